"""Ratio consensus of trained cluster models: IFCA's per-cluster average, reached by gossip.

For cluster j, with m_ij the weight of client i's copy (1 when it trained j this round):

    num_j <- P^G (m_j * theta_j),   den_j <- P^G m_j,   theta_ij <- num_ij / den_ij   (where den_ij > MIN_WEIGHT)

P = (A + I) row-normalised is one gossip step over the closed neighbourhood: each client averages its
own and its neighbours' (num, den) pairs, (own + sum of arrived) / (1 + arrivals). As G grows, num/den
tends to the network-wide mean of the trained copies: exactly what IFCA's server computes. A client that
no trained copy of j has reached (den = 0) keeps its own theta_ij.

Two forms of the same state, one per kind of driver:
- `WalkConsensus` (a driver that hosts every client and delivers each step as one [N, N] mask, the
  simulator) multiplies the G step matrices into one walk and touches the parameters once, or on large sparse
  graphs (where the walk is dense and a step is not) applies the G sparse steps to each block of the parameters;
  `RoundedWalkConsensus` does the latter always, where the wire rounds each step's messages (the walk does not
  compose then);
- `StepConsensus` (the message driver, and the simulator where payloads are rounded on the wire) keeps num
  and den of its clients, adds what arrives and mixes at the end of each step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from dfca.core import sparse_factor
from dfca.core.params import cluster_views
from dfca.core.ratio import MIN_WEIGHT, ratio_estimate, trailing
from dfca.core.screened_gossip import Screen, screened_mix
from dfca.models.batched import Params


def gossip_matrix(delivered: Tensor) -> Tensor:
    """One gossip step: P = (A + I) row-normalised, A[i, m] = i hears from m."""
    a = delivered.float() + torch.eye(delivered.shape[0], device=delivered.device)
    return a / a.sum(1, keepdim=True)


def consensus_weights(assigned: Tensor, k: int, untrained_weight: float) -> Tensor:
    """m [M, k]: 1 for the cluster a client trained this round, `untrained_weight` for the others.

    A small untrained weight lets every cluster reach every client, so clusters nobody trained
    are averaged too; without it, DFCA-LI can keep k different random copies of an untrained
    cluster that then lose every assignment (cluster collapse, measured on BA graphs).
    """
    one_hot = torch.nn.functional.one_hot(assigned, k).float()
    return one_hot + untrained_weight * (1.0 - one_hot)


def source_weights(seed: int, num_clients: int, k: int, clients: Tensor) -> Tensor:
    """m [M, k]: 1 where client i is cluster j's seeded source of the initial model, else 0 (with these
    weights num/den is exactly the source's model wherever it arrives)."""
    g = torch.Generator().manual_seed(seed * 31 + 13)
    sources = torch.randperm(num_clients, generator=g)[:k].to(clients.device)
    return (clients.unsqueeze(1) == sources.unsqueeze(0)).float()


@torch.no_grad()
def ratio_consensus(params: Params, trained: Tensor, walk: Tensor) -> None:
    """In place, for every cluster j: theta_j <- W (m_j theta_j) / W m_j where W m_j > MIN_WEIGHT.

    trained [N, k]: the weights m; walk [N, N]: the product P_G ... P_1 of the G gossip steps.
    """
    for j in range(trained.shape[1]):
        m = trained[:, j].float()
        src = m.nonzero().squeeze(1)  # only copies with weight enter num: about N/k columns, not N
        den = walk[:, src] @ m[src]
        reached = den > MIN_WEIGHT  # a trained copy reached the client; the others keep their own
        if not reached.any():
            continue
        coeff = walk[:, src] * m[src].unsqueeze(0) / den.clamp_min(MIN_WEIGHT).unsqueeze(1)  # num/den as [N, S]
        coeff[~reached] = 0.0
        keep = (~reached).float().unsqueeze(1)
        for view in cluster_views(params, j):
            trained_copies = view.index_select(0, src)  # before the in-place update below
            view.mul_(keep).addmm_(coeff, trained_copies)


Step = tuple[Tensor, Tensor]  # a step's A [N, N] (float, dense or CSR) and 1 + each client's arrivals [N]


def gossip_step(delivered: Tensor) -> Step:
    """A step's delivery mask as the factor of its products (CSR where it is sparse enough) and its divisor."""
    a = delivered.float()
    return sparse_factor.product_factor(a), a.sum(1) + 1


@torch.no_grad()
def stepwise_consensus(params: Params, trained: Tensor, steps: list[Step],
                       rounding: Callable[[Tensor, Tensor], Tensor] | None, block_bytes: int) -> None:
    """In place: every client's ratio consensus over `steps` (gossip_step: A_s [N, N] and 1 + deg_s), what
    is sent rounded by `rounding` (None: sent exactly), block by block of rows of each parameter's last dimension:
    num <- (num + A_s sent(num)) / (1 + deg_s), den likewise but exact; num/den where den > MIN_WEIGHT, else the
    client's own copy. Rows of a parameter never mix, so a block goes through all G steps at once and the memory is
    the parameters and two blocks."""
    n = trained.shape[0]
    den = trained.clone()
    for a, scale in steps:
        den = den.addmm(a, den).div_(trailing(scale, den))
    reached, den = den > MIN_WEIGHT, den.clamp_min(MIN_WEIGHT)
    blocks = [own for v in params.values() for own in parameter_blocks(v, block_bytes)]
    buffers = torch.empty(2, max(own.numel() for own in blocks), device=trained.device)  # num, sent
    # The first step's messages: cluster j's num is zero but at the clients that trained it (weight 0 for the
    # others, as the default schedule has it); what they send is zero too, so only those rows enter the product.
    weighted = [trained[:, j].nonzero().squeeze(1) for j in range(trained.shape[1])]
    first: list[Tensor] | None = None
    if steps and sum(len(rows) for rows in weighted) * 2 <= trained.numel():
        first = [sparse_factor.product_factor(sparse_factor.columns(steps[0][0], rows)) for rows in weighted]
    for own in blocks:
        num, sent = (b[: own.numel()].view(own.shape) for b in buffers)  # reused: no new pages for every block
        torch.mul(own, trailing(trained, own), out=num)
        for step, (a, scale) in enumerate(steps):
            if rounding is None:
                sent.copy_(num)
            else:
                rounding(num, sent)
            if step == 0 and first is not None:
                for j, rows in enumerate(weighted):
                    if len(rows):
                        num[:, j].view(n, -1).addmm_(first[j], sent[rows, j].reshape(len(rows), -1))
            else:
                num.view(n, -1).addmm_(a, sent.view(n, -1))
            num.div_(trailing(scale, num))
        own.copy_(torch.where(trailing(reached, own), num.div_(trailing(den, own)), own, out=num))


def parameter_blocks(v: Tensor, block_bytes: int) -> list[Tensor]:
    """Views of v [N, k, ...] that the wire rounds apart: blocks of rows of its last dimension, [N, k, r, C] of
    at most block_bytes; a [N, k] tensor is one block (a message carries its k values as one row)."""
    if v.dim() == 2:
        return [v]
    rows = v.view(v.shape[0], v.shape[1], -1, v.shape[-1])
    step = max(1, block_bytes // (rows.shape[0] * rows.shape[1] * rows.shape[3] * rows.element_size()))
    return [rows[:, :, lo : lo + step] for lo in range(0, rows.shape[2], step)]


def steps_are_cheaper(steps: list[Step], trained: Tensor, params: Params) -> bool:
    """Whether G products with the step masks (sparse ones at SPARSE_ENTRY_COST a stored entry) cost fewer
    multiply-adds than the walk: its G [N, N] products and the product of its columns that carry weight with the
    models."""
    n, k = trained.shape
    per_cluster = sum(v[0, 0].numel() for v in params.values())
    stepwise = sum(sparse_factor.SPARSE_ENTRY_COST * a._nnz() if a.layout != torch.strided else n * n for a, _ in steps)
    walk = len(steps) * n**3 + n * int((trained != 0).sum()) * per_cluster
    return stepwise * k * per_cluster < walk


class WalkConsensus:
    """The whole graph's consensus round, each step's mask kept as it is received. At the end either the G step
    matrices are multiplied into one walk and the parameters touched once (ratio_consensus), or, where that costs
    more (large sparse graphs: the walk is dense, a step is not), the steps are applied one by one
    (stepwise_consensus, exact)."""

    # stepwise: one block of num, all clients and clusters. On a CPU a few MB, which stay in cache through the G
    # steps (and make sparse steps' CSR products cheaper: sparse_factor); on a GPU larger blocks, fewer
    # kernel launches.
    BLOCK_BYTES = 4 << 20
    GPU_BLOCK_BYTES = 64 << 20

    def __init__(self, trained: Tensor) -> None:
        self.trained = trained
        self.steps: list[Step] = []

    def outgoing(self) -> dict[str, Tensor]:
        return {}  # every client is hosted here: nothing is sent but the mask

    def receive(self, delivered: Tensor, tensors: object) -> int:
        self.steps.append(gossip_step(delivered))
        return int(delivered.sum())

    def step(self) -> None:
        """Each step's mask was kept when it was received."""

    @property
    def block_bytes(self) -> int:
        return self.BLOCK_BYTES if self.trained.device.type == "cpu" else self.GPU_BLOCK_BYTES

    @property
    def walk(self) -> Tensor:
        """P_G ... P_1, P_s = (A_s + I) row-normalised."""
        walk = torch.eye(self.trained.shape[0], device=self.trained.device)
        for a, _ in self.steps:
            walk = gossip_matrix(a.to_dense() if a.layout != torch.strided else a) @ walk
        return walk

    def finish(self, params: Params) -> None:
        if steps_are_cheaper(self.steps, self.trained, params):
            stepwise_consensus(params, self.trained, self.steps, None, self.block_bytes)
        else:
            ratio_consensus(params, self.trained, self.walk)


class RoundedWalkConsensus(WalkConsensus):
    """The whole graph's consensus round when the wire rounds what is sent (8-bit or 16-bit payloads): the
    arithmetic of StepConsensus on every client, step by step, done at the end of the round block by block
    (stepwise_consensus: the memory is the parameters and two blocks, where StepConsensus holds num and the
    rounded messages besides, two more copies of every client's k models)."""

    def __init__(self, trained: Tensor, rounding: Callable[[Tensor, Tensor], Tensor]) -> None:
        """rounding(x, out): x as the wire delivers it, written into out (a tensor of x's shape)."""
        super().__init__(trained)
        self.rounding = rounding

    def finish(self, params: Params) -> None:
        stepwise_consensus(params, self.trained, self.steps, self.rounding, self.block_bytes)


class StepConsensus:
    """The hosted clients' num = m theta and den = m, mixed step by step from the messages that arrive.

    With a `screen` (`dfca.screen`, core.screened_gossip) the arrivals of a step are kept until it ends, then
    screened and mixed; without, they are added to num and den as they arrive (no second copy of num: what this
    client sent in the step was read or encoded before anything arrived) and the step divides by 1 + arrivals."""

    def __init__(self, params: Params, trained: Tensor, screen: Screen | None = None) -> None:
        self.num = {n: v * trailing(trained, v) for n, v in params.items()}  # [M, k, ...]
        self.den = trained.clone()  # [M, k]
        self.screen = screen
        self.dropped = 0  # informative (arrival, cluster) pairs the screen dropped, over the round
        self.degree = torch.zeros(self.den.shape[0], device=self.den.device)  # arrivals at each row this step
        self.arrivals: list[tuple[Tensor, dict[str, Tensor], Tensor]] = []

    def outgoing(self) -> dict[str, Tensor]:
        return {**{f"num.{n}": v for n, v in self.num.items()}, "den": self.den}

    def receive(self, delivered: Tensor, tensors: Mapping[str, Tensor]) -> int:
        """delivered [M, S]: row i got message s, whose (num, den) are tensors['num.<p>'] and tensors['den']."""
        if self.screen is not None:
            self.arrivals.append((delivered, {n: tensors[f"num.{n}"] for n in self.num}, tensors["den"]))
            return int(delivered.sum())
        rows = delivered.any(1).nonzero().squeeze(1)  # only they change: one message touches one row
        every_row = rows.numel() == delivered.shape[0]  # (the simulator): sum in place on the whole tensors
        a = delivered.float() if every_row else delivered[rows].float()
        for n, v in self.num.items():
            src = tensors[f"num.{n}"].reshape(a.shape[1], -1).to(v.dtype)
            if src.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
                src = src.clone()  # this step's outgoing num itself, read before it changes below
            if every_row:
                v.view(a.shape[0], -1).addmm_(a, src)
            else:
                v.index_add_(0, rows, (a @ src).reshape(-1, *v.shape[1:]))
        den = a @ tensors["den"].to(self.den.dtype)
        if every_row:
            self.den.add_(den)
            self.degree.add_(a.sum(1))
        else:
            self.den.index_add_(0, rows, den)
            self.degree.index_add_(0, rows, a.sum(1))
        return int(delivered.sum())

    def step(self) -> None:
        """(own + sum of arrived) / (1 + arrivals): one gossip step of P (screened, with a `screen`)."""
        if self.screen is not None:
            if self.arrivals:
                delivered, nums, dens = self.arrivals[0]
                if len(self.arrivals) > 1:  # the message driver's arrivals, taken together
                    delivered = torch.cat([d for d, _, _ in self.arrivals], dim=1)
                    nums = {n: torch.cat([a[n] for _, a, _ in self.arrivals]) for n in self.num}
                    dens = torch.cat([d for _, _, d in self.arrivals])
                self.num, self.den, dropped = screened_mix(self.num, self.den, delivered, nums, dens, self.screen)
                self.dropped += dropped
            self.screen.gossip_step += 1
            self.arrivals = []
            return
        scale = self.degree + 1  # in place: what outgoing() handed out was read by the step's receivers already
        for v in self.num.values():
            v.div_(trailing(scale, v))
        self.den.div_(trailing(scale, self.den))
        self.degree.zero_()

    def finish(self, params: Params) -> None:
        for n, v in params.items():
            v.copy_(ratio_estimate(self.num[n], self.den, v))
