"""What a run leaves behind: summary.json, metrics.jsonl, models/*.safetensors and PNG plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from dfca.config import ExperimentConfig  # noqa: E402
from dfca.models.batched import Params  # noqa: E402


class MetricsLog:
    """metrics.jsonl, one JSON line per evaluated round, flushed as rounds finish."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_summary(out: Path, summary: dict[str, Any], cfg: ExperimentConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "config.json").write_text(cfg.model_dump_json(indent=2) + "\n")


def save_models(out: Path, models: dict[str, Params], assigned: Sequence[int]) -> None:
    """One safetensors file per named model, plus the final assignment of every client."""
    folder = out / "models"
    folder.mkdir(parents=True, exist_ok=True)
    for name, params in models.items():
        save_file({k: v.contiguous() for k, v in params.items()}, str(folder / f"{name}.safetensors"))
    (folder / "assignments.json").write_text(json.dumps({"assigned": list(map(int, assigned))}) + "\n")


PLOTS = (  # key, label, file, log scale
    ("test_accuracy", "test accuracy", "accuracy.png", False),
    ("ari", "cluster ARI", "ari.png", False),
    ("assignment_counts", "clients per cluster", "clusters.png", False),
)
SERVER_CLUSTERING_PLOTS = (  # DPMM-CFL and FeSEM: K_t, macro-F1 and (DPMM-CFL) the sampler's acceptance rates
    ("test_accuracy", "test micro-accuracy (clients' mean)", "accuracy.png", False),
    ("macro_f1", "test macro-F1 (clients' mean)", "macro_f1.png", False),
    ("ari", "cluster ARI against the true groups", "ari.png", False),
    ("inferred_clusters", "clusters K_t", "clusters.png", False),
    ("split_acceptance", "split-merge: splits accepted / proposed", "split_acceptance.png", False),
    ("merge_acceptance", "split-merge: merges accepted / proposed", "merge_acceptance.png", False),
)
KMEANS_PLOTS = (
    ("gcd", "global centroid deviation (GCD, eq. 12)", "gcd.png", True),
    ("cv", "consensus variation (CV, eq. 12)", "cv.png", True),
    ("test_accuracy", "clustering accuracy on held-out points", "accuracy.png", False),
)

FEDCREF_PLOTS = (  # Sec. 5.3 of the FedCRef paper, per iteration
    ("test_accuracy", "clients' clustering ACC (eq. 4)", "accuracy.png", False),
    ("communities_found", "communities |G|", "communities.png", False),
    ("isolated_clusters", "isolated clusters |I|", "isolated.png", False),
    ("wrong_associations", "wrong associations (%)", "wrong_associations.png", False),
    ("active_clients", "active clients", "active.png", False),
)
TRAFFIC_PLOT = ("bytes_sent_per_client", "bytes a client sent (all receivers)", "traffic.png", False)  # every family
UNBOUNDED = ("populated_clusters", "inferred_clusters", "communities_found", "isolated_clusters",
             "wrong_associations", "active_clients")


def round_x(rounds: Sequence[int], seeding_rounds: int = 0) -> list[float]:
    """Where absolute rounds (1-based, seeding rounds first, as rows' `round`) lie on the plots' x axis, which counts
    training rounds: training round r at r (1..R); the S seeding rounds evenly inside the shaded span before
    round 1, seeding round s at s / (S + 1). Never negative."""
    s = seeding_rounds
    return [float(r - s) if r > s else r / (s + 1) for r in rounds]


def seeding_span(seeding_rounds: int) -> tuple[float, float] | None:
    """The x interval the seeding phase's shading covers: each seeding round's point with half a step either side,
    ending before training round 1 (None without seeding rounds)."""
    if seeding_rounds <= 0:
        return None
    step = 1 / (seeding_rounds + 1)
    return step / 2, (seeding_rounds + 0.5) * step


def training_ticks(last_round: float) -> list[int]:
    """The x ticks: whole training rounds from 1 to `last_round`, at most about 10 of them."""
    last = max(int(last_round), 1)
    ticks = MaxNLocator(nbins=10, integer=True, min_n_ticks=1).tick_values(1, last)
    out = sorted({int(round(t)) for t in ticks if 1 <= t <= last} | {1})
    return out


def std_band(history: list[dict[str, Any]], seeding_rounds: int = 0, key: str = "test_accuracy"
             ) -> tuple[list[float], list[float], list[float]]:
    """(x, lower, upper) of the ± std band around the clients' mean `key` (its `<key>_std`), clipped to [0, 1]; the
    rows without both are left out."""
    rows = [h for h in history if key in h and f"{key}_std" in h]
    x = round_x([h["round"] for h in rows], seeding_rounds)
    lower = [max(0.0, h[key] - h[f"{key}_std"]) for h in rows]
    upper = [min(1.0, h[key] + h[f"{key}_std"]) for h in rows]
    return x, lower, upper


def cluster_counts(history: list[dict[str, Any]], seeding_rounds: int = 0) -> tuple[list[float], list[list[int]]]:
    """(x, counts): counts[j][i] is how many clients cluster j held at the i-th row with `assignment_counts`; rows
    that list fewer clusters (an algorithm whose K changes) count 0 for the clusters they lack."""
    rows = [h for h in history if h.get("assignment_counts") is not None]
    k = max((len(h["assignment_counts"]) for h in rows), default=0)
    counts = [[int(h["assignment_counts"][j]) if j < len(h["assignment_counts"]) else 0 for h in rows]
              for j in range(k)]
    return round_x([h["round"] for h in rows], seeding_rounds), counts


def traffic_series(history: list[dict[str, Any]], seeding_rounds: int = 0) -> tuple[list[float], list[float]]:
    """(x, bytes): the payload bytes a client sent in each round (`bytes_sent_per_client`: all receivers, the mean
    over clients), seeding rounds included."""
    rows = [h for h in history if h.get("bytes_sent_per_client") is not None]
    return round_x([h["round"] for h in rows], seeding_rounds), [float(h["bytes_sent_per_client"]) for h in rows]


def byte_unit(most: float) -> tuple[float, str]:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if most >= scale:
            return scale, unit
    return 1.0, "B"


def plot_history(out: Path, history: list[dict[str, Any]], title: str, seeding_rounds: int = 0) -> list[Path]:
    """accuracy.png (the clients' mean with a ± std band), ari.png and clusters.png (how many clients each cluster
    holds, stacked) against rounds; for a k-means run gcd.png and cv.png (log scale) and accuracy.png; for
    DPMM-CFL and FeSEM also macro_f1.png and (DPMM-CFL) the sampler's acceptance rates, clusters.png being K_t; for
    FedCRef the clients' ACC, communities, isolated clusters, wrong associations and active clients per iteration.
    Every run also gets traffic.png, the bytes a client sent per round. Each plot draws the rows that carry its
    field; one whose field no row carries is not drawn.

    The x axis counts training rounds 1..R as the summary's `rounds` does; robust DFCA's seeding rounds come before
    round 1, inside a shaded span labelled "seeding" (`round_x`, `seeding_span`). Counts (clusters, communities)
    get an integer axis from 0.
    """
    paths = []
    plots: tuple[tuple[str, str, str, bool], ...] = PLOTS
    if any("gcd" in h for h in history):
        plots = KMEANS_PLOTS
    elif any("communities_found" in h for h in history):
        plots = FEDCREF_PLOTS
    elif any("macro_f1" in h for h in history):
        plots = tuple(p for p in SERVER_CLUSTERING_PLOTS if any(p[0] in h for h in history))
    for key, label, fname, log_scale in (*plots, TRAFFIC_PLOT):
        rows = [h for h in history if h.get(key) is not None]
        if not rows:
            continue
        x = round_x([h["round"] for h in rows], seeding_rounds)
        fig, ax = plt.subplots(figsize=(6, 4))
        if key == "assignment_counts":
            draw_cluster_counts(ax, history, seeding_rounds)
        elif key == "bytes_sent_per_client":
            draw_traffic(ax, history, seeding_rounds, label)
        else:
            values = [h[key] for h in rows]
            if key == "test_accuracy" and any("test_accuracy_std" in h for h in rows):
                bx, lower, upper = std_band(rows, seeding_rounds)
                ax.fill_between(bx, lower, upper, alpha=0.25, linewidth=0, label="± std over clients")
            ax.plot(x, values, marker="o", markersize=3, label="clients' mean" if key == "test_accuracy" else None)
            ax.set_ylabel(label)
            if key == "communities_found" and "true_categories" in history[-1]:
                ax.axhline(history[-1]["true_categories"], color="gray", linestyle=":", label="true categories")
            if log_scale:
                ax.set_yscale("log")
            elif key in UNBOUNDED:
                ax.set_ylim(0, max([*values, count_ceiling(history, key), 1]) + 0.5)
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            else:
                ax.set_ylim(min(0.0, min(values)), 1.02)
        round_axis(ax, x, seeding_rounds)
        ax.set_title(f"{title}: {label}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right" if key != "assignment_counts" else "upper right")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def round_axis(ax: Any, x: list[float], seeding_rounds: int) -> None:
    """The x axis in training rounds 1..R, with the seeding phase shaded and labelled before round 1."""
    last = max([*x, 1.0])
    span = seeding_span(seeding_rounds)
    if span is not None:
        ax.axvspan(*span, color="0.5", alpha=0.25, linewidth=0, zorder=3)  # over a stacked area too
        ax.text((span[0] + span[1]) / 2, 0.97, f"seeding: {seeding_rounds} rounds", rotation=90, ha="center",
                va="top", fontsize=7, color="0.2", zorder=4, transform=ax.get_xaxis_transform(),
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.8, "linewidth": 0})
    ax.set_xlim(0.0 if span is not None else 0.5, last + 0.5)
    ax.set_xticks(training_ticks(last))
    ax.set_xlabel("training round" if span is not None else "round")


def draw_cluster_counts(ax: Any, history: list[dict[str, Any]], seeding_rounds: int) -> None:
    x, counts = cluster_counts(history, seeding_rounds)
    ax.stackplot(x, *counts, labels=[f"cluster {j}" for j in range(len(counts))] if len(counts) <= 10 else None,
                 alpha=0.85)
    total = max((sum(c[i] for c in counts) for i in range(len(x))), default=1)
    ax.set_ylim(0, total)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("clients per cluster (stacked)")


def draw_traffic(ax: Any, history: list[dict[str, Any]], seeding_rounds: int, label: str) -> None:
    x, sent = traffic_series(history, seeding_rounds)
    scale, unit = byte_unit(max(sent, default=0.0))
    widths = [0.8 / (seeding_rounds + 1) if v < 1 else 0.8 for v in x]
    ax.bar(x, [b / scale for b in sent], width=widths, color="tab:purple")
    ax.set_ylim(0, max([b / scale for b in sent], default=0.0) * 1.1 or 1.0)
    ax.set_ylabel(f"{label}, {unit}")


def count_ceiling(history: list[dict[str, Any]], key: str) -> float:
    """The most a count could be, so a constant count is not drawn as a flat line on a 1.9-2.1 axis: k for
    populated clusters (from the rounds' assignment counts), else the true categories where known."""
    if key == "populated_clusters" and history and "assignment_counts" in history[-1]:
        return float(len(history[-1]["assignment_counts"]))
    if key == "communities_found" and history and "true_categories" in history[-1]:
        return float(history[-1]["true_categories"])
    return 0.0
