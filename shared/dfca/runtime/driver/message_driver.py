"""Driver 2, the message driver: one side of an algorithm (dfca.algorithms, unchanged), for the rows it hosts.

The pump between the algorithm and a Transport. Its parts, each beside it in runtime/driver/:
- bindings (its queue and what is bound to it), outbox (an exchange's messages encoded), decoding (what arrived);
- hearing (who hears whom), admission (the sender's host, cut-off, future rounds), ledger (dedupe, hold, staleness,
  waiting, deadlines);
- folding (inboxes handed to the algorithm), liveness, checkpoints, driver_stats (where a round's time goes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dfca.algorithms import Algorithm, Exchange
from dfca.algorithms.base import SERVER, Graph, report_of
from dfca.identity import topics
from dfca.runtime.driver.admission import Admission, Refusal, Screening, identity_of
from dfca.runtime.driver.bindings import QueueBindings
from dfca.runtime.driver.checkpoints import Checkpoint, driver_checkpoint, read_driver_checkpoint
from dfca.runtime.driver.decoding import decode_placed
from dfca.runtime.driver.delivery import Delivery, Placed, Unsettled
from dfca.runtime.driver.driver_stats import DriverStats, RejectionLog
from dfca.runtime.driver.folding import FOLD_BATCH, WHOLE, Folder, Ready
from dfca.runtime.driver.hearing import Hearing
from dfca.runtime.driver.host_transport import REPUBLISHED_HEADER, RunInterrupted
from dfca.runtime.driver.ledger import Ledger, Placement
from dfca.runtime.driver.liveness import NeighbourLiveness
from dfca.runtime.driver.outbox import encode_outbox
from dfca.transport import Message, Transport
from dfca.wire.codec import CHECKSUM, PAYLOAD_DTYPES, PayloadRejected, checksum

log = logging.getLogger(__name__)
KEEP_GOING_EVERY_S = 0.25  # how often a waiting driver asks whether to go on


class MessageDriver:
    def __init__(self, algorithm: Algorithm, experiment: str, transport: Transport,
                 keep_going: Callable[[], bool] | None = None, workers: int = 1, queue: str | None = None,
                 confirm_later: bool = False, binds_queue: bool = True, hosts: Sequence[int] | None = None) -> None:
        """`workers`: how many workers share the experiment's clients (client c on worker c % workers, unless `hosts`
        gives each client's worker: workers that hold their own data). `queue`: the
        driver's queue, by default its worker's (topics.worker_queue) or the central role's; lockstep setups whose
        drivers do not split the clients as c % workers name one each. `confirm_later`: a round ends without
        awaiting its messages' confirms; `take_confirmation` gives what awaits them (a worker's checkpoint writer
        calls it before the round's checkpoint is written). `binds_queue`: the driver declares and binds its queue
        itself; False where its broker user may not and the topology service does (runtime.driver.bindings)."""
        self.algorithm, self.transport, self.keep_going = algorithm, transport, keep_going
        self.confirm_later = confirm_later
        self.unconfirmed: Callable[[], None] | None = None  # the last round's confirms, under confirm_later
        self.experiment = topics.check_word(experiment, "experiment id")
        self.cfg, self.schedule, self.side = algorithm.ctx.cfg, algorithm.schedule, algorithm.side
        self.ids = list(algorithm.ctx.clients)
        self.admission = Admission(workers, transport.user, self.ids if self.side == "clients" else (), hosts=hosts)
        self.hearing = Hearing(self.ids, self.side, self.cfg.data.clients, lambda: self.algorithm.ctx.graph,
                               self.admission.blocked)
        self.ledger: Ledger[Delivery] = Ledger(self.side, self.cfg.runtime.staleness, time.monotonic)
        self.queue = queue or (topics.server_queue(experiment) if self.side == "server"
                               else topics.worker_queue(experiment, self.admission.host_of(self.ids[0])))
        self.bindings = QueueBindings(transport, self.queue, self.experiment, binds_queue)
        self.model_dtype = PAYLOAD_DTYPES[self.cfg.runtime.payload_dtype]
        self.round, self.index, self.rounds_done = -1, -1, 0
        self.exchanges: list[Exchange] = []
        self.ready = Ready()  # routed to the open exchange, to be folded together
        self.batch: list[Delivery] = []  # the open exchange's messages, under `aggregation: batch`
        self.dead: set[int] = set()  # presumed dead at the start of this round
        self.liveness = NeighbourLiveness()
        self.stats = DriverStats()
        self.rejections = RejectionLog(log)
        self.folder = Folder(self.stats, self._settle)
        self.bytes_sent = 0  # what the hosted clients sent (wire.message_bytes) since `take_bytes_sent`, per receiver
        self._next_check = 0.0

    @property
    def blocked(self) -> set[int]:
        """Senders cut off (runtime.driver.admission): unbound from the driver's queue, waited for by nobody."""
        return self.admission.blocked

    @property
    def neighbours(self) -> dict[int, list[int]]:
        """The hosted clients' current neighbours."""
        return {c: sorted(self.algorithm.ctx.graph.get(c, ())) for c in self.ids}

    def heard(self, graph: Graph | None = None) -> set[int]:
        """Every sender hosted elsewhere that a hosted client neighbours: the keys the driver's queue is bound to."""
        return self.hearing.heard(graph)

    # -- wiring -----------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Declare the exchanges and the driver's queue, and bind it to whom the algorithm hears."""
        self.bindings.declare(self.side, self.algorithm.links, self.heard(), self.cfg.data.clients)

    def set_graph(self, graph: Graph) -> None:
        """A topology change (the whole new graph): rebind the driver's queue, tell the algorithm."""
        if "neighbours" in self.algorithm.links and self.side == "clients":
            self.bindings.rebind(self.heard(), self.heard(graph), self.blocked)
        self.algorithm.set_graph({int(c): [int(m) for m in ms] for c, ms in graph.items()})
        self.hearing.index()

    # -- a round --------------------------------------------------------------------------------------------
    def run_round(self, t: int, timeout: float) -> bool:
        """Round t: every exchange published, collected and closed. True when no exchange timed out."""
        self.begin_round(t)
        complete = True
        for index in range(len(self.exchanges)):
            self.start_exchange(index)
            complete &= self.collect(timeout)
            self.end_exchange()
        self.end_round()
        return complete

    def begin_round(self, t: int) -> None:
        """Round t: who is presumed dead, its exchanges, local training."""
        self.round, self.index = t, -1
        self.ledger.begin_round(t)
        self.admission.begin_round()
        self.rejections.begin_round()
        if revived := self.liveness.revive(self.liveness.sightings, t - 1):
            log.info("round %d: %s heard from again", t, revived)
        self.dead = self.liveness.dead
        self.exchanges = self.algorithm.exchanges(t)
        with self.stats.timed("train"):
            self.algorithm.begin_round(t)

    def start_exchange(self, index: int) -> None:
        """Open exchange `index` of the round: publish this side's messages, then take the held ones of it."""
        self.index = index
        ex = self.exchanges[index]
        held = self.ledger.open(index, ex, self.hearing.due(ex, self.dead))
        self.batch = []
        self.ready.batch = WHOLE if self.algorithm.holds_arrivals(ex) else FOLD_BATCH
        if ex.sender == self.side:
            with self.stats.timed("publish"):
                self.publish(ex)  # before anything arrived is folded in: what the row sends is its own
        with self.stats.timed("receive"):
            for delivery in held:
                if delivery.envelope.sender in self.blocked:  # held before its sender was cut off
                    self._settle(delivery)
                else:
                    self._route(delivery)
            if self.ready.due(more_expected=self.ledger.due()):
                self._fold()

    def take_bytes_sent(self) -> int:
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    def publish(self, ex: Exchange) -> None:
        """Every hosted row's message of `ex`, one publish each (the broker fans it out), handed over together; the
        hosted rows that hear a hosted row get its message in the process."""
        outbox = encode_outbox(self.algorithm, ex, self.index, self.round, self.experiment, self.model_dtype,
                               self.hearing, self.admission.host_of)
        self.transport.publish_pipelined(outbox.messages)  # confirmed by the end of the round
        self.stats.published += len(outbox.messages)
        self.bytes_sent += outbox.sent
        for placed, hearing in outbox.local:
            fanout = Unsettled(None, len(hearing))
            for row in hearing:
                self._route(Delivery(row, None, placed, fanout))

    def collect(self, timeout: float) -> bool:
        """Receive the open exchange's messages until none is due or its deadline passes. True if none is missing."""
        ex = self.exchanges[self.index]
        with self.stats.waiting():
            while self.ledger.due() and self._receive_some(timeout):
                pass
            with self.stats.timed("receive"):
                self._fold()
            if missing := self.ledger.close():
                self.stats.timeouts += 1
                log.warning("round %d %s %d: timed out waiting for %s", self.round, ex.name, ex.step, sorted(missing))
            with self.stats.timed("receive"):
                self._fold(sorted(self.batch, key=lambda d: (d.envelope.sender, d.row)))
            self.batch = []
        return not missing

    def _receive_some(self, timeout: float) -> bool:
        """Take what waits in the queue, else wait a little for a message; False once the deadline has passed."""
        if arrived := self._arrived():
            self._take(arrived)
            return True
        deadline, now = self.ledger.deadline(timeout), self.ledger.now()
        if deadline is not None and now >= deadline:
            return False
        if self.keep_going is not None and now >= self._next_check:
            self._next_check = now + KEEP_GOING_EVERY_S
            if not self.keep_going():
                raise RunInterrupted
        wait = 0.05 if deadline is None else min(0.05, deadline - now)
        if (message := self.transport.receive(self.queue, wait)) is not None:
            self._take(self._arrived(message))  # woken by the first arrival: decoded with what came in with it
        return True

    def end_exchange(self) -> None:
        with self.stats.timed("mix"):
            self.algorithm.end_exchange(self.exchanges[self.index])

    def end_round(self) -> None:
        with self.stats.timed("publish"):  # the round's messages are on the broker before it counts as done
            if self.confirm_later:
                self.unconfirmed = self.transport.confirmation()
            else:
                self.transport.await_confirms()
        with self.stats.timed("mix"):
            self.algorithm.end_round(self.round)
        self.stats.screened = self.algorithm.screened
        self.rejections.end_round(self.round)
        expected = self.hearing.expected(self.exchanges) - {SERVER}  # a central role is never presumed dead
        self.liveness.observe_round(expected - self.dead, self.ledger.missed - {SERVER})
        self.rounds_done = self.round + 1
        self.ledger.end_round()
        self.admission.end_round(self.round)

    # -- messages -------------------------------------------------------------------------------------------
    def _arrived(self, first: Message | None = None) -> list[Message]:
        """What waits in the driver's queue, without blocking, up to FOLD_BATCH messages (`first`, one taken already,
        among them): messages decoded together cost about half as much each as one at a time."""
        arrived = [] if first is None else [first]
        while len(arrived) < FOLD_BATCH and (message := self.transport.receive(self.queue, 0.0)) is not None:
            arrived.append(message)
        return arrived

    def handle(self, message: Message) -> None:
        """handle_many of one message."""
        self.handle_many([message])

    def handle_many(self, arrived: list[Message]) -> None:
        """Check messages delivered to the driver's queue, then fold (together), hold, drop or reject each for the
        hosted rows that hear its sender. Copies of one message (a repeat) are decoded once."""
        self._take(arrived)
        with self.stats.timed("receive"):
            self._fold()

    def _take(self, arrived: list[Message]) -> None:
        """handle_many, but what is ready for the open exchange is folded when due: at most one fold's worth of
        distinct messages is held decoded for it at once, those being decoded (together) included."""
        self.stats.delivered += len(arrived)
        with self.stats.timed("receive"):
            pending = arrived
            while pending:
                if self.ready.full():
                    self._fold()
                room = self.ready.room()
                batch, pending = [m for m in pending[:room] if self._screen(m)], pending[room:]
                for message, decoded in zip(batch, self._decode(batch), strict=True):
                    self._handle(message, decoded)
            if self.ready.due(more_expected=self.ledger.due()):
                self._fold()

    def _decode(self, messages: list[Message]) -> list[Placed | PayloadRejected]:
        """Decoded together and placed in their rounds' exchanges (runtime.driver.decoding), copies of a message
        once."""
        return decode_placed(messages, self.experiment, self.algorithm, self.round, self.exchanges)

    def _screen(self, message: Message) -> bool:
        """What is settled before decoding (runtime.driver.admission). True: the message is to be decoded."""
        verdict = self.admission.screen(message.routing_key, message.publisher)
        if verdict is Screening.LOCAL_COPY:
            self.stats.not_neighbour += 1  # a copy of what was delivered locally (a binding made for another driver)
            self.transport.ack(message)
        elif isinstance(verdict, Refusal):
            self._reject(message, verdict.reason, verdict.detail)
        return verdict is Screening.DECODE

    def _handle(self, message: Message, decoded: Placed | PayloadRejected) -> None:
        if isinstance(decoded, PayloadRejected):
            self._reject(message, decoded.reason, decoded)
            self._count_invalid(message)
            return
        envelope = decoded.envelope
        rows = self.hearing.rows(envelope.sender, decoded.exchange)
        if envelope.sender in self.blocked:  # refused, not acknowledged: a worker's acks wait for the round's
            # checkpoint, and a cut-off sender's flood, queued before it was cut off, would fill the prefetch window
            # with them until the round's end, and hold back every honest message queued behind it
            self._reject(message, "cut_off", f"client {envelope.sender} is cut off")
        elif not rows:
            self.stats.not_neighbour += 1
            self.transport.ack(message)
        elif (refusal := self.admission.admit_round(envelope.sender, envelope.round, self.round)) is not None:
            self._reject(message, refusal.reason, refusal.detail)
        elif (refusal := self.admission.equivocation(
                identity_of(envelope), message.headers.get(CHECKSUM) or checksum(message.body))) is not None:
            self._reject(message, refusal.reason, refusal.detail)
            if self.admission.proven and envelope.sender not in self.blocked:
                self.block(envelope.sender, "sent two different bodies for one message")
        else:
            self.liveness.sighted(envelope.sender, envelope.round)  # only what was let in shows a sender's progress
            fanout = Unsettled(message, len(rows))
            for row in rows:
                self._route(Delivery(row, message, decoded, fanout))

    def _reject(self, message: Message, reason: str, detail: object) -> None:
        """Dead-letter a message, count it under `reason` and log why (`detail`; a few a round)."""
        self.stats.rejected[reason] += 1
        self.rejections.warn("rejected message %s for %s: %s", message.routing_key, self.queue, detail)
        self.transport.reject(message, requeue=False)

    def _settle(self, delivery: Delivery) -> None:
        """Row `delivery.row` is done with its message; the message is acknowledged once every row it reached is."""
        if (message := delivery.fanout.settle()) is not None:
            self.transport.ack(message)

    def _count_invalid(self, message: Message) -> None:
        """Count a malformed message, or a repeat, against its sender; cut the sender off when admission says so."""
        if (sender := self.admission.count_invalid(message.routing_key, message.redelivered)) is not None:
            self.block(sender)

    def block(self, sender: int, why: str = "") -> None:
        """Cut `sender` off: unbind its keys from the driver's queue and stop waiting for it."""
        self.blocked.add(sender)
        self.stats.blocked += 1
        self.bindings.hear(sender, False)
        self.hearing.index()
        self.ledger.forget(sender)
        why = why or f"sent {self.admission.invalid[sender]} malformed or repeated messages"
        log.warning("round %d: client %d (host %s) %s: cut off for the rest of the run", self.round, sender,
                    self.admission.host_of(sender), why)

    def _route(self, delivery: Delivery) -> None:
        """Place a delivery in the ledger, and fold, hold, settle or count it as placed."""
        placed = delivery.placed
        placement = self.ledger.place(delivery.identity(self.ids[delivery.row]), delivery.row, placed.index,
                                      placed.exchange, delivery)
        if placement is Placement.DUPLICATE:
            self.stats.duplicates += 1
            self._settle(delivery)
            if delivery.message is not None and delivery.fanout.first_repeat() and not self._resent(delivery):
                self._count_invalid(delivery.message)
        elif placement is Placement.OPEN and self.cfg.aggregation == "batch" and placed.exchange.averaged:
            self.batch.append(delivery)
        elif placement in (Placement.OPEN, Placement.MERGED):
            self.stats.stale_merged += placement is Placement.MERGED
            self.ready.add(delivery)
        elif placement is Placement.DROPPED:
            self.stats.stale_dropped += 1
            self._settle(delivery)

    def _resent(self, delivery: Delivery) -> bool:
        """A repeat its sender's host published again after a new connection (HostTransport), let off once."""
        assert delivery.message is not None
        return (REPUBLISHED_HEADER in delivery.message.headers
                and self.admission.resent(identity_of(delivery.placed.envelope)))

    def _fold(self, deliveries: list[Delivery] | None = None) -> None:
        """Fold `deliveries`, by default what is ready (runtime.driver.folding)."""
        deliveries = self.ready.take() if deliveries is None else deliveries
        self.folder.fold(deliveries, self.algorithm, self.exchanges[self.index], len(self.ids), self.ready.batch)

    # -- reports and checkpoints ----------------------------------------------------------------------------
    def report(self) -> dict[str, list[Any]]:
        """The hosted clients' evaluation, as a round report carries it."""
        return report_of(self.algorithm.evaluate(), self.ids, self.algorithm.data().true_cluster)

    def take_confirmation(self) -> Callable[[], None]:
        """Under confirm_later, what awaits the confirms of the last round's messages (to be called before its
        checkpoint is written: a worker that resumed from it never sends them again); else nothing to await."""
        unconfirmed, self.unconfirmed = self.unconfirmed, None
        return unconfirmed or self.transport.confirmation()

    def checkpoint(self) -> Checkpoint:
        """The hosted rows' state after the last round, copied, with the identities used in it
        (runtime.driver.checkpoints)."""
        return driver_checkpoint(self.algorithm.state(), self.round, self.experiment, self.ids, self.ledger.seen)

    def save_checkpoint(self, path: Path) -> None:
        """The hosted rows' state after the last round, as safetensors; written atomically."""
        self.checkpoint().write(path)

    def load_checkpoint(self, path: Path) -> int:
        """Restore the state; returns the last completed round (the next round is that + 1)."""
        restored = read_driver_checkpoint(path, self.experiment, self.ids)
        self.algorithm.load_state(restored.tensors)
        self.ledger.seen = restored.seen
        self.round = restored.round
        self.rounds_done = self.round + 1
        return self.round
