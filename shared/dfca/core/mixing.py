"""Metropolis-Hastings gossip weights of DFedAvgM (Sun et al. 2021).

w_im = 1 / (1 + max(d_i, d_m)) on every edge and w_ii = 1 - sum_m w_im: symmetric and doubly stochastic on
any undirected graph. Folded as a weighted running average (core.aggregation.fold_models), a lost message
drops its entry and the row is renormalised over what arrived.
"""

from __future__ import annotations

import torch
from torch import Tensor


def metropolis_hastings_weights(adjacency: Tensor) -> Tensor:
    """[N, N] doubly-stochastic Metropolis-Hastings weights of an undirected graph (bool adjacency)."""
    adj = adjacency.bool() & ~torch.eye(adjacency.shape[0], dtype=torch.bool, device=adjacency.device)
    degree = adj.sum(1).float()
    W = adj.float() / (1.0 + torch.maximum(degree.unsqueeze(1), degree.unsqueeze(0)))
    W += torch.diag(1.0 - W.sum(1))
    return W
