"""Fold batching: how the messages ready for the open exchange become the algorithm's inboxes.

A fold costs about a millisecond whatever it holds (measured: folding each message alone took 0.15 CPU-s a round of
the runtime benchmark's config in lockstep, batches 0.06), so what is ready is folded together: once FOLD_BATCH
distinct messages are ready, or once none is due any more. That also bounds what a worker holds decoded at once,
whatever its clients' degrees (DFCA's running average, eq. 8: O(k |theta|) per worker). One inbox holds the
messages of one round (a stale one is folded with its own round) and at most FOLD_BATCH distinct messages, each a
column delivered to every hosted row it reached; ragged payloads are folded one message at a time. An algorithm that
only keeps an exchange's arrivals until the exchange ends (`Algorithm.holds_arrivals`: a screened gossip step, which
holds them decoded whatever the batching) gets them in one inbox once nothing more is due (WHOLE), so it does not
copy the pieces into one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import torch

from dfca.algorithms import Algorithm, Exchange, Inbox
from dfca.runtime.driver.delivery import Delivery
from dfca.runtime.driver.driver_stats import DriverStats
from dfca.wire.codec import shape_of, stacked

# Distinct messages taken from the driver's queue and folded together (one inbox, one decode per message however many
# hosted clients it reaches): bounds what a worker holds decoded at once, whatever its clients' degrees.
FOLD_BATCH = 16
WHOLE = 1 << 62  # a batch never full: the exchange's arrivals folded together once none is due


class Ready:
    """The deliveries routed to the open exchange and not folded yet."""

    def __init__(self, batch: int = FOLD_BATCH) -> None:
        self.batch = batch
        self.deliveries: list[Delivery] = []
        self.messages: set[int] = set()  # id() of the distinct envelopes among them

    def add(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)
        self.messages.add(id(delivery.envelope))

    def full(self) -> bool:
        """As many distinct messages are ready as one fold takes."""
        return len(self.messages) >= self.batch

    def room(self) -> int:
        """How many more distinct messages one fold takes."""
        return self.batch - len(self.messages)

    def due(self, more_expected: bool) -> bool:
        """Fold now: the batch is full, or something is ready and nothing more is expected."""
        return bool(self.deliveries) and (self.full() or not more_expected)

    def take(self) -> list[Delivery]:
        """What is ready, no longer held here."""
        taken, self.deliveries, self.messages = self.deliveries, [], set()
        return taken


def fold_chunks(deliveries: list[Delivery], batch: int = FOLD_BATCH) -> Iterator[list[Delivery]]:
    """The deliveries in chunks to fold one at a time: per round they were sent in, up to `batch` distinct
    messages each, in arrival order."""
    by_round: dict[int, list[Delivery]] = {}
    for delivery in deliveries:
        by_round.setdefault(delivery.envelope.round, []).append(delivery)
    for group in by_round.values():
        distinct: set[int] = set()
        chunk: list[Delivery] = []
        for delivery in group:
            if id(delivery.envelope) not in distinct and len(distinct) == batch:
                yield chunk
                distinct, chunk = set(), []
            distinct.add(id(delivery.envelope))
            chunk.append(delivery)
        if chunk:
            yield chunk


def inboxes(chunk: list[Delivery], rows: int, device: torch.device) -> Iterator[tuple[list[Delivery], Inbox]]:
    """One inbox of a chunk, delivered[row, column] for each of its deliveries, a column per distinct message (grouped
    by the cluster or slot it carries, `part`, in arrival order within one: a cluster's models are then a view of the
    inbox's tensors), with the deliveries it holds; a chunk of ragged payloads gives one inbox per message."""
    envelopes = sorted({id(d.envelope): d.envelope for d in chunk}.values(), key=lambda e: e.part)
    shapes = {n: {shape_of(e.tensors, n) for e in envelopes} for n in envelopes[0].tensors}
    if len(envelopes) > 1 and any(len(s) > 1 for s in shapes.values()):
        for e in envelopes:
            yield from inboxes([d for d in chunk if d.envelope is e], rows, device)
        return
    columns = {id(e): column for column, e in enumerate(envelopes)}
    delivered = torch.zeros(rows, len(envelopes), dtype=torch.bool)
    delivered[[d.row for d in chunk], [columns[id(d.envelope)] for d in chunk]] = True
    tensors = {n: stacked([e.tensors for e in envelopes], n).to(device) for n in envelopes[0].tensors}
    yield chunk, Inbox(delivered.to(device), torch.tensor([e.sender for e in envelopes], device=device),
                       torch.tensor([e.part for e in envelopes], device=device), tensors, envelopes[0].round)


class Folder:
    """Hands deliveries to the algorithm an inbox at a time, then settles each (`settle`); counts in `stats` the
    (row, message) pairs the algorithm used or ignored, and the messages it refused."""

    def __init__(self, stats: DriverStats, settle: Callable[[Delivery], None]) -> None:
        self.stats, self.settle = stats, settle
        self.counted_refusals: Counter[str] = Counter()  # the algorithm's refusals already in stats.rejected

    def fold(self, deliveries: list[Delivery], algorithm: Algorithm, exchange: Exchange, rows: int,
             batch: int = FOLD_BATCH) -> None:
        """Fold `deliveries` into `exchange` of the algorithm hosting `rows` rows, `batch` distinct messages at a
        time."""
        for chunk in fold_chunks(deliveries, batch):
            for folded, inbox in inboxes(chunk, rows, algorithm.ctx.device):
                used = algorithm.receive(exchange, inbox)
                if algorithm.refused != self.counted_refusals:  # it refused some (a lying seed candidate)
                    self.stats.rejected.update(algorithm.refused - self.counted_refusals)
                    self.counted_refusals = algorithm.refused.copy()
                self.stats.applied += used
                self.stats.ignored += max(len(folded) - used, 0)
                for d in folded:
                    self.settle(d)
