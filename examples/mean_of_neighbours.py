"""A toy algorithm, the whole of it in one file: one model per client, the mean of its neighbours'.

Round t, for every client i with neighbours N(i) (docs/algorithms.md, "Adding an algorithm"):

    theta_i <- SGD on D_i                                          (train.lr, train.local_epochs)
    theta_i <- (w theta_i + sum_{j in N(i)} theta_j) / (w + |N(i)|)   w = mean_of_neighbours.own_weight

It is not registered in the product. A test registers it (tests/test_algorithm_registry.py):

    register("mean_of_neighbours", MeanOfNeighbours)

and the config section `mean_of_neighbours:` below joins the schema that `dfca.config.compose_config` builds
from the registry. To make it a product algorithm, move this file to shared/dfca/algorithms/ and put that
one line in shared/dfca/algorithms/__init__.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import Field
from torch import Tensor

from dfca.algorithms.base import Algorithm, Evaluation, Exchange, HostContext, Inbox, Outbox, params_in, state_of
from dfca.core import fold_models, init_cluster_models, round_seeds, train_assigned
from dfca.models.batched import Params
from dfca.sections import Strict
from dfca.wire.codec import TensorSpec


class MeanOfNeighboursConfig(Strict):
    """The config section `mean_of_neighbours:`."""

    own_weight: float = Field(1.0, ge=0.0, le=1000.0, description="w: the weight of a client's own model in the "
                              "mean, against 1 for each neighbour's")


class MeanOfNeighbours(Algorithm):
    """Every client keeps one model (k = 1) and replaces it by the mean of its neighbours' and its own."""

    links = frozenset({"neighbours"})
    clusters_clients = False  # one cluster: there is nothing to assign
    title = "mean of neighbours"
    section, Section = "mean_of_neighbours", MeanOfNeighboursConfig

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        cfg, m = ctx.cfg, len(ctx.clients)
        self.params: Params = init_cluster_models(ctx.model, ctx.clients, 1, cfg.seed, cfg.init, ctx.device)
        self.only = torch.zeros(m, dtype=torch.long, device=ctx.device)  # every client's cluster: 0
        self.weight = torch.ones(m, 1, device=ctx.device)
        self.losses = self.losses_of(self.params)

    def exchanges(self, t: int) -> list[Exchange]:
        return [Exchange("models", averaged=True)]  # one message to every neighbour, folded as a running mean

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        return self.model_spec()

    def begin_round(self, t: int) -> None:
        """theta_i <- SGD on D_i; the own model then enters the mean with weight w."""
        cfg, d = self.ctx.cfg, self.data()
        train_assigned(self.ctx.model, self.params, self.only, d.x_train, d.y_train, lr=self.schedule.lr(t),
                       epochs=self.schedule.epochs(t), batch_size=cfg.train.batch_size,
                       seeds=round_seeds(cfg.seed, self.ctx.clients, t))
        self.weight.fill_(cfg.mean_of_neighbours.own_weight)

    def send(self, ex: Exchange) -> Outbox:
        rows = torch.arange(len(self.ctx.clients), device=self.ctx.device)
        return Outbox(rows, self.only, {n: v[:, 0].clone() for n, v in self.params.items()})

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        """theta_i <- (c_i theta_i + sum of the arrivals) / (c_i + arrivals), c_i the weight folded so far."""
        return fold_models(self.params, self.weight, inbox.delivered.float(), inbox.part, inbox.tensors)

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
