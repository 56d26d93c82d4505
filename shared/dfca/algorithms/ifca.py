"""IFCA (Ghosh et al. 2021), centralized: a server holds k models; every round each client picks the one
with the least loss on its data, trains a copy and uploads it; the server averages the uploads per
cluster, weighted by sample count, and sends all k models back.

A round is two exchanges: `upload` (every client to the server) and `download` (the server's k models
to every client). The server is a central role written against the same interface: `IFCAServer`.
Clients and server start from the same seeded models (DFCA-GI's). An upload lost or late misses the
round; the server averages what arrived (and, on the runtime, closes the round `runtime.round_timeout`
after its first upload). A client that hears no complete set of k models keeps its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dfca.algorithms.base import (
    Algorithm,
    Evaluation,
    Exchange,
    HostContext,
    Inbox,
    Outbox,
    params_in,
    state_of,
)
from dfca.algorithms.client_data import local_sgd, sample_counts
from dfca.core import assign_clusters, fold_models, gather_clusters, round_seeds
from dfca.models.batched import Params
from dfca.wire.codec import TensorSpec

SERVER_GRACE = 2.0  # a client waits this many round timeouts for the server's models (the server's deadline first)


def ifca_exchanges(k: int) -> list[Exchange]:
    return [Exchange("upload", receiver="server", averaged=True, needs_arrival=True),
            Exchange("download", sender="server", parts=k, wait=SERVER_GRACE)]


def initial_models(ctx: HostContext) -> Params:
    """[k, ...]: the seeded models that the server and every client start from."""
    models = ctx.model.init(ctx.cfg.clusters, torch.Generator().manual_seed(ctx.cfg.seed))
    return {n: v.to(ctx.device) for n, v in models.items()}


class IFCA(Algorithm):
    """IFCA's clients (their central role: IFCAServer, below)."""

    links = frozenset({"server"})
    title = "IFCA"
    client_per_cluster = True

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        self.k = ctx.cfg.clusters
        self.models = initial_models(ctx)  # [k, ...]: the server's models, as this host's clients hold them
        self.model_round = 0  # how many of the server's averages the clients hold
        self.losses = self.losses_of(self.params)
        self.assigned = assign_clusters(self.losses)
        self.local: Params = {}
        self.arrived: dict[int, Params] = {}  # part -> the server's model of that cluster, this round

    @property
    def params(self) -> Params:
        """[M, k, ...]: every client's copy of the server's k models (one tensor, broadcast)."""
        return {n: v.unsqueeze(0).expand(len(self.ctx.clients), *v.shape) for n, v in self.models.items()}

    def exchanges(self, t: int) -> list[Exchange]:
        return ifca_exchanges(self.k)

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        return {**self.model_spec(), "samples": TensorSpec((), "float32")} if ex.name == "upload" else self.model_spec()

    def begin_round(self, t: int) -> None:
        """Pick the model of least loss (eq. 4) and train a copy of it."""
        cfg, d = self.ctx.cfg, self.data()
        self.assigned = assign_clusters(self.losses)
        self.local = gather_clusters(self.params, self.assigned)
        local_sgd(self.ctx.model, self.local, d, lr=self.schedule.lr(t), epochs=self.schedule.epochs(t),
                  batch_size=cfg.train.batch_size, seeds=round_seeds(cfg.seed, self.ctx.clients, t),
                  momentum=cfg.train.momentum, local_steps=cfg.train.local_steps)
        self.arrived = {}

    def send(self, ex: Exchange) -> Outbox:
        rows = torch.arange(len(self.ctx.clients), device=self.ctx.device)
        return Outbox(rows, self.assigned, {**self.local, "samples": sample_counts(self.data())})

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        for s in inbox.delivered.any(0).nonzero().flatten().tolist():
            self.arrived[int(inbox.part[s])] = {n: inbox.tensors[n][s] for n in self.models}
        return int(inbox.delivered.sum())

    def end_exchange(self, ex: Exchange) -> None:
        if ex.name == "download" and len(self.arrived) == self.k:
            self.models = {n: torch.stack([self.arrived[j][n] for j in range(self.k)]) for n in self.models}
            self.model_round += 1

    def end_round(self, t: int) -> None:
        self.losses = self.losses_of(self.params)

    def evaluate(self) -> Evaluation:
        return self.evaluation(self.params, self.losses, assign_clusters(self.losses), keeps_k=False)

    def final_models(self) -> dict[str, Params]:
        return {f"cluster_{j}": {n: v[j] for n, v in self.models.items()} for j in range(self.k)}

    def state(self) -> dict[str, Tensor]:
        return state_of(self.params, losses=self.losses, model_round=torch.tensor(self.model_round))

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self.models = {n: v[0].to(self.ctx.device) for n, v in params_in(tensors).items()}
        self.losses = tensors["losses"].to(self.ctx.device)
        self.model_round = int(tensors["model_round"])


class IFCAServer(Algorithm):
    """IFCA's server: cluster j becomes the sample-weighted mean of this round's uploads of j; a cluster
    nobody uploaded keeps its model."""

    side = "server"

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        self.k = ctx.cfg.clusters
        self.params: Params = {n: v.unsqueeze(0) for n, v in initial_models(ctx).items()}  # [1, k, ...]
        self.weight = torch.zeros(1, self.k, device=ctx.device)

    @property
    def models(self) -> Params:
        return {n: v[0] for n, v in self.params.items()}

    def exchanges(self, t: int) -> list[Exchange]:
        return ifca_exchanges(self.k)

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        return {**self.model_spec(), "samples": TensorSpec((), "float32")} if ex.name == "upload" else self.model_spec()

    def begin_round(self, t: int) -> None:
        self.weight = torch.zeros(1, self.k, device=self.ctx.device)  # the old model does not count

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        samples = inbox.delivered.float() * inbox.tensors["samples"].float().unsqueeze(0)
        return fold_models(self.params, self.weight, samples, inbox.part, inbox.tensors)

    def send(self, ex: Exchange) -> Outbox:
        parts = torch.arange(self.k, device=self.ctx.device)
        return Outbox(torch.zeros_like(parts), parts, self.models)

    def final_models(self) -> dict[str, Params]:
        return {f"cluster_{j}": {n: v[j] for n, v in self.models.items()} for j in range(self.k)}

    def state(self) -> dict[str, Tensor]:
        return state_of(self.params)

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self.params = {n: v.to(self.ctx.device) for n, v in params_in(tensors).items()}


IFCA.central_role = IFCAServer  # the server is written after the clients it serves
