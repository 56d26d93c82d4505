"""How the simulator's cost grows with the number of clients: seconds per round and peak memory.

    python benchmarks/scale_curve.py [--clients 100,300,1000,3000,10000] [--rounds 5] [--degree 10]
                                     [--device cpu] [--out runs/scale_curve]

The workload of benchmarks/simulator_round.py (rotated MNIST bundled, k=2, MLP h=200, 80 training samples per
client, 5 local epochs, batch 10, lr 0.1) under the default algorithm (robust DFCA, `dfca.traffic: lean`:
farthest-first seeding, then one-hop merges, and 5 steps of ratio consensus every 5th round counted back from
the last, 8-bit payloads), on an Erdos-Renyi graph with `--degree` expected neighbours per client (p = degree /
(N - 1)), so that a client's traffic stays the same as N grows. `--rounds 5` measures, after the seeding rounds,
four merge rounds and one gossip round. Each N runs in a process of its own: its peak resident memory is that
process's ru_maxrss, and with `--device cuda` the GPU's peak allocated memory beside it. A config whose estimated
tensors exceed the device's available memory is refused by the simulator before it allocates; the table says so,
with the estimate.

Writes `runs.jsonl` (one line per N) and `table.md` (with the commit and the machine's load) under --out, and
prints the table. No figure here is asserted by a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from resumable_runs import commit

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent


def config(clients: int, rounds: int, degree: float, hidden: int, device: str = "cpu",
           screen: bool = True) -> dict[str, Any]:
    return {
        "name": f"scale-{clients}", "clusters": 2, "rounds": rounds, "seed": 0, "eval_every": 1, "device": device,
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": clients, "train_per_client": 80,
                 "test_per_client": 10},
        "model": {"kind": "mlp", "hidden": hidden},
        "train": {"lr": 0.1, "local_epochs": 5, "batch_size": 10},
        "topology": {"kind": "erdos_renyi", "p": min(1.0, degree / max(clients - 1, 1))},
        "dfca": {"screen": screen},
    }


def measure_one(clients: int, rounds: int, degree: float, hidden: int, device: str = "cpu",
                screen: bool = True) -> dict[str, Any]:
    """Run one N here and return its figures (called in a child process)."""
    import torch

    from dfca.algorithms import schedule_of
    from dfca.config import ExperimentConfig
    from dfca.run_size import RunTooLarge, gib
    from dfca.simulator import simulate

    cfg = ExperimentConfig.model_validate(config(clients, rounds, degree, hidden, device, screen))
    row: dict[str, Any] = {"clients": clients, "estimated_bytes": cfg.estimated_bytes(),
                           "threads": torch.get_num_threads(), "device": device, "screen": screen}
    phases: dict[str, list[float]] = {}
    schedule = schedule_of(cfg)

    def on_round(record: dict[str, Any]) -> None:  # every round is evaluated: record["round"] is t + 1
        phase = record["phase"]
        if phase == "training":
            phase = "gossip" if schedule.gossip_steps(record["round"] - 1) else "merge"
        phases.setdefault(phase, []).append(record["seconds"])

    start = time.perf_counter()
    try:
        result = simulate(cfg, on_round=on_round)
    except RunTooLarge as err:
        row.update(refused=str(err), estimate=gib(cfg.estimated_bytes()))
        return row
    row.update(
        seconds_total=time.perf_counter() - start,
        rounds_by_phase={phase: len(seconds) for phase, seconds in phases.items()},
        seconds_per_round={phase: sum(seconds) / len(seconds) for phase, seconds in phases.items()},
        test_accuracy=result.summary["test_accuracy"], cluster_ari=result.summary["cluster_ari"],
        bytes_sent_per_client_per_round=result.summary["bytes_sent_per_client_per_round"],
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    if device == "cuda":
        row.update(peak_gpu_bytes=torch.cuda.max_memory_allocated(), gpu=torch.cuda.get_device_name())
    return row


def run_child(clients: int, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", str(clients), "--rounds", str(args.rounds), "--degree",
               str(args.degree), "--hidden", str(args.hidden), "--device", args.device, "--screen", args.screen]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"clients": clients, "failed": f"did not finish in {args.timeout} s"}
    if done.returncode != 0:
        return {"clients": clients, "failed": (done.stderr.strip().splitlines() or ["?"])[-1][-300:],
                "returncode": done.returncode, "estimated_bytes": 0}
    return json.loads(done.stdout.strip().splitlines()[-1])


def seconds(row: dict[str, Any], phase: str) -> str:
    value = row.get("seconds_per_round", {}).get(phase)
    return "" if value is None else f"{value:.2f}"


def table(rows: list[dict[str, Any]], args: argparse.Namespace, load_before: str, load_after: str) -> str:
    gpu = next((f", on {row['gpu']}" for row in rows if "gpu" in row), "")
    lines = [
        f"`python benchmarks/scale_curve.py --clients {args.clients} --rounds {args.rounds} --degree {args.degree} "
        f"--hidden {args.hidden} --device {args.device} --screen {args.screen}` at commit "
        f"{rows[0].get('commit', '?')}, one process per N "
        f"({rows[0].get('threads', '?')} torch threads{gpu}); load average before {load_before}, after {load_after}.",
        "",
        "| clients N | seeding round (s) | merge round (s) | gossip round, 5 steps (s) | "
        f"peak memory{' (GPU)' if args.device == 'cuda' else ''} | estimate | accuracy | ARI | "
        "MB sent per client per round |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes: list[str] = []
    for row in rows:
        n = f"{row['clients']:,}"
        if "refused" in row or "failed" in row:
            why = f"refused before allocating: {row['refused']}" if "refused" in row else f"failed: {row['failed']}"
            estimate = f"{row['estimated_bytes'] / 2**30:.2f} GiB" if row.get("estimated_bytes") else "–"
            lines.append(f"| {n} | – | – | – | – | {estimate} | – | – | – |")
            notes.append(f"N={n}: {why}")
            continue
        lines.append(
            f"| {n} | {seconds(row, 'seeding')} | {seconds(row, 'merge')} | {seconds(row, 'gossip')} | "
            f"{row.get('peak_gpu_bytes', row['peak_rss_bytes']) / 2**30:.2f} GiB | "
            f"{row['estimated_bytes'] / 2**30:.2f} GiB | "
            f"{row['test_accuracy']:.3f} | {row['cluster_ari']:.2f} | "
            f"{row['bytes_sent_per_client_per_round'] / 1e6:.1f} |")
    return "\n".join([*lines, "", *notes]) + "\n"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="100,300,1000,3000,10000", help="comma-separated N")
    parser.add_argument("--rounds", type=int, default=5, help="training rounds after seeding (the last gossips)")
    parser.add_argument("--degree", type=float, default=10.0, help="expected neighbours per client")
    parser.add_argument("--hidden", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one N may take")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where each N's simulation runs")
    parser.add_argument("--screen", choices=["on", "off"], default="on",
                        help="dfca.screen, screened gossip and merges (on: the default config's)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "scale_curve")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: measure this N, print JSON
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure_one(args.one, args.rounds, args.degree, args.hidden, args.device,
                                     args.screen == "on")))
        return 0
    sizes = [int(n) for n in args.clients.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    load_before, code = load_average(), commit()  # the code the children run, at the start (HEAD may move)
    rows = []
    with (args.out / "runs.jsonl").open("a") as runs:
        for clients in sizes:
            t0 = time.perf_counter()
            row = run_child(clients, args)
            row.update(commit=code, load=load_average())
            rows.append(row)
            runs.write(json.dumps(row) + "\n")
            runs.flush()
            print(f"N={clients}: {time.perf_counter() - t0:.0f} s", row.get("seconds_per_round", row), flush=True)
    text = table(rows, args, load_before, load_average())
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
