"""FedSPD's soft clustering (Lin et al. 2025): per-datapoint cluster labels by least loss (Algorithm 1,
DATACLUSTERING), mixture coefficients u_is, the random choice of the cluster to train, and the
personalised model x_i = sum_s u_is c_is (eq. 2)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dfca.core.label_matching import min_cost_matching
from dfca.models.batched import BatchedModel, Params

EVAL_BLOCK = 64  # clients evaluated together


@torch.no_grad()
def sample_losses(model: BatchedModel, params: Params, x: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy of every cluster model on every sample of every client: params [M, k, ...] -> [M, k, n]."""
    M, k = next(iter(params.values())).shape[:2]
    n = y.shape[1]
    out = torch.empty(M, k, n, device=x.device)
    for lo in range(0, M, EVAL_BLOCK):
        hi = min(lo + EVAL_BLOCK, M)
        flat = {name: t[lo:hi].reshape(-1, *t.shape[2:]) for name, t in params.items()}  # [(b k), ...]
        logits = model.logits(flat, x[lo:hi].repeat_interleave(k, dim=0))
        ce = F.cross_entropy(logits.transpose(1, 2), y[lo:hi].repeat_interleave(k, dim=0), reduction="none")
        out[lo:hi] = ce.reshape(hi - lo, k, n)
    return out


def datapoint_clusters(losses: Tensor) -> Tensor:
    """Each sample's cluster: the one whose model has its least loss. [M, k, n] -> [M, n]."""
    return losses.argmin(dim=1)


def mixture_shares(labels: Tensor, k: int, mask: Tensor | None = None) -> Tensor:
    """u_is: the fraction of client i's samples labelled s. [M, n] -> [M, k] (rows sum to 1); mask [M, n]: its
    real samples (the shares are of those)."""
    hot = torch.nn.functional.one_hot(labels, k).float()
    if mask is None:
        return hot.mean(1)
    return (hot * mask.unsqueeze(2)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)


def draw_clusters(shares: Tensor, seeds: Sequence[int]) -> Tensor:
    """Each client picks the cluster it trains this round with probability u_is. [M, k] -> [M].

    Client m draws with its own generator seeded `seeds[m]`, so a draw does not depend on which
    other clients are drawn with it (the simulator and the message-driven hosts draw the same)."""
    if not shares.shape[0]:
        return torch.zeros(0, dtype=torch.long, device=shares.device)
    draws = [torch.multinomial(row, 1, generator=torch.Generator().manual_seed(int(seed)))[0]
             for row, seed in zip(shares.cpu(), seeds, strict=True)]  # CPU generators: the same draws anywhere
    return torch.stack(draws).to(shares.device)


@torch.no_grad()
def personalised_models(params: Params, shares: Tensor) -> Params:
    """Eq. 2: x_i = sum_s u_is c_is. params [M, k, ...], shares [M, k] -> [M, ...]."""
    out: Params = {}
    for name, t in params.items():
        weights = shares.view(*shares.shape, *[1] * (t.dim() - 2)).to(t.dtype)
        out[name] = (t * weights).sum(1)
    return out


def mixture_error(estimated: Tensor, truth: Tensor) -> float:
    """Mean absolute error between estimated and true mixtures [M, k] under the best relabelling of clusters
    (cluster indices are arbitrary: label switching)."""
    cost = (estimated.unsqueeze(2) - truth.unsqueeze(1)).abs().mean(0)  # [k est, k true]
    rows, cols = min_cost_matching(cost.cpu().numpy())
    return float(cost[rows, cols].mean())
