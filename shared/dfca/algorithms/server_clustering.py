"""The clients of a server that clusters them by their uploaded models (DPMM-CFL, FeSEM), and what both servers share.

A round is two exchanges, as in DPMM-CFL's Algorithm 1:
- `upload`: every client trains the model of its cluster (line 5-6: omega_i <- Omega_{c_i}, then local SGD)
  and uploads omega_i with its sample count; the routing part is its present cluster id;
- `download`: the server, after clustering (line 7-9) and averaging (line 10-15), publishes one message: the
  K_t cluster models (a ragged first dimension, K_t <= N) and the assignment vector c^t. Every client takes
  Omega_{c_i}. The broker hands that one publish to every client, so a client receives K_t models a round
  where the paper sends it one; in exchange, a cluster that appears or disappears needs no new routing key or
  binding (clients bind `<experiment>.server.*`).

Cluster ids lie in 0..N-1 (a DP has at most N nonempty clusters among N clients), so `k` = N bounds the
routing part. Everyone starts in cluster 0 with one seeded random model (K_0 = 1, line 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
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
from dfca.algorithms.client_data import local_sgd, rows_of, sample_counts, test_accuracy, train_losses
from dfca.core import round_seeds
from dfca.models.batched import BatchedModel, Params
from dfca.wire.codec import TensorSpec

if TYPE_CHECKING:
    from dfca.sections import ExperimentBase

SERVER_GRACE = 2.0  # a client waits this many round timeouts for the server's models
CHAIN = ("splits_proposed", "splits_accepted", "merges_proposed", "merges_accepted")


def exchanges() -> list[Exchange]:
    return [Exchange("upload", receiver="server", needs_arrival=True),
            Exchange("download", sender="server", wait=SERVER_GRACE)]


def payload(algo: Algorithm, ex: Exchange) -> dict[str, TensorSpec]:
    if ex.name == "upload":
        return {**algo.model_spec(), "samples": TensorSpec((), "float32")}
    n = algo.ctx.cfg.data.clients
    models = {f"models.{name}": TensorSpec((n, *shape), ragged=True) for name, shape in algo.ctx.model.shapes().items()}
    return {**models, "assignment": TensorSpec((n,), "int64"), "chain": TensorSpec((len(CHAIN),), "float32")}


def initial_model(ctx: HostContext) -> Params:
    """Omega_1^0: one seeded random model, the same on every side."""
    return {n: v[0].to(ctx.device) for n, v in ctx.model.init(1, torch.Generator().manual_seed(ctx.cfg.seed)).items()}


def representation(model: BatchedModel, params: Params, which: str) -> Tensor:
    """[rows, d] float64: what a server clusters on, flattened: the final layer's tensors (BatchedModel.last_layer:
    the MLP's w2 and b2; a module's last layer with parameters, or the one its `dfca_last_layer` names), or every
    tensor."""
    names = model.last_layer() if which == "last_layer" else list(model.shapes())
    return torch.cat([params[n].flatten(1) for n in names], 1).double()


@torch.no_grad()
def macro_f1(model: BatchedModel, params: Params, x: Tensor, y: Tensor, classes: int,
             mask: Tensor | None = None) -> Tensor:
    """[M]: each client's macro-F1 on (x, y) with its own model params [M, ...], over the classes present in its
    labels or its predictions (scikit-learn's `f1_score(average="macro")`); mask [M, n]: its real samples."""
    pred = model.logits(params, x).argmax(-1)
    hot_true = torch.nn.functional.one_hot(y, classes).float()
    hot_pred = torch.nn.functional.one_hot(pred, classes).float()
    if mask is not None:
        hot_true, hot_pred = hot_true * mask.unsqueeze(2), hot_pred * mask.unsqueeze(2)
    tp = (hot_true * hot_pred).sum(1)
    support, predicted = hot_true.sum(1), hot_pred.sum(1)
    f1 = 2 * tp / (support + predicted).clamp(min=1)
    present = (support + predicted) > 0
    return (f1 * present).sum(1) / present.sum(1).clamp(min=1)


class ClusteredClients(Algorithm):
    """Clients that train their cluster's model and take their cluster, and its model, from the server."""

    links = frozenset({"server"})

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        self.k = ctx.cfg.data.clients
        m = len(ctx.clients)
        self.params: Params = {n: v.unsqueeze(0).repeat(m, *([1] * v.dim())) for n, v in initial_model(ctx).items()}
        self.cluster = torch.zeros(m, dtype=torch.long, device=ctx.device)
        self.chain = torch.zeros(len(CHAIN), device=ctx.device)
        self.local: Params = {}

    def exchanges(self, t: int) -> list[Exchange]:
        return exchanges()

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        return payload(self, ex)

    def begin_round(self, t: int) -> None:
        """Line 5-6: omega_i^{t,0} <- Omega_{c_i}, then local SGD (Q = local_epochs * ceil(n_i / B) steps)."""
        cfg, d = self.ctx.cfg, self.data()
        self.local = {n: v.clone() for n, v in self.params.items()}
        local_sgd(self.ctx.model, self.local, d, lr=self.schedule.lr(t), epochs=self.schedule.epochs(t),
                  batch_size=cfg.train.batch_size, seeds=round_seeds(cfg.seed, self.ctx.clients, t),
                  momentum=cfg.train.momentum, local_steps=cfg.train.local_steps)

    def send(self, ex: Exchange) -> Outbox:
        rows = torch.arange(len(self.ctx.clients), device=self.ctx.device)
        return Outbox(rows, self.cluster.clone(), {**self.local, "samples": sample_counts(self.data())})

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        """Line 14: client i takes its cluster c_i^t and Omega_{c_i}^t."""
        used = 0
        for s in range(inbox.delivered.shape[1]):
            rows = inbox.delivered[:, s].nonzero().flatten()
            if rows.numel() == 0:
                continue
            ids = torch.as_tensor(self.ctx.clients, device=self.ctx.device)[rows]
            cluster = inbox.tensors["assignment"][s].to(self.ctx.device)[ids]
            clusters = inbox.tensors[f"models.{next(iter(self.params))}"].shape[1]  # K_t: the models it carries
            if bool((cluster < 0).any() or (cluster >= clusters).any()):
                continue  # an assignment that names a model the message does not carry: not the server's
            for n in self.params:
                self.params[n][rows] = inbox.tensors[f"models.{n}"][s].to(self.ctx.device)[cluster]
            self.cluster[rows] = cluster
            self.chain = inbox.tensors["chain"][s].to(self.ctx.device)
            used += rows.numel()
        return used

    def evaluate(self) -> Evaluation:
        d, model = self.data(), self.ctx.model
        single = {n: v.unsqueeze(1) for n, v in self.params.items()}
        zero = torch.zeros_like(self.cluster)
        acc = test_accuracy(model, single, zero, d)
        loss = train_losses(model, single, d)[:, 0]
        f1 = torch.empty_like(acc)
        for rows, part in d.blocks():
            f1[slice(None) if rows is None else rows] = macro_f1(model, rows_of(self.params, rows), part.x_test,
                                                                 part.y_test, d.num_classes, part.test_mask)
        extra: dict[str, list[Any]] = {"macro_f1": f1.tolist()}
        for name, value in zip(CHAIN, self.chain.tolist(), strict=True):
            extra[name] = [value] * len(self.ctx.clients)
        return Evaluation(self.cluster.clone(), acc, loss, None, extra)

    def state(self) -> dict[str, Tensor]:
        return state_of(self.params, cluster=self.cluster, chain=self.chain)

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self.params = {n: v.to(self.ctx.device) for n, v in params_in(tensors).items()}
        self.cluster = tensors["cluster"].to(self.ctx.device)
        self.chain = tensors["chain"].to(self.ctx.device)

    @classmethod
    def run_metrics(cls, cfg: ExperimentBase, report: Mapping[str, list[Any]], data: Any,
                    graph: Graph) -> dict[str, float]:
        """K_t, the clients' mean macro-F1 and the sampler's acceptance rates this round."""
        out = {"inferred_clusters": float(len(set(report["assigned"]))),
               "macro_f1": float(np.mean(report["macro_f1"])) if report.get("macro_f1") else 0.0}
        if report.get("splits_proposed"):
            chain = {name: float(report[name][0]) for name in CHAIN}
            out["split_acceptance"] = chain["splits_accepted"] / max(chain["splits_proposed"], 1.0)
            out["merge_acceptance"] = chain["merges_accepted"] / max(chain["merges_proposed"], 1.0)
        return out


class ClusteringServer(Algorithm):
    """What DPMM-CFL's and FeSEM's servers share: the latest upload of every client, the assignment c and the
    cluster models Omega; `cluster(t)` (the algorithm's own step) sets c, `average` sets Omega (eq. 3)."""

    side = "server"

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        n = ctx.cfg.data.clients
        self.k = n
        start = initial_model(ctx)
        self.uploads: Params = {name: v.unsqueeze(0).repeat(n, *([1] * v.dim())) for name, v in start.items()}
        self.samples = torch.ones(n, device=ctx.device)
        self.assignment = torch.zeros(n, dtype=torch.long, device=ctx.device)
        self.models: Params = {name: v.unsqueeze(0).clone() for name, v in start.items()}  # [K, ...]
        self.chain = torch.zeros(len(CHAIN), device=ctx.device)
        self.round = 0

    def exchanges(self, t: int) -> list[Exchange]:
        return exchanges()

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        return payload(self, ex)

    def begin_round(self, t: int) -> None:
        self.round = t

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        """Keep each sender's latest upload (a client whose upload is lost is clustered on its last one)."""
        arrived = inbox.delivered.any(0).nonzero().flatten()
        for s in arrived.tolist():
            client = int(inbox.sender[s])
            for name in self.uploads:
                self.uploads[name][client] = inbox.tensors[name][s].to(self.ctx.device)
            self.samples[client] = float(inbox.tensors["samples"][s])
        return int(inbox.delivered.sum())

    def end_exchange(self, ex: Exchange) -> None:
        if ex.name == "upload":
            self.cluster(self.round)

    def cluster(self, t: int) -> None:
        raise NotImplementedError

    def representation(self, which: str) -> Tensor:
        """[N, d] float64: what the clustering sees of every client's upload."""
        return representation(self.ctx.model, self.uploads, which)

    def average(self, assignment: Tensor, clusters: int, weighting: str = "samples") -> Params:
        """Eq. (3): Omega_k = sum_{i: c_i = k} (n_i / N_k) omega_i ("uniform": Algorithm 1's 1 / m_k)."""
        w = self.samples if weighting == "samples" else torch.ones_like(self.samples)
        member = torch.nn.functional.one_hot(assignment, clusters).T.float() * w  # [K, N]
        member = member / member.sum(1, keepdim=True).clamp(min=1e-12)
        return {n: (member @ v.flatten(1)).view(clusters, *v.shape[1:]) for n, v in self.uploads.items()}

    def send(self, ex: Exchange) -> Outbox:
        zero = torch.zeros(1, dtype=torch.long, device=self.ctx.device)
        tensors = {f"models.{n}": v.unsqueeze(0).clone() for n, v in self.models.items()}
        return Outbox(zero, zero, {**tensors, "assignment": self.assignment.unsqueeze(0).clone(),
                                   "chain": self.chain.unsqueeze(0).clone()})

    def final_models(self) -> dict[str, Params]:
        k = next(iter(self.models.values())).shape[0]
        return {f"cluster_{j}": {n: v[j] for n, v in self.models.items()} for j in range(k)}

    def state(self) -> dict[str, Tensor]:
        models = {f"models.{n}": v for n, v in self.models.items()}
        return {**state_of(self.uploads), **models, "samples": self.samples, "assignment": self.assignment,
                "chain": self.chain}

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        device = self.ctx.device
        self.uploads = {n: v.to(device) for n, v in params_in(tensors).items()}
        self.models = {n: v.to(device) for n, v in params_in(tensors, "models.").items()}
        self.samples = tensors["samples"].to(device)
        self.assignment = tensors["assignment"].to(device)
        self.chain = tensors["chain"].to(device)


def generator_for(seed: int, t: int, stream: int) -> np.random.Generator:
    """The server's randomness in round t: reproducible, and the same after a restart from a checkpoint."""
    return np.random.default_rng(np.random.SeedSequence([seed % 2**63, t, stream]))
