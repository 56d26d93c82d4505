"""FedCRef (Nardi, Valerio and Passarella, "Federated Clustering: an unsupervised cluster-wise training for
decentralized data distributions"), Algorithms 1 and 2, without a central node.

Every client holds K_i unlabelled categories (data.categories) and a rough initial clustering of its samples into
K_i clusters Q_iq: the true categories with each sample moved to a wrong cluster with probability `dirtiness`
(the paper's simulated clustering), or k-means on a local autoencoder's codes (in place of DEC). A round is one
iteration of Algorithm 1's while loop:

    begin_round  line 7      every client whose clusters changed trains a fresh AE_iq on each cluster Q_iq (eq. 1)
    `models`     line 9      all-to-all: every client sends its K_i autoencoders and its cluster sizes
                 line 11     on arrival, client i evaluates AE_jp on its own data: for each of its clusters q,
                             one direction of eq. (2), Pr{Normalize|E_iq->iq - E_jp->iq| <= theta} >= alpha
    `associations` line 13   every client sends its verdicts (a bitmask per (q, j)); an edge (iq, jp) of Gamma
                 line 17-20  needs both directions. Every client builds the same Gamma and takes its connected
                             components with >= 2 clusters as communities G (eq. 3), the rest as isolated I
    `fedavg` x R line 21-23  FedAvg of one autoencoder AE_Gp per community, started from the size-weighted mean of
                             its members' AE_iq: each member trains its copy on its cluster and sends it to all;
                             everyone averages (weights: cluster sizes), so every client holds every AE_Gp (line 25)
    `merges`     (ours)      every client tests every AE_Gb on each of its clustered clusters (eq. 2, against its
                             own community's model) and sends the verdicts; communities that a majority of each
                             other's clusters vote for are joined, their models averaged by size (`fedcref.merge`)
    end_round    line 26-31  every active client refines its clusters with its K_i local and the |G| community
                             models (Algorithm 2) and goes inactive once ACC(previous, new labels) >= tau

The run stops when the number of communities and of isolated clusters changed by at most `stable_change` (10%)
over `stable_iterations` (3) iterations, or after `rounds` iterations. Every client reaches the same decision:
Gamma is common knowledge.

Where the paper leaves a choice open (each measured in docs/fedcref.md):
- no central node: the paper builds Gamma and aggregates on one node; here every client does both from messages
  it receives anyway, since the exchange is all-to-all. It costs one more all-to-all exchange of N K_max int64s
  per client per iteration, and it makes every FedAvg update reach every client (N - 1 receivers, where a
  community's FedAvg needs only its members): models cross the wire N (N - 1) times per FedAvg round.
- Inactive clients still train their clusters' share of the community models (they "participate in the federated
  learning process"), but neither retrain their local models nor refine.
- Line 7 trains a fresh AE_iq (one seeded initialisation for every autoencoder) on each cluster that changed since
  its model was trained: every iteration for an active client, once more after its last refinement for one that
  went inactive (so what it sends matches its final clusters), never again after that. Training on from the
  previous iteration's model instead (warm start) let the models overfit their small clusters: associations
  decayed over iterations, isolated clusters grew from 6 to 43-52 of 71, and at dirtiness 0.3 two seeds in five
  ended with 0.72 and 0.75 ACC and 9 and 6 communities.
- Eq. (2) is a share, as printed: the share of normalised differences <= theta must reach alpha. What normalises
  a difference is `fedcref.scale`: by default the sample's own error (as printed, min-max over the differences,
  it associated no pair here, not even two clean clusters of one digit: benchmarks/fedcref_association.py).
- Joining communities (`merges`) is ours. Without it, a category whose clusters did not all associate stays split
  into several communities, and in Algorithm 2 those split the category's votes: a 3/9 client saw its 3s divided
  between two 3-communities, a mixed 4/9 community won the second pick, and its ACC fell from 0.95 to 0.57. The
  community models, trained on many clusters, reconstruct each other's clusters where the small local models did
  not. At dirtiness 0.3, without joining the communities ended at 10-14 (one seed in five beyond +-2); with it,
  at 10-11, with a final ACC as high or higher in every seed (docs/fedcref.md).
- The paper's other stop rule, no active client left, is subsumed: with nobody active, Gamma no longer changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from dfca.algorithms.base import Algorithm, Evaluation, Exchange, Graph, HostContext, Inbox, Outbox, params_in, state_of
from dfca.core import autoencoder as ae
from dfca.core.cluster_refinement import agreement, communities, dirty_labels, merged_communities, reconstructs, refine
from dfca.data import FederatedData
from dfca.data.categories import category_range
from dfca.sections import MAX_CATEGORIES_PER_CLIENT, Strict
from dfca.wire.codec import TensorSpec

if TYPE_CHECKING:
    from dfca.sections import ExperimentBase

MODELS, ASSOCIATIONS, FEDAVG, MERGES = "models", "associations", "fedavg", "merges"
VOTE_BITS = 62  # community votes per int64 word


def training_seed(seed: int, client: int, cluster: int, t: int, step: int) -> int:
    """The minibatch order of one training run: a function of who trains what, when (never of the host)."""
    return int(np.random.SeedSequence([seed % 2**63, client, cluster, t, step]).generate_state(1)[0])


def vote_words(groups: int) -> int:
    """int64 words that carry one cluster's votes on `groups` communities (at least one)."""
    return max(1, -(-groups // VOTE_BITS))


def bits(flags: Tensor) -> Tensor:
    """[..., K] bool -> [...] int64 with bit p set where flags[..., p]."""
    weights = 2 ** torch.arange(flags.shape[-1], device=flags.device, dtype=torch.long)
    return (flags.long() * weights).sum(-1)


def unbits(words: Tensor, k: int) -> Tensor:
    """[...] int64 -> [..., k] bool."""
    return (words.unsqueeze(-1) >> torch.arange(k, device=words.device)) & 1 == 1


# -- the config section `fedcref:` and what FedCRef asks of the others ---------------------------------------------
MAX_FEDCREF_CLIENTS = 1000

class FedCRefConfig(Strict):
    """FedCRef (Nardi, Valerio and Passarella; algorithms.fedcref): cluster-wise federated autoencoders."""

    init: Literal["dirty", "kmeans"] = Field(
        "dirty", description="the initial local clustering: dirty, the true categories with each sample moved to a "
        "wrong cluster with probability `dirtiness` (Tables 3-4); kmeans, k-means on a local autoencoder's codes",
    )
    dirtiness: float = Field(0.3, ge=0.0, le=1.0, description="dirty: probability a sample starts in a wrong cluster")
    percentile: float = Field(75.0, gt=0.0, le=100.0, description="alpha of eq. (2), in percent")
    scale: Literal["relative", "errors", "differences"] = Field(
        "relative", description="what normalises eq. (2)'s absolute differences: each sample's own error (relative, "
        "the default), the min-max range of both error vectors (errors), or the differences' own range as printed "
        "(differences: it rarely associates here; docs/fedcref.md)",
    )
    theta: float = Field(0.2, ge=0.0, le=1.0, description="theta of eq. (2): the association threshold")
    tau: float = Field(0.8, ge=0.0, le=1.0, description="a client stops training and refining once the ACC between "
                       "its consecutive labellings reaches tau")
    layers: list[int] = Field(default_factory=lambda: [100, 64, 32], min_length=1, max_length=8,
                              description="encoder widths; the decoder mirrors them (d-100-64-32-64-100-d)")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="Adam's learning rate")
    batch_size: int = Field(32, ge=1, le=100_000)
    local_epochs: int = Field(10, ge=0, le=10_000,
                              description="epochs that train each local cluster model per iteration")
    fedavg_rounds: int = Field(15, ge=0, le=1000, description="FedAvg rounds that train each community model")
    fedavg_epochs: int = Field(1, ge=1, le=1000, description="local epochs of a community member per FedAvg round")
    stable_iterations: int = Field(3, ge=1, le=1000, description="the run stops when the number of communities and "
                                   "of isolated clusters changed by at most `stable_change` over this many iterations")
    stable_change: float = Field(0.1, ge=0.0, le=1.0)
    merge: bool = Field(True, description="after FedAvg, join the communities whose models reconstruct each other's "
                        "clusters (eq. 2 between community models, a majority of each side's clusters); not in the "
                        "paper: docs/fedcref.md")
    merge_share: float = Field(0.5, gt=0.0, le=1.0, description="the share of a community's clusters that must be "
                               "reconstructed by the other community's model for the two to join (both ways)")


class FedCRef(Algorithm):
    links = frozenset({"neighbours"})
    clusters_clients = False  # it clusters every client's samples, not the clients
    title = "FedCRef"
    section, Section = "fedcref", FedCRefConfig
    partition = "categories"
    trains_classifier = False  # its models are autoencoders

    @classmethod
    def config_defaults(cls, data: dict[str, Any]) -> dict[str, Any]:
        """FedCRef implies its setting unless the config names another: data.partition: categories and
        topology.kind: complete (the all-to-all exchange of Algorithm 1)."""
        out = dict(data)
        for section, key, value in (("data", "partition", "categories"), ("topology", "kind", "complete")):
            given = out.get(section, {})
            if isinstance(given, dict) and key not in given:
                out[section] = {**given, key: value}
        return out

    @classmethod
    def check_config(cls, cfg: ExperimentBase) -> None:
        data = cfg.data
        if cfg.topology.kind != "complete":
            raise ValueError("topology.kind: fedcref exchanges models all-to-all (Algorithm 1, line 9): use complete")
        if cfg.network.message_loss or cfg.network.message_delay:
            raise ValueError("network.message_loss: fedcref needs every model and association of an iteration "
                             "(set network.message_loss and message_delay to 0)")
        if data.clients > MAX_FEDCREF_CLIENTS:
            raise ValueError(f"data.clients: fedcref compares every pair of clusters, O((sum K_i)^2) per iteration; "
                             f"at most {MAX_FEDCREF_CLIENTS} clients")
        if data.features != "none":
            raise ValueError("data.features: fedcref's autoencoders reconstruct images (use none)")
        if data.categories_per_client is not None:
            low, high = data.categories_per_client
            if not 1 <= low <= high <= MAX_CATEGORIES_PER_CLIENT:
                raise ValueError(f"data.categories_per_client: need 1 <= low <= high <= {MAX_CATEGORIES_PER_CLIENT}, "
                                 f"got [{low}, {high}]")

    @classmethod
    def rounds_note(cls, cfg: ExperimentBase) -> str:
        return " at most (FedCRef stops when its communities settle)"

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        cfg, d = ctx.cfg, self.data().padded()
        self.options = cfg.fedcref
        self.n_clients = cfg.data.clients
        self.k_max = category_range(cfg, d.num_classes)[1]
        self.x = d.x_train.flatten(2)  # [M, n_max, d]
        real = d.train_mask
        self.valid = d.y_train >= 0 if real is None else (d.y_train >= 0) & real  # [M, n_max]: not padding
        self.truth = torch.where(self.valid, d.y_train, -1)  # the categories' labels, -1 on padding
        self.counts = self.valid.sum(1)
        self.k = 1
        self.clusters = torch.tensor([int(torch.unique(y[y >= 0]).numel()) for y in self.truth], device=ctx.device)
        dim = self.x.shape[-1]
        self.layout = ae.shapes(dim, self.options.layers)
        rows = len(ctx.clients)
        self.fresh = ae.init(1, dim, self.options.layers, cfg.seed, ctx.device)  # every AE_iq starts here
        self.local = {n: v.repeat(rows, self.k_max, *([1] * (v.dim() - 1))).view(rows, self.k_max, *v.shape[1:])
                      for n, v in self.fresh.items()}  # AE_iq [M, K_max, ...]
        self.stale = torch.ones(rows, dtype=torch.bool)  # its clusters changed since its AE_iq were trained
        self.labels = self.initial_labels()
        self.initial_acc = torch.tensor([self.accuracy(r) for r in range(rows)])
        self.active = torch.ones(rows, dtype=torch.bool)
        self.own_errors = torch.zeros_like(self.x[..., 0])  # [M, n_max]: each sample under its cluster's model
        self.node_category = torch.full((rows, self.k_max), -1, dtype=torch.long)
        self.node_community = torch.full((rows, self.k_max), -1, dtype=torch.long)
        self.community: dict[str, Tensor] = {n: torch.zeros(0, *s, device=ctx.device) for n, s in self.layout.items()}
        self.history: list[tuple[int, int]] = []  # (|G|, |I|) per iteration
        self.done = False
        self.round = 0
        self.reset_tables()

    # -- the schedule -----------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.done

    def exchanges(self, t: int) -> list[Exchange]:
        if self.done:
            return []
        merges = [Exchange(MERGES)] if self.options.merge else []
        return [Exchange(MODELS), Exchange(ASSOCIATIONS),
                *[Exchange(FEDAVG, step=s) for s in range(self.options.fedavg_rounds)], *merges]

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        models = {f"models.{n}": TensorSpec((self.k_max, *s), ragged=True) for n, s in self.layout.items()}
        if ex.name == MODELS:
            return {**models, "sizes": TensorSpec((self.k_max,), "float32"), "clusters": TensorSpec((), "int64")}
        if ex.name == ASSOCIATIONS:
            return {"verdicts": TensorSpec((self.k_max, self.n_clients), "int64")}
        if ex.name == MERGES:
            most = vote_words(self.n_clients * self.k_max // 2)  # at most N K_max / 2 communities
            return {"votes": TensorSpec((most, self.k_max), "int64", ragged=True)}
        return {**models, "which": TensorSpec((), "int64")}

    # -- step 0: the initial clustering -----------------------------------------------------------------------
    def initial_labels(self) -> Tensor:
        """[M, n_max]: Q_i, the initial clusters (-1 on padding)."""
        from sklearn.cluster import KMeans  # when used: slow to import

        o, cfg = self.options, self.ctx.cfg
        labels = torch.full_like(self.truth, -1)
        codes = self.local_codes() if o.init == "kmeans" else None
        for r, client in enumerate(self.ctx.clients):
            ok = self.valid[r]
            if codes is None:
                rng = np.random.default_rng(np.random.SeedSequence([cfg.seed % 2**63, client, 17]))
                found = dirty_labels(self.truth[r, ok].cpu().numpy(), o.dirtiness, rng)
            else:
                fit = KMeans(int(self.clusters[r]), n_init=10, random_state=(cfg.seed + client) % 2**31)
                found = fit.fit(codes[r, : int(self.counts[r])].cpu().numpy()).labels_.astype(np.int64)
            labels[r, ok] = torch.from_numpy(found).to(labels.device)
        return labels

    def local_codes(self) -> Tensor:
        """[M, n_max, code]: every sample's code under one autoencoder per client, trained on all its samples
        (2 x local_epochs) for k-means, in place of the paper's DEC."""
        o, rows = self.options, len(self.ctx.clients)
        start = ae.init(rows, self.x.shape[-1], o.layers, self.ctx.cfg.seed, self.ctx.device)
        seeds = [training_seed(self.ctx.cfg.seed, c, 99, 0, 0) for c in self.ctx.clients]
        trained = ae.train(start, self.x, self.counts.tolist(), seeds, max(o.local_epochs, 1) * 2, o.lr, o.batch_size)
        return ae.code(trained, self.x)

    # -- line 7: local training ---------------------------------------------------------------------------------
    def begin_round(self, t: int) -> None:
        self.round = t
        self.reset_tables()
        if self.done:
            return
        pairs = [(r, q) for r in range(len(self.ctx.clients)) if self.stale[r] for q in range(int(self.clusters[r]))]
        if pairs:
            start = {n: v.expand(len(pairs), *v.shape[1:]) for n, v in self.fresh.items()}
            trained = self.train_on_clusters(pairs, start, self.options.local_epochs, t, 0)
            rows, qs = torch.tensor([r for r, _ in pairs]), torch.tensor([q for _, q in pairs])
            for n in self.local:
                self.local[n][rows, qs] = trained[n]
        self.stale[:] = False
        for r in range(len(self.ctx.clients)):
            err = ae.errors({n: v[r] for n, v in self.local.items()}, self.x[r])  # [K_max, n_max]
            self.own_errors[r] = err.gather(0, self.labels[r].clamp(min=0).unsqueeze(0)).squeeze(0)

    def train_on_clusters(self, pairs: list[tuple[int, int]], start: dict[str, Tensor], epochs: int, t: int,
                          step: int) -> dict[str, Tensor]:
        """Train start[s] on cluster pairs[s] = (row, q); returns the trained models [len(pairs), ...]."""
        if not pairs:
            return start
        members = [(self.labels[r] == q).nonzero().flatten() for r, q in pairs]
        width = max(1, max(int(m.numel()) for m in members))
        xs = torch.zeros(len(pairs), width, self.x.shape[-1], device=self.x.device)
        for s, ((r, _), m) in enumerate(zip(pairs, members, strict=True)):
            xs[s, : m.numel()] = self.x[r, m]
        seeds = [training_seed(self.ctx.cfg.seed, self.ctx.clients[r], q, t, step) for r, q in pairs]
        o = self.options
        return ae.train(start, xs, [int(m.numel()) for m in members], seeds, epochs, o.lr, o.batch_size)

    # -- the exchanges -----------------------------------------------------------------------------------------
    def reset_tables(self) -> None:
        """What this host learns in one iteration, about every client (the exchanges are all-to-all)."""
        self.heard: dict[int, tuple[dict[str, Tensor], Tensor]] = {}  # client -> (its AE_iq [K_i, ...], sizes)
        self.verdicts: dict[int, Tensor] = {}  # client -> [K_max, N] bitmasks over the other client's clusters
        self.updates: dict[tuple[int, int], dict[str, Tensor]] = {}  # (client, q) -> its FedAvg update
        self.folded: set[int] = set()  # senders of the open FedAvg step already folded
        self.node_of: np.ndarray = np.full(self.n_clients * self.k_max, -1, dtype=np.int64)  # community per node
        # the hosted rows' own verdicts, [M, K_max, N]: bit p of [r, q, j] says AE_jp reconstructs cluster q of row r
        self.row_verdicts = torch.zeros(len(self.ctx.clients), self.k_max, self.n_clients, dtype=torch.long)
        self.votes: dict[int, Tensor] = {}  # client -> [K_max, |G|]: which community models reconstruct its clusters

    def groups(self) -> int:
        """|G|: the communities of this iteration (every client holds every community's model)."""
        return int(next(iter(self.community.values())).shape[0])

    def sizes(self) -> Tensor:
        """[M, K_max] samples per cluster."""
        hot = torch.nn.functional.one_hot(self.labels.clamp(min=0), self.k_max) * self.valid.unsqueeze(-1)
        return hot.sum(1).float()

    def send(self, ex: Exchange) -> Outbox:
        rows = torch.arange(len(self.ctx.clients), device=self.ctx.device)
        zero = torch.zeros_like(rows)
        if ex.name == MODELS:
            sizes = self.sizes()
            for r, c in enumerate(self.ctx.clients):
                k = int(self.clusters[r])
                self.heard[c] = ({n: v[r, :k].clone() for n, v in self.local.items()}, sizes[r].cpu())
            tensors = {f"models.{n}": v.clone() for n, v in self.local.items()}
            return Outbox(rows, zero, {**tensors, "sizes": sizes, "clusters": self.clusters.clone()},
                          lengths=self.clusters.clone())
        if ex.name == ASSOCIATIONS:
            for r, c in enumerate(self.ctx.clients):
                self.verdicts[c] = self.row_verdicts[r].clone()
            return Outbox(rows, zero, {"verdicts": self.row_verdicts.to(self.ctx.device)})
        if ex.name == MERGES:
            return self.send_votes(rows, zero)
        return self.send_update(ex, rows, zero)

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        if ex.name == MODELS:
            return self.receive_models(inbox)
        if ex.name == ASSOCIATIONS:
            for s in inbox.delivered.any(0).nonzero().flatten().tolist():
                self.verdicts[int(inbox.sender[s])] = inbox.tensors["verdicts"][s].cpu()
            return int(inbox.delivered.sum())
        if ex.name == MERGES:
            groups = self.groups()
            for s in inbox.delivered.any(0).nonzero().flatten().tolist():
                self.votes[int(inbox.sender[s])] = self.unpack_votes(inbox.tensors["votes"][s].cpu(), groups)
            return int(inbox.delivered.sum())
        return self.receive_update(inbox)

    def receive_models(self, inbox: Inbox) -> int:
        """Line 11-12, this side of eq. (2): every delivered AE_jp against each cluster of each receiving row."""
        o = self.options
        for s in inbox.delivered.any(0).nonzero().flatten().tolist():
            sender, k = int(inbox.sender[s]), int(inbox.tensors["clusters"][s])
            if not 1 <= k <= self.k_max:
                continue
            models = {n: inbox.tensors[f"models.{n}"][s][:k].to(self.ctx.device) for n in self.layout}
            self.heard.setdefault(sender, (models, inbox.tensors["sizes"][s].cpu()))
            rows = inbox.delivered[:, s].nonzero().flatten()
            valid = self.valid[rows]  # [R, n_max]: the padding is not evaluated
            err = torch.zeros(k, *valid.shape, device=self.x.device)  # [k, R, n_max]
            err[:, valid] = ae.errors(models, self.x[rows][valid])
            clusters = torch.arange(self.k_max, device=self.x.device)
            mask = (self.labels[rows].unsqueeze(0) == clusters.view(-1, 1, 1)) & self.valid[rows]  # [K_max, R, n]
            ok = reconstructs(self.own_errors[rows].unsqueeze(0).unsqueeze(0), err.unsqueeze(1), mask.unsqueeze(0),
                              o.percentile / 100.0, o.theta, o.scale)  # [k, K_max, R]
            self.row_verdicts[rows.cpu(), :, sender] = bits(ok.permute(2, 1, 0)).cpu()
        return int(inbox.delivered.sum())

    # -- line 17-23: Gamma, communities, FedAvg -------------------------------------------------------------------
    def end_exchange(self, ex: Exchange) -> None:
        if ex.name == ASSOCIATIONS:
            self.form_communities()
        elif ex.name == FEDAVG:
            self.average_updates()
        elif ex.name == MERGES:
            self.merge_communities()

    def form_communities(self) -> None:
        """Gamma from everyone's verdicts (an edge needs both directions), its components, and each community's
        starting model, the size-weighted mean of its members' AE_iq."""
        n, k = self.n_clients, self.k_max
        verdict = torch.zeros(n, k, n, dtype=torch.long)
        for c, v in self.verdicts.items():
            verdict[c] = v
        says = unbits(verdict, k)  # [N, K, N, K]: client c's cluster q is reconstructed by AE_jp
        exists = torch.zeros(n, k, dtype=torch.bool)
        for c, (_, sizes) in self.heard.items():
            exists[c] = sizes > 0
        both = says & says.permute(2, 3, 0, 1) & exists.view(n, k, 1, 1) & exists.view(1, 1, n, k)
        edges = both.view(n * k, n * k).nonzero().numpy()
        self.node_of = communities(n * k, edges)
        self.node_of[~exists.view(-1).numpy()] = -1
        groups = int(self.node_of.max()) + 1 if self.node_of.size else 0
        isolated = int((exists.view(-1).numpy() & (self.node_of < 0)).sum())
        self.history.append((groups, isolated))
        start = []
        for g in range(groups):
            nodes = np.flatnonzero(self.node_of == g)
            weights = torch.tensor([float(self.heard[int(v) // k][1][int(v) % k]) for v in nodes])
            stacked = {name: torch.stack([self.heard[int(v) // k][0][name][int(v) % k] for v in nodes])
                       for name in self.layout}
            start.append(weighted_mean(stacked, weights))
        self.community = stack_models(start, self.layout, self.ctx.device)
        for r, c in enumerate(self.ctx.clients):
            self.node_community[r] = torch.from_numpy(self.node_of[c * k: (c + 1) * k].copy())
            self.node_category[r] = self.majority_categories(r)

    def majority_categories(self, r: int) -> Tensor:
        """[K_max]: the true category most of cluster q's samples belong to (-1: empty); for the reports only."""
        out = torch.full((self.k_max,), -1, dtype=torch.long)
        for q in range(int(self.clusters[r])):
            members = self.truth[r][(self.labels[r] == q) & self.valid[r]]
            if members.numel():
                out[q] = int(torch.mode(members.cpu()).values)
        return out

    def send_update(self, ex: Exchange, rows: Tensor, zero: Tensor) -> Outbox:
        """A FedAvg round at the members: each trains its copy of AE_Gp on its cluster and sends it."""
        k, pairs = self.k_max, []
        for r, c in enumerate(self.ctx.clients):
            pairs += [(r, q) for q in range(int(self.clusters[r])) if self.node_of[c * k + q] >= 0]
        groups = [int(self.node_of[self.ctx.clients[r] * k + q]) for r, q in pairs]
        start = {n: v[groups] for n, v in self.community.items()}
        trained = self.train_on_clusters(pairs, start, self.options.fedavg_epochs, self.round, 1 + ex.step)
        out = {n: torch.zeros(len(self.ctx.clients), k, *s, device=self.ctx.device) for n, s in self.layout.items()}
        which = torch.zeros(len(self.ctx.clients), dtype=torch.long, device=self.ctx.device)
        filled = [0] * len(self.ctx.clients)
        for s, (r, q) in enumerate(pairs):
            for n in self.layout:
                out[n][r, filled[r]] = trained[n][s]
            self.updates[(self.ctx.clients[r], q)] = {n: trained[n][s] for n in self.layout}
            which[r] |= 1 << q
            filled[r] += 1
        self.folded = set(self.ctx.clients)
        lengths = torch.tensor([max(f, 1) for f in filled], device=self.ctx.device)
        return Outbox(rows, zero, {**{f"models.{n}": v for n, v in out.items()}, "which": which}, lengths=lengths)

    def receive_update(self, inbox: Inbox) -> int:
        for s in inbox.delivered.any(0).nonzero().flatten().tolist():
            sender = int(inbox.sender[s])
            if sender in self.folded:
                continue
            self.folded.add(sender)
            for slot, q in enumerate(unbits(inbox.tensors["which"][s], self.k_max).nonzero().flatten().tolist()):
                self.updates[(sender, q)] = {n: inbox.tensors[f"models.{n}"][s][slot].to(self.ctx.device)
                                             for n in self.layout}
        return int(inbox.delivered.sum())

    def average_updates(self) -> None:
        """FedAvg: AE_Gp <- sum over members of n_iq / N_p times their update (members heard from this step)."""
        k = self.k_max
        for g in range(self.groups()):
            nodes = [int(v) for v in np.flatnonzero(self.node_of == g) if (int(v) // k, int(v) % k) in self.updates]
            if not nodes:
                continue
            weights = torch.tensor([float(self.heard[v // k][1][v % k]) for v in nodes])
            stacked = {n: torch.stack([self.updates[(v // k, v % k)][n] for v in nodes]) for n in self.layout}
            for n, v in weighted_mean(stacked, weights).items():
                self.community[n][g] = v
        self.updates, self.folded = {}, set()

    # -- after line 23 (our addition): communities whose models reconstruct each other's clusters become one --------
    def community_votes(self, r: int) -> Tensor:
        """[K_max, |G|] bool: AE_Gb reconstructs cluster q of row r by eq. (2), against the model of q's own
        community (False for an isolated cluster)."""
        groups, ok = self.groups(), self.valid[r]
        own_group = self.node_community[r]
        if groups == 0 or not bool((own_group >= 0).any()):
            return torch.zeros(self.k_max, groups, dtype=torch.bool)
        o = self.options
        err = ae.errors(self.community, self.x[r, ok])  # [|G|, n_i]
        own = err[own_group.clamp(min=0).to(err.device)]  # [K_max, n_i]
        mask = self.labels[r, ok].unsqueeze(0) == torch.arange(self.k_max, device=err.device).unsqueeze(1)
        says = reconstructs(own.unsqueeze(1), err.unsqueeze(0), mask.unsqueeze(1), o.percentile / 100.0, o.theta,
                            o.scale).cpu()  # [K_max, |G|]
        return says & (own_group >= 0).unsqueeze(1)

    def send_votes(self, rows: Tensor, zero: Tensor) -> Outbox:
        groups = self.groups()
        words = vote_words(groups)
        spec = self.payload(Exchange(MERGES))["votes"].shape
        out = torch.zeros(len(self.ctx.clients), *spec, dtype=torch.long)
        for r, c in enumerate(self.ctx.clients):
            says = self.community_votes(r)
            self.votes[c] = says
            padded = torch.zeros(self.k_max, words * VOTE_BITS, dtype=torch.bool)
            padded[:, :groups] = says
            out[r, :words] = bits(padded.view(self.k_max, words, VOTE_BITS)).T
        lengths = torch.full((len(self.ctx.clients),), words, dtype=torch.long)
        return Outbox(rows, zero, {"votes": out.to(self.ctx.device)}, lengths=lengths.to(self.ctx.device))

    def unpack_votes(self, words: Tensor, groups: int) -> Tensor:
        """[words, K_max] int64 -> [K_max, |G|] bool."""
        flags = unbits(words[: vote_words(groups)], VOTE_BITS)  # [words, K_max, VOTE_BITS]
        return flags.permute(1, 0, 2).reshape(self.k_max, -1)[:, :groups]

    def merge_communities(self) -> None:
        """Join the communities that reconstruct each other's clusters (core.cluster_refinement.merged_communities):
        a joined community's model is the size-weighted mean of its parts' models. Every client holds the same
        votes, so every client joins the same communities."""
        groups, n, k = self.groups(), self.n_clients, self.k_max
        if groups < 2:
            return
        votes = np.zeros((n * k, groups), dtype=bool)
        for c, says in self.votes.items():
            votes[c * k: (c + 1) * k] = says.numpy()
        new = merged_communities(self.node_of, votes, self.options.merge_share)
        joined = int(new.max()) + 1
        if joined == groups:
            return
        member = self.node_of >= 0
        sizes = torch.zeros(groups)
        for v in np.flatnonzero(member):
            sizes[int(self.node_of[v])] += float(self.heard[int(v) // k][1][int(v) % k])
        parts = [np.flatnonzero(new == g) for g in range(joined)]
        models = [weighted_mean({name: self.community[name][torch.from_numpy(p).to(self.community[name].device)]
                                 for name in self.layout}, sizes[torch.from_numpy(p)]) for p in parts]
        self.community = stack_models(models, self.layout, self.ctx.device)
        self.node_of[member] = new[self.node_of[member]]
        self.history[-1] = (joined, self.history[-1][1])
        for r, c in enumerate(self.ctx.clients):
            self.node_community[r] = torch.from_numpy(self.node_of[c * k: (c + 1) * k].copy())

    # -- line 26-31 and the stop rule ------------------------------------------------------------------------------
    def end_round(self, t: int) -> None:
        if self.done:
            return
        for r in range(len(self.ctx.clients)):
            if not self.active[r]:
                continue
            k, ok = int(self.clusters[r]), self.valid[r]
            mine = {n: v[r, :k] for n, v in self.local.items()}
            models = {n: torch.cat([mine[n], self.community[n]]) for n in self.layout}
            err = ae.errors(models, self.x[r, ok])  # [K_i + |G|, n_i]
            new, selected = refine(err, k)
            before = self.labels[r, ok].cpu().numpy()
            self.labels[r, ok] = new
            self.stale[r] = bool((torch.from_numpy(before).to(new.device) != new).any())
            for p, m in enumerate(selected.tolist()):
                for n in self.layout:
                    self.local[n][r, p] = models[n][m]
            if agreement(before, new.cpu().numpy()) >= self.options.tau:
                self.active[r] = False
        self.done = self.stable() or t + 1 >= self.schedule.total_rounds

    def stable(self) -> bool:
        """The global stop: |G| and |I| each moved by at most stable_change over the last stable_iterations."""
        o = self.options
        if len(self.history) < o.stable_iterations:
            return False
        last = np.array(self.history[-o.stable_iterations:], dtype=float)  # [iterations, 2]
        spread = last.max(0) - last.min(0)
        return bool((spread <= o.stable_change * np.maximum(last.max(0), 1.0)).all())

    # -- reports and state ---------------------------------------------------------------------------------------
    def accuracy(self, r: int) -> float:
        ok = self.valid[r]
        return agreement(self.labels[r, ok].cpu().numpy(), self.truth[r, ok].cpu().numpy())

    def evaluate(self) -> Evaluation:
        rows = len(self.ctx.clients)
        acc = torch.tensor([self.accuracy(r) for r in range(rows)], device=self.ctx.device)
        loss = (self.own_errors * self.valid).sum(1) / self.counts.clamp(min=1)
        groups, isolated = self.history[-1] if self.history else (0, 0)
        extra: dict[str, list[Any]] = {
            "initial_acc": self.initial_acc.tolist(),
            "communities": [groups] * rows,
            "isolated": [isolated] * rows,
            "iterations": [len(self.history)] * rows,
            "active": self.active.long().tolist(),
            "cluster_category": self.node_category.tolist(),
            "cluster_community": self.node_community.tolist(),
            "categories": [sorted(set(y[y >= 0].tolist())) for y in self.truth.cpu()],
        }
        return Evaluation(torch.zeros(rows, dtype=torch.long, device=self.ctx.device), acc, loss, None, extra)

    def final_models(self) -> dict[str, dict[str, Tensor]]:
        return {f"community_{g}": {n: v[g] for n, v in self.community.items()} for g in range(self.groups())}

    def state(self) -> dict[str, Tensor]:
        history = torch.tensor(self.history, dtype=torch.long).view(-1, 2)
        device = self.ctx.device
        tensors = state_of(self.local, labels=self.labels, active=self.active, stale=self.stale,
                           initial_acc=self.initial_acc, own_errors=self.own_errors,
                           node_category=self.node_category, node_community=self.node_community, history=history,
                           done=torch.tensor([int(self.done)]),
                           **{f"community.{n}": v for n, v in self.community.items()})
        return {n: v.to(device) for n, v in tensors.items()}

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        device = self.ctx.device
        self.local = {n: v.to(device) for n, v in params_in(tensors).items()}
        self.community = {n: v.to(device) for n, v in params_in(tensors, "community.").items()}
        self.labels, self.own_errors = tensors["labels"].to(device), tensors["own_errors"].to(device)
        self.active, self.initial_acc = tensors["active"].bool().cpu(), tensors["initial_acc"].cpu()
        self.stale = tensors["stale"].bool().cpu()
        self.node_category, self.node_community = tensors["node_category"].cpu(), tensors["node_community"].cpu()
        self.history = [(int(a), int(b)) for a, b in tensors["history"].tolist()]
        self.done = bool(tensors["done"][0])

    @classmethod
    def run_metrics(cls, cfg: ExperimentBase, report: Mapping[str, list[Any]], data: Callable[[], FederatedData],
                    graph: Graph) -> dict[str, float]:
        """The paper's Sec. 5.3 metrics over every reported client: ACC (eq. 4) initial and now, |G| against |U|,
        wrong associations (%) and isolated clusters."""
        categories = {c for cats in report["categories"] for c in cats}
        members: dict[int, list[int]] = {}  # community -> the categories of its clusters
        for comms, cats in zip(report["cluster_community"], report["cluster_category"], strict=True):
            for g, c in zip(comms, cats, strict=True):
                if g >= 0:
                    members.setdefault(int(g), []).append(int(c))
        clustered = sum(len(v) for v in members.values())
        wrong = sum(len(v) - max(v.count(c) for c in set(v)) for v in members.values())
        return {
            "initial_acc": float(np.mean(report["initial_acc"])),
            "final_acc": float(np.mean(report["test_accuracy"])),
            "communities_found": float(report["communities"][0]),
            "true_categories": float(len(categories)),
            "wrong_associations": 100.0 * wrong / clustered if clustered else 0.0,
            "isolated_clusters": float(report["isolated"][0]),
            "active_clients": float(sum(report["active"])),
            "iterations": float(report["iterations"][0]),
        }


def weighted_mean(stacked: dict[str, Tensor], weights: Tensor) -> dict[str, Tensor]:
    w = weights / weights.sum().clamp(min=1e-12)
    return {n: (w.to(v.device).view(-1, *([1] * (v.dim() - 1))) * v).sum(0) for n, v in stacked.items()}


def stack_models(models: list[dict[str, Tensor]], layout: dict[str, tuple[int, ...]],
                 device: torch.device) -> dict[str, Tensor]:
    if not models:
        return {n: torch.zeros(0, *s, device=device) for n, s in layout.items()}
    return {n: torch.stack([m[n] for m in models]).to(device) for n in layout}
