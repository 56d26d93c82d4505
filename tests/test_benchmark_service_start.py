"""benchmarks/service_start.py: each service's import timed beside torch alone, and what slow libraries it loaded."""

from __future__ import annotations

from pathlib import Path

from benchmark_runs import run_benchmark


def test_the_benchmark_times_a_services_import_against_torch_alone(tmp_path: Path) -> None:
    (row,), printed = run_benchmark("service_start.py", "--services", "worker", "--repeats", "1",
                                    out=tmp_path / "runs.jsonl")
    assert row["service"] == "worker" and row["repeats"] == 1 and row["commit"]
    assert row["seconds"] > 0 and row["torch_seconds"] > 0  # (timings are the benchmark's business, not asserted)
    assert row["loaded"] == []  # no scikit-learn, SciPy or pandas (tests/test_service_imports.py)
    assert "| worker |" in printed
