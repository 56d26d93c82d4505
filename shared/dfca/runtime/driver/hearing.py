"""Who hears whom: which hosted rows a sender's message of an exchange reaches, and whom each row may hear from.

A client's message reaches the hosted rows whose client neighbours it in the graph; a central role's reaches every
hosted row; a central role hears every client. A blocked sender (runtime.driver.admission) is heard by nobody.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from dfca.algorithms import Exchange
from dfca.algorithms.base import SERVER

Graph = Mapping[int, Sequence[int]]


class Hearing:
    """The hosted rows `ids` of one side (`side`: "clients" or "server") among `clients` clients; `graph` gives the
    current graph, `blocked` the senders cut off (both read, never changed, here)."""

    def __init__(self, ids: Sequence[int], side: str, clients: int, graph: Callable[[], Graph],
                 blocked: Collection[int]) -> None:
        self.ids, self.side, self.clients, self.graph, self.blocked = list(ids), side, clients, graph, blocked
        self.hosted = set(self.ids) if side == "clients" else set()  # their messages are delivered locally
        self.rows_of: dict[int, list[int]] = {}  # sender -> the hosted rows whose client neighbours it
        self.index()

    def index(self) -> None:
        """Index the graph (again: after a change of the graph or of `blocked`)."""
        self.rows_of = {}
        graph = self.graph()
        for row, client in enumerate(self.ids):
            for m in graph.get(client, ()):
                if m not in self.blocked:
                    self.rows_of.setdefault(m, []).append(row)

    def heard(self, graph: Graph | None = None) -> set[int]:
        """Every sender hosted elsewhere that a hosted client neighbours (in `graph`, by default the current one)."""
        graph = self.graph() if graph is None else graph
        return {m for c in self.ids for m in graph.get(c, ())} - self.hosted

    def rows(self, sender: int, ex: Exchange) -> list[int]:
        """The hosted rows that `sender` may send a message of `ex` (the rows whose `sources` hold it)."""
        if ex.receiver != self.side:
            return []
        if ex.sender == "server":
            return list(range(len(self.ids))) if sender == SERVER else []
        if self.side == "server":
            return [0] if 0 <= sender < self.clients and sender not in self.blocked else []
        return self.rows_of.get(sender, [])

    def sources(self, row: int, ex: Exchange) -> set[int]:
        """Who may send row `row` a message of `ex`."""
        if ex.sender == "server":
            return {SERVER}
        if self.side == "server":
            return set(range(self.clients)) - set(self.blocked)
        return set(self.graph().get(self.ids[row], ())) - set(self.blocked)

    def due(self, ex: Exchange, dead: Collection[int]) -> list[dict[int, int]]:
        """Per hosted row, who owes it how many messages of `ex` (every source but the `dead`: `ex.parts` each)."""
        if ex.receiver != self.side:
            return [{} for _ in self.ids]
        return [{m: ex.parts for m in self.sources(row, ex) - set(dead)} for row in range(len(self.ids))]

    def expected(self, exchanges: Iterable[Exchange]) -> set[int]:
        """Everyone who may send a hosted row a message of one of `exchanges`."""
        return {m for ex in exchanges if ex.receiver == self.side for row in range(len(self.ids))
                for m in self.sources(row, ex)}
