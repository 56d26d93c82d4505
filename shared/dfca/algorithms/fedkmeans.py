"""Federated k-means over networks (Yang, Rastelli and Jung, Algorithm 1), and distributed k-means (Forero, Cano and
Giannakis 2011), the paper's baseline. Both cluster the nodes' data points, not the nodes.

A node's model is its k centroids W_i [k, d] (core.kmeans), and they travel between neighbours like any model:
a round is one iteration t and one exchange, `centroids`, in which every node sends its W_i.

`fedkmeans` (GTVMin, (7)): every node starts from k-means++ on its own points. In round t the selected nodes
run the local update (8) with the centroids their neighbours sent: (E1)-(E3) and (M), eq. (11), repeated until
(8) falls by less than `fedkmeans.tol` or after `fedkmeans.passes` passes. `fedkmeans.selection`:
- parallel (the default): every node, from the snapshot of its neighbours' centroids. This is the distributed
  non-linear Jacobi iteration the paper names as its method (and runs in its experiments): one message per
  edge per round moves every node, where one node per iteration needs n rounds to move them all.
- random / round_robin: one node i_t per iteration (step 3 of Algorithm 1), a block-coordinate descent that
  never increases (7) (the paper's convergence claim, tested).
A neighbour whose centroids did not arrive this round counts with the last ones heard from it (none yet: it is
left out). `fedkmeans.alpha = 0` is local k-means, the paper's other baseline.

A point's weight (`fedkmeans.data_weight`). (8) and (11), the update that Algorithm 1 runs, divide the data term
by m_i: our default. (6), (7) and (9) weigh every point 1 (`data_weight: one`), the same family with alpha
divided by m_i: with it (7) is exactly what the updates descend and (9) is exactly k-means on the augmented
dataset; with 1/m_i the descended objective is (7) with L_i / m_i. Measured (isotropic, n = 10, p = 0.7,
m_i = 200, 10 seeds, 60 iterations; GCD mean): local k-means 0.027; 1/m_i: 0.0004 at alpha 0.5, 0.0072 at
alpha 1; weight 1: 0.023 and 0.019. (11) divides by max(., 1), which, read literally with 1/m_i, pulls every
centroid whose weights sum below 1 towards the origin (at alpha = 0 always, where the update must be plain
k-means); we read it as a guard: a centroid with nothing assigned (no point, no matched neighbour centroid)
keeps its place.

`distkmeans`: every node also starts from k-means++ on its own points, then runs D-KM, consensus on same-index
centroids by the primal-dual method with step `distkmeans.eta` (2 in the paper), with the centroids that
arrived this round.

Reports: each node's test accuracy is its clustering accuracy on its held-out points (nearest centroid, best
matching of centroids to true blobs); `run_metrics` adds eq. (12)'s GCD and CV, the point-level ARI, the
objective (7), and the loss (2) of centralised k-means on the pooled data (the reference), from every node's
centroids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from dfca.algorithms.base import Algorithm, Evaluation, Exchange, Graph, HostContext, Inbox, Outbox, params_in, state_of
from dfca.core.assignment import masked_mean
from dfca.core.cluster_refinement import agreement
from dfca.core.kmeans import (
    Neighbours,
    distributed_kmeans_step,
    gtv_update,
    kmeans_plus_plus,
    set_distance,
    squared_distances,
)
from dfca.core.label_matching import adjusted_rand_index
from dfca.data import FederatedData
from dfca.models.batched import Params
from dfca.sections import Strict
from dfca.wire.codec import TensorSpec

if TYPE_CHECKING:
    from dfca.sections import ExperimentBase

CENTROIDS = "centroids"


def initial_centroids(ctx: HostContext) -> Tensor:
    """[M, k, d]: k-means++ on every hosted node's points, each seeded by the node's id."""
    assert ctx.data is not None, "k-means nodes hold data"
    data, k = ctx.data.padded(), ctx.cfg.clusters
    points, count = data.x_train, data.train_sizes.tolist()
    return torch.stack([kmeans_plus_plus(points[r, : count[r]], k, ctx.cfg.seed * 1_000_003 + 31 * c + 17)
                        for r, c in enumerate(ctx.clients)])


# -- the config sections `fedkmeans:` and `distkmeans:` -----------------------------------------------------------
class FedKMeansConfig(Strict):
    """Federated k-means over networks (Yang, Rastelli and Jung, Algorithm 1; see algorithms.fedkmeans)."""

    alpha: float = Field(1.0, ge=0.0, le=1e6, description="GTV penalty of (7); 0 is local k-means")
    selection: Literal["parallel", "random", "round_robin"] = Field(
        "parallel", description="which nodes update per iteration: all (Jacobi, the paper's method), or one (step 3)"
    )
    e3: bool = Field(True, description="the assignment step (E3), component II of (8)")
    data_weight: Literal["mean", "one"] = Field(
        "mean", description="a point's weight in (8): mean = 1/m_i as (8) and (11) print (a neighbour centroid then "
        "weighs alpha against the whole local dataset's 1); one = 1 as in (6), (7), (9) (see algorithms.fedkmeans)",
    )
    passes: int = Field(20, ge=1, le=10_000, description="cap of (E1)-(E3), (M) passes per update")
    tol: float = Field(1e-6, ge=0.0, lt=1.0, description="stop the passes when (8) falls by less than this (relative)")


class DistKMeansConfig(Strict):
    """Distributed k-means (Forero, Cano and Giannakis 2011), the federated k-means paper's baseline."""

    eta: float = Field(2.0, gt=0.0, le=1e6, description="the primal-dual step; the paper uses 2")


class KMeansNodes(Algorithm):
    """What both k-means algorithms share: centroids as the model, one exchange a round, the reports."""

    links = frozenset({"neighbours"})
    clusters_clients = False
    feature_vectors, trains_classifier = True, False

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        self.k = ctx.cfg.clusters
        self.points = self.data().padded()  # a node's points (feature vectors: padded in one tensor set)
        self.centroids = initial_centroids(ctx)  # W [M, k, d]
        self.round = 0

    def begin_round(self, t: int) -> None:
        self.round = t

    @property
    def params(self) -> Params:
        return {CENTROIDS: self.centroids}

    def exchanges(self, t: int) -> list[Exchange]:
        return [Exchange(CENTROIDS, stale_ok=True)]

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        return {CENTROIDS: TensorSpec(tuple(self.centroids.shape[1:]))}

    def send(self, ex: Exchange) -> Outbox:
        rows = torch.arange(len(self.ctx.clients), device=self.ctx.device)
        return Outbox(rows, torch.zeros_like(rows), {CENTROIDS: self.centroids.clone()})

    def evaluate(self) -> Evaluation:
        d = self.points
        near = squared_distances(d.x_test, self.centroids).argmin(-1)  # [M, n_test]
        accuracy = torch.tensor([agreement(p[:n].numpy(), t[:n].numpy()) for p, t, n in
                                 zip(near.cpu(), d.y_test.cpu(), d.test_sizes.tolist(), strict=True)])
        nearest = squared_distances(d.x_train, self.centroids).min(-1).values
        loss = nearest.mean(1) if d.train_mask is None else masked_mean(nearest, d.train_mask)
        only = torch.zeros(len(self.ctx.clients), dtype=torch.long, device=self.ctx.device)
        return Evaluation(only, accuracy.to(self.ctx.device), loss, {CENTROIDS: self.centroids},
                          {CENTROIDS: self.centroids.tolist()})

    def final_models(self) -> dict[str, Params]:
        return {f"node_{c}": {CENTROIDS: self.centroids[r]} for r, c in enumerate(self.ctx.clients)}

    @classmethod
    def run_metrics(cls, cfg: ExperimentBase, report: Mapping[str, list[Any]], data: Callable[[], FederatedData],
                    graph: Graph) -> dict[str, float]:
        return kmeans_metrics(cfg, data(), graph, report)


class FedKMeans(KMeansNodes):
    title = "federated k-means"
    section, Section = "fedkmeans", FedKMeansConfig

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        d = self.points
        if (mask := d.train_mask) is None:
            m = d.y_train.shape[1]
            weight = 1.0 if ctx.cfg.fedkmeans.data_weight == "one" else 1.0 / m
            self.point_weight = torch.full((len(ctx.clients),), weight, device=ctx.device)
        else:  # each point's a: 1 or 1 / m_i of its own node, 0 at padding
            a = 1.0 if ctx.cfg.fedkmeans.data_weight == "one" else 1.0 / d.train_sizes.unsqueeze(1).float()
            self.point_weight = mask.float() * a
        self.forget_neighbours()

    def forget_neighbours(self) -> None:
        """Slots for each node's neighbours' last centroids (heard [M, D, k, d]), none heard yet."""
        graph, clients = self.ctx.graph, self.ctx.clients
        degree = max((len(graph.get(c, ())) for c in clients), default=0)
        self.slot = torch.full((len(clients), self.ctx.cfg.data.clients), -1, dtype=torch.long)  # [M, N]: -1 or j
        for r, c in enumerate(clients):
            for j, m in enumerate(sorted(graph.get(c, ()))):
                self.slot[r, m] = j
        self.slot = self.slot.to(self.ctx.device)
        self.heard = torch.zeros(len(clients), degree, *self.centroids.shape[1:], device=self.ctx.device)
        self.heard_round = torch.full((len(clients), degree), -1, dtype=torch.long, device=self.ctx.device)

    def set_graph(self, graph: Graph) -> None:
        """A topology change: the centroids stay; every neighbour is heard afresh."""
        super().set_graph(graph)
        self.forget_neighbours()

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        """Keep each neighbour's newest centroids (a late message of an earlier round does not overwrite newer)."""
        rows, cols = inbox.delivered.nonzero(as_tuple=True)
        slot = self.slot[rows, inbox.sender[cols]]  # -1: not a neighbour
        keep = (slot >= 0) & (inbox.round >= self.heard_round[rows, slot.clamp_min(0)])
        rows, cols, slot = rows[keep], cols[keep], slot[keep]
        self.heard[rows, slot] = inbox.tensors[CENTROIDS][cols].to(self.heard.dtype)
        self.heard_round[rows, slot] = inbox.round
        return int(keep.sum())

    def selected(self, t: int) -> Tensor:
        """[M] bool: the nodes that update in round t."""
        rule, n = self.ctx.cfg.fedkmeans.selection, self.ctx.cfg.data.clients
        if rule == "parallel":
            return torch.ones(len(self.ctx.clients), dtype=torch.bool, device=self.ctx.device)
        node = t % n if rule == "round_robin" else int(torch.randint(n, (1,), generator=torch.Generator()
                                                                        .manual_seed(self.ctx.cfg.seed * 7919 + t)))
        return self.ctx.rows == node

    def end_exchange(self, ex: Exchange) -> None:
        """Step 5 of Algorithm 1 at the selected nodes: (E1)-(E3) and (M) until (8) stops falling."""
        cfg = self.ctx.cfg.fedkmeans
        rows = self.selected(self.round).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        near = Neighbours(self.heard[rows], self.heard_round[rows] >= 0)
        w, _ = gtv_update(self.points.x_train[rows], self.centroids[rows], near, cfg.alpha, self.point_weight[rows],
                             with_e3=cfg.e3, passes=cfg.passes, tol=cfg.tol)
        self.centroids[rows] = w

    def state(self) -> dict[str, Tensor]:
        return state_of(self.params, heard=self.heard, heard_round=self.heard_round)

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self.centroids = params_in(tensors)[CENTROIDS].to(self.ctx.device)
        self.heard, self.heard_round = tensors["heard"].to(self.ctx.device), tensors["heard_round"].to(self.ctx.device)


class DistKMeans(KMeansNodes):
    title = "distributed k-means"
    section, Section = "distkmeans", DistKMeansConfig

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        self.dual = torch.zeros_like(self.centroids)  # v [M, k, d]
        self.arrived: dict[int, list[Tensor]] = {}  # row -> this round's neighbour centroids

    def begin_round(self, t: int) -> None:
        super().begin_round(t)
        self.arrived = {}

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        """D-KM needs every neighbour's centroids of this round; a late one is of no use."""
        if inbox.round != self.round:
            return 0
        for r, s in inbox.delivered.nonzero().tolist():
            self.arrived.setdefault(r, []).append(inbox.tensors[CENTROIDS][s].to(self.centroids.dtype))
        return int(inbox.delivered.sum())

    def end_exchange(self, ex: Exchange) -> None:
        n_rows, k, dim = self.centroids.shape
        most = max((len(v) for v in self.arrived.values()), default=0)
        theirs = torch.zeros(n_rows, most, k, dim, device=self.ctx.device)
        mask = torch.zeros(n_rows, most, dtype=torch.bool, device=self.ctx.device)
        for r, got in self.arrived.items():
            theirs[r, : len(got)] = torch.stack(got)
            mask[r, : len(got)] = True
        self.centroids, self.dual = distributed_kmeans_step(self.points.x_train, self.centroids, self.dual,
                                                            Neighbours(theirs, mask), self.ctx.cfg.distkmeans.eta,
                                                            self.points.train_mask)

    def state(self) -> dict[str, Tensor]:
        return state_of(self.params, dual=self.dual)

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self.centroids = params_in(tensors)[CENTROIDS].to(self.ctx.device)
        self.dual = tensors["dual"].to(self.ctx.device)


_REFERENCES: dict[tuple[Any, ...], Tensor] = {}  # the data's config -> W^cen (it depends on nothing else)


def centralised_centroids(cfg: ExperimentBase, points: Tensor) -> Tensor:
    """k-means on the pooled points [P, d] (k-means++, 10 starts, seeded): eq. (12)'s reference W^cen."""
    from sklearn.cluster import KMeans  # when used: slow to import

    key = (cfg.data.model_dump_json(), cfg.seed, cfg.clusters, tuple(points.shape))
    if key not in _REFERENCES:
        fit = KMeans(cfg.clusters, init="k-means++", n_init=10, random_state=cfg.seed % 2**31)
        _REFERENCES[key] = torch.from_numpy(fit.fit(points.double().numpy()).cluster_centers_).float()
        while len(_REFERENCES) > 16:
            _REFERENCES.pop(next(iter(_REFERENCES)))
    return _REFERENCES[key]


def kmeans_metrics(cfg: ExperimentBase, data: FederatedData, graph: Graph,
                   report: Mapping[str, list[Any]]) -> dict[str, float]:
    """Eq. (12) and company over the nodes in `report` (clients, centroids): GCD, CV, point ARI, the objective (7),
    and `centralised_loss`, the k-means loss (2) of W^cen on the reported nodes' points.

    GCD = sum_i d(W_i, W^cen) / (2 n k); CV = sum_{i: |N_i| > 0} (1/|N_i|) sum_{i' in N_i} d(W_i, W_i') / (2 k n_eff),
    d of eq. (4), over the reported nodes and the edges between them; point_ari: the mean over nodes of the
    ARI of their points' nearest centroids against the true blobs.
    """
    clients = [int(c) for c in report["clients"]]
    w = torch.tensor(report[CENTROIDS], dtype=torch.float32)  # [n, k, d]
    row = {c: r for r, c in enumerate(clients)}
    data = data.padded()
    x, y = data.x_train[clients].cpu(), data.y_train[clients].cpu()
    sizes = data.train_sizes.tolist()
    counts = torch.tensor([sizes[c] for c in clients])  # m_i of the reported nodes
    real = torch.arange(x.shape[1]).unsqueeze(0) < counts.unsqueeze(1)
    pooled = (data.x_train.reshape(-1, data.x_train.shape[-1]) if data.train_mask is None
              else torch.cat([data.x_train[c, : sizes[c]] for c in range(data.num_clients)]))
    reference = centralised_centroids(cfg, pooled.cpu())
    k = cfg.clusters
    gcd = float(set_distance(w, reference.expand_as(w)).sum()) / (2 * len(clients) * k)
    per_node = []  # (1/|N_i|) sum_{i' in N_i} d(W_i, W_i'), for the nodes with a neighbour
    for c in clients:
        near = [row[m] for m in graph.get(c, ()) if m in row]
        if near:
            per_node.append(float(set_distance(w[row[c]].expand(len(near), *w.shape[1:]), w[near]).mean()))
    cv = sum(per_node) / (2 * k * len(per_node)) if per_node else 0.0
    edges = [(row[c], row[m]) for c in clients for m in graph.get(c, ()) if m in row and m > c]
    gtv = sum(float(set_distance(w[a], w[b])) for a, b in edges)  # each undirected edge once, as in (7)
    labels = squared_distances(x, w).argmin(-1)
    ari = float(np.mean([adjusted_rand_index(t[:n].numpy(), p[:n].numpy())
                         for t, p, n in zip(y, labels, counts.tolist(), strict=True)]))
    losses = (squared_distances(x, w).min(-1).values * real).sum(1)  # L_i of (6), over the node's own points
    point_weight: float | Tensor = 1.0 if cfg.fedkmeans.data_weight == "one" else 1.0 / x.shape[1]
    if data.train_mask is not None and cfg.fedkmeans.data_weight != "one":
        point_weight = 1.0 / counts.float()  # a = 1 / m_i, each node its own
    alpha = cfg.fedkmeans.alpha if cfg.algorithm == "fedkmeans" else 0.0
    return {
        "gcd": gcd,
        "cv": cv,
        "point_ari": ari,
        "objective": float((point_weight * losses).sum() if isinstance(point_weight, Tensor)
                           else point_weight * losses.sum()) + alpha * gtv,
        "centralised_loss": float((squared_distances(x, reference).min(-1).values * real).sum()),
    }

