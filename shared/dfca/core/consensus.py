"""Ratio consensus of trained cluster models: IFCA's per-cluster average, reached by gossip.

For cluster j, with m_ij the weight of client i's copy (1 when it trained j this round):

    num_j <- P^G (m_j * theta_j),   den_j <- P^G m_j,   theta_ij <- num_ij / den_ij   (where den_ij > MIN_WEIGHT)

P = (A + I) row-normalised is one gossip step over the closed neighbourhood: each client averages its
own and its neighbours' (num, den) pairs, (own + sum of arrived) / (1 + arrivals). As G grows, num/den
tends to the network-wide mean of the trained copies: exactly what IFCA's server computes. A client that
no trained copy of j has reached (den = 0) keeps its own theta_ij.

Two forms of the same state, one per kind of driver:
- `WalkConsensus` (a driver that hosts every client and delivers each step as one [N, N] mask, the
  simulator) multiplies the G step matrices into one walk and touches the parameters once;
- `StepConsensus` (the message driver) keeps num and den of its clients, sums what arrives and mixes
  at the end of each step.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dfca.core.params import cluster_views
from dfca.core.ratio import MIN_WEIGHT, ratio_estimate, trailing
from dfca.core.screened_gossip import Screen, screened_mix
from dfca.models import Params


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


class WalkConsensus:
    """The whole graph's consensus round: each step's mask becomes a matrix of the walk."""

    def __init__(self, trained: Tensor) -> None:
        self.trained = trained
        self.walk = torch.eye(trained.shape[0], device=trained.device)

    def outgoing(self) -> dict[str, Tensor]:
        return {}  # every client is hosted here: nothing is sent but the mask

    def receive(self, delivered: Tensor, tensors: object) -> int:
        self.walk = gossip_matrix(delivered) @ self.walk
        return int(delivered.sum())

    def step(self) -> None:
        """Each step's matrix entered the walk when it was received."""

    def finish(self, params: Params) -> None:
        ratio_consensus(params, self.trained, self.walk)


class StepConsensus:
    """The hosted clients' num = m theta and den = m, mixed step by step from the messages that arrive.

    With a `screen` (`dfca.screen`, core.screened_gossip) the arrivals of a step are kept until it ends, then
    screened and mixed; without, they are summed as they arrive."""

    def __init__(self, params: Params, trained: Tensor, screen: Screen | None = None) -> None:
        self.num = {n: v * trailing(trained, v) for n, v in params.items()}  # [M, k, ...]
        self.den = trained.clone()  # [M, k]
        self.screen = screen
        self.dropped = 0  # informative (arrival, cluster) pairs the screen dropped, over the round
        self.num_sum = {n: torch.zeros_like(v) for n, v in self.num.items()}
        self.den_sum = torch.zeros_like(self.den)
        self.degree = torch.zeros(self.den.shape[0], device=self.den.device)
        self.arrivals: list[tuple[Tensor, dict[str, Tensor], Tensor]] = []

    def _clear(self) -> None:
        """Empty the step's sums, in place (the buffers are as large as the models: kept, not reallocated)."""
        for v in self.num_sum.values():
            v.zero_()
        self.den_sum.zero_()
        self.degree.zero_()
        self.arrivals = []

    def outgoing(self) -> dict[str, Tensor]:
        return {**{f"num.{n}": v for n, v in self.num.items()}, "den": self.den}

    def receive(self, delivered: Tensor, tensors: Mapping[str, Tensor]) -> int:
        """delivered [M, S]: row i got message s, whose (num, den) are tensors['num.<p>'] and tensors['den']."""
        if self.screen is not None:
            self.arrivals.append((delivered, {n: tensors[f"num.{n}"] for n in self.num}, tensors["den"]))
            return int(delivered.sum())
        rows = delivered.any(1).nonzero().squeeze(1)  # only they change: one message touches one row
        if rows.numel() == delivered.shape[0]:  # every row got something (the simulator): sum in place
            a = delivered.float()
            for n, v in self.num_sum.items():
                v.view(a.shape[0], -1).addmm_(a, tensors[f"num.{n}"].reshape(a.shape[1], -1).to(v.dtype))
            self.den_sum.addmm_(a, tensors["den"].to(self.den.dtype))
            self.degree.add_(a.sum(1))
            return int(delivered.sum())
        a = delivered[rows].float()
        for n, v in self.num_sum.items():
            src = tensors[f"num.{n}"].reshape(a.shape[1], -1).to(v.dtype)
            v.index_add_(0, rows, (a @ src).reshape(-1, *v.shape[1:]))
        self.den_sum.index_add_(0, rows, a @ tensors["den"].to(self.den.dtype))
        self.degree.index_add_(0, rows, a.sum(1))
        return int(delivered.sum())

    def step(self) -> None:
        """(own + sum of arrived) / (1 + arrivals): one gossip step of P (screened, with a `screen`)."""
        if self.screen is not None:
            if self.arrivals:
                delivered = torch.cat([d for d, _, _ in self.arrivals], dim=1)
                nums = {n: torch.cat([a[n] for _, a, _ in self.arrivals]) for n in self.num}
                dens = torch.cat([d for _, _, d in self.arrivals])
                self.num, self.den, dropped = screened_mix(self.num, self.den, delivered, nums, dens, self.screen)
                self.dropped += dropped
            self._clear()
            return
        scale = self.degree + 1  # in place: what outgoing() handed out was read by the step's receivers already
        for n, v in self.num.items():
            v.add_(self.num_sum[n]).div_(trailing(scale, v))
        self.den.add_(self.den_sum).div_(trailing(scale, self.den))
        self._clear()

    def finish(self, params: Params) -> None:
        for n, v in params.items():
            v.copy_(ratio_estimate(self.num[n], self.den, v))
