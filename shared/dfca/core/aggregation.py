"""Decentralized aggregation, DFCA eq. 6-8.

Batch (eq. 7):      theta_ij <- (w_ii theta_ij + sum_{m in N_ij} theta_mj) / (w_ii + |N_ij|)
Sequential (eq. 8): theta_ij <- theta_ij + (theta_mj - theta_ij) / (w_ii + r), the r-th arrival (r = 1, 2, ...)

w_ii = 1 is the paper's rule (the own copy always counts). The `fresh` merge rule sets
w_ii = 0 for clusters the client did not train this round, so an untrained cluster takes
only what arrived; with nothing arrived it stays as it is. Over any arrival order the
running average equals the batch average (tests prove it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dfca.core.params import cluster_views
from dfca.models import Params


def self_weights(assigned: Tensor, k: int, merge: str) -> Tensor:
    """[M, k] weight of a client's own copy of each cluster in its merge."""
    if merge == "paper":
        return torch.ones(assigned.shape[0], k)
    if merge == "fresh":
        return torch.nn.functional.one_hot(assigned, k).float()
    raise ValueError(f"dfca.merge: unknown merge rule {merge!r} (paper or fresh)")


@torch.no_grad()
def running_average(current: Params, incoming: Params, arrivals: int, self_weight: float = 1.0) -> None:
    """Eq. 8 in place: fold the `arrivals`-th model (1-based) into the running average."""
    weight = 1.0 / (self_weight + arrivals)
    for name, t in current.items():
        t.add_(incoming[name].to(t.dtype) - t, alpha=weight)


def mixing_matrices(delivered: Tensor, sent_cluster: Tensor, self_w: Tensor) -> Tensor:
    """Per-cluster row-stochastic mixing matrices W[j] (eq. 7 as matrices, eq. 10).

    delivered [N, S] bool: receiver i got source m's model this round (the graph minus lost messages).
    sent_cluster [S]: the cluster each source model belongs to. self_w [N, k]: own-copy weights.
    Rows are receivers; the self entry sits at column i. Sources beyond N are extra models
    (for example last round's models that arrived late).
    """
    N = delivered.shape[0]
    k = self_w.shape[1]
    sent = torch.nn.functional.one_hot(sent_cluster, k).T.float()  # [k, N]
    W = delivered.float().unsqueeze(0) * sent.unsqueeze(1)  # [k, M, N]
    idx = torch.arange(N)
    W[:, idx, idx] = self_w.T
    empty = W.sum(2) == 0  # nothing arrived and own copy has weight 0: keep own copy
    W[:, idx, idx] += empty.float()
    return W / W.sum(2, keepdim=True)


@torch.no_grad()
def mix_clusters(params: Params, W: Tensor, extra: Tensor | None = None) -> None:
    """theta_{.,j} <- W[j] @ [theta_{.,j}; extra] for every cluster j, in place (eq. 7 as a matrix product).

    extra [S - N, D]: flattened extra source models, the columns of W beyond N.
    Only the source columns with weight off the diagonal (the clients that trained j) enter the
    product, in place on views of the parameters: about k times fewer multiply-adds than the dense
    [N, S] product, and no flattened copy of the models. A row that is e_i keeps its model exactly
    (times 1, plus 0).
    """
    n = next(iter(params.values())).shape[0]
    idx = torch.arange(n)
    for j in range(W.shape[0]):
        off = W[j].clone()
        own = off[idx, idx].clone()
        off[idx, idx] = 0.0
        if not (off.any() or (own != 1.0).any()):
            continue  # nothing arrived for cluster j anywhere
        cols = off.any(0).nonzero().squeeze(1)
        inner, outer = cols[cols < n], cols[cols >= n] - n
        weights, keep = off[:, cols], own.unsqueeze(1)
        offset = 0
        for view in cluster_views(params, j):
            size = view.shape[1]
            src = view.index_select(0, inner)
            if outer.numel():
                if extra is None:
                    raise ValueError("W has columns beyond N but no extra models were given")
                src = torch.cat([src, extra[outer, offset : offset + size].to(view.dtype)])
            view.mul_(keep).addmm_(weights, src)
            offset += size
