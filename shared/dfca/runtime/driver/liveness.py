"""Which neighbours a worker's clients still wait for (no global barrier).

A client ends its round when every *live* neighbour's model arrived or the round timeout passed.
A neighbour whose model missed the timeout in `dead_after` consecutive rounds is presumed dead:
clients stop waiting for it (its late models are still applied or dropped by the staleness
policy). It is live again as soon as it shows progress: a model of a later round than the latest it had sent
when it was presumed dead (a paused, restarted or cut-off worker catching up), or of the current round or later.
Waiting for it again costs at most `dead_after` round timeouts, in which it catches up: without that, a worker
paused for longer than a few rounds would stay behind, and its clients unheard, for the rest of the run (its rounds
take as long as everyone else's, so it never overtakes them on its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

DEAD_AFTER_MISSES = 2


class NeighbourLiveness:
    def __init__(self, dead_after: int = DEAD_AFTER_MISSES) -> None:
        self.dead_after = dead_after
        self.misses: dict[int, int] = {}
        self.sightings: dict[int, int] = {}  # sender -> the latest round a message of it came from
        self.dead_at: dict[int, int] = {}  # sender presumed dead -> its latest round then (-1: none seen)

    def sighted(self, sender: int, t: int) -> None:
        """A message of round t came from `sender`."""
        self.sightings[sender] = max(t, self.sightings.get(sender, t))

    def observe_round(self, expected: Iterable[int], missing: Iterable[int]) -> None:
        """After a round: senders in `missing` timed out, the rest of `expected` delivered."""
        missed = set(missing)
        for sender in set(expected) | missed:
            self.misses[sender] = self.misses.get(sender, 0) + 1 if sender in missed else 0
            if self.misses[sender] == self.dead_after:
                self.dead_at[sender] = self.sightings.get(sender, -1)

    def revive(self, sightings: Mapping[int, int], current_round: int) -> list[int]:
        """Senders presumed dead that were seen since with a later round than then, or with `current_round` or later,
        are live again; returns them."""
        revived = [s for s, r in sightings.items() if self.misses.get(s, 0) >= self.dead_after
                   and (r >= current_round or r > self.dead_at.get(s, -1))]
        for sender in revived:
            self.misses[sender] = 0
            self.dead_at.pop(sender, None)
        return revived

    @property
    def dead(self) -> set[int]:
        return {s for s, n in self.misses.items() if n >= self.dead_after}
