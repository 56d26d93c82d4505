"""Cluster recovery on sparse graphs: the paper's DFCA rule against the robust default and IFCA.

    python benchmarks/cluster_recovery.py [--seeds 5] [--rounds 30] [--settings 0,1] [--columns ...]
                                          [--paper] [--quick] [--render] [--out runs/cluster_recovery]

Rows are settings (k, N, graph, and stress: 10% message loss with sequential aggregation); columns
are DFCA with the paper's rule, the robust default (farthest-first seeding + ratio consensus, GI and
LI), robust without seeding, and centralized IFCA, all on the same data, seeds and starting models.
Every column trains for `--rounds` rounds; seeding adds its k * flood_rounds communication-only
rounds first. Each cell is the ARI mean and minimum over seeds, how many seeds reached ARI >= 0.95,
and the mean test accuracy. Every finished run is appended to OUT/runs.jsonl at once; a rerun
skips what is there, and several processes (one per core, OMP_NUM_THREADS=1) can share one OUT
and split the grid. Then the table is printed and written as markdown to OUT/table.md, and
OUT/cluster_recovery.png is drawn. `--paper` runs also log ARI and accuracy every 5 rounds, drawn
in OUT/cluster_recovery_curves.png. `--render` only redraws from runs.jsonl.

`--paper` runs the DFCA paper's own settings instead (k=4 N=240 ER p=0.1 and k=2 N=100 ER p=0.15,
MLP h=2048 and h=200, T=150). One h=2048 round on 240 clients takes tens of seconds on 2 CPU cores;
use `--rounds`, `--settings` and `--seeds` to fit the machine.

Data: rotated bundled MNIST, each cluster its own permutation of the 4,000 training images, as many
per client as that allows (at most `--max-train`), MLP h=200, lr 0.1, 5 local epochs, batch 50.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from resumable_runs import commit  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from dfca.algorithms import schedule_of  # noqa: E402
from dfca.config import ExperimentConfig  # noqa: E402
from dfca.simulator import simulate  # noqa: E402

ER, BA = "erdos_renyi", "barabasi_albert"
SETTINGS: list[dict[str, Any]] = [
    {"label": "k=2 N=30 BA m=2", "k": 2, "n": 30, "topology": {"kind": BA, "m": 2}},
    {"label": "k=2 N=30 ER p=0.1", "k": 2, "n": 30, "topology": {"kind": ER, "p": 0.1}},
    {"label": "k=4 N=32 ER p=0.2", "k": 4, "n": 32, "topology": {"kind": ER, "p": 0.2}},
    {"label": "k=4 N=40 BA m=2", "k": 4, "n": 40, "topology": {"kind": BA, "m": 2}},
    {"label": "k=4 N=60 ER p=0.3", "k": 4, "n": 60, "topology": {"kind": ER, "p": 0.3}},
    {"label": "k=2 N=100 ER p=0.15", "k": 2, "n": 100, "topology": {"kind": ER, "p": 0.15}},
    {"label": "k=4 N=240 ER p=0.1", "k": 4, "n": 240, "topology": {"kind": ER, "p": 0.1}},
    {"label": "k=4 N=32 ER p=0.2, 10% loss, sequential", "k": 4, "n": 32, "topology": {"kind": ER, "p": 0.2},
     "extra": {"aggregation": "sequential", "network": {"message_loss": 0.1}}},
    {"label": "k=2 N=30 BA m=2, 10% loss, sequential", "k": 2, "n": 30, "topology": {"kind": BA, "m": 2},
     "extra": {"aggregation": "sequential", "network": {"message_loss": 0.1}}},
]
# The DFCA paper's own settings (Tables 1 and 2): `--paper` runs these instead, each with its own
# model, batch size and rounds, and logs ARI and accuracy every `eval` rounds for the curves plot.
PAPER_SETTINGS: list[dict[str, Any]] = [  # T = 150 as in the paper; --rounds cuts it on small machines
    {"label": "paper k=4 N=240 ER p=0.1 h=2048", "k": 4, "n": 240, "topology": {"kind": ER, "p": 0.1},
     "rounds": 150, "eval": 5, "extra": {"model": {"hidden": 2048}}},
    {"label": "paper k=2 N=100 ER p=0.15 h=2048", "k": 2, "n": 100, "topology": {"kind": ER, "p": 0.15},
     "rounds": 150, "eval": 5, "extra": {"model": {"hidden": 2048}}},
    {"label": "paper k=4 N=240 ER p=0.1 h=200", "k": 4, "n": 240, "topology": {"kind": ER, "p": 0.1},
     "rounds": 150, "eval": 5},
    {"label": "paper k=2 N=100 ER p=0.15 h=200", "k": 2, "n": 100, "topology": {"kind": ER, "p": 0.15},
     "rounds": 150, "eval": 5},
]
COLUMNS: dict[str, dict[str, Any]] = {
    "paper GI": {"algorithm": "dfca", "init": "global", "dfca": {"variant": "paper"}},
    "paper LI": {"algorithm": "dfca", "init": "local", "dfca": {"variant": "paper"}},
    "robust GI": {"algorithm": "dfca", "init": "global", "dfca": {"variant": "robust", "seeding": "farthest"}},
    "robust LI": {"algorithm": "dfca", "init": "local", "dfca": {"variant": "robust", "seeding": "farthest"}},
    # the default with exact (float32) payloads: in the simulator G gossip steps then compose into one walk
    "robust GI float32": {"algorithm": "dfca", "init": "global", "dfca": {"variant": "robust", "seeding": "farthest"},
                          "runtime": {"payload_dtype": "float32"}},
    "no-seeding GI": {"algorithm": "dfca", "init": "global", "dfca": {"variant": "robust", "seeding": "none"}},
    "no-seeding LI": {"algorithm": "dfca", "init": "local", "dfca": {"variant": "robust", "seeding": "none"}},
    "IFCA": {"algorithm": "ifca", "init": "global"},
    # ablations: seeding with less or no consensus after it
    "seeded 3-step GI": {"algorithm": "dfca", "init": "global",
                         "dfca": {"variant": "robust", "seeding": "farthest", "warmup_rounds": 0}},
    "seeded paper GI": {"algorithm": "dfca", "init": "global", "dfca": {"variant": "paper", "seeding": "farthest"}},
    # without screened gossip (on by default, docs/security.md): what the screen costs where nobody lies
    "robust GI unscreened": {"algorithm": "dfca", "init": "global",
                             "dfca": {"variant": "robust", "seeding": "farthest", "screen": False}},
}
DEFAULT_COLUMNS = "paper GI,robust GI,robust LI,no-seeding GI,IFCA"
TRAIN_IMAGES, TEST_IMAGES = 4000, 1000  # the bundled 5,000 images, 20% held out for testing


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def config(setting: dict[str, Any], column: dict[str, Any], seed: int, rounds: int, max_train: int,
           device: str = "cpu") -> ExperimentConfig:
    k, n = setting["k"], setting["n"]
    per_cluster = -(-n // k)
    every = setting.get("eval", rounds)
    base = {
        "name": "recovery", "clusters": k, "rounds": rounds, "seed": seed, "eval_every": every,
        "aggregation": "batch", "device": device,
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180] if k == 2 else [0, 90, 180, 270],
                 "clients": n, "train_per_client": min(max_train, TRAIN_IMAGES // per_cluster),
                 "test_per_client": min(50, TEST_IMAGES // per_cluster), "permute_per_cluster": True},
        "model": {"kind": "mlp", "hidden": 200},
        "train": {"lr": 0.1, "local_epochs": 5, "batch_size": 50},
        "topology": setting["topology"],
    }
    cfg = ExperimentConfig.model_validate(merge(merge(base, setting.get("extra", {})), column))
    return cfg


def load_runs(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def claim(out: Path, log: Path, key: tuple[str, str, int, int]) -> bool:
    """Take run `key` unless runs.jsonl has it or a live process claimed it: several processes of this
    benchmark can share one OUT (one per core, each with OMP_NUM_THREADS=1) and split the grid."""
    if any((r["setting"], r["column"], r["seed"], r["rounds"]) == key for r in load_runs(log)):
        return False
    claims = out / "claims"
    claims.mkdir(exist_ok=True)
    path = claims / hashlib.sha1(json.dumps(key).encode()).hexdigest()
    try:
        with path.open("x") as f:
            f.write(str(os.getpid()))
        return True
    except FileExistsError:
        try:
            os.kill(int(path.read_text() or 0), 0)
            return False  # its owner still runs it
        except (ProcessLookupError, ValueError):
            path.write_text(str(os.getpid()))  # the owner died: take it over
            return True


def cell(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return "-"
    aris = [r["ari"] for r in runs]
    ok = sum(a >= 0.95 for a in aris)
    return (f"{statistics.mean(aris):.2f} / {min(aris):.2f} ({ok}/{len(aris)}), "
            f"{100 * statistics.mean(r['acc'] for r in runs):.1f}%")


def render(runs: list[dict[str, Any]], settings: list[dict[str, Any]], columns: list[str], out: Path,
           console: Console) -> None:
    labels = [s["label"] for s in settings if any(r["setting"] == s["label"] for r in runs)]
    table = Table(title="cluster recovery: ARI mean / min (seeds with ARI >= 0.95), mean test accuracy")
    table.add_column("setting")
    for name in columns:
        table.add_column(name, justify="right")
    for label in labels:
        table.add_row(label, *[cell([r for r in runs if r["setting"] == label and r["column"] == name])
                               for name in columns])
    console.print(table)
    lines = ["| setting | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for label in labels:
        cells = [cell([r for r in runs if r["setting"] == label and r["column"] == name]) for name in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / max(len(columns), 1)
    lowest = 100.0
    for c, name in enumerate(columns):
        aris, accs = [], []
        for label in labels:
            rows = [r for r in runs if r["setting"] == label and r["column"] == name]
            aris.append(statistics.mean(r["ari"] for r in rows) if rows else 0.0)
            accs.append(100 * statistics.mean(r["acc"] for r in rows) if rows else 0.0)
        lowest = min([lowest, *(a for a in accs if a > 0)])
        xs = [i + c * width for i in range(len(labels))]
        axes[0].bar(xs, aris, width, label=name)
        axes[1].bar(xs, accs, width, label=name)
    for ax, ylabel in zip(axes, ("cluster ARI (mean over seeds)", "test accuracy % (mean over seeds)"), strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=7, rotation=25, ha="right")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(-0.1, 1.05)
    axes[1].set_ylim(max(0.0, 5 * (lowest // 5) - 5), 100)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=len(columns), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(out / "cluster_recovery.png", dpi=110)
    console.print(f"wrote {out}/runs.jsonl, {out}/table.md and {out}/cluster_recovery.png")
    if any(r.get("curve") for r in runs):
        plot_curves(runs, labels, columns, out / "cluster_recovery_curves.png")
        console.print(f"wrote {out}/cluster_recovery_curves.png")


def plot_curves(runs: list[dict[str, Any]], labels: list[str], columns: list[str], path: Path) -> None:
    """ARI and accuracy against training round, mean over seeds: one row of panels per setting."""
    fig, axes = plt.subplots(len(labels), 2, figsize=(12, 3.2 * len(labels)), squeeze=False)
    for row, label in enumerate(labels):
        for name in columns:
            curves = [r["curve"] for r in runs if r["setting"] == label and r["column"] == name and r.get("curve")]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            xs = [curves[0][i][0] for i in range(length)]
            for col, key in enumerate((1, 2)):
                ys = [statistics.mean(c[i][key] for c in curves) for i in range(length)]
                axes[row][col].plot(xs, ys, marker="o", markersize=2, label=f"{name} ({len(curves)} seeds)")
        axes[row][0].set_ylabel(f"{label}\nARI", fontsize=8)
        axes[row][1].set_ylabel("test accuracy")
        axes[row][0].set_ylim(-0.1, 1.05)
        axes[row][0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("training round (after seeding)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=None,
                   help="training rounds of every run (seeding comes on top); default 30, or 150 with --paper")
    p.add_argument("--settings", default=None, help="comma-separated indices into the settings (default: all)")
    p.add_argument("--paper", action="store_true",
                   help="the paper's own settings (PAPER_SETTINGS: N=100/240, h=200/2048, their own rounds)")
    p.add_argument("--columns", default=DEFAULT_COLUMNS, help=f"comma-separated, of: {', '.join(COLUMNS)}")
    p.add_argument("--max-train", type=int, default=200, help="cap on training images per client")
    p.add_argument("--quick", action="store_true", help="2 seeds, 12 rounds, the first 2 settings")
    p.add_argument("--render", action="store_true", help="only print and plot what runs.jsonl holds")
    p.add_argument("--out", type=Path, default=None, help="default runs/cluster_recovery (or ..._paper)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the simulations run")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.rounds, args.settings = 2, 12, args.settings or "0,1"
    catalogue = PAPER_SETTINGS if args.paper else SETTINGS
    settings = [catalogue[int(i)] for i in (args.settings or ",".join(map(str, range(len(catalogue))))).split(",")]
    columns = [c.strip() for c in args.columns.split(",")]
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        p.error(f"unknown columns {unknown}; choose from {list(COLUMNS)}")
    code = commit()  # the code this process runs (HEAD may move while it runs)
    out: Path = args.out or Path("runs/cluster_recovery" + ("_paper" if args.paper else ""))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    console = Console(width=170)
    runs = load_runs(log)
    for setting in [] if args.render else settings:
        rounds = args.rounds or setting.get("rounds", 30)
        for seed in range(args.seeds):
            for name in columns:
                if not claim(out, log, (setting["label"], name, seed, rounds)):
                    continue  # done, or another process of this benchmark runs it
                began, load = time.perf_counter(), os.getloadavg()[0]
                cfg = config(setting, COLUMNS[name], seed, rounds, args.max_train, args.device)
                elapsed: list[tuple[int, float]] = []  # (round, seconds since the run began) at each evaluation
                result = simulate(cfg, on_round=lambda r, e=elapsed, b=began: e.append((r["round"],
                                                                                     time.perf_counter() - b)))
                s, skip = result.summary, schedule_of(cfg).seeding_rounds
                run = {"setting": setting["label"], "column": name, "seed": seed, "rounds": rounds,
                       "seeding_rounds": skip, "ari": s["cluster_ari"], "acc": s["test_accuracy"],
                       "populated": s["populated_clusters"], "bytes_per_round": s["bytes_sent_per_client_per_round"],
                       "seconds": time.perf_counter() - began, "commit": code, "load_before": load,
                       "load_after": os.getloadavg()[0], "threads": torch.get_num_threads(),
                       "elapsed": elapsed,
                       "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "curve": [(h["round"] - skip, h["ari"], h["test_accuracy"]) for h in result.history
                                 if h["round"] > skip] if "eval" in setting else None}
                runs.append(run)
                with log.open("a") as f:
                    f.write(json.dumps(run) + "\n")
                console.print(f"{setting['label']:40s} {name:13s} seed {seed}: ARI {run['ari']:.3f} "
                              f"acc {run['acc']:.4f} populated {run['populated']} ({run['seconds']:.0f}s)")
    wanted = {(s["label"], args.rounds or s.get("rounds", 30)) for s in settings}
    render([r for r in runs if (r["setting"], r["rounds"]) in wanted], settings, columns, out, console)


if __name__ == "__main__":
    main()
