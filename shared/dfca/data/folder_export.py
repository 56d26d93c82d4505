"""A federation written as a folder federation (`dfca data export`): what `read_folder_federation` reads back.

`OUT/client-007/train.npz` and `test.npz` hold each client's real samples (x float32 as the run uses them, y int64),
`OUT/clusters.json` the true clusters (where they are known). Client ids are `client-` and the row index, zero-padded
to at least three digits, so that their sorted order is the row order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dfca.data.folder_federation import CLUSTERS_FILE
from dfca.data.shards import FederatedData


def client_ids(count: int) -> list[str]:
    width = max(3, len(str(count - 1)))
    return [f"client-{i:0{width}d}" for i in range(count)]


def write_folder_federation(data: FederatedData, out: Path, progress: Callable[[int], None] | None = None) -> list[str]:
    """Write every client of `data` into `out` (new or empty); returns the client ids, in row order."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty folder; name a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    names = client_ids(data.num_clients)
    train_sizes, test_sizes = data.train_sizes.tolist(), data.test_sizes.tolist()
    for i, name in enumerate(names):
        folder = out / name
        folder.mkdir()
        np.savez(folder / "train.npz", x=data.x_train[i, : train_sizes[i]].cpu().numpy(),
                 y=data.y_train[i, : train_sizes[i]].cpu().numpy())
        np.savez(folder / "test.npz", x=data.x_test[i, : test_sizes[i]].cpu().numpy(),
                 y=data.y_test[i, : test_sizes[i]].cpu().numpy())
        if progress is not None:
            progress(i + 1)
    if data.has_true_clusters:
        clusters = dict(zip(names, data.true_cluster.tolist(), strict=True))
        (out / CLUSTERS_FILE).write_text(json.dumps(clusters, indent=1) + "\n")
    return names
