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

BLOCK_FLOATS = 1 << 25  # parameter values of tested estimates formed at once (128 MiB of float32)

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
    step: dict[str, Tensor] | None = None  # [M, ...]: this round's training step of each row's own model


def budgeted(den: Tensor, budget: float) -> tuple[Tensor, Tensor]:
    """(den', scale) [S, k]: each arrived den clamped to [0, 1] and each message's total to `budget`, and what its num
    is to be multiplied by (den' / den) for the pair to keep its estimate num / den. An honest pair's scale is 1."""
    clean = den.nan_to_num(0.0, 0.0, 0.0).clamp(0.0, 1.0)
    clean = clean * (budget / clean.sum(1, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)
    scale = torch.where(den > 0, clean / den.clamp_min(1e-30), torch.zeros_like(den))
    return clean, scale


def by_cluster(t: Tensor) -> Tensor:
    """[R, k, ...] -> [k, R, F], a view where the layout allows."""
    return t.reshape(t.shape[0], t.shape[1], -1).transpose(0, 1)


def anchor_distances(num: Mapping[str, Tensor], den: Tensor, anchor: Mapping[str, Tensor]) -> Tensor:
    """[M, S, k]: |num[s, j] / den[s, j] - anchor[i, j]| over all of cluster j's tensors, for every row i and message
    s, as (|n|^2 / d^2 + |a|^2 - 2 a.n / d), one batched product over the clusters per tensor: no estimate is formed."""
    inv = 1.0 / den.clamp_min(MIN_WEIGHT).double()  # [S, k]
    sq = torch.zeros(next(iter(anchor.values())).shape[0], *den.shape, dtype=torch.float64, device=den.device)
    for name, a in anchor.items():
        aj, nj = by_cluster(a), by_cluster(num[name].to(a.dtype))  # [k, M, F], [k, S, F]
        cross = torch.bmm(aj, nj.transpose(1, 2)).permute(1, 2, 0).double()  # [M, S, k]: a.n
        n_sq = nj.pow(2).sum(2).T.double()  # [S, k]
        a_sq = aj.pow(2).sum(2).T.double()  # [M, k]
        sq += a_sq.unsqueeze(1) + (n_sq * inv * inv).unsqueeze(0) - 2 * cross * inv.unsqueeze(0)
    return sq.clamp_min(0.0).sqrt()


def message_distances(models: Mapping[str, Tensor], part: Tensor, anchor: Mapping[str, Tensor]) -> Tensor:
    """[M, S]: |models[s] - anchor[i, part[s]]| for every row i and message s (a model of cluster part[s])."""
    m, s = next(iter(anchor.values())).shape[0], part.shape[0]
    sq = torch.zeros(m, s, dtype=torch.float64, device=part.device)
    for name, a in anchor.items():
        x = models[name].reshape(s, -1).to(a.dtype)
        for j in part.unique().tolist():
            cols = (part == j).nonzero().squeeze(1)
            aj, xj = a[:, j].reshape(m, -1), x.index_select(0, cols)
            sq[:, cols] += ((aj * aj).sum(1).unsqueeze(1) + (xj * xj).sum(1).unsqueeze(0) - 2 * aj @ xj.T).double()
    return sq.clamp_min(0.0).sqrt()


def own_cluster_checks(rows: Tensor, flat: Tensor, values: Mapping[str, Tensor], divisor: Tensor | None,
                       screen: Screen, along: bool = True) -> Tensor:
    """[P] bool: the estimates of pairs p of each row `rows[p]`'s own cluster pass the direction and data tests.

    values: name -> [Q, ...] the estimates' numerators, flat [P] the row of each pair's, divisor [Q] their den (None:
    models, no den). Direction: an estimate of the row's own cluster moved from the anchor along, not against, the
    row's own training step (every honest copy was trained on data like the row's from about the same anchor; only
    where `along`); data: screen.test. Formed block by block (BLOCK_FLOATS values at once)."""
    per_pair = sum(v[0].numel() for v in values.values())
    block = max(1, BLOCK_FLOATS // max(1, per_pair))
    ok = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    for lo in range(0, rows.shape[0], block):
        r, f = rows[lo:lo + block], flat[lo:lo + block]
        est = {n: v.index_select(0, f) for n, v in values.items()}
        if divisor is not None:
            d = divisor.index_select(0, f).clamp_min(MIN_WEIGHT)
            est = {n: v / trailing(d.to(v.dtype), v) for n, v in est.items()}
        if along and screen.step is not None:
            moved = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
            for n, v in est.items():
                own = screen.anchor[n][r, screen.clusters[r]]
                moved += ((v - own) * screen.step[n].index_select(0, r)).reshape(r.shape[0], -1).sum(1).double()
            ok[lo:lo + block] &= moved >= 0
        if screen.test is not None:
            ok[lo:lo + block] &= screen.test(r, est)
    return ok


def screened_arrivals(delivered: Tensor, part: Tensor, models: Mapping[str, Tensor], screen: Screen) -> Tensor:
    """[M, S] bool: the one-hop merge's arrivals (message s a model of cluster part[s]) row i keeps: within its
    radius of its anchor of that cluster, and, for its own cluster, passing the data test. Not the direction test:
    between the lean schedule's gossip rounds neighbours' anchors drift apart, and a model's difference from the
    receiver's anchor is that drift as much as the sender's step (measured: it dropped honest models by the
    thousand)."""
    keep = delivered & (message_distances(models, part, screen.anchor) <= screen.radius.unsqueeze(1))
    rows, cols = (keep & (part.unsqueeze(0) == screen.clusters.unsqueeze(1))).nonzero(as_tuple=True)
    if rows.numel():
        keep[rows, cols] = own_cluster_checks(rows, cols, models, None, screen, along=False)
    return keep


def screened_mix(num: dict[str, Tensor], den: Tensor, delivered: Tensor, arrived_num: Mapping[str, Tensor],
                 arrived_den: Tensor, screen: Screen) -> tuple[dict[str, Tensor], Tensor, int]:
    """One screened gossip step for the M hosted rows: (num', den', informative (pair, cluster)s dropped).

    num [M, k, ...], den [M, k]: the rows' pairs; delivered [M, S]: row i received message s; arrived_num
    [S, k, ...], arrived_den [S, k]: the messages (not changed). An arrival of (about) no weight, den <= MIN_WEIGHT, is
    dropped too: it carries no estimate, and its num could carry anything.
    """
    k = den.shape[1]
    clean, scale = budgeted(arrived_den, screen.budget)
    informative = delivered.unsqueeze(2) & (clean > MIN_WEIGHT).unsqueeze(0)  # [M, S, k]
    keep = informative & (anchor_distances(arrived_num, arrived_den, screen.anchor) <= screen.radius.view(-1, 1, 1))
    rows, cols = delivered.nonzero(as_tuple=True)
    own = screen.clusters[rows]
    tested = keep[rows, cols, own]
    if screen.test is not None or screen.step is not None:
        at = tested.nonzero().squeeze(1)
        if at.numel():
            flat = cols[at] * k + own[at]  # the pair's (message, cluster) in [S * k]
            values = {n: v.reshape(-1, *v.shape[2:]) for n, v in arrived_num.items()}
            keep[rows[at], cols[at], own[at]] = own_cluster_checks(rows[at], flat, values, arrived_den.reshape(-1),
                                                                   screen)
    dropped = int((informative & ~keep).sum())
    weight = keep.to(den.dtype)  # [M, S, k]
    divisor = delivered.sum(1).to(den.dtype) + 1
    new_den = (den + (weight * clean.to(den.dtype).unsqueeze(0)).sum(1)) / trailing(divisor, den)
    if screen.trim > 0:
        est = trimmed_estimates(num, den, arrived_num, arrived_den, rows, cols, keep[rows, cols], screen.trim)
        return {n: v * trailing(new_den.to(v.dtype), v) for n, v in est.items()}, new_den, dropped
    mix = (weight * scale.to(den.dtype).unsqueeze(0)).permute(2, 0, 1)  # [k, M, S]: what each arrived num counts for
    out: dict[str, Tensor] = {}
    for n, v in num.items():
        total = torch.bmm(mix.to(v.dtype), by_cluster(arrived_num[n].to(v.dtype)))  # [k, M, F]
        out[n] = (v + total.transpose(0, 1).reshape(v.shape)) / trailing(divisor, v)
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
