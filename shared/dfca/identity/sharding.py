"""Which worker hosts which clients: client c lives on worker c % workers (a StatefulSet ordinal)."""

from __future__ import annotations


def clients_of(ordinal: int, workers: int, num_clients: int) -> list[int]:
    """The clients worker `ordinal` hosts; empty when there are more workers than clients."""
    if not 0 <= ordinal < workers:
        raise ValueError(f"worker ordinal {ordinal} outside 0..{workers - 1}")
    return list(range(ordinal, num_clients, workers))


def assignment(num_clients: int, workers: int) -> dict[int, list[int]]:
    return {w: clients_of(w, workers, num_clients) for w in range(workers)}
