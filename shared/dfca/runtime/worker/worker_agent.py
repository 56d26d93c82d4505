"""One worker process: its runners (one per experiment), its control queue and its heartbeats.

The worker with ordinal w hosts clients c with c % workers == w of every experiment. It learns of
experiments from control commands on `dfca.control` (its own queue, bound to its deployment's keys; the topology
service declares and binds it where the worker's broker user may not) and, when
it starts, from the topology service's REST API: a restarted worker asks which experiments are
running and rejoins them from its checkpoints. Commands name their deployment; others are ignored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import httpx

from dfca.config import ExperimentConfig
from dfca.identity import topics
from dfca.identity.broker_setup import bind_to_deployment, ensure_broker_topology
from dfca.identity.principals import principal_of_user
from dfca.identity.topics import worker_control_queue
from dfca.runtime.control.experiments import HEARTBEAT_S
from dfca.runtime.protocol.holdings import Placement
from dfca.runtime.protocol.messages import (
    TERMINAL_STATUSES,
    FinalModelsShare,
    GoCommand,
    PresenceEvent,
    RoundReport,
    StartCommand,
    StopCommand,
    TopologyChange,
    WorkerEvent,
    control_principal,
    decode_control,
    encode,
)
from dfca.runtime.service.event_consumer import QueueConsumer
from dfca.runtime.service.registration import data_refusal, known_to_topology
from dfca.runtime.worker.client_runner import ClientRunner, RunSpec
from dfca.runtime.worker.data_silo import DataSilo
from dfca.settings import service_auth
from dfca.transport import Transport, TransportError

log = logging.getLogger(__name__)

RECOVER_RETRY_S = 2.0
REGISTRATION_CHECK_BEATS = 5  # a worker holding data asks whether its registration was refused every 5 heartbeats


def with_data_root(cfg: ExperimentConfig, data_root: str | None) -> ExperimentConfig:
    """DFCA_DATA_ROOT fills in `data.root` when the config leaves it empty."""
    if data_root is None or cfg.data.root is not None:
        return cfg
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"root": data_root})})


class WorkerAgent:
    def __init__(
        self,
        deployment: str,
        ordinal: int,
        workers: int,
        connect: Callable[[int], Transport],
        checkpoint_dir: Path,
        topology_url: str | None,
        data_root: str | None = None,
        device: str | None = None,
        silo: DataSilo | None = None,
    ) -> None:
        """`silo`: the worker's own data folder (`--data`, DFCA_DATA_DIR), read; registered with every presence
        announcement and hosted by the experiments over the workers' data."""
        self.deployment, self.ordinal, self.workers, self.connect = deployment, ordinal, workers, connect
        self.checkpoint_dir, self.topology_url, self.data_root = checkpoint_dir, topology_url, data_root
        self.device = device  # DFCA_DEVICE, or None: each experiment's config decides
        self.silo = silo
        self.refusal: str | None = None  # why the topology service refused this worker's data, if it did
        self.transport = connect(64)
        self.runners: dict[str, ClientRunner] = {}
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.recovered = threading.Event()
        self.queue = worker_control_queue(deployment, ordinal)
        self.consumer = QueueConsumer(self.transport, self.queue, decode_control, self.handle, control_principal)
        self._threads: list[threading.Thread] = []
        # one client for the status checks its runners make while they wait (a new one loads the CA bundle each time)
        self._http = httpx.Client(timeout=5.0, headers=service_auth())

    def start(self) -> None:
        if principal_of_user(self.transport.user) is None:  # a shared user; else the topology service declares the
            ensure_broker_topology(self.transport)  # control queue and binds it (a worker's own user may not)
            self.transport.declare_queue(self.queue, topics.DEAD_LETTER_EXCHANGE, topics.SERVICE_QUEUE_LIMITS)
            bind_to_deployment(self.transport, self.queue, topics.CONTROL_EXCHANGE, self.deployment)
        for name, target in (("control", self._control_loop), ("heartbeat", self._heartbeat_loop),
                             ("recover", self._recover_loop)):
            thread = threading.Thread(target=target, name=f"worker-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Leave every experiment where it is (checkpoints stay), close connections."""
        self.stopping.set()
        with self.lock:
            runners = list(self.runners.values())
        for runner in runners:
            runner.halt()
        for runner in runners:
            runner.join(timeout)
        for thread in self._threads:
            thread.join(2.0)
        self.transport.close()
        self._http.close()

    # -- control ------------------------------------------------------------------------------------------
    def handle(self, command: StartCommand | GoCommand | StopCommand | TopologyChange) -> None:
        if command.deployment != self.deployment:
            return
        if isinstance(command, StartCommand):
            if self.topology_url and self._status(command.experiment) not in ("running", None):
                return  # a backlog command of an experiment that is over
            self._launch(RunSpec(self.deployment, command.experiment, command.config, command.workers,
                                 self.ordinal, command.neighbours, command.topology_version, device=self.device,
                                 placement=command.placement))
            return
        with self.lock:
            runner = self.runners.get(command.experiment)
        if runner is not None:
            runner.post(command)

    def _launch(self, spec: RunSpec) -> None:
        if spec.ordinal >= spec.workers:
            log.warning("experiment %s has %d workers; worker %d sits it out", spec.experiment, spec.workers,
                        spec.ordinal)
            return
        spec.config = with_data_root(spec.config, self.data_root)
        with self.lock:
            if spec.experiment in self.runners or self.stopping.is_set():
                return
            runner = ClientRunner(spec, self.connect, self.emit, self.checkpoint_dir,
                                  over=(lambda: self._status(spec.experiment) in (*TERMINAL_STATUSES, "unknown"))
                                  if self.topology_url else None, silo=self.silo)
            self.runners[spec.experiment] = runner
        log.info("experiment %s: hosting clients %s", spec.experiment, spec.clients,
                 extra={"experiment": spec.experiment, "worker": self.ordinal})
        runner.start()

    def emit(self, event: RoundReport | WorkerEvent | FinalModelsShare) -> None:
        """Publish a runner's event. A round's report does not hold up the next round: it is handed over without
        waiting for the broker's confirm, which the runner's next event awaits first (a refusal, or no confirm
        within the transport's publish timeout, raises TransportError there, one round later; a lost connection
        resends it). Every other event returns once the broker has it, and so do the reports before it."""
        self.transport.await_confirms()
        message = (topics.METRICS_EXCHANGE, event_key(event), encode(event), None)
        if isinstance(event, RoundReport):
            self.transport.publish_pipelined([message])
        else:
            self.transport.publish_many([message])

    # -- threads ------------------------------------------------------------------------------------------
    def _control_loop(self) -> None:
        waiting = False
        while not self.stopping.is_set():  # until the topology service has declared the queue (it hears our presence)
            try:
                self.consumer.poll(0.5)
                break
            except TransportError as err:
                if "404" not in str(err):
                    break  # run_forever retries
                if not waiting:
                    log.info("waiting for the topology service to declare %s", self.queue)
                    waiting = True
                self.stopping.wait(0.5)
        self.consumer.run_forever(self.stopping)

    def _heartbeat_loop(self) -> None:
        beats = 0
        while True:
            with self.lock:
                runners = [r for r in self.runners.values() if not r.finished]
            try:
                presence = PresenceEvent(deployment=self.deployment, worker=self.ordinal, workers=self.workers,
                                         holdings=None if self.silo is None else self.silo.holdings())
                self.transport.publish(topics.METRICS_EXCHANGE, topics.presence_key(self.deployment),
                                       encode(presence))
                for runner in runners:  # not emit: awaiting a runner's round report is the runner's business
                    event = runner.worker_event()
                    self.transport.publish(topics.METRICS_EXCHANGE, event_key(event), encode(event))
            except Exception as err:  # the transport retries; a missed heartbeat is harmless
                log.warning("heartbeat failed: %s", err)
            if self.silo is not None and self.topology_url and beats % REGISTRATION_CHECK_BEATS == 1:
                self.check_registration()  # a refusal is logged even where nobody probes /readyz
            beats += 1
            if self.stopping.wait(HEARTBEAT_S):
                return

    def _recover_loop(self) -> None:
        """Rejoin the experiments the topology service says are running (after a restart)."""
        if not self.topology_url:
            self.recovered.set()
            return
        while not self.stopping.is_set():
            try:
                self._recover()
                self.recovered.set()
                return
            except (httpx.HTTPError, ValueError, KeyError) as err:
                log.info("topology service not reachable yet (%s); retrying", err)
                self.stopping.wait(RECOVER_RETRY_S)

    def _recover(self) -> None:
        assert self.topology_url
        for spec in running_specs(self.topology_url, self.deployment, self.ordinal, self.device):
            self._launch(spec)

    def _status(self, experiment: str) -> str | None:
        """The experiment's status per the topology service; None when it cannot be asked."""
        try:
            response = self._http.get(f"{self.topology_url}/experiments/{experiment}")
        except httpx.HTTPError:
            return None
        if response.status_code == 404:
            return "unknown"
        return str(response.json().get("status")) if response.is_success else None

    def check_registration(self) -> str | None:
        """Ask the topology service whether it refused this worker's data; log a new refusal. The refusal, or None."""
        refusal = data_refusal(self._http, self.topology_url, self.ordinal)
        if refusal is not None and refusal != self.refusal:
            log.error("the topology service refused this worker's data: %s", refusal)
        self.refusal = refusal
        return refusal

    def ready(self) -> bool:
        """Rejoined the running experiments, and known to the topology service (dfca.runtime.service.registration),
        which has not refused its data."""
        if self.silo is not None and self.check_registration() is not None:
            return False
        return (self.recovered.is_set() and not self.stopping.is_set()
                and known_to_topology(self._http, self.topology_url, "worker", self.ordinal))


def event_key(event: RoundReport | WorkerEvent | FinalModelsShare) -> str:
    """A runner's event's routing key on dfca.metrics."""
    return topics.metrics_key(event.deployment, event.experiment, event.kind)


def running_specs(topology_url: str, deployment: str, ordinal: int, device: str | None = None,
                  algorithms: Collection[str] | None = None) -> list[RunSpec]:
    """The experiments the topology service says are running (of `algorithms`, when given), as run specs."""
    specs = []
    with httpx.Client(base_url=topology_url, timeout=5.0, headers=service_auth()) as client:
        for item in client.get("/experiments").raise_for_status().json():
            if item["status"] != "running":
                continue
            detail = client.get(f"/experiments/{item['id']}").raise_for_status().json()
            if algorithms is not None and detail["config"].get("algorithm") not in algorithms:
                continue
            topo = client.get(f"/experiments/{item['id']}/topology").raise_for_status().json()
            specs.append(spec_from_rest(deployment, ordinal, detail, topo, device))
    return specs


def spec_from_rest(deployment: str, ordinal: int, detail: dict[str, Any], topo: dict[str, Any],
                   device: str | None = None) -> RunSpec:
    return RunSpec(
        deployment=deployment, experiment=detail["id"], config=ExperimentConfig.model_validate(detail["config"]),
        workers=int(topo["workers"]), ordinal=ordinal,
        neighbours={int(c): [int(m) for m in ms] for c, ms in topo["neighbours"].items()},
        topology_version=int(topo["version"]), go=bool(detail["go"]), device=device,
        placement=Placement.model_validate(topo["placement"]) if topo.get("placement") else None,
    )
