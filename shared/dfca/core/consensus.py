"""Ratio consensus of trained cluster models: IFCA's per-cluster average, reached by gossip.

For cluster j, with m_ij = 1 when client i trained j this round:

    num_j <- P^G (m_j * theta_j),   den_j <- P^G m_j,   theta_ij <- num_ij / den_ij   (where den_ij > 0)

P = (A + I) row-normalised is one gossip step over the closed neighbourhood (each client
averages its own and its neighbours' (num, den) pairs). As G grows, num/den tends to the
network-wide mean of the trained copies: exactly what IFCA's server computes. A client that
no trained copy of j has reached (den = 0) keeps its own theta_ij.

This is the robust DFCA warm-up: measured here, the paper's one-hop merge lets each region of a
sparse graph give the cluster indices its own meaning in the first rounds; a few rounds of
ratio consensus make every client see nearly the same k models, so the assignment (eq. 4)
splits clients by their data everywhere in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dfca.config import ExperimentConfig
from dfca.core.params import cluster_views
from dfca.models import Params

MIN_WEIGHT = 1e-3  # den below this: no trained copy has reached the client (keep its own model)


def gossip_matrix(delivered: Tensor) -> Tensor:
    """One gossip step: P = (A + I) row-normalised, A[i, m] = i hears from m."""
    a = delivered.float() + torch.eye(delivered.shape[0])
    return a / a.sum(1, keepdim=True)


def gossip_step(values: Tensor, neighbours_sum: Tensor, degree: Tensor) -> Tensor:
    """The message-driven form of one step: (own + sum of neighbours') / (degree + 1)."""
    return (values + neighbours_sum) / (degree + 1).reshape(-1, *[1] * (values.dim() - 1))


def consensus_weights(assigned: Tensor, k: int, untrained_weight: float) -> Tensor:
    """m [M, k]: 1 for the cluster a client trained this round, `untrained_weight` for the others.

    A small untrained weight lets every cluster reach every client, so clusters nobody trained
    are averaged too; without it, DFCA-LI can keep k different random copies of an untrained
    cluster that then lose every assignment (cluster collapse, measured on BA graphs).
    """
    one_hot = torch.nn.functional.one_hot(assigned, k).float()
    return one_hot + untrained_weight * (1.0 - one_hot)


def agrees_on_initial_models(cfg: ExperimentConfig, t: int) -> bool:
    """Robust DFCA-LI spends round 0 agreeing on initial models instead of training.

    Averaging independently initialised networks destroys them (hidden units do not line up);
    measured on a BA graph, the averaged clusters then all lose to one and the clients collapse
    into a single cluster. Instead, for each cluster j one source client (a seeded draw) floods
    its own local initialisation by the same ratio consensus: with weight 1 at the source and 0
    elsewhere, num/den is exactly the source's model wherever it arrives.
    """
    return t == 0 and cfg.init == "local" and cfg.dfca.steps_at(0) > 0


def agreement_weights(cfg: ExperimentConfig, clients: Sequence[int]) -> Tensor:
    """m [M, k]: 1 where client i is cluster j's source of the initial model, else 0."""
    g = torch.Generator().manual_seed(cfg.seed * 31 + 13)
    sources = torch.randperm(cfg.data.clients, generator=g)[: cfg.clusters]
    return (torch.tensor(list(clients)).unsqueeze(1) == sources.unsqueeze(0)).float()


def round_weights(cfg: ExperimentConfig, t: int, clients: Sequence[int], assigned: Tensor) -> Tensor:
    """The consensus weights m of robust round t (the same in the simulator and the hosts)."""
    if agrees_on_initial_models(cfg, t):
        return agreement_weights(cfg, clients)
    return consensus_weights(assigned, cfg.clusters, cfg.dfca.untrained_weight)


@torch.no_grad()
def ratio_consensus(params: Params, trained: Tensor, steps: Tensor | list[Tensor]) -> None:
    """In place, for every cluster j: theta_j <- P^G (m_j theta_j) / P^G m_j where P^G m_j > MIN_WEIGHT.

    trained [N, k]: the weights m (consensus_weights); steps: the gossip matrices of the G steps.
    """
    mats = [steps] if isinstance(steps, Tensor) else steps
    walk = mats[0]
    for P in mats[1:]:  # P_G ... P_1: one [N, N] product, then one pass over the parameters per cluster
        walk = P @ walk
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


def ratio_estimate(num: Tensor, den: Tensor, own: Tensor) -> Tensor:
    """num / den where den > MIN_WEIGHT, else `own`; den's shape is a prefix of num's (e.g. [M, k] and [M, k, ...])."""
    shape = (*den.shape, *[1] * (num.dim() - den.dim()))
    reached = (den > MIN_WEIGHT).reshape(shape)
    return torch.where(reached, num / den.clamp_min(MIN_WEIGHT).reshape(shape), own)
