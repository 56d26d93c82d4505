"""The topology service's control plane: experiments, graphs, and what workers are told.

The REST layer (`services/topology`) calls `create`, `start`, `stop`, `change_edges` and the
views; one loop thread consumes worker events from `dfca.metrics` and, every tick, sends the
start barrier's `go`, presumes silent workers dead and settles finished experiments.

Edge changes (FedSPD's dynamic network) bind the new edges' queues at once, so no model of a new
neighbour is lost, and tell workers to switch neighbour lists before round `effective_round`
(two rounds after the most advanced worker), where each worker's driver rebinds its queues. Records
are kept in memory and, with a `state_dir`, as one JSON file per experiment so a restarted
topology service picks up where it was.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from dfca.algorithms import algorithm_class, has_central_role
from dfca.config import ExperimentConfig
from dfca.graph import REQUEST_BUDGET_S, build_graph
from dfca.identity import topics
from dfca.identity.broker_setup import bind_to_deployment, ensure_broker_topology
from dfca.identity.principals import worker
from dfca.identity.topics import events_queue, worker_control_queue
from dfca.models.build import model_from_config
from dfca.models.factory import ModelFactoryError, allowed_factories, check_config_model
from dfca.runtime.control.experiments import DONE_STATES, HEARTBEAT_S, RUNTIME_ALGORITHMS, ExperimentRecord
from dfca.runtime.control.placement import PlacementError, data_on_workers, placed_config
from dfca.runtime.control.registry import DataRegistry
from dfca.runtime.protocol.holdings import Placement
from dfca.runtime.protocol.messages import (
    ExperimentEvent,
    FinalModelsShare,
    GoCommand,
    PresenceEvent,
    RoundReport,
    StartCommand,
    StopCommand,
    TopologyChange,
    WorkerEvent,
    decode_event,
    encode,
    event_principal,
)
from dfca.runtime.service.event_consumer import QueueConsumer
from dfca.runtime.service.state_dirs import require_writable
from dfca.transport import Transport, TransportError

log = logging.getLogger(__name__)

TICK_S = 0.5
BUS_SILENCE_S = 3 * HEARTBEAT_S  # no event from any worker for this long: the bus (or this service) is down
PRESENT_FOR_S = 5 * HEARTBEAT_S  # a worker or aggregator last heard from longer ago than this is not present


class UnknownExperiment(KeyError):
    pass


class InvalidTransition(ValueError):
    """A start or stop that the experiment's status does not allow (HTTP 409)."""


class ConfigRejected(ValueError):
    """A valid config the runtime cannot run (HTTP 422); `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def experiment_id(cfg: ExperimentConfig) -> str:
    return topics.experiment_id(cfg.name, uuid.uuid4().hex[:topics.EXPERIMENT_SUFFIX])


def heard_by_host(neighbours: Mapping[int, Iterable[int]], host_of: Callable[[int], int]) -> dict[str, set[int]]:
    """Per worker (its principal), the clients hosted elsewhere that one of its clients neighbours in `neighbours`;
    `host_of(client)` is the ordinal of the worker hosting it."""
    heard: dict[str, set[int]] = {}
    for client, ms in neighbours.items():
        host = host_of(client)
        heard.setdefault(worker(host), set()).update(m for m in ms if host_of(m) != host)
    return heard


class Coordinator:
    """`workers`: how many workers the deployment runs (DFCA_WORKERS); None learns it from the workers'
    presence announcements, and without any, uses the config's `runtime.workers`."""

    def __init__(self, transport: Transport, deployment: str, workers: int | None = None,
                 state_dir: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        self.transport = transport
        self.deployment = deployment
        self.workers = workers
        self.presence: dict[int, tuple[int, float]] = {}  # ordinal -> (its DFCA_WORKERS, last seen)
        self.aggregator_seen = float("-inf")  # when an aggregator last announced itself
        self.last_heard = clock()  # any event from any worker
        self.heard_again_at = self.last_heard  # after a silence of everyone: nobody is presumed dead before
        # dead_after seconds from here
        self.state_dir = None if state_dir is None else require_writable(state_dir, "DFCA_CHECKPOINT_DIR")
        self.clock = clock
        self.records: dict[str, ExperimentRecord] = {}
        self.data = DataRegistry()  # what the workers holding data registered, and whom it refused
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.consumer: QueueConsumer | None = None
        self._control_queues: set[int] = set()  # the ordinals whose control queue this process declared
        self._load()

    # -- lifecycle ------------------------------------------------------------------------------------
    def open(self) -> None:
        """Declare dfca's exchanges and this service's event queue, then start the loop thread."""
        ensure_broker_topology(self.transport)
        queue = events_queue(self.deployment, "topology")
        self.transport.declare_queue(queue, topics.DEAD_LETTER_EXCHANGE, topics.SERVICE_QUEUE_LIMITS)
        bind_to_deployment(self.transport, queue, topics.METRICS_EXCHANGE, self.deployment)
        self.consumer = QueueConsumer(self.transport, queue, decode_event, self.on_event, event_principal)
        self._declare_control_queues(range(self.workers or 0))
        self._thread = threading.Thread(target=self._loop, name="coordinator", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        assert self.consumer is not None
        next_tick = 0.0
        while not self._stop.is_set():
            try:
                self.consumer.poll(min(TICK_S, max(next_tick - time.monotonic(), 0.01)))
                if time.monotonic() >= next_tick:
                    self.tick()
                    next_tick = time.monotonic() + TICK_S
            except Exception:  # keep the control plane alive; the transport reconnects by itself
                log.exception("coordinator loop error")
                self._stop.wait(1.0)

    # -- REST operations ---------------------------------------------------------------------------------
    def create(self, cfg: ExperimentConfig) -> ExperimentRecord:
        if cfg.algorithm not in RUNTIME_ALGORITHMS:
            raise ConfigRejected("algorithm", f"algorithm: the runtime runs {sorted(RUNTIME_ALGORITHMS)}, "
                                              f"not {cfg.algorithm!r} (use `dfca run` for it)")
        placement = None
        if data_on_workers(cfg):  # the model is checked against the data the workers registered
            placement = self._placement(cfg)
            cfg = placed_config(cfg, placement)
        try:
            if placement is None:
                check_config_model(cfg, allowed_factories())  # the operator's allow-list: REST carries names, not code
        except ModelFactoryError as err:
            raise ConfigRejected(err.field, str(err)) from err
        try:
            graph = build_graph(cfg.topology, cfg.data.clients, cfg.seed, budget_s=REQUEST_BUDGET_S)
        except ValueError as err:
            raise ConfigRejected("topology", str(err)) from err
        record = ExperimentRecord.new(experiment_id(cfg), cfg, graph, self.worker_count(cfg), placement)
        with self.lock:
            self.records[record.id] = record
            self._changed(record)
        log.info("experiment %s created", record.id, extra={"experiment": record.id})
        return record

    def _placement(self, cfg: ExperimentConfig) -> Placement:
        """`data.source: workers`: the registered workers' clients, placed, for a model that fits them (else
        ConfigRejected naming the worker)."""
        with self.lock:
            try:
                placement = self.data.placement_for(self._recent_presence(), cfg.data.classes)
            except PlacementError as err:
                raise ConfigRejected("data.source", str(err)) from err
        if placement.num_clients < max(2, cfg.clusters):
            raise ConfigRejected("data.source", f"the registered workers hold {placement.num_clients} clients "
                                 f"({placement.client_ids}); the experiment needs at least {max(2, cfg.clusters)}")
        shape = tuple(placement.input_shape)
        try:
            if cfg.model.kind == "cnn" and len(shape) != 3:
                raise ValueError("model.kind: cnn needs images (channels, height, width)")
            model_from_config(cfg.model, shape, placement.num_classes, "cpu", allowed_factories())
        except (ValueError, RuntimeError, TypeError, IndexError, ModelFactoryError) as err:
            raise ConfigRejected("model", f"the model does not fit the workers' data (samples of shape "
                                 f"{tuple(placement.input_shape)}, {placement.num_classes} classes, from workers "
                                 f"{placement.workers}): {err}") from err
        return placement

    def worker_count(self, cfg: ExperimentConfig) -> int:
        if self.workers is not None:
            return self.workers
        return max(self._recent_presence().values(), default=cfg.runtime.workers or 1)

    def present_workers(self) -> int | None:
        """The workers the deployment runs: DFCA_WORKERS, else what the workers announce; None if unknown."""
        if self.workers is not None:
            return self.workers
        return max(self._recent_presence().values(), default=None)

    def _recent_presence(self) -> dict[int, int]:
        """ordinal -> its DFCA_WORKERS, for the workers heard from within PRESENT_FOR_S."""
        now = self.clock()
        return {o: w for o, (w, seen) in self.presence.items() if now - seen < PRESENT_FOR_S}

    def aggregator_present(self) -> bool:
        return self.clock() - self.aggregator_seen < PRESENT_FOR_S

    def deployment_view(self) -> dict[str, Any]:
        """What this service knows of the deployment's processes (GET /deployment): the workers it runs
        (DFCA_WORKERS, or null where they are learnt from presence), the ordinals heard from within PRESENT_FOR_S,
        and whether an aggregator is. A worker or the aggregator is ready only once it is known here."""
        return {"deployment": self.deployment, "workers": self.present_workers(),
                "workers_present": sorted(self._recent_presence()), "aggregator": self.aggregator_present(),
                **self.data.view()}

    def check_can_run(self, cfg: ExperimentConfig) -> None:
        """Refuse (409) what cannot run here: a central-role algorithm with no aggregator, or a config that asks
        for another number of workers than the deployment has."""
        if has_central_role(cfg.algorithm) and not self.aggregator_present():
            raise InvalidTransition(
                f"algorithm {cfg.algorithm!r} needs the aggregator (its server runs there) and no aggregator has "
                "announced itself: start one (`dfca up --aggregator`, compose `--profile aggregator`, or the k8s "
                "aggregator Deployment), then start the experiment again")
        present = self.present_workers()
        if cfg.runtime.workers is not None and present is not None and cfg.runtime.workers != present:
            raise InvalidTransition(
                f"runtime.workers is {cfg.runtime.workers} but {present} workers are present; set runtime.workers "
                f"to {present} or leave it out (the run uses the workers present)")

    def get(self, experiment: str) -> ExperimentRecord:
        with self.lock:
            record = self.records.get(experiment)
        if record is None:
            raise UnknownExperiment(experiment)
        return record

    def list(self) -> list[ExperimentRecord]:
        with self.lock:
            return sorted(self.records.values(), key=lambda r: r.created_at)

    def start(self, experiment: str) -> ExperimentRecord:
        with self.lock:
            record = self.get(experiment)
            if record.status != "created":
                raise InvalidTransition(f"experiment {experiment} is {record.status}; only a created one starts")
            self.check_can_run(record.config)
            record.workers = self.worker_count(record.config)
            if record.placement is not None:
                try:
                    self.data.check_placement_holds(record.id, record.placement, self._recent_presence(),
                                                    record.workers)
                except PlacementError as err:
                    raise InvalidTransition(str(err)) from err
            record.start(self.clock())
            if has_central_role(record.config.algorithm):
                self._declare_server_queue(record)
            self._declare_control_queues(range(record.workers))
            self._declare_worker_queues(record)
            self._control(StartCommand(deployment=self.deployment, experiment=record.id, config=record.config,
                                       workers=record.workers, neighbours=record.neighbours(),
                                       topology_version=record.topology_version, placement=record.placement))
            self._changed(record)
        log.info("experiment %s started on %d workers", record.id, record.workers, extra={"experiment": record.id})
        return record

    def delete(self, experiment: str) -> None:
        """Forget an experiment that is not running (created, or over): its record, graph and saved file. Its
        metrics stay in the metrics service."""
        with self.lock:
            record = self.get(experiment)
            if record.status in ("running", "stopping"):
                raise InvalidTransition(f"experiment {experiment} is {record.status}; stop it before deleting it")
            del self.records[experiment]
        if self.state_dir is not None:
            (self.state_dir / f"{experiment}.json").unlink(missing_ok=True)
        log.info("experiment %s deleted", experiment, extra={"experiment": experiment})

    def stop(self, experiment: str) -> ExperimentRecord:
        with self.lock:
            record = self.get(experiment)
            if record.terminal:
                raise InvalidTransition(f"experiment {experiment} is already {record.status}")
            if record.status == "created":
                record.finish("stopped", self.clock())
            elif record.status == "running":
                record.status, record.stop_requested_at = "stopping", self.clock()
                self._control(StopCommand(deployment=self.deployment, experiment=record.id))
            self._changed(record)
        return record

    def change_edges(self, experiment: str, add: list[tuple[int, int]], remove: list[tuple[int, int]]
                     ) -> ExperimentRecord:
        with self.lock:
            record = self.get(experiment)
            if record.terminal or record.status == "stopping":
                raise InvalidTransition(f"experiment {experiment} is {record.status}")
            before = record.neighbours()
            record.change_edges(add, remove)
            after = record.neighbours()
            if record.status == "running":
                ahead = max((v.round for v in record.worker_views.values()), default=0)
                record.effective_round = ahead + 2
                self._bind_new_edges(record, before, after)
                self._control(TopologyChange(deployment=self.deployment, experiment=record.id,
                                             version=record.topology_version,
                                             effective_round=record.effective_round, neighbours=after))
            self._changed(record, announce=False)
        return record

    def _declare_server_queue(self, record: ExperimentRecord) -> None:
        """The central role's queue, bound to every client's uploads: they wait there until the aggregator's role
        has started (workers may not declare it: dfca.identity.broker_users)."""
        queue = topics.server_queue(record.id)
        self.transport.declare_queue(queue, topics.DEAD_LETTER_EXCHANGE, topics.MODEL_QUEUE_LIMITS)
        for client in range(record.num_clients):
            self.transport.bind(queue, topics.MODELS_EXCHANGE, topics.neighbour_binding(record.id, client))

    def _declare_control_queues(self, ordinals: Iterable[int]) -> None:
        """The control queues of these workers, bound to this deployment's commands: under per-principal users a worker
        may only consume its own (dfca.identity.broker_users), so this service declares and binds it."""
        for ordinal in ordinals:
            if ordinal in self._control_queues:
                continue
            queue = worker_control_queue(self.deployment, ordinal)
            self.transport.declare_queue(queue, topics.DEAD_LETTER_EXCHANGE, topics.SERVICE_QUEUE_LIMITS)
            bind_to_deployment(self.transport, queue, topics.CONTROL_EXCHANGE, self.deployment)
            self._control_queues.add(ordinal)

    def _declare_worker_queues(self, record: ExperimentRecord) -> None:
        """Each worker's queue of models, declared and bound to whom its clients hear (topics.inbox_binding_keys)
        before any worker is told to start: under per-principal users a worker may only consume it."""
        links = algorithm_class(record.config.algorithm).links
        heard = heard_by_host(record.neighbours(), record.host) if "neighbours" in links else {}
        for ordinal in range(record.workers):
            queue = topics.worker_queue(record.id, worker(ordinal))
            self.transport.declare_queue(queue, topics.DEAD_LETTER_EXCHANGE, topics.MODEL_QUEUE_LIMITS)
            for key in topics.inbox_binding_keys(record.id, heard.get(worker(ordinal), ()), "server" in links):
                self.transport.bind(queue, topics.MODELS_EXCHANGE, key)

    def _bind_new_edges(self, record: ExperimentRecord, before: dict[int, list[int]],
                        after: dict[int, list[int]]) -> None:
        """Bind each worker's queue to the clients hosted elsewhere that its clients newly neighbour, before any worker
        switches to the new graph, so that nothing a new neighbour sends from the effective round on is lost (a
        worker delivers its own clients' messages itself). A removed edge's binding stays (what it delivers is
        acknowledged unused) where the worker may not unbind it; a worker whose user may unbinds it itself."""
        heard = heard_by_host({c: set(ms) - set(before[c]) for c, ms in after.items()}, record.host)
        for host, new in heard.items():
            queue = topics.worker_queue(record.id, host)
            if new:
                self.transport.declare_queue(queue, topics.DEAD_LETTER_EXCHANGE, topics.MODEL_QUEUE_LIMITS)
            for m in sorted(new):
                self.transport.bind(queue, topics.MODELS_EXCHANGE, topics.neighbour_binding(record.id, m))

    # -- events and ticks --------------------------------------------------------------------------------
    def on_event(self, event: RoundReport | WorkerEvent | ExperimentEvent | PresenceEvent | FinalModelsShare) -> None:
        if event.deployment != self.deployment or isinstance(event, ExperimentEvent | FinalModelsShare):
            return
        now = self.clock()
        if now - self.last_heard > BUS_SILENCE_S:
            self.heard_again_at = now
            log.info("hearing workers again after %.0f s of silence", now - self.last_heard)
        self.last_heard = now
        if isinstance(event, PresenceEvent):
            if event.role == "aggregator":
                self.aggregator_seen = self.clock()
            else:
                self.presence[event.worker] = (event.workers, self.clock())
                with self.lock:
                    self.data.register(event.worker, event.holdings, self._placed(), self._recent_presence())
                if event.worker < event.workers:
                    try:
                        self._declare_control_queues([event.worker])
                    except TransportError as err:  # its next presence tries again
                        log.warning("could not declare worker %d's control queue: %s", event.worker, err)
            return
        with self.lock:
            record = self.records.get(event.experiment)
            if record is None or record.status not in ("running", "stopping"):
                return
            view = record.worker_views.get(event.worker)
            before = None if view is None else view.state
            record.observe(event, self.clock())
            if record.worker_views[event.worker].state in DONE_STATES and before not in DONE_STATES:
                self._changed(record, announce=False)  # saved: a restarted service must know it is done

    def _placed(self) -> dict[int, tuple[str, Placement]]:
        """Per worker ordinal, an experiment not yet over that placed clients on it, and its placement."""
        return {o: (r.id, r.placement) for r in self.records.values() if r.placement is not None and not r.terminal
                for o in r.placement.workers}

    def tick(self) -> None:
        now = self.clock()
        with self.lock:
            for record in self.records.values():
                if record.status not in ("running", "stopping"):
                    continue
                if record.barrier_passed(now):
                    record.go = True
                    self._control(GoCommand(deployment=self.deployment, experiment=record.id))
                    self._changed(record, announce=False)
                    log.info("experiment %s: every worker is ready, go", record.id, extra={"experiment": record.id})
                bus_silent = now - self.last_heard > BUS_SILENCE_S
                for w in [] if bus_silent else record.mark_dead(now, self.heard_again_at):
                    log.warning("experiment %s: worker %d is silent, presumed dead", record.id, w,
                                extra={"experiment": record.id, "worker": w})
                status = record.settle(now)
                if status is not None:
                    record.finish(status, now)
                    self._changed(record)
                    self._delete_queues(record)
                    log.info("experiment %s %s (failed clients: %s)", record.id, status, record.failed_clients,
                             extra={"experiment": record.id})

    def _delete_queues(self, record: ExperimentRecord) -> None:
        for ordinal in range(record.workers):
            try:
                self.transport.delete_queue(topics.worker_queue(record.id, worker(ordinal)))
            except Exception as err:  # a queue that never existed, or a broker hiccup: harmless
                log.debug("could not delete the queue of worker %d: %s", ordinal, err)

    # -- publishing and persistence -------------------------------------------------------------------
    def _control(self, command: StartCommand | GoCommand | StopCommand | TopologyChange) -> None:
        key = topics.control_key(self.deployment, command.experiment, command.kind)
        self.transport.publish(topics.CONTROL_EXCHANGE, key, encode(command))

    def _changed(self, record: ExperimentRecord, announce: bool = True) -> None:
        if announce:
            event = ExperimentEvent(deployment=self.deployment, experiment=record.id, status=record.status,
                                    config=record.config, failed_clients=record.failed_clients)
            key = topics.metrics_key(self.deployment, record.id, "experiment")
            self.transport.publish(topics.METRICS_EXCHANGE, key, encode(event))
        if self.state_dir is not None:
            try:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                tmp = self.state_dir / f"{record.id}.json.tmp"
                tmp.write_text(json.dumps(record.to_json()))
                tmp.replace(self.state_dir / f"{record.id}.json")
            except OSError as err:  # writable at start (require_writable): say so at every record it misses
                log.error("cannot persist experiment %s in %s (%s): a restart would lose its latest state",
                          record.id, self.state_dir, err)

    def _load(self) -> None:
        if self.state_dir is None or not self.state_dir.exists():
            return
        for path in sorted(self.state_dir.glob("*.json")):
            try:
                record = ExperimentRecord.from_json(json.loads(path.read_text()))
            except (ValueError, KeyError) as err:
                log.warning("skipping unreadable experiment record %s: %s", path, err)
                continue
            self.records[record.id] = record
