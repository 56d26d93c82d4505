"""FedSPD (Lin et al. 2025, Algorithm 1): soft clustering for personalised decentralized FL.

Every client holds k cluster centers c_is, labels each of its samples with the cluster of least loss
(DATACLUSTERING) and keeps the shares u_is. Each round it draws one cluster s with probability u_is,
trains c_is for tau epochs on D_is (its samples labelled s), sends only that model to its neighbours
(one exchange, `models`), and averages c_is over the closed neighbourhood that updated s (eq. 1: a
neighbour's model of another cluster leaves its centers as they are); then it relabels its data.
After the last round it forms x_i = sum_s u_is c_is (eq. 2) and trains it for tau_final epochs on all
its data (FINALPHASE). Appendix B.1: the first round runs double local epochs, and the learning rate
decays by `fedspd.lr_decay` every `fedspd.lr_decay_every` rounds (dfca.schedule).

Before the final phase `evaluate` reports x_i without the extra training (FedSPD's "post aggregation"
accuracy, B.2.6); after it, the personalised models. The assigned cluster is argmax_s u_is; round
reports carry each client's `mixture` (u_is) and, on mixture data, the `true_mixture`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import Field
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
from dfca.algorithms.client_data import local_sgd, rows_of, test_accuracy, train_losses
from dfca.core import fold_models, gather_clusters, init_cluster_models, round_seeds, scatter_clusters
from dfca.core.soft_assignment import (
    datapoint_clusters,
    draw_clusters,
    mixture_shares,
    personalised_models,
    sample_losses,
)
from dfca.models.batched import Params
from dfca.schedule import RoundSchedule
from dfca.sections import Strict
from dfca.wire.codec import TensorSpec

FINAL_PHASE_ROUND = 1_000_003  # seed offset of the final phase's sample orders


# -- the config section `fedspd:` and the schedule it sets ------------------------------------------------------
class FedSPDConfig(Strict):
    """FedSPD (Lin et al. 2025, Algorithm 1 and Appendix B.1). Learning rate and batch size come from `train`."""

    local_epochs: int | None = Field(
        None, ge=1, le=10_000,
        description="tau: local epochs over D_is per round; None uses train.local_epochs (B.1: 5)"
    )
    double_first_round: bool = Field(True, description="B.1: the first round runs twice the local epochs")
    final_epochs: int = Field(
        10, ge=0, le=10_000, description="tau_final: local epochs on all local data after the last round (B.2.2: 10)"
    )
    lr_decay: float = Field(0.8, gt=0.0, le=1.0, description="B.1: multiplicative learning-rate decay factor")
    lr_decay_every: int = Field(
        10, ge=1, le=100_000, description="rounds between two decay steps (B.1 states the factor, not the period)"
    )


class FedSPDSchedule(RoundSchedule):
    """B.1: the learning rate also decays by fedspd.lr_decay every fedspd.lr_decay_every rounds; tau local epochs
    per round, twice as many in round 0."""

    def lr(self, t: int) -> float:
        """eta_t = train.lr * train.lr_decay^t * fedspd.lr_decay^floor(t / fedspd.lr_decay_every)."""
        o = self.cfg.fedspd
        return super().lr(t) * o.lr_decay ** (t // o.lr_decay_every)

    def epochs(self, t: int) -> int:
        """tau (fedspd.local_epochs, else train.local_epochs), doubled in round 0 under fedspd.double_first_round."""
        o = self.cfg.fedspd
        tau = o.local_epochs if o.local_epochs is not None else self.cfg.train.local_epochs
        return 2 * tau if t == 0 and o.double_first_round else tau


class FedSPD(Algorithm):
    links = frozenset({"neighbours"})
    title = "FedSPD"
    section, Section, Schedule = "fedspd", FedSPDConfig, FedSPDSchedule

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        self.k = cfg.clusters
        self.params: Params = init_cluster_models(ctx.model, ctx.clients, self.k, cfg.seed, cfg.init, ctx.device)
        self.selected = torch.zeros(len(ctx.clients), dtype=torch.long, device=ctx.device)
        self.trained: Params = {}
        self.weight = torch.zeros(len(ctx.clients), self.k, device=ctx.device)
        self.personal: Params | None = None  # x_i after the final phase
        self.relabel()

    def relabel(self) -> None:
        """DATACLUSTERING: every sample to its least-loss cluster; u_is = the shares of the labels (of the client's
        own samples: padding has no label that counts)."""
        d, model = self.data(), self.ctx.model
        if len(blocks := d.blocks()) == 1:
            self.labels = datapoint_clusters(sample_losses(model, self.params, d.x_train, d.y_train))
            self.shares = mixture_shares(self.labels, self.k, d.train_mask)
            return
        width = int(d.train_sizes.max())
        self.labels = torch.zeros(d.num_clients, width, dtype=torch.long, device=self.ctx.device)
        for rows, part in blocks:
            losses = sample_losses(model, rows_of(self.params, rows), part.x_train, part.y_train)
            self.labels[rows, : part.y_train.shape[1]] = datapoint_clusters(losses)
        real = torch.arange(width, device=self.ctx.device).unsqueeze(0) < d.train_sizes.unsqueeze(1)
        self.shares = mixture_shares(self.labels, self.k, real)

    def exchanges(self, t: int) -> list[Exchange]:
        return [Exchange("models", averaged=True, stale_ok=True)]

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        return self.model_spec()

    def begin_round(self, t: int) -> None:
        """Draw s_i with probability u_is, train c_{i,s_i} on D_{i,s_i} in place."""
        cfg, d, clients = self.ctx.cfg, self.data(), self.ctx.clients
        self.selected = draw_clusters(self.shares, round_seeds(cfg.seed * 31 + 7, clients, t))
        self.trained = gather_clusters(self.params, self.selected)  # c_{i,s_i}, trained on D_{i,s_i} only
        if epochs := self.schedule.epochs(t):
            local_sgd(self.ctx.model, self.trained, d, lr=self.schedule.lr(t), epochs=epochs,
                      batch_size=cfg.train.batch_size, seeds=round_seeds(cfg.seed, clients, t),
                      momentum=cfg.train.momentum, sample_mask=self.labels == self.selected.unsqueeze(1),
                      local_steps=cfg.train.local_steps)
            scatter_clusters(self.params, self.selected, self.trained)
        self.weight = torch.nn.functional.one_hot(self.selected, self.k).float()  # own copy counts for s_i only

    def send(self, ex: Exchange) -> Outbox:
        order = self.selected.argsort(stable=True)
        return Outbox(order, self.selected[order], {n: v[order] for n, v in self.trained.items()})

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        """Eq. 1: only a model of the cluster this client updated too joins its running average."""
        same = inbox.delivered & (inbox.part.unsqueeze(0) == self.selected.unsqueeze(1))
        return fold_models(self.params, self.weight, same, inbox.part, inbox.tensors)

    def end_round(self, t: int) -> None:
        self.relabel()
        if t + 1 == self.ctx.cfg.rounds:
            self.final_phase(t + 1)

    def final_phase(self, t: int) -> None:
        """FINALPHASE: x_i = sum_s u_is c_is (eq. 2), then tau_final epochs of local SGD on all of D_i."""
        cfg, d = self.ctx.cfg, self.data()
        personal = personalised_models(self.params, self.shares)
        local_sgd(self.ctx.model, personal, d, lr=self.schedule.lr(t), epochs=cfg.fedspd.final_epochs,
                  batch_size=cfg.train.batch_size, seeds=round_seeds(cfg.seed, self.ctx.clients, FINAL_PHASE_ROUND),
                  momentum=cfg.train.momentum, local_steps=cfg.train.local_steps)
        self.personal = personal

    def current_models(self) -> Params:
        """[M, 1, ...]: the personalised models, or x_i of eq. 2 before the final phase."""
        models = self.personal if self.personal is not None else personalised_models(self.params, self.shares)
        return {n: v.unsqueeze(1) for n, v in models.items()}

    def evaluate(self) -> Evaluation:
        d = self.data()
        models = self.current_models()
        only = torch.zeros(len(self.ctx.clients), dtype=torch.long, device=self.ctx.device)
        acc = test_accuracy(self.ctx.model, models, only, d)
        loss = train_losses(self.ctx.model, models, d)[:, 0]
        extra = {"mixture": self.shares.tolist()}
        if d.mixture is not None:
            extra["true_mixture"] = d.mixture.tolist()
        return Evaluation(self.shares.argmax(1), acc, loss, self.params, extra)

    def final_models(self) -> dict[str, Params]:
        """Cluster s's saved model: the mean of c_is over all clients."""
        return {f"cluster_{j}": {n: t[:, j].mean(0) for n, t in self.params.items()} for j in range(self.k)}

    def state(self) -> dict[str, Tensor]:
        personal = {f"personal.{n}": v for n, v in (self.personal or {}).items()}
        return state_of(self.params, **personal)

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self.params = {n: v.to(self.ctx.device) for n, v in params_in(tensors).items()}
        self.relabel()  # labels and u_is follow from the restored centers
        personal = {n: v.to(self.ctx.device) for n, v in params_in(tensors, "personal.").items()}
        self.personal = personal or None
