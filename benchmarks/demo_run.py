"""What `dfca run` of the demo costs a user, round by round: its first round, its later rounds, the summary's
`seconds_per_round` (the mean over every round, the first included) and its wall time, each run in a fresh process,
optionally alternating with another checkout of the project (`--base DIR`, e.g. a `git worktree` of an older
commit) so the two are compared under the same load.

    python benchmarks/demo_run.py [--repeats 3] [--base DIR] [--device cpu|cuda] [--out FILE]

A run's first round carries whatever the process does once (imports a metric first calls, CUDA warming up), which
the summary's mean spreads over the run. Appends one line per run, with the commit of the code that ran and the
machine's load, to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resumable_runs import RESULTS, append_stamped, commit

REPO = Path(__file__).resolve().parents[1]


def one_run(checkout: Path, device: str) -> dict[str, Any]:
    """`dfca run` of the demo from `checkout`'s code in a fresh interpreter, and what its outputs say."""
    with tempfile.TemporaryDirectory() as out:
        paths = [str(checkout / "shared"), str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # the checkout's code first
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dfca.cli", "run", "--out", out, "--force", "--set", f"device={device}"],
                       cwd=checkout, env=env, capture_output=True, text=True, check=True)
        process = time.perf_counter() - began
        summary = json.loads((Path(out) / "summary.json").read_text())
        rounds = [json.loads(line)["seconds"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"device": summary["device"], "first_round_seconds": rounds[0],
            "later_rounds_seconds": statistics.mean(rounds[1:]) if len(rounds) > 1 else None,
            "seconds_per_round": summary["seconds_per_round"], "wall_seconds": summary["wall_seconds"],
            "process_seconds": process, "test_accuracy": summary["test_accuracy"],
            "cluster_ari": summary["cluster_ari"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", type=Path, help="another checkout to run right before each run of this one")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path(RESULTS) / "demo_run_runs.jsonl")
    args = parser.parse_args()
    if args.base is not None and not (args.base / "shared" / "dfca").is_dir():
        parser.error(f"--base {args.base}: not a checkout of this project (no shared/dfca)")
    checkouts = ([("base", args.base.resolve(), commit(args.base.resolve()))] if args.base is not None else []) + [
        ("this", REPO, commit())]
    load_before = os.getloadavg()[0]
    rows = [{"checkout": name, "code": code, "pair": i, **one_run(path, args.device)}
            for i in range(args.repeats) for name, path, code in checkouts]
    stamp = append_stamped(args.out, rows, load_before)
    print(f"`dfca run` of the demo on {args.device}, {args.repeats} runs of each checkout, alternating:\n")
    print("| code | first round | later rounds (mean) | seconds_per_round | wall_seconds | process | accuracy | ARI |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        later = f"{r['later_rounds_seconds']:.3f} s" if r["later_rounds_seconds"] is not None else "-"
        print(f"| {r['code']} | {r['first_round_seconds']:.2f} s | {later} | {r['seconds_per_round']:.3f} s | "
              f"{r['wall_seconds']:.2f} s | {r['process_seconds']:.2f} s | {r['test_accuracy']:.4f} | "
              f"{r['cluster_ari']:.2f} |")
    print(f"\nappended to {args.out} (commit {stamp['commit']}, load {load_before:.2f} -> {stamp['load_after']:.2f})")


if __name__ == "__main__":
    main()
