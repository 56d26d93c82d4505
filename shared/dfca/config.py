"""The one experiment config schema, shared by `dfca run`, the REST API and YAML files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator

from dfca.run_size import SCREEN_COPIES, estimated_run_bytes, gib

AlgorithmName = Literal["dfca", "ifca", "dfedavgm", "fedspd", "local", "fedkmeans", "distkmeans", "dpmm_cfl", "fesem",
                        "fedcref"]
ALGORITHMS: tuple[str, ...] = get_args(AlgorithmName)
KMEANS_ALGORITHMS = ("fedkmeans", "distkmeans")  # they cluster feature vectors, not clients
SERVER_CLUSTERING = ("dpmm_cfl", "fesem")  # a server clusters the clients by their uploaded models
MAX_FEDCREF_CLIENTS = 1000
MAX_CATEGORIES_PER_CLIENT = 63  # a client's clusters travel as the bits of an int64 (algorithms.fedcref)


MAX_SEED = 2**32 - 1  # the seeds derived from it (x 1_000_003, x 31 + c) stay inside torch's and numpy's range
MAX_LR = 10.0
MAX_EDGES = 500_000  # expected edges of the communication graph (built in memory, sent to every worker)
MAX_RUN_BYTES = 256 << 30  # a run's estimated tensors (estimated_run_bytes) beyond this are refused


class Strict(BaseModel):
    """Unknown keys are errors; every float must be finite (NaN and infinity are refused as the field's error)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class DataConfig(Strict):
    dataset: Literal["mnist-bundled", "mnist", "emnist", "femnist", "cifar10", "digits", "blobs"] = Field(
        "mnist-bundled", description="blobs: the k-means papers' Gaussian blobs in R^feature_dim (data.features)"
    )
    root: str | None = Field(None, description="folder with local dataset files (not needed for mnist-bundled)")
    rotations: list[int] = Field(default_factory=lambda: [0, 90, 180, 270], min_length=1)
    clients: int = Field(40, ge=2, le=100_000)
    train_per_client: int = Field(100, ge=1, le=100_000)
    test_per_client: int = Field(25, ge=1, le=100_000)
    permute_per_cluster: bool = Field(
        False, description="each cluster draws its own permutation of the training images (IFCA/paper style)"
    )
    mixture: bool = Field(False, description="FedSPD B.1.1: each client mixes two distributions, 10%-90%")
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of the images held out for testing")
    geometry: Literal["isotropic", "heterogeneous", "anisotropic"] = Field(
        "isotropic", description="blobs: std 1; stds 1.0, 2.5, 0.5; or isotropic mapped by A (dfca.data.features)"
    )
    features: Literal["none", "projection"] = Field(
        "none", description="projection: every image becomes its fixed random projection to R^feature_dim"
    )
    feature_dim: int = Field(2, ge=1, le=4096, description="blobs and projection: the dimension d of a point")
    partition: Literal["rotation", "dirichlet", "class_split", "categories"] = Field(
        "rotation", description="rotation: cluster j is the data rotated by rotations[j]; dirichlet, class_split: "
        "label skew with data.groups groups (DPMM-CFL Sec. 4.1, dfca.data.label_skew); categories: every client "
        "holds K_i whole categories (classes), FedCRef's setting (dfca.data.categories; algorithm fedcref sets it)",
    )
    categories_per_client: tuple[int, int] | None = Field(
        None, description="categories: K_i is drawn uniformly in [low, high] (None: [2, classes // 2], the paper's)"
    )
    samples_per_category: int = Field(
        500, ge=1, le=100_000, description="categories: S, samples of each of a client's categories (fewer when the "
        "pool is too small for disjoint shards: the largest S that fits, logged)",
    )
    overlap: float = Field(
        0.0, ge=0.0, lt=1.0, description="categories: share of S that every holder of a category has in common "
        "(FedCRef's overlap O)",
    )
    groups: int | None = Field(
        None, ge=1, le=1000, description="dirichlet, class_split: the true number of groups (None: clusters)"
    )


MAX_OPTIONS_BYTES = 16_384  # a factory's options travel in every config; a few numbers and names


class ModelConfig(Strict):
    kind: Literal["mlp", "cnn", "torch"] = Field(
        "mlp", description="mlp: the built-in MLP (model.hidden); cnn: the paper's CNN; torch: the nn.Module "
        "model.factory makes (docs/configuration.md, 'Your own model')")
    hidden: int = Field(200, ge=1, le=65_536)
    factory: str | None = Field(
        None, max_length=500, description="kind torch: `package.module:function` or `path/to/file.py:function`, "
        "called as function(input_shape, num_classes, **model.options) -> torch.nn.Module")
    options: dict[str, JsonValue] = Field(
        default_factory=dict, description="kind torch: keyword arguments for the factory (JSON values)")

    @model_validator(mode="after")
    def _factory(self) -> ModelConfig:
        if self.kind != "torch":
            if self.factory is not None or self.options:
                raise ValueError(f"model.factory: only model.kind torch takes a factory and options (kind is "
                                 f"{self.kind})")
            return self
        if not self.factory:
            raise ValueError("model.factory: model.kind torch needs a factory, `package.module:function` or "
                             "`path/to/file.py:function`")
        where, sep, function = self.factory.rpartition(":")
        if not sep or not where or not function.isidentifier() or any(c.isspace() for c in self.factory):
            raise ValueError(f"model.factory: {self.factory!r} is not `package.module:function` or "
                             "`path/to/file.py:function`")
        if not where.endswith(".py") and not all(part.isidentifier() for part in where.split(".")):
            raise ValueError(f"model.factory: {where!r} is neither a module path (package.module) nor a .py file")
        if bad := [k for k in self.options if not k.isidentifier()]:
            raise ValueError(f"model.options: {bad[0]!r} is not a keyword argument name")
        if len(json.dumps(self.options)) > MAX_OPTIONS_BYTES:
            raise ValueError(f"model.options: more than {MAX_OPTIONS_BYTES:,} bytes of JSON")
        return self


class TrainConfig(Strict):
    lr: float = Field(0.1, gt=0.0, le=MAX_LR, description=f"SGD step size, finite, at most {MAX_LR:g}")
    local_epochs: int = Field(5, ge=0, le=10_000)
    batch_size: int = Field(50, ge=1, le=100_000)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    lr_decay: float = Field(1.0, gt=0.0, le=1.0, description="multiplicative lr decay per round")


class TopologyConfig(Strict):
    kind: Literal["erdos_renyi", "barabasi_albert", "random_geometric", "ring", "complete"] = "erdos_renyi"
    p: float = Field(0.15, gt=0.0, le=1.0)
    m: int = Field(2, ge=1, le=100_000)
    radius: float = Field(0.3, gt=0.0, le=2.0, description="random_geometric: points in the unit square")
    max_tries: int = Field(1000, ge=1, le=100_000)


class NetworkConfig(Strict):
    """Simulated asynchrony for the simulator: lost and late messages."""

    message_loss: float = Field(0.0, ge=0.0, lt=1.0)
    message_delay: float = Field(0.0, ge=0.0, lt=1.0, description="probability a message arrives one round late")


FULL_TRAFFIC = {"warmup_rounds": 8, "gossip_every": 1, "gossip_steps": 3}  # the robust schedule before `lean`


def traffic_of(dfca: Any) -> str:
    """The traffic preset a DFCA section (a dict as given, or a DFCAConfig) asks for."""
    if not isinstance(dfca, dict):
        return str(dfca.traffic)
    return str(dfca.get("traffic", "full" if dfca.get("screen") else "lean"))


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
            10-20x the paper rule's bytes (the default before issue 16). `screen: true` implies full: the screen guards
            gossip, not one-hop merges.
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
        False,
        description="robust: screened gossip against lying neighbours (core.screened_gossip): weights held to what "
        "an honest client can send, estimates far from the receiver's model of last round or (for its own cluster) "
        "much worse on its own data dropped; costs a copy of the models and a loss per arrival",
    )
    screen_radius: float = Field(
        3.0, gt=0.0, le=1000.0,
        description="screen: drop an estimate farther from last round's model than this many times the distance "
        "the receiver's own training moved its model this round",
    )
    screen_trim: float = Field(
        0.0, ge=0.0, lt=0.5,
        description="screen: each gossip step's estimate is the coordinate-wise mean of the kept estimates with this "
        "fraction cut from each end (W-MSR; about 3x the gossip's cost); 0: their weighted mean, as ratio consensus",
    )
    screen_loss: float = Field(
        0.5, ge=0.0, le=100.0,
        description="screen: drop an estimate of the receiver's own cluster whose loss on its data exceeds "
        "max((1 + screen_loss) x, x + screen_loss), x the loss of its model of last round, or chance (ln classes)",
    )
    seeding: Literal["none", "farthest"] | None = Field(
        None,
        description="farthest: before training, agree on k seed models by farthest-first max-flooding "
        "(core.seeding, dfca.schedule): each seed is the local model of the client the earlier seeds fit worst; "
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
        """traffic: full (or screen: true, unless traffic is named) fills the keys the config leaves out with the
        full schedule's values."""
        if not isinstance(data, dict) or traffic_of(data) != "full":
            return data
        return {**FULL_TRAFFIC, "traffic": "full", **data}

    @property
    def merge_rule(self) -> str:
        return self.merge or ("fresh" if self.variant == "robust" else "paper")

    @property
    def seeding_rule(self) -> str:
        return self.seeding or ("farthest" if self.variant == "robust" else "none")


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


class DPMMConfig(Strict):
    """DPMM-CFL (Sec. 2-3 of the paper; see algorithms.dpmm_cfl for what the paper leaves open)."""

    alpha: float = Field(1.0, gt=0.0, le=1e6, description="DP concentration: how readily new clusters open")
    sigma0: float = Field(1.0, gt=0.0, le=1e6, description="G0 = N(0, sigma0^2 I), the base measure")
    likelihood_var: Annotated[float, Field(gt=0.0, le=1e12)] | Literal["nearest", "pooled"] = Field(
        "pooled", description="s in Sigma = s I, the likelihood covariance (it drives the inferred K), or a rule "
        "that sets it every round: pooled, the within-cluster variance per dimension under the chain's starting "
        "assignments; nearest, the median squared distance from a client to its nearest other client / 2d",
    )
    sampler: Literal["split_merge", "gibbs"] = Field(
        "split_merge", description="split_merge: Jain-Neal restricted Gibbs split-merge plus Gibbs scans; gibbs: "
        "collapsed Gibbs scans only (for comparison)",
    )
    sweeps: int = Field(3, ge=1, le=10_000, description="sampler sweeps per round")
    proposals: int = Field(20, ge=0, le=100_000, description="split-merge proposals per sweep")
    gibbs_scans: int = Field(1, ge=0, le=1000, description="collapsed Gibbs scans per sweep")
    launch_scans: int = Field(5, ge=0, le=1000, description="t: restricted Gibbs scans that build a launch state")
    restart: Literal["previous", "one_cluster"] = Field(
        "previous", description="the chain starts from last round's assignments, or from one cluster every round"
    )
    weighting: Literal["samples", "uniform"] = Field(
        "samples", description="cluster model: eq. (3), weights n_i / N_k; or Algorithm 1's 1 / m_k"
    )
    new_cluster: Literal["members", "parent", "random"] = Field(
        "members", description="a cluster that opens this round starts from the average of its members' models "
        "(eq. 3), from the model its members came from, or from a fresh random model",
    )
    representation: Literal["last_layer", "all"] = Field(
        "last_layer", description="what the sampler clusters: the final layer's weights and bias (the paper), or "
        "every parameter",
    )


class FeSEMConfig(Strict):
    """FeSEM (Long et al. 2023): k centres in parameter space, nearest-centre assignment, weighted averages."""

    representation: Literal["last_layer", "all"] = Field(
        "last_layer", description="the L2 distance over the final layer (as DPMM-CFL clusters) or every parameter"
    )
    iterations: int = Field(10, ge=1, le=10_000, description="E/M passes per round (stops early when stable)")


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


class RuntimeConfig(Strict):
    """Settings of the distributed runtime (`staleness` also decides what the simulator does with late messages)."""

    workers: int | None = Field(None, ge=1, description="the workers the run expects; `:start` refuses it when a "
                                "different number is present (unset: the workers present)")
    round_timeout: float = Field(30.0, gt=0.0, le=86_400.0,
                                 description="seconds a client waits for neighbours per round")
    payload_dtype: Literal["float32", "float16", "bfloat16", "int8"] = Field(
        "float32", description="model tensors on the wire (both drivers: the simulator delivers the rounded values); "
        "int8: 8-bit codes with a float32 scale per row (core.quantize), a quarter of float32's bytes; robust DFCA "
        "with dfca.traffic lean defaults to int8",
    )
    staleness: Literal["drop", "merge"] = Field(
        "drop", description="what a client does with a model that arrives after its round (both drivers: the "
        "simulator's late messages too): drop it, or merge it into the next round's running average",
    )


class ExperimentConfig(Strict):
    name: str = Field("experiment", min_length=1, max_length=200)
    algorithm: AlgorithmName = "dfca"
    init: Literal["global", "local"] = "global"
    aggregation: Literal["sequential", "batch"] = "sequential"
    clusters: int = Field(4, ge=1, le=64)
    rounds: int = Field(
        30, ge=1, le=100_000, description="training rounds (robust DFCA seeds its k models in extra rounds first)"
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description=f"every random draw of the run follows from it (0..{MAX_SEED})")
    eval_every: int = Field(1, ge=1, le=100_000)
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu", description="where models, data and computation live: `dfca run` here; a worker uses DFCA_DEVICE if "
        "set, else this (auto: the GPU if there is one)",
    )
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    dfca: DFCAConfig = Field(default_factory=DFCAConfig)
    fedspd: FedSPDConfig = Field(default_factory=FedSPDConfig)
    fedkmeans: FedKMeansConfig = Field(default_factory=FedKMeansConfig)
    distkmeans: DistKMeansConfig = Field(default_factory=DistKMeansConfig)
    dpmm: DPMMConfig = Field(default_factory=DPMMConfig)
    fesem: FeSEMConfig = Field(default_factory=FeSEMConfig)
    fedcref: FedCRefConfig = Field(default_factory=FedCRefConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @model_validator(mode="before")
    @classmethod
    def _lean_payloads(cls, data: Any) -> Any:
        """Robust DFCA with traffic lean sends 8-bit payloads unless runtime.payload_dtype is named."""
        if not isinstance(data, dict) or data.get("algorithm", "dfca") != "dfca":
            return data
        dfca, runtime = data.get("dfca", {}), data.get("runtime", {})
        variant = dfca.get("variant", "robust") if isinstance(dfca, dict) else dfca.variant
        given = runtime if isinstance(runtime, dict) else runtime.model_dump(exclude_unset=True)
        if variant != "robust" or traffic_of(dfca) != "lean" or "payload_dtype" in given:
            return data
        return {**data, "runtime": {**given, "payload_dtype": "int8"}}

    @model_validator(mode="before")
    @classmethod
    def _fedcref_setting(cls, data: Any) -> Any:
        """algorithm: fedcref implies its setting unless the config names another: data.partition: categories and
        topology.kind: complete (the all-to-all exchange of Algorithm 1)."""
        if not isinstance(data, dict) or data.get("algorithm") != "fedcref":
            return data
        out = dict(data)
        for section, key, value in (("data", "partition", "categories"), ("topology", "kind", "complete")):
            given = out.get(section, {})
            if isinstance(given, dict) and key not in given:
                out[section] = {**given, key: value}
        return out

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        if self.algorithm in ("dfca", "ifca", "fedspd") and len(self.data.rotations) < 1:
            raise ValueError("data.rotations must name at least one rotation")
        if self.data.clients < self.clusters and self.algorithm in ("dfca", "ifca", "fesem"):
            raise ValueError(f"data.clients ({self.data.clients}) must be at least clusters ({self.clusters})")
        if self.topology.kind == "barabasi_albert" and self.topology.m >= self.data.clients:
            raise ValueError("topology.m must be smaller than data.clients")
        self._check_feature_vectors()
        self._check_label_skew()
        self._check_categories()
        if (edges := self.expected_edges()) > MAX_EDGES:
            raise ValueError(f"data.clients, topology: the graph would have about {edges:,.0f} edges, above "
                             f"{MAX_EDGES:,}: fewer clients or a sparser topology (smaller p or m)")
        if (needed := self.estimated_bytes()) > MAX_RUN_BYTES:
            raise ValueError(f"data.clients, model.hidden, data.train_per_client: the run's tensors would take about "
                             f"{gib(needed)}, above the {gib(MAX_RUN_BYTES)} any one run may use")
        return self

    def expected_edges(self) -> float:
        n, t = self.data.clients, self.topology
        pairs = n * (n - 1) / 2
        if t.kind == "complete":
            return pairs
        if t.kind == "erdos_renyi":
            return pairs * t.p
        if t.kind == "barabasi_albert":
            return float(n * t.m)
        if t.kind == "ring":
            return float(n)
        return pairs * min(1.0, 3.1416 * t.radius**2)  # random geometric: a point's disc in the unit square

    def estimated_bytes(self, clients: int | None = None, model_values: int | None = None) -> int:
        """The memory the tensors of `clients` clients (default: all) take, estimated (dfca.run_size); `model_values`:
        a built model's values per copy (a `kind: torch` module's is known only then)."""
        d = self.data
        return estimated_run_bytes(
            dataset=d.dataset, features=d.features, feature_dim=d.feature_dim, kind=self.model.kind,
            hidden=self.model.hidden, clients=d.clients if clients is None else clients, clusters=self.clusters,
            train_per_client=d.train_per_client, test_per_client=d.test_per_client,
            samples=d.samples_per_category * (MAX_CATEGORIES_PER_CLIENT + 1) if d.partition == "categories"
            else None,  # categories: at most MAX_CATEGORIES_PER_CLIENT of S each, rounded up
            extra_copies=SCREEN_COPIES if self.algorithm == "dfca" and self.dfca.screen else 0,
            model_values=model_values)

    def _check_categories(self) -> None:
        data, fedcref = self.data, self.algorithm == "fedcref"
        if fedcref != (data.partition == "categories"):
            raise ValueError("data.partition: categories is FedCRef's setting and FedCRef needs it (algorithm: "
                             f"{self.algorithm}, data.partition: {data.partition})")
        if not fedcref:
            if data.categories_per_client is not None:
                raise ValueError("data.categories_per_client: goes with data.partition: categories")
            return
        if self.topology.kind != "complete":
            raise ValueError("topology.kind: fedcref exchanges models all-to-all (Algorithm 1, line 9): use complete")
        if self.network.message_loss or self.network.message_delay:
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

    def _check_label_skew(self) -> None:
        data = self.data
        if data.partition == "rotation":
            if data.groups is not None:
                raise ValueError("data.groups: goes with data.partition dirichlet or class_split (rotation: clusters)")
            return
        if data.dataset in ("blobs", "femnist") or data.features == "projection":
            raise ValueError(f"data.partition: {data.partition} splits a labelled image pool; data.dataset "
                             f"{data.dataset!r} (features {data.features!r}) is not one")
        if data.mixture:
            raise ValueError(f"data.mixture: FedSPD's mixtures use rotations, not data.partition {data.partition}")
        if data.partition == "categories":
            if data.groups is not None:
                raise ValueError("data.groups: categories draws K_i per client (data.categories_per_client)")
            return
        if (data.groups or self.clusters) > data.clients:
            raise ValueError(f"data.groups: {data.groups or self.clusters} groups need at least as many clients "
                             f"(data.clients is {data.clients})")

    def _check_feature_vectors(self) -> None:
        kmeans, data = self.algorithm in KMEANS_ALGORITHMS, self.data
        vectors = data.dataset == "blobs" or data.features == "projection"
        if kmeans and not vectors:
            raise ValueError(f"algorithm: {self.algorithm} clusters feature vectors; data.dataset {data.dataset!r} "
                             "holds images: use data.dataset: blobs, or data.features: projection")
        if data.dataset == "blobs" and not kmeans:
            raise ValueError(f"data.dataset: blobs holds unlabelled points for {' and '.join(KMEANS_ALGORITHMS)}, "
                             f"not for algorithm {self.algorithm}")
        if data.dataset == "blobs" and data.features == "projection":
            raise ValueError("data.features: projection maps images; data.dataset: blobs are vectors already")
        if kmeans and self.clusters > data.train_per_client:
            raise ValueError(f"clusters: k={self.clusters} centroids need at least k points per node, but "
                             f"data.train_per_client is {data.train_per_client}")
        if data.geometry == "anisotropic" and data.feature_dim != 2:
            raise ValueError("data.geometry: anisotropic maps R^2 by a fixed 2x2 matrix; set data.feature_dim: 2")
        if vectors and self.model.kind == "cnn":
            raise ValueError("model.kind: cnn needs images; feature vectors need mlp")


class ConfigError(ValueError):
    """A config that failed validation; the message names each bad field."""


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(config)"
        lines.append(f"{field}: {e['msg']}")
    return "; ".join(lines)


def parse_config(data: dict[str, Any]) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from err


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides (the CLI's `--set`) to a config mapping, in place.

    The value is read as YAML (`0.05`, `[0, 180]`, `true`, `null`, `erdos_renyi`); missing sections are made.
    The result still has to pass `parse_config`, so a wrong key or value is reported like one in the file.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected key=value with a dotted key, e.g. train.lr=0.05")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"{key}: the value {raw!r} is not valid YAML ({err})") from err
        node = data
        path = key.split(".")
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path[: depth + 1])}: is a value, not a section, so {key} cannot be set")
            node = child
        node[path[-1]] = value
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML mapping of a config file, before validation."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return data


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read, override (`--set`) and validate a config file."""
    return parse_config(apply_overrides(read_config_file(path), overrides))
