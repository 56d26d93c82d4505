"""Clustering and consensus metrics: ARI, matched assignment accuracy, Disp_j (DFCA section 4)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import adjusted_rand_score
from torch import Tensor

from dfca.core.params import cluster_views
from dfca.models import Params


def cluster_ari(assigned: Tensor, truth: Tensor) -> float:
    return float(adjusted_rand_score(truth.numpy(), assigned.numpy()))


def cluster_accuracy(assigned: Tensor, truth: Tensor) -> float:
    """Share of clients whose assignment matches the truth under the best label matching (Hungarian)."""
    k = int(max(assigned.max(), truth.max())) + 1
    counts = np.zeros((k, k), dtype=np.int64)
    np.add.at(counts, (assigned.numpy(), truth.numpy()), 1)
    rows, cols = linear_sum_assignment(-counts)
    return float(counts[rows, cols].sum() / len(truth))


def assignment_counts(assigned: Tensor, k: int) -> list[int]:
    return torch.bincount(assigned, minlength=k).tolist()


def populated_clusters(assigned: Tensor) -> int:
    return int(assigned.unique().numel())


@torch.no_grad()
def disagreement(params: Params) -> list[float]:
    """Disp_j = 1/N sum_i ||theta_ij - mean_i theta_ij||^2, per cluster j."""
    k = next(iter(params.values())).shape[1]
    # the population variance over clients, summed over coordinates, is exactly Disp_j (no [N, D] temporaries)
    return [float(sum(v.var(0, unbiased=False).sum() for v in cluster_views(params, j))) for j in range(k)]


EDGE_CHUNK_BYTES = 1 << 27  # the models of one chunk of edge ends gathered at once (128 MiB)


@torch.no_grad()
def index_consistency(params: Params, adjacency: Tensor) -> float:
    """Share of graph edges (i, m) across which cluster indices mean the same thing.

    For an edge, cluster j at i is matched to the nearest cluster at m (L2 over parameters);
    the edge is consistent when that matching is the identity for every j. 1.0 means every
    neighbour pair agrees on what each index is; DFCA-LI starts near 1/k!.
    """
    k = next(iter(params.values())).shape[1]
    if k == 1:
        return 1.0
    src, dst = torch.nonzero(torch.triu(adjacency, diagonal=1), as_tuple=True)
    if src.numel() == 0:
        return 1.0
    n = adjacency.shape[0]
    per_client = [t.view(n, k, -1) for t in params.values()]  # [N, k, D_t] views, no copy
    norms = sum((v * v).sum(2) for v in per_client)  # [N, k] squared norms
    size = sum(v.shape[2] for v in per_client) * k * 4
    chunk = max(1, EDGE_CHUNK_BYTES // size)
    consistent = 0
    for lo in range(0, src.numel(), chunk):
        a, b = src[lo : lo + chunk], dst[lo : lo + chunk]
        dots = sum(torch.bmm(v.index_select(0, a), v.index_select(0, b).transpose(1, 2)) for v in per_client)
        dist = norms[a].unsqueeze(2) + norms[b].unsqueeze(1) - 2 * dots  # [E, k, k] squared L2
        consistent += int((dist.argmin(2) == torch.arange(k, device=dist.device)).all(1).sum())
    return consistent / src.numel()
