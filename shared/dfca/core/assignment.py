"""Cluster assignment, DFCA eq. 4: c(i) = argmin_j F_client(theta_ij, D_i)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dfca.core.params import gather_clusters
from dfca.models.batched import BatchedModel, Params

EVAL_BLOCK = 64  # clients evaluated together


@torch.no_grad()
def loss_matrix(model: BatchedModel, params: Params, x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean cross-entropy of every cluster model on every client's data (eq. 1): [M, k]. mask [M, n]: the client's
    real samples (the mean is over them; padding counts for nothing)."""
    return loss_matrices(model, params, x, y, mask)[0]


@torch.no_grad()
def loss_matrices(model: BatchedModel, params: Params, x: Tensor, y: Tensor, mask: Tensor | None = None,
                  head: int = 0) -> tuple[Tensor, Tensor | None]:
    """(loss_matrix, and with head > 0 the same over each client's first `head` samples alone, [M, k]), from one
    forward pass: a sample's loss does not depend on the others it is batched with."""
    M, k = next(iter(params.values())).shape[:2]
    out = torch.empty(M, k, device=x.device)
    first = torch.empty(M, k, device=x.device) if head > 0 else None
    for lo in range(0, M, EVAL_BLOCK):
        hi = min(lo + EVAL_BLOCK, M)
        flat = {n: t[lo:hi].reshape(-1, *t.shape[2:]) for n, t in params.items()}  # [(b k), ...]
        xb, yb = repeated(x[lo:hi], k), repeated(y[lo:hi], k)
        logits = model.logits(flat, xb)
        ce = F.cross_entropy(logits.transpose(1, 2), yb, reduction="none")
        real = None if mask is None else repeated(mask[lo:hi], k)
        out[lo:hi] = (ce.mean(1) if real is None else masked_mean(ce, real)).reshape(hi - lo, k)
        if first is not None:
            few = ce[:, :head]
            first[lo:hi] = (few.mean(1) if real is None else masked_mean(few, real[:, :head])).reshape(hi - lo, k)
    return out, first


def repeated(t: Tensor, k: int) -> Tensor:
    """Each row of t k times over, in place of one another ([b, ...] -> [b k, ...]); t itself where k is 1."""
    return t if k == 1 else t.repeat_interleave(k, dim=0)


def assign_clusters(losses: Tensor) -> Tensor:
    """Eq. 4: each client picks the cluster whose model has its lowest local loss. [M, k] -> [M]."""
    return losses.argmin(dim=1)


@torch.no_grad()
def accuracy_with(model: BatchedModel, params: Params, clusters: Tensor, x: Tensor, y: Tensor,
                  mask: Tensor | None = None) -> Tensor:
    """Each client's accuracy on (x, y) using its model of `clusters[m]`: [M]; mask [M, n]: over its real samples."""
    M = clusters.shape[0]
    acc = torch.empty(M, device=x.device)
    rows = torch.arange(M, device=x.device)
    for lo in range(0, M, EVAL_BLOCK):
        sl = slice(lo, min(lo + EVAL_BLOCK, M))
        chosen = gather_clusters(params, clusters[sl], rows[sl])
        pred = model.logits(chosen, x[sl]).argmax(-1)
        hit = (pred == y[sl]).float()
        acc[sl] = hit.mean(1) if mask is None else masked_mean(hit, mask[sl])
    return acc


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """[M, n] -> [M]: each row's mean over its True positions (0 for a row with none); what lies elsewhere, even
    NaN, counts for nothing."""
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum(1) / mask.sum(1).clamp(min=1).to(values.dtype)
