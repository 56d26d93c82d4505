"""What round t is: the one schedule that both drivers and every algorithm read.

Rounds 0 .. seeding_rounds - 1 are robust DFCA's farthest-first seeding (core.seeding): k slots of
`flood_rounds` rounds each, no training. The `cfg.rounds` training rounds follow. A training round
merges by ratio consensus over G gossip steps (robust DFCA, core.consensus) or by the one-hop merge
(eq. 7/8: the paper's rule, or robust with `gossip_steps: 0` after the warm-up). The warm-up counts
from the first training round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from dfca.config import ExperimentConfig, TopologyConfig


def diameter_bound(topology: TopologyConfig, n: int) -> int:
    """Rounds a max-flood needs: an upper estimate of the graph's diameter from its kind and size.

    Measured against 10 graphs each of ER N=30..240 p=0.1..0.3 and BA m=2 N=30..240: never below the
    real diameter. The simulator warns when a drawn graph is wider than `flood_rounds`.
    """
    if n <= 2 or topology.kind == "complete":
        return 1
    log_n = math.log(n)
    if topology.kind == "ring":
        return n // 2
    if topology.kind == "erdos_renyi":
        return math.ceil(2 * log_n / math.log(max(n * topology.p, 2.0))) + 1
    if topology.kind == "barabasi_albert":
        return math.ceil(2 * log_n / math.log(max(2 * topology.m, 2))) + 1
    return math.ceil(1.5 / topology.radius) + 2  # random geometric: about sqrt(2) / radius hops


@dataclass(frozen=True)
class SeedingStep:
    """Where a seeding round sits: which slot is flooding and which of its rounds this is."""

    slot: int
    step: int
    rounds_per_slot: int

    @property
    def first(self) -> bool:
        return self.step == 0

    @property
    def last(self) -> bool:
        return self.step == self.rounds_per_slot - 1


class RoundSchedule:
    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        d = cfg.dfca
        seeds = cfg.algorithm == "dfca" and d.seeding_rule == "farthest"
        self.flood_rounds = d.flood_rounds or min(diameter_bound(cfg.topology, cfg.data.clients), cfg.data.clients - 1)
        self.seeding_rounds = cfg.clusters * self.flood_rounds if seeds else 0
        self.total_rounds = cfg.rounds + self.seeding_rounds

    def phase(self, t: int) -> Literal["seeding", "training"]:
        return "seeding" if t < self.seeding_rounds else "training"

    def seeding(self, t: int) -> SeedingStep | None:
        """The seeding step of round t, or None for a training round."""
        if t >= self.seeding_rounds:
            return None
        return SeedingStep(t // self.flood_rounds, t % self.flood_rounds, self.flood_rounds)

    def gossip_steps(self, t: int) -> int:
        """G_t, gossip steps of ratio consensus in round t; 0 means a one-hop merge (eq. 7/8). After the warm-up,
        every `gossip_every`-th training round gossips, counted back from the last (which always does)."""
        d = self.cfg.dfca
        if self.cfg.algorithm != "dfca" or d.variant != "robust" or t < self.seeding_rounds:
            return 0
        u = t - self.seeding_rounds  # the training round
        if u < d.warmup_rounds:
            return d.warmup_gossip_steps
        return d.gossip_steps if (self.cfg.rounds - 1 - u) % d.gossip_every == 0 else 0

    def agrees_on_initial_models(self, t: int) -> bool:
        """Robust DFCA-LI without seeding spends round 0 agreeing on initial models instead of training
        (see algorithms.dfca): averaging independently initialised networks destroys them."""
        return t == 0 and self.cfg.init == "local" and self.gossip_steps(0) > 0

    def lr(self, t: int) -> float:
        """train.lr decayed by train.lr_decay every round; FedSPD (B.1) also by fedspd.lr_decay every
        fedspd.lr_decay_every rounds."""
        lr = self.cfg.train.lr * self.cfg.train.lr_decay**t
        if self.cfg.algorithm == "fedspd":
            lr *= self.cfg.fedspd.lr_decay ** (t // self.cfg.fedspd.lr_decay_every)
        return lr

    def epochs(self, t: int) -> int:
        """Local epochs of round t: seed_epochs once, at the first seeding round; none in a seeding round
        after it or an agreement round; FedSPD's tau (doubled in round 0, B.1); else train.local_epochs."""
        cfg = self.cfg
        if t < self.seeding_rounds:
            return cfg.dfca.seed_epochs if t == 0 else 0
        if self.agrees_on_initial_models(t):
            return 0
        if cfg.algorithm == "fedspd":
            tau = cfg.fedspd.local_epochs if cfg.fedspd.local_epochs is not None else cfg.train.local_epochs
            return 2 * tau if t == 0 and cfg.fedspd.double_first_round else tau
        return cfg.train.local_epochs
