"""The aggregator's central roles: an algorithm's server side (dfca.algorithms.central_roles), over the message
driver.

The aggregator service receives the same start/stop commands as the workers. For each started experiment
whose algorithm has a central role (IFCA's server) it runs `ServerRole` on a thread of its own, with its own
connection: the server algorithm over a `MessageDriver` on `topics.server_queue(experiment)`, publishing
with the server's routing key (`<experiment>.server.<cluster>`). It serves every round and ends after the
last, on a stop command, or, while no client message comes, once the topology service says the experiment
is over (when the aggregator knows the topology service's URL). It computes on DFCA_DEVICE, else the CPU.

Restarts lose nothing: after every round the role checkpoints its algorithm's state (DPMM-CFL: the assignment,
the cluster models and every client's latest upload) to `<checkpoint_dir>/<experiment>/server.safetensors` and
only then acknowledges the round's uploads, so a killed aggregator's unacknowledged uploads wait in the durable
server queue. A restarted aggregator asks the topology service which experiments are running and resumes their
roles from their checkpoints. An aggregator that shuts down keeps the server queue; a finished or stopped
experiment deletes it, and its checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from dfca.algorithms import HostContext, server_of
from dfca.algorithms.base import SERVER
from dfca.data import build_federated_data
from dfca.devices import resolve_device
from dfca.identity import topics
from dfca.models.build import model_from_config
from dfca.models.factory import allowed_factories
from dfca.runtime.driver.checkpoints import CheckpointSlots, remove_checkpoint
from dfca.runtime.driver.host_transport import HostTransport, RunInterrupted
from dfca.runtime.driver.message_driver import MessageDriver
from dfca.runtime.protocol.messages import TERMINAL_STATUSES, StartCommand
from dfca.settings import service_auth
from dfca.transport import Transport

log = logging.getLogger(__name__)

OVER_CHECK_S = 5.0  # while no client message comes, ask this often whether the experiment is over


class ServerRole:
    def __init__(self, command: StartCommand, transport: Transport, topology_url: str | None = None,
                 device: str | None = None, checkpoint_dir: Path | None = None) -> None:
        self.command, self.transport, self.topology_url = command, transport, topology_url
        self.experiment, self.config = command.experiment, command.config
        self.device = resolve_device(device, "DFCA_DEVICE") if device else torch.device("cpu")
        self.driver: MessageDriver | None = None
        self.checkpoint = None if checkpoint_dir is None else checkpoint_dir / self.experiment / "server.safetensors"
        self.resumed_from = 0
        self.leaving = False  # the aggregator shuts down: keep the queue, the experiment goes on

    def experiment_over(self) -> bool:
        """The topology service says the experiment ended (False when it cannot be asked)."""
        if not self.topology_url:
            return False
        try:
            response = httpx.get(f"{self.topology_url}/experiments/{self.experiment}", timeout=5.0,
                                 headers=service_auth())
        except httpx.HTTPError:
            return False
        if response.status_code == 404:
            return True
        return response.is_success and response.json().get("status") in TERMINAL_STATUSES

    def progress(self) -> dict[str, Any]:
        """What the aggregator's GET /status shows about this role."""
        driver = self.driver
        if driver is None:
            return {"algorithm": self.config.algorithm, "round": 0}
        return {"algorithm": self.config.algorithm, "round": driver.rounds_done,
                "rounds": driver.schedule.total_rounds, "resumed_from": self.resumed_from,
                "stats": driver.stats.as_dict(),
                "presumed_dead": sorted(driver.liveness.dead)}

    def run(self, stop: threading.Event) -> None:
        """Serve every round; return early when `stop` is set or the experiment is over."""
        cfg = self.config
        shape, classes = model_shape(self.command)
        model = model_from_config(cfg.model, shape, classes, self.device, allowed_factories())
        server = server_of(HostContext(cfg, model, None, [SERVER], dict(self.command.neighbours), self.device))
        assert server is not None, f"{cfg.algorithm} has no central role"
        next_check = time.monotonic() + OVER_CHECK_S

        def keep_going() -> bool:
            nonlocal next_check
            if stop.is_set():
                return False
            if self.topology_url and time.monotonic() >= next_check:
                next_check = time.monotonic() + OVER_CHECK_S
                return not self.experiment_over()
            return True

        transport = HostTransport(self.transport)  # acks wait for the round's checkpoint
        placement = self.command.placement
        driver = MessageDriver(server, self.experiment, transport, keep_going, workers=self.command.workers,
                               hosts=None if placement is None else placement.hosts)
        self.driver = driver
        finished = False
        slots = None if self.checkpoint is None else CheckpointSlots(self.checkpoint)  # mapped once, written each round
        try:
            driver.setup()
            start = 0
            if self.checkpoint is not None and self.checkpoint.exists():
                start = self.resumed_from = driver.load_checkpoint(self.checkpoint) + 1
                log.info("experiment %s: %s server resumes at round %d from %s", self.experiment, cfg.algorithm,
                         start, self.checkpoint)
            for t in range(start, driver.schedule.total_rounds):
                driver.run_round(t, cfg.runtime.round_timeout)
                if slots is not None:
                    slots.name(slots.put(driver.checkpoint()))
                transport.flush_acks()
            finished = True
            log.info("experiment %s: %s server done after %d rounds (%s)", self.experiment, cfg.algorithm,
                     driver.rounds_done, driver.stats.as_dict())
        except RunInterrupted:
            log.info("experiment %s: %s server stops at round %d", self.experiment, cfg.algorithm, driver.round)
        finally:
            if slots is not None:
                slots.close()
            if finished or not self.leaving:
                self.forget()

    def forget(self) -> None:
        """The experiment is over for this role: delete its queue and checkpoint."""
        try:
            self.transport.delete_queue(topics.server_queue(self.experiment))
        except Exception as err:  # a broker hiccup: the queue is left behind, harmless
            log.debug("could not delete the server queue: %s", err)
        if self.checkpoint is not None:
            remove_checkpoint(self.checkpoint)



def model_shape(command: StartCommand) -> tuple[tuple[int, ...], int]:
    """The input shape and classes of the experiment's model: what the workers holding the data registered, or, for a
    built-in dataset, what the config's data has (built for its shapes; the server holds no client data)."""
    if command.placement is not None:
        return tuple(command.placement.input_shape), command.placement.num_classes
    data = build_federated_data(command.config)
    return data.input_shape, data.num_classes
