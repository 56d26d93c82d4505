"""What screened gossip (`dfca.screen`, the default) costs a runtime round, against the same round unscreened, both
measured in one run.

    python benchmarks/runtime_screen_cost.py [--pairs 4] [--rounds 12] [--demo] [--private-broker] [--favoured]
                                             [--workers N] [--out docs/results/runtime_screen_cost_runs.jsonl]

The runtime benchmark's 24-client config (or the demo's) on a fresh stack of `--workers` workers per run (by default
as many as `dfca up` starts: one per core, at most 3)
(runtime_benchmark.runtime_profile), screened and unscreened in turn, `--pairs` times, the order swapped from one
pair to the next so that both see the same load; and in each pair the simulator's same-work round, screened and
unscreened (its best of one run each). Prints each pair's seconds per round, the runtime's CPU seconds per round
(workers, other services and the RabbitMQ node together) and the ratios, screened over unscreened, then their
medians; appends them with the commit and the load to --out.
Goal: screened <= 1.3x unscreened.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from runtime_benchmark import (
    RabbitMQNode,
    bench_config,
    benchmark_broker_url,
    commit,
    default_workers,
    demo_config,
    favoured,
    redact_url,
    runtime_profile,
    simulator_round_seconds,
)

GOAL = 1.3  # screened at most this many times the unscreened round
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def screened(cfg: dict[str, Any], on: bool) -> dict[str, Any]:
    return {**cfg, "dfca": {**cfg.get("dfca", {}), "screen": on}}


def one_pair(cfg: dict[str, Any], broker: str, first_on: bool, workers: int) -> dict[str, dict[str, float]]:
    """Screened and unscreened, runtime (on `workers` workers) then simulator, in the order `first_on` says."""
    out: dict[str, dict[str, float]] = {}
    for on in (first_on, not first_on):
        with tempfile.TemporaryDirectory() as tmp:
            profile = runtime_profile(screened(cfg, on), broker, Path(tmp), workers=workers)
        out["on" if on else "off"] = {"runtime_s": profile.seconds, "runtime_cpu": sum(profile.cpu.values()),
                                      "runtime_accuracy": profile.accuracy}
    for on in (first_on, not first_on):
        sim = simulator_round_seconds(screened(cfg, on), repeats=1)
        out["on" if on else "off"] |= {"simulator_s": sim.same_work, "simulator_accuracy": sim.accuracy}
    return out


def ratios(pair: dict[str, dict[str, float]]) -> dict[str, float]:
    on, off = pair["on"], pair["off"]
    return {key: on[key] / off[key] for key in ("runtime_s", "runtime_cpu", "simulator_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--demo", action="store_true", help="the demo config instead of the 24-client one")
    p.add_argument("--broker", default=benchmark_broker_url())
    p.add_argument("--private-broker", action="store_true", help="a RabbitMQ node of the run's own")
    p.add_argument("--favoured", action="store_true", help="the run's processes ahead of the machine's others")
    p.add_argument("--workers", type=int, default=default_workers(),
                   help="the runtime's worker processes (default: as `dfca up` starts them here)")
    p.add_argument("--out", type=Path, default=RESULTS / "runtime_screen_cost_runs.jsonl")
    args = p.parse_args()
    if args.pairs < 1:
        p.error("--pairs: at least 1")
    cfg = demo_config(args.rounds) if args.demo else bench_config(args.rounds)
    load_before, measured = os.getloadavg()[0], commit()
    pairs = []
    with contextlib.ExitStack() as held:
        favour = held.enter_context(favoured()) if args.favoured else False
        if args.private_broker:
            args.broker = held.enter_context(
                RabbitMQNode.start_new(Path(held.enter_context(tempfile.TemporaryDirectory())))).url
        print("| pair | runtime s/round on, off | ratio | runtime CPU-s/round on, off | ratio | "
              "simulator s/round on, off | ratio |\n|---|---|---|---|---|---|---|", flush=True)
        for i in range(args.pairs):
            pair = one_pair(cfg, args.broker, first_on=i % 2 == 0, workers=args.workers)
            r = ratios(pair)
            pairs.append({**pair, "ratios": r})
            on, off = pair["on"], pair["off"]
            print(f"| {i + 1} | {on['runtime_s']:.3f}, {off['runtime_s']:.3f} | {r['runtime_s']:.2f}x | "
                  f"{on['runtime_cpu']:.3f}, {off['runtime_cpu']:.3f} | {r['runtime_cpu']:.2f}x | "
                  f"{on['simulator_s']:.4f}, {off['simulator_s']:.4f} | {r['simulator_s']:.2f}x |", flush=True)
    median = {key: statistics.median(pair["ratios"][key] for pair in pairs) for key in pairs[0]["ratios"]}
    accuracy = {side: statistics.mean(pair[side]["runtime_accuracy"] for pair in pairs) for side in ("on", "off")}
    print(f"\nmedian, screened over unscreened (goal <= {GOAL}x): runtime round {median['runtime_s']:.2f}x, its CPU "
          f"{median['runtime_cpu']:.2f}x; simulator round {median['simulator_s']:.2f}x. Runtime accuracy: screened "
          f"{accuracy['on']:.4f}, unscreened {accuracy['off']:.4f}")
    record = {"commit": measured, "load_before": load_before, "load_after": os.getloadavg()[0],
              "cores": os.cpu_count(), "workers": args.workers, "favoured": favour,
              "config": "demo" if args.demo else "24 clients",
              "rounds": args.rounds, "broker": redact_url(args.broker), "pairs": pairs, "median": median}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"appended to {args.out} (commit {measured})")


if __name__ == "__main__":
    main()
