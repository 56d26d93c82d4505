"""benchmarks/checkpoint_writes.py: a worker's checkpoints written into slots in place and as fresh files renamed over
the old one, each read back and compared, timed for a training and a seeding state."""

from __future__ import annotations

from pathlib import Path

from benchmark_runs import run_benchmark


def test_the_benchmark_times_both_ways_for_both_states_and_records_them(tmp_path: Path) -> None:
    rows, printed = run_benchmark("checkpoint_writes.py", "--checkpoints", "12", "--pause", "0", "--repeats", "1",
                                  "--dir", str(tmp_path), out=tmp_path / "runs.jsonl")
    assert sorted((r["state"], r["way"]) for r in rows) == [
        ("seeding", "fresh file"), ("seeding", "slots"), ("training", "fresh file"), ("training", "slots")]
    sizes = {r["state"]: r["state_mb"] for r in rows}
    assert 3.2 < sizes["training"] < 3.4 and 6.4 < sizes["seeding"] < 6.6  # a worker of the 24-client config
    assert all(r["cpu_ms"] > 0 and r["disk_mb"] >= 0 and r["commit"] for r in rows)
    assert "training  slots" in printed and "seeding   fresh file" in printed
    assert list(tmp_path.iterdir()) == [tmp_path / "runs.jsonl"]  # its files were in a folder of its own, removed
