"""What storing a round report costs the metrics service, one transaction per event against one per burst.

The metrics service stores every worker's round report (and worker events) in its SQL store. This times its own
handler, `MetricsCollector`, on a fresh SQLite file: `on_event` for each report (a transaction and commit each, as
the service once did) against `on_events` for bursts of `--batch` reports (one transaction each, as the service now
stores what is there at once), and the config check of each report as the collector does it now (the
experiment's config parsed once) against reading and parsing it from the store for each report (before). Reports
look like the runtime benchmark's: 3 workers of 8 clients, every round evaluated.

    python benchmarks/metrics_store.py [--rounds 100] [--dir DIR] [--out docs/results/metrics_store_runs.jsonl]

Prints CPU and wall milliseconds per report for each way, the ratio to one commit per report, and appends the
figures, with the commit and the machine's load, to --out. Where the file lies matters (a commit syncs it): `--dir`
should be on the disk the service writes to (the default: a temporary folder beside this repository).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from resumable_runs import RESULTS, commit
from runtime_benchmark import bench_config

from dfca.config import ExperimentConfig
from dfca.runtime.control.experiments import check_round
from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.protocol.messages import ExperimentEvent, RoundReport
from dfca.transport import InMemoryTransport
from services.metrics.main import MetricsCollector

WORKERS, CLIENTS_PER_WORKER = 3, 8


def round_reports(rounds: int) -> list[RoundReport]:
    """A run's round reports, round by round, each worker's in turn."""
    reports = []
    for t in range(1, rounds + 1):
        for w in range(WORKERS):
            clients = list(range(w, WORKERS * CLIENTS_PER_WORKER, WORKERS))
            evaluation = {"clients": clients, "assigned": [c % 2 for c in clients], "test_accuracy": [0.9] * 8,
                          "train_loss": [0.3] * 8, "true_cluster": [c % 2 for c in clients]}
            stats = {"published": 8 * t, "applied": 30 * t, "seconds": {"train": 0.02 * t, "receive": 0.06 * t},
                     "cpu_seconds": {"train": 0.02 * t, "receive": 0.06 * t, "loop": 0.1 * t}}
            reports.append(RoundReport(deployment="bench", experiment="e", worker=w, incarnation="i", round=t,
                                       clients=clients, complete=True, seconds=0.15, evaluation=evaluation,
                                       stats=stats))
    return reports


def timed(work: Any, count: int) -> dict[str, float]:
    """CPU and wall milliseconds per item of `work()`, which handles `count` items."""
    cpu, wall = time.process_time(), time.perf_counter()
    work()
    return {"cpu_ms": 1e3 * (time.process_time() - cpu) / count, "wall_ms": 1e3 * (time.perf_counter() - wall) / count}


def store_reports(folder: Path, reports: list[RoundReport], config: ExperimentConfig, batch: int) -> dict[str, float]:
    """Per report: the collector storing `reports` (one `on_event` each, or `on_events` of `batch` at a time) into a
    fresh store whose experiment is known."""
    store = MetricsStore(f"sqlite:///{folder / f'batch{batch}.db'}")
    collector = MetricsCollector(InMemoryTransport(), store, "bench")
    collector.on_event(ExperimentEvent(deployment="bench", experiment="e", status="running", config=config))
    if batch == 1:
        figures = timed(lambda: [collector.on_event(r) for r in reports], len(reports))
    else:
        figures = timed(lambda: [collector.on_events(reports[i:i + batch]) for i in range(0, len(reports), batch)],
                        len(reports))
    assert len(store.reports("e")) == len(reports), "every report stored once"
    return figures


def config_checks(folder: Path, reports: list[RoundReport], config: ExperimentConfig) -> dict[str, dict[str, float]]:
    """Per report: the round check on the experiment's config read and parsed from the store (before) against the
    collector's, parsed once per experiment (now)."""
    store = MetricsStore(f"sqlite:///{folder / 'configs.db'}")
    collector = MetricsCollector(InMemoryTransport(), store, "bench")
    collector.on_event(ExperimentEvent(deployment="bench", experiment="e", status="running", config=config))

    def from_store() -> None:
        for report in reports:
            stored = store.experiment(report.experiment)
            assert stored is not None
            check_round(report.experiment, stored.config, report)

    def cached() -> None:
        for report in reports:
            config_now = collector.config_of(report.experiment)
            assert config_now is not None
            check_round(report.experiment, config_now, report)

    return {"from the store": timed(from_store, len(reports)), "parsed once": timed(cached, len(reports))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--batches", default="1,3,10", help="reports per transaction; 1: one commit per report")
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--out", type=Path, default=Path(RESULTS) / "metrics_store_runs.jsonl")
    args = parser.parse_args()
    config = ExperimentConfig.model_validate(bench_config(args.rounds))
    reports = round_reports(args.rounds)
    record: dict[str, Any] = {"commit": commit(), "load_before": os.getloadavg()[0], "args": {
        "rounds": args.rounds, "batches": args.batches, "dir": str(args.dir)}, "reports": len(reports)}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=".metrics-store-bench-") as tmp:
        folder = Path(tmp)
        record["per_report"] = {int(b): store_reports(folder, reports, config, int(b)) for b in args.batches.split(",")}
        record["config_check"] = config_checks(folder, reports, config)
    record["load_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")

    one = record["per_report"].get(1)
    print(f"storing {len(reports)} round reports ({WORKERS} workers x {args.rounds} rounds) in {args.dir}:\n")
    print("| reports per transaction | CPU ms a report | wall ms a report | CPU against one each |\n|---|---|---|---|")
    for batch, figures in record["per_report"].items():
        ratio = f"{figures['cpu_ms'] / one['cpu_ms']:.2f}x" if one else ""
        print(f"| {batch} | {figures['cpu_ms']:.2f} | {figures['wall_ms']:.2f} | {ratio} |")
    print("\n| a report's round check | CPU ms a report |\n|---|---|")
    for way, figures in record["config_check"].items():
        print(f"| {way} | {figures['cpu_ms']:.3f} |")
    print(f"\nappended to {args.out} (commit {record['commit']}, load {record['load_before']:.2f} -> "
          f"{record['load_after']:.2f})")


if __name__ == "__main__":
    main()
