"""benchmarks/service_start.py: each service's import timed beside torch alone, and what slow libraries it loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_benchmark_times_a_services_import_against_torch_alone(tmp_path: Path) -> None:
    out = tmp_path / "runs.jsonl"
    run = subprocess.run([sys.executable, "benchmarks/service_start.py", "--services", "worker", "--repeats", "1",
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["service"] == "worker" and row["repeats"] == 1 and row["commit"]
    assert row["seconds"] > row["torch_seconds"] > 0  # a worker imports torch and more
    assert row["loaded"] == []  # no scikit-learn, SciPy or pandas (tests/test_service_imports.py)
    assert "| worker |" in run.stdout
