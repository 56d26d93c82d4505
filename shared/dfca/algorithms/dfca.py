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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import networkx as nx
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
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
from dfca.algorithms.client_data import first_samples, sample_counts, train_assigned, train_loss_matrices
from dfca.core import (
    assign_clusters,
    fold_models,
    init_cluster_models,
    loss_matrix,
    round_seeds,
    self_weights,
)
from dfca.core.assignment import masked_mean
from dfca.core.consensus import (
    RoundedWalkConsensus,
    StepConsensus,
    WalkConsensus,
    consensus_weights,
    source_weights,
)
from dfca.core.params import gather_clusters
from dfca.core.screened_gossip import MergeFolds, Screen, own_rows, screened_arrivals, training_steps
from dfca.core.seeding import (
    FIRST_HAND,
    RelayHops,
    SeedCandidates,
    first_slot_scores,
    fit_scores,
    refused_candidates,
    responds_to_input,
)
from dfca.models.batched import Params
from dfca.run_size import SCREEN_COPIES
from dfca.schedule import RoundSchedule, diameter_bound
from dfca.sections import Strict
from dfca.wire.codec import TensorSpec

if TYPE_CHECKING:
    from dfca.sections import ExperimentBase

SCREEN_SAMPLES = 64  # samples per client that screened gossip's loss test evaluates an estimate on
DUPLICATE_AGREEMENT = 0.99  # a seed candidate predicting what an installed seed predicts this often is its copy


# -- the config section `dfca:` ---------------------------------------------------------------------------------
FULL_TRAFFIC = {"warmup_rounds": 8, "gossip_every": 1, "gossip_steps": 3}  # the robust schedule before `lean`


def traffic_of(dfca: Any) -> str:
    """The traffic preset a DFCA section (a dict as given, or a DFCAConfig) asks for."""
    if not isinstance(dfca, dict):
        return str(dfca.traffic)
    return str(dfca.get("traffic", "lean"))


class DFCAConfig(Strict):
    """DFCA's rules: the paper's, or the robust variant (see README "Cluster recovery").

    paper:  eq. 7/8 as written; a client sends only its assigned model; its own copy always counts.
    robust: farthest-first seeding, then rounds of G steps of ratio consensus over all k clusters
            (core.consensus): cluster j becomes the mean of the copies trained this round, as IFCA's
            server computes it, approximated over the graph. G = `warmup_gossip_steps` in the first
            `warmup_rounds` rounds, `gossip_steps` in every `gossip_every`-th round after (counted back
            from the last); the other rounds merge one hop (eq. 7/8 with the `fresh` rule).

    `traffic` picks the robust schedule's defaults (a key the config names wins):
      lean (default): warmup_rounds 0, gossip_every 5, gossip_steps 5, and 8-bit payloads
            (runtime.payload_dtype int8): 0.9-1.5x the paper rule's bytes (docs/traffic.md);
      full: warmup_rounds 8, gossip_every 1, gossip_steps 3, float32 payloads: consensus every round,
            10-20x the paper rule's bytes (the default before lean).
    `screen` (on by default) guards every exchange that folds neighbours' models: gossip steps and one-hop merges.
    """

    variant: Literal["paper", "robust"] = "robust"
    traffic: Literal["lean", "full"] = Field(
        "lean", description="robust: lean gossips 5 steps every 5th round with 8-bit payloads, about the paper rule's "
        "bytes; full gossips 3 steps every round (10 in 8 warm-up rounds) in float32 (10-20x); a key the config "
        "names wins",
    )
    merge: Literal["paper", "fresh"] | None = Field(
        None, description="paper: eq. 7 keeps the own copy; fresh: an untrained cluster takes only what arrived"
    )
    warmup_rounds: int = Field(0, ge=0, le=100_000, description="robust: rounds of the warm-up (traffic full: 8)")
    warmup_gossip_steps: int = Field(10, ge=1, le=1000, description="robust: gossip steps per warm-up round")
    gossip_steps: int = Field(5, ge=0, le=1000, description="robust: gossip steps per gossip round after the warm-up "
                              "(traffic full: 3)")
    gossip_every: int = Field(
        5, ge=1, le=100_000, description="robust: after the warm-up, every gossip_every-th round gossips (counted "
        "back from the last round, which always does); the others merge one hop (eq. 7/8, the fresh rule); "
        "traffic full: 1",
    )
    untrained_weight: float = Field(
        0.0, ge=0.0, le=1.0, description="robust: weight of a cluster copy its client did not train this round"
    )
    screen: bool = Field(
        True,
        description="robust: screened gossip and merges against lying neighbours (core.screened_gossip): weights "
        "held to what an honest client can send; estimates far from the receiver's own (farther than screen_radius "
        "times the median arrival's distance), or, for its own cluster, well behind its own training step or much "
        "worse on its own data, dropped; costs a copy of the models and a loss on 64 samples per row and step; "
        "false: plain ratio consensus, which one lying neighbour can capture",
    )
    screen_radius: float = Field(
        2.0, gt=0.0, le=1000.0,
        description="screen: drop an estimate farther from the receiver's own than this many times its scale (the "
        "lower median of its arrivals' distances, never below how far its own training moved its model, and that "
        "where fewer than two arrived; 0.8 times this at a round's first gossip step; one-hop merges: at the "
        "merge's end, from the median of the merge's arrivals)",
    )
    screen_trim: float = Field(
        0.0, ge=0.0, lt=0.5,
        description="screen: each gossip step's estimate is the coordinate-wise mean of the kept estimates with this "
        "fraction cut from each end (W-MSR; about 3x the gossip's cost); 0: their weighted mean, as ratio consensus",
    )
    screen_loss: float = Field(
        0.5, ge=0.0, le=100.0,
        description="screen: drop an estimate of the receiver's own cluster whose loss on its data exceeds "
        "max((1 + screen_loss) x, x + screen_loss), x the loss of its model of last round, or chance (ln classes); "
        "a one-hop merge's model also above 1.3 times the median loss of the merge's other models",
    )
    seeding: Literal["none", "farthest"] | None = Field(
        None,
        description="farthest: before training, agree on k seed models by farthest-first max-flooding "
        "(core.seeding, DFCASchedule): each seed is the local model of the client the earlier seeds fit worst; "
        "None: farthest for variant robust, none for variant paper",
    )
    seed_epochs: int = Field(10, ge=0, le=10_000,
                             description="seeding: local epochs that train each client's candidate")
    flood_rounds: int | None = Field(
        None, ge=1, le=100_000, description="seeding: rounds per seed slot (>= the graph's diameter); None: a bound "
        "from topology and clients (dfca.schedule.diameter_bound)",
    )

    @model_validator(mode="before")
    @classmethod
    def _traffic_preset(cls, data: Any) -> Any:
        """traffic: full fills the keys the config leaves out with the full schedule's values."""
        if not isinstance(data, dict) or traffic_of(data) != "full":
            return data
        return {**FULL_TRAFFIC, "traffic": "full", **data}

    @property
    def merge_rule(self) -> str:
        return self.merge or ("fresh" if self.variant == "robust" else "paper")

    @property
    def seeding_rule(self) -> str:
        return self.seeding or ("farthest" if self.variant == "robust" else "none")


# -- the schedule: seeding rounds, then training rounds that gossip or merge one hop ----------------------------
@dataclass(frozen=True)
class SeedingStep:
    """Where a seeding round sits: which slot is flooding and which of its rounds this is."""

    slot: int
    step: int
    rounds_per_slot: int

    @property
    def first(self) -> bool:
        return self.step == 0

    @property
    def last(self) -> bool:
        return self.step == self.rounds_per_slot - 1


class DFCASchedule(RoundSchedule):
    """Rounds 0 .. seeding_rounds - 1 are robust DFCA's farthest-first seeding (core.seeding): k slots of
    `flood_rounds` rounds each, no training. The `cfg.rounds` training rounds follow. A training round
    merges by ratio consensus over G gossip steps (robust DFCA, core.consensus) or by the one-hop merge
    (eq. 7/8: the paper's rule, or robust with `gossip_steps: 0` after the warm-up). The warm-up counts
    from the first training round."""

    def __init__(self, cfg: ExperimentBase) -> None:
        self.flood_rounds = cfg.dfca.flood_rounds or min(diameter_bound(cfg.topology, cfg.data.clients),
                                                         cfg.data.clients - 1)
        super().__init__(cfg)

    def preparation_rounds(self) -> int:
        return self.cfg.clusters * self.flood_rounds if self.cfg.dfca.seeding_rule == "farthest" else 0

    def seeding(self, t: int) -> SeedingStep | None:
        """The seeding step of round t, or None for a training round."""
        if t >= self.seeding_rounds:
            return None
        return SeedingStep(t // self.flood_rounds, t % self.flood_rounds, self.flood_rounds)

    def gossip_steps(self, t: int) -> int:
        """G_t, gossip steps of ratio consensus in round t; 0 means a one-hop merge (eq. 7/8). After the warm-up,
        every `gossip_every`-th training round gossips, counted back from the last (which always does)."""
        d = self.cfg.dfca
        if d.variant != "robust" or t < self.seeding_rounds:
            return 0
        u = t - self.seeding_rounds  # the training round
        if u < d.warmup_rounds:
            return d.warmup_gossip_steps
        return d.gossip_steps if (self.cfg.rounds - 1 - u) % d.gossip_every == 0 else 0

    def rounds_since_agreement(self, t: int) -> int:
        """Training rounds from the last round whose clients agreed on their models (a gossip round, or the end of
        seeding) to round t: 1 right after it. Between, one-hop merges let neighbours' models drift apart."""
        u = t - self.seeding_rounds
        since = 1
        while u - since >= 0 and not self.gossip_steps(t - since):
            since += 1
        return since

    def agrees_on_initial_models(self, t: int) -> bool:
        """Robust DFCA-LI without seeding spends round 0 agreeing on initial models instead of training
        (see the module's docstring): averaging independently initialised networks destroys them."""
        return t == 0 and self.cfg.init == "local" and self.gossip_steps(0) > 0

    def epochs(self, t: int) -> int:
        """Local epochs of round t: seed_epochs once, at the first seeding round; none in a seeding round after it
        or an agreement round; else train.local_epochs."""
        if t < self.seeding_rounds:
            return self.cfg.dfca.seed_epochs if t == 0 else 0
        if self.agrees_on_initial_models(t):
            return 0
        return super().epochs(t)


class DFCA(Algorithm):
    links = frozenset({"neighbours"})
    title = "DFCA"
    section, Section, Schedule = "dfca", DFCAConfig, DFCASchedule
    client_per_cluster = True
    schedule: DFCASchedule

    @classmethod
    def config_defaults(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Robust DFCA with traffic lean sends 8-bit payloads unless runtime.payload_dtype is named."""
        dfca, runtime = data.get("dfca", {}), data.get("runtime", {})
        variant = dfca.get("variant", "robust") if isinstance(dfca, dict) else dfca.variant
        given = runtime if isinstance(runtime, dict) else runtime.model_dump(exclude_unset=True)
        if variant != "robust" or traffic_of(dfca) != "lean" or "payload_dtype" in given:
            return data
        return {**data, "runtime": {**given, "payload_dtype": "int8"}}

    @classmethod
    def extra_model_copies(cls, cfg: ExperimentBase) -> int:
        return SCREEN_COPIES if cfg.dfca.screen and cfg.dfca.variant == "robust" else 0

    @classmethod
    def variant(cls, cfg: ExperimentBase) -> str | None:
        return cfg.dfca.variant

    def graph_warning(self, graph: nx.Graph) -> str | None:
        if not self.schedule.seeding_rounds:
            return None
        return warn_if_flood_too_short(graph, self.schedule.flood_rounds)

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        self.k = cfg.clusters
        self.params: Params = init_cluster_models(ctx.model, ctx.clients, self.k, cfg.seed, cfg.init, ctx.device)
        self.screen_losses: Tensor | None = None  # [M, k]: each model's loss on its client's screen samples
        self.take_losses()
        self.assigned = assign_clusters(self.losses)
        self.weight = torch.ones(len(ctx.clients), self.k, device=ctx.device)  # c_ij of the open one-hop merge
        # n_i: clients of unequal size weigh their copies by their sample counts in the one-hop merge
        self.sizes = sample_counts(ctx.data) if ctx.data is not None and ctx.data.is_ragged else None
        self.consensus: WalkConsensus | RoundedWalkConsensus | StepConsensus | None = None
        self.seeds: SeedCandidates | None = None
        self._relay_hops: RelayHops | None = None  # the graph's distances, for seeding's relays
        self.merge_screen: Screen | None = None  # what the open one-hop merge screens arrivals against
        self.merge_folds: MergeFolds | None = None  # its folded arrivals, for the tests at its end

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
        return self.model_spec() if self.sizes is None else {**self.model_spec(), "samples": TensorSpec((), "float32")}

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
        screening = cfg.dfca.screen and cfg.dfca.variant == "robust" and not agreeing
        anchor = {n: v.clone() for n, v in self.params.items()} if screening else None
        train_assigned(  # eq. 5
            self.ctx.model, self.params, self.assigned, d, lr=self.schedule.lr(t),
            epochs=self.schedule.epochs(t), batch_size=cfg.train.batch_size,
            seeds=round_seeds(cfg.seed, self.ctx.clients, t), local_steps=cfg.train.local_steps,
        )
        if self.schedule.gossip_steps(t):
            m = (source_weights(cfg.seed, cfg.data.clients, self.k, self.ctx.rows) if agreeing
                 else consensus_weights(self.assigned, self.k, cfg.dfca.untrained_weight))
            if anchor is not None:
                self.consensus = StepConsensus(self.params, m, self.screen(anchor, t))
            elif not self.ctx.whole:  # the message driver: its clients' (num, den), mixed as messages arrive
                self.consensus = StepConsensus(self.params, m)
            elif (rounding := self.wire_tensor_rounding()) is None:  # every client here, nothing rounds what is sent
                self.consensus = WalkConsensus(m)
            else:
                self.consensus = RoundedWalkConsensus(m, rounding)
        else:
            self.weight = self_weights(self.assigned, self.k, cfg.dfca.merge_rule)
            if self.sizes is not None:
                self.weight *= self.sizes.unsqueeze(1)
            self.merge_screen = self.screen(anchor, t) if anchor is not None else None
            if self.merge_screen is not None:
                self.merge_folds = MergeFolds(anchor, {n: own_rows(v, self.assigned) for n, v in self.params.items()},
                                              self.weight.clone())

    def screen(self, anchor: Params, t: int) -> Screen:
        """What round t's gossip or merge screens arrivals against (core.screened_gossip): last round's models, the
        step this round's training moved each client's own (its length is the scale's floor), the loss test on its
        own data (at most SCREEN_SAMPLES of its training samples, the same ones for the anchor and every estimate),
        and, for a one-hop merge, the rounds since the clients last agreed (how far apart their models may have
        drifted)."""
        d = self.ctx.cfg.dfca
        rows = torch.arange(len(self.ctx.clients), device=self.ctx.device)
        step, terms = training_steps(self.params, anchor, self.assigned)
        reach = terms["step_sq"].sqrt().clamp_min(1e-6)  # |step_i|: how far training moved each client's own model
        if self.screen_losses is not None:  # x: last round's model's loss, taken with eq. 1's losses
            before = self.screen_losses.gather(1, self.assigned.unsqueeze(1)).squeeze(1)
        else:
            before = self.sample_loss(rows, gather_clusters(anchor, self.assigned))
        # an estimate of a row's own cluster passes at most max((1 + screen_loss) x, x + screen_loss), below chance
        limit = torch.minimum(torch.maximum((1 + d.screen_loss) * before, before + d.screen_loss),
                              torch.full_like(before, math.log(self.data().num_classes)))
        return Screen(anchor, reach.to(self.ctx.device), self.assigned, 1 + (self.k - 1) * d.untrained_weight,
                      d.screen_trim, step, d.screen_radius, float(self.schedule.rounds_since_agreement(t)),
                      loss=self.sample_loss, loss_limit=limit, cached=terms, model_loss=self.model_sample_loss)

    def sample_loss(self, rows: Tensor, models: Params) -> Tensor:
        """[R]: the loss of models [R, ...] on the first SCREEN_SAMPLES training samples of each row."""
        x, y, mask = first_samples(self.data(), rows, SCREEN_SAMPLES)
        return loss_matrix(self.ctx.model, {n: v.unsqueeze(1) for n, v in models.items()}, x, y, mask)[:, 0]

    def model_sample_loss(self, rows: Tensor, model: Params) -> Tensor:
        """[R]: the loss of one model (its tensors unbatched) on the first SCREEN_SAMPLES training samples of each
        row, every row's samples in one forward pass (`sample_loss`'s loss, the model read once)."""
        x, y, mask = first_samples(self.data(), rows, SCREEN_SAMPLES)
        r, n = y.shape
        logits = self.ctx.model.logits({name: v.unsqueeze(0) for name, v in model.items()},
                                       x.reshape(1, r * n, *x.shape[2:]))
        ce = F.cross_entropy(logits[0], y.reshape(-1), reduction="none").view(r, n)
        return ce.mean(1) if mask is None else masked_mean(ce, mask)

    def local_models(self, t: int) -> Params:
        """phi_i, the seeding's local model: client i's copy of cluster 0 after `seed_epochs` epochs on D_i."""
        d = self.data()
        phi = {n: v[:, :1].clone() for n, v in self.params.items()}
        train_assigned(
            self.ctx.model, phi, torch.zeros(len(self.ctx.clients), dtype=torch.long, device=self.ctx.device),
            d, lr=self.schedule.lr(t), epochs=self.schedule.epochs(t),
            batch_size=self.ctx.cfg.train.batch_size, seeds=round_seeds(self.ctx.cfg.seed, self.ctx.clients, t),
            local_steps=self.ctx.cfg.train.local_steps,
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
        models = gather_clusters(self.params, part, order)
        return Outbox(order, part, models if self.sizes is None else {**models, "samples": self.sizes[order]})

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        if ex.name == "seed":
            assert self.seeds is not None
            seeding = self.schedule.seeding(inbox.round)
            if seeding is None or seeding.slot != self.seeds.slot:
                return 0  # a late candidate of a slot that has closed
            score, origin = inbox.tensors["score"], inbox.tensors["origin"]
            refused = refused_candidates(score, origin, seeding.slot, self.ctx.cfg.seed, self.ctx.cfg.data.clients)
            self.refused["seed_score"] += int((inbox.delivered & refused).any(0).sum())
            # how far each relay's sender is from its origin (core.seeding): a hosted origin's model is its local one
            # whoever relays it, so only the others' are walked
            sender = inbox.sender.to(origin.device)
            elsewhere = torch.tensor([int(o) not in self.seeds.row for o in origin.tolist()], device=origin.device)
            if self._relay_hops is None or self._relay_hops.graph is not self.ctx.graph:
                self._relay_hops = RelayHops(self.ctx.graph)
            hops = self._relay_hops.hops(sender, origin, seeding.step + 1, elsewhere)
            early = hops > seeding.step  # relayed before the origin's candidate could reach it (first-hand: 0 hops)
            self.refused["seed_early"] += int((inbox.delivered & early.unsqueeze(0)).any(0).sum())
            delivered = inbox.delivered & ~(refused | early).unsqueeze(0)
            check = self.candidate_check
            self.refused["seed_model"] += self.seeds.offer(delivered, score, origin, inbox.tensors, check, sender,
                                                           hops + FIRST_HAND)
            return int(delivered.sum())
        if ex.name == "gossip":
            assert self.consensus is not None
            return self.consensus.receive(inbox.delivered, inbox.tensors)
        delivered = inbox.delivered
        distance = None
        if self.merge_screen is not None:  # a robust one-hop merge, screened like a gossip step
            delivered, distance = screened_arrivals(delivered, inbox.part, inbox.tensors, self.merge_screen)
            self.screened += int((inbox.delivered & ~delivered).sum())
        arrivals = delivered if self.sizes is None else delivered * inbox.tensors["samples"].unsqueeze(0)
        fold_models(self.params, self.weight, arrivals, inbox.part, inbox.tensors)  # eq. 7/8, n-weighted
        if self.merge_folds is not None and distance is not None:
            self.merge_folds.add(arrivals, inbox.part, inbox.tensors, distance)
        return int(inbox.delivered.sum())  # taken, folded or screened out

    def candidate_check(self, rows: Tensor, candidates: Params) -> Tensor:
        """[R] bool: the candidate each row would keep is a finite model whose output depends on that row's inputs,
        and, in slot s > 0, not a copy of a seed already installed: the farthest client's model never predicts
        what seed j predicts on DUPLICATE_AGREEMENT of the row's samples (a liar's copy of seed 0 would make two
        clusters one)."""
        assert self.seeds is not None
        x, _, mask = first_samples(self.data(), rows)
        logits = self.ctx.model.logits({n: v.to(x.device) for n, v in candidates.items()}, x)
        if mask is not None:  # padding reads as the row's first sample
            logits = torch.where(mask.unsqueeze(2), logits, logits[:, :1])
        ok = responds_to_input(logits)
        predicted = logits.argmax(-1)
        for j in range(self.seeds.slot):
            seed = self.ctx.model.logits({n: v[:, j].index_select(0, rows) for n, v in self.params.items()}, x)
            same = (predicted == seed.argmax(-1)).float()
            ok &= (same.mean(1) if mask is None else masked_mean(same, mask)) < DUPLICATE_AGREEMENT
        return ok

    def holds_arrivals(self, ex: Exchange) -> bool:
        """A screened gossip step keeps its arrivals for the step's end (screened_mix takes them together)."""
        return ex.name == "gossip" and isinstance(self.consensus, StepConsensus) and self.consensus.screen is not None

    def end_exchange(self, ex: Exchange) -> None:
        if ex.name == "gossip":
            assert self.consensus is not None
            self.consensus.step()
        elif self.merge_folds is not None and self.merge_screen is not None:  # the merge's end tests
            self.screened += self.merge_folds.settle(self.params, self.weight, self.merge_screen)
            self.merge_folds = None

    def end_round(self, t: int) -> None:
        if (step := self.schedule.seeding(t)) is not None:
            assert self.seeds is not None
            if not step.last:
                return
            self.seeds.install(self.params, step.slot)
            if t + 1 == self.schedule.seeding_rounds:
                self.seeds = None  # the local models are no longer needed
        self.merge_screen = self.merge_folds = None
        if step is None and self.consensus is not None:
            self.consensus.finish(self.params)
            if isinstance(self.consensus, StepConsensus):
                self.screened += self.consensus.dropped
            self.consensus = None
        self.take_losses()

    def take_losses(self) -> None:
        """Eq. 1's losses of the models as they are and, where gossip is screened, the same on each client's first
        SCREEN_SAMPLES samples: the next round's screen limits what its estimates may lose against the one of the
        model its client trains (`screen`). One forward pass gives both."""
        d = self.ctx.cfg.dfca
        head = SCREEN_SAMPLES if d.screen and d.variant == "robust" else 0
        self.losses, self.screen_losses = train_loss_matrices(self.ctx.model, self.params, self.data(), head)

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
        if self.screen_losses is not None:
            extra["screen_losses"] = self.screen_losses
        if self.seeds is not None:  # mid-seeding: the local models and the candidates
            extra.update({f"seed.local.{n}": v for n, v in self.seeds.local.items()})
            extra.update({f"seed.candidate.{n}": v for n, v in self.seeds.models().items()})
            extra.update({"seed.score": self.seeds.score, "seed.origin": self.seeds.origin,
                          "seed.slot": torch.tensor(self.seeds.slot)})
        return state_of(self.params, **extra)

    def load_state(self, tensors: Mapping[str, Tensor]) -> None:
        self.params = {n: v.to(self.ctx.device) for n, v in params_in(tensors).items()}
        self.losses = tensors["losses"].to(self.ctx.device)
        held = tensors.get("screen_losses")  # None: the screen takes its samples' losses itself
        self.screen_losses = None if held is None else held.to(self.ctx.device)
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
