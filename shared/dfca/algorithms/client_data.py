"""What an algorithm computes on its hosted clients' own samples, whatever their sizes: losses, accuracy, local SGD.

A federation of equal clients is one block of rows and runs exactly as the core functions do. Clients of unequal
size are padded (dfca.data.shards): every function here masks the padding out, and a client's SGD does its epochs
over its own samples: ceil(n_i / batch_size) steps an epoch, the last one on the remainder, and no step once its
samples are used (the batched step then waits for the larger clients). With train.local_steps every client's epoch
is instead that many full batches of its own samples (fixed_step_sgd), so no client waits for a larger one.
Bucketed clients (padding that would more than double memory) are computed bucket by bucket: their model rows
gathered, computed, written back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dfca.core import accuracy_with, gather_clusters, scatter_clusters
from dfca.core.assignment import loss_matrices
from dfca.core.local_update import sample_orders
from dfca.data import FederatedData
from dfca.data.shards import padded
from dfca.models.batched import BatchedModel, Params, step_streams

STREAM_BYTES = 512 * 2**20  # the samples one fixed-step call gathers: its clients train in groups that fit in it


def rows_of(params: Params, rows: Tensor | None) -> Params:
    return params if rows is None else {n: v.index_select(0, rows) for n, v in params.items()}


def train_losses(model: BatchedModel, params: Params, data: FederatedData) -> Tensor:
    """[M, k]: the mean loss of every client's k models on its own train samples (eq. 1)."""
    return train_loss_matrices(model, params, data)[0]


def train_loss_matrices(model: BatchedModel, params: Params, data: FederatedData, head: int = 0
                        ) -> tuple[Tensor, Tensor | None]:
    """(train_losses, and with head > 0 the same over the samples `first_samples(data, rows, head)` takes alone),
    from one forward pass."""
    blocks = data.blocks()
    if len(blocks) == 1:
        return loss_matrices(model, params, data.x_train, data.y_train, data.train_mask, head)
    k = next(iter(params.values())).shape[1]
    out = torch.empty(data.num_clients, k, device=data.true_cluster.device)
    first = torch.empty_like(out) if head > 0 else None
    for rows, d in blocks:
        losses, few = loss_matrices(model, rows_of(params, rows), d.x_train, d.y_train, d.train_mask, head)
        out[rows] = losses
        if first is not None and few is not None:
            first[rows] = few
    return out, first


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
    seeds: Sequence[int], momentum: float = 0.0, sample_mask: Tensor | None = None, local_steps: int | None = None,
) -> None:
    """Every client's local SGD on its own samples (of those, where sample_mask [M, n >= its width] holds), in
    place on params [M, ...]: `epochs` passes over them, or with local_steps, epochs x local_steps steps each."""
    if epochs <= 0:
        return
    if local_steps is not None:
        fixed_step_sgd(model, params, data, seeds, steps=epochs * local_steps, lr=lr, batch_size=batch_size,
                       momentum=momentum, sample_mask=sample_mask)
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


def fixed_step_sgd(
    model: BatchedModel, params: Params, data: FederatedData, seeds: Sequence[int], *, steps: int, lr: float,
    batch_size: int, momentum: float = 0.0, sample_mask: Tensor | None = None,
) -> None:
    """Every client does exactly `steps` SGD steps of batch_size samples, in place on params [M, ...]: its batches
    walk seeded permutations of its own samples (where sample_mask [M, n >= its width] holds), a fresh one each time
    one is used up (step_streams), never padding. A client without such a sample stays as it is.

    Each client's steps gather its samples into a stream of the same length whatever its size, so clients of every
    size bucket train together, as one batched call (in groups within STREAM_BYTES)."""
    length = steps * batch_size
    device = data.true_cluster.device
    parts = []  # (the block's clients [B], its data, their streams [B, length])
    trains = torch.zeros(data.num_clients, dtype=torch.bool, device=device)
    for rows, d in data.blocks():
        y = d.y_train
        kept = d.train_mask if d.train_mask is not None else torch.ones(y.shape, dtype=torch.bool, device=y.device)
        clients = torch.arange(data.num_clients, device=device) if rows is None else rows.to(device)
        if sample_mask is not None:
            kept = kept & sample_mask.index_select(0, clients.to(sample_mask.device))[:, : y.shape[1]].to(kept.device)
        parts.append((clients, d, step_streams([seeds[c] for c in clients.tolist()], kept, length).to(y.device)))
        trains[clients] = kept.any(1).to(device)
    active = trains.nonzero().flatten()
    x_all = parts[0][1].x_train
    group = max(1, STREAM_BYTES // (length * (x_all[0, 0].numel() * x_all.element_size() + 8)))
    slot = torch.full((data.num_clients,), -1, dtype=torch.long, device=device)  # a client's row in its group
    for lo in range(0, active.numel(), group):
        members = active[lo : lo + group]
        slot.fill_(-1)
        slot[members] = torch.arange(members.numel(), device=device)
        x = torch.empty(members.numel(), length, *x_all.shape[2:], dtype=x_all.dtype, device=x_all.device)
        y = torch.empty(members.numel(), length, dtype=torch.long, device=x_all.device)
        for clients, d, stream in parts:
            at = slot[clients]
            here = (at >= 0).nonzero().flatten()
            if here.numel() == 0:
                continue
            width = d.y_train.shape[1]
            flat = (stream.index_select(0, here.to(stream.device)) + here.to(stream.device).unsqueeze(1) * width)
            to = at[here].to(x.device)
            x[to] = d.x_train.reshape(-1, *x_all.shape[2:]).index_select(0, flat.flatten()).view(-1, length,
                                                                                                 *x_all.shape[2:])
            y[to] = d.y_train.reshape(-1).index_select(0, flat.flatten()).view(-1, length).to(torch.long)
        whole = members.numel() == data.num_clients  # every client at once: train params in place
        p = params if whole else rows_of(params, members)
        orders = torch.arange(length, device=x.device).expand(members.numel(), 1, length)
        model.sgd(p, x, y, lr, orders, batch_size, momentum)
        if not whole:
            for n, v in p.items():
                params[n].index_copy_(0, members, v)


def train_assigned(
    model: BatchedModel, params: Params, assigned: Tensor, data: FederatedData, *, lr: float, epochs: int,
    batch_size: int, seeds: Sequence[int], momentum: float = 0.0, local_steps: int | None = None,
) -> None:
    """Eq. 5 on every client's own samples: theta_{i,c(i)} trains, the other copies stay."""
    if epochs <= 0:
        return
    chosen = gather_clusters(params, assigned)
    local_sgd(model, chosen, data, lr=lr, epochs=epochs, batch_size=batch_size, seeds=seeds, momentum=momentum,
              local_steps=local_steps)
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
