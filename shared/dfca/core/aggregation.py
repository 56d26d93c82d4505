"""Decentralized aggregation, DFCA eq. 6-8, as one weighted running average.

Batch (eq. 7):      theta_ij <- (w_ii theta_ij + sum_{m in N_ij} theta_mj) / (w_ii + |N_ij|)
Sequential (eq. 8): theta_ij <- theta_ij + (theta_mj - theta_ij) / (w_ii + r), the r-th arrival (r = 1, 2, ...)

`fold_models` is both. Each copy theta_ij carries a weight c_ij: w_ii when the round's merge opens,
plus every arrival folded since. A batch of arrivals a_is x_s of cluster j makes
theta_ij <- (c_ij theta_ij + sum_s a_is x_s) / (c_ij + sum_s a_is). One message at a time (a_is = 1)
that is eq. 8; all of a round's messages at once it is eq. 7; any arrival order gives the same result
(tests prove it). Weighted arrivals give DFedAvgM's Metropolis-Hastings mixing, and c = 0 gives
IFCA's sample-weighted server average (the old model does not count).

w_ii = 1 is the paper's rule (the own copy always counts). The `fresh` merge rule sets w_ii = 0 for
clusters the client did not train this round, so an untrained cluster takes only what arrived; with
nothing arrived it stays as it is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dfca.core.params import cluster_views
from dfca.core.sparse_factor import product_factor
from dfca.models.batched import Params


def self_weights(assigned: Tensor, k: int, merge: str) -> Tensor:
    """[M, k] weight of a client's own copy of each cluster in its merge."""
    if merge == "paper":
        return torch.ones(assigned.shape[0], k, device=assigned.device)
    if merge == "fresh":
        return torch.nn.functional.one_hot(assigned, k).float()
    raise ValueError(f"dfca.merge: unknown merge rule {merge!r} (paper or fresh)")


def _columns(mask: Tensor) -> slice | Tensor:
    """The indices where `mask` holds: a slice when they are contiguous (a view, no copy), else an index."""
    cols = mask.nonzero().squeeze(1)
    first, last = int(cols[0]), int(cols[-1])
    return slice(first, last + 1) if last - first + 1 == cols.numel() else cols


@torch.no_grad()
def fold_models(params: Params, weight: Tensor, arrivals: Tensor, cluster: Tensor, sources: Params) -> int:
    """Fold arriving models into the running averages, in place (eq. 8, weighted; eq. 7 for a batch).

    params [M, k, ...]: the copies; weight [M, k]: the weight c_ij each copy carries so far, updated in
    place; arrivals [M, S] >= 0: the weight of message s at row i (0: not delivered to i); cluster [S]:
    the cluster each message belongs to; sources: name -> [S, ...], the messages' models (sorted by
    cluster, a cluster's sources are read as a view). Only rows that received something change, in place
    on views of the parameters. Returns how many (row, message) pairs were folded in.
    """
    M = arrivals.shape[0]
    arrivals = arrivals.to(weight.dtype)
    for j in cluster.unique().tolist():
        cols = _columns(cluster == j)
        a = arrivals[:, cols]
        got = a.sum(1)
        moved = got > 0
        rows = moved.nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        total = torch.where(moved, weight[:, j] + got, 1.0)
        own = torch.where(moved, weight[:, j] / total, 1.0).unsqueeze(1)  # 1 and 0: a row that got nothing stays
        coef = a / total.unsqueeze(1)
        every_row = rows.numel() * 2 >= M  # in place on the whole view; else only the rows that moved
        if not every_row:
            own, coef = own[rows], coef[rows]
        coef = product_factor(coef)  # CSR on large sparse graphs (a row holds its neighbours' columns only)
        for name, view in zip(params, cluster_views(params, j), strict=True):
            src = sources[name][cols].reshape(coef.shape[1], -1).to(view.dtype)
            if src.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
                src = src.clone()  # the sources are views of the copies updated in place below
            if every_row:
                view.mul_(own).addmm_(coef, src)
            else:
                view.index_copy_(0, rows, torch.addmm(view.index_select(0, rows) * own, coef, src))
        weight[:, j] += got
    return int((arrivals > 0).sum())
