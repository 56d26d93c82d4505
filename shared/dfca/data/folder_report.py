"""What `dfca data inspect DIR` shows of a folder federation: its clients, their sizes and labels, and every problem."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dfca.data.folder_checks import FolderDataError, Problem
from dfca.data.folder_federation import read_contents


@dataclass
class ClientSummary:
    """One readable client: its train and test sample counts, whether its test set was held out, label counts."""

    name: str
    train: int
    test: int
    test_held_out: bool
    label_counts: list[int]


@dataclass
class FolderReport:
    """A folder federation at a glance; `problems` empty means it can be run."""

    path: Path
    layout: str = ""
    client_ids: list[str] = field(default_factory=list)
    clients: list[ClientSummary] = field(default_factory=list)
    input_shape: tuple[int, ...] | None = None
    num_classes: int = 0
    true_clusters: dict[str, int] | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def client_count(self) -> int:
        return len(self.client_ids)

    def samples(self) -> dict[str, int]:
        """min, median and max of the clients' train plus test samples (zeros where no client is readable)."""
        sizes = np.array([c.train + c.test for c in self.clients] or [0])
        return {"min": int(sizes.min()), "median": float(np.median(sizes)), "max": int(sizes.max())}

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path), "layout": self.layout, "clients": self.client_count, "samples": self.samples(),
            "input_shape": list(self.input_shape) if self.input_shape else None, "num_classes": self.num_classes,
            "true_clusters": self.true_clusters is not None,
            "per_client": [{"client": c.name, "train": c.train, "test": c.test, "test_held_out": c.test_held_out,
                            "label_counts": c.label_counts,
                            "cluster": None if self.true_clusters is None else self.true_clusters.get(c.name)}
                           for c in self.clients],
            "problems": [{"file": str(p.file), "client": p.client, "problem": p.text} for p in self.problems],
        }


def inspect_folder(path: str | Path, classes: int | None = None, seed: int = 0,
                   test_fraction: float = 0.2) -> FolderReport:
    """Read and check every client in `path`; problems are listed in the report, never raised."""
    report = FolderReport(Path(path))
    try:
        found = read_contents(path, seed, test_fraction, classes=classes)
    except FolderDataError as err:
        report.problems = err.problems
        return report
    report.layout, report.client_ids, report.problems = found.layout, found.known, found.problems
    report.num_classes, report.true_clusters = found.num_classes, found.true_cluster
    if found.clients:
        report.input_shape = tuple(int(s) for s in found.clients[0].x_train.shape[1:])
    width = max(found.num_classes, 1)
    for c in found.clients:
        labels = np.concatenate([c.y_train, c.y_test])
        counts = np.bincount(labels[labels < width], minlength=width) if len(labels) else np.zeros(width, int)
        report.clients.append(ClientSummary(c.name, len(c.y_train), len(c.y_test), c.test_file is None,
                                            [int(n) for n in counts]))
    return report
