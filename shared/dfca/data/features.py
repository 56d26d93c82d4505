"""Feature vectors for the k-means algorithms: the paper's blobs, or a fixed projection of an image dataset.

Blobs (`data.dataset: blobs`, federated k-means over networks, Sec. IV-A): k = `clusters` Gaussian blobs in
R^d (d = `data.feature_dim`, 2 in the paper) whose centres are drawn in [-10, 10]^d at least `BLOB_SEPARATION`
apart, sampled with scikit-learn's make_blobs from the seed. `data.geometry`:
- isotropic: every blob has standard deviation 1;
- heterogeneous: standard deviations 1.0, 2.5, 0.5 (cycled for k > 3);
- anisotropic: isotropic blobs mapped by the fixed A = [[0.6, -0.6], [-0.4, 0.8]] (d = 2 only).
The pooled points are shuffled and split evenly: node i gets `train_per_client` points (its D_i) and
`test_per_client` held-out points; y holds every point's true blob. Every node sees the same distribution,
so `true_cluster` is 0 everywhere.

Projection (`data.features: projection`): each image of an image dataset, flattened, times a fixed seeded
Gaussian matrix [C*H*W, feature_dim] / sqrt(C*H*W); labels stay the classes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from dfca.data.partition import seeded_rng
from dfca.data.shards import FederatedData

if TYPE_CHECKING:
    from dfca.sections import ExperimentBase

BLOB_SEPARATION = 5.0
HETEROGENEOUS_STD = (1.0, 2.5, 0.5)
ANISOTROPIC = np.array([[0.6, -0.6], [-0.4, 0.8]])


def blob_centres(k: int, dim: int, rng: np.random.Generator, box: float = 10.0, tries: int = 10_000) -> np.ndarray:
    """k centres in [-box, box]^dim, pairwise at least BLOB_SEPARATION apart (rejection sampling)."""
    centres: list[np.ndarray] = []
    for _ in range(tries):
        c = rng.uniform(-box, box, dim)
        if all(np.linalg.norm(c - o) >= BLOB_SEPARATION for o in centres):
            centres.append(c)
            if len(centres) == k:
                return np.stack(centres)
    raise ValueError(f"data: cannot place {k} blob centres {BLOB_SEPARATION} apart in [-{box}, {box}]^{dim}; "
                     "use fewer clusters or more data.feature_dim")


def blobs(cfg: ExperimentBase) -> FederatedData:
    from sklearn.datasets import make_blobs  # when used: slow to import

    data, k, n = cfg.data, cfg.clusters, cfg.data.clients
    rng = seeded_rng(cfg.seed, "blobs")
    centres = blob_centres(k, data.feature_dim, rng)
    std = [HETEROGENEOUS_STD[j % len(HETEROGENEOUS_STD)] for j in range(k)] if data.geometry == "heterogeneous" else 1.0
    per_node = data.train_per_client + data.test_per_client
    x, y = make_blobs(n_samples=n * per_node, centers=centres, cluster_std=std,
                      random_state=int(rng.integers(2**31 - 1)), shuffle=True)
    if data.geometry == "anisotropic":
        x = x @ ANISOTROPIC
    x = torch.from_numpy(x).float().reshape(n, per_node, -1)
    y = torch.from_numpy(y).long().reshape(n, per_node)
    m = data.train_per_client
    return FederatedData(x_train=x[:, :m].contiguous(), y_train=y[:, :m].contiguous(),
                         x_test=x[:, m:].contiguous(), y_test=y[:, m:].contiguous(),
                         true_cluster=torch.zeros(n, dtype=torch.long), num_classes=k)


def projected(images: FederatedData, dim: int, seed: int) -> FederatedData:
    """The same shards with every image replaced by its fixed random projection to R^dim."""
    size = math.prod(images.x_train.shape[2:])
    g = torch.Generator().manual_seed(seed * 1_000_003 + 977)
    matrix = torch.randn(size, dim, generator=g) / math.sqrt(size)

    def project(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:2], size) @ matrix.to(x.device)

    return FederatedData(
        x_train=project(images.x_train), y_train=images.y_train, x_test=project(images.x_test),
        y_test=images.y_test, true_cluster=images.true_cluster, num_classes=images.num_classes,
        mixture=images.mixture, train_distribution=images.train_distribution,
        test_distribution=images.test_distribution, rotations=images.rotations,
    )
