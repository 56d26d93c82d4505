"""A message driver's queue and its bindings: the broker delivers to the queue only what its hosted rows hear.

A worker's queue is bound to the keys of every neighbour of a hosted client that is hosted elsewhere, and/or the
server's (the algorithm's `links`); the central role's queue to every client's keys. The broker delivers each
message to a queue once, however many of its hosted rows hear the sender.

Where the driver's broker user may not bind (a worker's own user under per-principal users:
dfca.identity.broker_users), the topology service declares and binds the queue (runtime.control.coordinator) and
the driver only consumes it: `managed` is False, and declaring, binding and unbinding here do nothing. A sender cut
off is then refused by the driver (runtime.driver.admission) rather than unbound.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from dfca.identity import topics
from dfca.identity.broker_setup import ensure_broker_topology
from dfca.transport import Transport


class QueueBindings:
    """The bindings of `queue`, the queue of a driver of `experiment`, on `transport`."""

    def __init__(self, transport: Transport, queue: str, experiment: str, managed: bool = True) -> None:
        self.transport, self.queue, self.experiment, self.managed = transport, queue, experiment, managed

    def declare(self, side: str, links: Collection[str], heard: Iterable[int], clients: int) -> None:
        """Declare the exchanges and the queue, and bind it to whom the algorithm hears (`heard`; the central role:
        all `clients`)."""
        if not self.managed:
            return
        ensure_broker_topology(self.transport)
        self.transport.declare_queue(self.queue, topics.DEAD_LETTER_EXCHANGE, topics.MODEL_QUEUE_LIMITS)
        if side == "server":
            uploads = topics.server_queue(self.experiment)
            for c in range(clients):
                self.transport.bind(uploads, topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, c))
            return
        for key in topics.inbox_binding_keys(self.experiment, heard if "neighbours" in links else (),
                                             "server" in links):
            self.transport.bind(self.queue, topics.MODELS_EXCHANGE, key)
        # The server's queue, where uploads wait until the central role has started, is the topology service's
        # to declare at :start (Coordinator._declare_server_queue) and the central role's own.

    def hear(self, sender: int, bound: bool) -> None:
        """Bind (or unbind) `sender`'s keys to (from) the queue."""
        if not self.managed:
            return
        (self.transport.bind if bound else self.transport.unbind)(
            self.queue, topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, sender))

    def rebind(self, old: set[int], new: set[int], blocked: Collection[int]) -> None:
        """The senders heard change from `old` to `new` (a blocked sender is not bound again)."""
        for m in sorted(old - new):
            self.hear(m, False)
        for m in sorted(new - old - set(blocked)):
            self.hear(m, True)
