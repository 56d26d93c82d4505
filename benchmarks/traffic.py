"""Accuracy and cluster recovery against the bytes a client sends: where each DFCA schedule sits.

    python benchmarks/traffic.py [--seeds 5] [--settings 2,6] [--columns ...] [--out runs/traffic] [--render]
                                 [--import-grid RUNS.jsonl:GRID=COLUMN,...]

Settings are benchmarks/cluster_recovery.py's (by index; default k=4 N=32 ER p=0.2 and k=4 N=240 ER p=0.1),
with its data, model and training. Columns are schedules:

- paper: the paper's rule (eq. 4-8), one float32 model to each neighbour a round;
- seeded paper: the same after farthest-first seeding;
- full: robust DFCA as it was the default before `traffic: lean`: seeding, 8 warm-up rounds of 10 gossip steps, then 3
  steps every round, all k clusters, float32;
- full int8: the same with 8-bit payloads (compression alone);
- lean float32 / lean float16: the new schedule (seeding, 5 gossip steps every 5th round, one-hop merges between)
  with wider payloads (the schedule alone);
- lean 3 steps: the default with 3 gossip steps a gossip round instead of 5;
- lean: the default (`dfca.traffic: lean`): that schedule with 8-bit payloads.

Each run is evaluated every 5 training rounds; a point of its curve is (MB a client sent so far, seeding
included, ARI, test accuracy). Runs are appended to OUT/runs.jsonl as they finish (a rerun skips what is there;
several processes can share OUT and split the work). Then OUT/traffic.md holds the table (per setting and
column: seeds with ARI >= 0.95, mean accuracy, MB per client over the run and its ratio to the paper rule's) and
OUT/traffic.png the curves, mean over seeds. `--import-grid` adds runs of benchmarks/cluster_recovery.py (final
accuracy and bytes, no curves) where this benchmark's own are missing: a column of the grid under this
benchmark's name for it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from cluster_recovery import SETTINGS, claim, config, load_runs  # noqa: E402
from resumable_runs import commit  # noqa: E402

from dfca.algorithms import schedule_of  # noqa: E402
from dfca.simulator import simulate  # noqa: E402

ROBUST = {"variant": "robust", "seeding": "farthest"}
COLUMNS: dict[str, dict[str, Any]] = {
    "paper": {"dfca": {"variant": "paper"}},
    "seeded paper": {"dfca": {"variant": "paper", "seeding": "farthest"}},
    "full": {"dfca": {**ROBUST, "traffic": "full"}},
    "full int8": {"dfca": {**ROBUST, "traffic": "full"}, "runtime": {"payload_dtype": "int8"}},
    "lean float32": {"dfca": {**ROBUST, "traffic": "lean"}, "runtime": {"payload_dtype": "float32"}},
    "lean float16": {"dfca": {**ROBUST, "traffic": "lean"}, "runtime": {"payload_dtype": "float16"}},
    "lean 3 steps": {"dfca": {**ROBUST, "traffic": "lean", "gossip_steps": 3}},
    "lean": {"dfca": {**ROBUST, "traffic": "lean"}},
}
EVAL_EVERY = 5


CODE = commit()  # the code this process runs, at its start (HEAD may move while it runs)


def run_one(setting: dict[str, Any], column: str, seed: int, rounds: int, max_train: int) -> dict[str, Any]:
    began = time.perf_counter()
    cfg = config({**setting, "eval": EVAL_EVERY}, {"algorithm": "dfca", "init": "global", **COLUMNS[column]}, seed,
                 rounds, max_train)
    result = simulate(cfg)
    s, skip = result.summary, schedule_of(cfg).seeding_rounds
    total = s["bytes_sent_per_client_per_round"] * schedule_of(cfg).total_rounds
    return {"setting": setting["label"], "column": column, "seed": seed, "rounds": rounds, "commit": CODE,
            "payload_dtype": cfg.runtime.payload_dtype, "ari": s["cluster_ari"], "acc": s["test_accuracy"],
            "bytes": total, "seconds": time.perf_counter() - began,
            "curve": [(h["round"] - skip, h["bytes_sent_total"], h["ari"], h["test_accuracy"]) for h in result.history
                      if h["round"] >= skip]}


def imported(path: Path, mapping: str) -> list[dict[str, Any]]:
    """Runs of benchmarks/cluster_recovery.py (its runs.jsonl) as this benchmark's, without curves: `mapping` is
    "grid column=column,..." (what a grid column was depends on the commit it ran at)."""
    names = dict(pair.split("=", 1) for pair in mapping.split(","))
    return [{"setting": r["setting"], "column": names[r["column"]], "seed": r["seed"], "rounds": r["rounds"],
             "ari": r["ari"], "acc": r["acc"], "bytes": r["bytes_per_round"] * (r["rounds"] + r["seeding_rounds"]),
             "curve": None, "from": str(path)}
            for r in load_runs(path) if r["column"] in names]


def cell(runs: list[dict[str, Any]], paper_bytes: float | None) -> str:
    if not runs:
        return "–"
    recovered = sum(r["ari"] >= 0.95 for r in runs)
    mb = statistics.mean(r["bytes"] for r in runs) / 1e6
    ratio = f" ({mb * 1e6 / paper_bytes:.2f}×)" if paper_bytes else ""
    return f"{recovered}/{len(runs)}, {100 * statistics.mean(r['acc'] for r in runs):.1f}%, {mb:,.0f} MB{ratio}"


def render(runs: list[dict[str, Any]], labels: list[str], columns: list[str], out: Path) -> str:
    lines = ["| schedule | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    paper = {label: statistics.mean(r["bytes"] for r in runs if r["setting"] == label and r["column"] == "paper")
             for label in labels if any(r["setting"] == label and r["column"] == "paper" for r in runs)}
    for name in columns:
        lines.append(f"| {name} | " + " | ".join(
            cell([r for r in runs if r["setting"] == label and r["column"] == name], paper.get(label))
            for label in labels) + " |")
    table = "\n".join(lines) + "\n"
    (out / "traffic.md").write_text(table)
    fig, axes = plt.subplots(2, len(labels), figsize=(6 * len(labels), 7), squeeze=False)
    for c, label in enumerate(labels):
        for k, name in enumerate(columns):
            color = plt.get_cmap("tab10")(k % 10)
            chosen = [r for r in runs if r["setting"] == label and r["column"] == name]
            curves = [r["curve"] for r in chosen if r["curve"]]
            length = min((len(cv) for cv in curves), default=0)
            mb = [statistics.mean(cv[i][1] for cv in curves) / 1e6 for i in range(length)]
            for row, index, key, what in ((0, 3, "acc", "test accuracy"), (1, 2, "ari", "ARI")):
                if curves:  # the run as it goes: evaluated every EVAL_EVERY rounds
                    axes[row][c].plot(mb, [statistics.mean(cv[i][index] for cv in curves) for i in range(length)],
                                      marker="o", markersize=2, linewidth=1, color=color)
                if chosen:  # where it ends: mean over seeds (every run, imported ones too)
                    axes[row][c].plot([statistics.mean(r["bytes"] for r in chosen) / 1e6],
                                      [statistics.mean(r[key] for r in chosen)], marker="*", markersize=12,
                                      linestyle="", color=color, label=f"{name} ({len(chosen)} seeds)")
                axes[row][c].set_ylabel(what)
        for row in range(2):
            axes[row][c].set_xscale("log")
            axes[row][c].set_xlabel("MB sent per client (cumulative, log scale)")
            axes[row][c].grid(alpha=0.3)
        axes[0][c].set_title(label)
    for c in range(len(labels)):
        axes[0][c].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "traffic.png", dpi=110)
    plt.close(fig)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--settings", default="2,6", help="indices into cluster_recovery.SETTINGS")
    p.add_argument("--columns", default=",".join(COLUMNS), help=f"comma-separated, of: {', '.join(COLUMNS)}")
    p.add_argument("--max-train", type=int, default=200, help="cap on training images per client")
    p.add_argument("--out", type=Path, default=Path("runs/traffic"))
    p.add_argument("--render", action="store_true", help="only redraw from OUT/runs.jsonl")
    p.add_argument("--import-grid", action="append", default=[], metavar="RUNS.jsonl:GRID=COLUMN,...",
                   help="add cluster_recovery.py runs to the table (no curves), e.g. "
                   "docs/results/traffic_columns_runs.jsonl:'robust GI=full'")
    args = p.parse_args()
    columns = [c.strip() for c in args.columns.split(",")]
    if unknown := [c for c in columns if c not in COLUMNS]:
        p.error(f"unknown columns {unknown}; choose from {list(COLUMNS)}")
    settings = [SETTINGS[int(i)] for i in args.settings.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    for setting in [] if args.render else settings:
        for seed in range(args.seeds):
            for name in columns:
                if not claim(args.out, log, (setting["label"], name, seed, args.rounds)):
                    continue
                run = run_one(setting, name, seed, args.rounds, args.max_train)
                with log.open("a") as f:
                    f.write(json.dumps(run) + "\n")
                print(f"{setting['label']:24s} {name:13s} seed {seed}: ARI {run['ari']:.3f} acc {run['acc']:.4f} "
                      f"{run['bytes'] / 1e6:,.0f} MB ({run['seconds']:.0f}s)", flush=True)
    extra = [run for spec in args.import_grid for run in imported(Path(spec.split(":", 1)[0]), spec.split(":", 1)[1])]
    ours = {(r["setting"], r["column"], r["seed"]) for r in load_runs(log)}
    runs = load_runs(log) + [r for r in extra if (r["setting"], r["column"], r["seed"]) not in ours]
    print(render(runs, [s["label"] for s in settings], columns, args.out))


if __name__ == "__main__":
    main()
