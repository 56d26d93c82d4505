"""What round t is: the schedule that both drivers and every algorithm read.

Rounds 0 .. seeding_rounds - 1 prepare the run without training (robust DFCA's farthest-first seeding,
algorithms.dfca); the `cfg.rounds` training rounds follow. A round's learning rate and local epochs come
from `train`, and an algorithm whose schedule differs (DFCA's seeding and gossip rounds, FedSPD's decay)
subclasses `RoundSchedule` in its own file and names the subclass as its `Schedule`
(`dfca.algorithms.schedule_of` builds the schedule of a config).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from dfca.sections import ExperimentBase, TopologyConfig


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


class RoundSchedule:
    """The plain schedule: no preparation rounds, one-hop exchanges, train.lr decayed by train.lr_decay every
    round and train.local_epochs local epochs per round."""

    def __init__(self, cfg: ExperimentBase) -> None:
        self.cfg = cfg
        self.seeding_rounds = self.preparation_rounds()
        self.total_rounds = cfg.rounds + self.seeding_rounds

    def preparation_rounds(self) -> int:
        """Rounds before the first training round (they train nothing but what `epochs` says)."""
        return 0

    def phase(self, t: int) -> Literal["seeding", "training"]:
        return "seeding" if t < self.seeding_rounds else "training"

    def phase_round(self, t: int) -> tuple[Literal["seeding", "training"], int, int]:
        """Round t (0-based, seeding rounds first) as people count it: (phase, its 1-based number in that phase,
        that phase's rounds). The one numbering of the progress bar, plots, logs, dashboard and summaries."""
        if t < self.seeding_rounds:
            return "seeding", t + 1, self.seeding_rounds
        return "training", t - self.seeding_rounds + 1, self.cfg.rounds

    def phase_fields(self, t: int) -> dict[str, str | int]:
        """Round t's `phase`, `phase_round` and `phase_rounds`, as metrics rows and round views carry them beside
        the absolute 1-based `round`."""
        phase, number, total = self.phase_round(t)
        return {"phase": phase, "phase_round": number, "phase_rounds": total}

    def label(self, t: int) -> str:
        """`seeding 3 of 8` for a seeding round, `round 4 of 10` for a training round."""
        phase, number, total = self.phase_round(t)
        return f"{'seeding' if phase == 'seeding' else 'round'} {number} of {total}"

    def gossip_steps(self, t: int) -> int:
        """G_t, the exchanges of ratio consensus in round t; 0 means a one-hop merge (eq. 7/8)."""
        return 0

    def lr(self, t: int) -> float:
        """eta_t = train.lr * train.lr_decay^t."""
        return self.cfg.train.lr * self.cfg.train.lr_decay**t

    def epochs(self, t: int) -> int:
        """Local epochs of round t: train.local_epochs."""
        return self.cfg.train.local_epochs
