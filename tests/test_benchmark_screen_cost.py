"""benchmarks/screen_cost.py end to end on the runtime benchmark's config: the screened and the unscreened
simulation run the same rounds side by side, each kind of round is recorded for both, and both learn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_runs import REPO, run_benchmark


@pytest.mark.slow
def test_the_runtime_config_screened_and_unscreened_round_by_round(tmp_path: Path) -> None:
    rows, printed = run_benchmark("screen_cost.py", "--runtime-config", "--rounds", "6", out=tmp_path / "rows.jsonl")
    (row,) = rows
    assert row["setting"] == "runtime 24 clients" and row["rounds"] == 6 and row["commit"]
    assert row["gossip"]["rounds"] + row["merge"]["rounds"] == 6  # the lean schedule: both kinds in six rounds
    for kind in ("gossip", "merge"):
        assert row[kind]["plain_s"] > 0 and row[kind]["screened_s"] > 0
    assert row["screened_pairs_dropped"] > 0  # the screen ran: honest spread drops a few pairs
    # the same run but for the screen: both learn the two rotations (chance is 0.1)
    assert min(row["test_accuracy"].values()) > 0.6
    assert "all training rounds: ratio" in printed


def test_two_configs_at_once_are_refused(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "benchmarks/screen_cost.py", "--demo", "--runtime-config", "--out",
                          str(tmp_path / "rows.jsonl")], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 2 and "give one" in run.stderr
    assert not (tmp_path / "rows.jsonl").exists()
