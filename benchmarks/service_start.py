"""How long a service process takes to import its code: what a killed worker pod's replacement (or `dfca up`)
spends before it can connect, against importing torch alone (the floor every service pays) in the same run.

Each service's `services/<name>/main.py` is imported in a fresh interpreter (`python -c "import ..."`), `--repeats`
times, alternating with torch alone; the median wall seconds of each, and which of scikit-learn, SciPy and pandas
(slow to import, used by a few algorithms and the simulator's summaries only) the import loaded.

    python benchmarks/service_start.py [--services worker,topology,metrics,aggregator] [--repeats 5] [--out FILE]

Appends one line per service, with the commit and the machine's load, to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from resumable_runs import RESULTS, append_stamped

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("sklearn", "scipy", "pandas")


def import_seconds(module: str) -> tuple[float, list[str]]:
    """Wall seconds of a fresh interpreter importing `module`, and which of HEAVY it loaded."""
    code = f"import sys, {module}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return time.perf_counter() - began, [m for m in run.stdout.strip().split(",") if m]


def measure(service: str, repeats: int) -> dict[str, Any]:
    own, floor, loaded = [], [], []
    for _ in range(repeats):
        seconds, loaded = import_seconds(f"services.{service}.main")
        own.append(seconds)
        floor.append(import_seconds("torch")[0])
    return {"service": service, "seconds": statistics.median(own), "torch_seconds": statistics.median(floor),
            "loaded": loaded, "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", default="worker,topology,metrics,aggregator")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(RESULTS) / "service_start_runs.jsonl")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = [measure(s, args.repeats) for s in args.services.split(",")]
    stamp = append_stamped(args.out, rows, load_before)
    print(f"seconds to import, medians of {args.repeats} fresh interpreters, alternating with torch alone:\n")
    print("| service | import | torch alone | beyond torch | slow libraries loaded |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['service']} | {r['seconds']:.2f} | {r['torch_seconds']:.2f} | "
              f"{r['seconds'] - r['torch_seconds']:.2f} | {', '.join(r['loaded']) or 'none'} |")
    print(f"\nappended to {args.out} (commit {stamp['commit']}, load {load_before:.2f} -> {stamp['load_after']:.2f})")


if __name__ == "__main__":
    main()
