"""benchmarks/unequal_clients.py runs end to end at a tiny scale: both federations hold the same samples, the unequal
one is bucketed by size, and the line it writes carries every case (the unequal one with and without fixed local
steps), their ratios, the commit and the load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_unequal_clients_benchmark_writes_both_cases_and_their_ratios(tmp_path: Path) -> None:
    out = tmp_path / "runs.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "unequal_clients.py"), "--clients", "12",
                           "--median", "10", "--most", "80", "--rounds", "2", "--hidden", "8", "--dim", "16",
                           "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, check=True)
    row = json.loads(out.read_text())
    equal, unequal = row["equal"], row["unequal"]
    assert row["commit"] and row["load_before"] >= 0
    assert equal["padding_overhead"] == 1.0 and equal["size_buckets"] == 0
    assert unequal["max"] == 80 and unequal["size_buckets"] > 1 and 1.0 <= unequal["padding_overhead"] <= 1.5
    assert equal["samples"] <= unequal["samples"] < equal["samples"] + 12  # the same total, to a client's rounding
    assert row["ratios"]["round_time"] == unequal["round_seconds"] / equal["round_seconds"]
    steps = row["unequal_steps"]  # the same federation, every client doing the equal clients' steps per round
    assert row["config"]["local_steps"] == steps["local_steps"] == -(-equal["min"] // 10)
    assert equal["local_steps"] is None and unequal["local_steps"] is None
    assert steps["samples"] == unequal["samples"] and steps["size_buckets"] == unequal["size_buckets"]
    assert row["steps_ratios"]["round_time"] == steps["round_seconds"] / equal["round_seconds"]
    fixed = row["steps_ratios"]
    assert row["steps_goal_met"] == (fixed["round_time"] <= 1.5 and fixed["peak_rss"] <= 1.5)
    assert "goal <= 1.5x" in done.stdout and "fixed steps" in done.stdout
