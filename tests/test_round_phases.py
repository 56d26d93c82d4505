"""One round numbering everywhere: seeding 1..S, then training 1..R, in `dfca run`'s bars, metrics.jsonl and
summary.json, the metrics service's round views, and the plots' series (x axis, seeding span, ± std band,
clients per cluster, bytes per round)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from PIL import Image
from typer.testing import CliRunner

from dfca.algorithms import schedule_of
from dfca.cli.main import app
from dfca.config import ExperimentConfig
from dfca.results.outputs import (
    cluster_counts,
    plot_history,
    round_x,
    seeding_span,
    std_band,
    traffic_series,
    training_ticks,
)
from dfca.runtime.metrics.experiment_results import plot_files
from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.metrics.run_summary import history, summary_of
from dfca.runtime.protocol.messages import ExperimentEvent, RoundReport
from dfca.transport import InMemoryTransport
from services.metrics.main import MetricsCollector, create_app

SMALL = {
    "name": "phases", "algorithm": "dfca", "init": "global", "clusters": 2, "rounds": 3, "seed": 0,
    "data": {"dataset": "digits", "rotations": [0, 180], "clients": 12, "train_per_client": 40, "test_per_client": 10},
    "model": {"kind": "mlp", "hidden": 16},
    "train": {"lr": 0.1, "local_epochs": 1, "batch_size": 20},
    "topology": {"kind": "erdos_renyi", "p": 0.5},
}


def rows(seeding: int, training: int, clients: int = 10) -> list[dict[str, Any]]:
    """Synthetic metrics rows: absolute rounds 1..S+R, accuracy rising, one client moving cluster per round."""
    out = []
    for r in range(1, seeding + training + 1):
        moved = min(r, clients)
        out.append({"round": r, "test_accuracy": min(0.1 * r, 0.95), "test_accuracy_std": 0.2, "ari": 0.5,
                    "assignment_counts": [clients - moved, moved], "populated_clusters": 2,
                    "bytes_sent_per_client": 1000.0 * r})
    return out


def test_round_x_counts_training_rounds_and_keeps_seeding_inside_its_span() -> None:
    x = round_x(list(range(1, 8 + 10 + 1)), seeding_rounds=8)
    assert min(x) > 0  # no negative (or zero) round on the axis
    assert x[8:] == [float(r) for r in range(1, 11)]  # training rounds at 1..R
    lo, hi = seeding_span(8)
    assert all(lo < v < hi for v in x[:8])  # every seeding round inside the span ...
    assert all(v > hi for v in x[8:]) and hi < 1  # ... and no training round; it ends before round 1
    assert lo > 0
    assert x[:8] == sorted(x[:8]) and len(set(x[:8])) == 8  # in order, one point each
    assert seeding_span(0) is None
    assert round_x([1, 2, 3]) == [1.0, 2.0, 3.0]  # without seeding: the rows' rounds


def test_ticks_are_whole_training_rounds_from_1() -> None:
    for last in (1, 3, 10, 60, 500):
        ticks = training_ticks(last)
        assert ticks[0] == 1 and ticks[-1] <= last and all(isinstance(t, int) for t in ticks)
        assert len(ticks) <= 12
    assert training_ticks(10)[-1] == 10


def test_the_std_band_is_mean_plus_and_minus_std_clipped_to_0_1() -> None:
    history = [{"round": 1, "test_accuracy": 0.1, "test_accuracy_std": 0.3},
               {"round": 2, "test_accuracy": 0.5, "test_accuracy_std": 0.1},
               {"round": 3, "test_accuracy": 0.9, "test_accuracy_std": 0.2},
               {"round": 4, "train_loss": 1.0}]  # not evaluated: left out
    x, lower, upper = std_band(history, seeding_rounds=1)
    assert x[1:] == [1.0, 2.0] and 0 < x[0] < 1
    assert lower == pytest.approx([0.0, 0.4, 0.7])
    assert upper == pytest.approx([0.4, 0.6, 1.0])


def test_cluster_counts_sum_to_the_clients_every_round_and_pad_a_growing_k() -> None:
    x, counts = cluster_counts(rows(3, 5, clients=10), seeding_rounds=3)
    assert len(counts) == 2 and len(x) == 8
    assert all(sum(c[i] for c in counts) == 10 for i in range(len(x)))
    assert counts[1] == [1, 2, 3, 4, 5, 6, 7, 8]
    _, grown = cluster_counts([{"round": 1, "assignment_counts": [4]}, {"round": 2, "assignment_counts": [1, 3]}])
    assert grown == [[4, 1], [0, 3]]


def test_traffic_series_is_the_bytes_each_round() -> None:
    history = rows(2, 3)
    history.append({"round": 6})  # a row without traffic
    x, sent = traffic_series(history, seeding_rounds=2)
    assert sent == [1000.0, 2000.0, 3000.0, 4000.0, 5000.0]
    assert x[2:] == [1.0, 2.0, 3.0] and all(0 < v < 1 for v in x[:2])


def test_plot_history_writes_the_plots_with_a_traffic_plot(tmp_path: Path) -> None:
    paths = plot_history(tmp_path, rows(8, 10), "t", seeding_rounds=8)
    assert sorted(p.name for p in paths) == ["accuracy.png", "ari.png", "clusters.png", "traffic.png"]
    for path in paths:
        assert Image.open(path).size[0] > 300
    assert [p.name for p in plot_history(tmp_path, [{"round": 1, "gcd": 1.0, "cv": 0.5, "test_accuracy": 0.9,
                                                     "bytes_sent_per_client": 10.0}], "k")] == [
        "gcd.png", "cv.png", "accuracy.png", "traffic.png"]


def test_dfca_run_numbers_seeding_and_training_rounds_apart(tmp_path: Path) -> None:
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(SMALL))
    seeding = schedule_of(ExperimentConfig.model_validate(SMALL)).seeding_rounds
    assert seeding > 0
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(cfg_path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    bars = [line.split() for line in result.output.splitlines() if line.startswith(("seeding ", "rounds "))]
    assert [(bar[0], bar[2]) for bar in bars] == [("seeding", f"{seeding}/{seeding}"), ("rounds", "3/3")]
    assert f"{seeding + 3}/{seeding + 3}" not in result.output  # never the two phases as one count
    assert re.search(r"│ rounds\s*│\s*3\s*│", result.output)  # the results table: training rounds ...
    assert re.search(rf"seeding_rounds\s*│\s*{seeding}\s*│", result.output)  # ... and the seeding before them
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == list(range(1, seeding + 4))  # the absolute round, as before
    assert [(r["phase"], r["phase_round"], r["phase_rounds"]) for r in lines] == (
        [("seeding", s, seeding) for s in range(1, seeding + 1)] + [("training", t, 3) for t in (1, 2, 3)])
    assert all(sum(r["assignment_counts"]) == 12 for r in lines)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeding_rounds"] == seeding and summary["rounds"] == 3
    for png in ("accuracy.png", "ari.png", "clusters.png", "traffic.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


CFG = ExperimentConfig.model_validate({"name": "m", "clusters": 2, "rounds": 2,
                                       "data": {"dataset": "digits", "clients": 4}})


def report(worker: int, round_: int) -> RoundReport:
    clients = [worker, worker + 2]
    moved = [0, 1] if round_ < 4 else [1, 1]  # from round 4 on, both of worker 1's clients sit in cluster 1
    evaluation = {"clients": clients, "assigned": [0, 1] if worker == 0 else moved,
                  "test_accuracy": [0.5, 0.7], "train_loss": [1.0, 0.5], "true_cluster": [0, 1]}
    return RoundReport(deployment="d", experiment="m1", worker=worker, incarnation="a", round=round_,
                       clients=clients, complete=True, seconds=1.0, evaluation=evaluation, stats={},
                       bytes_published=100 * round_, at=1000.0 + round_)


@pytest.fixture
def store(tmp_path: Path) -> MetricsStore:
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    collector = MetricsCollector(InMemoryTransport(), store, "d")
    collector.on_event(ExperimentEvent(deployment="d", experiment="m1", status="running", config=CFG, at=1000.0))
    for round_ in range(1, schedule_of(CFG).total_rounds + 1):
        for worker in (0, 1):
            collector.on_event(report(worker, round_))
    collector.on_event(ExperimentEvent(deployment="d", experiment="m1", status="completed", config=CFG, at=1020.0))
    return store


def test_the_runtime_round_views_carry_each_rounds_phase(store: MetricsStore) -> None:
    seeding = schedule_of(CFG).seeding_rounds
    assert seeding > 0  # robust DFCA by default
    stored = store.experiment("m1")
    assert stored is not None
    records = history(stored, store.reports("m1"))
    assert [(r["round"], r["phase"], r["phase_round"], r["phase_rounds"]) for r in records] == (
        [(s, "seeding", s, seeding) for s in range(1, seeding + 1)]
        + [(seeding + 1, "training", 1, 2), (seeding + 2, "training", 2, 2)])
    assert all(sum(r["assignment_counts"]) == 4 for r in records)
    summary = summary_of(store, "m1")
    assert summary["seeding_rounds"] == seeding and summary["rounds"] == 2
    assert (summary["phase"], summary["phase_round"], summary["phase_rounds"]) == ("training", 2, 2)
    with TestClient(create_app(store, "memory://")) as client:
        served = client.get("/experiments/m1/metrics").json()["history"]
        assert served[seeding]["phase"] == "training" and served[seeding]["phase_round"] == 1
        with client.stream("GET", "/experiments/m1/events") as events:
            body = "".join(events.iter_text())
        progress = [json.loads(line[len("data: "):]) for block in body.split("\n\n") if "event: progress" in block
                    for line in block.splitlines() if line.startswith("data: ")]
        assert progress and progress[-1]["phase"] == "training" and progress[-1]["phase_rounds"] == 2
        assert progress[-1]["phase_round"] == progress[-1]["round"] - seeding
        listing = client.get("/experiments/m1/plots").json()["files"]
        assert {"accuracy.png", "ari.png", "clusters.png", "traffic.png"} <= set(listing)
        png = client.get("/experiments/m1/plots/traffic.png")
        assert png.status_code == 200 and Image.open(io.BytesIO(png.content)).format == "PNG"
    assert set(plot_files(store, "m1")) >= {"traffic.png", "clusters.png"}
