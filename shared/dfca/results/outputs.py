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
    ("populated_clusters", "populated clusters", "clusters.png", False),
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
UNBOUNDED = ("populated_clusters", "inferred_clusters", "communities_found", "isolated_clusters",
             "wrong_associations", "active_clients")


def plot_history(out: Path, history: list[dict[str, Any]], title: str, seeding_rounds: int = 0) -> list[Path]:
    """accuracy.png and ari.png against rounds, plus clusters.png (populated clusters); for a k-means run gcd.png
    and cv.png (log scale) and accuracy.png; for DPMM-CFL and FeSEM also macro_f1.png and (DPMM-CFL) the sampler's
    acceptance rates; for FedCRef the clients' ACC, communities, isolated clusters, wrong associations and active
    clients per iteration.

    The x axis counts training rounds as the summary's `rounds` does: robust DFCA's seeding rounds come first, at
    -S+1..0, shaded, and training rounds are 1..T. Counts (clusters, communities) get an integer axis from 0.
    """
    rounds = [h["round"] - seeding_rounds for h in history]
    paths = []
    plots = PLOTS
    if history and "gcd" in history[0]:
        plots = KMEANS_PLOTS
    elif history and "communities_found" in history[0]:
        plots = FEDCREF_PLOTS
    elif history and "macro_f1" in history[0]:
        plots = tuple(p for p in SERVER_CLUSTERING_PLOTS if p[0] in history[0])
    for key, label, fname, log_scale in plots:
        values = [h[key] for h in history]
        fig, ax = plt.subplots(figsize=(6, 4))
        if seeding_rounds:
            ax.axvspan(-seeding_rounds + 0.5, 0.5, color="0.9",
                       label="seeding: local training, then k seeds flooded")
        ax.plot(rounds, values, marker="o", markersize=3)
        ax.set_xlabel("training round (seeding rounds at 0 and below)" if seeding_rounds else "round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.set_title(f"{title}: {label}")
        if key == "communities_found" and history and "true_categories" in history[-1]:
            ax.axhline(history[-1]["true_categories"], color="gray", linestyle=":", label="true categories")
        if log_scale:
            ax.set_yscale("log")
        elif key in UNBOUNDED:
            ax.set_ylim(0, max([*values, count_ceiling(history, key), 1]) + 0.5)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        elif values:
            ax.set_ylim(min(0.0, min(values)), 1.02)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def count_ceiling(history: list[dict[str, Any]], key: str) -> float:
    """The most a count could be, so a constant count is not drawn as a flat line on a 1.9-2.1 axis: k for
    populated clusters (from the rounds' assignment counts), else the true categories where known."""
    if key == "populated_clusters" and history and "assignment_counts" in history[-1]:
        return float(len(history[-1]["assignment_counts"]))
    if key == "communities_found" and history and "true_categories" in history[-1]:
        return float(history[-1]["true_categories"])
    return 0.0
