"""Which neighbours a worker's clients still wait for (no global barrier).

A client ends its round when every *live* neighbour's model arrived or the round timeout passed.
A neighbour whose model missed the timeout in `dead_after` consecutive rounds is presumed dead:
clients stop waiting for it (its late models are still applied or dropped by the staleness
policy). It is live again as soon as one of its models for the current round or later arrives,
which is what a restarted worker's clients send once they have caught up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

DEAD_AFTER_MISSES = 2


class NeighbourLiveness:
    def __init__(self, dead_after: int = DEAD_AFTER_MISSES) -> None:
        self.dead_after = dead_after
        self.misses: dict[int, int] = {}
        self.sightings: dict[int, int] = {}  # sender -> the latest round a message of it came from

    def sighted(self, sender: int, t: int) -> None:
        """A message of round t came from `sender`."""
        self.sightings[sender] = max(t, self.sightings.get(sender, t))

    def observe_round(self, expected: Iterable[int], missing: Iterable[int]) -> None:
        """After a round: senders in `missing` timed out, the rest of `expected` delivered."""
        missed = set(missing)
        for sender in set(expected) | missed:
            self.misses[sender] = self.misses.get(sender, 0) + 1 if sender in missed else 0

    def revive(self, sightings: Mapping[int, int], current_round: int) -> list[int]:
        """Senders seen with a model of `current_round` or later are live again; returns them."""
        revived = [s for s, r in sightings.items() if r >= current_round and self.misses.get(s, 0) >= self.dead_after]
        for sender in revived:
            self.misses[sender] = 0
        return revived

    @property
    def dead(self) -> set[int]:
        return {s for s, n in self.misses.items() if n >= self.dead_after}
