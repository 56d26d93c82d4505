"""The topology service's register of the workers that hold their own data: accepted holdings and refusals.

A worker started on a data folder repeats its `DataHoldings` with every presence announcement; the register accepts
it, or refuses it with a reason that names the worker and the clients (`placement.registration_refusal`). A refused
worker's clients are in no experiment: an experiment over the workers' data is neither created nor started while a
present worker is refused, so no client is silently left out. `GET /deployment` lists both (`data`, `data_refused`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from dfca.runtime.control.placement import PlacementError, place, registration_refusal
from dfca.runtime.protocol.holdings import DataHoldings, Placement

log = logging.getLogger(__name__)


class DataRegistry:
    def __init__(self) -> None:
        self.holdings: dict[int, DataHoldings] = {}  # ordinal -> what it registered, accepted
        self.refused: dict[int, str] = {}  # ordinal -> why its latest registration was refused

    def register(self, ordinal: int, holdings: DataHoldings | None, placed: Mapping[int, tuple[str, Placement]],
                 present: Collection[int] = ()) -> str | None:
        """Take worker `ordinal`'s announcement (None: it holds no data folder); the refusal, or None if accepted.
        `placed`: per ordinal, an experiment not yet over that placed clients there; `present`: the workers heard
        from lately, whose holdings count against a newcomer's (with those of placed workers)."""
        if holdings is None:
            if ordinal in placed:
                reason = (f"worker {ordinal} came back without a data folder, but experiment {placed[ordinal][0]} "
                          f"runs over its clients {placed[ordinal][1].ids_of(ordinal)}; start it with its --data")
                return self._refuse(ordinal, reason)
            self.refused.pop(ordinal, None)
            if self.holdings.pop(ordinal, None) is not None:
                log.info("worker %d holds no data folder any more", ordinal)
            return None
        counted = set(present) | set(placed)
        others = {o: h for o, h in self.holdings.items() if o != ordinal and o in counted}
        reason = registration_refusal(ordinal, holdings, others, placed)
        if reason is not None:
            return self._refuse(ordinal, reason)
        if self.holdings.get(ordinal) != holdings or ordinal in self.refused:
            log.info("worker %d registered %d clients from %s (input shape %s, %d classes)", ordinal,
                     len(holdings.clients), holdings.folder, tuple(holdings.input_shape), holdings.num_classes)
        self.refused.pop(ordinal, None)
        self.holdings[ordinal] = holdings
        return None

    def _refuse(self, ordinal: int, reason: str) -> str:
        if self.refused.get(ordinal) != reason:
            log.error("refused the registration of worker %d: %s", ordinal, reason, extra={"worker": ordinal})
        self.refused[ordinal] = reason
        return reason

    def placement_for(self, present: Collection[int], classes: int | None = None) -> Placement:
        """The clients of the present workers holding data, placed; PlacementError naming a refused worker first."""
        refused = {o: r for o, r in self.refused.items() if o in present}
        if refused:
            raise PlacementError("; ".join(f"worker {o} is refused: {r}" for o, r in sorted(refused.items())))
        return place({o: h for o, h in self.holdings.items() if o in present}, classes)

    def check_placement_holds(self, experiment: str, placement: Placement, present: Collection[int],
                              workers: int) -> None:
        """PlacementError unless every worker the placement uses is present, accepted and holds the same clients."""
        for ordinal in placement.workers:
            ids = placement.ids_of(ordinal)
            if ordinal >= workers:
                raise PlacementError(f"experiment {experiment} places clients on worker {ordinal}, but the deployment "
                                     f"runs {workers} workers")
            if ordinal in self.refused:
                raise PlacementError(f"worker {ordinal} is refused: {self.refused[ordinal]}")
            if ordinal not in present or ordinal not in self.holdings:
                raise PlacementError(f"worker {ordinal}, which holds {len(ids)} of experiment {experiment}'s clients, "
                                     "is not up: start it (with its --data folder), then start the experiment")
            if sorted(self.holdings[ordinal].ids) != ids:
                raise PlacementError(f"worker {ordinal} now holds other clients than when experiment {experiment} "
                                     "was created: create the experiment again")

    def view(self) -> dict[str, Any]:
        """What GET /deployment shows: per worker holding data, its folder and client count; the refusals."""
        return {"data": {str(o): {"folder": h.folder, "clients": len(h.clients)}
                         for o, h in sorted(self.holdings.items())},
                "data_refused": {str(o): r for o, r in sorted(self.refused.items())}}
