"""What a worker holding its own data tells the topology service, and where an experiment puts each client.

`DataHoldings` goes from a worker to the topology service with its presence announcements (never the samples);
`Placement` goes from the topology service to the workers, the aggregator and the metrics service with an experiment
whose `data.source` is `workers` (dfca.runtime.control.placement makes it).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_CLIENTS = 100_000


class ClientFacts(BaseModel):
    """One client a worker holds: its id (its folder's name), its sample counts and, if known, its true cluster."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=200)
    train: int = Field(ge=0)
    test: int = Field(ge=0)
    cluster: int | None = Field(None, ge=0, le=1_000_000)


class DataHoldings(BaseModel):
    """What a worker holding data registers: the facts about its clients, never their samples."""

    model_config = ConfigDict(extra="forbid")
    folder: str = Field(max_length=4096)
    clients: list[ClientFacts] = Field(min_length=1, max_length=MAX_CLIENTS)
    input_shape: list[int] = Field(min_length=1, max_length=8)
    num_classes: int = Field(ge=1, le=1_000_000)

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.clients]


class Placement(BaseModel):
    """An experiment's clients over the registered workers: client g (0..N-1) is `client_ids[g]` on worker
    `hosts[g]`. `true_clusters` only when every client has one (ARI needs all of them)."""

    model_config = ConfigDict(extra="forbid")
    client_ids: list[str] = Field(max_length=MAX_CLIENTS)
    hosts: list[int] = Field(max_length=MAX_CLIENTS)
    train_counts: list[int] = Field(max_length=MAX_CLIENTS)
    true_clusters: list[int] | None = None
    input_shape: list[int]
    num_classes: int

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    def clients_of(self, ordinal: int) -> list[int]:
        """The global indices worker `ordinal` hosts, ascending."""
        return [g for g, host in enumerate(self.hosts) if host == ordinal]

    def ids_of(self, ordinal: int) -> list[str]:
        return [self.client_ids[g] for g in self.clients_of(ordinal)]

    @property
    def workers(self) -> list[int]:
        """The ordinals that host clients."""
        return sorted(set(self.hosts))
