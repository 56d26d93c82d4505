"""What screened gossip (`dfca.screen`, the default) costs a simulator round, against the same round unscreened.

    python benchmarks/screen_cost.py [--setting 2 | --demo | --runtime-config] [--traffic lean] [--rounds 10]
                                     [--seed 0] [--out docs/results/screen_cost_runs.jsonl]

Two simulations of one goal-grid setting (benchmarks/cluster_recovery.py's SETTINGS, MLP h=200, the grid's data),
or of the demo config `dfca run` runs by default (`--demo`: 40 clients, ER p=0.5, MLP h=200), or of the runtime
benchmark's 24-client config (`--runtime-config`: ER p=0.5, MLP h=64, 80 samples a client), identical but for
`dfca.screen`, run side by side: the seeding rounds untimed, then each training round timed on
one and at once on the other, alternating which goes first, so that both see the same load. Prints the seconds of
each kind of round (gossip rounds and one-hop merges) for both and their ratio, screened over unscreened, and the
ratio over all the training rounds; appends them with the commit and the load to --out. One BLAS thread; the
seconds are the process's CPU seconds (time.process_time), which other work on a shared machine changes far less
than wall-clock time.
Goal: screened <= 1.3x unscreened.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from cluster_recovery import SETTINGS, config, merge
from resumable_runs import commit
from runtime_benchmark import bench_config, demo_config

from dfca.algorithms import schedule_of
from dfca.config import ExperimentConfig
from dfca.simulator import Simulation, keep_run_heap, prepare

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"  # wherever it is run from


def accuracy(sim: Simulation) -> float:
    return round(float(sim.algorithm.evaluate().test_accuracy.mean()), 4)


def screened_config(args: argparse.Namespace, screen: bool) -> ExperimentConfig:
    """The run's config, screened or not: the demo's or the runtime benchmark's as they are but for the rounds (the
    schedule's seeding rounds, then --rounds training rounds) and the seed, or a goal-grid setting."""
    dfca = {"dfca": {"traffic": args.traffic, "screen": screen}}
    if args.demo or args.runtime_config:  # their own dfca section: the defaults
        base = merge(demo_config(1) if args.demo else bench_config(1), dfca)
        rounds = schedule_of(ExperimentConfig.model_validate(base)).seeding_rounds + args.rounds
        return ExperimentConfig.model_validate({**base, "rounds": rounds, "seed": args.seed})
    column = {"algorithm": "dfca", "init": "global", "dfca": {"variant": "robust", "seeding": "farthest"}}
    return config(SETTINGS[args.setting], merge(column, dfca), args.seed, args.rounds, 500)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", type=int, default=2, help="index into cluster_recovery.SETTINGS")
    p.add_argument("--demo", action="store_true", help="the demo config (shared/dfca/configs/demo.yaml) instead")
    p.add_argument("--runtime-config", action="store_true",
                   help="the runtime benchmark's 24-client config (runtime_benchmark.bench_config) instead")
    p.add_argument("--traffic", choices=["lean", "full"], default="lean")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "screen_cost_runs.jsonl")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.demo and args.runtime_config:
        p.error("--demo and --runtime-config are two configs: give one")
    label = "demo" if args.demo else "runtime 24 clients" if args.runtime_config else SETTINGS[args.setting]["label"]
    load_before, measured = os.getloadavg()[0], commit()  # the code as it was when the run started
    sims, cfg = {}, None
    for screen in (False, True):
        cfg = screened_config(args, screen)
        ctx = prepare(cfg)
        keep_run_heap(ctx)  # the heap as simulate() keeps it
        sims[screen] = Simulation(ctx)
    assert cfg is not None
    schedule = schedule_of(cfg)
    for t in range(schedule.seeding_rounds):
        for sim in sims.values():
            sim.run_round(t)
    seconds: dict[str, dict[bool, list[float]]] = {"gossip": {False: [], True: []}, "merge": {False: [], True: []}}
    for t in range(schedule.seeding_rounds, schedule.seeding_rounds + args.rounds):
        kind = "gossip" if schedule.gossip_steps(t) else "merge"
        for screen in ((False, True) if t % 2 else (True, False)):
            start = time.process_time()
            sims[screen].run_round(t)
            seconds[kind][screen].append(time.process_time() - start)
    record: dict[str, object] = {
        "setting": label, "traffic": args.traffic, "rounds": args.rounds, "seed": args.seed, "clock": "cpu",
        "commit": measured, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
        "screened_pairs_dropped": sims[True].algorithm.screened,
        "test_accuracy": {("screened" if screen else "plain"): accuracy(sim) for screen, sim in sims.items()},
    }
    for kind, by in seconds.items():
        if by[False]:
            record[kind] = {"rounds": len(by[False]), "plain_s": round(statistics.mean(by[False]), 3),
                            "screened_s": round(statistics.mean(by[True]), 3),
                            "ratio": round(sum(by[True]) / sum(by[False]), 3)}
            print(f"{kind:>6} rounds ({len(by[False])}): plain {statistics.mean(by[False]):.3f} s, screened "
                  f"{statistics.mean(by[True]):.3f} s, ratio {sum(by[True]) / sum(by[False]):.2f}")
    total = {s: sum(sum(by[s]) for by in seconds.values()) for s in (False, True)}
    record["ratio"] = round(total[True] / total[False], 3)
    print(f"all training rounds: ratio {record['ratio']:.2f} (load {load_before:.1f} -> {os.getloadavg()[0]:.1f}); "
          f"test accuracy {record['test_accuracy']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
