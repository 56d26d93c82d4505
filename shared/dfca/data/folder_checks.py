"""What a folder federation's files must satisfy, and the error that names the file and the client that do not.

Every check returns the problems it finds (`Problem`: a file, a client, what is wrong) rather than raising, so
`dfca data inspect` can list them all; the reader raises them together as one `FolderDataError` before any
federation is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MIN_SAMPLES = 2  # a client needs a train and a test sample: with fewer there is nothing to train or to score


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a folder federation: the file it is in, the client it concerns (None: the folder)."""

    file: Path
    client: str | None
    text: str

    def __str__(self) -> str:
        who = f" (client {self.client})" if self.client is not None else ""
        return f"{self.file}{who}: {self.text}"


class FolderDataError(ValueError):
    """A folder federation that cannot be read; the message names the file and the client of every problem."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        lines = [str(p) for p in self.problems]
        head = lines[0] if len(lines) == 1 else f"{len(lines)} problems:\n  " + "\n  ".join(lines)
        super().__init__(head)

    @classmethod
    def one(cls, file: Path, client: str | None, text: str) -> FolderDataError:
        return cls([Problem(file, client, text)])


def check_features(x: np.ndarray, file: Path, client: str) -> list[Problem]:
    """Features are float or uint8, with at least one sample, and finite."""
    if x.dtype != np.uint8 and x.dtype.kind != "f":
        return [Problem(file, client, f"x has dtype {x.dtype}; features are float or uint8 (0..255)")]
    if x.ndim < 2:
        return [Problem(file, client, f"x has shape {x.shape}; expected [samples, ...features]")]
    if x.dtype.kind == "f":
        finite = np.isfinite(x.reshape(len(x), -1)).all(axis=1)
        if not finite.all():
            bad = np.flatnonzero(~finite)
            return [Problem(file, client, f"x holds NaN or infinite values in {len(bad)} sample(s), the first at "
                            f"index {int(bad[0])}")]
    return []


def check_labels(y: np.ndarray, samples: int, file: Path, client: str) -> list[Problem]:
    """Labels are one integer per sample, none negative."""
    if y.dtype.kind not in "iu":
        return [Problem(file, client, f"y has dtype {y.dtype}; labels must be integers (class indices 0..C-1)")]
    if y.shape != (samples,):
        return [Problem(file, client, f"y has shape {y.shape}; expected one label per sample ({samples},)")]
    if samples and int(y.min()) < 0:
        return [Problem(file, client, f"y holds the negative label {int(y.min())}; labels are 0..C-1")]
    return []


def check_sample_count(samples: int, file: Path, client: str, held_out: bool) -> list[Problem]:
    """A client's train file holds at least MIN_SAMPLES samples (when its test set is held out of it) or one."""
    least = MIN_SAMPLES if held_out else 1
    if samples >= least:
        return []
    why = " (its test share is held out of them)" if held_out else ""
    return [Problem(file, client, f"{samples} sample(s); a client needs at least {least}{why}")]


def check_label_range(labels: Mapping[str, tuple[Path, np.ndarray]], classes: int) -> list[Problem]:
    """Every label lies in 0..classes-1."""
    problems = []
    for client, (file, y) in labels.items():
        if len(y) and int(y.max()) >= classes:
            problems.append(Problem(file, client, f"label {int(y.max())} is outside 0..{classes - 1} "
                                    f"({classes} classes)"))
    return problems


def check_shapes(shapes: Mapping[str, tuple[Path, tuple[int, ...]]]) -> list[Problem]:
    """Every client's samples have the shape of the first client's."""
    if not shapes:
        return []
    first, (first_file, expected) = next(iter(shapes.items()))
    return [Problem(file, client, f"samples of shape {shape}, but client {first} ({first_file}) has {expected}; "
                    "every client's samples must have one shape")
            for client, (file, shape) in shapes.items() if shape != expected]


def check_clusters(clusters: object, file: Path, known: Sequence[str]) -> list[Problem]:
    """clusters.json maps every known client, and only known clients, to a cluster number >= 0."""
    if not isinstance(clusters, dict):
        return [Problem(file, None, "must be a JSON object {client-id: cluster}")]
    problems = []
    names = set(known)
    for client, cluster in clusters.items():
        if client not in names:
            problems.append(Problem(file, client, "names a client with no data (no such client folder or rows)"))
        elif isinstance(cluster, bool) or not isinstance(cluster, int) or cluster < 0:
            problems.append(Problem(file, client, f"cluster {cluster!r} is not an integer >= 0"))
    problems += [Problem(file, c, "has no cluster; clusters.json names every client or is left out")
                 for c in known if c not in clusters]
    return problems
