"""The optional aggregator: central roles (dfca.runtime.aggregator.central_roles) on the same broker, on DFCA_DEVICE.

Health on DFCA_PORT (default 8083): /livez, /readyz (broker reachable, control consumer running, and the topology
service knows this aggregator: dfca.runtime.service.registration); GET /status lists the roles running. Roles
checkpoint to
DFCA_CHECKPOINT_DIR; on start the aggregator asks the topology service (DFCA_TOPOLOGY_URL) which experiments
are running and resumes the roles of those that have one.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from dfca.algorithms import central_roles, has_central_role
from dfca.identity import topics
from dfca.identity.broker_setup import bind_to_deployment, ensure_broker_topology
from dfca.identity.topics import aggregator_control_queue, deployment_tag
from dfca.runtime.aggregator.central_roles import ServerRole
from dfca.runtime.control.experiments import HEARTBEAT_S
from dfca.runtime.protocol.messages import (
    GoCommand,
    PresenceEvent,
    StartCommand,
    StopCommand,
    TopologyChange,
    control_principal,
    decode_control,
    encode,
)
from dfca.runtime.service.broker_identity import warn_if_shared_user
from dfca.runtime.service.event_consumer import QueueConsumer
from dfca.runtime.service.http_service import add_health_routes, serve
from dfca.runtime.service.registration import known_to_topology
from dfca.runtime.service.structured_logs import configure_logging
from dfca.runtime.worker.worker_agent import running_specs
from dfca.settings import ServiceSettings, service_auth
from dfca.transport import connect_transport

log = logging.getLogger(__name__)

RECOVER_RETRY_S = 2.0


class Aggregator:
    def __init__(self, deployment: str, broker_url: str, topology_url: str | None = None,
                 device: str | None = None, checkpoint_dir: Path | None = None) -> None:
        self.deployment, self.broker_url, self.topology_url, self.device = deployment, broker_url, topology_url, device
        self.checkpoint_dir = checkpoint_dir
        self.lock = threading.Lock()  # the control consumer and the recovery both start roles
        self.transport = connect_transport(broker_url, name="dfca-aggregator")
        self.queue = aggregator_control_queue(deployment)
        self.consumer = QueueConsumer(self.transport, self.queue, decode_control, self.handle, control_principal)
        self.roles: dict[str, tuple[ServerRole, threading.Event, threading.Thread]] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.consumer.run_forever, args=(self.stopping,), daemon=True)
        self._http = httpx.Client(timeout=2.0, headers=service_auth())  # readiness: does the topology know us?

    def open(self) -> None:
        ensure_broker_topology(self.transport)
        self.transport.declare_queue(self.queue, topics.DEAD_LETTER_EXCHANGE, topics.SERVICE_QUEUE_LIMITS)
        bind_to_deployment(self.transport, self.queue, topics.CONTROL_EXCHANGE, self.deployment)
        self.thread.start()
        threading.Thread(target=self._presence_loop, name="aggregator-presence", daemon=True).start()
        if self.topology_url:
            threading.Thread(target=self._recover_loop, daemon=True).start()

    def _presence_loop(self) -> None:
        """Announce this aggregator every HEARTBEAT_S, on a connection of its own, so that the topology service
        starts the algorithms with a central role only while one is there."""
        transport = connect_transport(self.broker_url, name="dfca-aggregator-presence")
        try:
            while not self.stopping.is_set():
                try:
                    presence = PresenceEvent(role="aggregator", deployment=self.deployment, worker=0, workers=1)
                    transport.publish(topics.METRICS_EXCHANGE, topics.presence_key(self.deployment), encode(presence))
                except Exception as err:  # the transport retries; a missed announcement is harmless
                    log.warning("presence announcement failed: %s", err)
                self.stopping.wait(HEARTBEAT_S)
        finally:
            transport.close()

    def _recover_loop(self) -> None:
        """Resume the central roles of the experiments the topology service says are running."""
        assert self.topology_url
        while not self.stopping.is_set():
            try:
                for spec in running_specs(self.topology_url, self.deployment, 0, algorithms=central_roles()):
                    self.handle(StartCommand(deployment=self.deployment, experiment=spec.experiment,
                                             config=spec.config, workers=spec.workers, neighbours=spec.neighbours,
                                             topology_version=spec.topology_version, placement=spec.placement))
                return
            except (httpx.HTTPError, ValueError, KeyError) as err:
                log.info("topology service not reachable yet (%s); retrying", err)
                self.stopping.wait(RECOVER_RETRY_S)

    def ready(self) -> bool:
        return self.thread.is_alive() and known_to_topology(self._http, self.topology_url, "aggregator")

    def handle(self, command: StartCommand | GoCommand | StopCommand | TopologyChange) -> None:
        if command.deployment != self.deployment:
            return
        if isinstance(command, StartCommand):
            with self.lock:
                if command.experiment in self.roles:
                    return
                if not has_central_role(command.config.algorithm):
                    return
                role = ServerRole(command, connect_transport(self.broker_url, name="dfca-aggregator-role"),
                                  self.topology_url, self.device, self.checkpoint_dir)
                stop = threading.Event()
                thread = threading.Thread(target=self._run, args=(role, stop), daemon=True)
                self.roles[command.experiment] = (role, stop, thread)
                thread.start()
        elif isinstance(command, StopCommand) and command.experiment in self.roles:
            self.roles[command.experiment][1].set()

    def _run(self, role: ServerRole, stop: threading.Event) -> None:
        try:
            role.run(stop)
        except Exception:
            log.exception("central role %s of experiment %s failed", type(role).__name__, role.experiment)
        finally:
            role.transport.close()

    def close(self) -> None:
        self.stopping.set()
        for role, stop, _ in self.roles.values():
            role.leaving = True  # the experiment goes on: its queue and checkpoint stay for the next aggregator
            stop.set()
        for _, _, thread in self.roles.values():
            thread.join(5)
        self.thread.join(5)
        self.transport.close()
        self._http.close()


def create_app(aggregator: Aggregator, broker_url: str) -> FastAPI:
    app = FastAPI(title="dfca aggregator", version="1")
    add_health_routes(app, broker_url, aggregator.ready)

    @app.get("/status")
    def status() -> dict[str, Any]:
        return {"roles": {e: {"role": type(r).__name__, "running": t.is_alive(), **r.progress()}
                          for e, (r, _, t) in aggregator.roles.items()}}

    return app


def main() -> None:
    settings = ServiceSettings.from_env("aggregator")
    configure_logging("aggregator", settings.log_level)
    warn_if_shared_user(settings.broker_url, "aggregator")
    aggregator = Aggregator(deployment_tag(settings.topology_url), settings.broker_url, settings.topology_url,
                            settings.device, Path(settings.checkpoint_dir))
    aggregator.open()
    try:
        serve(create_app(aggregator, settings.broker_url), settings.host, settings.port)
    finally:
        aggregator.close()
