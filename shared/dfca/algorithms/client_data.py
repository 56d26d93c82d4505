"""What an algorithm computes on its hosted clients' own samples, whatever their sizes: losses, accuracy, local SGD.

A federation of equal clients is one block of rows and runs exactly as the core functions do. Clients of unequal
size are padded (dfca.data.shards): every function here masks the padding out, and a client's SGD does its epochs
over its own samples: ceil(n_i / batch_size) steps an epoch, the last one on the remainder, and no step once its
samples are used (the batched step then waits for the larger clients). Bucketed clients (padding that would more
than double memory) are computed bucket by bucket: their model rows gathered, computed, written back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dfca.core import accuracy_with, gather_clusters, loss_matrix, scatter_clusters
from dfca.core.local_update import sample_orders
from dfca.data import FederatedData
from dfca.data.shards import padded
from dfca.models.batched import BatchedModel, Params


def rows_of(params: Params, rows: Tensor | None) -> Params:
    return params if rows is None else {n: v.index_select(0, rows) for n, v in params.items()}


def train_losses(model: BatchedModel, params: Params, data: FederatedData) -> Tensor:
    """[M, k]: the mean loss of every client's k models on its own train samples (eq. 1)."""
    blocks = data.blocks()
    if len(blocks) == 1:
        return loss_matrix(model, params, data.x_train, data.y_train, data.train_mask)
    out = torch.empty(data.num_clients, next(iter(params.values())).shape[1], device=data.true_cluster.device)
    for rows, d in blocks:
        out[rows] = loss_matrix(model, rows_of(params, rows), d.x_train, d.y_train, d.train_mask)
    return out


def test_accuracy(model: BatchedModel, params: Params, clusters: Tensor, data: FederatedData) -> Tensor:
    """[M]: every client's accuracy on its own test samples with its model of `clusters`."""
    blocks = data.blocks()
    if len(blocks) == 1:
        return accuracy_with(model, params, clusters, data.x_test, data.y_test, data.test_mask)
    out = torch.empty(data.num_clients, device=clusters.device)
    for rows, d in blocks:
        assert rows is not None
        out[rows] = accuracy_with(model, rows_of(params, rows), clusters[rows], d.x_test, d.y_test, d.test_mask)
    return out


def local_sgd(
    model: BatchedModel, params: Params, data: FederatedData, *, lr: float, epochs: int, batch_size: int,
    seeds: Sequence[int], momentum: float = 0.0, sample_mask: Tensor | None = None,
) -> None:
    """Every client's local SGD on its own samples (of those, where sample_mask [M, n >= its width] holds), in
    place on params [M, ...]."""
    if epochs <= 0:
        return
    for rows, d in data.blocks():
        width = d.y_train.shape[1]
        wanted = None if sample_mask is None else sample_mask[:, :width] if rows is None else sample_mask[rows, :width]
        block_seeds = seeds if rows is None else [seeds[r] for r in rows.tolist()]
        orders, keep = sample_orders(block_seeds, width, epochs, d.train_count, wanted)
        p = rows_of(params, rows)
        model.sgd(p, d.x_train, d.y_train, lr, orders, batch_size, momentum, **keep)
        if rows is not None:
            for n, v in p.items():
                params[n].index_copy_(0, rows, v)


def train_assigned(
    model: BatchedModel, params: Params, assigned: Tensor, data: FederatedData, *, lr: float, epochs: int,
    batch_size: int, seeds: Sequence[int], momentum: float = 0.0,
) -> None:
    """Eq. 5 on every client's own samples: theta_{i,c(i)} trains, the other copies stay."""
    if epochs <= 0:
        return
    chosen = gather_clusters(params, assigned)
    local_sgd(model, chosen, data, lr=lr, epochs=epochs, batch_size=batch_size, seeds=seeds, momentum=momentum)
    scatter_clusters(params, assigned, chosen)


def sample_counts(data: FederatedData) -> Tensor:
    """[M] float32: each client's real train samples (n_i), what a sample-weighted average weighs it by."""
    return data.train_sizes.to(torch.float32)


def first_samples(data: FederatedData, rows: Tensor, count: int | None = None
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """The train samples of `rows` [R], at most `count` each (None: all): x [R, c, ...], y [R, c] and the mask of
    real samples [R, c] (None where no row is padded)."""
    if not data.is_bucketed:
        mask = data.train_mask
        return (data.x_train[:, :count].index_select(0, rows), data.y_train[:, :count].index_select(0, rows),
                None if mask is None else mask[:, :count].index_select(0, rows))
    own = [data.client_shards(r)[0] for r in rows.tolist()]
    x, _ = padded([x[:count] for x, _ in own])
    y, n = padded([y[:count] for _, y in own], counted=True)
    assert n is not None
    return x, y, torch.arange(y.shape[1], device=y.device).unsqueeze(0) < n.unsqueeze(1)
