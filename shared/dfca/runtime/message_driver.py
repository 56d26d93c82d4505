"""Driver 2, the message driver: one side of an algorithm, for the rows it hosts, over a Transport.

It runs the simulator's algorithm objects (dfca.algorithms) unchanged and owns everything around them:
- queues: one per driver (a worker's, topics.worker_queue), bound to the keys of every neighbour of a hosted client
  that is hosted elsewhere, and/or the server's (the algorithm's `links`); the broker delivers each message to a
  worker once, and the driver hands it to every hosted row whose client neighbours the sender (a fan-out the driver
  settles with one ack); a central role has one queue, bound to every client's keys;
- local delivery: a hosted client's message to hosted neighbours does not leave the process: the driver hands them
  its values as the wire delivers them (encode_message's `received`: what decoding the published copy gives, from
  the codes just computed), so no broker delivery, decode or ack is spent on it; a copy that arrives from the
  broker under a hosted sender's key is dropped;
- each exchange of a round: publish every hosted row's message, collect until every expected sender's
  messages arrived or the deadline passed (`runtime.round_timeout` x the exchange's `wait`; counted from
  the first arrival where the exchange `needs_arrival`), close it;
- one decoder (dfca.wire.decode_message's checks; dfca.wire_batches.decode_messages applies them to what arrived
  together): routing key against headers, experiment, an exchange that the message's round has, payload names,
  shapes and values; a bad message is dead-lettered and counted; an outbox is encoded together too
  (dfca.wire_batches.encode_rows: the bytes of one message at a time);
- the sender's host: the routing key must name the principal hosting the sender (client c on worker
  c % workers, a central role on the aggregator) and, where the driver's own broker user is a principal's,
  the broker-proven publisher must be that principal (dfca.principals), else `publisher` is counted;
- cut-off: where publishers are proven, a sender whose host sent BLOCK_AFTER_INVALID malformed messages, or as many
  repeats of messages already used (a flood of well-formed copies; the broker's own redeliveries do not count),
  under its key in one round is unbound from the driver's queue for the rest of the run and no longer waited for
  (`blocked`): the broker stops delivering what it sends;
- dedupe: a message is used at most once per (receiver, sender, round, exchange, step, part);
- order: a message of a later exchange is held (unacknowledged, each identity once) until its exchange opens;
  one more than MAX_ROUNDS_AHEAD rounds ahead of the receiver is rejected and counted (`future_round`),
  so forged rounds cannot pile up in memory. Messages of the open exchange are folded as they arrive
  (`aggregation: sequential`: DFCA's running average, eq. 8): what has arrived at the driver's queue is taken
  together, each message decoded once however many hosted clients it reaches, and folded as one inbox once
  FOLD_BATCH distinct messages are ready or none is due any more (messages that trickle in wait for the next
  ones: a fold's cost is mostly fixed), so a worker holds O(k |theta|) however many neighbours its clients have;
  in an exchange whose
  messages are averaged, they are held and folded in sender order when the exchange closes (`batch`, eq. 7).
  One of an earlier exchange is stale:
  folded into the open exchange one round later if that exchange has its name and takes stale messages
  and `runtime.staleness` is merge, else dropped;
- liveness (runtime.liveness): a client that missed its messages in consecutive rounds is presumed dead and
  not waited for, until a message of the round before or later comes from it again;
- checkpoints: the algorithm's state, with the round, the hosted ids and the dedupe set of the last round (so a
  message redelivered after a crash is a duplicate, not merged twice), as safetensors, written atomically.
  Acknowledgements are the transport's business: a worker's HostTransport defers them until the
  checkpoint that covers them is on disk.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dfca import principals, topics
from dfca.algorithms import Algorithm, Exchange, Inbox
from dfca.algorithms.base import SERVER, Graph, check_finite, report_of
from dfca.runtime.checkpoints import Checkpoint
from dfca.runtime.host_transport import RunInterrupted
from dfca.runtime.liveness import NeighbourLiveness
from dfca.transport import Message, Transport
from dfca.transport.broker_setup import ensure_broker_topology
from dfca.wire import PAYLOAD_DTYPES, Envelope, PayloadRejected, Spec, message_bytes, shape_of, stacked
from dfca.wire_batches import decode_messages, encode_rows

log = logging.getLogger(__name__)
# A live neighbour is a round or two ahead at most (it waits for this client's messages, or a deadline, in every
# exchange), but one that presumed this client dead (a restarted worker) runs on: its messages are held for when
# this client catches up. Beyond this many rounds a message is rejected and counted (`future_round`): forged rounds
# cannot pile up. (Measured: at 3, a worker restarted at round 4 recovered by timeouts only and its run took more
# than 5 minutes instead of 1.5.)
MAX_ROUNDS_AHEAD = 20

KEEP_GOING_EVERY_S = 0.25  # how often a waiting driver asks whether to go on
# Malformed messages from one proven sender in one round after which it is cut off. An honest client sends a few
# valid messages per round and never a malformed one; a flood sends thousands.
BLOCK_AFTER_INVALID = 20
# Distinct messages taken from the driver's queue and folded together (one inbox, one decode per message however many
# hosted clients it reaches): bounds what a worker holds decoded at once, whatever its clients' degrees.
FOLD_BATCH = 16
# Warnings about rejected messages logged per round; the rest are counted (DriverStats.rejected) and summed up in one
# line at the round's end, so a flood of junk cannot flood the logs (or spend a worker's time writing them).
LOGGED_REJECTIONS_PER_ROUND = 10
Identity = tuple[int, int, int, str, int, int]  # receiver, sender, round, exchange, step, part
# Where a round's time goes (DriverStats.seconds, cumulative): train = the algorithm's begin_round (assignment and
# local training); publish = send, encode and publish, and at the round's end awaiting the publisher confirms that
# have not come yet (an exchange's messages are handed over without waiting for them); receive = checking, decoding
# and folding what arrived; wait = the rest of collecting (nothing to do: waiting on neighbours or the broker);
# mix = end_exchange and end_round (a gossip step's mixing, the losses for the next assignment); checkpoint = what a
# worker's round loop spends on the round's checkpoint (copying the state, waiting for the write before; the runner's).
# DriverStats.cpu_seconds: the same phases' CPU time of the thread that runs them (the round loop's), and `loop`: that
# thread's CPU time over whole rounds (what it spends beyond the phases: the runner's round reports and controls).
PHASES = ("train", "publish", "receive", "wait", "mix", "checkpoint")


@dataclass
class DriverStats:
    published: int = 0
    applied: int = 0  # (receiver, message) pairs the algorithm used
    ignored: int = 0  # delivered, but of no use to the algorithm (FedSPD: another cluster)
    duplicates: int = 0
    stale_dropped: int = 0
    stale_merged: int = 0
    not_neighbour: int = 0
    timeouts: int = 0  # exchanges closed by their deadline
    screened: int = 0  # (gossip arrival, cluster) pairs screened gossip dropped
    blocked: int = 0  # senders cut off for flooding malformed messages
    rejected: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # per phase, see PHASES
    cpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((*PHASES, "loop"), 0.0))

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("rejected", "seconds", "cpu_seconds")}
        out["rejected"] = dict(self.rejected)
        out["seconds"] = dict(self.seconds)
        out["cpu_seconds"] = dict(self.cpu_seconds)
        out["rejected_total"] = sum(self.rejected.values())
        return out


@dataclass(eq=False)
class Unsettled:
    """One message handed to several hosted rows: it is acknowledged when the last of them is done with it (None:
    delivered locally, nothing to acknowledge)."""

    message: Message | None
    rows: int
    repeat_counted: bool = False  # a repeat counts once against its sender, however many rows it reached


@dataclass
class Delivery:
    row: int
    message: Message | None  # None: a hosted client's message, delivered locally
    envelope: Envelope
    fanout: Unsettled


def model_key_of(message: Message) -> topics.ModelKey | None:
    """The message's routing key parsed (topics.parse_model_key), None where it is malformed."""
    try:
        return topics.parse_model_key(message.routing_key)
    except ValueError:
        return None


class MessageDriver:
    def __init__(self, algorithm: Algorithm, experiment: str, transport: Transport,
                 keep_going: Callable[[], bool] | None = None, workers: int = 1, queue: str | None = None,
                 confirm_later: bool = False) -> None:
        """`workers`: how many workers share the experiment's clients (client c on worker c % workers). `queue`: the
        driver's queue, by default its worker's (topics.worker_queue) or the central role's; lockstep setups whose
        drivers do not split the clients as c % workers name one each. `confirm_later`: a round ends without
        awaiting its messages' confirms; `take_confirmation` gives what awaits them (a worker's checkpoint writer
        calls it before the round's checkpoint is written)."""
        self.algorithm, self.transport, self.keep_going = algorithm, transport, keep_going
        self.confirm_later = confirm_later
        self.unconfirmed: Callable[[], None] | None = None  # the last round's confirms, under confirm_later
        self.experiment = topics.check_word(experiment, "experiment id")
        ctx = algorithm.ctx
        self.cfg, self.schedule, self.side = ctx.cfg, algorithm.schedule, algorithm.side
        self.workers = workers
        self.publishers = principals.PublisherCheck(transport.user)
        self.ids = list(ctx.clients)
        self.hosted = set(self.ids) if self.side == "clients" else set()  # their messages are delivered locally
        self.queue = queue or (topics.server_queue(experiment) if self.side == "server"
                               else topics.worker_queue(experiment, self.host_of(self.ids[0])))
        self.model_dtype = PAYLOAD_DTYPES[self.cfg.runtime.payload_dtype]
        self.round, self.index, self.rounds_done = -1, -1, 0
        self.exchanges: list[Exchange] = []
        self.held: list[Delivery] = []  # messages of later exchanges
        self.held_ids: set[Identity] = set()
        self.batch: list[Delivery] = []  # the open exchange's messages, under `aggregation: batch`
        self.ready: list[Delivery] = []  # routed to the open exchange, to be folded together (_fold_ready)
        self.ready_messages: set[int] = set()  # id() of the distinct envelopes in `ready`
        self.seen: set[Identity] = set()
        self.waiting: list[dict[int, int]] = [{} for _ in self.ids]  # per row: sender -> messages still due
        self.missed: set[int] = set()  # senders that missed an exchange of this round
        self.dead: set[int] = set()  # presumed dead at the start of this round
        self.sightings: dict[int, int] = {}  # sender -> the latest round heard from it
        self.invalid: Counter[int] = Counter()  # sender -> malformed messages under its key this round
        self.blocked: set[int] = set()  # senders cut off: unbound from the driver's queue
        self.hearing: dict[int, list[int]] = {}  # sender -> the hosted rows whose client neighbours it (_index_graph)
        self.liveness = NeighbourLiveness()
        self.stats = DriverStats()
        self.counted_refusals: Counter[str] = Counter()  # the algorithm's refusals already in stats.rejected
        self.bytes_sent = 0  # what the hosted clients sent (wire.message_bytes) since `take_bytes_sent`, per receiver
        self.opened_at, self.first_arrival = 0.0, None  # of the open exchange
        self._next_check = 0.0
        self.unlogged = 0  # rejections this round past LOGGED_REJECTIONS_PER_ROUND
        self.logged = 0
        self._index_graph()

    def host_of(self, sender: int) -> str:
        """The principal hosting `sender`."""
        return principals.AGGREGATOR if sender == SERVER else principals.host_of(sender, self.workers)

    @property
    def neighbours(self) -> dict[int, list[int]]:
        """The hosted clients' current neighbours."""
        return {c: sorted(self.algorithm.ctx.graph.get(c, ())) for c in self.ids}

    def heard(self, graph: Graph | None = None) -> set[int]:
        """Every sender hosted elsewhere that a hosted client neighbours: the keys the driver's queue is bound to."""
        graph = self.algorithm.ctx.graph if graph is None else graph
        return {m for c in self.ids for m in graph.get(c, ())} - self.hosted

    def _index_graph(self) -> None:
        """sender -> the hosted rows that hear it, for the fan-out of what arrives (blocked senders heard by none)."""
        self.hearing = {}
        for row, client in enumerate(self.ids):
            for m in self.algorithm.ctx.graph.get(client, ()):
                if m not in self.blocked:
                    self.hearing.setdefault(m, []).append(row)

    # -- wiring -----------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Declare the exchanges and the driver's queue, and bind it to whom the algorithm hears."""
        ensure_broker_topology(self.transport)
        self.transport.declare_queue(self.queue, topics.DEAD_LETTER_EXCHANGE, topics.MODEL_QUEUE_LIMITS)
        if self.side == "server":
            self._bind_uploads(range(self.cfg.data.clients))
            return
        links = self.algorithm.links
        if "neighbours" in links:
            for m in sorted(self.heard()):
                self.transport.bind(self.queue, topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, m))
        if "server" in links:
            self.transport.bind(self.queue, topics.MODELS_EXCHANGE, topics.server_binding(self.experiment))
        # The server's queue, where uploads wait until the central role has started, is the topology service's
        # to declare at :start (Coordinator._declare_server_queue) and the central role's own.

    def _bind_uploads(self, clients: Any) -> None:
        queue = topics.server_queue(self.experiment)
        for c in clients:
            self.transport.bind(queue, topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, c))

    def set_graph(self, graph: Graph) -> None:
        """A topology change (the whole new graph): rebind the driver's queue, tell the algorithm."""
        if "neighbours" in self.algorithm.links and self.side == "clients":
            old, new = self.heard(), self.heard(graph)
            for m in sorted(old - new):
                self.transport.unbind(self.queue, topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, m))
            for m in sorted(new - old - self.blocked):
                self.transport.bind(self.queue, topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, m))
        self.algorithm.set_graph({int(c): [int(m) for m in ms] for c, ms in graph.items()})
        self._index_graph()

    def rows_hearing(self, sender: int, ex: Exchange) -> list[int]:
        """The hosted rows that `sender` may send a message of `ex` (the rows whose `sources` hold it)."""
        if ex.receiver != self.side:
            return []
        if ex.sender == "server":
            return list(range(len(self.ids))) if sender == SERVER else []
        if self.side == "server":
            return [0] if 0 <= sender < self.cfg.data.clients and sender not in self.blocked else []
        return self.hearing.get(sender, [])

    def sources(self, row: int, ex: Exchange) -> set[int]:
        """Who may send row `row` a message of `ex`."""
        if ex.sender == "server":
            return {SERVER}
        if self.side == "server":
            return set(range(self.cfg.data.clients)) - self.blocked
        return set(self.algorithm.ctx.graph.get(self.ids[row], ())) - self.blocked

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
        self.round, self.index, self.missed = t, -1, set()
        self.invalid.clear()
        self.logged = 0
        revived = self.liveness.revive(self.sightings, t - 1)
        if revived:
            log.info("round %d: %s heard from again", t, revived)
        self.dead = self.liveness.dead
        self.exchanges = self.algorithm.exchanges(t)
        with self.timed("train"):
            self.algorithm.begin_round(t)

    def start_exchange(self, index: int) -> None:
        """Open exchange `index` of the round: publish this side's messages, then take the held ones of it."""
        self.index = index
        ex = self.exchanges[index]
        receiving = ex.receiver == self.side
        self.waiting = [{m: ex.parts for m in self.sources(r, ex) - self.dead} if receiving else {}
                        for r in range(len(self.ids))]
        self.batch, self.opened_at, self.first_arrival = [], time.monotonic(), None
        if ex.sender == self.side:
            with self.timed("publish"):
                self.publish(ex)  # before anything arrived is folded in: what the row sends is its own
        held, self.held = self.held, []
        self.held_ids.clear()
        with self.timed("receive"):
            for delivery in held:
                self._route(delivery)
            self._fold_if_due()

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        began, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.stats.seconds[phase] += time.perf_counter() - began
            self.stats.cpu_seconds[phase] += time.thread_time() - cpu

    def take_bytes_sent(self) -> int:
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    def publish(self, ex: Exchange) -> None:
        """Every hosted row's message of `ex`, one publish each (the broker fans it out), handed over together."""
        out = self.algorithm.send(ex)
        spec = self.algorithm.payload(ex)
        models = self.algorithm.ctx.model.shapes()
        check_finite(self.algorithm, self.round,
                     {n: out.tensors[n] for n in spec if n in models or n.split(".", 1)[-1] in models})
        heads = [Envelope(self.experiment, self.ids[row], self.round, ex.name, ex.step, part)
                 for row, part in zip(out.row.tolist(), out.part.tolist(), strict=True)]
        hearing_of = [self.rows_hearing(h.sender, ex) if h.sender in self.hosted else [] for h in heads]
        encoded = encode_rows(heads, spec, out.tensors, self.model_dtype, out.lengths, [bool(h) for h in hearing_of])
        batch, sent, local = [], 0, []
        for head, hearing, (body, headers, received) in zip(heads, hearing_of, encoded, strict=True):
            key = topics.model_key(self.experiment, self.host_of(head.sender), head.sender, head.part)
            batch.append((topics.MODELS_EXCHANGE, key, body, headers))
            if self.side == "clients":  # a client's traffic: the message once per receiver, as the simulator counts
                receivers = 1 if ex.receiver == "server" else len(self.algorithm.ctx.graph.get(head.sender, ()))
                sent += message_bytes(len(body), headers, key) * receivers
            if received is not None:  # hosted rows hear it: their copy, as decoding the published one gives it
                local.append((replace(head, tensors=received), hearing))
        self.transport.publish_pipelined(batch)  # the rows' messages together; confirmed by the end of the round
        self.stats.published += len(batch)
        self.bytes_sent += sent
        for envelope, hearing in local:
            fanout = Unsettled(None, len(hearing))
            for row in hearing:
                self._route(Delivery(row, None, envelope, fanout))

    def collect(self, timeout: float) -> bool:
        """Receive the open exchange's messages until none is due or its deadline passes. True if none is missing."""
        ex = self.exchanges[self.index]
        began, received = time.perf_counter(), self.stats.seconds["receive"]
        cpu, received_cpu = time.thread_time(), self.stats.cpu_seconds["receive"]
        while any(self.waiting):
            if arrived := self._arrived():
                self._take(arrived)
                continue
            now = time.monotonic()
            start = self.first_arrival if ex.needs_arrival else self.opened_at
            deadline = None if start is None else start + ex.wait * timeout
            if deadline is not None and now >= deadline:
                break
            self._check_keep_going(now)
            wait = 0.05 if deadline is None else min(0.05, deadline - now)
            if (message := self.transport.receive(self.queue, wait)) is not None:
                self._take([message])  # woken by the first arrival
        with self.timed("receive"):
            self._fold_ready()
        missing = {m for w in self.waiting for m in w}
        if missing:
            self.stats.timeouts += 1
            self.missed |= missing
            log.warning("round %d %s %d: timed out waiting for %s", self.round, ex.name, ex.step, sorted(missing))
        with self.timed("receive"):
            self._fold(sorted(self.batch, key=lambda d: (d.envelope.sender, d.row)))
        self.batch = []
        self.stats.seconds["wait"] += time.perf_counter() - began - (self.stats.seconds["receive"] - received)
        self.stats.cpu_seconds["wait"] += time.thread_time() - cpu - (self.stats.cpu_seconds["receive"] - received_cpu)
        return not missing

    def _check_keep_going(self, now: float) -> None:
        if self.keep_going is not None and now >= self._next_check:
            self._next_check = now + KEEP_GOING_EVERY_S
            if not self.keep_going():
                raise RunInterrupted

    def end_exchange(self) -> None:
        with self.timed("mix"):
            self.algorithm.end_exchange(self.exchanges[self.index])

    def end_round(self) -> None:
        with self.timed("publish"):  # the round's messages are on the broker before it counts as done (checkpoint)
            if self.confirm_later:
                self.unconfirmed = self.transport.confirmation()
            else:
                self.transport.await_confirms()
        with self.timed("mix"):
            self.algorithm.end_round(self.round)
        self.stats.screened = self.algorithm.screened
        if self.unlogged:
            log.warning("round %d: %d more rejected messages not logged one by one (see the rejected counts)",
                        self.round, self.unlogged)
            self.unlogged = 0
        expected = {m for r in range(len(self.ids)) for ex in self.exchanges if ex.receiver == self.side
                    for m in self.sources(r, ex)} - {SERVER}  # a central role is never presumed dead
        self.liveness.observe_round(expected - self.dead, self.missed - {SERVER})
        self.rounds_done = self.round + 1
        self.seen = {i for i in self.seen if i[2] >= self.round}  # older ones are stale, never applied again

    # -- messages -------------------------------------------------------------------------------------------
    def _arrived(self) -> list[Message]:
        """What waits in the driver's queue, without blocking, up to FOLD_BATCH messages."""
        arrived: list[Message] = []
        while len(arrived) < FOLD_BATCH and (message := self.transport.receive(self.queue, 0.0)) is not None:
            arrived.append(message)
        return arrived

    def handle(self, message: Message) -> None:
        """Check one message delivered to the driver's queue, then fold, hold, drop or reject it for each hosted row
        that hears its sender."""
        self.handle_many([message])

    def handle_many(self, arrived: list[Message]) -> None:
        """Check messages delivered to the driver's queue, then fold (together), hold, drop or reject each for the
        hosted rows that hear its sender. Copies of one message (a repeat) are decoded once."""
        self._take(arrived)
        with self.timed("receive"):
            self._fold_ready()

    def _take(self, arrived: list[Message]) -> None:
        """handle_many, but what is ready for the open exchange is folded when due (_fold_if_due): at most
        FOLD_BATCH distinct messages are held decoded for it at once, those being decoded (together) included."""
        with self.timed("receive"):
            pending = arrived
            while pending:
                if len(self.ready_messages) >= FOLD_BATCH:
                    self._fold_ready()
                room = FOLD_BATCH - len(self.ready_messages)
                batch, pending = [m for m in pending[:room] if self._screen(m)], pending[room:]
                for message, decoded in zip(batch, self._decode(batch), strict=True):
                    self._handle(message, decoded)
            self._fold_if_due()

    def _decode(self, messages: list[Message]) -> list[Envelope | PayloadRejected]:
        """decode_messages (together), once for all copies of one message: the same routing key, headers and body
        decode to the same envelope (the body is compared, not only its stated checksum)."""
        firsts: dict[tuple[str, str], list[int]] = {}  # key and headers -> the distinct messages that have them
        distinct: list[Message] = []
        which: list[int] = []
        for message in messages:
            same = firsts.setdefault((message.routing_key, json.dumps(message.headers, sort_keys=True, default=str)),
                                     [])
            at = next((i for i in same if distinct[i].body == message.body), None)
            if at is None:
                at = len(distinct)
                same.append(at)
                distinct.append(message)
            which.append(at)
        decoded = decode_messages([(m.routing_key, m.body, m.headers) for m in distinct], self.experiment,
                                  self.spec_of)
        return [decoded[at] for at in which]

    def _screen(self, message: Message) -> bool:
        """What is settled before decoding: a copy of a hosted client's message (delivered locally) is acknowledged,
        one not published by its sender's host rejected. True: the message is to be decoded."""
        key = model_key_of(message)
        if key is not None and key.sender in self.hosted:
            self.stats.not_neighbour += 1  # a copy of what was delivered locally (a binding made for another driver)
            self.transport.ack(message)
            return False
        if not self.from_senders_host(message, key):
            self.stats.rejected["publisher"] += 1
            self._warn("rejected message %s for %s: published by %r, not by its sender's host", message.routing_key,
                       self.queue, message.publisher)
            self.transport.reject(message, requeue=False)
            return False
        return True

    def _handle(self, message: Message, decoded: Envelope | PayloadRejected) -> None:
        if isinstance(decoded, PayloadRejected):
            self.stats.rejected[decoded.reason] += 1
            self._warn("rejected message %s for %s: %s", message.routing_key, self.queue, decoded)
            self.transport.reject(message, requeue=False)  # to the dead-letter exchange
            self._count_invalid(message)
            return
        envelope = decoded
        self.sightings[envelope.sender] = max(envelope.round, self.sightings.get(envelope.sender, envelope.round))
        _, ex = self.exchange_of(envelope)
        rows = self.rows_hearing(envelope.sender, ex)
        if not rows:
            self.stats.not_neighbour += 1
            self.transport.ack(message)
            return
        if envelope.round > self.round + MAX_ROUNDS_AHEAD:
            self.stats.rejected["future_round"] += 1
            self._warn("rejected a message of round %d from %d at round %d: more than %d rounds ahead",
                       envelope.round, envelope.sender, self.round, MAX_ROUNDS_AHEAD)
            self.transport.reject(message, requeue=False)
            return
        fanout = Unsettled(message, len(rows))
        for row in rows:
            self._route(Delivery(row, message, envelope, fanout))

    def _warn(self, text: str, *args: Any) -> None:
        """Log a rejection, or count it once this round's LOGGED_REJECTIONS_PER_ROUND are logged."""
        if self.logged < LOGGED_REJECTIONS_PER_ROUND:
            self.logged += 1
            log.warning(text, *args)
        else:
            self.unlogged += 1

    def _settle(self, delivery: Delivery) -> None:
        """Row `delivery.row` is done with its message; the message is acknowledged once every row it reached is."""
        delivery.fanout.rows -= 1
        if delivery.fanout.rows == 0 and delivery.message is not None:
            self.transport.ack(delivery.message)

    def _count_invalid(self, message: Message) -> None:
        """A malformed message, or a repeat the broker did not redeliver, whose sender's host is proven counts against
        that sender; past BLOCK_AFTER_INVALID in one round the sender is cut off. An honest client never sends
        either (a publish retried after a lost confirm repeats one message). Without proven publishers anyone could
        frame an honest client, so nobody is cut off."""
        if not self.publishers.strict or message.redelivered:
            return
        key = model_key_of(message)
        if key is None:
            return
        sender = key.sender
        if sender == SERVER or sender in self.blocked:
            return
        self.invalid[sender] += 1
        if self.invalid[sender] >= BLOCK_AFTER_INVALID:
            self.block(sender)

    def _count_repeat(self, delivery: Delivery) -> None:
        if delivery.message is not None and not delivery.fanout.repeat_counted:
            delivery.fanout.repeat_counted = True
            self._count_invalid(delivery.message)

    def block(self, sender: int) -> None:
        """Cut `sender` off: unbind its keys from the driver's queue and stop waiting for it."""
        self.blocked.add(sender)
        self.stats.blocked += 1
        self.transport.unbind(self.queue, topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, sender))
        self._index_graph()
        for waiting in self.waiting:
            waiting.pop(sender, None)
        log.warning("round %d: client %d (host %s) sent %d malformed or repeated messages: cut off for the rest of the "
                    "run",
                    self.round, sender, self.host_of(sender), self.invalid[sender])

    def from_senders_host(self, message: Message, key: topics.ModelKey | None) -> bool:
        """The routing key (`key`, parsed) names the sender's host, and (where publishers are proven) the host
        published it. A malformed key (None) passes here: the decoder rejects it."""
        if key is None:
            return True
        host = self.host_of(key.sender)
        return key.host == host and self.publishers.allows(message.publisher, host)

    def _route(self, delivery: Delivery) -> None:
        row, envelope = delivery.row, delivery.envelope
        identity = self.identity(delivery)
        if identity in self.seen:
            self.stats.duplicates += 1
            self._settle(delivery)
            self._count_repeat(delivery)
            return
        index, ex = self.exchange_of(envelope)
        here = (envelope.round, index)
        now = (self.round, self.index)
        if here > now:
            if identity in self.held_ids:
                self.stats.duplicates += 1
                self._settle(delivery)
                self._count_repeat(delivery)
            else:
                self.held_ids.add(identity)
                self.held.append(delivery)
            return
        if here == now:
            due = self.waiting[row]
            if envelope.sender in due:
                due[envelope.sender] -= 1
                if due[envelope.sender] <= 0:
                    del due[envelope.sender]
            if self.first_arrival is None:
                self.first_arrival = time.monotonic()
            self.seen.add(identity)  # a duplicate arriving before the message is folded is a duplicate
            if self.cfg.aggregation == "batch" and ex.averaged:
                self.batch.append(delivery)
            else:
                self._make_ready(delivery)
            return
        current = self.exchanges[self.index]
        if (ex.stale_ok and self.cfg.runtime.staleness == "merge" and envelope.round == self.round - 1
                and current.name == ex.name and current.stale_ok and current.receiver == self.side):
            self.stats.stale_merged += 1
            self.seen.add(identity)
            self._make_ready(delivery)
            return
        self.stats.stale_dropped += 1
        self.seen.add(identity)
        self._settle(delivery)

    def _make_ready(self, delivery: Delivery) -> None:
        self.ready.append(delivery)
        self.ready_messages.add(id(delivery.envelope))

    def _fold_ready(self) -> None:
        ready, self.ready = self.ready, []
        self.ready_messages = set()
        self._fold(ready)

    def _fold_if_due(self) -> None:
        """Fold what is ready once FOLD_BATCH distinct messages are, or once none is due any more. A fold costs
        about a millisecond whatever it holds (measured: folding each message alone took 0.15 CPU-s a round of
        the runtime benchmark's config in lockstep, batches 0.06), so messages that trickle in one by one wait
        for the next ones, up to FOLD_BATCH; the exchange closes when the last is folded."""
        if self.ready and (len(self.ready_messages) >= FOLD_BATCH or not any(self.waiting)):
            self._fold_ready()

    def _fold(self, deliveries: list[Delivery]) -> None:
        """Hand messages to the algorithm, one inbox per round they were sent in (a stale one is folded with its own
        round) and per FOLD_BATCH distinct messages, each a column delivered to every hosted row it reached."""
        by_round: dict[int, list[Delivery]] = {}
        for delivery in deliveries:
            by_round.setdefault(delivery.envelope.round, []).append(delivery)
        for group in by_round.values():
            columns: dict[int, int] = {}  # id(envelope) -> its column
            chunk: list[Delivery] = []
            for delivery in group:
                if id(delivery.envelope) not in columns and len(columns) == FOLD_BATCH:
                    self._deliver(chunk, columns)
                    columns, chunk = {}, []
                columns.setdefault(id(delivery.envelope), len(columns))
                chunk.append(delivery)
            if chunk:
                self._deliver(chunk, columns)

    def _deliver(self, chunk: list[Delivery], columns: dict[int, int]) -> None:
        """One inbox: delivered[row, column] for each delivery of `chunk`, the columns' distinct messages."""
        device = self.algorithm.ctx.device
        envelopes = list({id(d.envelope): d.envelope for d in chunk}.values())  # in column order
        shapes = {n: {shape_of(e.tensors, n) for e in envelopes} for n in envelopes[0].tensors}
        if len(envelopes) > 1 and any(len(s) > 1 for s in shapes.values()):  # ragged payloads: one at a time
            for e in envelopes:
                self._deliver([d for d in chunk if d.envelope is e], {id(e): 0})
            return
        delivered = torch.zeros(len(self.ids), len(envelopes), dtype=torch.bool)
        delivered[[d.row for d in chunk], [columns[id(d.envelope)] for d in chunk]] = True
        tensors = {n: stacked([e.tensors for e in envelopes], n).to(device) for n in envelopes[0].tensors}
        inbox = Inbox(delivered.to(device), torch.tensor([e.sender for e in envelopes], device=device),
                      torch.tensor([e.part for e in envelopes], device=device), tensors, envelopes[0].round)
        used = self.algorithm.receive(self.exchanges[self.index], inbox)
        if self.algorithm.refused != self.counted_refusals:  # the algorithm refused some (a lying seed candidate)
            self.stats.rejected.update(self.algorithm.refused - self.counted_refusals)
            self.counted_refusals = self.algorithm.refused.copy()
        self.stats.applied += used
        self.stats.ignored += max(len(chunk) - used, 0)
        for d in chunk:
            self._settle(d)

    def identity(self, delivery: Delivery) -> Identity:
        e = delivery.envelope
        return (self.ids[delivery.row], e.sender, e.round, e.exchange, e.step, e.part)

    def exchange_of(self, head: Envelope) -> tuple[int, Exchange]:
        """The index and exchange a message belongs to; PayloadRejected if its round has no such exchange."""
        if not 0 <= head.round < self.schedule.total_rounds:
            raise PayloadRejected("round", f"round {head.round} outside 0..{self.schedule.total_rounds - 1}")
        exchanges = self.exchanges if head.round == self.round else self.algorithm.exchanges(head.round)
        for index, ex in enumerate(exchanges):
            if (ex.name, ex.step) == (head.exchange, head.step):
                return index, ex
        raise PayloadRejected("exchange", f"round {head.round} has no exchange {head.exchange!r} step {head.step}")

    def spec_of(self, head: Envelope) -> Spec:
        _, ex = self.exchange_of(head)
        if not 0 <= head.part < self.algorithm.k:
            raise PayloadRejected("cluster", f"part {head.part} outside 0..{self.algorithm.k - 1}")
        return self.algorithm.payload(ex)

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
        """The hosted rows' state after the last round, copied: the next round may change it while it is written."""
        tensors = {n: v.detach().to("cpu", copy=True).contiguous() for n, v in self.algorithm.state().items()}
        # the identities used in the last round: a message folded before this checkpoint but not yet acked comes
        # back after a crash, and must be a duplicate then, not a late message merged a second time
        meta = {"round": str(self.round), "experiment": self.experiment, "clients": json.dumps(self.ids),
                "seen": json.dumps(sorted(self.seen))}
        return Checkpoint(tensors, meta)

    def save_checkpoint(self, path: Path) -> None:
        """The hosted rows' state after the last round, as safetensors; written atomically."""
        self.checkpoint().write(path)

    def load_checkpoint(self, path: Path) -> int:
        """Restore the state; returns the last completed round (the next round is that + 1)."""
        with safe_open(str(path), "pt") as f:
            meta: Mapping[str, str] = f.metadata()
        if meta.get("experiment") != self.experiment or json.loads(meta["clients"]) != self.ids:
            raise ValueError(f"checkpoint {path} belongs to another experiment or client set")
        self.algorithm.load_state(load_file(str(path)))
        self.seen = {(int(r), int(sd), int(t), str(x), int(st), int(pt)) for r, sd, t, x, st, pt in
                     json.loads(meta.get("seen", "[]"))}
        self.round = int(meta["round"])
        self.rounds_done = self.round + 1
        return self.round
