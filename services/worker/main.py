"""The worker service: hosts clients c with c % DFCA_WORKERS == DFCA_WORKER_ORDINAL of every experiment, and, started
on a data folder (DFCA_DATA_DIR), exactly that folder's clients in the experiments over the workers' data.

Health on DFCA_PORT (default 8082): /livez, /readyz (broker reachable, running experiments rejoined, and the
topology service knows this worker: dfca.runtime.service.registration),
GET /status (this worker's runners).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from dfca.devices import DeviceUnavailable, device_name, resolve_device
from dfca.identity.topics import deployment_tag
from dfca.runtime.service.broker_identity import warn_if_shared_user
from dfca.runtime.service.http_service import add_health_routes, serve
from dfca.runtime.service.structured_logs import configure_logging
from dfca.runtime.worker.data_silo import FolderDataError, read_silo
from dfca.runtime.worker.worker_agent import WorkerAgent
from dfca.settings import ServiceSettings
from dfca.transport import Transport, connect_transport

log = logging.getLogger(__name__)


def create_app(agent: WorkerAgent, broker_url: str) -> FastAPI:
    app = FastAPI(title=f"dfca worker {agent.ordinal}", version="1")
    add_health_routes(app, broker_url, agent.ready)

    @app.get("/status")
    def status() -> dict[str, Any]:
        with agent.lock:
            runners = dict(agent.runners)
        return {"worker": agent.ordinal, "workers": agent.workers, "experiments": {
            e: {"state": r.status.state, "rounds_done": r.status.rounds_done, "resumed_from": r.status.resumed_from,
                "clients": r.spec.clients, "device": str(r.device)} for e, r in runners.items()},
            "data": None if agent.silo is None else agent.silo.holdings().model_dump(mode="json"),
            "data_refused": agent.refusal}

    return app


def main() -> None:
    settings = ServiceSettings.from_env("worker")
    ordinal = settings.worker_ordinal
    configure_logging(f"worker-{ordinal}", settings.log_level)
    warn_if_shared_user(settings.broker_url, f"worker-{ordinal}")

    def connect(prefetch: int) -> Transport:
        return connect_transport(settings.broker_url, prefetch=prefetch, name=f"dfca-worker-{ordinal}")

    if settings.device:  # a device the deployment fixed: checked now, not at the first experiment
        try:
            device = resolve_device(settings.device, "DFCA_DEVICE")
        except DeviceUnavailable as err:
            log.error("%s", err)
            raise SystemExit(f"dfca worker: {err}") from None
        log.info("worker %d computes on %s (DFCA_DEVICE=%s)", ordinal, device_name(device), settings.device)
    else:
        log.info("worker %d computes where each experiment's config says (DFCA_DEVICE unset)", ordinal)
    try:
        silo = read_silo(settings.data_dir, ordinal)
    except FolderDataError as err:
        log.error("worker %d cannot use its data folder %s: %s", ordinal, settings.data_dir, err)
        raise SystemExit(2) from err
    agent = WorkerAgent(deployment_tag(settings.topology_url), ordinal, settings.workers, connect,
                        Path(settings.checkpoint_dir), settings.topology_url, settings.data_root, settings.device, silo)
    agent.start()
    log.info("worker %d of %d up", ordinal, settings.workers)
    try:
        serve(create_app(agent, settings.broker_url), settings.host, settings.port)
    finally:
        agent.shutdown()
        log.info("worker %d stopped", ordinal)
