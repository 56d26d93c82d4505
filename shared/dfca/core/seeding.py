"""Farthest-first seeding of the k cluster models by max-flooding: robust DFCA's initialization.

Why. With random initial models the first assignment (eq. 4) is decided by which random model has
the lowest loss overall, not by the data: most clients pick the same model, some models are never
picked (they stay random and are never chosen again), and two distributions share a cluster. IFCA
recovers from part of this through its global average; on a sparse graph a client's copy of its
cluster is mostly its own training, so assignments lock in within a few rounds, and regions of the
graph settle on different meanings of the same index (issue 6, docs/cluster_recovery.md).

What. A decentralized k-means++ (deterministic farthest-first, the loss as the distance) that
gives every client the same k models, each the local model of a client of a different
distribution, before any cluster model is trained:

0. Every client trains a local model phi_i: its copy of cluster 0, `dfca.seed_epochs` epochs of
   SGD on its own data (no communication).
1. Slot 0: every client's candidate is (u_i, i, phi_i), u_i a seeded uniform number.
   Slot s >= 1: (min_{j<s} F(seed_j, D_i), i, phi_i): how badly the seeds so far fit the client.
2. For `flood_rounds` rounds every client sends its current candidate to its neighbours and keeps
   the best one it has seen (higher score wins; on a tie the lower client id). After as many rounds
   as the graph's diameter every client holds the same candidate: the global farthest client.
3. seed_s := that candidate's model, at every client: theta_{i,s} <- seed_s.

The k slots take k * flood_rounds rounds, one model message per neighbour per round, no training.
Lost or late messages only slow the flood; the max does not depend on arrival order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dfca.config import ExperimentConfig, TopologyConfig

SCORE_HEADER = "dfca-seed-score"  # the candidate's score, repr(float)
ORIGIN_HEADER = "dfca-seed-origin"  # the client whose local model the candidate is


def diameter_bound(topology: TopologyConfig, n: int) -> int:
    """Rounds a max-flood needs: an upper estimate of the graph's diameter from its kind and size.

    Measured against 10 graphs each of ER N=30..240 p=0.1..0.3 and BA m=2 N=30..240: never below the
    real diameter. The simulator warns when a drawn graph is wider than `flood_rounds`.
    """
    if n <= 2:
        return 1
    log_n = math.log(n)
    if topology.kind == "complete":
        return 1
    if topology.kind == "ring":
        return n // 2
    if topology.kind == "erdos_renyi":
        return math.ceil(2 * log_n / math.log(max(n * topology.p, 2.0))) + 1
    if topology.kind == "barabasi_albert":
        return math.ceil(2 * log_n / math.log(max(2 * topology.m, 2))) + 1
    return math.ceil(1.5 / topology.radius) + 2  # random geometric: about sqrt(2) / radius hops


def flood_rounds(cfg: ExperimentConfig) -> int:
    if cfg.dfca.flood_rounds is not None:
        return cfg.dfca.flood_rounds
    return min(diameter_bound(cfg.topology, cfg.data.clients), cfg.data.clients - 1)


def seeding_rounds(cfg: ExperimentConfig) -> int:
    """How many of the first rounds the seeding takes (0 without seeding)."""
    return cfg.clusters * flood_rounds(cfg) if cfg.dfca.seeding_rule == "farthest" else 0


@dataclass(frozen=True)
class SeedingStep:
    """Where round t sits in the seeding: which slot is flooding and which of its rounds this is."""

    slot: int
    step: int
    rounds_per_slot: int

    @property
    def first(self) -> bool:
        return self.step == 0

    @property
    def last(self) -> bool:
        return self.step == self.rounds_per_slot - 1


def seeding_step(cfg: ExperimentConfig, t: int) -> SeedingStep | None:
    """The seeding step of round t, or None once the seeding is over (or without seeding)."""
    if t >= seeding_rounds(cfg):
        return None
    d = flood_rounds(cfg)
    return SeedingStep(t // d, t % d, d)


def first_slot_scores(seed: int, clients: Sequence[int]) -> Tensor:
    """Slot 0's scores: one seeded uniform number per client, the same however clients are grouped."""
    return torch.tensor(
        [float(torch.rand(1, generator=torch.Generator().manual_seed(seed * 1_000_003 + 104_723 + c)))
         for c in clients],
        dtype=torch.float64,
    )


def fit_scores(losses: Tensor, slot: int) -> Tensor:
    """Slot s >= 1: each client's loss under the seed that fits it best so far, [M, k] -> [M]."""
    return losses[:, :slot].min(dim=1).values.to(torch.float64)


def beats(score: Tensor, origin: Tensor, best_score: Tensor, best_origin: Tensor) -> Tensor:
    """Candidate (score, origin) beats (best_score, best_origin): higher score, then lower client id."""
    return (score > best_score) | ((score == best_score) & (origin < best_origin))


def flood_step(score: Tensor, origin: Tensor, delivered: Tensor) -> Tensor:
    """One round of the max-flood for all N clients: [N] index of the client whose candidate each keeps.

    score [N], origin [N]: every client's candidate at the start of the round; delivered [N, N] bool:
    receiver i got sender m's candidate. A client always considers its own candidate.
    """
    n = score.shape[0]
    seen = delivered | torch.eye(n, dtype=torch.bool)
    masked = torch.where(seen, score.unsqueeze(0).expand(n, n), torch.tensor(-math.inf, dtype=score.dtype))
    top = masked.max(dim=1, keepdim=True).values
    tied = seen & (masked == top)
    origins = torch.where(tied, origin.unsqueeze(0).expand(n, n), torch.iinfo(torch.long).max)
    return origins.min(dim=1).indices
