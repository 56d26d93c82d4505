"""Cluster assignment, DFCA eq. 4: c(i) = argmin_j F_client(theta_ij, D_i)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dfca.core.params import gather_clusters
from dfca.models.batched import BatchedModel, Params

EVAL_BLOCK = 64  # clients evaluated together


@torch.no_grad()
def loss_matrix(model: BatchedModel, params: Params, x: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of every cluster model on every client's data (eq. 1): [M, k]."""
    M, k = next(iter(params.values())).shape[:2]
    out = torch.empty(M, k, device=x.device)
    for lo in range(0, M, EVAL_BLOCK):
        hi = min(lo + EVAL_BLOCK, M)
        flat = {n: t[lo:hi].reshape(-1, *t.shape[2:]) for n, t in params.items()}  # [(b k), ...]
        xb = x[lo:hi].repeat_interleave(k, dim=0)
        yb = y[lo:hi].repeat_interleave(k, dim=0)
        logits = model.logits(flat, xb)
        ce = F.cross_entropy(logits.transpose(1, 2), yb, reduction="none").mean(1)
        out[lo:hi] = ce.reshape(hi - lo, k)
    return out


def assign_clusters(losses: Tensor) -> Tensor:
    """Eq. 4: each client picks the cluster whose model has its lowest local loss. [M, k] -> [M]."""
    return losses.argmin(dim=1)


@torch.no_grad()
def accuracy_with(model: BatchedModel, params: Params, clusters: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Each client's accuracy on (x, y) using its model of `clusters[m]`: [M]."""
    M = clusters.shape[0]
    acc = torch.empty(M, device=x.device)
    rows = torch.arange(M, device=x.device)
    for lo in range(0, M, EVAL_BLOCK):
        sl = slice(lo, min(lo + EVAL_BLOCK, M))
        chosen = gather_clusters(params, clusters[sl], rows[sl])
        pred = model.logits(chosen, x[sl]).argmax(-1)
        acc[sl] = (pred == y[sl]).float().mean(1)
    return acc
