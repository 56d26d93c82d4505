"""The simulator: lockstep rounds, all clients in one process, vectorized.

Aggregation is per-cluster mixing over the graph (core.aggregation). Asynchrony is simulated:
each message is lost with probability `network.message_loss`, and arrives one round late
with probability `network.message_delay`. Without loss or delay, sequential aggregation
(eq. 8) equals batch aggregation (eq. 7) for any arrival order, so both run as one mixing step.
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

from dfca.algorithms import Algorithm, SimContext, build_algorithm
from dfca.collapse import CollapseWatch
from dfca.config import ExperimentConfig
from dfca.data import FederatedData, build_federated_data
from dfca.evaluation import (
    assignment_counts,
    cluster_accuracy,
    cluster_ari,
    disagreement,
    index_consistency,
    populated_clusters,
)
from dfca.graph import adjacency_matrix, build_graph
from dfca.models import Params, build_model

log = logging.getLogger(__name__)

RoundCallback = Callable[[dict[str, Any]], None]


@dataclass
class RunResult:
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    final_models: dict[str, Params]
    assigned: Tensor
    graph: nx.Graph
    algorithm: Algorithm
    warnings: list[str] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but no CUDA device is available")
    if name != "cpu":
        log.warning("device: %s is accepted but not used yet: the simulator and hosts compute on the CPU", name)
    return torch.device(name)


def delivery_masks(
    adjacency: Tensor, loss: float, delay: float, generator: torch.Generator
) -> tuple[Tensor, Tensor | None]:
    """(on_time, late) [N, N] bool masks over the graph's directed edges."""
    if loss == 0 and delay == 0:
        return adjacency, None
    u = torch.rand(adjacency.shape, generator=generator)
    kept = adjacency & (u >= loss)
    if delay == 0:
        return kept, None
    late = kept & (torch.rand(adjacency.shape, generator=generator) < delay)
    return kept & ~late, late


def round_record(
    algo: Algorithm, t: int, truth: Tensor, k: int, adjacency: Tensor, sample: torch.Generator
) -> dict[str, Any]:
    ev = algo.evaluate()
    record: dict[str, Any] = {
        "round": t + 1,
        "test_accuracy": float(ev.test_accuracy.mean()),
        "test_accuracy_std": float(ev.test_accuracy.std()) if ev.test_accuracy.numel() > 1 else 0.0,
        "train_loss": float(ev.train_loss.mean()),
        "assignment_counts": assignment_counts(ev.assigned, k),
        "populated_clusters": populated_clusters(ev.assigned),
        "ari": cluster_ari(ev.assigned, truth),
        "cluster_acc": cluster_accuracy(ev.assigned, truth),
        "bytes_sent_per_client": algo.bytes_sent_per_client(),
    }
    if ev.cluster_params is not None:
        record["disagreement"] = disagreement(ev.cluster_params)
        record["index_consistency"] = index_consistency(ev.cluster_params, sampled_edges(adjacency, sample))
    return record


def sampled_edges(adjacency: Tensor, generator: torch.Generator, most: int = 200) -> Tensor:
    """At most `most` undirected edges of the graph, as an adjacency matrix (keeps metrics cheap)."""
    src, dst = torch.nonzero(torch.triu(adjacency, diagonal=1), as_tuple=True)
    if src.numel() > most:
        keep = torch.randperm(src.numel(), generator=generator)[:most]
        src, dst = src[keep], dst[keep]
    out = torch.zeros_like(adjacency)
    out[src, dst] = True
    return out


def prepare(cfg: ExperimentConfig, data: FederatedData | None = None) -> SimContext:
    data = data if data is not None else build_federated_data(cfg)
    graph = build_graph(cfg.topology, data.num_clients, cfg.seed)
    model = build_model(cfg.model.kind, data.input_shape, cfg.model.hidden, data.num_classes)
    return SimContext(cfg, model, data, graph, adjacency_matrix(graph, data.num_clients))


def simulate(
    cfg: ExperimentConfig,
    data: FederatedData | None = None,
    on_round: RoundCallback | None = None,
) -> RunResult:
    """Run `cfg` in the simulator and return its history, summary and final models."""
    torch.set_flush_denormal(True)  # denormals made some rounds 5-8x slower
    resolve_device(cfg.device)
    start = time.perf_counter()
    ctx = prepare(cfg, data)
    algo = build_algorithm(ctx)
    truth = ctx.data.true_cluster
    net = torch.Generator().manual_seed(cfg.seed * 31 + 1)
    sample = torch.Generator().manual_seed(cfg.seed * 31 + 2)
    watch = CollapseWatch(cfg.clusters)
    history: list[dict[str, Any]] = []
    for t in range(cfg.total_rounds):
        t0 = time.perf_counter()
        on_time, late = delivery_masks(ctx.adjacency, cfg.network.message_loss, cfg.network.message_delay, net)
        algo.run_round(t, on_time, late)
        if (t + 1) % cfg.eval_every == 0 or t + 1 == cfg.total_rounds:
            record = round_record(algo, t, truth, cfg.clusters, ctx.adjacency, sample)
            record["seconds"] = time.perf_counter() - t0
            record["phase"] = "seeding" if t < cfg.seeding_rounds else "training"
            record["warnings"] = watch.observe(record)
            history.append(record)
            if on_round is not None:
                on_round(record)
    final = algo.evaluate()
    wall = time.perf_counter() - start
    summary = build_summary(cfg, history, final.test_accuracy, final.assigned, truth, wall, watch.warnings)
    return RunResult(history, summary, algo.final_models(), final.assigned, ctx.graph, algo, watch.warnings)


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
        "variant": cfg.dfca.variant if cfg.algorithm == "dfca" else None,
        "init": cfg.init,
        "aggregation": cfg.aggregation,
        "rounds": cfg.rounds,
        "seeding_rounds": cfg.seeding_rounds,
        "clients": int(truth.numel()),
        "clusters": cfg.clusters,
        "seed": cfg.seed,
        "test_accuracy": float(accuracy.mean()),
        "test_accuracy_std": float(accuracy.std()) if accuracy.numel() > 1 else 0.0,
        "cluster_ari": cluster_ari(assigned, truth),
        "cluster_acc": cluster_accuracy(assigned, truth),
        "populated_clusters": populated_clusters(assigned),
        "assignment_counts": assignment_counts(assigned, cfg.clusters),
        "bytes_sent_per_client_per_round": history[-1]["bytes_sent_per_client"] if history else 0.0,
        "wall_seconds": wall,
        "seconds_per_round": sum(h["seconds"] for h in history) / max(len(history), 1),
        "warnings": warnings,
    }
