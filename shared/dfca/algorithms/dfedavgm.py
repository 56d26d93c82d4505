"""DFedAvgM (Sun et al. 2021), as DFCA uses it: one model per client, local SGD with heavy-ball momentum
(`train.momentum`; 0.9 is the usual choice, the config default 0 gives plain DFedAvg), then one gossip
step with Metropolis-Hastings weights w_im = 1 / (1 + max(d_i, d_m)) (core.mixing), folded as a weighted
running average as the models arrive: x_i <- (w_ii x_i + sum_m w_im x_m) / (w_ii + sum_m w_im) over the
models m that arrived, so a lost message drops its weight and the row is renormalised.

Params are [M, 1, ...]: a cluster axis of size 1, so the core's cluster functions apply.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dfca.algorithms.base import (
    Algorithm,
    Evaluation,
    Exchange,
    Graph,
    HostContext,
    Inbox,
    Outbox,
    params_in,
    state_of,
)
from dfca.algorithms.client_data import train_assigned
from dfca.core import fold_models, init_cluster_models, round_seeds
from dfca.core.mixing import metropolis_hastings_weights
from dfca.models.batched import Params
from dfca.wire.codec import TensorSpec


class DFedAvgM(Algorithm):
    links = frozenset({"neighbours"})
    title = "DFedAvgM"

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        self.params: Params = init_cluster_models(ctx.model, ctx.clients, 1, ctx.cfg.seed, ctx.cfg.init, ctx.device)
        self.only = torch.zeros(len(ctx.clients), dtype=torch.long, device=ctx.device)
        self.losses = self.losses_of(self.params)
        self.mixing = self.mixing_rows()
        self.weight = torch.ones(len(ctx.clients), 1, device=ctx.device)

    def mixing_rows(self) -> Tensor:
        """[M, N]: the hosted clients' rows of the graph's Metropolis-Hastings matrix."""
        n = self.ctx.cfg.data.clients
        adjacency = torch.zeros(n, n, dtype=torch.bool, device=self.ctx.device)
        for c, ms in self.ctx.graph.items():
            adjacency[c, list(ms)] = True
            adjacency[list(ms), c] = True
        return metropolis_hastings_weights(adjacency)[self.ctx.rows]

    def set_graph(self, graph: Graph) -> None:
        super().set_graph(graph)
        self.mixing = self.mixing_rows()

    def exchanges(self, t: int) -> list[Exchange]:
        return [Exchange("models", averaged=True, stale_ok=True)]

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        return self.model_spec()

    def begin_round(self, t: int) -> None:
        """Local SGD with `train.momentum`; the own model enters the mixing with w_ii."""
        cfg, d = self.ctx.cfg, self.data()
        train_assigned(
            self.ctx.model, self.params, self.only, d, lr=self.schedule.lr(t),
            epochs=self.schedule.epochs(t), batch_size=cfg.train.batch_size,
            seeds=round_seeds(cfg.seed, self.ctx.clients, t), momentum=cfg.train.momentum,
            local_steps=cfg.train.local_steps,
        )
        rows = torch.arange(len(self.ctx.clients), device=self.ctx.device)
        self.weight = self.mixing[rows, self.ctx.rows].unsqueeze(1).clone()

    def send(self, ex: Exchange) -> Outbox:
        rows = torch.arange(len(self.ctx.clients), device=self.ctx.device)
        return Outbox(rows, self.only, {n: v[:, 0].clone() for n, v in self.params.items()})

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        weights = inbox.delivered.float() * self.mixing[:, inbox.sender]
        return fold_models(self.params, self.weight, weights, inbox.part, inbox.tensors)

    def end_round(self, t: int) -> None:
        self.losses = self.losses_of(self.params)

    def evaluate(self) -> Evaluation:
        return self.evaluation(self.params, self.losses, self.only)

    def final_models(self) -> dict[str, Params]:
        return {"mean": {n: t[:, 0].mean(0) for n, t in self.params.items()}}

    def state(self) -> dict[str, Tensor]:
        return state_of(self.params, losses=self.losses)

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self.params = {n: v.to(self.ctx.device) for n, v in params_in(tensors).items()}
        self.losses = tensors["losses"].to(self.ctx.device)


class LocalOnly(DFedAvgM):
    """`local`: every client trains its own model on its own data and never communicates."""

    links = frozenset()
    title = "local training"

    def exchanges(self, t: int) -> list[Exchange]:
        return []
