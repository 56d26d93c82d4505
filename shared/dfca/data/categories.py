"""FedCRef's setting (`data.partition: categories`): every client holds K_i whole categories of one image pool.

Client i draws K_i uniformly in `data.categories_per_client` ([2, classes // 2] by default: 2..5 for the ten
digits, the paper's Sec. 5.2), then K_i distinct categories (classes), and gets S samples of each. The task is
unsupervised, so the pool's train and test images are pooled into one (no test split).

S is `data.samples_per_category` (the paper's 500) where the pool allows disjoint shards. Where it does not, a
category's S_c is the largest value that fits: category c, held by h_c clients with overlap O, needs O*S_c
images shared by every holder plus (1 - O)*S_c of each holder's own, so S_c <= |pool_c| / (O + h_c (1 - O)).
The bundled MNIST has about 500 images per digit: with 20 clients (about 7 holders per digit) S_c is 40-100
(logged), so clusters are smaller than the paper's and unequal across categories.

Overlap O (`data.overlap`, the paper's Sec. 5.4.3): the first round(O*S) samples of a category are the same
images at every holder.

Clients hold sum_c S_c samples each; the tensors are stacked to the largest and padded with blank
images labelled -1. `y_train` holds the true category of every sample: only the simulated initial clustering
(dirty labels, as the paper's Tables 3-4) and the evaluation read it. `x_test` is an empty view of one
sample per client (the clustering is judged on the clients' own data), and `true_cluster` is K_i.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from dfca.data.partition import seeded_rng
from dfca.data.pool import ImagePool, PooledSource
from dfca.data.shards import FederatedData

if TYPE_CHECKING:
    from dfca.sections import ExperimentBase

log = logging.getLogger(__name__)

PADDING = -1  # the label of a padded slot


def category_range(cfg: ExperimentBase, classes: int) -> tuple[int, int]:
    """[low, high] of K_i, checked against the pool's classes."""
    low, high = cfg.data.categories_per_client or (2, max(classes // 2, 2))
    if high > classes:
        raise ValueError(f"data.categories_per_client: up to {high} categories per client, but "
                         f"{cfg.data.dataset} has {classes} classes")
    return low, high


def samples_per_category(wanted: int, overlap: float, pool_sizes: np.ndarray, holders: np.ndarray) -> np.ndarray:
    """[classes]: the largest S_c <= wanted with O*S_c + h_c (1 - O)*S_c <= |pool_c| (wanted where h_c = 0)."""
    return np.array([min(wanted, math.floor(size / (overlap + h * (1 - overlap)))) if h else wanted
                     for size, h in zip(pool_sizes, holders, strict=True)], dtype=np.int64)


def category_data(cfg: ExperimentBase, source: PooledSource) -> FederatedData:
    data, classes = cfg.data, source.num_classes
    pool = ImagePool(torch.cat([source.train.images, source.test.images]),
                     torch.cat([source.train.labels, source.test.labels]), source.train.scale)
    low, high = category_range(cfg, classes)
    rng = seeded_rng(cfg.seed, "categories")
    counts = rng.integers(low, high + 1, size=data.clients)
    held = [np.sort(rng.choice(classes, k, replace=False)) for k in counts]
    labels = pool.labels.numpy()
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(classes)]
    holders = np.bincount(np.concatenate(held), minlength=classes)
    s = samples_per_category(data.samples_per_category, data.overlap, np.array([len(b) for b in by_class]), holders)
    if (s[holders > 0] < 1).any():
        raise ValueError(f"data.samples_per_category: {data.dataset} has too few images of some category for "
                         f"{data.clients} clients (a category has {int(holders.max())} holders)")
    if (s[holders > 0] < data.samples_per_category).any():
        log.warning("%s: %d-%d samples per category (data.samples_per_category is %d): the most that disjoint "
                    "shards of the pool allow for %d clients with overlap %.2f", data.dataset,
                    int(s[holders > 0].min()), int(s[holders > 0].max()), data.samples_per_category, data.clients,
                    data.overlap)
    shared = np.rint(data.overlap * s).astype(np.int64)
    cursor = shared.copy()
    width = max(int(s[c].sum()) for c in held)
    rows = np.full((data.clients, width), -1, dtype=np.int64)
    for i, categories in enumerate(held):
        picks = []
        for c in categories:
            own = by_class[c][cursor[c]: cursor[c] + s[c] - shared[c]]
            cursor[c] += s[c] - shared[c]
            picks.append(np.concatenate([by_class[c][: shared[c]], own]))
        mine = rng.permutation(np.concatenate(picks))
        rows[i, : mine.size] = mine
    index = torch.from_numpy(np.maximum(rows, 0))
    pad = torch.from_numpy(rows < 0)
    x = pool.pixels(index.flatten()).view(data.clients, width, *pool.input_shape)
    x[pad] = 0.0
    y = pool.labels[index].clone()
    y[pad] = PADDING
    return FederatedData(x, y, x[:, :1], y[:, :1], torch.from_numpy(counts.astype(np.int64)), classes)
