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
from dfca.models import Params  # noqa: E402


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

    Robust DFCA's seeding rounds (no training) are shaded.
    """
    rounds = [h["round"] for h in history]
    paths = []
    plots = PLOTS
    if history and "gcd" in history[0]:
        plots = KMEANS_PLOTS
    elif history and "communities_found" in history[0]:
        plots = FEDCREF_PLOTS
    elif history and "macro_f1" in history[0]:
        plots = tuple(p for p in SERVER_CLUSTERING_PLOTS if p[0] in history[0])
    for key, label, fname, log_scale in plots:
        fig, ax = plt.subplots(figsize=(6, 4))
        if seeding_rounds:
            ax.axvspan(0, seeding_rounds, color="0.9", label="seeding (no training)")
            ax.legend(fontsize=8, loc="lower right")
        ax.plot(rounds, [h[key] for h in history], marker="o", markersize=3)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        ax.set_title(f"{title}: {label}")
        if key == "communities_found" and "true_categories" in history[-1]:
            ax.axhline(history[-1]["true_categories"], color="gray", linestyle=":", label="true categories")
            ax.legend(fontsize=8)
        if log_scale:
            ax.set_yscale("log")
        elif key not in UNBOUNDED:
            ax.set_ylim(min(0.0, min(h[key] for h in history)), 1.02)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
