"""Clients of unequal size against equal clients holding the same samples in all: round time and peak memory.

    python benchmarks/unequal_clients.py [--clients 200] [--median 100] [--most 2000] [--rounds 4] [--hidden 64]
                                         [--dim 128] [--local-steps N] [--device cpu]
                                         [--out docs/results/unequal_clients_runs.jsonl]

The unequal federation draws each client's train size from a lognormal of median --median (sigma 1), cut to 2..
--most, the first client --most; the equal one gives every client the same number of samples, the same total
(the largest multiple of the client count in it). The samples are synthetic: --dim features, 10 classes, two
clusters whose labels are permuted apart, so that DFCA has clusters to find; each client tests on 20 samples.
Both run DFCA's paper rule (k = 2, the one-hop merge weighted by n_i on the unequal side), an MLP of --hidden
units, 1 local epoch of batch 10, in the simulator, each case in a fresh process. The unequal federation runs twice:
with each client's epoch over its own samples (train.local_steps unset: ceil(n_i / 10) steps, the largest client's
many steps set the round's pace) and with every client doing --local-steps steps (default: the equal federation's
steps per round, so both do the same steps). Reported per case: the median
round after the first (a warm-up), the process's peak RSS (VmHWM) and that peak above the process's RSS before
the federation was built (what the data, models and training took), the padding overhead (rows stored per real
row) and the size buckets. The ratios unequal / equal are what the goal bounds: <= 1.5x for both round time and
peak memory; `ratios` holds the own-epochs unequal case's, `steps_ratios` the fixed-steps one's, both against the same
equal run. Appends one line, with the commit and the machine's load, to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from resumable_runs import RESULTS, append_stamped

GOAL = 1.5
BATCH = 10
REPO = Path(__file__).resolve().parents[1]


def sizes_of(case: str, clients: int, median: int, most: int, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    drawn = np.clip(np.round(rng.lognormal(math.log(median), 1.0, clients)), 2, most).astype(int)
    drawn[0] = most
    if case != "equal":  # unequal, unequal_steps
        return [int(s) for s in drawn]
    return [int(drawn.sum()) // clients] * clients


def memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def one_case(args: argparse.Namespace) -> dict[str, Any]:
    """Build the case's federation, run its rounds, report (in this process)."""
    import torch

    from dfca.config import ExperimentConfig
    from dfca.data.shards import from_clients
    from dfca.simulator import simulate

    torch.set_num_threads(args.threads)
    before = memory_kib("VmRSS")
    sizes = sizes_of(args.case, args.clients, args.median, args.most, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    centres = torch.randn(10, args.dim, generator=g) * 2
    permuted = torch.randperm(10, generator=g)

    def samples(n: int, cluster: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (n,), generator=g)
        x = centres[y] + torch.randn(n, args.dim, generator=g)
        return x, (permuted[y] if cluster else y)

    truth = torch.arange(args.clients) % 2
    train = [samples(n, int(c)) for n, c in zip(sizes, truth.tolist(), strict=True)]
    test = [samples(20, int(c)) for c in truth.tolist()]
    data = from_clients(train, test, truth, 10)
    cfg = ExperimentConfig.model_validate({
        "name": f"unequal-{args.case}", "algorithm": "dfca", "clusters": 2, "rounds": args.rounds, "seed": args.seed,
        "init": "global", "data": {"dataset": "digits", "clients": args.clients},  # its samples: `data`, built above
        "model": {"kind": "mlp", "hidden": args.hidden},
        "train": {"lr": 0.05, "local_epochs": 1, "batch_size": BATCH,
                  "local_steps": args.local_steps if args.case == "unequal_steps" else None},
        "topology": {"kind": "erdos_renyi", "p": min(1.0, 8 / args.clients)}, "dfca": {"variant": "paper"},
        "device": args.device,
    })
    began = time.perf_counter()
    result = simulate(cfg, data=data)
    seconds = [h["seconds"] for h in result.history]
    return {"case": args.case, "local_steps": cfg.train.local_steps, "samples": sum(sizes), "min": min(sizes),
            "median": statistics.median(sizes),
            "max": max(sizes), "round_seconds": statistics.median(seconds[1:] or seconds), "rounds": seconds,
            "wall_seconds": time.perf_counter() - began, "peak_rss_mib": memory_kib("VmHWM") / 1024,
            "peak_above_start_mib": (memory_kib("VmHWM") - before) / 1024,
            "padding_overhead": data.padding_overhead, "size_buckets": len(data.buckets),
            "test_accuracy": result.summary["test_accuracy"], "cluster_ari": result.summary["cluster_ari"]}


def ratios_of(case: dict[str, Any], equal: dict[str, Any]) -> dict[str, float]:
    return {"round_time": case["round_seconds"] / equal["round_seconds"],
            "peak_rss": case["peak_rss_mib"] / equal["peak_rss_mib"],
            "peak_above_start": case["peak_above_start_mib"] / max(equal["peak_above_start_mib"], 1e-9)}


def goal_met(ratios: dict[str, float]) -> bool:
    return ratios["round_time"] <= GOAL and ratios["peak_rss"] <= GOAL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--median", type=int, default=100)
    parser.add_argument("--most", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--local-steps", type=int, default=None,
                        help="steps per round of every client in the fixed-steps case (default: the equal "
                        "federation's, ceil(samples per client / batch))")
    parser.add_argument("--case", choices=["equal", "unequal", "unequal_steps"], help=argparse.SUPPRESS)  # a child
    parser.add_argument("--out", type=Path, default=REPO / RESULTS / "unequal_clients_runs.jsonl")
    args = parser.parse_args()
    if args.local_steps is None:
        args.local_steps = -(-sizes_of("equal", args.clients, args.median, args.most, args.seed)[0] // BATCH)
    if args.case:
        print(json.dumps(one_case(args)))
        return
    load_before = os.getloadavg()[0]
    cases = {}
    for case in ("equal", "unequal", "unequal_steps"):
        argv = sys.argv[1:]
        child = subprocess.run([sys.executable, __file__, *argv, "--case", case], capture_output=True, text=True,
                               check=True)
        cases[case] = json.loads(child.stdout.strip().splitlines()[-1])
    equal, unequal, steps = cases["equal"], cases["unequal"], cases["unequal_steps"]
    ratios, steps_ratios = ratios_of(unequal, equal), ratios_of(steps, equal)
    print(f"{'':18}{'equal':>12}{'unequal':>12}{'ratio':>8}{'fixed steps':>12}{'ratio':>8}")
    print(f"{'samples':18}{equal['samples']:>12}{unequal['samples']:>12}")
    spread = f"{unequal['min']}/{unequal['median']:.0f}/{unequal['max']}"
    print(f"{'sizes min/med/max':18}{equal['min']:>12}{spread:>12}")
    print(f"{'padding overhead':18}{equal['padding_overhead']:>12.2f}{unequal['padding_overhead']:>12.2f}")
    print(f"{'size buckets':18}{equal['size_buckets']:>12}{unequal['size_buckets']:>12}")
    print(f"{'local steps':18}{'own epochs':>12}{'own epochs':>12}{'':8}{args.local_steps:>12}")
    for key, ratio in (("round_seconds", "round_time"), ("peak_rss_mib", "peak_rss"),
                       ("peak_above_start_mib", "peak_above_start")):
        print(f"{key:18}{equal[key]:>12.3f}{unequal[key]:>12.3f}{ratios[ratio]:>7.2f}x{steps[key]:>12.3f}"
              f"{steps_ratios[ratio]:>7.2f}x")
    print(f"{'test_accuracy':18}{equal['test_accuracy']:>12.3f}{unequal['test_accuracy']:>12.3f}{'':8}"
          f"{steps['test_accuracy']:>12.3f}")
    met, steps_met = goal_met(ratios), goal_met(steps_ratios)
    print(f"goal <= {GOAL}x for round time and peak memory: own epochs {'met' if met else 'not met'}, "
          f"fixed steps {'met' if steps_met else 'not met'}")
    keys = ("clients", "median", "most", "rounds", "hidden", "dim", "threads", "device", "local_steps")
    config = {k: getattr(args, k) for k in keys}
    stamp = append_stamped(args.out, [{"config": config, "equal": equal, "unequal": unequal, "ratios": ratios,
                                       "goal_met": met, "unequal_steps": steps, "steps_ratios": steps_ratios,
                                       "steps_goal_met": steps_met}], load_before)
    print(f"appended to {args.out} (commit {stamp['commit']}, load {load_before:.2f} -> {stamp['load_after']:.2f})")


if __name__ == "__main__":
    main()
