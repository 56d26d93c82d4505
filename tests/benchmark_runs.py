"""Running a benchmark script end to end, as its tests do: small arguments, a private results file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str, out: Path) -> tuple[list[dict[str, Any]], str]:
    """benchmarks/<script> with `args`, appending to `out`: the rows it wrote and what it printed (it must succeed)."""
    run = subprocess.run([sys.executable, f"benchmarks/{script}", *args, "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    return [json.loads(line) for line in out.read_text().splitlines()], run.stdout
