"""The topology service: the control plane's REST API (FastAPI) over `dfca.runtime.control.coordinator`.

POST /experiments (an ExperimentConfig; 201 {"id"}), POST /experiments/{id}:start, POST /experiments/{id}:stop,
POST /experiments/{id}/edges ({"add": [[u, v]], "remove": [[u, v]]}), GET /experiments, GET /experiments/{id},
GET /experiments/{id}/topology, GET /deployment (the workers and the aggregator it knows), /livez, /readyz.
Mutating calls need `Authorization: Bearer $DFCA_API_TOKEN`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from dfca.config import ExperimentConfig
from dfca.identity.topics import deployment_tag
from dfca.runtime.control.coordinator import ConfigRejected, Coordinator, InvalidTransition, UnknownExperiment
from dfca.runtime.control.experiments import EdgeChangeInvalid
from dfca.runtime.service.broker_identity import warn_if_shared_user
from dfca.runtime.service.http_service import RequestGuard, add_health_routes, add_validation_errors, bearer_auth, serve
from dfca.runtime.service.structured_logs import configure_logging
from dfca.settings import ServiceSettings, env
from dfca.transport import connect_transport

log = logging.getLogger(__name__)


class EdgeChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    add: list[tuple[int, int]] = Field(default_factory=list)
    remove: list[tuple[int, int]] = Field(default_factory=list)


def create_app(coordinator: Coordinator, token: str | None, broker_url: str, read_token: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        coordinator.close()

    app = FastAPI(title="dfca topology", version="1", lifespan=lifespan)
    app.add_middleware(RequestGuard, token=token, check_token=True, read_token=read_token)  # 401/413 before a body
    add_validation_errors(app)
    auth = Depends(bearer_auth(token))
    add_health_routes(app, broker_url)

    def record_or_404(experiment: str) -> Any:
        try:
            return coordinator.get(experiment)
        except UnknownExperiment:
            raise HTTPException(404, f"no experiment {experiment!r}") from None

    @app.post("/experiments", status_code=201, dependencies=[auth])
    def create(cfg: ExperimentConfig) -> dict[str, Any]:
        try:
            record = coordinator.create(cfg)
        except ConfigRejected as err:
            raise HTTPException(422, [{"loc": ["body", err.field], "msg": str(err), "type": "value_error"}]) from err
        return {"id": record.id, "status": record.status}

    @app.post("/experiments/{experiment}:start", dependencies=[auth])
    def start(experiment: str) -> dict[str, Any]:
        record_or_404(experiment)
        try:
            record = coordinator.start(experiment)
        except InvalidTransition as err:
            raise HTTPException(409, str(err)) from err
        return {"id": record.id, "status": record.status, "workers": record.workers}

    @app.post("/experiments/{experiment}:stop", dependencies=[auth])
    def stop(experiment: str) -> dict[str, Any]:
        record_or_404(experiment)
        try:
            record = coordinator.stop(experiment)
        except InvalidTransition as err:
            raise HTTPException(409, str(err)) from err
        return {"id": record.id, "status": record.status}

    @app.delete("/experiments/{experiment}", dependencies=[auth], status_code=200)
    def delete(experiment: str) -> dict[str, Any]:
        """Forget a created or finished experiment (409 while it runs); its metrics stay in the metrics service."""
        record_or_404(experiment)
        try:
            coordinator.delete(experiment)
        except InvalidTransition as err:
            raise HTTPException(409, str(err)) from err
        return {"id": experiment, "deleted": True}

    @app.post("/experiments/{experiment}/edges", dependencies=[auth])
    def change_edges(experiment: str, change: EdgeChange) -> dict[str, Any]:
        record_or_404(experiment)
        try:
            record = coordinator.change_edges(experiment, change.add, change.remove)
        except EdgeChangeInvalid as err:
            raise HTTPException(422, [{"loc": ["body", "add/remove"], "msg": str(err), "type": "value_error"}]) \
                from err
        except InvalidTransition as err:
            raise HTTPException(409, str(err)) from err
        return record.topology()

    @app.get("/experiments")
    def list_experiments() -> list[dict[str, Any]]:
        return [{k: v for k, v in r.public().items() if k != "config"} for r in coordinator.list()]

    @app.get("/experiments/{experiment}")
    def get(experiment: str) -> dict[str, Any]:
        return record_or_404(experiment).public()  # type: ignore[no-any-return]

    @app.get("/experiments/{experiment}/topology")
    def topology(experiment: str) -> dict[str, Any]:
        return record_or_404(experiment).topology()  # type: ignore[no-any-return]

    @app.get("/deployment")
    def deployment() -> dict[str, Any]:
        """The workers and the aggregator this service has heard from: a worker's and the aggregator's /readyz
        pass only once they are listed here, so a deployment whose processes are all ready can start any
        experiment at once."""
        return coordinator.deployment_view()

    @app.exception_handler(UnknownExperiment)
    def unknown(_: Any, err: UnknownExperiment) -> JSONResponse:
        return JSONResponse({"detail": f"no experiment {err}"}, status_code=404)

    return app


def main() -> None:
    settings = ServiceSettings.from_env("topology")
    configure_logging("topology", settings.log_level)
    warn_if_shared_user(settings.broker_url, "topology")
    workers = env("DFCA_WORKERS")
    transport = connect_transport(settings.broker_url, name="dfca-topology")
    coordinator = Coordinator(transport, deployment_tag(settings.topology_url), int(workers) if workers else None,
                              state_dir=Path(settings.checkpoint_dir) / "_topology")
    coordinator.open()
    if not settings.api_token:
        log.warning("DFCA_API_TOKEN is not set: every mutating call will get 401")
    try:
        serve(create_app(coordinator, settings.api_token, settings.broker_url, settings.read_token), settings.host,
              settings.port)
    finally:
        coordinator.close()
        transport.close()
        log.info("topology service stopped")
