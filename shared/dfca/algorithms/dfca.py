"""DFCA (Kirch et al.): decentralized clustered federated learning, and the robust variant we default to.

Every client i holds k cluster models theta_i1..theta_ik. A round of the paper's rule (`dfca.variant: paper`):

    eq. 4   c(i) = argmin_j F(theta_ij; D_i)             the client picks the cluster that fits its data best,
    eq. 5   theta_{i,c(i)} <- SGD on D_i                  trains only that model,
    eq. 6   sends theta_{i,c(i)} to its neighbours        (one exchange, `models`),
    eq. 7/8 folds each model of cluster j it receives into theta_ij: a running average as the models arrive,
            its own copy weighing w_ii (1 in the paper; 0 for an untrained cluster under `dfca.merge: fresh`).

Robust DFCA (`dfca.variant: robust`, the default; README "Cluster recovery"):
- Seeding (`dfca.seeding: farthest`): the first k x flood_rounds rounds train nothing. In each, one exchange
  `seed`: a client sends its candidate (score, origin, model) and keeps the best it receives; a slot's last
  round installs the candidate as that cluster's model everywhere (core.seeding).
- A training round with G = schedule.gossip_steps(t) > 0 replaces eq. 6-8 by G exchanges `gossip` of ratio
  consensus over all k clusters (core.consensus): cluster j becomes the mean of the copies trained this
  round, as IFCA's server would compute it, approximated over the graph.
- DFCA-LI without seeding spends round 0 agreeing on initial models: averaging independently initialised
  networks destroys them (hidden units do not line up; measured on a BA graph, the clusters then collapse
  into one). Instead one seeded source client per cluster floods its own initialisation by the same
  consensus; with weight 1 at the source and 0 elsewhere, num/den is exactly the source's model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import networkx as nx
import torch
from torch import Tensor

from dfca.algorithms.base import (
    Algorithm,
    Evaluation,
    Exchange,
    HostContext,
    Inbox,
    LazyTensors,
    Outbox,
    cluster_means,
    cluster_sums,
    params_in,
    state_of,
)
from dfca.core import (
    assign_clusters,
    fold_models,
    init_cluster_models,
    loss_matrix,
    round_seeds,
    self_weights,
    train_assigned,
)
from dfca.core.consensus import (
    RoundedWalkConsensus,
    StepConsensus,
    WalkConsensus,
    consensus_weights,
    source_weights,
)
from dfca.core.params import gather_clusters
from dfca.core.screened_gossip import Screen, displacement
from dfca.core.seeding import SeedCandidates, first_slot_scores, fit_scores, refused_candidates, responds_to_input
from dfca.models import Params
from dfca.wire import TensorSpec

SCREEN_SAMPLES = 64  # samples per client that screened gossip's loss test evaluates an estimate on
DUPLICATE_AGREEMENT = 0.99  # a seed candidate predicting what an installed seed predicts this often is its copy


class DFCA(Algorithm):
    links = frozenset({"neighbours"})

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        self.k = cfg.clusters
        self.params: Params = init_cluster_models(ctx.model, ctx.clients, self.k, cfg.seed, cfg.init, ctx.device)
        self.losses = self.losses_of(self.params)
        self.assigned = assign_clusters(self.losses)
        self.weight = torch.ones(len(ctx.clients), self.k, device=ctx.device)  # c_ij of the open one-hop merge
        self.consensus: WalkConsensus | RoundedWalkConsensus | StepConsensus | None = None
        self.seeds: SeedCandidates | None = None

    def exchanges(self, t: int) -> list[Exchange]:
        if self.schedule.seeding(t) is not None:
            return [Exchange("seed", stale_ok=True)]
        if steps := self.schedule.gossip_steps(t):
            return [Exchange("gossip", step=s) for s in range(steps)]
        return [Exchange("models", averaged=True, stale_ok=True)]

    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        if ex.name == "gossip":
            return {**self.model_spec((self.k,), "num."), "den": TensorSpec((self.k,), "float32")}
        if ex.name == "seed":
            return {**self.model_spec(), "score": TensorSpec((), "float64"), "origin": TensorSpec((), "int64")}
        return self.model_spec()

    # -- a round -------------------------------------------------------------------------------------
    def begin_round(self, t: int) -> None:
        if (step := self.schedule.seeding(t)) is not None:
            if self.seeds is None:
                self.seeds = SeedCandidates(self.local_models(t), self.ctx.rows, self.wire_rounding())
            if step.first:
                self.seeds.open(step.slot, first_slot_scores(self.ctx.cfg.seed, self.ctx.clients) if step.slot == 0
                                else fit_scores(self.losses, step.slot))
            return
        cfg = self.ctx.cfg
        d = self.data()
        self.assigned = assign_clusters(self.losses)  # eq. 4
        agreeing = self.schedule.agrees_on_initial_models(t)
        screening = cfg.dfca.screen and self.schedule.gossip_steps(t) > 0 and not agreeing
        anchor = {n: v.clone() for n, v in self.params.items()} if screening else None
        train_assigned(  # eq. 5
            self.ctx.model, self.params, self.assigned, d.x_train, d.y_train, lr=self.schedule.lr(t),
            epochs=self.schedule.epochs(t), batch_size=cfg.train.batch_size,
            seeds=round_seeds(cfg.seed, self.ctx.clients, t),
        )
        if self.schedule.gossip_steps(t):
            m = (source_weights(cfg.seed, cfg.data.clients, self.k, self.ctx.rows) if agreeing
                 else consensus_weights(self.assigned, self.k, cfg.dfca.untrained_weight))
            if anchor is not None:
                self.consensus = StepConsensus(self.params, m, self.screen(anchor))
            elif not self.ctx.whole:  # the message driver: its clients' (num, den), mixed as messages arrive
                self.consensus = StepConsensus(self.params, m)
            elif (rounding := self.wire_tensor_rounding()) is None:  # every client here, nothing rounds what is sent
                self.consensus = WalkConsensus(m)
            else:
                self.consensus = RoundedWalkConsensus(m, rounding)
        else:
            self.weight = self_weights(self.assigned, self.k, cfg.dfca.merge_rule)

    def screen(self, anchor: Params) -> Screen:
        """What this round's gossip screens arrivals against (core.screened_gossip): last round's models, the
        distance this round's training moved each client's own, and the loss test on its own data (at most
        SCREEN_SAMPLES of its training samples, the same ones for the anchor and every estimate)."""
        d = self.ctx.cfg.dfca
        radius = d.screen_radius * displacement(self.params, anchor, self.assigned).clamp_min(1e-6)
        self.anchor_loss = self.sample_loss(torch.arange(len(self.ctx.clients), device=self.ctx.device),
                                            gather_clusters(anchor, self.assigned))
        return Screen(anchor, radius.to(self.ctx.device), self.assigned, 1 + (self.k - 1) * d.untrained_weight,
                      self.fits_own_data, d.screen_trim)

    def sample_loss(self, rows: Tensor, models: Params) -> Tensor:
        """[R]: the loss of models [R, ...] on the first SCREEN_SAMPLES training samples of each row."""
        d = self.data()
        x = d.x_train[:, :SCREEN_SAMPLES].index_select(0, rows)
        y = d.y_train[:, :SCREEN_SAMPLES].index_select(0, rows)
        return loss_matrix(self.ctx.model, {n: v.unsqueeze(1) for n, v in models.items()}, x, y)[:, 0]

    def fits_own_data(self, rows: Tensor, estimates: Params) -> Tensor:
        """[P] bool: each estimate of row `rows[p]`'s own cluster is not much worse on that row's samples than its
        model of last round (loss x): at most max((1 + screen_loss) x, x + screen_loss), and below chance
        (ln classes)."""
        tol = self.ctx.cfg.dfca.screen_loss
        before = self.anchor_loss.index_select(0, rows)
        limit = torch.minimum(torch.maximum((1 + tol) * before, before + tol),
                              torch.full_like(before, math.log(self.data().num_classes)))
        return self.sample_loss(rows, estimates) <= limit

    def local_models(self, t: int) -> Params:
        """phi_i, the seeding's local model: client i's copy of cluster 0 after `seed_epochs` epochs on D_i."""
        d = self.data()
        phi = {n: v[:, :1].clone() for n, v in self.params.items()}
        train_assigned(
            self.ctx.model, phi, torch.zeros(len(self.ctx.clients), dtype=torch.long, device=self.ctx.device),
            d.x_train, d.y_train, lr=self.schedule.lr(t), epochs=self.schedule.epochs(t),
            batch_size=self.ctx.cfg.train.batch_size, seeds=round_seeds(self.ctx.cfg.seed, self.ctx.clients, t),
        )
        return {n: v[:, 0] for n, v in phi.items()}

    def send(self, ex: Exchange) -> Outbox:
        rows = torch.arange(len(self.ctx.clients), device=self.ctx.device)
        if ex.name == "seed":
            assert self.seeds is not None
            seeds = self.seeds
            slot = torch.full_like(rows, seeds.slot)
            ready = {"score": seeds.score.clone(), "origin": seeds.origin.clone()}
            # the simulator rounds what it delivers: a relayed candidate need not be rounded before it is sent too
            models = seeds.origin_models if self.ctx.whole else seeds.models
            return Outbox(rows, slot, LazyTensors([*self.params, *ready], models, ready))
        if ex.name == "gossip":
            assert self.consensus is not None
            return Outbox(rows, torch.zeros_like(rows), self.consensus.outgoing())
        order = self.assigned.argsort(stable=True)  # eq. 6, grouped by cluster
        part = self.assigned[order]
        return Outbox(order, part, gather_clusters(self.params, part, order))

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        if ex.name == "seed":
            assert self.seeds is not None
            seeding = self.schedule.seeding(inbox.round)
            if seeding is None or seeding.slot != self.seeds.slot:
                return 0  # a late candidate of a slot that has closed
            score, origin = inbox.tensors["score"], inbox.tensors["origin"]
            refused = refused_candidates(score, origin, seeding.slot, self.ctx.cfg.seed, self.ctx.cfg.data.clients)
            self.refused["seed_score"] += int((inbox.delivered & refused).any(0).sum())
            delivered = inbox.delivered & ~refused.unsqueeze(0)
            check = self.candidate_check
            self.refused["seed_model"] += self.seeds.offer(delivered, score, origin, inbox.tensors, check)
            return int(delivered.sum())
        if ex.name == "gossip":
            assert self.consensus is not None
            return self.consensus.receive(inbox.delivered, inbox.tensors)
        return fold_models(self.params, self.weight, inbox.delivered, inbox.part, inbox.tensors)  # eq. 7/8

    def candidate_check(self, rows: Tensor, candidates: Params) -> Tensor:
        """[R] bool: the candidate each row would keep is a finite model whose output depends on that row's inputs,
        and, in slot s > 0, not a copy of a seed already installed: the farthest client's model never predicts
        what seed j predicts on DUPLICATE_AGREEMENT of the row's samples (a liar's copy of seed 0 would make two
        clusters one)."""
        assert self.seeds is not None
        x = self.data().x_train.index_select(0, rows)
        logits = self.ctx.model.logits({n: v.to(x.device) for n, v in candidates.items()}, x)
        ok = responds_to_input(logits)
        predicted = logits.argmax(-1)
        for j in range(self.seeds.slot):
            seed = self.ctx.model.logits({n: v[:, j].index_select(0, rows) for n, v in self.params.items()}, x)
            ok &= (predicted == seed.argmax(-1)).float().mean(1) < DUPLICATE_AGREEMENT
        return ok

    def end_exchange(self, ex: Exchange) -> None:
        if ex.name == "gossip":
            assert self.consensus is not None
            self.consensus.step()

    def end_round(self, t: int) -> None:
        if (step := self.schedule.seeding(t)) is not None:
            assert self.seeds is not None
            if not step.last:
                return
            self.seeds.install(self.params, step.slot)
            if t + 1 == self.schedule.seeding_rounds:
                self.seeds = None  # the local models are no longer needed
        elif self.consensus is not None:
            self.consensus.finish(self.params)
            if isinstance(self.consensus, StepConsensus):
                self.screened += self.consensus.dropped
            self.consensus = None
        self.losses = self.losses_of(self.params)

    # -- reports and checkpoints ---------------------------------------------------------------------
    def evaluate(self) -> Evaluation:
        return self.evaluation(self.params, self.losses, assign_clusters(self.losses))

    def final_models(self) -> dict[str, Params]:
        return cluster_means(self.params, assign_clusters(self.losses), self.k)

    def final_model_sums(self) -> dict[str, tuple[Params, int]]:
        return cluster_sums(self.params, assign_clusters(self.losses), self.k)

    def model_copies(self) -> Params:
        return self.params

    def state(self) -> dict[str, Tensor]:
        extra: dict[str, Tensor] = {"losses": self.losses}
        if self.seeds is not None:  # mid-seeding: the local models and the candidates
            extra.update({f"seed.local.{n}": v for n, v in self.seeds.local.items()})
            extra.update({f"seed.candidate.{n}": v for n, v in self.seeds.models().items()})
            extra.update({"seed.score": self.seeds.score, "seed.origin": self.seeds.origin,
                          "seed.slot": torch.tensor(self.seeds.slot)})
        return state_of(self.params, **extra)

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self.params = {n: v.to(self.ctx.device) for n, v in params_in(tensors).items()}
        self.losses = tensors["losses"].to(self.ctx.device)
        self.seeds = None
        if "seed.score" in tensors:
            local = {n: v.to(self.ctx.device) for n, v in params_in(tensors, "seed.local.").items()}
            self.seeds = SeedCandidates(local, self.ctx.rows, self.wire_rounding())
            self.seeds.restore(tensors["seed.score"], tensors["seed.origin"], int(tensors["seed.slot"]),
                               params_in(tensors, "seed.candidate."))


def warn_if_flood_too_short(graph: nx.Graph, flood_rounds: int) -> str | None:
    """A warning when the drawn graph is wider than a max-flood of `flood_rounds` rounds reaches."""
    if graph.number_of_nodes() > 1 and nx.is_connected(graph) and (diameter := nx.diameter(graph)) > flood_rounds:
        return (f"dfca.flood_rounds={flood_rounds} is below the graph's diameter {diameter}: the k seeds may differ "
                "between regions of the graph; raise dfca.flood_rounds")
    return None
