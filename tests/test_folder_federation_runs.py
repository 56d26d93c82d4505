"""Export, then run, equals the built-in run: the bundled rotated-MNIST config written by `dfca data export` and run
from its folder gives the built-in run's metrics with the same seeds, in the simulator (`dfca run`) and on the
message drivers; a folder without clusters.json runs with no ARI anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dfca.algorithms import schedule_of
from dfca.cli.main import DEFAULT_CONFIG, app
from dfca.config import load_config
from dfca.graph import neighbours
from dfca.simulator import prepare, simulate
from dfca.transport import InMemoryBroker, InMemoryTransport
from harness.lockstep import run_lockstep

runner = CliRunner()
SMALL = ["data.clients=10", "data.train_per_client=50", "data.test_per_client=10", "model.hidden=32", "rounds=3",
         "train.local_epochs=3", "dfca.flood_rounds=3", "dfca.seed_epochs=3", "dfca.traffic=full",
         "runtime.payload_dtype=float32"]  # the demo, small; float32 payloads: both drivers' arithmetic, exactly
METRICS = ("test_accuracy", "test_accuracy_std", "train_loss", "ari", "cluster_acc", "assignment_counts",
           "populated_clusters", "disagreement", "bytes_sent_per_client")


def sets(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "mnist"
    result = runner.invoke(app, ["data", "export", str(DEFAULT_CONFIG), str(out), *sets(SMALL)])
    assert result.exit_code == 0, result.output
    return out


def test_export_writes_the_layout_with_clusters_and_a_config(exported: Path) -> None:
    clients = sorted(p.name for p in exported.iterdir() if p.is_dir())
    assert clients == [f"client-{i:03d}" for i in range(10)]
    with np.load(exported / "client-003" / "train.npz") as part:
        assert part["x"].shape == (50, 1, 28, 28) and part["x"].dtype == np.float32 and part["y"].dtype == np.int64
    clusters = json.loads((exported / "clusters.json").read_text())
    builtin = prepare(load_config(DEFAULT_CONFIG, SMALL)).data
    assert list(clusters.values()) == builtin.true_cluster.tolist()
    shown = runner.invoke(app, ["data", "inspect", str(exported), "--json"])
    report = json.loads(shown.output)
    assert shown.exit_code == 0 and report["clients"] == 10 and report["input_shape"] == [1, 28, 28]
    assert report["samples"] == {"min": 60, "median": 60.0, "max": 60} and report["problems"] == []
    assert report["true_clusters"] and sum(sum(c["label_counts"]) for c in report["per_client"]) == 600
    again = runner.invoke(app, ["data", "export", str(DEFAULT_CONFIG), str(exported), *sets(SMALL)])
    assert again.exit_code == 2 and "not an empty folder" in again.output.replace("\n", " ")


def test_dfca_run_from_the_exported_folder_equals_the_builtin_run(exported: Path, tmp_path: Path) -> None:
    builtin, folder = tmp_path / "builtin", tmp_path / "folder"
    ran = runner.invoke(app, ["run", str(DEFAULT_CONFIG), "--out", str(builtin), *sets(SMALL)])
    assert ran.exit_code == 0, ran.output
    ran = runner.invoke(app, ["run", str(exported / "experiment.yaml"), "--out", str(folder)])
    assert ran.exit_code == 0, ran.output
    a, b = (json.loads((d / "summary.json").read_text()) for d in (builtin, folder))
    for key in ("test_accuracy", "test_accuracy_std", "cluster_ari", "cluster_acc", "assignment_counts", "rounds",
                "seeding_rounds", "clients", "bytes_sent_per_client_per_round"):
        assert a[key] == b[key], key
    assert a["cluster_ari"] == 1.0  # the clusters are found: a run worth comparing
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (builtin, folder)]
    assert len(rows[0]) == len(rows[1]) == a["rounds"] + a["seeding_rounds"]
    for x, y in zip(*rows, strict=True):
        assert {k: x[k] for k in METRICS} == {k: y[k] for k in METRICS}


def test_the_message_drivers_from_the_folder_end_where_the_builtin_simulator_ends(exported: Path) -> None:
    builtin_cfg = load_config(DEFAULT_CONFIG, SMALL)
    folder_cfg = load_config(exported / "experiment.yaml")
    assert folder_cfg.data.source == "folder" and folder_cfg.data.clients == 10
    sim = simulate(builtin_cfg)
    ctx = prepare(folder_cfg)
    assert ctx.data.client_names[0] == "client-000" and torch.equal(ctx.data.y_train, sim.simulation.ctx.data.y_train)
    broker = InMemoryBroker()
    run = run_lockstep(folder_cfg, ctx.data, neighbours(ctx.graph), lambda: InMemoryTransport(broker), hosts=3)
    reports = [d.report() for d in run.drivers]
    for d, report in zip(run.drivers, reports, strict=True):
        assert not d.stats.rejected and d.stats.timeouts == 0 and d.rounds_done == schedule_of(folder_cfg).total_rounds
        for name, tensor in d.algorithm.state().items():
            if name.startswith("params."):
                torch.testing.assert_close(tensor, sim.algorithm.state()[name][d.ids], rtol=1e-4, atol=1e-5)
        final = sim.algorithm.evaluate()
        assert report["assigned"] == final.assigned[d.ids].tolist()
        assert report["true_cluster"] == sim.simulation.ctx.data.true_cluster[d.ids].tolist()
        torch.testing.assert_close(torch.tensor(report["test_accuracy"]), final.test_accuracy[d.ids].cpu())


def test_without_clusters_json_no_ari_is_reported_anywhere(exported: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "unlabelled"
    shutil.copytree(exported, copy)
    (copy / "clusters.json").unlink()
    out = tmp_path / "run"
    ran = runner.invoke(app, ["run", str(DEFAULT_CONFIG), "--out", str(out), *sets(SMALL[3:]),
                              "--set", "data={source: folder, path: " + str(copy) + "}"])
    assert ran.exit_code == 0, ran.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clients"] == 10 and summary["test_accuracy"] > 0.25
    assert "cluster_ari" not in summary and "cluster_acc" not in summary and "ARI" not in ran.output
    for line in (out / "metrics.jsonl").read_text().splitlines():
        assert "ari" not in json.loads(line) and "cluster_acc" not in json.loads(line)
    assert (out / "accuracy.png").exists() and not (out / "ari.png").exists()
    assert "cluster_ari" not in ran.output and "test_accuracy" in ran.output
