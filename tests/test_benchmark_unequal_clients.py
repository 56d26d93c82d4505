"""benchmarks/unequal_clients.py runs end to end at a tiny scale: both federations hold the same samples, the unequal
one is bucketed by size, and the line it writes carries both cases, their ratios, the commit and the load."""

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
                           "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=600, check=True)
    row = json.loads(out.read_text())
    equal, unequal = row["equal"], row["unequal"]
    assert row["commit"] and row["load_before"] >= 0
    assert equal["padding_overhead"] == 1.0 and equal["size_buckets"] == 0
    assert unequal["max"] == 80 and unequal["size_buckets"] > 1 and 1.0 <= unequal["padding_overhead"] <= 1.5
    assert equal["samples"] <= unequal["samples"] < equal["samples"] + 12  # the same total, to a client's rounding
    assert row["ratios"]["round_time"] == unequal["round_seconds"] / equal["round_seconds"]
    assert "goal <= 1.5x" in done.stdout
