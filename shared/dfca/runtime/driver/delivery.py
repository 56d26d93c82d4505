"""What the message driver routes: a decoded message placed in its round's exchanges, and its deliveries to hosted
rows (one message reaches every hosted row whose client neighbours its sender, and is acknowledged once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dfca.algorithms import Exchange
from dfca.runtime.driver.ledger import Identity
from dfca.transport import Message
from dfca.wire.codec import Envelope


class Placed(NamedTuple):
    """A decoded message and the exchange of its round it belongs to (worked out once, when it is decoded)."""

    envelope: Envelope
    index: int  # of the exchange in its round's exchanges
    exchange: Exchange


@dataclass(eq=False)
class Unsettled:
    """One message handed to several hosted rows: it is acknowledged when the last of them is done with it (None:
    delivered locally, nothing to acknowledge)."""

    message: Message | None
    rows: int
    repeat_counted: bool = False  # a repeat counts once against its sender, however many rows it reached

    def first_repeat(self) -> bool:
        """A repeat of the message: True the first time only (it counts once against its sender)."""
        first, self.repeat_counted = not self.repeat_counted, True
        return first

    def settle(self) -> Message | None:
        """One row is done with the message: the message to acknowledge now that the last one is, else None."""
        self.rows -= 1
        return self.message if self.rows == 0 else None


@dataclass
class Delivery:
    """Message `placed` for hosted row `row` (`message` None: a hosted client's message, delivered locally)."""

    row: int
    message: Message | None
    placed: Placed
    fanout: Unsettled

    @property
    def envelope(self) -> Envelope:
        return self.placed.envelope

    def identity(self, receiver: int) -> Identity:
        """The message's identity for `receiver`, the client of row `row`."""
        e = self.placed.envelope
        return (receiver, e.sender, e.round, e.exchange, e.step, e.part)
