"""A federation read from files (`data: {source: folder, path: DIR}`): every client's own samples, of any size.

DIR holds one folder per client (`DIR/<client-id>/`, arrays or images: dfca.data.folder_formats), or DIR is one
CSV or Parquet table with a client column. Clients are the folders' names (or the table's client ids), sorted; row
i of the federation is the i-th. A client without its own test set (no test.npz, no test/ folder, no `test` rows)
has `test_fraction` of its train samples held out, drawn from `seed` and its id, so a worker reading only its own
clients draws the same split. uint8 features are scaled to [0, 1]; everything becomes float32; a per-sample shape
(H, W) is read as one channel (1, H, W).

Classes: C is `classes` where given, else the largest label any read client holds, plus one. Labels must lie in
0..C-1.

`DIR/clusters.json` (`{client-id: cluster}`, next to a table file for a table) is optional and used only to score
the clustering (ARI, per-cluster accuracy); without it every true cluster is -1 and no ARI is reported.

Everything is checked before anything is built (dfca.data.folder_checks): every problem found raises one
`FolderDataError` naming each file and client; no client is ever dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dfca.data import folder_checks as checks
from dfca.data.folder_checks import FolderDataError, Problem
from dfca.data.folder_formats import (
    ClientFiles,
    Part,
    is_table,
    read_client_folder,
    read_table_clients,
    table_client_ids,
)
from dfca.data.partition import seeded_rng
from dfca.data.shards import FederatedData, from_clients

CLUSTERS_FILE = "clusters.json"
Progress = Callable[[int, int], None]  # (clients read, clients to read)

__all__ = ["CLUSTERS_FILE", "FolderDataError", "Problem", "list_client_ids", "read_folder_federation"]


@dataclass
class ClientSplit:
    """A client's checked samples: float32 x, int64 y; test_file None where its test set was held out."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    train_file: Path
    test_file: Path | None


@dataclass
class FolderContents:
    """What a read found: the clients that passed their own checks, and every problem."""

    root: Path
    layout: str  # "folders" or "table"
    known: list[str]
    clients: list[ClientSplit] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    num_classes: int = 0
    true_cluster: dict[str, int] | None = None


def list_client_ids(path: str | Path) -> list[str]:
    """The federation's client ids, sorted: DIR's client folders, or a table's client column."""
    root = Path(path)
    if root.is_file() and is_table(root):
        try:
            ids = table_client_ids(root)
        except (OSError, ValueError) as err:
            raise FolderDataError.one(root, None, f"is not a readable table with a 'client' column ({err})") from err
    elif root.is_dir():
        ids = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    else:
        raise FolderDataError.one(root, None, "no such folder (or .csv/.parquet table file)")
    if not ids:
        raise FolderDataError.one(root, None, "holds no clients: expected DIR/<client-id>/train.npz, "
                                  "DIR/<client-id>/train/<label>/ images, or a table with a client column")
    return ids


def read_folder_federation(
    path: str | Path, seed: int, test_fraction: float, clients: Sequence[str] | None = None,
    classes: int | None = None, progress: Progress | None = None, counted: bool = False,
) -> FederatedData:
    """The federation in `path` (only the named `clients`, in that order, where given: no other client's folder is
    opened); raises FolderDataError listing every problem, before anything is built. `progress(done, total)` is
    called after each client folder is read. `counted`: the clients' sample counts are kept even when they are
    equal (a part of a larger federation, whose other parts may differ: every holder then sends the same fields)."""
    found = read_contents(path, seed, test_fraction, clients, classes, progress)
    if found.problems:
        raise FolderDataError(found.problems)
    names = [c.name for c in found.clients]
    truth = [found.true_cluster[n] for n in names] if found.true_cluster is not None else [-1] * len(names)
    return from_clients(
        train=[(torch.from_numpy(c.x_train), torch.from_numpy(c.y_train)) for c in found.clients],
        test=[(torch.from_numpy(c.x_test), torch.from_numpy(c.y_test)) for c in found.clients],
        true_cluster=torch.tensor(truth, dtype=torch.long), num_classes=found.num_classes, client_names=names,
        counted=counted)


def read_contents(
    path: str | Path, seed: int, test_fraction: float, clients: Sequence[str] | None = None,
    classes: int | None = None, progress: Progress | None = None,
) -> FolderContents:
    """Read and check `clients` (default: all) of the federation in `path`, collecting every problem."""
    root = Path(path)
    known = list_client_ids(root)
    found = FolderContents(root, "table" if root.is_file() else "folders", known)
    chosen = list(known if clients is None else clients)
    found.problems += [Problem(root / c, c, "named twice") for c in sorted({c for c in chosen if chosen.count(c) > 1})]
    if found.layout == "table":
        files, problems = read_table_clients(root, chosen)
        found.problems += problems
        found.problems += [Problem(root, c, "has no rows in the table") for c in chosen if c not in files]
        stored = [files[c] for c in chosen if c in files]
    else:
        stored = []
        for done, client in enumerate(chosen, 1):
            files_of, problems = read_client_folder(root / client, client)
            found.problems += problems
            if files_of is not None:
                stored.append(files_of)
            if progress is not None:
                progress(done, len(chosen))
    for files_of in stored:
        split, problems = checked_split(files_of, seed, test_fraction)
        found.problems += problems
        if split is not None:
            found.clients.append(split)
    found.problems += checks.check_shapes({c.name: (c.train_file, c.x_train.shape[1:]) for c in found.clients})
    found.problems += test_shape_problems(found.clients)
    labels = [c.y_train for c in found.clients] + [c.y_test for c in found.clients]
    found.num_classes = classes if classes is not None else max((int(y.max()) + 1 for y in labels if len(y)), default=0)
    found.problems += checks.check_label_range(
        {c.name: (c.train_file, c.y_train) for c in found.clients}, found.num_classes)
    found.problems += checks.check_label_range(
        {c.name: (c.test_file, c.y_test) for c in found.clients if c.test_file is not None}, found.num_classes)
    found.true_cluster, problems = read_clusters(root, known, chosen)
    order = {c: i for i, c in enumerate(chosen)}
    found.problems = sorted(found.problems + problems, key=lambda p: order.get(p.client, -1) if p.client else -1)
    return found


def test_shape_problems(clients: list[ClientSplit]) -> list[Problem]:
    """A client's test samples have the shape of its train samples."""
    return [Problem(c.test_file or c.train_file, c.name, f"test samples of shape {c.x_test.shape[1:]}, train "
                    f"samples of shape {c.x_train.shape[1:]}")
            for c in clients if c.x_test.shape[1:] != c.x_train.shape[1:]]


def checked_split(files: ClientFiles, seed: int, test_fraction: float) -> tuple[ClientSplit | None, list[Problem]]:
    """A client's samples as float32 and int64, its test set held out where it has none; or its problems."""
    held_out = files.test is None
    problems = part_problems(files.train, files.name, held_out)
    if files.test is not None:
        problems += part_problems(files.test, files.name, False)
    if problems:
        return None, problems
    x, y = as_features(files.train.x), files.train.y.astype(np.int64)
    if files.test is not None:
        x_test, y_test = as_features(files.test.x), files.test.y.astype(np.int64)
        return ClientSplit(files.name, x, y, x_test, y_test, files.train.file, files.test.file), []
    train_rows, test_rows = held_out_rows(len(y), test_fraction, seed, files.name)
    return ClientSplit(files.name, x[train_rows], y[train_rows], x[test_rows], y[test_rows], files.train.file,
                       None), []


def part_problems(part: Part, client: str, held_out: bool) -> list[Problem]:
    problems = checks.check_features(part.x, part.file, client)
    if problems:
        return problems
    return (checks.check_sample_count(len(part.x), part.file, client, held_out)
            or checks.check_labels(part.y, len(part.x), part.file, client))


def as_features(x: np.ndarray) -> np.ndarray:
    """float32 features; uint8 scaled to [0, 1]; a per-sample (H, W) read as (1, H, W)."""
    out = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32, copy=False)
    return out[:, None] if out.ndim == 3 else out


def held_out_rows(samples: int, test_fraction: float, seed: int, client: str) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows): round(samples * test_fraction) rows, at least one and at most samples - 1, drawn
    from the seed and the client's id."""
    held = min(max(1, round(samples * test_fraction)), samples - 1)
    order = seeded_rng(seed, f"held-out/{client}").permutation(samples)
    return np.sort(order[held:]), np.sort(order[:held])


def read_clusters(root: Path, known: list[str], chosen: list[str]) -> tuple[dict[str, int] | None, list[Problem]]:
    """clusters.json's {client: cluster} (None where there is none), checked against every known client."""
    file = (root.parent if root.is_file() else root) / CLUSTERS_FILE
    if not file.is_file():
        return None, []
    try:
        clusters = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        return None, [Problem(file, None, f"is not readable JSON ({err})")]
    problems = checks.check_clusters(clusters, file, known)
    return (None if problems else {c: int(clusters[c]) for c in chosen}), problems
