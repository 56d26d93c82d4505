"""The screen's cost on the goal grid against how many neighbours a client hears: a figure of screen_cost.py's runs.

    python benchmarks/screen_cost_figure.py [--runs docs/results/screen_cost_runs.jsonl] [--out docs/screen_cost.png]

For each goal-grid setting without message loss (benchmarks/cluster_recovery.py's SETTINGS), the latest lean
10-round run of `screen_cost.py` in --runs: screened over unscreened CPU seconds of the gossip rounds against the
setting's mean degree (its graph as the run draws it, seed 0), of the one-hop merges against the mean degree over
k (a merge tests the arrivals of a client's own cluster on its data), and of all training rounds, with the goal
(1.3x). Prints the points it draws, with each run's commit and date.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from cluster_recovery import SETTINGS, config, merge  # noqa: E402

from dfca.graph import build_graph  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOAL = 1.3
PANELS = (("gossip rounds", "gossip", "mean degree: the arrivals a step measures and mixes"),
          ("one-hop merges", "merge", "mean degree / k: the own-cluster arrivals a merge tests on data"),
          ("all training rounds", "ratio", "mean degree"))


class Point(NamedTuple):
    label: str
    k: int
    degree: float  # mean neighbours a client has
    ratios: dict[str, float]  # "ratio" (all training rounds), "gossip", "merge": screened over unscreened
    commit: str
    date: str


def latest_runs(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The latest lean 10-round seed-0 run of each setting label (by date; later lines win a tie)."""
    latest: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.get("traffic") != "lean" or row.get("rounds") != 10 or row.get("seed", 0) != 0:
            continue
        if row["setting"] not in latest or row["date"] >= latest[row["setting"]]["date"]:
            latest[row["setting"]] = row
    return latest


def mean_degree(setting: dict[str, Any]) -> float:
    """A client's mean number of neighbours in the setting's graph, drawn as screen_cost.py's runs draw it."""
    cfg = config(setting, merge({"algorithm": "dfca"}, {}), 0, 10, 500)
    graph = build_graph(cfg.topology, cfg.data.clients, cfg.seed)
    return 2 * graph.number_of_edges() / graph.number_of_nodes()


def points(rows: list[dict[str, Any]]) -> list[Point]:
    """One point per loss-free setting that has a run, by degree."""
    latest = latest_runs(rows)
    out = []
    for setting in SETTINGS:
        if "extra" in setting or (row := latest.get(setting["label"])) is None:
            continue
        ratios = {"ratio": row["ratio"], "gossip": row["gossip"]["ratio"], "merge": row["merge"]["ratio"]}
        out.append(Point(setting["label"], setting["k"], mean_degree(setting), ratios, row["commit"], row["date"]))
    return sorted(out, key=lambda p: p.degree)


def draw(found: list[Point], out: Path) -> None:
    """Three panels (gossip rounds, merges, all training rounds), each point a setting, k=2 and k=4 apart."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=True)
    for ax, (title, key, xlabel) in zip(axes, PANELS, strict=True):
        for k, marker in ((2, "o"), (4, "s")):
            mine = [p for p in found if p.k == k]
            x = [p.degree / (k if key == "merge" else 1) for p in mine]
            ax.scatter(x, [p.ratios[key] for p in mine], marker=marker, label=f"k={k}", zorder=3)
            for p, xi in zip(mine, x, strict=True):
                ax.annotate(p.label.split(" ", 1)[1], (xi, p.ratios[key]), textcoords="offset points",
                            xytext=(5, 3), fontsize=7)
        ax.axhline(GOAL, color="grey", linewidth=1, linestyle="-.", label=f"goal ({GOAL}x)")
        ax.set_title(title)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("screened / unscreened CPU time")
    axes[0].legend(fontsize=8)
    fig.suptitle("What the screen costs a simulator round on the goal grid (MLP h=200, one thread)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=REPO / "docs" / "results" / "screen_cost_runs.jsonl")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "screen_cost.png")
    args = p.parse_args()
    rows = [json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()]
    found = points(rows)
    if not found:
        raise SystemExit(f"no lean 10-round runs of a goal-grid setting in {args.runs}")
    for point in found:
        print(f"{point.label}: degree {point.degree:.1f}, all {point.ratios['ratio']:.2f}x, gossip "
              f"{point.ratios['gossip']:.2f}x, merges {point.ratios['merge']:.2f}x ({point.commit}, {point.date})")
    draw(found, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
