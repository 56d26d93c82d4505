"""What the runtime's services say to each other over the broker: JSON documents validated by pydantic.

Control commands go from the topology service to workers (and the aggregator) on `dfca.control`
with routing key `<experiment>.<kind>`; events go from workers and the topology service to
whoever listens (topology, metrics) on `dfca.metrics` with routing key `<experiment>.<kind>`.
Every document names its `deployment` (see `topics.deployment_tag`), so several stacks can share
one broker without acting on each other's messages. Nothing here is pickled.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from dfca.config import ExperimentConfig
from dfca.identity import principals
from dfca.runtime.protocol.holdings import DataHoldings, Placement

ExperimentStatus = Literal["created", "running", "stopping", "stopped", "completed", "failed"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"stopped", "completed", "failed"})
WorkerState = Literal["preparing", "ready", "resumed", "running", "finished", "stopped", "failed"]


MAX_ROUND = 10_000_000  # above any run's rounds (the config caps them at 100,000 plus seeding)
MAX_WORKER = 100_000
NodeId = Annotated[int, Field(ge=0, le=10_000_000)]


class Document(BaseModel):
    """Every control and event document: unknown fields, NaN and infinity are refused, numbers are bounded."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    deployment: str = Field(max_length=200)
    experiment: str = Field(max_length=200)


# -- control: topology -> workers, aggregator ----------------------------------------------------------
class StartCommand(Document):
    """Host your share of `experiment`: build data and clients, bind queues, report `ready`."""

    kind: Literal["start"] = "start"
    config: ExperimentConfig
    workers: int = Field(ge=1)
    neighbours: dict[int, list[int]]
    topology_version: int = 0
    placement: Placement | None = Field(None, description="`data.source: workers`: which worker holds which client")


class GoCommand(Document):
    """Every worker is ready (or the start barrier timed out): begin round 0."""

    kind: Literal["go"] = "go"


class StopCommand(Document):
    kind: Literal["stop"] = "stop"


class TopologyChange(Document):
    """New neighbour lists; a worker applies them before the local step of `effective_round`."""

    kind: Literal["topology"] = "topology"
    version: int
    effective_round: int = Field(ge=0)
    neighbours: dict[int, list[int]]


ControlCommand = Annotated[StartCommand | GoCommand | StopCommand | TopologyChange, Field(discriminator="kind")]
_control = TypeAdapter(ControlCommand)


# -- events: workers, topology -> topology, metrics ------------------------------------------------------
class RoundReport(Document):
    """One worker finished round `round` (1-based, like the simulator's records) for its clients."""

    kind: Literal["round"] = "round"
    worker: int = Field(ge=0, le=MAX_WORKER)
    incarnation: str = Field(max_length=100)
    round: int = Field(ge=1, le=MAX_ROUND)
    clients: list[NodeId] = Field(max_length=100_000)
    complete: bool = Field(description="every live neighbour's model arrived before the round timeout")
    seconds: float = Field(ge=0.0)
    evaluation: dict[str, list[Any]] | None = Field(
        None, description="MessageDriver.report(): clients, assigned, test_accuracy, train_loss, true_cluster"
    )
    stats: dict[str, Any] = Field(default_factory=dict, description="DriverStats.as_dict(), cumulative per incarnation")
    lag_seconds: float = Field(0.0, ge=0.0, description="mean seconds from a neighbour's publish to its delivery here")
    bytes_published: int = Field(0, ge=0, description="payload bytes this worker's clients sent this round, each "
                                 "message counted once per receiver (as the simulator counts)")
    dead_neighbours: list[NodeId] = Field(default_factory=list)
    at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _evaluation_fits(self) -> RoundReport:
        """One value per reported client in every list; accuracies in [0, 1]; cluster ids non-negative integers."""
        if self.evaluation is None:
            return self
        n = len(self.clients)
        for name, values in self.evaluation.items():
            if len(values) != n:
                raise ValueError(f"evaluation.{name}: {len(values)} values for {n} clients")
        if self.evaluation.get("clients", self.clients) != self.clients:
            raise ValueError("evaluation.clients: not the report's clients")
        for name in ("test_accuracy",):
            if not all(isinstance(v, int | float) and 0.0 <= v <= 1.0 for v in self.evaluation.get(name, [])):
                raise ValueError(f"evaluation.{name}: values must lie in [0, 1]")
        for name, least in (("assigned", 0), ("true_cluster", -1)):  # -1: unknown (a folder without clusters.json)
            if not all(isinstance(v, int) and not isinstance(v, bool) and least <= v <= 1_000_000
                       for v in self.evaluation.get(name, [])):
                raise ValueError(f"evaluation.{name}: values must be cluster ids")
        return self


class WorkerEvent(Document):
    """A worker's state for one experiment; sent on every change and every few seconds as its heartbeat."""

    kind: Literal["worker"] = "worker"
    worker: int = Field(ge=0, le=MAX_WORKER)
    incarnation: str = Field(max_length=100)
    state: WorkerState
    round: int = Field(0, ge=0, le=MAX_ROUND, description="rounds completed so far")
    clients: list[NodeId] = Field(default_factory=list, max_length=100_000)
    resumed_from: int | None = Field(None, ge=0, le=MAX_ROUND,
                                     description="rounds completed in the checkpoint it resumed from")
    detail: str = Field("", max_length=2000)
    device: str = Field("", max_length=100, description="where its clients compute (`cpu`, `cuda:0 (GPU name)`); "
                        "empty until it has placed them")
    at: float = Field(default_factory=time.time)


class FinalModelsShare(Document):
    """A worker's share of the run's final models, sent once when its clients finished the last round
    (`dfca.runtime.protocol.final_models`): base64 safetensors of per-model sums and counts, with the sha256 of the
    bytes."""

    kind: Literal["final_models"] = "final_models"
    worker: int
    incarnation: str
    safetensors: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    at: float = Field(default_factory=time.time)


class ExperimentEvent(Document):
    """The topology service's view of an experiment, sent on every status change."""

    kind: Literal["experiment"] = "experiment"
    status: ExperimentStatus
    config: ExperimentConfig
    failed_clients: list[int] = Field(default_factory=list)
    at: float = Field(default_factory=time.time)


class PresenceEvent(BaseModel):
    """A worker process (or the aggregator) announces itself every few seconds, experiment or not: the topology
    service learns how many workers the deployment runs (their DFCA_WORKERS), and whether an aggregator is there
    for the algorithms with a central role, without being told."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["presence"] = "presence"
    role: Literal["worker", "aggregator"] = "worker"
    deployment: str
    worker: int
    workers: int = Field(ge=1)
    holdings: DataHoldings | None = Field(None, description="a worker started on a data folder: its clients' facts")
    at: float = Field(default_factory=time.time)



Event = Annotated[RoundReport | WorkerEvent | ExperimentEvent | PresenceEvent | FinalModelsShare,
                  Field(discriminator="kind")]
_event = TypeAdapter(Event)


class MessageInvalid(ValueError):
    """A control or event message that is not a valid document; it is dead-lettered."""


def encode(document: BaseModel) -> bytes:
    return document.model_dump_json().encode()


def _decode(adapter: TypeAdapter[Any], body: bytes) -> Any:
    try:
        return adapter.validate_json(body)
    except (ValidationError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MessageInvalid(str(err)[:500]) from err


def decode_control(body: bytes) -> StartCommand | GoCommand | StopCommand | TopologyChange:
    return _decode(_control, body)  # type: ignore[no-any-return]


def decode_event(body: bytes) -> RoundReport | WorkerEvent | ExperimentEvent | PresenceEvent | FinalModelsShare:
    return _decode(_event, body)  # type: ignore[no-any-return]


def control_principal(_command: object) -> str:
    """Control commands come from the topology service only."""
    return principals.TOPOLOGY


def event_principal(event: BaseModel) -> str:
    """Who may publish `event`: a worker its own reports, events, presence and final models; the aggregator its
    presence; the topology service the experiment's status."""
    if isinstance(event, ExperimentEvent):
        return principals.TOPOLOGY
    if isinstance(event, PresenceEvent) and event.role == "aggregator":
        return principals.AGGREGATOR
    assert isinstance(event, RoundReport | WorkerEvent | FinalModelsShare | PresenceEvent)
    return principals.worker(event.worker)
