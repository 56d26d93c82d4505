"""Driver 1, the simulator: lockstep rounds, every client in one process, vectorized.

It runs an algorithm (dfca.algorithms) exactly as the message driver does, but delivers each exchange
at once, as a mask over the graph's edges. Asynchrony is simulated per exchange: every message is lost
with probability `network.message_loss`; in a round's first exchange it arrives one round late with
probability `network.message_delay`. A late message misses its exchange; where the exchange takes stale
messages and `runtime.staleness` is `merge`, it is folded into the next round's exchange of the same
name, as the message driver does with a message of an earlier round. An upload to a central role is
lost, or late and past its deadline, with the same probabilities; the server's models always arrive.

Without loss or delay, sequential aggregation (eq. 8) equals batch aggregation (eq. 7) for any arrival
order (core.aggregation), so `aggregation` changes nothing here; it decides when the message driver
folds each model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import Tensor

from dfca.algorithms import Algorithm, Exchange, HostContext, Inbox, Outbox, clients_of, schedule_of, server_of
from dfca.algorithms.base import SERVER, Evaluation, check_finite, report_of
from dfca.config import ExperimentConfig
from dfca.data import FederatedData, build_federated_data
from dfca.devices import resolve_device
from dfca.graph import adjacency_matrix, build_graph, neighbours
from dfca.heap import keep_freed_memory
from dfca.identity import principals, topics
from dfca.models.batched import BatchedModel, Params
from dfca.models.build import model_from_config
from dfca.results.collapse import CollapseWatch
from dfca.results.evaluation import (
    assignment_counts,
    clustering_scores,
    disagreement,
    index_consistency,
    populated_clusters,
)
from dfca.run_size import check_fits_memory, leaves_room
from dfca.wire.codec import PAYLOAD_DTYPES, Envelope, as_received, body_bytes, headers_of, message_bytes

log = logging.getLogger(__name__)

RoundCallback = Callable[[dict[str, Any]], None]


@dataclass
class SimContext:
    cfg: ExperimentConfig
    model: BatchedModel
    data: FederatedData
    graph: nx.Graph
    adjacency: Tensor  # [N, N] bool
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def n(self) -> int:
        return self.adjacency.shape[0]


def prepare(cfg: ExperimentConfig, data: FederatedData | None = None) -> SimContext:
    device = resolve_device(cfg.device)
    if data is None:
        check_fits_memory(cfg.estimated_bytes(), f"this run of {cfg.data.clients} clients", str(device))
    data = (data if data is not None else build_federated_data(cfg)).to(device)
    graph = build_graph(cfg.topology, data.num_clients, cfg.seed)
    model = model_from_config(cfg.model, data.input_shape, data.num_classes, device)
    if cfg.model.kind == "torch":  # a module's copies are known now
        check_fits_memory(cfg.estimated_bytes(model_values=model.num_params()),
                          f"this run of {cfg.data.clients} clients", str(device))
    return SimContext(cfg, model, data, graph, adjacency_matrix(graph, data.num_clients).to(device), device)


def delivery_masks(
    adjacency: Tensor, loss: float, delay: float, generator: torch.Generator
) -> tuple[Tensor, Tensor | None]:
    """(on_time, late) [N, N] bool masks over the graph's directed edges."""
    if loss == 0 and delay == 0:
        return adjacency, None
    u = torch.rand(adjacency.shape, generator=generator).to(adjacency.device)
    kept = adjacency & (u >= loss)
    if delay == 0:
        return kept, None
    late = kept & (torch.rand(adjacency.shape, generator=generator).to(adjacency.device) < delay)
    return kept & ~late, late


class Simulation:
    """An algorithm (and its central role, if any) over all N clients, round by round."""

    def __init__(self, ctx: SimContext) -> None:
        cfg = ctx.cfg
        self.ctx, self.schedule = ctx, schedule_of(cfg)
        graph = neighbours(ctx.graph)
        self.algorithm = clients_of(HostContext(cfg, ctx.model, ctx.data, list(range(ctx.n)), graph, ctx.device, True))
        self.server = server_of(HostContext(cfg, ctx.model, None, [SERVER], graph, ctx.device, True))
        self.net = torch.Generator().manual_seed(cfg.seed * 31 + 1)
        self.gossip = torch.Generator().manual_seed(cfg.seed * 31 + 11)
        self.uplink = torch.Generator().manual_seed(cfg.seed * 31 + 5)
        self.late: tuple[str, Tensor, Outbox, int] | None = None  # a round's late messages, kept for the next
        self.round_bytes = 0.0  # payload bytes a client sent in the last round (all receivers), mean over clients
        self.total_bytes, self.rounds_run = 0.0, 0  # the same summed over the run's rounds, and how many ran
        if warning := self.algorithm.graph_warning(ctx.graph):
            log.warning(warning)

    @property
    def participants(self) -> list[Algorithm]:
        return [self.algorithm] if self.server is None else [self.algorithm, self.server]

    def side(self, name: str) -> Algorithm:
        return self.server if name == "server" and self.server is not None else self.algorithm

    def run_round(self, t: int) -> None:
        cfg, adjacency = self.ctx.cfg, self.ctx.adjacency
        on_time, late = delivery_masks(adjacency, cfg.network.message_loss, cfg.network.message_delay, self.net)
        merge_late = cfg.runtime.staleness == "merge"
        earlier, self.late = self.late, None
        for p in self.participants:
            p.begin_round(t)
        sent = 0.0
        for index, ex in enumerate(self.algorithm.exchanges(t)):
            out = self.side(ex.sender).send(ex)
            sent += self.traffic(ex, out, t)
            if cfg.runtime.payload_dtype != "float32":  # the values the receivers decode
                received = as_received(self.side(ex.sender).payload(ex), out.tensors,
                                       PAYLOAD_DTYPES[cfg.runtime.payload_dtype])
                out = Outbox(out.row, out.part, received, out.lengths)
            receiver = self.side(ex.receiver)
            mask = on_time if index == 0 else adjacency & self.kept(adjacency.shape)
            receiver.receive(ex, Inbox(self.delivered(ex, out, mask), self.senders(ex, out), out.part, out.tensors, t))
            if ex.stale_ok and merge_late and earlier is not None and earlier[0] == ex.name:
                _, late_mask, late_out, sent_in = earlier
                receiver.receive(ex, Inbox(late_mask[:, late_out.row], self.senders(ex, late_out), late_out.part,
                                           late_out.tensors, sent_in))
            if index == 0 and late is not None and ex.stale_ok and merge_late and ex.receiver == "clients":
                self.late = (ex.name, late, out.frozen(), t)
            for p in self.participants:
                p.end_exchange(ex)
        for p in self.participants:
            p.end_round(t)
        check_finite(self.algorithm, t)
        self.round_bytes = sent / self.ctx.n
        self.total_bytes += self.round_bytes
        self.rounds_run += 1

    def kept(self, shape: torch.Size) -> Tensor:
        """A later exchange's mask of messages not lost (it has no late ones: they miss their step)."""
        loss = self.ctx.cfg.network.message_loss
        if loss == 0:
            return torch.ones(shape, dtype=torch.bool, device=self.ctx.device)
        return (torch.rand(shape, generator=self.gossip) >= loss).to(self.ctx.device)

    def delivered(self, ex: Exchange, out: Outbox, mask: Tensor) -> Tensor:
        n, messages = self.ctx.n, out.row.shape[0]
        if ex.sender == "server":
            return torch.ones(n, messages, dtype=torch.bool, device=self.ctx.device)
        if ex.receiver == "server":
            net = self.ctx.cfg.network
            arrived = torch.ones(n, dtype=torch.bool)
            if net.message_loss or net.message_delay:  # the upload reached the server before its deadline
                arrived = torch.rand(n, generator=self.uplink) >= 1.0 - (1 - net.message_loss) * (1 - net.message_delay)
            return arrived.to(self.ctx.device)[out.row].unsqueeze(0)
        return mask[:, out.row]

    def run_metrics(self, ev: Evaluation) -> dict[str, float]:
        """The algorithm's metrics over every client (`Algorithm.run_metrics`), as the metrics service computes them."""
        ctx = self.ctx
        report = report_of(ev, list(range(ctx.n)), ctx.data.true_cluster)
        return type(self.algorithm).run_metrics(ctx.cfg, report, lambda: ctx.data, neighbours(ctx.graph))

    def senders(self, ex: Exchange, out: Outbox) -> Tensor:
        return torch.full_like(out.row, SERVER) if ex.sender == "server" else out.row

    def traffic(self, ex: Exchange, out: Outbox, t: int) -> float:
        """Bytes the clients sent in `ex`: each message as the message driver encodes and publishes it
        (wire.message_bytes: the safetensors body with models at `runtime.payload_dtype`, the headers, the routing
        key), once per receiver. What a central role sends is not a client's traffic."""
        if ex.sender == "server":
            return 0.0
        cfg = self.ctx.cfg
        spec = self.side(ex.sender).payload(ex)
        model_dtype = PAYLOAD_DTYPES[cfg.runtime.payload_dtype]

        def size(rows: int | None) -> int:  # a ragged tensor carries `rows` rows (None: all it has)
            return body_bytes(spec, {n: tuple(s.shape) if not s.ragged else
                                     (out.tensors[n].shape[1] if rows is None else rows, *out.tensors[n].shape[2:])
                                     for n, s in spec.items()}, model_dtype)

        experiment = topics.experiment_id(cfg.name, "0" * topics.EXPERIMENT_SUFFIX)  # as long as the runtime's
        workers = cfg.runtime.workers or 1
        lengths = [None] * out.row.shape[0] if out.lengths is None else out.lengths.tolist()
        per_message = torch.tensor([
            message_bytes(size(rows), headers_of(Envelope(experiment, sender, t, ex.name, ex.step, part), model_dtype),
                          topics.model_key(experiment, principals.host_of(sender, workers), sender, part))
            for sender, part, rows in zip(out.row.tolist(), out.part.tolist(), lengths, strict=True)
        ], dtype=torch.float64)
        if ex.receiver == "server":
            return float(per_message.sum())
        receivers = self.ctx.adjacency[out.row].sum(1).double().cpu()
        return float((per_message * receivers).sum())


@dataclass
class RunResult:
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    final_models: dict[str, Params]
    assigned: Tensor
    graph: nx.Graph
    simulation: Simulation
    warnings: list[str] = field(default_factory=list)

    @property
    def algorithm(self) -> Algorithm:
        return self.simulation.algorithm


def round_record(sim: Simulation, t: int, sample: torch.Generator) -> dict[str, Any]:
    ev = sim.algorithm.evaluate()
    truth, k = sim.ctx.data.true_cluster, sim.ctx.cfg.clusters
    assigned = ev.assigned.cpu()
    record: dict[str, Any] = {
        "round": t + 1,
        "test_accuracy": float(ev.test_accuracy.mean()),
        "test_accuracy_std": float(ev.test_accuracy.std()) if ev.test_accuracy.numel() > 1 else 0.0,
        "train_loss": float(ev.train_loss.mean()),
        "assignment_counts": assignment_counts(assigned, k),
        "populated_clusters": populated_clusters(assigned),
        **clustering_scores(assigned, truth.cpu()),  # none where the true clusters are unknown
        "bytes_sent_per_client": sim.round_bytes,
        "bytes_sent_total": sim.total_bytes,  # per client, every round so far (seeding included)
    }
    if ev.cluster_params is not None:  # the simulator's alone: a runtime worker sees only its own clients' models
        began = time.perf_counter()
        record["disagreement"] = disagreement(ev.cluster_params)
        record["index_consistency"] = index_consistency(ev.cluster_params, sampled_edges(sim.ctx.adjacency, sample))
        record["consensus_seconds"] = time.perf_counter() - began  # of the round's `seconds`
    record.update(sim.run_metrics(ev))
    return record


def sampled_edges(adjacency: Tensor, generator: torch.Generator, most: int = 200) -> Tensor:
    """At most `most` undirected edges of the graph, as an adjacency matrix (keeps metrics cheap)."""
    src, dst = torch.nonzero(torch.triu(adjacency, diagonal=1).cpu(), as_tuple=True)
    if src.numel() > most:
        keep = torch.randperm(src.numel(), generator=generator)[:most]
        src, dst = src[keep], dst[keep]
    out = torch.zeros_like(adjacency)
    out[src.to(adjacency.device), dst.to(adjacency.device)] = True
    return out


def keep_run_heap(ctx: SimContext) -> bool:
    """The heap as a run keeps it (dfca.heap): each round's large tensors reuse the last round's memory, not fresh
    pages; those above 32 MiB too where the run's tensors take at most half the memory available."""
    cfg = ctx.cfg
    values = ctx.model.num_params() if cfg.model.kind == "torch" else None
    return keep_freed_memory(large_blocks=leaves_room(cfg.estimated_bytes(model_values=values)))


def simulate(
    cfg: ExperimentConfig,
    data: FederatedData | None = None,
    on_round: RoundCallback | None = None,
) -> RunResult:
    """Run `cfg` in the simulator and return its history, summary and final models."""
    torch.set_flush_denormal(True)  # denormals made some rounds 5-8x slower
    start = time.perf_counter()
    ctx = prepare(cfg, data)
    keep_run_heap(ctx)
    sim = Simulation(ctx)
    schedule = sim.schedule
    sample = torch.Generator().manual_seed(cfg.seed * 31 + 2)
    watch = CollapseWatch(1 if type(sim.algorithm).infers_clusters else cfg.clusters)
    history: list[dict[str, Any]] = []
    for t in range(schedule.total_rounds):
        t0 = time.perf_counter()
        sim.run_round(t)
        finished = sim.algorithm.finished  # its own stopping rule (FedCRef's): this round is the last
        if (t + 1) % cfg.eval_every == 0 or t + 1 == schedule.total_rounds or finished:
            record = round_record(sim, t, sample)
            record["seconds"] = time.perf_counter() - t0
            record.update(schedule.phase_fields(t))  # phase, phase_round (1-based in its phase), phase_rounds
            record["warnings"] = watch.observe(record) if sim.algorithm.clusters_clients else []
            history.append(record)
            if on_round is not None:
                on_round(record)
        if finished:
            break
    final = sim.algorithm.evaluate()
    truth = sim.ctx.data.true_cluster.cpu()
    summary = build_summary(cfg, history, final.test_accuracy.cpu(), final.assigned.cpu(), truth,
                            time.perf_counter() - start, watch.warnings)
    summary["device"] = str(sim.ctx.device)
    summary["bytes_sent_per_client_per_round"] = sim.total_bytes / max(sim.rounds_run, 1)  # evaluated or not
    summary.update(sim.run_metrics(final))
    summary["refused"] = dict(sim.algorithm.refused)  # arrivals the algorithm would not use, by reason
    summary["screened"] = sim.algorithm.screened  # gossip (arrival, cluster) pairs dropped by screening
    summary.update(size_fields(sim.ctx.data))
    summary.update(last_rounds_means(history))
    models = (sim.server or sim.algorithm).final_models()
    return RunResult(history, summary, models, final.assigned.cpu(), sim.ctx.graph, sim, watch.warnings)


def size_fields(data: FederatedData) -> dict[str, Any]:
    """The clients' sizes as a summary reports them: train samples (min, median, max), the padding overhead (rows
    stored per real row, 1.0 where all clients are equal) and the size buckets (0: one padded set)."""
    sizes = data.train_sizes.float()
    return {"samples_per_client": [int(sizes.min()), float(sizes.median()), int(sizes.max())],
            "padding_overhead": data.padding_overhead, "size_buckets": len(data.buckets)}


def last_rounds_means(history: list[dict[str, Any]], rounds: int = 3) -> dict[str, float]:
    """Accuracy and macro-F1 averaged over the last `rounds` records, as DPMM-CFL's paper reports them."""
    last = history[-rounds:]
    if not last or "macro_f1" not in last[-1]:
        return {}
    return {"test_accuracy_last3": sum(h["test_accuracy"] for h in last) / len(last),
            "macro_f1_last3": sum(h["macro_f1"] for h in last) / len(last)}


def build_summary(
    cfg: ExperimentConfig,
    history: list[dict[str, Any]],
    accuracy: Tensor,
    assigned: Tensor,
    truth: Tensor,
    wall: float,
    warnings: list[str],
) -> dict[str, Any]:
    return {
        "name": cfg.name,
        "algorithm": cfg.algorithm,
        "variant": cfg.algorithm_class.variant(cfg),
        "init": cfg.init,
        "aggregation": cfg.aggregation,
        "rounds": cfg.rounds,
        "seeding_rounds": schedule_of(cfg).seeding_rounds,
        "clients": int(truth.numel()),
        "clusters": cfg.clusters,
        "seed": cfg.seed,
        "test_accuracy": float(accuracy.mean()),
        "test_accuracy_std": float(accuracy.std()) if accuracy.numel() > 1 else 0.0,
        **clustering_scores(assigned, truth, ari="cluster_ari"),  # none where the true clusters are unknown
        "populated_clusters": populated_clusters(assigned),
        "assignment_counts": assignment_counts(assigned, cfg.clusters),
        # payload bytes a client sent, all receivers together (a message to d neighbours counts d times), averaged
        # over the run's rounds, seeding rounds included; the same meaning in both drivers
        "bytes_sent_per_client_per_round": (sum(h.get("bytes_sent_per_client", 0.0) for h in history)
                                            / max(len(history), 1)),
        "wall_seconds": wall,
        "seconds_per_round": sum(h["seconds"] for h in history) / max(len(history), 1),
        "warnings": warnings,
    }
