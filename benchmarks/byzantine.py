"""One compromised host of three: what each forged attack (harness.forgery) costs the honest clients, screen on and off.

    python benchmarks/byzantine.py [--seeds 1] [--processes 2] [--settings 0,1] [--out runs/byzantine]

Every run is robust DFCA over three in-memory message drivers in lockstep (harness.forged_lockstep.run_with_forger,
the message driver's own code), host 1 compromised: it trains, receives and reports like the others, but its
clients send what the attack forges, in its gossip steps and, on the lean schedule, its one-hop merges too
(harness.forgery.forged_models). Rows are attacks, columns the defence: `lean screen` (the default: `traffic: lean`,
`dfca.screen` on, core.screened_gossip, its gossip steps and one-hop merges screened), `lean off` (the same
unscreened: `dfca.screen: false`), and with `traffic: full` (gossip every round) `off`, `screen` and `screen+trim`
(also `dfca.screen_trim: 0.25`, the coordinate-wise trimmed mean); seeding's checks are always on. Each cell is
the honest clients' mean test accuracy and ARI (hosts 0 and 2 only), mean over seeds, and its difference from the
honest run with the same defence. Settings: the runtime tests' config (rotated MNIST k=2, 24 clients, ER p=0.5,
h=64) and the goal grid's k=4 N=32 ER p=0.2 (h=200, 15 rounds: half the grid's, to save CPU).

Each finished run is appended to OUT/runs.jsonl (a rerun skips what is there); the table is printed and written to
OUT/table.md with the commit and the load. Processes run one BLAS thread each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # harness: drivers in lockstep

from resumable_runs import commit, load_runs, run_pending  # noqa: E402

from dfca.config import ExperimentConfig  # noqa: E402
from dfca.data import build_federated_data  # noqa: E402
from dfca.graph import build_graph, neighbours  # noqa: E402
from harness.forged_lockstep import honest_scores, run_with_forger  # noqa: E402
from harness.forgery import Attack  # noqa: E402

SETTINGS: list[dict[str, Any]] = [
    {"label": "k=2 N=24 ER p=0.5 h=64 (runtime tests)", "config": {
        "clusters": 2, "rounds": 10, "aggregation": "sequential",
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": 24, "train_per_client": 80,
                 "test_per_client": 25},
        "model": {"kind": "mlp", "hidden": 64}, "train": {"lr": 0.25, "local_epochs": 3, "batch_size": 20},
        "topology": {"kind": "erdos_renyi", "p": 0.5}}},
    {"label": "k=4 N=32 ER p=0.2 h=200 (goal grid)", "config": {
        "clusters": 4, "rounds": 15, "aggregation": "batch",
        "data": {"dataset": "mnist-bundled", "rotations": [0, 90, 180, 270], "clients": 32, "train_per_client": 200,
                 "test_per_client": 50, "permute_per_cluster": True},
        "model": {"kind": "mlp", "hidden": 200}, "train": {"lr": 0.1, "local_epochs": 5, "batch_size": 50},
        "topology": {"kind": "erdos_renyi", "p": 0.2}}},
]
ATTACKS: list[tuple[str, str]] = [
    ("none", "none"),
    ("inflate", "inflate"),  # the seed hijack and the consensus hijack together
    ("inflate", "none"), ("relay", "none"), ("duplicate", "none"),
    ("none", "inflate"), ("none", "zeros"), ("none", "flip"), ("none", "reverse"),
]
DEFENCES = {"lean screen": {"dfca": {"traffic": "lean", "screen": True}},  # the default
            "lean off": {"dfca": {"traffic": "lean", "screen": False}},
            "off": {"dfca": {"traffic": "full", "screen": False}},
            "screen": {"dfca": {"traffic": "full", "screen": True}},
            "screen+trim": {"dfca": {"traffic": "full", "screen": True, "screen_trim": 0.25}}}


def config(setting: dict[str, Any], defence: str, seed: int) -> ExperimentConfig:
    raw: dict[str, Any] = {"name": "byzantine", "algorithm": "dfca", "seed": seed, **setting["config"]}
    for key, value in DEFENCES[defence].items():
        raw[key] = {**raw.get(key, {}), **value}
    return ExperimentConfig.model_validate(raw)


def one_run(spec: dict[str, Any]) -> dict[str, Any]:
    setting = SETTINGS[spec["setting"]]
    cfg = config(setting, spec["defence"], spec["seed"])
    data = build_federated_data(cfg)
    graph = neighbours(build_graph(cfg.topology, data.num_clients, cfg.seed))
    start = time.perf_counter()
    run = run_with_forger(cfg, data, graph, Attack(spec["attack"][0], spec["attack"][1]))  # type: ignore[arg-type]
    return {**spec, **honest_scores(run, 1), "seconds": time.perf_counter() - start}


def key(run: dict[str, Any]) -> tuple[Any, ...]:
    return run["setting"], run["defence"], tuple(run["attack"]), run["seed"]


def table(runs: list[dict[str, Any]], settings: list[int]) -> str:
    lines = []
    for s in settings:
        lines += [f"### {SETTINGS[s]['label']}", "",
                  "| attack (seed, gossip) | " + " | ".join(f"defence {d}" for d in DEFENCES) + " |",
                  "|---|" + "---|" * len(DEFENCES)]
        honest = {d: [r for r in runs if r["setting"] == s and r["defence"] == d and tuple(r["attack"]) ==
                      ("none", "none")] for d in DEFENCES}
        for attack in ATTACKS:
            cells = []
            for d in DEFENCES:
                mine = [r for r in runs if r["setting"] == s and r["defence"] == d and tuple(r["attack"]) == attack]
                if not mine:
                    cells.append("–")
                    continue
                acc = statistics.mean(r["test_accuracy"] for r in mine)
                ari = statistics.mean(r["cluster_ari"] for r in mine)
                base = statistics.mean(r["test_accuracy"] for r in honest[d]) if honest[d] else None
                delta = f" ({100 * (acc - base):+.1f})" if base is not None and attack != ("none", "none") else ""
                cells.append(f"{100 * acc:.1f}%{delta}, ARI {ari:.2f} (n={len(mine)})")
            lines.append(f"| {attack[0]}, {attack[1]} | " + " | ".join(cells) + " |")
        seconds = {d: [r["seconds"] for r in runs if r["setting"] == s and r["defence"] == d] for d in DEFENCES}
        timing = ", ".join(f"{d} {statistics.mean(v):.0f}" for d, v in seconds.items() if v)
        lines += ["", f"Seconds per run, mean over the attacks run: {timing} (two runs at a time, one thread each).",
                  ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--settings", default="0,1")
    parser.add_argument("--defences", default=",".join(DEFENCES))
    parser.add_argument("--attacks", default="", help="seed:gossip,...; default: all of ATTACKS")
    parser.add_argument("--out", type=Path, default=Path("runs/byzantine"))
    args = parser.parse_args()
    settings = [int(s) for s in args.settings.split(",")]
    defences = args.defences.split(",")
    attacks = [tuple(a.split(":")) for a in args.attacks.split(",")] if args.attacks else ATTACKS
    results = args.out / "runs.jsonl"
    done = {key(r) for r in load_runs(results)}
    todo = [{"setting": s, "defence": d, "attack": list(a), "seed": seed}
            for s in settings for seed in range(args.seeds) for a in attacks for d in defences]
    todo = [t for t in todo if key(t) not in done]
    run_pending(todo, one_run, results, args.processes,
                lambda r: f"{SETTINGS[r['setting']]['label']} {r['defence']} {r['attack']} seed {r['seed']}: "
                          f"{r['test_accuracy']:.3f} ARI {r['cluster_ari']:.2f} ({r['seconds']:.0f} s)")
    text = (f"Measured with `python benchmarks/byzantine.py` ({' '.join(sys.argv[1:])}) at commit {commit()}, "
            f"load {os.getloadavg()[0]:.2f} at the end.\n\n" + table(load_runs(results), settings))
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
