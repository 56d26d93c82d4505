"""benchmarks/wire_batches.py: an exchange's messages encoded and decoded one at a time and together, timed per
message, the two ways checked to give the same bytes and values."""

from __future__ import annotations

from pathlib import Path

from benchmark_runs import run_benchmark


def test_the_benchmark_times_both_ways_for_each_case_and_records_them(tmp_path: Path) -> None:
    (row,), printed = run_benchmark("wire_batches.py", "--cases", "runtime", "--rows", "3", "--repeats", "1",
                                    "--loops", "1", out=tmp_path / "runs.jsonl")
    assert (row["case"], row["hidden"], row["rows"], row["arrivals"]) == ("runtime", 64, 3, 16)
    assert row["body_bytes"] > 100_000 and row["commit"]  # 8-bit codes of two 784-64-10 models, with their scales
    for way in ("encode_seconds_per_message", "decode_seconds_per_message", "stack_seconds_per_message"):
        assert set(row[way]) == {"alone", "together"} and all(v > 0 for v in row[way].values())
    assert row["checksum_seconds_per_message"] > 0
    assert set(row["dequantize_seconds_per_message"]) == {"copy then scale", "one pass"}
    assert "| runtime | 109 kB |" in printed
