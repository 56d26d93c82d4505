"""benchmarks/peers_runtime.py without Flower: its process-tree accounting counts what children used, and its dfca
side runs the workload on a private RabbitMQ node and sees the models cross the broker."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchmark_runs import run_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from process_tree_trace import TreeTrace  # noqa: E402

from dfca.models.build import build_model  # noqa: E402

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass\n"


def test_a_tree_counts_the_cpu_of_children_that_have_ended() -> None:
    """A parent that starts two short-lived children one after the other (as a SuperNode starts ClientApps) and
    waits for them: the tree's CPU seconds include both children's, counted once."""
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time\n"
                               f"for _ in range(2): subprocess.run([sys.executable, '-c', {BURN!r}], check=True)\n"
                               "print('done', flush=True)\n"
                               "time.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    try:
        trace = TreeTrace({"tree": [parent.pid]}).start()
        began = time.time()
        assert parent.stdout is not None and parent.stdout.readline().strip() == "done"
        ended = time.time()
        trace.stop()  # a last sample, with the parent still there
    finally:
        parent.kill()
        parent.wait(timeout=30)
    used = trace.between(began, ended)["tree"]
    assert 1.2 <= used < 2.5, used  # two children of 0.6 CPU-s each, plus the interpreters' start-up, not twice


@pytest.mark.rabbitmq
@pytest.mark.slow
def test_the_runtime_side_runs_the_workload_and_moves_its_models_through_the_broker(tmp_path: Path) -> None:
    rows, printed = run_benchmark("peers_runtime.py", "--runs", "dfca-ifca", "--rounds", "6",
                                  out=tmp_path / "rows.jsonl")
    (row,) = rows
    # five timed rounds: the byte counter is sampled every 0.1 s or slower, so the window's ends may miss up to a
    # sample's traffic; over two short rounds that was a quarter of the bytes
    assert row["run"] == "dfca-ifca" and row["timed_rounds"] == 5 and row["layout"] == "3 workers x 8 clients"
    assert row["test_accuracy"] > 0.6  # FedAvg on two rotations after 6 rounds; chance is 0.1
    assert set(row["cpu_seconds_per_round_by_tree"]) == {"workers", "services", "broker"}
    assert all(v > 0 for v in row["cpu_seconds_per_round_by_tree"].values()), row
    model_bytes = 4 * sum(math.prod(shape) for shape in build_model("mlp", (1, 28, 28), 64, 10).shapes().values())
    # a round: 24 uploads to the aggregator and the global model to every worker, at the least
    assert row["bytes_per_round"] >= (24 + 3) * model_bytes, row["bytes_per_round"]
    assert "dfca runtime, IFCA k=1" in printed and row["commit"] and row["load_before"]
