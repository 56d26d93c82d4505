"""Makes cluster collapse visible: warns when clusters empty out or assignments freeze badly."""

from __future__ import annotations

from typing import Any

STALL_ROUNDS = 10  # rounds of unchanged ARI below STALL_ARI that count as locked in
STALL_ARI = 0.9


class CollapseWatch:
    def __init__(self, k: int) -> None:
        self.k = k
        self.warnings: list[str] = []
        self._ari: list[float] = []
        self._warned: set[str] = set()

    def observe(self, record: dict[str, Any]) -> list[str]:
        """Warnings raised by this round's record (each kind at most once per run)."""
        found: dict[str, str] = {}
        if record["populated_clusters"] < self.k and record["round"] > 1:
            found["collapse"] = (
                f"round {record['round']}: only {record['populated_clusters']} of {self.k} clusters are "
                "populated (cluster collapse)"
            )
        if "ari" in record:  # the true clusters are known
            self._ari.append(record["ari"])
        recent = self._ari[-STALL_ROUNDS:]
        if len(recent) == STALL_ROUNDS and max(recent) - min(recent) < 1e-9 and recent[-1] < STALL_ARI:
            found["stall"] = (
                f"round {record['round']}: ARI has stayed at {recent[-1]:.3f} for {STALL_ROUNDS} rounds "
                "(assignments locked in below 0.9)"
            )
        fresh = [w for kind, w in found.items() if kind not in self._warned]
        self._warned.update(found)
        self.warnings.extend(fresh)
        return fresh
