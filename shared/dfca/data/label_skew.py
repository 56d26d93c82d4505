"""Label-skew partitions with a group structure (DPMM-CFL Sec. 4.1, after Ma et al. 2022): `data.partition`.

dirichlet:   the classes are split among G groups with concentration 0.1 (for every class c, group shares
             q_c ~ Dir(0.1)), so group g's class mixture is pi_g ~ q_{., g} normalised; each group's share is then
             split among its clients with concentration 10 (client weights w ~ Dir(10) per class), so a client's
             class mixture is pi_g * w_i normalised.
class_split: every group is a random subset of 3 classes; every client of the group holds 2 of them, in
             equal numbers.

Clients are spread over the groups round-robin and shuffled with the seed (`true_cluster` is the group).
Every client holds `train_per_client` train and `test_per_client` test images drawn from its class
mixture (the test split from the same mixture: a client is evaluated on its own distribution). Images of a
class are dealt from a seeded permutation of that class's pool, cycling when a class runs out, so shards
overlap as little as the pool allows. Equal sizes keep client tensors stacked: a paper-style Dirichlet split
gives unequal n_i, which the eq. (3) weighting would then use; here n_i is equal and (3) is uniform.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from dfca.data.partition import assign_clusters, seeded_rng
from dfca.data.pool import ImagePool, PooledSource
from dfca.data.shards import FederatedData

if TYPE_CHECKING:
    from dfca.sections import ExperimentBase

log = logging.getLogger(__name__)

GROUP_CONCENTRATION = 0.1  # classes among groups
CLIENT_CONCENTRATION = 10.0  # a group's data among its clients
CLASSES_PER_GROUP = 3
CLASSES_PER_CLIENT = 2


def class_mixtures(partition: str, group: np.ndarray, groups: int, classes: int,
                   rng: np.random.Generator) -> np.ndarray:
    """[N, classes]: every client's class mixture (rows sum to 1)."""
    n = group.shape[0]
    out = np.zeros((n, classes))
    if partition == "dirichlet":
        shares = rng.dirichlet(np.full(groups, GROUP_CONCENTRATION), size=classes)  # [classes, groups]
        for g in range(groups):
            members = np.flatnonzero(group == g)
            weights = rng.dirichlet(np.full(max(len(members), 1), CLIENT_CONCENTRATION), size=classes)  # [C, m]
            for slot, i in enumerate(members):
                out[i] = shares[:, g] * weights[:, slot]
        empty = out.sum(1) == 0
        out[empty] = 1.0  # a client whose group drew no mass at all (vanishingly rare) gets every class
        return out / out.sum(1, keepdims=True)
    if partition == "class_split":
        if classes < CLASSES_PER_GROUP:
            raise ValueError(f"data.partition: class_split needs at least {CLASSES_PER_GROUP} classes")
        for g in range(groups):
            subset = rng.choice(classes, CLASSES_PER_GROUP, replace=False)
            for i in np.flatnonzero(group == g):
                out[i, rng.choice(subset, CLASSES_PER_CLIENT, replace=False)] = 1.0 / CLASSES_PER_CLIENT
        return out
    raise ValueError(f"data.partition: unknown label partition {partition!r}")


def class_counts(mixture: np.ndarray, samples: int, rng: np.random.Generator) -> np.ndarray:
    """[N, classes] integer counts summing to `samples` per client: a multinomial draw from each mixture
    (class_split's equal halves come out exact: the largest remainder rounding of an even split)."""
    even = np.isclose(mixture, mixture.max(1, keepdims=True)) | (mixture == 0)
    if even.all():  # uniform over a subset: deterministic, balanced counts
        base = np.floor(mixture * samples).astype(np.int64)
        for i in range(mixture.shape[0]):
            rest = samples - base[i].sum()
            order = rng.permutation(np.flatnonzero(mixture[i] > 0))[:rest]
            base[i, order] += 1
        return base
    return np.stack([rng.multinomial(samples, p) for p in mixture])


def deal(pool: ImagePool, counts: np.ndarray, rng: np.random.Generator, split: str) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """Images for every client, `counts[i, c]` of class c, dealt from a seeded permutation of each class's
    images and shuffled within the client."""
    labels = pool.labels.numpy()
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(counts.shape[1])]
    cursor = np.zeros(counts.shape[1], dtype=np.int64)
    rows = []
    reused = 0
    for i in range(counts.shape[0]):
        picks = []
        for c in np.flatnonzero(counts[i]):
            if by_class[c].size == 0:
                raise ValueError(f"the {split} pool has no image of class {c}")
            take = np.arange(cursor[c], cursor[c] + counts[i, c]) % by_class[c].size
            reused += int(max(cursor[c] + counts[i, c] - by_class[c].size, 0) > 0)
            cursor[c] += counts[i, c]
            picks.append(by_class[c][take])
        rows.append(rng.permutation(np.concatenate(picks)))
    if reused:
        log.info("the %s pool is too small for disjoint label-skew shards: %d client draws reuse images", split, reused)
    index = torch.from_numpy(np.stack(rows))
    return pool.pixels(index), pool.labels[index]


def label_skew_data(cfg: ExperimentBase, source: PooledSource) -> FederatedData:
    """`data.partition` (dirichlet or class_split) of a pooled dataset, with `data.groups` true groups."""
    data = cfg.data
    groups = data.groups or cfg.clusters
    group = assign_clusters(data.clients, groups, seeded_rng(cfg.seed, "groups"))
    mixture = class_mixtures(data.partition, group, groups, source.num_classes, seeded_rng(cfg.seed, "label-skew"))
    counts_rng = seeded_rng(cfg.seed, "label-counts")
    train_counts = class_counts(mixture, data.train_per_client, counts_rng)
    test_counts = class_counts(mixture, data.test_per_client, counts_rng)
    x_train, y_train = deal(source.train, train_counts, seeded_rng(cfg.seed, "train"), "train")
    x_test, y_test = deal(source.test, test_counts, seeded_rng(cfg.seed, "test"), "test")
    return FederatedData(x_train, y_train, x_test, y_test, torch.from_numpy(group), source.num_classes)
