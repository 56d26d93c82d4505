"""The message-driven driver: a host runs 1..M clients (vectorized) and applies each arriving model at once.

Per round, a host (1) assigns its clients (eq. 4), (2) trains each client's assigned model (eq. 5),
(3) publishes it to `dfca.models` with key `<experiment>.<sender>.<cluster>`, then (4) folds in
neighbours' models as they arrive: with `aggregation: sequential` each model is applied at once by
the running average (eq. 8); with `batch` the round's models are held and applied together (eq. 7),
in sender order. A client's round ends when every neighbour's model has arrived or the round
timeout passes.

Robust rounds (`dfca.variant: robust`, G_t = `cfg.dfca.steps_at(t)` > 0) replace (3)-(4) by ratio
consensus (core.consensus) over G_t gossip steps of all k clusters. Each hosted client keeps
num_j = m_j theta_j and den_j = m_j (m_j = 1 iff it trained j this round); at step s it publishes
one message with its whole (num, den) (`wire.encode_consensus`, header `kind=consensus`, `step=s`),
waits for every neighbour's step-s message (or the round timeout) and sets
num <- (own + sum of arrived) / (1 + arrivals), den likewise. After the last step
theta_j <- num_j / den_j where den_j > MIN_WEIGHT. `collect` runs all steps (the workers' loop);
`consensus_publish` / `consensus_collect` / `consensus_finish` let a single-threaded driver
interleave hosts step by step (`lockstep_round`). A gossip message is applied once per (receiver,
sender, round, step); one of a later step or round waits; one of an earlier step or round is dropped.

Seeding rounds (`dfca.seeding: farthest`, the first k * flood_rounds rounds; host_seeding and
core.seeding): no training; each client publishes its seed candidate (model plus score and origin
headers) and keeps the best arriving one of the open slot; after a slot's last round the candidate
becomes the client's model of that cluster.

Safety: a payload that fails to decode, has wrong shapes, NaN/Inf or a bad checksum, or whose
header disagrees with its routing key, is rejected to the dead-letter exchange and counted. A
model already applied (same receiver, sender, round, cluster) is acked and ignored. Models from a
later round wait (unacked) until this host reaches that round; models from an earlier round
follow `runtime.staleness`: `drop` (default) or `merge` into the current running average.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dfca import topics
from dfca.config import ExperimentConfig
from dfca.core import (
    assign_clusters,
    init_cluster_models,
    loss_matrix,
    round_seeds,
    running_average,
    self_weights,
    train_assigned,
)
from dfca.core.assignment import accuracy_with
from dfca.core.consensus import agrees_on_initial_models, gossip_step, ratio_estimate, round_weights
from dfca.core.seeding import SeedingStep, seeding_rounds, seeding_step
from dfca.data import FederatedData
from dfca.host_seeding import SeedFlood, is_seed_message
from dfca.models import BatchedModel, Params, build_model
from dfca.transport import Message, Transport
from dfca.wire import (
    ConsensusUpdate,
    ModelUpdate,
    PayloadRejected,
    decode_consensus,
    decode_routed_update,
    encode_consensus,
    encode_update,
    is_consensus,
)

log = logging.getLogger(__name__)


@dataclass
class HostStats:
    published: int = 0
    applied: int = 0
    duplicates: int = 0
    stale_dropped: int = 0
    stale_merged: int = 0
    not_neighbour: int = 0
    timeouts: int = 0
    rejected: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "rejected"}
        out["rejected"] = dict(self.rejected)
        out["rejected_total"] = sum(self.rejected.values())
        return out


@dataclass
class GossipRound:
    """A robust round's ratio-consensus state of the hosted clients (rows as in ClientHost.clients)."""

    steps: int
    num: Params  # name -> [M, k, ...]: m_j * theta_j, mixed by each step
    den: torch.Tensor  # [M, k]: m_j, mixed by each step
    published: int = -1  # the last step published
    collected: int = -1  # the last step whose mixing is done
    arrived: dict[int, dict[int, ConsensusUpdate]] = field(default_factory=dict)  # client -> sender -> update
    excused: dict[int, set[int]] = field(default_factory=dict)  # neighbours nobody waits for (dead)
    missed: dict[int, set[int]] = field(default_factory=dict)  # neighbours that missed some step
    complete: bool = True


Held = tuple[int, Message, "ModelUpdate | ConsensusUpdate"]


class ClientHost:
    """Hosts the clients `clients` of one experiment and runs DFCA's loop over a Transport."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        experiment: str,
        clients: Sequence[int],
        data: FederatedData,
        neighbours: Mapping[int, Sequence[int]],
        transport: Transport,
        model: BatchedModel | None = None,
    ) -> None:
        self.cfg, self.experiment, self.transport = cfg, topics.check_word(experiment, "experiment id"), transport
        self.clients = [int(c) for c in clients]
        self.row = {c: r for r, c in enumerate(self.clients)}
        self.data = data
        self.neighbours = {c: sorted(int(m) for m in neighbours[c]) for c in self.clients}
        self.model = model or build_model(cfg.model.kind, data.input_shape, cfg.model.hidden, data.num_classes)
        self.shapes = self.model.shapes()
        self.k = cfg.clusters
        self.params: Params = init_cluster_models(self.model, self.clients, self.k, cfg.seed, cfg.init)
        self.losses = loss_matrix(self.model, self.params, data.x_train, data.y_train)
        self.round = -1  # the round whose merge is open; -1 before the first local step
        self.assigned = assign_clusters(self.losses)
        self.self_w = torch.ones(len(self.clients), self.k)
        self.arrivals = torch.zeros(len(self.clients), self.k, dtype=torch.long)
        self.waiting: dict[int, set[int]] = {c: set() for c in self.clients}
        self.held: list[Held] = []  # later rounds (or steps), or batch mode's round
        self.seen: set[tuple[int, int, int, int]] = set()
        self.gossip: GossipRound | None = None  # open during a robust round's consensus
        self.gossip_seen: set[tuple[int, int, int, int]] = set()  # (receiver, sender, round, step)
        self.training_start = seeding_rounds(cfg) if cfg.algorithm == "dfca" else 0
        self.seeding: SeedFlood | None = (
            SeedFlood(cfg, self.clients, self.model, data) if self.training_start else None
        )
        self.stats = HostStats()

    # -- wiring -------------------------------------------------------------------------------
    def queue(self, client: int) -> str:
        return topics.client_queue(self.experiment, client)

    def setup(self) -> None:
        """Declare exchanges, one queue per client, and bind it to each neighbour's models."""
        for name, kind in topics.EXCHANGES.items():
            self.transport.declare_exchange(name, kind)
        self.transport.declare_queue(topics.DEAD_LETTER_QUEUE)
        self.transport.bind(topics.DEAD_LETTER_QUEUE, topics.DEAD_LETTER_EXCHANGE, "#")
        for c in self.clients:
            self.transport.declare_queue(self.queue(c), dead_letter_exchange=topics.DEAD_LETTER_EXCHANGE)
            for m in self.neighbours[c]:
                self.transport.bind(self.queue(c), topics.MODELS_EXCHANGE, topics.neighbour_binding(self.experiment, m))

    def set_neighbours(self, client: int, new: Sequence[int]) -> None:
        """Change a client's edges during a run: rebind its queue (FedSPD's dynamic network)."""
        old, fresh = set(self.neighbours[client]), {int(m) for m in new}
        for m in old - fresh:
            self.transport.unbind(self.queue(client), topics.MODELS_EXCHANGE,
                                  topics.neighbour_binding(self.experiment, m))
        for m in fresh - old:
            self.transport.bind(self.queue(client), topics.MODELS_EXCHANGE,
                                topics.neighbour_binding(self.experiment, m))
        self.neighbours[client] = sorted(fresh)
        self.waiting[client] &= fresh

    # -- one round ----------------------------------------------------------------------------
    def local_step(self, t: int) -> None:
        """Assign (eq. 4), train the assigned models (eq. 5), publish them, open round t's merge."""
        cfg = self.cfg
        if self.seeding is not None and (step := seeding_step(cfg, t)) is not None:
            self._seeding_step(t, step)
            return
        self.assigned = assign_clusters(self.losses)
        train_assigned(
            self.model, self.params, self.assigned, self.data.x_train, self.data.y_train,
            lr=cfg.train.lr * cfg.train.lr_decay**t,
            epochs=0 if agrees_on_initial_models(cfg, t) else cfg.train.local_epochs,
            batch_size=cfg.train.batch_size, seeds=round_seeds(cfg.seed, self.clients, t),
        )
        self.round = t
        self.self_w = self_weights(self.assigned, self.k, cfg.dfca.merge_rule)
        self.arrivals.zero_()
        steps = self.gossip_steps(t)
        if steps > 0:
            self._open_gossip(steps)
            self.consensus_publish(0)
            return
        self.waiting = {c: set(self.neighbours[c]) for c in self.clients}
        dtype = torch.float16 if cfg.runtime.payload_dtype == "float16" else torch.float32
        samples = int(self.data.y_train.shape[1])
        for r, c in enumerate(self.clients):
            j = int(self.assigned[r])
            update = ModelUpdate(self.experiment, c, t, j, samples, {n: v[r, j] for n, v in self.params.items()})
            body, headers = encode_update(update, dtype)
            self.transport.publish(topics.MODELS_EXCHANGE, topics.model_key(self.experiment, c, j), body, headers)
            self.stats.published += 1
        self.reroute_held()

    def _seeding_step(self, t: int, step: SeedingStep) -> None:
        """A seeding round: publish every hosted client's seed candidate of the open slot."""
        assert self.seeding is not None
        self.round = t
        self.arrivals.zero_()
        self.seeding.open(t, step, self.params, self.losses)
        self.waiting = {c: set(self.neighbours[c]) for c in self.clients}
        dtype = torch.float16 if self.cfg.runtime.payload_dtype == "float16" else torch.float32
        samples = int(self.data.y_train.shape[1])
        for r, c in enumerate(self.clients):
            params, extra = self.seeding.outgoing(r)
            body, headers = encode_update(ModelUpdate(self.experiment, c, t, step.slot, samples, params), dtype)
            self.transport.publish(topics.MODELS_EXCHANGE, topics.model_key(self.experiment, c, step.slot), body,
                                   {**headers, **extra})
            self.stats.published += 1
        self.reroute_held()

    def collect(self, timeout: float) -> bool:
        """Receive round-t models until every neighbour has reported or `timeout` passes.

        In a robust round: run the remaining gossip steps (`timeout` for each) and finish the consensus.
        """
        if self.gossip is not None:
            return self._collect_gossip(timeout)
        complete = self._receive_until(time.monotonic() + timeout)
        if not complete:
            self.stats.timeouts += 1
            missing = {c: sorted(w) for c, w in self.waiting.items() if w}
            log.warning("round %d: timed out waiting for %s", self.round, missing)
        self._apply_batch()
        return complete

    def _receive_until(self, deadline: float) -> bool:
        """Handle deliveries until no hosted client waits for anyone or the deadline passes."""
        while any(self.waiting.values()):
            got = False
            for c in [c for c in self.clients if self.waiting[c]]:
                while (msg := self.transport.receive(self.queue(c), 0.0)) is not None:
                    self.handle(c, msg)
                    got = True
            if got:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            c = next(c for c in self.clients if self.waiting[c])
            msg = self.transport.receive(self.queue(c), min(0.05, remaining))
            if msg is not None:
                self.handle(c, msg)
        return not any(self.waiting.values())

    # -- robust rounds: ratio consensus over gossip steps ------------------------------------------
    def gossip_steps(self, t: int) -> int:
        """G_t: gossip steps of ratio consensus in round t; 0 means the round merges by eq. 7/8."""
        return self.cfg.dfca.steps_at(t, self.training_start)

    def _open_gossip(self, steps: int) -> None:
        trained = round_weights(self.cfg, self.round, self.clients, self.assigned)  # m [M, k]
        num = {n: v * trained.reshape(*trained.shape, *[1] * (v.dim() - 2)) for n, v in self.params.items()}
        self.gossip = GossipRound(steps, num, trained.clone(), excused={c: set() for c in self.clients},
                                  missed={c: set() for c in self.clients})

    def _open_round(self) -> GossipRound:
        if self.gossip is None:
            raise RuntimeError(f"round {self.round} has no open consensus")
        return self.gossip

    def consensus_publish(self, step: int) -> None:
        """Publish every hosted client's (num, den) of all k clusters as gossip step `step`."""
        g = self._open_round()
        if step != g.collected + 1 or step != g.published + 1 or step >= g.steps:
            raise RuntimeError(f"gossip step {step} out of order (published {g.published}, "
                               f"collected {g.collected}, {g.steps} steps)")
        g.published = step
        g.arrived = {c: {} for c in self.clients}
        self.waiting = {c: set(self.neighbours[c]) - g.excused[c] for c in self.clients}
        dtype = torch.float16 if self.cfg.runtime.payload_dtype == "float16" else torch.float32
        for r, c in enumerate(self.clients):
            update = ConsensusUpdate(self.experiment, c, self.round, step, {n: v[r] for n, v in g.num.items()},
                                     g.den[r])
            body, headers = encode_consensus(update, dtype)
            self.transport.publish(topics.MODELS_EXCHANGE, topics.model_key(self.experiment, c, 0), body, headers)
            self.stats.published += 1
        self.reroute_held()

    def consensus_collect(self, step: int, timeout: float) -> bool:
        """Wait for every neighbour's step-`step` message (or `timeout`), then mix: one gossip step."""
        g = self._open_round()
        if step != g.published or step != g.collected + 1:
            raise RuntimeError(f"gossip step {step} not open (published {g.published}, collected {g.collected})")
        if step == 0:  # neighbours dropped from waiting by the caller (presumed dead) are not waited for
            g.excused = {c: set(self.neighbours[c]) - self.waiting[c] - set(g.arrived[c]) for c in self.clients}
        complete = self._receive_until(time.monotonic() + timeout)
        if not complete:
            self.stats.timeouts += 1
            missing = {c: sorted(w) for c, w in self.waiting.items() if w}
            log.warning("round %d gossip step %d: timed out waiting for %s", self.round, step, missing)
            for c, w in self.waiting.items():
                g.missed[c] |= w
            g.complete = False
        num_sum = {n: torch.zeros_like(v) for n, v in g.num.items()}
        den_sum = torch.zeros_like(g.den)
        degree = torch.zeros(len(self.clients))
        for r, c in enumerate(self.clients):
            for sender in sorted(g.arrived[c]):
                update = g.arrived[c][sender]
                for n in num_sum:
                    num_sum[n][r] += update.num[n]
                den_sum[r] += update.den
                degree[r] += 1
        g.num = {n: gossip_step(v, num_sum[n], degree) for n, v in g.num.items()}
        g.den = gossip_step(g.den, den_sum, degree)
        g.collected = step
        g.arrived = {c: {} for c in self.clients}
        return complete

    def consensus_finish(self) -> bool:
        """theta_j <- num_j / den_j where den_j > MIN_WEIGHT (else keep theta_j); closes the consensus.

        Afterwards `waiting` holds the neighbours that missed some step; returns whether none did.
        """
        g = self._open_round()
        if g.collected != g.steps - 1:
            raise RuntimeError(f"consensus finished after {g.collected + 1} of {g.steps} steps")
        for n, v in self.params.items():
            v.copy_(ratio_estimate(g.num[n], g.den, v))
        self.waiting = {c: set(w) for c, w in g.missed.items()}
        self.gossip = None
        return g.complete

    def _collect_gossip(self, timeout: float) -> bool:
        g = self._open_round()
        while g.collected < g.steps - 1:
            if g.published == g.collected:
                self.consensus_publish(g.collected + 1)
            self.consensus_collect(g.published, timeout)
        return self.consensus_finish()

    def reroute_held(self) -> None:
        """Route the held messages again (the round or step they waited for may have come)."""
        held, self.held = self.held, []
        for client, msg, update in held:
            self._route(client, msg, update)

    def finish_round(self) -> None:
        """Recompute every cluster's local loss: the next round's assignment and this round's evaluation."""
        if self.seeding is not None and self.round < self.training_start and self.seeding.close(self.params):
            if self.round + 1 >= self.training_start:
                self.seeding = None  # seeding is over: the local models are no longer needed
        self.losses = loss_matrix(self.model, self.params, self.data.x_train, self.data.y_train)

    def run_round(self, t: int, timeout: float | None = None) -> bool:
        self.local_step(t)
        complete = self.collect(self.cfg.runtime.round_timeout if timeout is None else timeout)
        self.finish_round()
        return complete

    # -- messages -----------------------------------------------------------------------------
    def handle(self, client: int, msg: Message) -> None:
        """Check one delivered model message for `client` and apply, hold, drop or reject it."""
        try:
            update: ModelUpdate | ConsensusUpdate = (
                self._decode_consensus(msg) if is_consensus(msg.headers) else self._decode(msg)
            )
        except PayloadRejected as err:
            self.stats.rejected[err.reason] += 1
            log.warning("rejected model message %s for client %d: %s", msg.routing_key, client, err)
            self.transport.reject(msg, requeue=False)  # to the dead-letter exchange
            return
        if update.sender not in self.neighbours[client]:
            self.stats.not_neighbour += 1
            self.transport.ack(msg)
            return
        self._route(client, msg, update)

    def _decode(self, msg: Message) -> ModelUpdate:
        return decode_routed_update(msg.routing_key, msg.body, msg.headers, self.shapes, self.experiment, self.k)

    def _decode_consensus(self, msg: Message) -> ConsensusUpdate:
        try:
            experiment, sender, _ = topics.parse_model_key(msg.routing_key)
        except ValueError as err:
            raise PayloadRejected("routing_key", str(err)) from err
        update = decode_consensus(msg.body, msg.headers, self.shapes, self.k)
        if (update.experiment, update.sender) != (experiment, sender):
            raise PayloadRejected("spoofed", f"headers say sender {update.sender}, routing key {msg.routing_key!r}")
        if update.experiment != self.experiment:
            raise PayloadRejected("experiment", f"consensus message of experiment {update.experiment!r}")
        return update

    def _route_consensus(self, client: int, msg: Message, update: ConsensusUpdate) -> None:
        identity = (client, update.sender, update.round, update.step)
        g = self.gossip
        if identity in self.gossip_seen:
            self.stats.duplicates += 1
            self.transport.ack(msg)
        elif update.round > self.round or (
            g is not None and update.round == self.round and g.published < update.step < g.steps
        ):
            self.held.append((client, msg, update))
        elif g is not None and update.round == self.round and update.step == g.published > g.collected:
            g.arrived[client][update.sender] = update
            self.waiting[client].discard(update.sender)
            self.gossip_seen.add(identity)
            self.stats.applied += 1
            self.transport.ack(msg)
        else:  # an earlier round or step (or a round that merges by eq. 7/8): too late to mix
            self.stats.stale_dropped += 1
            self.gossip_seen.add(identity)
            self.transport.ack(msg)

    def _route_seed(self, client: int, msg: Message, update: ModelUpdate) -> None:
        """A seed candidate: adopt it if it is of the open slot and beats the client's own (order-free)."""
        identity = (client, update.sender, update.round, update.cluster)
        if identity in self.seen:
            self.stats.duplicates += 1
            self.transport.ack(msg)
            return
        if update.round > self.round:
            self.held.append((client, msg, update))
            return
        try:
            if self.seeding is not None and (update.round == self.round or self.cfg.runtime.staleness == "merge"):
                self.seeding.offer(self.row[client], update.cluster, update.params, msg.headers)
        except PayloadRejected as err:
            self.stats.rejected[err.reason] += 1
            log.warning("rejected seed candidate %s for client %d: %s", msg.routing_key, client, err)
            self.transport.reject(msg, requeue=False)
            return
        if update.round == self.round:
            self.stats.applied += 1
            self.waiting[client].discard(update.sender)
        else:
            self.stats.stale_dropped += 1
        self.seen.add(identity)
        self.transport.ack(msg)

    def _route(self, client: int, msg: Message, update: ModelUpdate | ConsensusUpdate) -> None:
        if isinstance(update, ConsensusUpdate):
            self._route_consensus(client, msg, update)
            return
        if is_seed_message(msg.headers):
            self._route_seed(client, msg, update)
            return
        identity = (client, update.sender, update.round, update.cluster)
        if self.gossip is not None and update.round == self.round:  # a model update in a consensus round
            self.stats.stale_dropped += 1
            self.seen.add(identity)
            self.transport.ack(msg)
        elif identity in self.seen:
            self.stats.duplicates += 1
            self.transport.ack(msg)
        elif update.round > self.round or (update.round == self.round and self.cfg.aggregation == "batch"):
            self.held.append((client, msg, update))
            if update.round == self.round:
                self.waiting[client].discard(update.sender)
        elif update.round < self.round:
            if self.cfg.runtime.staleness == "merge":
                self._apply(client, update)
                self.stats.stale_merged += 1
            else:
                self.stats.stale_dropped += 1
            self.seen.add(identity)
            self.transport.ack(msg)
        else:
            self._apply(client, update)
            self.waiting[client].discard(update.sender)
            self.seen.add(identity)
            self.transport.ack(msg)

    def _apply(self, client: int, update: ModelUpdate) -> None:
        """Eq. 8: fold one neighbour model into the client's copy of that cluster."""
        r, j = self.row[client], update.cluster
        self.arrivals[r, j] += 1
        current = {n: v[r, j] for n, v in self.params.items()}
        running_average(current, update.params, int(self.arrivals[r, j]), float(self.self_w[r, j]))
        self.stats.applied += 1

    def _apply_batch(self) -> None:
        """Batch mode (eq. 7): apply the round's held models together, in sender order."""
        due = [(c, m, u) for c, m, u in self.held if isinstance(u, ModelUpdate) and u.round == self.round]
        self.held = [(c, m, u) for c, m, u in self.held if not (isinstance(u, ModelUpdate) and u.round == self.round)]
        for client, msg, update in sorted(due, key=lambda held: (held[2].sender, held[0])):
            self._apply(client, update)
            self.seen.add((client, update.sender, update.round, update.cluster))
            self.transport.ack(msg)

    # -- results and checkpoints -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        assigned = assign_clusters(self.losses)
        acc = accuracy_with(self.model, self.params, assigned, self.data.x_test, self.data.y_test)
        loss = self.losses.gather(1, assigned.unsqueeze(1)).squeeze(1)
        return {
            "clients": self.clients,
            "assigned": assigned.tolist(),
            "test_accuracy": acc.tolist(),
            "train_loss": loss.tolist(),
            "true_cluster": self.data.true_cluster.tolist(),
        }

    def save_checkpoint(self, path: Path) -> None:
        """Client state after a round, as safetensors; written atomically."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"params.{n}": v.contiguous() for n, v in self.params.items()}
        tensors["losses"] = self.losses.contiguous()
        if self.seeding is not None:  # mid-seeding: the local models and the open slot's candidates
            tensors.update(self.seeding.tensors())
        meta = {"round": str(self.round), "experiment": self.experiment, "clients": json.dumps(self.clients)}
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)

    def load_checkpoint(self, path: Path) -> int:
        """Restore client state; returns the last completed round (the next round is that + 1)."""
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        if meta.get("experiment") != self.experiment or json.loads(meta["clients"]) != self.clients:
            raise ValueError(f"checkpoint {path} belongs to another experiment or client set")
        tensors = load_file(str(path))
        for n in self.params:
            self.params[n] = tensors[f"params.{n}"]
        self.losses = tensors["losses"]
        self.round = int(meta["round"])
        if self.seeding is not None:
            if self.round + 1 >= self.training_start:
                self.seeding = None
            else:
                self.seeding.restore(tensors, list(self.params))
        return self.round


def run_hosts_lockstep(
    cfg: ExperimentConfig,
    data: FederatedData,
    neighbours: Mapping[int, Sequence[int]],
    transport_factory: Any,
    hosts: int = 2,
    experiment: str = "lockstep",
) -> list[ClientHost]:
    """Run `cfg` over `hosts` ClientHosts in one thread, in phases (all train, then all merge).

    For tests and benchmarks on the in-memory transport: with batch aggregation the result
    must equal the simulator's.
    """
    n = data.num_clients
    groups = [list(range(h, n, hosts)) for h in range(hosts)]
    built = [
        ClientHost(cfg, experiment, g, data.subset(g), {c: neighbours[c] for c in g}, transport_factory())
        for g in groups
    ]
    for h in built:
        h.setup()
    for t in range(cfg.total_rounds):
        lockstep_round(built, t)
    return built


def lockstep_round(hosts: Sequence[ClientHost], t: int, timeout: float = 5.0) -> None:
    """Round t of `hosts` in one thread, in phases: all train, then all merge, then all finish.

    A robust round interleaves the hosts step by step: all publish gossip step s, then all collect it.
    """
    for h in hosts:
        h.local_step(t)
    gossiping = [h for h in hosts if h.gossip is not None]
    steps = max((h.gossip.steps for h in gossiping if h.gossip is not None), default=0)
    for s in range(steps):
        if s > 0:
            for h in gossiping:
                h.consensus_publish(s)
        for h in gossiping:
            if not h.consensus_collect(s, timeout):
                raise RuntimeError(f"round {t}: host missed gossip step {s} in lockstep mode")
    for h in gossiping:
        h.consensus_finish()
    for h in hosts:
        if h not in gossiping and not h.collect(timeout=timeout):
            raise RuntimeError(f"round {t}: host missed neighbour models in lockstep mode")
    for h in hosts:
        h.finish_round()
