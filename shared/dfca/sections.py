"""The config sections every experiment has, and the base of every section: what `dfca.config` and each algorithm's
own section (dfca.algorithms) share.

`ExperimentBase` holds data, model, train, topology and network; `dfca.config.compose_config` adds `algorithm`, every
registered algorithm's section (declared as a `Strict` model in its file) and `runtime`. The base reads what it needs
of the chosen algorithm through `AlgorithmHooks`, so this module imports neither the algorithms nor the schema that
composes them, and both can import it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from dfca.run_size import estimated_run_bytes, gib

MAX_CATEGORIES_PER_CLIENT = 63  # a client's clusters travel as the bits of an int64 (algorithms.fedcref)


class Strict(BaseModel):
    """Unknown keys are errors; every float must be finite (NaN and infinity are refused as the field's error)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class AlgorithmHooks(Protocol):
    """What the schema reads of an algorithm's clients class (dfca.algorithms.base.Algorithm)."""

    title: ClassVar[str]
    partition: ClassVar[str | None]
    feature_vectors: ClassVar[bool]
    client_per_cluster: ClassVar[bool]

    @classmethod
    def config_defaults(cls, data: dict[str, Any]) -> dict[str, Any]: ...

    @classmethod
    def check_config(cls, cfg: Any) -> None: ...

    @classmethod
    def extra_model_copies(cls, cfg: Any) -> int: ...


MAX_SEED = 2**32 - 1  # the seeds derived from it (x 1_000_003, x 31 + c) stay inside torch's and numpy's range
MAX_LR = 10.0
MAX_EDGES = 500_000  # expected edges of the communication graph (built in memory, sent to every worker)
MAX_RUN_BYTES = 256 << 30  # a run's estimated tensors (estimated_run_bytes) beyond this are refused


BUILTIN_ONLY = ("dataset", "root", "rotations", "train_per_client", "test_per_client", "permute_per_cluster", "mixture",
                "geometry", "features", "feature_dim", "partition", "categories_per_client", "samples_per_category",
                "overlap", "groups")


class DataConfig(Strict):
    source: Literal["builtin", "folder", "workers"] = Field(
        "builtin", description="builtin: data.dataset split by a seeded rule; folder: the federation in data.path "
        "(docs/your_data.md); workers: the clients the registered workers hold, each from its own folder")
    path: str | None = Field(None, description="source folder: the federation's folder, or its .csv/.parquet table")
    classes: int | None = Field(None, ge=2, le=100_000, description="source folder, workers: the number of classes "
                                "C; labels lie in 0..C-1 (unset: the largest label + 1)")
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
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share of the images held out for testing (mnist-bundled, digits); source "
        "folder: share of a client's train samples held out where it has no test set of its own")
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

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.source == "builtin":
            if self.path is not None or self.classes is not None:
                field = "data.path" if self.path is not None else "data.classes"
                raise ValueError(f"{field}: goes with data.source folder or workers (data.source is builtin)")
            return self
        if self.source == "folder" and not self.path:
            raise ValueError("data.path: data.source folder reads the federation from a folder (or a .csv/.parquet "
                             "table); name it")
        if self.source == "workers" and self.path is not None:
            raise ValueError("data.path: with data.source workers each worker reads its own folder (dfca worker "
                             "--data DIR); the experiment names none")
        defaults = DataConfig()
        for name in BUILTIN_ONLY:
            if getattr(self, name) != getattr(defaults, name):
                raise ValueError(f"data.{name}: goes with data.source builtin; the clients of data.source "
                                 f"{self.source} hold their own data")
        return self


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
    local_steps: int | None = Field(
        None, ge=1, le=10_000, description="None: a local epoch walks the client's own samples once, "
        "ceil(n_i / batch_size) steps, so a larger client does more steps; a number: every client's local epoch is "
        "exactly this many steps of batch_size samples, drawn from its own samples by walking seeded permutations of "
        "them (IFCA's tau local steps: local_epochs 1, local_steps tau)")
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


class ExperimentBase(Strict):
    """What every experiment config has; `compose_config` adds `algorithm` and the algorithms' sections."""

    algorithms: ClassVar[Mapping[str, type[AlgorithmHooks]]] = {}  # the registry the schema was composed from

    name: str = Field("experiment", min_length=1, max_length=200)
    algorithm: str = "dfca"  # a Literal of the registered names in the composed schema
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

    @property
    def algorithm_class(self) -> type[AlgorithmHooks]:
        """The clients class of `algorithm`: what the registry knows of it."""
        return self.algorithms[self.algorithm]

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        """The defaults the chosen algorithm implies for other sections (Algorithm.config_defaults)."""
        if not isinstance(data, dict):
            return data
        chosen = cls.algorithms.get(data.get("algorithm", cls.model_fields["algorithm"].default))
        return data if chosen is None else chosen.config_defaults(data)

    @model_validator(mode="after")
    def _check(self) -> ExperimentBase:
        chosen = self.algorithm_class
        if self.data.clients < self.clusters and chosen.client_per_cluster:
            raise ValueError(f"data.clients ({self.data.clients}) must be at least clusters ({self.clusters})")
        if self.topology.kind == "barabasi_albert" and self.topology.m >= self.data.clients:
            raise ValueError("topology.m must be smaller than data.clients")
        self._check_feature_vectors()
        self._check_label_skew()
        self._check_partition()
        chosen.check_config(self)
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
            extra_copies=self.algorithm_class.extra_model_copies(self),
            model_values=model_values)

    def _check_partition(self) -> None:
        """A data.partition that an algorithm owns (Algorithm.partition) goes with that algorithm, and it with it."""
        data, chosen = self.data, self.algorithm_class
        owners = {c.partition: c for c in self.algorithms.values() if c.partition is not None}
        wanted = chosen.partition or (data.partition if data.partition in owners else None)
        if wanted is not None and (chosen.partition != data.partition):
            title = owners[wanted].title
            raise ValueError(f"data.partition: {wanted} is {title}'s setting and {title} needs it (algorithm: "
                             f"{self.algorithm}, data.partition: {data.partition})")
        if data.partition != "categories" and data.categories_per_client is not None:
            raise ValueError("data.categories_per_client: goes with data.partition: categories")

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
        kmeans, data = self.algorithm_class.feature_vectors, self.data
        vectors = data.dataset == "blobs" or data.features == "projection"
        if kmeans and not vectors and data.source == "builtin":
            raise ValueError(f"algorithm: {self.algorithm} clusters feature vectors; data.dataset {data.dataset!r} "
                             "holds images: use data.dataset: blobs, or data.features: projection")
        if data.dataset == "blobs" and not kmeans:
            kinds = ' and '.join(n for n, c in self.algorithms.items() if c.feature_vectors)
            raise ValueError(f"data.dataset: blobs holds unlabelled points for {kinds}, "
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
