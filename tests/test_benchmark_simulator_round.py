"""benchmarks/simulator_round.py runs end to end at a tiny scale and writes its figures with their provenance; the
FLOPs it divides by are the kernels' own counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_simulator_round_writes_each_phases_rate_with_commit_and_load(tmp_path: Path) -> None:
    out = tmp_path / "runs.jsonl"
    clients, train, epochs, hidden = 6, 20, 3, 16
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "simulator_round.py"), "--clients", str(clients),
                    "--train", str(train), "--epochs", str(epochs), "--hidden", str(hidden), "--rounds", "2",
                    "--out", str(out)], capture_output=True, text=True, timeout=300, check=True)
    row = json.loads(out.read_text())
    assert row["commit"] and row["load_before"] >= 0 and row["matmul_gflops"] > 0
    d, c = 784, 10
    phases = row["phases"]
    assert set(phases) == {"training", "training (textbook)", "assignment + inference", "aggregation"}
    textbook = clients * (4 * d * hidden + 6 * hidden * c) * epochs * train
    assert abs(phases["training (textbook)"]["gflop"] * 1e9 - textbook) < 1
    # the form the simulator used does no more arithmetic than the textbook step, and both forms were timed
    assert phases["training"]["gflop"] <= phases["training (textbook)"]["gflop"]
    assert row["sgd_weights"]["gflop"] == phases["training (textbook)"]["gflop"]
    assert row["sgd_samples"]["gflop"] < row["sgd_weights"]["gflop"]
    assert all(p["seconds"] > 0 and p["gflops"] > 0 for p in phases.values())
    # the floor recorded every product the kernel ran: their FLOPs are the executed count the table divides by
    floor = row["floor"]
    assert abs(floor["product_gflop"] - phases["training"]["gflop"]) < 1e-9
    assert floor["calls"]["product"] > 0 and floor["seconds"]["product"] > 0 and floor["call_seconds"] > 0
