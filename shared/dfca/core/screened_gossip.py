"""Screened gossip: one step of ratio consensus that a lying neighbour cannot steer far (`dfca.screen`).

Ratio consensus (core.consensus) trusts every (num, den) pair it receives: a sender that claims a huge weight den,
or an estimate num/den far from everyone else's, decides the result alone (one forged pair per
step taking a 24-client run from accuracy 0.877 to 0.11). What an honest pair can be is known at the receiver:

- den: the weights m_i (1 for the cluster a client trained, `untrained_weight` for the others) only ever mix, so an
  honest den lies in [0, 1] per cluster and sums to at most budget = 1 + (k - 1) untrained_weight over the k
  clusters. A den outside is clamped, then the pair is scaled down to the budget (num with it: the estimate is kept,
  its weight is not): a liar weighs no more than one honest client, however it spreads its weight.
- the estimate e_mj = num_mj / den_mj: every honest copy of cluster j this round is a mix of copies trained from
  the model the clients agreed on last round (theta_ij before training, the *anchor*), so it lies within about
  one training displacement r of it. Receiver i measures its own, r_i = |trained theta_{i,c(i)} - anchor_{i,c(i)}|,
  and drops (weight 0) an informative arrival with |e_mj - anchor_ij| > radius * r_i (`dfca.screen_radius`).
- for its own cluster c(i) the receiver also has data: `test(rows, estimates)` (the algorithm's) drops an estimate
  whose loss on the receiver's own samples is much worse than the anchor's (`dfca.screen_loss`).

A dropped arrival counts as (0, 0): the step's divisor (1 + arrivals) is kept, so num and den shrink together and
the estimate num/den is a mix of the accepted copies only. Without liars nothing is dropped where training moved
every copy by about the same distance, and the step is exactly ratio consensus.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from dfca.core.ratio import MIN_WEIGHT, trailing

BLOCK_FLOATS = 1 << 25  # message estimates formed at once (128 MiB of float32)

# (receiver rows [P], their estimates of their own cluster [P, ...]) -> [P] bool: keep the estimate
EstimateTest = Callable[[Tensor, dict[str, Tensor]], Tensor]


@dataclass
class Screen:
    """What a receiver screens arrivals against, per hosted row."""

    anchor: dict[str, Tensor]  # [M, k, ...]: the rows' models before this round's training
    radius: Tensor  # [M]: the farthest an accepted estimate may lie from its anchor
    clusters: Tensor  # [M]: each row's own cluster this round (the one it trained)
    budget: float  # an honest message's largest total den: 1 + (k - 1) untrained_weight
    test: EstimateTest | None  # the data test of an estimate of the row's own cluster
    trim: float = 0.0  # > 0: the estimate is the coordinate-wise trimmed mean of what was kept, this cut per end


def budgeted(den: Tensor, budget: float) -> tuple[Tensor, Tensor]:
    """(den', scale) [S, k]: each arrived den clamped to [0, 1] and each message's total to `budget`, and what its num
    is to be multiplied by (den' / den) for the pair to keep its estimate num / den. An honest pair's scale is 1."""
    clean = den.nan_to_num(0.0, 0.0, 0.0).clamp(0.0, 1.0)
    clean = clean * (budget / clean.sum(1, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)
    scale = torch.where(den > 0, clean / den.clamp_min(1e-30), torch.zeros_like(den))
    return clean, scale


def _flat(t: Tensor, j: int) -> Tensor:
    """[R, k, ...] -> cluster j as [R, F]."""
    return t[:, j].reshape(t.shape[0], -1)


def anchor_distances(num: Mapping[str, Tensor], den: Tensor, anchor: Mapping[str, Tensor]) -> Tensor:
    """[M, S, k]: |num[s, j] / den[s, j] - anchor[i, j]| over all of cluster j's tensors, for every row i and message
    s, as |e|^2 + |a|^2 - 2 a.e (one matrix product per cluster and tensor, no copy per pair)."""
    m, (s, k) = next(iter(anchor.values())).shape[0], den.shape
    sq = torch.zeros(m, s, k, dtype=torch.float64, device=den.device)
    inv = 1.0 / den.clamp_min(MIN_WEIGHT)
    for name, a in anchor.items():
        for j in range(k):
            aj = _flat(a, j)  # [M, F]
            a_sq = (aj * aj).sum(1).unsqueeze(1)
            step = max(1, BLOCK_FLOATS // max(1, aj.shape[1]))
            for lo in range(0, s, step):  # the estimates of `step` messages at a time: [step, F]
                e = _flat(num[name][lo:lo + step], j).to(a.dtype) * inv[lo:lo + step, j].to(a.dtype).unsqueeze(1)
                sq[:, lo:lo + step, j] += (a_sq + (e * e).sum(1).unsqueeze(0) - 2 * aj @ e.T).double()
    return sq.clamp_min(0.0).sqrt()


def own_cluster_estimates(num: Mapping[str, Tensor], den: Tensor, cols: Tensor, clusters: Tensor) -> dict[str, Tensor]:
    """[P, ...]: each pair's arrived estimate of the receiver's own cluster (`clusters` [P])."""
    d = den[cols, clusters].clamp_min(MIN_WEIGHT)
    return {n: v[cols, clusters] / trailing(d.to(v.dtype), v[cols, clusters]) for n, v in num.items()}


def screened_mix(num: dict[str, Tensor], den: Tensor, delivered: Tensor, arrived_num: Mapping[str, Tensor],
                 arrived_den: Tensor, screen: Screen) -> tuple[dict[str, Tensor], Tensor, int]:
    """One screened gossip step for the M hosted rows: (num', den', informative (pair, cluster)s dropped).

    num [M, k, ...], den [M, k]: the rows' pairs; delivered [M, S]: row i received message s; arrived_num
    [S, k, ...], arrived_den [S, k]: the messages (not changed). An arrival of (about) no weight, den <= MIN_WEIGHT, is
    dropped too: it carries no estimate, and its num could carry anything.
    """
    clean, scale = budgeted(arrived_den, screen.budget)
    informative = clean > MIN_WEIGHT  # [S, k]
    keep = (delivered.unsqueeze(2) & informative.unsqueeze(0)
            & (anchor_distances(arrived_num, arrived_den, screen.anchor) <= screen.radius.view(-1, 1, 1)))  # [M, S, k]
    if screen.test is not None:
        rows, cols = delivered.nonzero(as_tuple=True)
        own = screen.clusters[rows]
        tested = keep[rows, cols, own]
        if bool(tested.any()):
            at = tested.nonzero().squeeze(1)
            passed = screen.test(rows[at], own_cluster_estimates(arrived_num, arrived_den, cols[at], own[at]))
            keep[rows[at], cols[at], own[at]] = passed
    dropped = int((delivered.unsqueeze(2) & informative.unsqueeze(0) & ~keep).sum())
    weight = keep.to(den.dtype)  # [M, S, k]
    degree = delivered.sum(1).to(den.dtype)
    new_den = (den + (weight * clean.to(den.dtype).unsqueeze(0)).sum(1)) / trailing(degree + 1, den)
    if screen.trim > 0:
        rows, cols = delivered.nonzero(as_tuple=True)
        est = trimmed_estimates(num, den, arrived_num, arrived_den, rows, cols, keep[rows, cols], screen.trim)
        return {n: v * trailing(new_den.to(v.dtype), v) for n, v in est.items()}, new_den, dropped
    mix = weight * scale.to(den.dtype).unsqueeze(0)  # [M, S, k]: what each arrived num counts for
    out: dict[str, Tensor] = {}
    for n, v in num.items():
        total = torch.stack([mix[:, :, j].to(v.dtype) @ _flat(arrived_num[n], j).to(v.dtype)
                             for j in range(den.shape[1])], 1).reshape(v.shape)
        out[n] = (v + total) / trailing(degree + 1, v)
    return out, new_den, dropped


def trimmed_estimates(num: Mapping[str, Tensor], den: Tensor, arr_num: Mapping[str, Tensor], arr_den: Tensor,
                      rows: Tensor, cols: Tensor, keep: Tensor, trim: float) -> dict[str, Tensor]:
    """[M, k, ...]: per row and cluster, the coordinate-wise trimmed mean of its own estimate (where informative) and
    the kept arrivals' estimates, floor(trim x their number) cut from each end (W-MSR style); its own estimate where
    it has none. The W estimates of a row sit in the last dimension: sums and top-c there, no sort."""
    m, k = den.shape
    order = torch.argsort(rows, stable=True)
    counts = torch.bincount(rows, minlength=m)
    slot = torch.arange(rows.shape[0], device=rows.device) - (torch.cumsum(counts, 0) - counts)[rows[order]] + 1
    width = int(counts.max()) + 1 if rows.numel() else 1
    valid = torch.zeros(m, width, k, dtype=torch.bool, device=den.device)
    valid[:, 0] = den > MIN_WEIGHT
    valid[rows[order], slot] = keep[order]
    valid = valid.transpose(1, 2)  # [M, k, W]
    n_valid = valid.sum(2)  # [M, k]
    cut = (trim * n_valid.double()).floor().long()
    most = int(cut.max()) if cut.numel() else 0
    out: dict[str, Tensor] = {}
    for name, v in num.items():
        own_est = v / trailing(den.clamp_min(MIN_WEIGHT).to(v.dtype), v)
        src = arr_num[name].to(v.dtype) / trailing(arr_den.clamp_min(MIN_WEIGHT).to(v.dtype), arr_num[name])
        table = torch.zeros(m, width, *v.shape[1:], dtype=v.dtype, device=v.device)
        table[:, 0] = own_est
        table[rows[order], slot] = src.index_select(0, cols[order])
        table = table.movedim(1, -1).contiguous()  # [M, k, ..., W]
        mask = valid.reshape(m, k, *[1] * (v.dim() - 2), width)
        table = table.masked_fill(~mask, 0.0)
        total = table.sum(-1)
        if most > 0:
            rank = torch.arange(most, device=v.device)
            take = (rank < trailing(cut, v).unsqueeze(-1)).to(v.dtype)  # [M, k, 1.., most]: the first cut[m, k]
            top = table.masked_fill(~mask, -math.inf).topk(most, dim=-1).values.nan_to_num(0.0, 0.0, 0.0)
            low = table.masked_fill(~mask, math.inf).topk(most, dim=-1, largest=False).values.nan_to_num(0.0, 0.0, 0.0)
            total = total - (top * take).sum(-1) - (low * take).sum(-1)
        kept = trailing((n_valid - 2 * cut).clamp_min(1).to(v.dtype), v)
        out[name] = torch.where(trailing(n_valid > 0, v), total / kept, own_est)
    return out


def displacement(trained: Mapping[str, Tensor], anchor: Mapping[str, Tensor], clusters: Tensor) -> Tensor:
    """[M]: |theta_{i,c(i)} after training - before|, how far a round's training moved each row's own model."""
    rows = torch.arange(clusters.shape[0], device=clusters.device)
    sq = torch.zeros(clusters.shape[0], dtype=torch.float64, device=clusters.device)
    for n, v in trained.items():
        sq += (v[rows, clusters] - anchor[n][rows, clusters]).pow(2).reshape(rows.shape[0], -1).sum(1).double()
    return sq.sqrt()
