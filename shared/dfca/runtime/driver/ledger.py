"""The ledger: where each message a driver admitted stands against the round's exchanges, and who is still due.

A message is known by its identity (receiver, sender, round, exchange, step, part) and its position (round,
index of its exchange in that round). Against the open exchange the ledger places it:
- DUPLICATE: its identity was used (or is held) already: a message is used at most once;
- HELD: it belongs to a later exchange: kept (each identity once) and released when that exchange opens;
- OPEN: it belongs to the open exchange: its sender is due one message fewer for its row;
- MERGED: it belongs to an earlier exchange (stale), the open one is the exchange of its name one round later,
  both take stale messages and `runtime.staleness` is merge: folded into the open exchange;
- DROPPED: any other stale message.
Waiting: per receiving row, the senders the open exchange still expects and how many messages of each; the
exchange's deadline is `wait` round timeouts after it opened (or after its first arrival, where the exchange
`needs_arrival`), on the clock the ledger is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Generic, TypeVar

from dfca.algorithms import Exchange

Identity = tuple[int, int, int, str, int, int]  # receiver, sender, round, exchange, step, part
T = TypeVar("T")


class Placement(Enum):
    """Where a message stands against the open exchange."""

    DUPLICATE = "duplicate"
    HELD = "held"
    OPEN = "open"
    MERGED = "merged"
    DROPPED = "dropped"


class Ledger(Generic[T]):
    """The ledger of one driver's side (`side`: "clients" or "server"): `staleness` is `runtime.staleness`, `now`
    the clock deadlines are read on. `T`: what is held for a later exchange (the driver's deliveries)."""

    def __init__(self, side: str, staleness: str, now: Callable[[], float]) -> None:
        self.side, self.staleness, self.now = side, staleness, now
        self.round, self.index = -1, -1
        self.open_exchange: Exchange | None = None
        self.seen: set[Identity] = set()  # used: a repeat of one of these is a duplicate
        self.held: list[T] = []  # messages of later exchanges, in arrival order
        self.held_ids: set[Identity] = set()
        self.waiting: list[dict[int, int]] = []  # per row: sender -> messages still due
        self.missed: set[int] = set()  # senders that missed an exchange of this round
        self.opened_at: float = 0.0
        self.first_arrival: float | None = None

    # -- the round and its exchanges --------------------------------------------------------------------------
    def begin_round(self, t: int) -> None:
        """Round t begins; no exchange of it is open yet."""
        self.round, self.index, self.open_exchange, self.missed = t, -1, None, set()

    def open(self, index: int, exchange: Exchange, expected: Sequence[dict[int, int]]) -> list[T]:
        """Open exchange `index` of the round, expecting `expected[row]` (sender -> messages) for each row. Returns
        the held messages, no longer held: the caller places them again (some may belong to this exchange)."""
        self.index, self.open_exchange = index, exchange
        self.waiting = [dict(e) for e in expected]
        self.opened_at, self.first_arrival = self.now(), None
        held, self.held = self.held, []
        self.held_ids.clear()
        return held

    def deadline(self, timeout: float) -> float | None:
        """When the open exchange closes unless everything due arrived (None: it waits for a first arrival)."""
        assert self.open_exchange is not None, "no exchange is open"
        start = self.first_arrival if self.open_exchange.needs_arrival else self.opened_at
        return None if start is None else start + self.open_exchange.wait * timeout

    def expired(self, timeout: float) -> bool:
        """The open exchange's deadline has passed."""
        deadline = self.deadline(timeout)
        return deadline is not None and self.now() >= deadline

    def due(self) -> bool:
        """Some row still expects a message."""
        return any(self.waiting)

    def close(self) -> set[int]:
        """Close the open exchange: the senders still due (they missed it), also added to `missed`."""
        missing = {sender for due in self.waiting for sender in due}
        self.missed |= missing
        return missing

    def forget(self, sender: int) -> None:
        """No row expects `sender` any more (it was cut off)."""
        for due in self.waiting:
            due.pop(sender, None)

    def end_round(self) -> None:
        """Identities of rounds before this one are forgotten: their messages are stale, never used again."""
        self.seen = {i for i in self.seen if i[2] >= self.round}

    # -- messages ---------------------------------------------------------------------------------------------
    def place(self, identity: Identity, row: int, index: int, exchange: Exchange, item: T) -> Placement:
        """Place the message `identity`, of exchange `index` (`exchange`) of its round, for row `row`; a HELD one
        is kept as `item`. Every placement but HELD and DUPLICATE marks the identity used."""
        if identity in self.seen:
            return Placement.DUPLICATE
        sender, here, now = identity[1], (identity[2], index), (self.round, self.index)
        if here > now:
            return self._hold(identity, item)
        self.seen.add(identity)  # a repeat arriving before the message is folded is a duplicate
        if here == now:
            self._arrived(row, sender)
            return Placement.OPEN
        return Placement.MERGED if self._mergeable(identity[2], exchange) else Placement.DROPPED

    def _hold(self, identity: Identity, item: T) -> Placement:
        if identity in self.held_ids:
            return Placement.DUPLICATE
        self.held_ids.add(identity)
        self.held.append(item)
        return Placement.HELD

    def _arrived(self, row: int, sender: int) -> None:
        due = self.waiting[row]
        if sender in due:
            due[sender] -= 1
            if due[sender] <= 0:
                del due[sender]
        if self.first_arrival is None:
            self.first_arrival = self.now()

    def _mergeable(self, claimed_round: int, exchange: Exchange) -> bool:
        """A stale message of `exchange` in `claimed_round` may be folded into the open exchange."""
        current = self.open_exchange
        return (exchange.stale_ok and self.staleness == "merge" and claimed_round == self.round - 1
                and current is not None and current.name == exchange.name and current.stale_ok
                and current.receiver == self.side)
