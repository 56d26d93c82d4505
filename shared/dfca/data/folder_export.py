"""A federation written as a folder federation (`dfca data export`): what `read_folder_federation` reads back.

`OUT/client-007/train.npz` and `test.npz` hold each client's real samples (x float32 as the run uses them, y int64),
`OUT/clusters.json` the true clusters (where they are known). Client ids are `client-` and the row index, zero-padded
to at least three digits, so that their sorted order is the row order. Padding rows (label -1) are not written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dfca.data.folder_federation import CLUSTERS_FILE
from dfca.data.shards import FederatedData


def client_ids(count: int) -> list[str]:
    width = max(3, len(str(count - 1)))
    return [f"client-{i:0{width}d}" for i in range(count)]


def save_part(file: Path, x: torch.Tensor, y: torch.Tensor) -> None:
    """A client's samples as train.npz or test.npz; rows labelled -1 are padding (FedCRef's categories pad each
    client to the largest that way) and stay out."""
    real = y >= 0
    np.savez(file, x=x[real].cpu().numpy(), y=y[real].cpu().numpy())


def check_out_folder(out: Path) -> None:
    """Refuse (FileExistsError) an `out` that is a file or a folder with something in it."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty folder; name a new or empty folder")


def write_folder_federation(data: FederatedData, out: Path, progress: Callable[[int], None] | None = None) -> list[str]:
    """Write every client of `data` into `out` (new or empty); returns the client ids, in row order."""
    check_out_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    names = client_ids(data.num_clients)
    train_sizes, test_sizes = data.train_sizes.tolist(), data.test_sizes.tolist()
    for i, name in enumerate(names):
        folder = out / name
        folder.mkdir()
        save_part(folder / "train.npz", data.x_train[i, : train_sizes[i]], data.y_train[i, : train_sizes[i]])
        save_part(folder / "test.npz", data.x_test[i, : test_sizes[i]], data.y_test[i, : test_sizes[i]])
        if progress is not None:
            progress(i + 1)
    if data.has_true_clusters:
        clusters = dict(zip(names, data.true_cluster.tolist(), strict=True))
        (out / CLUSTERS_FILE).write_text(json.dumps(clusters, indent=1) + "\n")
    return names
