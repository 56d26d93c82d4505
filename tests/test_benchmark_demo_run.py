"""benchmarks/demo_run.py: `dfca run` of the demo in a fresh process, its first and later rounds recorded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmark_runs import REPO, run_benchmark


def test_the_benchmark_runs_the_demo_and_records_its_rounds(tmp_path: Path) -> None:
    (row,), printed = run_benchmark("demo_run.py", "--repeats", "1", out=tmp_path / "runs.jsonl")
    assert (row["checkout"], row["pair"], row["device"]) == ("this", 0, "cpu")
    assert row["code"].split("+")[0] == row["commit"].split("+")[0]  # the code that ran is this checkout's
    assert row["test_accuracy"] > 0.85 and row["cluster_ari"] == 1.0  # the demo recovers its two clusters
    assert all(row[k] > 0 for k in ("first_round_seconds", "later_rounds_seconds", "seconds_per_round",
                                      "wall_seconds", "process_seconds"))
    assert f"| {row['code']} |" in printed


def test_a_base_that_is_not_a_checkout_is_refused(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "benchmarks/demo_run.py", "--base", str(tmp_path), "--out",
                          str(tmp_path / "runs.jsonl")], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 2 and "not a checkout of this project" in run.stderr
    assert not (tmp_path / "runs.jsonl").exists()
