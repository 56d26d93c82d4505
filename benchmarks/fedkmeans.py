"""Federated k-means over networks: the paper's Figures 1-4 at its own scale, mean and standard error over seeds.

    python benchmarks/fedkmeans.py [--runs 10] [--iterations 200] [--processes 2] [--out docs]
                                   [--results runs/fedkmeans/runs.jsonl] [--render]

Data: the paper's blobs (k = 3 in R^2, centres at least 5 apart; isotropic, heterogeneous variances, anisotropic),
n = 10 nodes, Erdos-Renyi graphs, every method from k-means++ at every node (dfca.algorithms.fedkmeans).
- Figures 1 and 2: GCD and CV of (12) against m_i in {50, 100, 200, 400, 800} at p = 0.7, for Algorithm 1 with
  alpha 0 (local k-means), 0.5 and 1 (the data term divided by m_i, as the paper's (8) and (11) print: the
  default), distributed k-means with eta = 2, and Algorithm 1 at alpha = 1 with every point weighing 1 as in
  (6), (7) and (9) (`fedkmeans.data_weight: one`).
- Figures 3 and 4: GCD and CV against p in {0.4, 0.7, 1} at m_i = 200.
Every finished run is appended to the results file (resumable); then docs/fedkmeans.md gets the tables (mean
+- standard error, and how many runs ended with GCD above 0.5: a node, or the network, on a wrong solution)
and docs/fedkmeans_figures.png the four figures (rows: datasets; log scale). `--render` only redraws.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import matplotlib
from resumable_runs import commit, load_runs, run_pending

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GEOMETRIES = ("isotropic", "heterogeneous", "anisotropic")
SIZES = (50, 100, 200, 400, 800)
PROBABILITIES = (0.4, 0.7, 1.0)
METHODS: dict[str, dict[str, Any]] = {
    "local k-means (alpha 0)": {"algorithm": "fedkmeans", "fedkmeans": {"alpha": 0.0}},
    "Algorithm 1, alpha 0.5": {"algorithm": "fedkmeans", "fedkmeans": {"alpha": 0.5}},
    "Algorithm 1, alpha 1": {"algorithm": "fedkmeans", "fedkmeans": {"alpha": 1.0}},
    "distributed k-means (eta 2)": {"algorithm": "distkmeans", "distkmeans": {"eta": 2.0}},
    "Algorithm 1, alpha 1, point weight 1": {"algorithm": "fedkmeans", "fedkmeans": {"alpha": 1.0,
                                                                                    "data_weight": "one"}},
}
SWEEP_P_METHODS = tuple(list(METHODS)[:4])  # the paper's methods; the weight-1 variant only against m_i
BAD_GCD = 0.5  # above this, at least one node sits on a wrong solution (two centroids in one blob)


def grid(runs: int) -> list[dict[str, Any]]:
    """Every run of both sweeps, as (figure cell) keys."""
    keys = []
    for geometry in GEOMETRIES:
        for method in METHODS:
            keys += [{"geometry": geometry, "method": method, "m": m, "p": 0.7, "seed": s} for m in SIZES
                     for s in range(runs)]
        for method in SWEEP_P_METHODS:
            keys += [{"geometry": geometry, "method": method, "m": 200, "p": p, "seed": s} for p in PROBABILITIES
                     if p != 0.7 for s in range(runs)]
    return keys


def key_of(run: dict[str, Any]) -> str:
    return json.dumps([run["geometry"], run["method"], run["m"], run["p"], run["seed"], run["iterations"]])


def one_run(spec: dict[str, Any]) -> dict[str, Any]:
    from dfca.config import parse_config
    from dfca.simulator import simulate

    method = METHODS[spec["method"]]
    cfg = parse_config({
        "name": "fedkmeans-bench", "clusters": 3, "rounds": spec["iterations"], "eval_every": spec["iterations"],
        "seed": spec["seed"], "topology": {"kind": "erdos_renyi", "p": spec["p"]},
        "data": {"dataset": "blobs", "geometry": spec["geometry"], "clients": 10, "train_per_client": spec["m"],
                 "test_per_client": 50},
        **method,
    })
    began = time.perf_counter()
    s = simulate(cfg).summary
    return {**spec, **{k: s[k] for k in ("gcd", "cv", "point_ari", "objective", "test_accuracy")},
            "seconds": time.perf_counter() - began}


def mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def cells(runs: list[dict[str, Any]], metric: str, axis: str) -> dict[tuple[str, str, float], list[float]]:
    """(geometry, method, m or p) -> the metric over seeds, for the sweep along `axis` ("m" at p = 0.7, or "p")."""
    out: dict[tuple[str, str, float], list[float]] = {}
    for r in runs:
        if axis == "m" and r["p"] == 0.7:
            out.setdefault((r["geometry"], r["method"], r["m"]), []).append(r[metric])
        if axis == "p" and r["m"] == 200 and r["method"] in SWEEP_P_METHODS:
            out.setdefault((r["geometry"], r["method"], r["p"]), []).append(r[metric])
    return out


def table(runs: list[dict[str, Any]], metric: str, axis: str) -> str:
    data = cells(runs, metric, axis)
    xs = SIZES if axis == "m" else PROBABILITIES
    methods = list(METHODS) if axis == "m" else list(SWEEP_P_METHODS)
    name = "m_i (p = 0.7)" if axis == "m" else "p (m_i = 200)"
    lines = ["| dataset | method | " + " | ".join(f"{name.split()[0]} = {x:g}" for x in xs) + " |",
             "|---|---|" + "---|" * len(xs)]
    for geometry in GEOMETRIES:
        for method in methods:
            row = []
            for x in xs:
                values = data.get((geometry, method, x), [])
                if not values:
                    row.append("")
                    continue
                mean, se = mean_se(values)
                bad = sum(v > BAD_GCD for v in values) if metric == "gcd" else 0
                row.append(f"{mean:.2e} ± {se:.1e}" + (f" ({bad} bad)" if bad else ""))
            lines.append(f"| {geometry} | {method} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def figures(runs: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(len(GEOMETRIES), 4, figsize=(18, 11), squeeze=False)
    panels = (("gcd", "m", "Fig. 1: GCD vs m_i (p = 0.7)"), ("cv", "m", "Fig. 2: CV vs m_i (p = 0.7)"),
              ("gcd", "p", "Fig. 3: GCD vs p (m_i = 200)"), ("cv", "p", "Fig. 4: CV vs p (m_i = 200)"))
    for col, (metric, axis, title) in enumerate(panels):
        data = cells(runs, metric, axis)
        xs = SIZES if axis == "m" else PROBABILITIES
        for row, geometry in enumerate(GEOMETRIES):
            ax = axes[row][col]
            for method in (METHODS if axis == "m" else SWEEP_P_METHODS):
                points = [(x, *mean_se(data[(geometry, method, x)])) for x in xs if (geometry, method, x) in data]
                if not points:
                    continue
                x, mean, se = zip(*points, strict=True)
                dashed = "weight 1" in method
                ax.errorbar(x, mean, yerr=se, marker="o", markersize=3, capsize=2, label=method,
                            linestyle="--" if dashed else "-")
            ax.set_yscale("log")
            ax.set_xlabel("m_i" if axis == "m" else "p")
            ax.set_ylabel(metric.upper())
            ax.set_title(f"{title}\n{geometry}", fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--results", type=Path, default=Path("runs/fedkmeans/runs.jsonl"))
    ap.add_argument("--render", action="store_true")
    args = ap.parse_args()
    done = load_runs(args.results)
    have = {key_of(r) for r in done}
    todo = [{**k, "iterations": args.iterations} for k in grid(args.runs)]
    todo = [k for k in todo if key_of(k) not in have]
    if not args.render:
        done += run_pending(todo, one_run, args.results, args.processes)
    runs = [r for r in done if r["iterations"] == args.iterations and r["seed"] < args.runs]
    args.out.mkdir(parents=True, exist_ok=True)
    figures(runs, args.out / "fedkmeans_figures.png")
    header = (f"Measured by `python benchmarks/fedkmeans.py --runs {args.runs} --iterations {args.iterations}` at "
              f"commit {commit()}, load average {os.getloadavg()[0]:.2f} when rendered; n = 10 nodes, k = 3 blobs in "
              f"R^2, mean ± standard error over {args.runs} runs (seeds 0..{args.runs - 1}); '(b bad)': b runs ended "
              f"with GCD > {BAD_GCD} (a node, or the network, on a wrong solution).")
    text = "\n\n".join([header, "### GCD against m_i (Figure 1)", table(runs, "gcd", "m"),
                        "### CV against m_i (Figure 2)", table(runs, "cv", "m"),
                        "### GCD against p (Figure 3)", table(runs, "gcd", "p"),
                        "### CV against p (Figure 4)", table(runs, "cv", "p")])
    (args.out / "fedkmeans_tables.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
