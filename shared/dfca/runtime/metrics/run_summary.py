"""From stored round reports to the simulator's views: per-round history and `summary.json`'s fields.

The summary is `dfca.simulator.build_summary` over the live clients' latest evaluation (clients of
failed workers are left out and listed under `failed_clients`), plus what only a distributed run
has: its status, message counts (applied, rejected by reason, dead-lettered, ...), timeouts,
restarts and where each restarted worker resumed. FedSPD's runs add each live client's `mixture`
(u_is) and, on mixture data, `mixture_error` (mean absolute error against the true mixtures); an algorithm
with metrics of its own (`Algorithm.run_metrics`: the k-means algorithms' GCD and CV) adds them, per round
and in the summary, computed as the simulator computes them.
Per-round seconds are the slowest worker's wall time for that round (workers wait for each other).
`bytes_sent_per_client_per_round` is what the simulator reports: the payload bytes a client sent, each message
counted once per receiver, averaged over the rounds.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import torch

from dfca.algorithms import CLIENTS, schedule_of
from dfca.config import ExperimentConfig
from dfca.core.soft_assignment import mixture_error
from dfca.data import FederatedData, build_federated_data
from dfca.graph import build_graph, neighbours
from dfca.results.evaluation import assignment_counts, clustering_scores, populated_clusters
from dfca.runtime.control.placement import data_on_workers
from dfca.runtime.metrics.metrics_store import MetricsStore, StoredExperiment, StoredReport
from dfca.simulator import build_summary, last_rounds_means

COUNTED_STATS = (
    "published",
    "applied",
    "ignored",
    "duplicates",
    "stale_dropped",
    "stale_merged",
    "not_neighbour",
    "screened",
    "timeouts",
    "blocked",
    "republished",
)


def latest_by_round(reports: Iterable[StoredReport]) -> dict[int, dict[int, StoredReport]]:
    """round -> worker -> the last report of that round (a restarted worker may re-run a round)."""
    out: dict[int, dict[int, StoredReport]] = defaultdict(dict)
    for report in reports:  # in arrival order: later ones win
        out[report.round][report.worker] = report
    return dict(sorted(out.items()))


def evaluated_clients(reports: Iterable[StoredReport], exclude: set[int]) -> dict[str, list[Any]]:
    """Concatenated evaluations of the given reports (every per-client field), without the `exclude` clients."""
    out: dict[str, list[Any]] = {
        "clients": [],
        "assigned": [],
        "test_accuracy": [],
        "train_loss": [],
        "true_cluster": [],
    }
    for report in reports:
        ev = report.evaluation
        if ev is None:
            continue
        for i, client in enumerate(ev["clients"]):
            if client in exclude:
                continue
            for key, values in ev.items():
                out.setdefault(key, []).append(values[i])
    return out


class DataOnWorkers(LookupError):
    """The experiment's data lives on its workers (`data.source: workers`): the metrics service never rebuilds it."""


@lru_cache(maxsize=4)
def _shards(config_json: str) -> FederatedData:
    cfg = ExperimentConfig.model_validate_json(config_json)
    if data_on_workers(cfg):
        raise DataOnWorkers(f"experiment {cfg.name}: its clients' data stays on the workers")
    return build_federated_data(cfg)


@lru_cache(maxsize=4)
def _graph(config_json: str) -> dict[int, list[int]]:
    cfg = ExperimentConfig.model_validate_json(config_json)
    return neighbours(build_graph(cfg.topology, cfg.data.clients, cfg.seed))


def algorithm_metrics(cfg: ExperimentConfig, report: dict[str, list[Any]]) -> dict[str, float]:
    """`Algorithm.run_metrics` over the reported clients (the graph the config draws, built once per config; data
    built, once, on demand)."""
    algorithm = CLIENTS.get(cfg.algorithm)
    if algorithm is None or not report.get("clients"):
        return {}
    key = cfg.model_dump_json()
    try:
        return algorithm.run_metrics(cfg, report, lambda: _shards(key), _graph(key))
    except DataOnWorkers:  # metrics computed from every client's data (the k-means GCD): not where data stays home
        return {}


def clustering_metrics(ev: dict[str, list[Any]], k: int) -> dict[str, Any]:
    acc = torch.tensor(ev["test_accuracy"], dtype=torch.float32)
    assigned = torch.tensor(ev["assigned"], dtype=torch.long)
    truth = torch.tensor(ev["true_cluster"], dtype=torch.long)
    return {
        "clients_evaluated": len(ev["clients"]),
        "test_accuracy": float(acc.mean()),
        "test_accuracy_std": float(acc.std()) if acc.numel() > 1 else 0.0,
        "train_loss": float(torch.tensor(ev["train_loss"]).mean()),
        "assignment_counts": assignment_counts(assigned, k),
        "populated_clusters": populated_clusters(assigned),
        **clustering_scores(assigned, truth),  # none where the true clusters are unknown
        "cluster_accuracy": per_cluster_accuracy(acc, assigned, k),
    }


def per_cluster_accuracy(acc: torch.Tensor, assigned: torch.Tensor, k: int) -> list[float | None]:
    return [float(acc[assigned == j].mean()) if bool((assigned == j).any()) else None for j in range(k)]


def history(experiment: StoredExperiment, reports: list[StoredReport]) -> list[dict[str, Any]]:
    """One record per round, like the simulator's metrics.jsonl (clustering fields on evaluated rounds); `round` is
    absolute (1-based, seeding rounds first), `phase`, `phase_round` and `phase_rounds` count it as people do
    (`RoundSchedule.phase_round`: seeding 1..S, then training 1..R)."""
    k = experiment.config.clusters
    schedule = schedule_of(experiment.config)
    failed = set(experiment.failed_clients)
    records = []
    for round_, by_worker in latest_by_round(reports).items():
        chosen = list(by_worker.values())
        record: dict[str, Any] = {
            "round": round_,
            **schedule.phase_fields(round_ - 1),
            "workers_reported": len(chosen),
            "complete": all(r.complete for r in chosen),
            "seconds": max(r.seconds for r in chosen),
            "lag_seconds": sum(r.lag_seconds for r in chosen) / len(chosen),
            "bytes_sent_per_client": sum(r.bytes_published for r in chosen)
            / max(sum(len(r.clients) for r in chosen), 1),
        }
        ev = evaluated_clients(chosen, failed)
        if ev["clients"]:
            record.update(clustering_metrics(ev, k))
            record.update(algorithm_metrics(experiment.config, ev))
        records.append(record)
    return records


def final_evaluation(reports: list[StoredReport], exclude: set[int]) -> dict[str, list[Any]]:
    """Every live client's latest evaluation."""
    latest: dict[int, tuple[int, dict[str, Any]]] = {}
    for report in reports:
        ev = report.evaluation
        if ev is None:
            continue
        for i, client in enumerate(ev["clients"]):
            if client in exclude or (client in latest and latest[client][0] > report.round):
                continue
            latest[client] = (report.round, {key: ev[key][i] for key in ev})
    out: dict[str, list[Any]] = defaultdict(list)
    for client in sorted(latest):
        for key, value in latest[client][1].items():
            out[key].append(value)
    return dict(out)


def last_stats(reports: Iterable[StoredReport]) -> dict[tuple[int, str], dict[str, Any]]:
    """Each (worker, incarnation)'s latest stats: its running totals (DriverStats.as_dict)."""
    return {(report.worker, report.incarnation): report.stats for report in reports}


def worker_phase_totals(reports: Iterable[StoredReport], key: str) -> dict[int, dict[str, float]]:
    """Per worker, each phase's cumulative stats[key] ("seconds" or "cpu_seconds": DriverStats) summed over its
    incarnations."""
    totals: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (worker, _), stats in last_stats(reports).items():
        for phase, value in (stats.get(key) or {}).items():
            totals[worker][str(phase)] += float(value)
    return {w: dict(phases) for w, phases in totals.items()}


def message_totals(reports: Iterable[StoredReport], dead_lettered: int) -> dict[str, Any]:
    """Cumulative counters summed over every worker incarnation (each reports its own running totals)."""
    last = last_stats(reports)
    totals: dict[str, Any] = {key: sum(int(s.get(key, 0)) for s in last.values()) for key in COUNTED_STATS}
    rejected: Counter[str] = Counter()
    for stats in last.values():
        rejected.update({str(k): int(v) for k, v in stats.get("rejected", {}).items()})
    totals["rejected"] = dict(rejected)
    totals["rejected_total"] = sum(rejected.values())
    totals["dead_lettered"] = dead_lettered
    return totals


def summarize(
    experiment: StoredExperiment,
    reports: list[StoredReport],
    worker_events: list[dict[str, Any]],
    dead_lettered: int,
) -> dict[str, Any]:
    cfg = experiment.config
    failed = set(experiment.failed_clients)
    rounds = history(experiment, reports)
    final = final_evaluation(reports, failed)
    accuracy = torch.tensor(final.get("test_accuracy", []), dtype=torch.float32)
    assigned = torch.tensor(final.get("assigned", []), dtype=torch.long)
    truth = torch.tensor(final.get("true_cluster", []), dtype=torch.long)
    end = experiment.finished_at or max((r.at for r in reports), default=experiment.started_at or 0.0)
    wall = max(end - (experiment.started_at or end), 0.0)
    if accuracy.numel():
        summary = build_summary(cfg, rounds, accuracy, assigned, truth, wall, [])
    else:
        summary = {
            "name": cfg.name,
            "algorithm": cfg.algorithm,
            "rounds": cfg.rounds,
            "seeding_rounds": schedule_of(cfg).seeding_rounds,
            "clients": 0,
            "test_accuracy": None,
            "cluster_ari": None,
            "cluster_acc": None,
            "populated_clusters": 0,
            "wall_seconds": wall,
            "seconds_per_round": None,
        }
    summary.update(mixture_fields(final))
    summary.update(algorithm_metrics(cfg, final))
    summary.update(last_rounds_means([r for r in rounds if "test_accuracy" in r]))
    summary.update(latest_phase(cfg, rounds))
    incarnations: dict[int, set[str]] = defaultdict(set)
    for event in worker_events:
        incarnations[event["worker"]].add(event["incarnation"])
    summary.update(
        {
            "id": experiment.id,
            "status": experiment.status,
            "clients_total": cfg.data.clients,
            "failed_clients": sorted(failed),
            "rounds_completed": max((r["round"] for r in rounds), default=0),
            "messages": message_totals(reports, dead_lettered),
            "worker_restarts": {str(w): len(i) - 1 for w, i in sorted(incarnations.items()) if len(i) > 1},
            "resumed_from": {str(e["worker"]): e["resumed_from"] for e in worker_events if e["state"] == "resumed"},
            "devices": {str(e["worker"]): e["device"] for e in worker_events if e["device"]},  # the latest each
        }
    )
    return summary


def latest_phase(cfg: ExperimentConfig, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the run stands, as people count rounds: the latest round's `phase`, `phase_round` and `phase_rounds`
    (before any round: the first seeding round's phase, or training, at 0)."""
    if rounds:
        last = rounds[-1]
        return {key: last[key] for key in ("phase", "phase_round", "phase_rounds")}
    return {**schedule_of(cfg).phase_fields(0), "phase_round": 0}


def summary_of(store: MetricsStore, experiment: str) -> dict[str, Any]:
    """The summary of an experiment the store knows."""
    stored = store.experiment(experiment)
    assert stored is not None
    return summarize(stored, store.reports(experiment), store.worker_events(experiment), store.dead_letters(experiment))


def mixture_fields(final: dict[str, list[Any]]) -> dict[str, Any]:
    """FedSPD: every client's u_is by client id, and their error against the true mixtures when known."""
    if not final.get("mixture"):
        return {}
    out: dict[str, Any] = {"mixture": {str(c): m for c, m in zip(final["clients"], final["mixture"], strict=True)}}
    truth = final.get("true_mixture")
    if truth and len(truth) == len(final["mixture"]):
        out["mixture_error"] = mixture_error(torch.tensor(final["mixture"]), torch.tensor(truth))
    return out
