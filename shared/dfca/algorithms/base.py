"""The algorithm interface: each algorithm is written once, and both drivers run it unchanged.

An algorithm holds batched state over the participants one driver hosts: rows of clients (all N in
the simulator, a worker's M on the runtime) or the single row of a central role (IFCA's server). A
round is a list of message exchanges (`exchanges(t)`). The driver runs it so:

    begin_round(t)
    for each exchange ex of round t:
        send(ex)                 -> Outbox: what every hosted row publishes (if this side sends in ex)
        receive(ex, inbox)       -> fold what arrived (if this side receives in ex); called with all of an
                                    exchange's messages at once (simulator) or one message at a time (runtime)
        end_exchange(ex)
    end_round(t)

`evaluate`, `state` / `load_state` and `final_models` report and persist. A message's routing `part`
is a cluster index (0 where there is one model); its tensors are checked against `payload(ex)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor

from dfca.algorithms.client_data import test_accuracy, train_losses
from dfca.data import FederatedData
from dfca.identity import topics
from dfca.models.batched import BatchedModel, Params
from dfca.schedule import RoundSchedule
from dfca.sections import Strict
from dfca.wire.codec import PAYLOAD_DTYPES, TensorSpec, as_received, model_as_received

if TYPE_CHECKING:
    import networkx as nx

    from dfca.sections import ExperimentBase

Side = Literal["clients", "server"]
SERVER = topics.SERVER_SENDER  # the sender id of a central role
Graph = Mapping[int, list[int]]


@dataclass(frozen=True)
class Exchange:
    """One message exchange of a round: every `sender` row publishes, the `receiver` side collects.

    sender clients, receiver clients: to the sender's graph neighbours; sender clients, receiver server:
    to the central role; sender server: to every client. `parts`: messages per sender (the server's k
    models). `averaged`: the messages enter a running average (eq. 7/8), so under `aggregation: batch`
    the message driver holds them and folds them in sender order when the exchange closes. `stale_ok`: a
    message that arrives after its exchange closed may still be folded into the next round's exchange of
    the same name (`runtime.staleness: merge`). `wait`: the deadline, in round timeouts. `needs_arrival`:
    the deadline counts from the first arrival (a server does not close an empty round).
    """

    name: str
    step: int = 0
    sender: Side = "clients"
    receiver: Side = "clients"
    parts: int = 1
    averaged: bool = False
    stale_ok: bool = False
    wait: float = 1.0
    needs_arrival: bool = False


class LazyTensors(Mapping[str, Tensor]):
    """Tensors computed on first access: what a row sends when only a driver that encodes needs it."""

    def __init__(self, names: list[str], make: Callable[[], Mapping[str, Tensor]],
                 ready: Mapping[str, Tensor] | None = None) -> None:
        self._names, self._make, self._made = names, make, dict(ready or {})

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._made:
            self._made.update(self._make())
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class Outbox:
    """What the hosted rows publish in one exchange: message s comes from row `row[s]`, routed by `part[s]`,
    and carries `tensors[name][s]`. The simulator hands the tensors to `receive` as they are, so they must not
    be views of state that `receive` changes."""

    row: Tensor  # [S] long
    part: Tensor  # [S] long
    tensors: Mapping[str, Tensor]
    lengths: Tensor | None = None  # [S] long: rows of each message's ragged tensors (the rest is padding)

    def frozen(self) -> Outbox:
        """A copy that later changes of the senders' state do not reach (for messages delivered late)."""
        lengths = None if self.lengths is None else self.lengths.clone()
        return Outbox(self.row.clone(), self.part.clone(), {n: self.tensors[n].clone() for n in self.tensors}, lengths)


@dataclass
class Inbox:
    """Messages delivered to the hosted rows: delivered[i, s] says row i received message s."""

    delivered: Tensor  # [M, S] bool
    sender: Tensor  # [S] long: the global id of each message's sender (SERVER for a central role)
    part: Tensor  # [S] long
    tensors: Mapping[str, Tensor]  # name -> [S, ...]
    round: int  # the round the messages were sent in (earlier than now: stale, `runtime.staleness: merge`)


@dataclass
class Evaluation:
    """The hosted clients' state after a round."""

    assigned: Tensor  # [M] the cluster each client would use now
    test_accuracy: Tensor  # [M] accuracy on the client's own test split with that model
    train_loss: Tensor  # [M] train loss of that model
    cluster_params: Params | None  # [M, k, ...] for Disp_j, when the algorithm keeps k models per client
    extra: dict[str, list[Any]] = field(default_factory=dict)  # per-client extras of a round report


@dataclass
class HostContext:
    """What an algorithm instance is built from: config, model, the hosted clients and their data."""

    cfg: ExperimentBase
    model: BatchedModel
    data: FederatedData | None  # the hosted clients' shards, on `device` (None for a central role)
    clients: list[int]  # the hosted rows' global client ids
    graph: Graph  # the whole communication graph, client -> neighbours
    device: torch.device
    whole: bool = False  # every client is hosted and each exchange is delivered at once (the simulator)

    @property
    def rows(self) -> Tensor:
        return torch.tensor(self.clients, dtype=torch.long, device=self.device)


class Algorithm(ABC):
    """One side (clients or a central role) of one algorithm, batched over the rows a driver hosts."""

    side: ClassVar[Side] = "clients"
    links: ClassVar[frozenset[str]] = frozenset()  # whom the clients hear: "neighbours", "server"
    clusters_clients: ClassVar[bool] = True  # it assigns clients to clusters (k-means clusters their points)
    k: int = 1  # models per client; a message's part lies in 0..k-1

    # -- what the registry, the schema and the drivers read of an algorithm's clients class ----------------------
    title: ClassVar[str] = ""  # its name in messages (its paper's)
    central_role: ClassVar[type[Algorithm] | None] = None  # the server side, run by the aggregator
    section: ClassVar[str | None] = None  # the key of its config section (`dfca:`), whose model is `Section`
    Section: ClassVar[type[Strict] | None] = None
    Schedule: ClassVar[type[RoundSchedule]] = RoundSchedule  # its rounds, learning rates and local epochs
    infers_clusters: ClassVar[bool] = False  # it infers K itself (the collapse watch then expects one cluster)
    trains_classifier: ClassVar[bool] = True  # its model is a classifier of model.kind (a `kind: torch` factory)
    feature_vectors: ClassVar[bool] = False  # it clusters feature vectors (blobs or projected images), not images
    partition: ClassVar[str | None] = None  # the data.partition it needs, which no other algorithm takes
    client_per_cluster: ClassVar[bool] = False  # it needs at least as many clients as clusters

    @classmethod
    def config_defaults(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The config as given (before validation) with the defaults this algorithm implies for other sections."""
        return data

    @classmethod  # noqa: B027 - an optional hook
    def check_config(cls, cfg: ExperimentBase) -> None:
        """Raise ValueError (naming the field) when `cfg`'s other sections do not suit this algorithm."""

    @classmethod
    def extra_model_copies(cls, cfg: ExperimentBase) -> int:
        """Model copies per client beyond the k its state holds (for the run's memory estimate, dfca.run_size)."""
        return 0

    @classmethod
    def variant(cls, cfg: ExperimentBase) -> str | None:
        """Which of its rules `cfg` runs, as a run's summary names it (None: it has one)."""
        return None

    @classmethod
    def rounds_note(cls, cfg: ExperimentBase) -> str:
        """What `dfca run` adds after the number of rounds (an algorithm that stops on its own says so)."""
        return ""

    def graph_warning(self, graph: nx.Graph) -> str | None:
        """A warning about the drawn communication graph for this run (the simulator logs it), or None."""
        return None

    def __init__(self, ctx: HostContext) -> None:
        self.ctx = ctx
        self.schedule = schedule_of(ctx.cfg)
        self.refused: Counter[str] = Counter()  # arrivals `receive` would not use, by reason (both drivers count them)
        self.screened = 0  # (arrival, cluster) pairs screened gossip dropped (core.screened_gossip)

    @abstractmethod
    def exchanges(self, t: int) -> list[Exchange]:
        """The message exchanges of round t (the same list on every side)."""

    @abstractmethod
    def payload(self, ex: Exchange) -> dict[str, TensorSpec]:
        """What one message of `ex` carries."""

    def begin_round(self, t: int) -> None:  # noqa: B027 - an optional hook
        """Local computation before the round's first exchange."""

    def send(self, ex: Exchange) -> Outbox:
        raise NotImplementedError(f"{type(self).__name__} sends nothing in {ex.name}")

    def receive(self, ex: Exchange, inbox: Inbox) -> int:
        """Fold delivered messages in; returns how many (row, message) pairs were used."""
        raise NotImplementedError(f"{type(self).__name__} receives nothing in {ex.name}")

    def end_exchange(self, ex: Exchange) -> None:  # noqa: B027 - an optional hook
        """After the exchange's last delivery."""

    def holds_arrivals(self, ex: Exchange) -> bool:
        """True where `receive` only keeps what arrives for `ex`, all of it used together at `end_exchange`: the
        message driver then folds it as one inbox once nothing more is due, not a few messages at a time."""
        return False

    def end_round(self, t: int) -> None:  # noqa: B027 - an optional hook
        """After the round's last exchange."""

    @abstractmethod
    def state(self) -> dict[str, Tensor]:
        """Tensors to checkpoint after a round; the model copies as `params.<name>`."""

    @abstractmethod
    def load_state(self, tensors: Mapping[str, Tensor]) -> None: ...

    def model_copies(self) -> Mapping[str, Tensor]:
        """The model copies (`state()`'s `params.*`, by name), which must stay finite (check_finite). An algorithm
        whose state also holds what is costly to build (DFCA's seed candidates) returns them directly."""
        return params_in(self.state())

    def evaluate(self) -> Evaluation:
        raise NotImplementedError(f"{type(self).__name__} has no clients to evaluate")

    def final_models(self) -> dict[str, Params]:
        """Named single models to save (no client dimension)."""
        return {}

    def final_model_sums(self) -> dict[str, tuple[Params, int]]:
        """This host's share of the run's final models, for a runtime worker: per name, a sum over its clients and
        how many clients it sums, so that the totals over all workers divided by the counts are `final_models()`
        of the whole run. By default each of `final_models()` counts for every hosted client."""
        m = len(self.ctx.clients)
        return {name: ({n: t * m for n, t in params.items()}, m) for name, params in self.final_models().items()}

    @property
    def finished(self) -> bool:
        """The algorithm met its own stopping rule (FedCRef's); both drivers end the run after this round."""
        return False

    def set_graph(self, graph: Graph) -> None:
        """The communication graph changed (FedSPD's dynamic network)."""
        self.ctx.graph = graph

    @classmethod
    def run_metrics(cls, cfg: ExperimentBase, report: Mapping[str, list[Any]], data: Callable[[], FederatedData],
                    graph: Graph) -> dict[str, float]:
        """Metrics over every client's report (`report_of`), beyond the accuracy and ARI every run reports.

        The simulator and the metrics service both call it; `data` builds every client's shards when needed.
        """
        return {}

    # -- helpers the algorithms share ----------------------------------------------------------------
    def model_spec(self, lead: tuple[int, ...] = (), prefix: str = "") -> dict[str, TensorSpec]:
        return {prefix + n: TensorSpec((*lead, *s)) for n, s in self.ctx.model.shapes().items()}

    def wire_rounding(self) -> Callable[[Params], Params] | None:
        """What crossing the wire does to a batch of models [R, ...] (runtime.payload_dtype; None: float32, nothing)."""
        dtype = self.ctx.cfg.runtime.payload_dtype
        if dtype == "float32":
            return None
        spec = self.model_spec()
        return lambda models: as_received(spec, models, PAYLOAD_DTYPES[dtype])

    def wire_tensor_rounding(self) -> Callable[[Tensor, Tensor], Tensor] | None:
        """What crossing the wire does to one model tensor [..., C] (rows of C rounded apart), written into a second
        tensor of its shape (None: float32, nothing)."""
        dtype = self.ctx.cfg.runtime.payload_dtype
        if dtype == "float32":
            return None
        return lambda t, out: model_as_received(t, PAYLOAD_DTYPES[dtype], out)

    def data(self) -> FederatedData:
        assert self.ctx.data is not None, "a central role holds no client data"
        return self.ctx.data

    def losses_of(self, params: Params) -> Tensor:
        return train_losses(self.ctx.model, params, self.data())

    def evaluation(self, params: Params, losses: Tensor, assigned: Tensor, keeps_k: bool = True) -> Evaluation:
        """Each client's test accuracy and train loss with its model of `assigned`."""
        acc = test_accuracy(self.ctx.model, params, assigned, self.data())
        loss = losses.gather(1, assigned.unsqueeze(1)).squeeze(1)
        return Evaluation(assigned, acc, loss, params if keeps_k else None)



# -- the registry: the clients class of every algorithm, by config name (filled by dfca.algorithms) ------------
CLIENTS: dict[str, type[Algorithm]] = {}


def register(name: str, algorithm: type[Algorithm]) -> None:
    """Make `algorithm` (its clients class) the algorithm `name`: what `algorithm: <name>` in a config runs."""
    if not name.isidentifier():
        raise ValueError(f"algorithm name {name!r} is not an identifier (it names a config section's owner)")
    CLIENTS[name] = algorithm


def unregister(name: str) -> None:
    """Forget the algorithm `name` (a test's own algorithm, after the test)."""
    CLIENTS.pop(name, None)


def algorithm_class(name: str) -> type[Algorithm]:
    if name not in CLIENTS:
        raise ValueError(f"algorithm: {name!r} is not implemented yet (available: {sorted(CLIENTS)})")
    return CLIENTS[name]


def schedule_of(cfg: ExperimentBase) -> RoundSchedule:
    """The round schedule of `cfg`: its algorithm's `Schedule`."""
    return algorithm_class(cfg.algorithm).Schedule(cfg)

class RunDiverged(RuntimeError):
    """The models stopped being finite numbers: training diverged (a learning rate too large for the data)."""


def check_finite(algorithm: Algorithm, t: int, tensors: Mapping[str, Tensor] | None = None) -> None:
    """Raise RunDiverged when the models (`tensors`, default the algorithm's `params.*` state) hold NaN or infinite
    values. The simulator checks after every round; the message driver checks what it is about to send, so a
    diverged run fails at once with the reason instead of sending NaN models, which receivers reject as invalid,
    until every round times out."""
    if tensors is None:
        tensors = algorithm.model_copies()
    bad = sorted(n for n, v in tensors.items() if v.is_floating_point() and not all_finite(v))
    if bad:
        raise RunDiverged(f"round {t}: the models' {', '.join(bad[:4])} hold NaN or infinite values: training "
                          f"diverged; lower train.lr (now {algorithm.ctx.cfg.train.lr:g})")


def all_finite(v: Tensor) -> bool:
    """Whether v holds no NaN or infinite value. A NaN or an infinity makes the sum NaN or infinite, so a finite sum
    settles it in one pass without a [numel] mask; only a sum that overflowed from finite values is checked
    value by value."""
    return bool(torch.isfinite(v.sum())) or bool(torch.isfinite(v).all())


def report_of(ev: Evaluation, clients: list[int], true_cluster: Tensor) -> dict[str, list[Any]]:
    """An evaluation as a round report carries it: per-client lists, the algorithm's extras included."""
    return {"clients": list(clients), "assigned": ev.assigned.tolist(), "test_accuracy": ev.test_accuracy.tolist(),
            "train_loss": ev.train_loss.tolist(), "true_cluster": true_cluster.tolist(), **ev.extra}


def state_of(params: Params, **extra: Tensor) -> dict[str, Tensor]:
    """A checkpoint's tensors: the model copies as `params.<name>`, plus `extra`."""
    return {**{f"params.{n}": v for n, v in params.items()}, **extra}


def params_in(tensors: Mapping[str, Tensor], prefix: str = "params.") -> Params:
    return {n.removeprefix(prefix): v for n, v in tensors.items() if n.startswith(prefix)}


def cluster_sums(params: Params, assigned: Tensor, k: int) -> dict[str, tuple[Params, int]]:
    """`cluster_means`' share of one host: cluster j's members' sum and count, and as `cluster_j@all` every hosted
    client's copy of j (the model of a cluster that nobody in the whole run is assigned to)."""
    out: dict[str, tuple[Params, int]] = {}
    for j in range(k):
        rows = (assigned == j).nonzero().flatten()
        out[f"cluster_{j}"] = ({n: t[rows, j].sum(0) for n, t in params.items()}, int(rows.numel()))
        out[f"cluster_{j}@all"] = ({n: t[:, j].sum(0) for n, t in params.items()}, int(assigned.shape[0]))
    return out


def cluster_means(params: Params, assigned: Tensor, k: int) -> dict[str, Params]:
    """Cluster j's saved model: the mean over clients assigned to j (all clients if none is)."""
    out: dict[str, Params] = {}
    for j in range(k):
        rows = (assigned == j).nonzero().flatten()
        if rows.numel() == 0:
            rows = torch.arange(assigned.shape[0], device=assigned.device)
        out[f"cluster_{j}"] = {n: t[rows, j].mean(0) for n, t in params.items()}
    return out
