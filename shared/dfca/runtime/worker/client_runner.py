"""The round loop of one experiment on one worker, around the message driver (runtime.driver.message_driver).

Life of a runner (one thread, never the transport's I/O thread):
1. prepare: build the data every process builds identically from the seed, keep this worker's
   clients, place them on the worker's device (DFCA_DEVICE, else the config's `device`), build the
   algorithm (dfca.algorithms) and a message driver over a `HostTransport`, declare and bind its
   queues, and load `<checkpoint_dir>/<experiment>/<ordinal>.safetensors` if it exists (a restart
   resumes there);
2. report `ready` (or `resumed`), then wait for the topology service's `go` (the start barrier:
   nobody publishes round 0 before every queue is bound) unless the experiment is already running;
3. rounds: apply due topology changes, run the round's exchanges (the driver waits for every live
   neighbour or `runtime.round_timeout`), copy the state and hand it to the checkpoint writer, which
   writes it while the next round runs and then acks the round's messages; report the round to
   `dfca.metrics`;
4. report `finished` after the last round, `stopped` on a stop command, `failed` on an error.

A lost broker connection is absorbed by the transport (it reconnects and the broker redelivers
what was not acked). If the transport gives up (`TransportError`), the runner starts over from
its last checkpoint on a new connection: nothing acked was lost, since acks follow checkpoints.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dfca.algorithms import HostContext, clients_of, schedule_of
from dfca.config import ExperimentConfig
from dfca.data import FederatedData, build_federated_data
from dfca.devices import device_name, worker_device
from dfca.heap import keep_freed_memory
from dfca.identity.principals import principal_of_user
from dfca.identity.sharding import clients_of as hosted_clients
from dfca.models.build import model_from_config
from dfca.models.factory import allowed_factories
from dfca.run_size import check_fits_memory, leaves_room
from dfca.runtime.driver.checkpoints import CheckpointWriter
from dfca.runtime.driver.host_transport import HostTransport, RunInterrupted
from dfca.runtime.driver.message_driver import MessageDriver
from dfca.runtime.protocol.final_models import encode_sums
from dfca.runtime.protocol.holdings import Placement
from dfca.runtime.protocol.messages import (
    FinalModelsShare,
    GoCommand,
    RoundReport,
    StopCommand,
    TopologyChange,
    WorkerEvent,
    WorkerState,
)
from dfca.runtime.worker.data_silo import DataSilo, SiloMismatch, empty_data
from dfca.transport import Transport, TransportError

log = logging.getLogger(__name__)

EventSink = Callable[[RoundReport | WorkerEvent | FinalModelsShare], None]
Connect = Callable[[int], Transport]  # prefetch -> a new connection
MAX_RECOVERIES = 20
OVER_CHECK_S = 5.0  # while waiting for messages, ask the topology service this often whether the run has ended
RECOVERY_BACKOFF_S = (1.0, 15.0)


@dataclass
class RunSpec:
    deployment: str
    experiment: str
    config: ExperimentConfig
    workers: int
    ordinal: int
    neighbours: dict[int, list[int]]  # the whole graph
    topology_version: int = 0
    go: bool = False  # the experiment is already past its start barrier
    device: str | None = None  # DFCA_DEVICE: where this worker computes (None: the config's `device`)
    placement: Placement | None = None  # `data.source: workers`: which worker holds which client

    @property
    def clients(self) -> list[int]:
        if self.placement is not None:
            return self.placement.clients_of(self.ordinal)
        return hosted_clients(self.ordinal, self.workers, self.config.data.clients)

    @property
    def hosts(self) -> list[int] | None:
        """Each client's worker where workers hold their own data; None: client c on worker c % workers."""
        return None if self.placement is None else self.placement.hosts


def checkpoint_path(checkpoint_dir: Path, experiment: str, ordinal: int) -> Path:
    return checkpoint_dir / experiment / f"{ordinal}.safetensors"


def prefetch_for(neighbours: dict[int, list[int]], clients: list[int], messages_per_round: int = 1) -> int:
    """The worker queue's prefetch: room for several rounds of messages from every sender hosted elsewhere that a
    hosted client neighbours (acks wait for checkpoints; hosted senders' messages are delivered locally).

    `messages_per_round`: messages a neighbour sends per round (robust DFCA: one per gossip step).
    """
    heard = {m for c in clients for m in neighbours.get(c, ())} - set(clients)
    return max(64, 8 * max(1, len(heard)) * max(1, messages_per_round))


@dataclass
class RunnerStatus:
    state: WorkerState = "preparing"
    rounds_done: int = 0
    resumed_from: int | None = None
    detail: str = ""
    pending_topology: list[TopologyChange] = field(default_factory=list)


class ClientRunner:
    """Runs one experiment's share of clients on this worker, in its own thread."""

    def __init__(
        self,
        spec: RunSpec,
        connect: Connect,
        emit: EventSink,
        checkpoint_dir: Path,
        data: FederatedData | None = None,
        over: Callable[[], bool] | None = None,
        silo: DataSilo | None = None,
    ) -> None:
        """`over()`: the topology service says the experiment has ended (asked every OVER_CHECK_S while waiting).
        `silo`: the worker's own data folder, which an experiment over the workers' data reads its clients from."""
        self.silo = silo
        self.spec = spec
        self.over = over
        self._next_over_check = 0.0
        self._ended_without_us = False
        self.connect = connect
        self.emit = emit
        self.checkpoint = checkpoint_path(checkpoint_dir, spec.experiment, spec.ordinal)
        self.writer = CheckpointWriter(self.checkpoint)
        self.incarnation = uuid.uuid4().hex[:8]
        self.status = RunnerStatus()
        self.driver: MessageDriver | None = None
        self._data = data
        self.device = torch.device("cpu")
        self._placed_on = ""  # device_name(self.device), once the clients' data is there
        self._inbox: queue.Queue[GoCommand | StopCommand | TopologyChange] = queue.Queue()
        self._go = threading.Event()
        self._stop = threading.Event()
        self._stop_requested = False  # by a stop command, as opposed to this process shutting down
        self._transport: HostTransport | None = None
        self._version = spec.topology_version
        self._graph = {int(c): list(ms) for c, ms in spec.neighbours.items()}  # the whole graph, as of _version
        self.thread = threading.Thread(target=self._main, name=f"runner-{spec.experiment}", daemon=True)
        if spec.go:
            self._go.set()

    # -- control, from other threads ----------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def post(self, command: GoCommand | StopCommand | TopologyChange) -> None:
        if isinstance(command, GoCommand):
            self._go.set()
        elif isinstance(command, StopCommand):
            self._stop_requested = True
            self.halt()
        else:
            self._inbox.put(command)

    def halt(self) -> None:
        """Stop as soon as possible (process shutdown, or after a stop command)."""
        self._stop.set()
        self._go.set()
        transport = self._transport
        if transport is not None:
            transport.interrupt()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    @property
    def finished(self) -> bool:
        return not self.thread.is_alive()

    # -- the thread ----------------------------------------------------------------------------------
    def _main(self) -> None:
        spec = self.spec
        try:
            torch.set_flush_denormal(True)
            # blocks above 32 MiB kept too where this worker's tensors leave room (a module's size is not known yet)
            keep_freed_memory(large_blocks=spec.config.model.kind != "torch"
                              and leaves_room(spec.config.estimated_bytes(len(spec.clients))))
            self.device = worker_device(spec.config.device, spec.device)
            if self._data is None and spec.placement is not None:
                self._data = self._own_data(spec.placement)
            if self._data is None:
                check_fits_memory(spec.config.estimated_bytes(len(spec.clients)),
                                  f"worker {spec.ordinal}'s {len(spec.clients)} clients", str(self.device))
                self._data = build_federated_data(spec.config).subset(spec.clients)
            self._data = self._data.to(self.device)
            self._placed_on = device_name(self.device)
            self._run_with_recovery()
        except RunInterrupted:
            pass
        except Exception as err:  # report and end this runner; the process lives on
            log.exception("experiment %s failed on worker %d", spec.experiment, spec.ordinal)
            self._report("failed", detail=f"{type(err).__name__}: {err}"[:500])
            return
        finally:
            self.writer.close()
        if self._stop_requested:
            self._report("stopped")
        elif self._stop.is_set():
            log.info("experiment %s: worker %d shutting down at round %d", spec.experiment, spec.ordinal,
                     self.status.rounds_done)
            self.status.state = "stopped"

    def _own_data(self, placement: Placement) -> FederatedData:
        """This worker's clients from its own folder (no folder: no clients may be placed here)."""
        spec = self.spec
        if self.silo is None:
            if spec.clients:
                raise SiloMismatch(f"worker {spec.ordinal} was started without a data folder, but experiment "
                                   f"{spec.experiment} places clients {placement.ids_of(spec.ordinal)} on it")
            return empty_data(placement)
        return self.silo.for_experiment(spec.config, placement)

    def _run_with_recovery(self) -> None:
        attempt = 0
        while True:
            try:
                self._run_once(first=attempt == 0)
                return
            except TransportError as err:
                if self._stop.is_set():  # the connection went away because we are stopping
                    raise RunInterrupted from err
                attempt += 1
                if attempt > MAX_RECOVERIES:
                    raise
                delay = min(RECOVERY_BACKOFF_S[0] * 2 ** (attempt - 1), RECOVERY_BACKOFF_S[1])
                log.warning("experiment %s: transport failed (%s); restarting from the checkpoint in %.1f s",
                            self.spec.experiment, err, delay)
                if self._stop.wait(delay):
                    raise RunInterrupted from err

    def _run_once(self, first: bool) -> None:
        spec, cfg = self.spec, self.spec.config
        data = self._data
        assert data is not None
        schedule = schedule_of(cfg)
        steps = max((schedule.gossip_steps(t) for t in range(schedule.total_rounds)), default=0)
        transport = HostTransport(self.connect(prefetch_for(spec.neighbours, spec.clients, steps)))
        self._transport = transport
        if self._stop.is_set():
            transport.interrupt()
        try:
            if not spec.clients:  # more workers than clients: nothing to host
                if first:
                    self._report("ready")
                self._wait_for_go()
                self._report("finished")
                return
            model = model_from_config(cfg.model, data.input_shape, data.num_classes, self.device, allowed_factories())
            if cfg.model.kind == "torch":  # a module's copies are known now
                check_fits_memory(cfg.estimated_bytes(len(spec.clients), model_values=model.num_params()),
                                  f"worker {spec.ordinal}'s {len(spec.clients)} clients", str(self.device))
            ctx = HostContext(cfg, model, data, spec.clients, self._graph, self.device)
            driver = MessageDriver(clients_of(ctx), spec.experiment, transport, self._keep_going, workers=spec.workers,
                                   confirm_later=True, binds_queue=principal_of_user(transport.user) is None,
                                   hosts=spec.hosts)
            self.driver = driver
            driver.setup()
            next_round = 0
            if self.checkpoint.exists():
                next_round = driver.load_checkpoint(self.checkpoint) + 1
                if first:
                    self.status.resumed_from = next_round
                    log.info("experiment %s: worker %d resumes after round %d from %s", spec.experiment,
                             spec.ordinal, next_round, self.checkpoint)
            self.status.rounds_done = next_round
            if first:
                self._report("resumed" if self.status.resumed_from else "ready")
            self._wait_for_go()
            try:
                self._rounds(driver, transport, next_round)
                self.writer.wait()  # the last round's checkpoint is on disk and its messages acked
            except RunInterrupted:
                if self._ended_without_us:
                    self._leave(driver, transport)
                raise
            self._send_final_models(driver)
            self._report("finished")
        finally:
            self.writer.wait_quietly()  # before the connection closes: the acks after the checkpoint need it
            self._transport = None
            transport.close()

    def _keep_going(self) -> bool:
        """Asked by the driver while it waits: go on unless stopping, or the experiment ended without this worker
        (it was paused or cut off, presumed dead, and the run completed without its clients)."""
        if self._stop.is_set():
            return False
        now = time.monotonic()
        if self.over is not None and now >= self._next_over_check:
            self._next_over_check = now + OVER_CHECK_S
            if self.over():
                log.warning("experiment %s ended while worker %d was away (at round %d): leaving it",
                            self.spec.experiment, self.spec.ordinal, self.status.rounds_done)
                self._ended_without_us = True
                return False
        return True

    def _leave(self, driver: MessageDriver, transport: HostTransport) -> None:
        """The experiment is over: delete this worker's queue (a reconnect may have declared it again after the
        topology service deleted it; a queue the topology service declared is its own to delete) and its
        checkpoint."""
        self.writer.wait_quietly()  # the acks that follow a checkpoint in flight need the queue
        try:
            if driver.bindings.managed:
                transport.delete_queue(driver.queue)
        except TransportError as err:
            log.debug("could not delete %s: %s", driver.queue, err)
        self.writer.remove()
        self._report("stopped", detail="the experiment ended while this worker was away")

    def _wait_for_go(self) -> None:
        while not self._go.wait(0.5):
            pass
        if self._stop.is_set():
            raise RunInterrupted
        self.status.state = "running"

    def _rounds(self, driver: MessageDriver, transport: HostTransport, start: int) -> None:
        cfg = self.spec.config
        total = driver.schedule.total_rounds
        cpu = time.thread_time()  # this thread's CPU over the rounds (DriverStats.cpu_seconds["loop"])
        for t in range(start, total):
            if self._stop.is_set():
                raise RunInterrupted
            began = time.perf_counter()
            self._apply_control(driver, t)
            complete = driver.run_round(t, cfg.runtime.round_timeout)
            with driver.stats.timed("checkpoint"):
                acks = transport.take_acks()  # this round's: sent once its checkpoint is on disk, which follows
                self.writer.submit(driver.checkpoint(), lambda acks=acks: transport.ack_now(acks),  # its confirms
                                   first=driver.take_confirmation())
            self.status.rounds_done = t + 1
            finished = driver.algorithm.finished  # its own stopping rule (FedCRef's): this round is the last
            evaluate = (t + 1) % cfg.eval_every == 0 or t + 1 == total or finished
            report = driver.report() if evaluate else None
            now = time.thread_time()  # (the last round's report was sent after its reading: counted here)
            driver.stats.cpu_seconds["loop"] += now - cpu
            driver.stats.republished = transport.republished
            cpu = now
            self.emit(RoundReport(
                deployment=self.spec.deployment, experiment=self.spec.experiment, worker=self.spec.ordinal,
                incarnation=self.incarnation, round=t + 1, clients=driver.ids, complete=complete,
                seconds=time.perf_counter() - began, evaluation=report,
                stats=driver.stats.as_dict(), lag_seconds=transport.take_lag(),
                bytes_published=driver.take_bytes_sent(), dead_neighbours=sorted(driver.liveness.dead),
            ))
            if finished:
                break

    def _apply_control(self, driver: MessageDriver, t: int) -> None:
        """Topology changes due by round t: rebind the worker's queue to its clients' new neighbours."""
        while True:
            try:
                change = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(change, TopologyChange) and change.version > self._version:
                self.status.pending_topology.append(change)
        due = sorted((c for c in self.status.pending_topology if c.effective_round <= t), key=lambda c: c.version)
        for change in due:
            self.status.pending_topology.remove(change)
            if change.version <= self._version:
                continue
            driver.set_graph(change.neighbours)
            self._graph = {int(c): list(ms) for c, ms in change.neighbours.items()}
            self._version = change.version
            log.info("round %d: topology version %d applied", t, change.version)

    def _send_final_models(self, driver: MessageDriver) -> None:
        """The hosted clients' share of the run's final models, for the metrics service to merge and serve."""
        sums = driver.algorithm.final_model_sums()
        if not sums:
            return
        encoded, digest = encode_sums(sums)
        self.emit(FinalModelsShare(deployment=self.spec.deployment, experiment=self.spec.experiment,
                                   worker=self.spec.ordinal, incarnation=self.incarnation, safetensors=encoded,
                                   sha256=digest))

    def _report(self, state: WorkerState, detail: str = "") -> None:
        self.status.state = state
        self.status.detail = detail
        self.emit(self.worker_event(state, detail))

    def worker_event(self, state: WorkerState | None = None, detail: str = "") -> WorkerEvent:
        """This runner's state as an event; with no `state`, the heartbeat (which repeats the last state's detail)."""
        return WorkerEvent(
            deployment=self.spec.deployment, experiment=self.spec.experiment, worker=self.spec.ordinal,
            incarnation=self.incarnation, state=state or self.status.state, round=self.status.rounds_done,
            clients=self.spec.clients, resumed_from=self.status.resumed_from, detail=detail or self.status.detail,
            device=self._placed_on,
        )
