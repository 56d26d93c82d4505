"""Screened gossip: one step of ratio consensus, and one-hop merges, that a lying neighbour cannot steer far
(`dfca.screen`, on by default).

Ratio consensus (core.consensus) trusts every (num, den) pair it receives: a sender that claims a huge weight den,
or an estimate num/den far from everyone else's, decides the result alone (one forged pair per step taking a
24-client run from accuracy 0.877 to 0.11). What an honest pair can be is known at the receiver:

- den: the weights m_i (1 for the cluster a client trained, `untrained_weight` for the others) only ever mix, so an
  honest den lies in [0, 1] per cluster and sums to at most budget = 1 + (k - 1) untrained_weight over the k
  clusters. A den outside is clamped, then the pair is scaled down to the budget (num with it: the estimate is kept,
  its weight is not). From a round's second gossip step on, honest dens are mixes that have moved towards each
  other (towards about 1/k), while a liar can keep claiming 1 and outweigh k honest neighbours: an arrival counts
  with at most DEN_CAP x the larger of the receiver's own den and the lower median of the arrived dens of that
  cluster (`capped`).
- the estimate e_sj = num_sj / den_sj: honest copies of cluster j are mixes of models trained from nearby starting
  points, so they lie near each other. Receiver i centres cluster j on its own estimate c_ij (while it holds no weight
  of j: on the medoid of its arrivals of j, or its anchor, last round's model, with fewer than two) and measures that
  cluster's scale s_ij: the lower median of the distances |e_sj - c_ij| of its informative arrivals this step, never
  below r_i = |trained theta_{i,c(i)} - anchor_{i,c(i)}| (how far its own training moved its model), and r_i itself
  where fewer than two arrived. An arrival farther than `radius` x s_ij is dropped (weight 0); at a round's first step,
  where every honest arrival is a model its sender has just trained and their distances are tight, farther than
  FIRST_STEP_RADIUS x `radius`. A minority of liars cannot raise the median; honest neighbours whose models drifted
  apart between consensus rounds raise it together.
- for its own cluster c(i) the receiver also knows the direction training goes and has data: an estimate more than
  BEHIND x max(|step_i|, s_ic(i)) behind its own estimate along its own step is dropped (a lie that undoes training),
  and the mix it would fold is tested on its own samples (`Screen.passes`, the algorithm's loss): where the mix is much
  worse than its anchor, each kept arrival of that cluster is tested alone and the failing ones dropped (the honest mix
  passes, so the data test costs one loss per row and step, not one per arrival).

A dropped arrival counts as (0, 0): the step's divisor (1 + arrivals) is kept, so num and den shrink together and the
estimate num/den is a mix of the accepted copies only. The one-hop merges (`screened_arrivals`) are folded as they
arrive, within a loose bound: `radius` x r_i x `drift` of the row's own model of that cluster, `drift` growing with the
rounds since the last consensus, and, for its own cluster, not BEHIND x drift own steps behind. The tests that need them
all wait for the merge's end (`MergeFolds`): each (row, cluster)'s scale is the lower median of its arrivals' distances
(r_i with fewer than two), as in a gossip step, and an arrival beyond `radius` x that scale is dropped; each arrival of
the row's own cluster is tested alone on its data, and dropped above the row's limit or above MERGE_LOSS_SPREAD x the
median loss of its peers; what a row lost is taken back out of its running average.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dfca.core.ratio import MIN_WEIGHT, trailing
from dfca.core.sparse_factor import GPU_SPARSE_DENSITY, WIDE_ROW_DENSITY, add_product, product_factor

BLOCK_FLOATS = 1 << 25  # parameter values of tested estimates formed at once (128 MiB of float32)
BEHIND = 2.0  # an estimate of the row's own cluster this many own steps behind its own estimate is dropped
FIRST_STEP_RADIUS = 0.8  # a round's first gossip step drops beyond this fraction of the radius
DEN_CAP = 1.0  # from the second step on, a den counts at most this times the row's reference den
MERGE_LOSS_SPREAD = 1.3  # a merge's arrival this many times its kept peers' median loss on the row's data is dropped
# A gossip step's products with the arrivals are taken at the (row, message) pairs that are read alone (CSR) where
# those are at most this share of all pairs, on CPU: on 30 clients of MLP h=200, k=2, at a share of 0.1 / 0.2 / 0.3 /
# 0.5 the distances' products took 0.33 / 0.55 / 0.75 / 1.04 of the dense product's time, the mix 0.39 / 0.56 /
# 0.73 / 1.09 (one thread, the 2-core machine). A sparse graph's steps read about its density of them. On a GPU the
# dense products run near the chip's peak, and the pairs are taken alone (cuSPARSE) where they are at most
# sparse_factor.GPU_SPARSE_DENSITY of all, as a step's mix is: 10 neighbours of 1,000 clients read 0.01 of them, and
# the dense [N, N] products of N = 3,000 clients made a screened round cost three unscreened ones.
SAMPLED_DENSITY = 0.3
# ... for tensors of at least this many values a model: on narrower ones the dense product is faster (30 rows, 10%
# of pairs, one thread: 10 values 0.003 against 0.5 ms, 200 values 0.011 against 0.035 ms; 2,000 values 0.6 against
# 0.16 ms)
SAMPLED_WIDTH = 512
# A sparse product of a step (its mix's CSR factor, its products at the pairs read) is taken whole where its rows hold
# at most this many entries on average, on CPU; beyond, a block of sparse_factor.COLUMN_BLOCK columns at a time, and
# only where at most sparse_factor.WIDE_ROW_DENSITY of it is read (a whole CSR entry reads a whole source row, so
# wide rows of many neighbours go out of cache). The mix: sparse_factor's figures. The products at the pairs read,
# h=200's 156,800 values a row, one thread, cold caches, the products of every pair (per cluster) / at the pairs
# whole / in blocks of 512 columns, ms: N=30, k=2, 4 pairs a row 22 / 10 / 23, 8 a row 20 / 20 / 28; N=60, k=4,
# 9 a row 86 / 80 / 69, 19 a row (density 0.3) 85 / 159 / 101; N=100, k=2, 14 a row 96 / 99 / 70; N=240, k=4,
# 12 a row 784 / 374 / 327, 24 a row 808 / 760 / 551.
WHOLE_ROW_ENTRIES = 12
PAIR_BLOCK = 512  # columns a block of the products at the pairs read takes (their rows: 2 KiB each, in cache)
# A merge's models are multiplied by the anchors and by the steps in one product (`anchors_and_steps`) where the two
# together take at most this much: a copy of them is kept for the round.
FUSED_BYTES = 64 << 20

# (receiver rows [P], their estimates of their own cluster [P, ...]) -> [P] bool: keep the estimate
EstimateTest = Callable[[Tensor, dict[str, Tensor]], Tensor]
# (receiver rows [R], one model, its tensors unbatched) -> [R]: that model's loss on each row's samples
ModelLoss = Callable[[Tensor, dict[str, Tensor]], Tensor]


@dataclass
class Screen:
    """What a receiver screens arrivals against, per hosted row."""

    anchor: dict[str, Tensor]  # [M, k, ...]: the rows' models before this round's training
    reach: Tensor  # [M]: r_i, how far this round's training moved each row's own model (the scale's floor)
    clusters: Tensor  # [M]: each row's own cluster this round (the one it trained)
    budget: float  # an honest message's largest total den: 1 + (k - 1) untrained_weight
    trim: float = 0.0  # > 0: the estimate is the coordinate-wise trimmed mean of what was kept, this cut per end
    step: dict[str, Tensor] | None = None  # [M, ...]: this round's training step of each row's own model
    radius: float = 2.0  # an arrival farther than radius x the row's scale from its centre is dropped
    drift: float = 1.0  # one-hop merges: the scale is r_i x drift (rounds since the clients last agreed, >= 1)
    cached: dict[str, Tensor] = field(default_factory=dict, repr=False)  # what the round's arrivals share, once
    gossip_step: int = 0  # the round's gossip steps taken so far
    loss: EstimateTest | None = None  # [P]: the loss of each estimate of a row's own cluster on that row's samples
    loss_limit: Tensor | None = None  # [M]: the most a row's loss may be for its estimate to pass (`passes`)
    model_loss: ModelLoss | None = None  # one model's `loss` on several rows at once (a merge's arrivals), if given

    @property
    def tested(self) -> bool:
        """Whether estimates of a row's own cluster are tested on its data (the algorithm gave a loss and limits)."""
        return self.loss is not None and self.loss_limit is not None

    def passes(self, rows: Tensor, estimates: dict[str, Tensor]) -> Tensor:
        """[P] bool: the data test, each estimate of row `rows[p]`'s own cluster no worse on that row's samples
        than the row's limit."""
        assert self.loss is not None and self.loss_limit is not None
        return self.loss(rows, estimates) <= self.loss_limit.index_select(0, rows)


def anchor_norms(screen: Screen) -> Tensor:
    """[M, k]: |anchor_ij|^2, taken once a round."""
    if "anchor_sq" not in screen.cached:
        screen.cached["anchor_sq"] = sum((squared_norms(a) for a in screen.anchor.values()),
                                         torch.zeros(screen.clusters.shape[0], 1, dtype=torch.float64,
                                                     device=screen.clusters.device))
    return screen.cached["anchor_sq"]


def training_steps(trained: Mapping[str, Tensor], anchor: Mapping[str, Tensor], clusters: Tensor
                   ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(step, terms): each row's step of its own cluster, trained less anchor [M, ...] (both [M, k, ...], clusters
    [M]), and `step_dots` of them, from the same rows of the anchor (a Screen's `cached`)."""
    start = {n: own_rows(anchor[n], clusters) for n in trained}
    step = {n: own_rows(v, clusters) - start[n] for n, v in trained.items()}
    return step, step_dots(start, step)


def step_dots(start: Mapping[str, Tensor], step: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """What a round's screen takes of its steps once (`step_terms`): "anchor_step", start_i . step_i, and "step_sq",
    |step_i|^2, [M] each (start and step [M, ...]: each row's own cluster's anchor and step)."""
    m = next(iter(step.values())).shape[0]
    dot = torch.zeros(m, dtype=torch.float64, device=next(iter(step.values())).device)
    sq = torch.zeros_like(dot)
    for n, v in step.items():
        flat = v.reshape(m, -1)
        dot += (start[n].reshape(m, -1) * flat).sum(1).double()
        sq += torch.linalg.vector_norm(flat, dim=1).double().pow(2)
    return {"anchor_step": dot, "step_sq": sq}


def step_terms(screen: Screen) -> tuple[Tensor, Tensor]:
    """([M], [M]): anchor_{i,c(i)} . step_i and |step_i|^2, taken once a round (`training_steps` gives them)."""
    assert screen.step is not None
    if "anchor_step" not in screen.cached:
        start = {n: own_rows(a, screen.clusters) for n, a in screen.anchor.items()}
        screen.cached.update(step_dots(start, screen.step))
    return screen.cached["anchor_step"], screen.cached["step_sq"]


def budgeted(den: Tensor, budget: float) -> tuple[Tensor, Tensor]:
    """(den', scale) [S, k]: each arrived den clamped to [0, 1] and each message's total to `budget`, and what its num
    is to be multiplied by (den' / den) for the pair to keep its estimate num / den. An honest pair's scale is 1."""
    clean = den.nan_to_num(0.0, 0.0, 0.0).clamp(0.0, 1.0)
    clean = clean * (budget / clean.sum(1, keepdim=True).clamp_min(1e-12)).clamp(max=1.0)
    scale = torch.where(den > 0, clean / den.clamp_min(1e-30), torch.zeros_like(den))
    return clean, scale


def capped(den: Tensor, clean: Tensor, informative: Tensor, factor: float) -> Tensor:
    """[M, S, k]: the share of each arrival's den a row counts: its den capped at factor x the larger of the row's own
    den and the lower median of the informative arrivals' dens of that cluster."""
    m, s, k = informative.shape
    values = clean.double().unsqueeze(0).expand(m, s, k).transpose(1, 2).reshape(m * k, s)
    valid = informative.transpose(1, 2).reshape(m * k, s)
    some = valid.any(1)
    median = lower_median(values, valid | ~some.unsqueeze(1)).view(m, k)
    limit = factor * torch.maximum(torch.where(some.view(m, k), median, torch.zeros_like(median)), den.double())
    c = clean.double().unsqueeze(0)  # [1, S, k]
    share = torch.minimum(c, limit.unsqueeze(1)) / c.clamp_min(1e-30)
    return torch.where(c > 0, share, torch.ones_like(share))


def by_cluster(t: Tensor) -> Tensor:
    """[R, k, ...] -> [k, R, F], a view where the layout allows."""
    return t.reshape(t.shape[0], t.shape[1], -1).transpose(0, 1)


def taken_alone(pairs: Tensor) -> bool:
    """Whether the pairs [R, S, ...] bool that are read are few enough of all for products at them alone to be
    faster than every pair's (SAMPLED_DENSITY on CPU, GPU_SPARSE_DENSITY on a GPU; on CPU, where a row (each index
    but the second) reads more than WHOLE_ROW_ENTRIES on average, at most WIDE_ROW_DENSITY)."""
    read = int(pairs.sum())
    if pairs.device.type != "cpu":
        return read <= GPU_SPARSE_DENSITY * pairs.numel()
    wide = read > WHOLE_ROW_ENTRIES * (pairs.numel() // max(pairs.shape[1], 1))
    return read <= (min(SAMPLED_DENSITY, WIDE_ROW_DENSITY) if wide else SAMPLED_DENSITY) * pairs.numel()


def pair_products(a: Tensor, b: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """[P] float64: a[rows[p]] . b[cols[p]] (a [R, F], b [C, F]) at P distinct pairs alone, in their order: one
    sampled product (CSR) where the rows are wide (F >= SAMPLED_WIDTH), else every pair's product, read at them.
    The rows of a row-major [R, k, F] as its [R k, F] view are contiguous, which the sampled product needs to take
    them in place (a cluster's [R, F] view is copied first: several times as long, measured). On CPU, where the rows
    of a that are read take more than WHOLE_ROW_ENTRIES pairs each on average, the sampled product is taken a block
    of PAIR_BLOCK columns at a time, its sums added in float64."""
    if a.shape[1] < SAMPLED_WIDTH:
        return (a @ b.T)[rows, cols].double()
    key = rows * b.shape[0] + cols
    order = torch.argsort(key)
    crow = torch.zeros(a.shape[0] + 1, dtype=torch.long, device=a.device)
    crow[1:] = torch.cumsum(torch.bincount(rows, minlength=a.shape[0]), 0)
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the products used are tested (core tests)
        warnings.simplefilter("ignore", UserWarning)
        pattern = torch.sparse_csr_tensor(crow, cols[order], torch.ones(order.shape[0], dtype=a.dtype,
                                                                       device=a.device), (a.shape[0], b.shape[0]))
        wide = a.device.type == "cpu" and rows.shape[0] > WHOLE_ROW_ENTRIES * int((crow[1:] > crow[:-1]).sum())
        if wide and a.shape[1] > PAIR_BLOCK:
            values = torch.zeros(order.shape[0], dtype=torch.float64, device=a.device)
            for start in range(0, a.shape[1], PAIR_BLOCK):
                block = slice(start, start + PAIR_BLOCK)
                values += torch.sparse.sampled_addmm(pattern, a[:, block], b[:, block].T, beta=0.0).values().double()
        else:
            values = torch.sparse.sampled_addmm(pattern, a, b.T, beta=0.0).values()
    out = torch.empty(order.shape[0], dtype=torch.float64, device=a.device)
    out[order] = values.double()
    return out


def flat_rows(v: Tensor) -> Tensor:
    """[R, k, ...] -> [R k, F]: row r's cluster j at row r k + j (a view where v is contiguous)."""
    return v.reshape(v.shape[0] * v.shape[1], -1)


def estimate_distances(num: Mapping[str, Tensor], den: Tensor, own_num: Mapping[str, Tensor], own_den: Tensor,
                       screen: Screen, read: Tensor | None = None) -> Tensor:
    """[M, S, k]: |num[s, j] / den[s, j] - c_ij| over all of cluster j's tensors, for every row i and message s, c_ij
    the row's centre: its own estimate own_num / own_den where it holds weight, else its anchor. As
    (|n|^2 / d^2 + |c|^2 - 2 c.n / d), a product per cluster and tensor (and one with the anchors of the rows that
    hold no weight of the cluster): no estimate is formed. read [M, S, k]: the distances that are read (the others
    are left inexact); where they are few (`taken_alone`), the products are taken at those alone, every cluster's in
    one sampled product per tensor."""
    inv = 1.0 / den.clamp_min(MIN_WEIGHT).double()  # [S, k]
    held = own_den > MIN_WEIGHT  # [M, k]
    own_inv = torch.where(held, 1.0 / own_den.clamp_min(MIN_WEIGHT).double(), torch.zeros_like(own_den).double())
    m, s, k = own_den.shape[0], den.shape[0], den.shape[1]
    cross = torch.zeros(m, s, k, dtype=torch.float64, device=den.device)
    c_sq = torch.where(held, torch.zeros_like(own_inv), anchor_norms(screen))  # the unheld rows': |anchor|^2
    n_sq = torch.zeros(s, k, dtype=torch.float64, device=den.device)
    if read is None:
        read = torch.ones(m, s, k, dtype=torch.bool, device=den.device)
    at_held, at_unheld = read & held.unsqueeze(1), read & ~held.unsqueeze(1)  # [M, S, k]
    alone = taken_alone(read)
    if alone:  # the (i, s, j) triples read, of rows that hold weight of j, and of rows that do not
        held_ix, unheld_ix = at_held.nonzero(as_tuple=True), at_unheld.nonzero(as_tuple=True)
    else:
        some_held, some_unheld = at_held.any(1).any(0).tolist(), at_unheld.any(1).any(0).tolist()  # [k] each
    for name, v in own_num.items():
        n_sq += squared_norms(num[name])
        c_sq += squared_norms(v) * own_inv * own_inv
        if alone:
            x = flat_rows(num[name].to(v.dtype))  # [S k, F]
            i, t, j = held_ix
            if i.numel():
                cross[i, t, j] += pair_products(flat_rows(v), x, i * k + j, t * k + j) * own_inv[i, j]
            i, t, j = unheld_ix
            if i.numel():
                anchor = screen.anchor[name]
                cross[i, t, j] += pair_products(flat_rows(anchor), x.to(anchor.dtype), i * k + j, t * k + j)
            continue
        oj, nj = by_cluster(v), by_cluster(num[name].to(v.dtype))  # [k, M, F], [k, S, F]
        for j in range(k):
            if some_held[j]:
                cross[:, :, j] += (oj[j] @ nj[j].T).double() * own_inv[:, j:j + 1]
            if some_unheld[j]:  # rows without weight of j: their anchor
                rows = (~held[:, j]).nonzero().squeeze(1)
                anchors = screen.anchor[name][:, j].reshape(m, -1).index_select(0, rows)
                cross[rows, :, j] += (anchors @ nj[j].to(anchors.dtype).T).double()
    sq = c_sq.unsqueeze(1) + (n_sq * inv * inv).unsqueeze(0) - 2 * cross * inv.unsqueeze(0)
    return sq.clamp_min(0.0).sqrt()


def squared_norms(v: Tensor) -> Tensor:
    """[R, k]: |v[r, j]|^2 over each (row, cluster)'s values (v [R, k, ...]), with no temporary of v's size."""
    return torch.linalg.vector_norm(v.reshape(v.shape[0], v.shape[1], -1), dim=2).double().pow(2)


def lower_median(values: Tensor, valid: Tensor) -> Tensor:
    """[M]: the lower median of each row's valid values (values, valid [M, W]; every row has one at least)."""
    ordered = values.masked_fill(~valid, math.inf).sort(1).values
    middle = ((valid.sum(1) - 1) // 2).clamp_min(0)
    return ordered.gather(1, middle.unsqueeze(1)).squeeze(1)


def cluster_scales(distance: Tensor, informative: Tensor, reach: Tensor) -> Tensor:
    """[M, k]: each row's scale of each cluster, the lower median of its informative arrivals' distances, never below
    r_i (how far its own training moved it); r_i itself where fewer than two arrived, so one arrival alone does not
    set its own scale. Liars cannot raise it while they are fewer than half its arrivals, and where the copies agree
    (distances at the level of the float noise of |n|^2 + |c|^2 - 2 c.n) the scale is a training step, not that
    noise. Counting r_i among the distances would put the median at the nearest arrival where two or three arrived:
    on sparse graphs, where honest estimates differ most, about 30% of the honest weight would be dropped."""
    m, s, k = distance.shape
    values = distance.transpose(1, 2).reshape(m * k, s)
    valid = informative.transpose(1, 2).reshape(m * k, s)
    several = valid.sum(1) >= 2
    median = lower_median(values, valid | ~several.unsqueeze(1)).view(m, k)
    floor = reach.double().unsqueeze(1).expand(m, k)
    return torch.where(several.view(m, k), torch.maximum(median, floor), floor)


def own_rows(v: Tensor, clusters: Tensor) -> Tensor:
    """[M, ...]: v[i, clusters[i]] of v [M, k, ...], taken as rows of the flat [M k, ...] view (one index_select)."""
    m, k = v.shape[0], v.shape[1]
    index = torch.arange(m, device=v.device) * k + clusters
    return v.reshape(m * k, *v.shape[2:]).index_select(0, index)


def cluster_steps(screen: Screen, name: str) -> list[tuple[int, Tensor, Tensor]]:
    """Per cluster j some row trained: (j, those rows [Mj], their steps of tensor `name` [Mj, F]), taken once a
    round."""
    assert screen.step is not None
    m = screen.clusters.shape[0]
    if "trained" not in screen.cached:
        screen.cached["trained"] = screen.clusters.unique()
    out = []
    for j in screen.cached["trained"].tolist():
        if f"rows.{j}" not in screen.cached:
            screen.cached[f"rows.{j}"] = (screen.clusters == j).nonzero().squeeze(1)
        rows = screen.cached[f"rows.{j}"]
        if f"step.{name}.{j}" not in screen.cached:
            screen.cached[f"step.{name}.{j}"] = screen.step[name].reshape(m, -1).index_select(0, rows)
        out.append((j, rows, screen.cached[f"step.{name}.{j}"]))
    return out


def step_products(values: Mapping[str, Tensor], screen: Screen, read: Tensor) -> Tensor:
    """[M, S]: values[s, c(i)] . step_i for every row i and message s (values [S, k, ...]) that `read` [M, S] holds
    (0 elsewhere): one product per cluster over the rows that trained it, or, where the pairs read are few
    (`taken_alone`), one at those pairs alone."""
    assert screen.step is not None
    m, s = screen.clusters.shape[0], next(iter(values.values())).shape[0]
    out = torch.zeros(m, s, dtype=torch.float64, device=screen.clusters.device)
    if taken_alone(read):
        i, t = read.nonzero(as_tuple=True)
        if not i.numel():
            return out
        k = next(iter(values.values())).shape[1]
        cols = t * k + screen.clusters[i]  # message t's copy of row i's own cluster
        for n, v in values.items():
            step = screen.step[n].reshape(m, -1)
            out[i, t] += pair_products(step, flat_rows(v).to(step.dtype), i, cols)
        return out
    for n, v in values.items():
        clusters = by_cluster(v)  # [k, S, F], a view
        for j, rows, step in cluster_steps(screen, n):
            out[rows] += (step @ clusters[j].to(step.dtype).T).double()
    return out * read


def behind_own_step(num: Mapping[str, Tensor], den: Tensor, own_num: Mapping[str, Tensor], own_den: Tensor,
                    screen: Screen, spread: Tensor, read: Tensor) -> Tensor:
    """[M, S] bool: message s's estimate of row i's own cluster lies more than BEHIND own steps (or BEHIND times the
    cluster's scale `spread` [M], where its copies lie farther apart than a step) behind the row's own estimate
    along its own step: (e - c_i) . step_i < -BEHIND |step_i| max(|step_i|, spread_i) (a row holds weight of its own
    cluster: it trained it). Exact where `read` [M, S] holds."""
    assert screen.step is not None
    rows = torch.arange(screen.clusters.shape[0], device=screen.clusters.device)
    own = screen.clusters
    arrived_den = den[:, own].T.double().clamp_min(MIN_WEIGHT)  # [M, S]
    _, step_sq = step_terms(screen)
    centre_step = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    k = den.shape[1]
    for n, v in own_num.items():  # num_{i,c(i)} . step_i, read in place from the [M k, F] view
        step = screen.step[n].reshape(rows.shape[0], -1)
        centre_step += pair_products(step, flat_rows(v).to(step.dtype), rows, rows * k + own)
    centre_step /= own_den[rows, own].double().clamp_min(MIN_WEIGHT)
    along = step_products(num, screen, read) / arrived_den - centre_step.unsqueeze(1)
    return along < -BEHIND * (step_sq.sqrt() * torch.maximum(step_sq.sqrt(), spread)).unsqueeze(1)


def message_distances(models: Mapping[str, Tensor], part: Tensor, screen: Screen, read: Tensor | None = None
                      ) -> tuple[Tensor, Tensor | None]:
    """([M, S], [M, S] or None): |models[s] - theta_{i,part[s]}| for every row i and message s (a model of cluster
    part[s]), theta_i row i's models as training left them: its anchor, its own cluster moved by its step; and, with
    a step, models[s] . step_i. As |x - a|^2, less 2 (x - a).step - |step|^2 where part[s] is the row's own cluster:
    no model is copied, and one product per tensor with the anchors' [M k, F] view and the steps (in one matrix,
    `anchors_and_steps`, where it is small enough) reads the messages. read [M, S]: the pairs that are read (the
    others are left inexact); where they are few (`taken_alone`), the products are taken at them alone, each message
    with its cluster's anchor."""
    m, s = screen.clusters.shape[0], part.shape[0]
    k = next(iter(screen.anchor.values())).shape[1]
    own = part.unsqueeze(0) == screen.clusters.unsqueeze(1)  # [M, S]
    sq = anchor_norms(screen).index_select(1, part)  # [M, S]: |a_{i,part[s]}|^2
    along = None if screen.step is None else torch.zeros(m, s, dtype=torch.float64, device=part.device)
    alone = read is not None and taken_alone(read)
    if alone:
        assert read is not None
        i, t = read.nonzero(as_tuple=True)
        at_part = i * k + part[t]  # row i's anchor of message t's cluster, in the anchors' [M k, F] view
    pick = part.view(1, 1, s).expand(m, 1, s)
    for name, anchor in screen.anchor.items():
        x = models[name].reshape(s, -1).to(anchor.dtype)
        sq = sq + squared_norms(x.unsqueeze(1)).squeeze(1).unsqueeze(0)
        fused = anchors_and_steps(screen, name) if along is not None else None  # [M k + M, F] or None
        step = None if screen.step is None else screen.step[name].reshape(m, -1).to(x.dtype)
        if not alone:  # a_ij . x_s for every cluster j, and step_i . x_s: in one product where fused
            products = (flat_rows(anchor) if fused is None else fused) @ x.T  # [M k (+ M), S]
            sq -= 2 * products[:m * k].view(m, k, s).gather(1, pick).squeeze(1).double()
            if along is not None and step is not None:
                along += (step @ x.T if fused is None else products[m * k:]).double()
            continue
        if i.numel():  # at the pairs read alone: a message with its cluster's anchor, and with the row's step
            if fused is not None:
                both = pair_products(fused, x, torch.cat([at_part, m * k + i]), torch.cat([t, t]))
                at_anchor, at_step = both[:i.shape[0]], both[i.shape[0]:]
            else:
                at_anchor = pair_products(flat_rows(anchor), x, at_part, t)
                at_step = None if step is None else pair_products(step, x, i, t)
            sq[i, t] -= 2 * at_anchor
            if along is not None and at_step is not None:
                along[i, t] += at_step
    if along is not None:
        anchor_step, step_sq = step_terms(screen)
        moved = along - anchor_step.unsqueeze(1)  # [M, S]: (x - a).step
        sq -= own.double() * (2 * moved - step_sq.unsqueeze(1))
    return sq.clamp_min(0.0).sqrt(), along


def anchors_and_steps(screen: Screen, name: str) -> Tensor | None:
    """[M k + M, F]: tensor `name`'s anchors as the rows of their [M k, F] view, then each row's step, as one matrix,
    so that one product with a merge's models gives both (`message_distances` reads the models once, not twice).
    Taken once a round, where it holds at most FUSED_BYTES (a copy of the anchors: a worker's few rows, not a whole
    large simulation's); else None."""
    anchor = screen.anchor[name]
    if screen.step is None or anchor.numel() * (1 + 1 / anchor.shape[1]) * anchor.element_size() > FUSED_BYTES:
        return None
    key = f"anchors_and_steps.{name}"
    if key not in screen.cached:
        step = screen.step[name].reshape(anchor.shape[0], -1)
        screen.cached[key] = torch.cat([flat_rows(anchor), step.to(anchor.dtype)])
    return screen.cached[key]


def data_checks(rows: Tensor, flat: Tensor, values: Mapping[str, Tensor], divisor: Tensor | None,
                test: EstimateTest) -> Tensor:
    """[P] bool: the estimates of pairs p of each row `rows[p]`'s own cluster pass the data test.

    values: name -> [Q, ...] the estimates' numerators, flat [P] the row of each pair's, divisor [Q] their den (None:
    models, no den). Formed block by block (BLOCK_FLOATS values at once)."""
    per_pair = sum(v[0].numel() for v in values.values())
    block = max(1, BLOCK_FLOATS // max(1, per_pair))
    out: list[Tensor] = []
    for lo in range(0, rows.shape[0], block):
        r, f = rows[lo:lo + block], flat[lo:lo + block]
        est = {n: v.index_select(0, f) for n, v in values.items()}
        if divisor is not None:
            d = divisor.index_select(0, f).clamp_min(MIN_WEIGHT)
            est = {n: v / trailing(d.to(v.dtype), v) for n, v in est.items()}
        out.append(test(r, est))
    return torch.cat(out) if out else torch.ones(0, dtype=torch.bool, device=rows.device)


def models_behind_own_step(along: Tensor, part: Tensor, screen: Screen) -> Tensor:
    """[M, S] bool: model s is of row i's own cluster and lies more than BEHIND own steps behind the row's trained
    model along its step: (x_s - theta_i) . step_i < -BEHIND |step_i|^2, theta_i = anchor + step_i."""
    anchor_step, step_sq = step_terms(screen)
    along = along - (anchor_step + step_sq).unsqueeze(1)
    own = part.unsqueeze(0) == screen.clusters.unsqueeze(1)
    return own & (along < -BEHIND * screen.drift * step_sq.unsqueeze(1))  # drift: the merge's scale, as its radius


def screened_arrivals(delivered: Tensor, part: Tensor, models: Mapping[str, Tensor],
                      screen: Screen) -> tuple[Tensor, Tensor]:
    """([M, S] bool, [M, S]): the one-hop merge's arrivals (message s a model of cluster part[s]) row i folds as they
    arrive, within radius x r_i x drift of its own model of that cluster as training left it and, for its own
    cluster, no more than BEHIND own steps behind it along its own step; and their distances to that model. Each
    arrival is judged alone (they are folded one at a time as they arrive); the tests that need them all wait for
    the merge's end (`MergeFolds`)."""
    distance, along = message_distances(models, part, screen, delivered)  # along [M, S]: x_s . step_i
    keep = delivered & (distance <= (screen.radius * screen.drift * screen.reach).unsqueeze(1))
    if along is not None:
        keep &= ~models_behind_own_step(along, part, screen)
    return keep, distance


@dataclass
class MergeFolds:
    """A one-hop merge's folded arrivals, kept until the merge ends for the tests that need all of them.

    At the end each (row, cluster) has a scale, as in a gossip step: the lower median of its arrivals' distances,
    never below r_i (r_i itself with fewer than two); an arrival farther than radius x that scale is dropped. Each
    arrival of the row's own cluster is then tested alone on its data. The arrivals a row lost are taken back out of
    its running average (`unfold`), as if only the kept ones had arrived. What the merge ends at does not depend on
    how its arrivals were batched."""

    anchor: Mapping[str, Tensor]  # [M, k, ...]: the rows' models before this round's training
    trained: dict[str, Tensor]  # [M, ...]: each row's model of its own cluster as training left it
    weight: Tensor  # [M, k]: the weights the copies carried when the merge opened
    folded: list[tuple[Tensor, Tensor, Mapping[str, Tensor], Tensor]] = field(default_factory=list)
    # each batch's (arrivals [M, S], part [S], the messages' models, distances [M, S])

    def add(self, arrivals: Tensor, part: Tensor, models: Mapping[str, Tensor], distance: Tensor) -> None:
        if bool((arrivals > 0).any()):
            self.folded.append((arrivals, part, models, distance))

    def settle(self, params: dict[str, Tensor], weight: Tensor, screen: Screen) -> int:
        """Drops what the merge's end tests fail, taking them back out of the copies (params and weight in place).
        Returns how many arrivals were dropped. The batches' arrivals are judged together (one scale per row and
        cluster); their models are read where they arrived, batch by batch, never copied into one tensor."""
        if not self.folded:
            return 0
        arrivals = torch.cat([a for a, _, _, _ in self.folded], 1)  # [M, S]
        part = torch.cat([p for _, p, _, _ in self.folded])
        distance = torch.cat([d for _, _, _, d in self.folded], 1)
        models = [m for _, _, m, _ in self.folded]
        arrived = arrivals > 0
        k = self.weight.shape[1]
        informative = arrived.unsqueeze(2) & torch.nn.functional.one_hot(part, k).bool().unsqueeze(0)  # [M, S, k]
        scales = cluster_scales(distance.unsqueeze(2).expand(-1, -1, k), informative, screen.reach)  # [M, k]
        keep = arrived & (distance <= screen.radius * scales.gather(1, part.unsqueeze(0).expand_as(distance)))
        if screen.tested:
            keep &= ~worse_on_data(keep & (part.unsqueeze(0) == screen.clusters.unsqueeze(1)), models, screen)
        lost = arrived & ~keep
        self.unfold(params, weight, arrivals * lost.to(arrivals.dtype), part, models, screen.clusters)
        return int(lost.sum())

    def unfold(self, params: dict[str, Tensor], weight: Tensor, lost: Tensor, part: Tensor,
               models: Sequence[Mapping[str, Tensor]], own: Tensor) -> None:
        """Takes the arrivals `lost` [M, S] (their weights, 0 for the others; part [S] their clusters; models: the
        batches' models, whose messages are the columns of `lost` in order) back out of the running averages, in
        place: eq. 8's average c theta = w theta_0 + sum_s a_s x_s less the lost ones, theta <- (c theta - sum_lost
        a_s x_s) / (c - sum_lost a_s), with c the weight each copy carries (`weight`, updated too). Only the lost
        messages' models are read. A copy left with no weight (its own copy counted 0 and every arrival was lost)
        goes back to where the merge opened: its anchor, or for the row's own cluster (own [M]) its trained model.
        The same average as folding the kept ones alone, to float rounding, however the arrivals were batched."""
        r, s = lost.nonzero(as_tuple=True)  # the lost (row, message) pairs
        if not r.numel():
            return
        k = weight.shape[1]
        copy = r * k + part[s]  # each pair's copy, a row of the [M k, ...] view
        copies, which = copy.unique(return_inverse=True)  # [C]: the copies that lose something
        rows, clusters = copies // k, copies % k
        messages, column = s.unique(return_inverse=True)  # [L]: the lost messages
        taken = torch.zeros(copies.shape[0], messages.shape[0], dtype=weight.dtype, device=weight.device)
        taken[which, column] = lost[r, s].to(weight.dtype)  # [C, L]: a_s of each lost message at each copy
        c = weight.reshape(-1).index_select(0, copies)  # [C]: the weight each copy carries
        left = (c - taken.sum(1)).clamp_min(0.0)
        emptied = left <= 1e-6 * c.clamp_min(1.0)  # nothing kept where the own copy counted 0
        own_copy = clusters == own.index_select(0, rows)
        any_emptied = bool(emptied.any())
        for n, v in params.items():
            flat = v.view(-1, *v.shape[2:])  # [M k, ...]: the copies, in place
            x = picked_models(models, n, messages).reshape(messages.shape[0], -1).to(v.dtype)  # [L, F]
            total = flat.index_select(0, copies).reshape(copies.shape[0], -1) * c.to(v.dtype).unsqueeze(1)
            total.sub_(taken.to(v.dtype) @ x)  # c theta less the lost arrivals
            kept = total / left.clamp_min(1e-12).to(v.dtype).unsqueeze(1)
            if any_emptied:
                trained = self.trained[n].index_select(0, rows).reshape(rows.shape[0], -1)
                anchor = flat_rows(self.anchor[n]).index_select(0, copies)
                opened = torch.where(own_copy.unsqueeze(1), trained, anchor).to(v.dtype)  # where the merge opened
                kept = torch.where(emptied.unsqueeze(1), opened, kept)
            flat.index_copy_(0, copies, kept.view(-1, *v.shape[2:]))
        weight.view(-1).index_copy_(0, copies, left.to(weight.dtype))


def picked_models(batches: Sequence[Mapping[str, Tensor]], name: str, columns: Tensor) -> Tensor:
    """[L, ...]: tensor `name` of the messages at the sorted `columns` [L] among the batches' (in order), a copy of
    those alone."""
    out = []
    for span, batch in batch_columns(batches):
        index = columns[(columns >= span.start) & (columns < span.stop)]
        if index.numel():
            out.append(batch[name].index_select(0, index - span.start))
    return torch.cat(out)


def batch_columns(batches: Sequence[Mapping[str, Tensor]]) -> list[tuple[slice, Mapping[str, Tensor]]]:
    """Each batch of messages' tensors ([S_b, ...] each) with its columns among all of them, in order."""
    out, at = [], 0
    for batch in batches:
        size = next(iter(batch.values())).shape[0]
        out.append((slice(at, at + size), batch))
        at += size
    return out


def worse_on_data(own: Tensor, models: Sequence[Mapping[str, Tensor]], screen: Screen) -> Tensor:
    """[M, S] bool: the arrivals `own` [M, S] of each row's own cluster (message s's model in the batches `models`,
    whose messages are the columns in order) whose loss on the row's samples is above the row's limit, or above
    MERGE_LOSS_SPREAD times the lower median of the losses of those within it. With the screen's `model_loss`, a
    model is read once and tested on the samples of every row that received it together (one large product in place
    of a small one per row, and no copy of the model per row: at 100 clients of h=200 a merge's tests took 0.26 in
    place of 0.37 s); else each (row, model) pair is formed and tested (`data_checks`)."""
    assert screen.loss is not None and screen.loss_limit is not None
    losses = torch.full(own.shape, math.inf, dtype=torch.float64, device=own.device)
    for columns, batch in batch_columns(models):
        if screen.model_loss is not None:  # each message once, on the samples of every row that tests it together
            for c in own[:, columns].any(0).nonzero().squeeze(1).tolist():
                rows = own[:, columns.start + c].nonzero().squeeze(1)
                losses[rows, columns.start + c] = screen.model_loss(rows, {n: v[c] for n, v in batch.items()}).double()
            continue
        r, c = own[:, columns].nonzero(as_tuple=True)
        if r.numel():
            losses[r, c + columns.start] = data_checks(r, c, batch, None, screen.loss).double()
    worse = own & (losses > screen.loss_limit.double().unsqueeze(1))
    peers = own & ~worse
    some = peers.any(1)
    median = lower_median(losses, peers | ~some.unsqueeze(1))  # rows with none: no arrival is left to test
    return worse | (peers & (losses > MERGE_LOSS_SPREAD * median.unsqueeze(1)))


def mixed(num: Mapping[str, Tensor], den: Tensor, delivered: Tensor, arrived_num: Mapping[str, Tensor],
          clean: Tensor, scale: Tensor, keep: Tensor, cap: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor]:
    """(num', den'): own + the kept arrivals (den clamped to the budget, num scaled with it), over 1 + arrivals;
    cap [M, S, k]: what each kept pair counts for at that row (its den capped), 1 where None."""
    weight = keep.to(den.dtype) if cap is None else keep.to(den.dtype) * cap.to(den.dtype)  # [M, S, k]
    divisor = delivered.sum(1).to(den.dtype) + 1
    new_den = (den + (weight * clean.to(den.dtype).unsqueeze(0)).sum(1)) / trailing(divisor, den)
    # [k, M, S]: what each arrived num counts for, over the divisor; CSR where few are non-zero, taken in column
    # blocks where its rows hold many (SAMPLED_DENSITY, WHOLE_ROW_ENTRIES)
    mix = (weight * scale.to(den.dtype).unsqueeze(0)).permute(2, 0, 1) / divisor.view(1, -1, 1)
    factors = [product_factor(mix[j], SAMPLED_DENSITY, WHOLE_ROW_ENTRIES) for j in range(mix.shape[0])]
    out: dict[str, Tensor] = {}
    for n, v in num.items():  # (own + mix @ arrived) / divisor, summed in place through the clusters' views [M, F]
        total = v / trailing(divisor.to(v.dtype), v)
        own, arrived = by_cluster(total), by_cluster(arrived_num[n].to(v.dtype))
        for j, factor in enumerate(factors):
            add_product(own[j], factor.to(v.dtype), arrived[j], WHOLE_ROW_ENTRIES)
        out[n] = total
    return out, new_den


def pairwise_distances(num: Mapping[str, Tensor], den: Tensor, j: int, among: Tensor) -> Tensor:
    """[C, C]: |e_sj - e_tj| between the estimates of cluster j of the messages `among` [C], from their Gram matrix."""
    inv = 1.0 / den.index_select(0, among)[:, j].clamp_min(MIN_WEIGHT).double()
    gram = torch.zeros(among.shape[0], among.shape[0], dtype=torch.float64, device=den.device)
    for v in num.values():
        x = v[among, j].reshape(among.shape[0], -1)  # [C, F]: the only copy
        gram += (x @ x.T).double()
    sq = gram * inv.unsqueeze(0) * inv.unsqueeze(1)
    norms = sq.diagonal()
    return (norms.unsqueeze(0) + norms.unsqueeze(1) - 2 * sq).clamp_min(0.0).sqrt()


def medoid_centred(distance: Tensor, informative: Tensor, den: Tensor, arrived_num: Mapping[str, Tensor],
                   arrived_den: Tensor) -> Tensor:
    """distance [M, S, k] with a row that holds no weight of cluster j (it did not train it) centred, for that
    cluster, on the medoid of its informative arrivals (the arrival nearest all the others and its anchor) in place
    of its anchor: honest copies moved from the anchor together, so a lie that moved the other way (or drifted) is
    far from them, where from the anchor it looked as near as they did. Rows with fewer than two such arrivals keep
    their anchor. Only the messages informative of j for some such row are compared (the others carry no weight of
    j: their distances are never read)."""
    unheld = (den <= MIN_WEIGHT) & (informative.sum(1) >= 2)  # [M, k]
    if not unheld.any():
        return distance
    distance = distance.clone()
    for j in unheld.any(0).nonzero().squeeze(1).tolist():
        rows = unheld[:, j].nonzero().squeeze(1)
        member = informative[rows, :, j]  # [U, S]
        among = member.any(0).nonzero().squeeze(1)  # [C]
        between = pairwise_distances(arrived_num, arrived_den, j, among)  # [C, C]
        member = member.index_select(1, among)  # [U, C]
        to_anchor = distance[rows, :, j].index_select(1, among)
        total = member.double() @ between + to_anchor  # to the other arrivals, and to the anchor
        medoid = total.masked_fill(~member, math.inf).argmin(1)  # [U]
        distance[rows.unsqueeze(1), among.unsqueeze(0), j] = between.index_select(0, medoid)
    return distance


def screened_mix(num: dict[str, Tensor], den: Tensor, delivered: Tensor, arrived_num: Mapping[str, Tensor],
                 arrived_den: Tensor, screen: Screen) -> tuple[dict[str, Tensor], Tensor, int]:
    """One screened gossip step for the M hosted rows: (num', den', informative (pair, cluster)s dropped).

    num [M, k, ...], den [M, k]: the rows' pairs; delivered [M, S]: row i received message s; arrived_num
    [S, k, ...], arrived_den [S, k]: the messages (not changed). An arrival of (about) no weight, den <= MIN_WEIGHT, is
    dropped too: it carries no estimate, and its num could carry anything.
    """
    m, k = den.shape
    clean, scale = budgeted(arrived_den, screen.budget)
    informative = delivered.unsqueeze(2) & (clean > MIN_WEIGHT).unsqueeze(0)  # [M, S, k]
    distance = estimate_distances(arrived_num, arrived_den, num, den, screen, informative)  # [M, S, k]
    distance = medoid_centred(distance, informative, den, arrived_num, arrived_den)
    scales = cluster_scales(distance, informative, screen.reach)  # [M, k]
    radius = screen.radius * (FIRST_STEP_RADIUS if screen.gossip_step == 0 else 1.0)
    keep = informative & (distance <= radius * scales.unsqueeze(1))
    rows = torch.arange(m, device=den.device)
    if screen.step is not None:
        keep[rows, :, screen.clusters] &= ~behind_own_step(arrived_num, arrived_den, num, den, screen,
                                                           scales[rows, screen.clusters],
                                                           informative[rows, :, screen.clusters])
    cap = capped(den, clean, informative, DEN_CAP) if screen.gossip_step > 0 else None
    out, new_den = mixed(num, den, delivered, arrived_num, clean, scale, keep, cap)
    if screen.tested:
        keep, out, new_den = data_screened(num, den, delivered, arrived_num, arrived_den, clean, scale, keep, screen,
                                           out, new_den, cap)
    dropped = int((informative & ~keep).sum())
    if screen.trim > 0:
        rows_, cols = delivered.nonzero(as_tuple=True)
        est = trimmed_estimates(num, den, arrived_num, arrived_den, rows_, cols, keep[rows_, cols], screen.trim)
        return {n: v * trailing(new_den.to(v.dtype), v) for n, v in est.items()}, new_den, dropped
    return out, new_den, dropped


def data_screened(num: Mapping[str, Tensor], den: Tensor, delivered: Tensor, arrived_num: Mapping[str, Tensor],
                  arrived_den: Tensor, clean: Tensor, scale: Tensor, keep: Tensor, screen: Screen,
                  out: dict[str, Tensor], new_den: Tensor, cap: Tensor | None = None
                  ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """(keep, num', den'): the mix (out, new_den) of `keep`, tested on each row's data for its own cluster; in the
    rows whose mix fails, each kept arrival of that cluster is tested alone, the failing ones dropped, and the mix
    made again (one loss per row, and per arrival only where a liar hides)."""
    rows = torch.arange(den.shape[0], device=den.device)
    own = screen.clusters
    mix_den = new_den[rows, own]
    held = mix_den > MIN_WEIGHT
    estimate = {n: own_rows(v, own).div_(trailing(mix_den.clamp_min(MIN_WEIGHT).to(v.dtype), v[:, 0]))
                for n, v in out.items()}  # own_rows copies: divided in place
    failing = rows[held & ~screen.passes(rows, estimate)]
    if not failing.numel():
        return keep, out, new_den
    k = den.shape[1]
    sub = keep[failing, :, own[failing]]  # [F, S]
    fr, cols = sub.nonzero(as_tuple=True)
    if not fr.numel():
        return keep, out, new_den
    r = failing[fr]
    values = {n: v.reshape(-1, *v.shape[2:]) for n, v in arrived_num.items()}
    keep = keep.clone()
    keep[r, cols, own[r]] = data_checks(r, cols * k + own[r], values, arrived_den.reshape(-1), screen.passes)
    return keep, *mixed(num, den, delivered, arrived_num, clean, scale, keep, cap)


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
