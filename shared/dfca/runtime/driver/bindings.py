"""A message driver's queue and its bindings: the broker delivers to the queue only what its hosted rows hear.

A worker's queue is bound to the keys of every neighbour of a hosted client that is hosted elsewhere, and/or the
server's (the algorithm's `links`); the central role's queue to every client's keys. The broker delivers each
message to a queue once, however many of its hosted rows hear the sender.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from dfca.identity import topics
from dfca.identity.broker_setup import ensure_broker_topology
from dfca.transport import Transport


class QueueBindings:
    """The bindings of `queue`, the queue of a driver of `experiment`, on `transport`."""

    def __init__(self, transport: Transport, queue: str, experiment: str) -> None:
        self.transport, self.queue, self.experiment = transport, queue, experiment

    def declare(self, side: str, links: Collection[str], heard: Iterable[int], clients: int) -> None:
        """Declare the exchanges and the queue, and bind it to whom the algorithm hears (`heard`; the central role:
        all `clients`)."""
        ensure_broker_topology(self.transport)
        self.transport.declare_queue(self.queue, topics.DEAD_LETTER_EXCHANGE, topics.MODEL_QUEUE_LIMITS)
        if side == "server":
            uploads = topics.server_queue(self.experiment)
            for c in range(clients):
                self.transport.bind(uploads, topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, c))
            return
        if "neighbours" in links:
            for m in sorted(heard):
                self.hear(m, True)
        if "server" in links:
            self.transport.bind(self.queue, topics.MODELS_EXCHANGE, topics.server_binding(self.experiment))
        # The server's queue, where uploads wait until the central role has started, is the topology service's
        # to declare at :start (Coordinator._declare_server_queue) and the central role's own.

    def hear(self, sender: int, bound: bool) -> None:
        """Bind (or unbind) `sender`'s keys to (from) the queue."""
        (self.transport.bind if bound else self.transport.unbind)(
            self.queue, topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, sender))

    def rebind(self, old: set[int], new: set[int], blocked: Collection[int]) -> None:
        """The senders heard change from `old` to `new` (a blocked sender is not bound again)."""
        for m in sorted(old - new):
            self.hear(m, False)
        for m in sorted(new - old - set(blocked)):
            self.hear(m, True)
