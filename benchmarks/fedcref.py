"""FedCRef at reduced scale: the shape of the paper's Tables 3 and 4 (EMNIST rows) on the bundled MNIST digits.

    python benchmarks/fedcref.py [--seeds 5] [--clients 20] [--processes 2] [--out docs]
                                 [--results docs/fedcref_runs.jsonl] [--render]

Setting: N = 20 clients, K_i uniform in [2, 5] of the ten digits, the bundled 5,000 MNIST images pooled and dealt
disjointly (45-125 samples per category where the paper has 500: dfca.data.categories), the simulated initial
clustering at dirtiness 0, 0.3 and 0.5, every other option at `fedcref:`'s defaults (the paper's alpha 75, theta 0.2,
tau 0.8, 784-100-64-32-64-100-784 autoencoders, Adam, 15 FedAvg rounds). Reported as the paper does, mean ± 95% CI
(t over seeds): final ACC, the ACC improvement over the initial clustering (%), communities found against the true
number of categories, wrong associations (%), isolated clusters after the first association and at the end.
Every finished run is appended to the results file (resumable); docs/fedcref.md's tables and docs/fedcref.png
are rendered from it. `--render` only redraws.
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
from scipy import stats

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DIRTINESS = (0.0, 0.3, 0.5)
PAPER_EMNIST = {  # Tables 3 and 4: communities / 10, wrong (%), isolated start -> end, ACC end, improvement (%)
    0.0: ("10.1 ± 0.7", "0.0 ± 0.0", "89.4 → 17.3", "0.948 ± 0.011", "-5.2 ± 1.05"),
    0.3: ("9.8 ± 1.1", "5.1 ± 1.7", "87.6 → 16.1", "0.879 ± 0.028", "25.4 ± 4.00"),
    0.5: ("10.2 ± 0.9", "6.9 ± 1.2", "89.4 → 48.0", "0.711 ± 0.049", "41.4 ± 9.74"),
}


def config_of(spec: dict[str, Any]) -> dict[str, Any]:
    return {"name": "fedcref-bench", "algorithm": "fedcref", "seed": spec["seed"], "rounds": 30,
            "data": {"clients": spec["clients"]}, "fedcref": {"dirtiness": spec["dirtiness"]}}


def key_of(run: dict[str, Any]) -> str:
    return json.dumps([run["dirtiness"], run["seed"], run["clients"]])


def one_run(spec: dict[str, Any]) -> dict[str, Any]:
    from dfca.config import parse_config
    from dfca.simulator import simulate

    began = time.perf_counter()
    result = simulate(parse_config(config_of(spec)))
    s, h = result.summary, result.history
    return {**spec, **{k: s[k] for k in ("initial_acc", "final_acc", "communities_found", "true_categories",
                                          "wrong_associations", "isolated_clusters", "iterations")},
            "isolated_start": h[0]["isolated_clusters"], "clusters": sum(len(c) for c in
                                                                         result.algorithm.evaluate().extra["categories"]),
            "acc_t": [r["test_accuracy"] for r in h], "communities_t": [r["communities_found"] for r in h],
            "isolated_t": [r["isolated_clusters"] for r in h], "wrong_t": [r["wrong_associations"] for r in h],
            "active_t": [r["active_clients"] for r in h],
            "bytes_per_client": sum(r["bytes_sent_per_client"] for r in h),
            "seconds": time.perf_counter() - began}


def describe(r: dict[str, Any]) -> str:
    return (f"dirtiness {r['dirtiness']} seed {r['seed']}: ACC {r['initial_acc']:.3f} -> {r['final_acc']:.3f}, "
            f"|G| {r['communities_found']:.0f}, wrong {r['wrong_associations']:.1f}%, {r['iterations']:.0f} iterations "
            f"({r['seconds']:.0f} s)")


def ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, float(stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5)


def cell(values: list[float], digits: int) -> str:
    m, h = ci(values)
    return f"{m:.{digits}f} ± {h:.{digits}f}"


def tables(runs: list[dict[str, Any]]) -> str:
    lines = ["| dirtiness | runs | ACC init | ACC end | improvement (%) | communities / true | wrong (%) | "
             "isolated start → end | iterations | ACC end > init | \\|G\\| within ±2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in DIRTINESS:
        rs = [r for r in runs if r["dirtiness"] == d]
        if not rs:
            continue
        gain = [100 * (r["final_acc"] - r["initial_acc"]) / r["initial_acc"] for r in rs]
        improved = sum(r["final_acc"] > r["initial_acc"] for r in rs)
        near = sum(abs(r["communities_found"] - r["true_categories"]) <= 2 for r in rs)
        truth = statistics.fmean(r["true_categories"] for r in rs)
        clusters = statistics.fmean(r["clusters"] for r in rs)
        lines.append(f"| {d} | {len(rs)} | {cell([r['initial_acc'] for r in rs], 3)} | "
                     f"{cell([r['final_acc'] for r in rs], 3)} | {cell(gain, 1)} | "
                     f"{cell([r['communities_found'] for r in rs], 1)} / {truth:.0f} | "
                     f"{cell([r['wrong_associations'] for r in rs], 1)} | "
                     f"{statistics.fmean(r['isolated_start'] for r in rs):.1f} → "
                     f"{cell([r['isolated_clusters'] for r in rs], 1)} of {clusters:.0f} | "
                     f"{cell([r['iterations'] for r in rs], 1)} | {improved}/{len(rs)} | {near}/{len(rs)} |")
    paper = ["| dirtiness | communities / 10 | wrong (%) | isolated start → end (of ~87 clusters) | ACC end | "
             "improvement (%) |", "|---|---|---|---|---|---|"]
    paper += [f"| {d} | {' | '.join(row)} |" for d, row in PAPER_EMNIST.items()]
    return "### Measured (bundled MNIST, N = 20)\n\n" + "\n".join(lines) + \
        "\n\n### The paper's EMNIST rows (N = 25, 500 samples per cluster; Tables 3 and 4)\n\n" + "\n".join(paper)


def figure(runs: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for metric, ax, title in (("acc_t", axes[0], "clients' ACC (eq. 4)"), ("communities_t", axes[1], "communities |G|"),
                              ("wrong_t", axes[2], "wrong associations (%)"), ("isolated_t", axes[3], "isolated |I|")):
        for i, d in enumerate(DIRTINESS):
            for j, r in enumerate(r for r in runs if r["dirtiness"] == d):
                ax.plot(range(1, len(r[metric]) + 1), r[metric], color=f"C{i}", alpha=0.6,
                        label=f"dirtiness {d}" if j == 0 else None)
        ax.set_title(title)
        ax.set_xlabel("iteration")
    axes[1].axhline(10, color="gray", linestyle=":", label="true categories")
    axes[0].legend()
    axes[1].legend()
    fig.suptitle("FedCRef on bundled MNIST, N = 20 (one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--results", type=Path, default=Path("docs/fedcref_runs.jsonl"))
    parser.add_argument("--render", action="store_true", help="only redraw the tables and figure from the results")
    args = parser.parse_args()
    runs = load_runs(args.results)
    if not args.render:
        done = {key_of(r) for r in runs}
        todo = [{"dirtiness": d, "seed": s, "clients": args.clients} for d in DIRTINESS for s in range(args.seeds)]
        runs += run_pending([t for t in todo if key_of(t) not in done], one_run, args.results, args.processes,
                            describe)
    runs = [r for r in runs if r["clients"] == args.clients]
    text = tables(runs)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fedcref_tables.md").write_text(f"<!-- python benchmarks/fedcref.py, commit {commit()}, load "
                                                f"{os.getloadavg()[0]:.2f} when rendered -->\n\n{text}\n")
    figure(runs, args.out / "fedcref.png")


if __name__ == "__main__":
    main()
