"""Cluster-model stacks: every tensor is [clients, k, *shape]."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dfca.models.batched import BatchedModel, Params


def init_cluster_models(
    model: BatchedModel, clients: Sequence[int], k: int, seed: int, init: str, device: torch.device | str = "cpu"
) -> Params:
    """DFCA-GI: every client holds the same k models (one seed). DFCA-LI: each client its own.

    Drawn on the CPU (the same models on every device), then placed on `device`."""
    if init == "global":
        base = model.init(k, torch.Generator().manual_seed(seed))
        return {name: t.to(device).unsqueeze(0).repeat(len(clients), *[1] * t.dim()) for name, t in base.items()}
    if init == "local":
        per_client = [model.init(k, torch.Generator().manual_seed(seed * 1_000_003 + 7 + c)) for c in clients]
        return {name: torch.stack([p[name] for p in per_client]).to(device) for name in per_client[0]}
    raise ValueError(f"init: unknown initialisation {init!r} (global or local)")


def _flat_rows(t: Tensor, clusters: Tensor, rows: Tensor | None = None) -> Tensor:
    """Row rows[i] * k + clusters[i] of t [M, k, ...] seen as [M * k, ...] (rows: 0..M-1 by default)."""
    if rows is None:
        rows = torch.arange(clusters.shape[0], device=clusters.device)
    return rows * t.shape[1] + clusters


def gather_clusters(params: Params, clusters: Tensor, rows: Tensor | None = None) -> Params:
    """params [M, k, ...], clusters [M] -> each client's model of its cluster, [M, ...]; with `rows` [S], client
    rows[i]'s model of clusters[i], [S, ...]. A copy: whole rows of memory (index_select), where advanced indexing
    copies element by element."""
    return {name: t.reshape(-1, *t.shape[2:]).index_select(0, _flat_rows(t, clusters, rows))
            for name, t in params.items()}


def scatter_clusters(params: Params, clusters: Tensor, values: Params) -> None:
    """Write values [M, ...] back into params[m, clusters[m]] in place."""
    for name, t in params.items():
        if t.is_contiguous():
            t.view(-1, *t.shape[2:]).index_copy_(0, _flat_rows(t, clusters), values[name])
        else:
            t[torch.arange(clusters.shape[0], device=clusters.device), clusters] = values[name]


def flatten_params(params: Params) -> Tensor:
    """[M, ...] per-client models -> [M, D]."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in params.values()], dim=1)


def flatten_cluster(params: Params, j: int) -> Tensor:
    """[M, D] view of cluster j over all clients (concatenated parameters)."""
    return torch.cat([t[:, j].reshape(t.shape[0], -1) for t in params.values()], dim=1)


def cluster_views(params: Params, j: int) -> list[Tensor]:
    """Cluster j as one [M, D_t] view per tensor, in the order of `params`: writing a view writes params.

    No copy (unlike flatten_cluster), so large models mix in place; needs each [M, k, ...] tensor to be
    contiguous after its first dimension, as every stack built here is.
    """
    views = []
    for name, t in params.items():
        try:
            views.append(t[:, j].view(t.shape[0], -1))
        except RuntimeError as e:
            raise ValueError(f"parameter {name!r} is not laid out [M, k, ...] contiguously: {e}") from e
    return views
