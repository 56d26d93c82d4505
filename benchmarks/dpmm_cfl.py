"""DPMM-CFL against FeSEM swept over k: the shape of the paper's Figures 1 and 2, at the bundled data's scale.

    python benchmarks/dpmm_cfl.py [--seeds 5] [--rounds 30] [--processes 2] [--out docs]
                                  [--results runs/dpmm_cfl/runs.jsonl] [--render]

Data: the 5,000 bundled MNIST images (4,000 train, 1,000 test), label-skewed (dfca.data.label_skew) into
G = 5 groups of 10 clients (50 clients, 60 train and 20 test images each: 3,000 train draws from 4,000 images
and all 1,000 test images, so shards barely overlap), Dirichlet (0.1 across groups, 10 within) or class split
(3 classes a group, 2 a client). The paper's 200 clients and 10 groups would leave 20 train images a client.
Model: MLP with 64 hidden units (its final layer, 650 numbers, is what the server clusters), SGD lr 0.05,
momentum 0.9, batch 10, one local epoch (Q = 6 steps). Methods: DPMM-CFL (split-merge, the defaults of
`dpmm:`), DPMM-CFL with Gibbs scans only, and FeSEM at every k of K_VALUES. Reported as the paper does:
micro-accuracy and macro-F1 averaged over clients, the mean of the last three rounds; mean ± std over seeds.
Every finished run is appended to the results file (resumable); docs/dpmm_cfl.md's tables and
docs/dpmm_cfl_figures.png are rendered from it. `--render` only redraws.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import matplotlib
from resumable_runs import commit, load_runs, run_pending

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PARTITIONS = ("dirichlet", "class_split")
GROUPS, CLIENTS, TRAIN, TEST = 5, 50, 60, 20
K_VALUES = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 25)
DPMM_METHODS = {"DPMM-CFL": {"sampler": "split_merge"}, "DPMM-CFL, Gibbs only": {"sampler": "gibbs"}}


def grid(seeds: int, rounds: int) -> list[dict[str, Any]]:
    keys = []
    for partition in PARTITIONS:
        for seed in range(seeds):
            keys += [{"partition": partition, "method": m, "k": None, "seed": seed, "rounds": rounds}
                     for m in DPMM_METHODS]
            keys += [{"partition": partition, "method": "FeSEM", "k": k, "seed": seed, "rounds": rounds}
                     for k in K_VALUES]
    return keys


def key_of(run: dict[str, Any]) -> str:
    return json.dumps([run["partition"], run["method"], run["k"], run["seed"], run["rounds"]])


def config_of(spec: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "name": "dpmm-bench", "seed": spec["seed"], "rounds": spec["rounds"],
        "data": {"partition": spec["partition"], "groups": GROUPS, "clients": CLIENTS, "train_per_client": TRAIN,
                 "test_per_client": TEST},
        "model": {"kind": "mlp", "hidden": 64},
        "train": {"lr": 0.05, "local_epochs": 1, "batch_size": 10, "momentum": 0.9},
    }
    if spec["method"] == "FeSEM":
        return {**cfg, "algorithm": "fesem", "clusters": spec["k"]}
    return {**cfg, "algorithm": "dpmm_cfl", "clusters": GROUPS, "dpmm": DPMM_METHODS[spec["method"]]}


def one_run(spec: dict[str, Any]) -> dict[str, Any]:
    from dfca.config import parse_config
    from dfca.simulator import simulate

    began = time.perf_counter()
    result = simulate(parse_config(config_of(spec)))
    s = result.summary
    return {**spec, "inferred_clusters": s["inferred_clusters"], "ari": s["cluster_ari"],
            "accuracy": s["test_accuracy_last3"], "f1": s["macro_f1_last3"],
            "k_t": [h["inferred_clusters"] for h in result.history],
            "accuracy_t": [h["test_accuracy"] for h in result.history],
            "f1_t": [h["macro_f1"] for h in result.history],
            "split_acceptance_t": [h.get("split_acceptance", 0.0) for h in result.history],
            "merge_acceptance_t": [h.get("merge_acceptance", 0.0) for h in result.history],
            "seconds": time.perf_counter() - began}


def describe(r: dict[str, Any]) -> str:
    return (f"{r['partition']} {r['method']} k={r['k']} seed {r['seed']}: K {r['inferred_clusters']:.0f} "
            f"acc {r['accuracy']:.3f} ({r['seconds']:.0f} s)")


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def pick(runs: list[dict[str, Any]], partition: str, method: str, k: int | None = None) -> list[dict[str, Any]]:
    return [r for r in runs if r["partition"] == partition and r["method"] == method and r["k"] == k]


def tables(runs: list[dict[str, Any]]) -> str:
    out = []
    for partition in PARTITIONS:
        lines = [f"### {partition} (true groups: {GROUPS})", "",
                 "| method | k | inferred K | accuracy | macro-F1 | ARI vs groups | runs |",
                 "|---|---|---|---|---|---|---|"]
        for method in DPMM_METHODS:
            rs = pick(runs, partition, method)
            if rs:
                cells = [mean_std([r[m] for r in rs]) for m in ("inferred_clusters", "accuracy", "f1", "ari")]
                lines.append(f"| {method} | inferred | {cells[0][0]:.1f} ± {cells[0][1]:.1f} | "
                             f"{cells[1][0]:.3f} ± {cells[1][1]:.3f} | {cells[2][0]:.3f} ± {cells[2][1]:.3f} | "
                             f"{cells[3][0]:.2f} ± {cells[3][1]:.2f} | {len(rs)} |")
        for k in K_VALUES:
            rs = pick(runs, partition, "FeSEM", k)
            if rs:
                cells = [mean_std([r[m] for r in rs]) for m in ("inferred_clusters", "accuracy", "f1", "ari")]
                lines.append(f"| FeSEM | {k} | {cells[0][0]:.1f} | {cells[1][0]:.3f} ± {cells[1][1]:.3f} | "
                             f"{cells[2][0]:.3f} ± {cells[2][1]:.3f} | {cells[3][0]:.2f} ± {cells[3][1]:.2f} | "
                             f"{len(rs)} |")
        out.append("\n".join(lines))
    seed_lines = ["### DPMM-CFL per seed", "", "| partition | method | seed | K_T | K_t over rounds | accuracy | "
                  "macro-F1 | ARI |", "|---|---|---|---|---|---|---|---|"]
    for partition in PARTITIONS:
        for method in DPMM_METHODS:
            for r in sorted(pick(runs, partition, method), key=lambda r: r["seed"]):
                trace = " ".join(str(int(k)) for k in r["k_t"])
                seed_lines.append(f"| {partition} | {method} | {r['seed']} | {int(r['inferred_clusters'])} | {trace} | "
                                  f"{r['accuracy']:.3f} | {r['f1']:.3f} | {r['ari']:.2f} |")
    out.append("\n".join(seed_lines))
    return "\n\n".join(out)


def figures(runs: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(17, 9), squeeze=False)
    for row, partition in enumerate(PARTITIONS):
        dpmm = pick(runs, partition, "DPMM-CFL")
        for col, (metric, label) in enumerate((("accuracy", "micro-accuracy"), ("f1", "macro-F1"))):
            ax = axes[row][col]
            points = [(k, *mean_std([r[metric] for r in pick(runs, partition, "FeSEM", k)]))
                      for k in K_VALUES if pick(runs, partition, "FeSEM", k)]
            if points:
                ks, mean, std = zip(*points, strict=True)
                ax.plot(ks, mean, marker="o", label="FeSEM (fixed k)")
                ax.fill_between(ks, [m - s for m, s in zip(mean, std, strict=True)],
                                [m + s for m, s in zip(mean, std, strict=True)], alpha=0.2)
            if dpmm:
                m, s = mean_std([r[metric] for r in dpmm])
                ax.axhline(m, linestyle=":", color="C3", label=f"DPMM-CFL (unknown k): {m:.3f} ± {s:.3f}")
                ax.axhspan(m - s, m + s, color="C3", alpha=0.1)
                kmean, kstd = mean_std([r["inferred_clusters"] for r in dpmm])
                ax.axvline(kmean, linestyle=":", color="C2", label=f"inferred K: {kmean:.1f} ± {kstd:.1f}")
                ax.axvspan(kmean - kstd, kmean + kstd, color="C2", alpha=0.1)
            ax.axvline(GROUPS, linestyle="--", color="grey", linewidth=0.8, label=f"true groups ({GROUPS})")
            ax.set_xlabel("k")
            ax.set_ylabel(label)
            ax.set_title(f"Fig. 1 shape: {partition}, {label} (mean of the last 3 rounds)", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        ax = axes[row][2]
        for r in sorted(dpmm, key=lambda r: r["seed"]):
            rounds = range(1, len(r["k_t"]) + 1)
            ax.plot(rounds, r["k_t"], drawstyle="steps-post", label=f"K_t, seed {r['seed']}")
        ax2 = ax.twinx()
        if dpmm:
            rounds = range(1, len(dpmm[0]["accuracy_t"]) + 1)
            ax2.plot(rounds, [statistics.fmean(v) for v in zip(*(r["accuracy_t"] for r in dpmm), strict=True)],
                     color="black", linestyle="--", label="accuracy (mean)")
            ax2.plot(rounds, [statistics.fmean(v) for v in zip(*(r["f1_t"] for r in dpmm), strict=True)],
                     color="grey", linestyle="--", label="macro-F1 (mean)")
        ax2.set_ylim(0, 1)
        ax.set_xlabel("round")
        ax.set_ylabel("inferred K_t")
        ax.set_title(f"Fig. 2 shape: DPMM-CFL, {partition}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        ax2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--results", type=Path, default=Path("runs/dpmm_cfl/runs.jsonl"))
    ap.add_argument("--render", action="store_true")
    args = ap.parse_args()
    done = load_runs(args.results)
    have = {key_of(r) for r in done}
    todo = [k for k in grid(args.seeds, args.rounds) if key_of(k) not in have]
    if not args.render:
        done += run_pending(todo, one_run, args.results, args.processes, describe)
    runs = [r for r in done if r["rounds"] == args.rounds and r["seed"] < args.seeds]
    args.out.mkdir(parents=True, exist_ok=True)
    figures(runs, args.out / "dpmm_cfl_figures.png")
    header = (f"Measured by `python benchmarks/dpmm_cfl.py --seeds {args.seeds} --rounds {args.rounds}` (its built-in "
              f"configs) at commit {commit()}, load average {os.getloadavg()[0]:.2f} when rendered; bundled MNIST, "
              f"{CLIENTS} clients in {GROUPS} groups, {TRAIN} train / {TEST} test images a client; accuracy and "
              f"macro-F1: the clients' mean over the last 3 rounds; mean ± std over seeds 0..{args.seeds - 1}.")
    text = header + "\n\n" + tables(runs)
    (args.out / "dpmm_cfl_tables.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
