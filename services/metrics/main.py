"""The metrics service: stores metric events (SQLAlchemy) and serves summaries, histories, SSE and Prometheus.

GET /experiments, GET /experiments/{id}/summary (summary.json's fields), GET /experiments/{id}/metrics
(per-round history and worker state changes), GET /experiments/{id}/events (server-sent events: live
progress), GET /experiments/{id}/models[/{file}] (the final models and assignments, as `dfca run` saves them),
GET /experiments/{id}/plots[/{file}] (the plots `dfca run` draws), GET /metrics (Prometheus), /livez, /readyz,
and the web dashboard at /ui (`dfca.runtime.metrics.dashboard`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from dfca.algorithms import schedule_of
from dfca.config import ExperimentConfig
from dfca.identity import topics
from dfca.identity.broker_setup import bind_to_deployment, ensure_broker_topology
from dfca.identity.topics import dead_letter_tap_queue, deployment_tag, events_queue
from dfca.runtime.control.experiments import EventRefused, check_round
from dfca.runtime.metrics.dashboard import add_dashboard
from dfca.runtime.metrics.dead_letters import DeadLetter, charged_experiment
from dfca.runtime.metrics.experiment_results import NoResults, model_files, plot_files
from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.metrics.prometheus_export import RuntimeCollector
from dfca.runtime.metrics.run_summary import final_evaluation, history, summary_of
from dfca.runtime.protocol.messages import (
    TERMINAL_STATUSES,
    ExperimentEvent,
    FinalModelsShare,
    PresenceEvent,
    RoundReport,
    WorkerEvent,
    decode_event,
    event_principal,
)
from dfca.runtime.service.broker_identity import warn_if_shared_user
from dfca.runtime.service.event_consumer import QueueConsumer
from dfca.runtime.service.http_service import RequestGuard, add_health_routes, add_validation_errors, serve
from dfca.runtime.service.state_dirs import StateDirUnwritable
from dfca.runtime.service.structured_logs import configure_logging
from dfca.settings import ServiceSettings
from dfca.transport import Transport, connect_transport

log = logging.getLogger(__name__)
DEAD_LETTER_BATCH = 500
EVENT_BATCH = 100  # events stored in one transaction, of those there at once (3 workers' round reports: 1-3)
EVENT_LINGER_S = 0.05  # how long a batch waits for the next event: a round's reports of every worker, one commit
MAX_STREAMS_PER_CLIENT = 8  # open /events streams per client address; 429 beyond
MAX_STREAMS = 64

SSE_POLL_S = 0.5
SSE_KEEPALIVE_S = 15.0


class MetricsCollector:
    """Consumes this deployment's events and every dead letter into the store, on one thread."""

    def __init__(self, transport: Transport, store: MetricsStore, deployment: str) -> None:
        self.transport, self.store, self.deployment = transport, store, deployment
        self.events = events_queue(deployment, "metrics")
        self.dead_letters = dead_letter_tap_queue(deployment)
        self.consumer = QueueConsumer(transport, self.events, decode_event, self.on_event, event_principal,
                                      handle_many=self.on_events, batch=EVENT_BATCH, linger=EVENT_LINGER_S)
        self._configs: dict[str, ExperimentConfig] = {}  # of the experiments seen: round reports are checked on them
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="metrics-consumer", daemon=True)

    def open(self) -> None:
        ensure_broker_topology(self.transport)
        self.transport.declare_queue(self.events, topics.DEAD_LETTER_EXCHANGE, topics.SERVICE_QUEUE_LIMITS)
        bind_to_deployment(self.transport, self.events, topics.METRICS_EXCHANGE, self.deployment)
        self.transport.declare_queue(self.dead_letters, limits=topics.DEAD_LETTER_TAP_LIMITS)
        self.transport.bind(self.dead_letters, topics.DEAD_LETTER_EXCHANGE, "")
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)

    def on_event(self, event: RoundReport | WorkerEvent | ExperimentEvent | PresenceEvent | FinalModelsShare) -> None:
        if event.deployment != self.deployment or isinstance(event, PresenceEvent):
            return
        if isinstance(event, ExperimentEvent):
            self.store.record_experiment(event)
            self._configs[event.experiment] = event.config
        elif isinstance(event, FinalModelsShare):
            self.store.record_final_models(event)
        elif isinstance(event, RoundReport):
            if (config := self.config_of(event.experiment)) is not None:
                check_round(event.experiment, config, event)  # refused: dead-lettered, never stored
            self.store.record_round(event)
        else:
            self.store.record_worker(event)

    def on_events(self, events: list[Any]) -> list[Exception | None]:
        """Events that arrived together, stored in one transaction; each one's refusal (EventRefused: a round
        beyond the run's) or None. A store error raises: the consumer handles them again one by one."""
        refusals: list[Exception | None] = []
        with self.store.writes():
            for event in events:
                try:
                    self.on_event(event)
                except EventRefused as err:  # checked before anything of it was written
                    refusals.append(err)
                else:
                    refusals.append(None)
        return refusals

    def config_of(self, experiment: str) -> ExperimentConfig | None:
        """The experiment's config, as the store has it (parsed once per experiment)."""
        if (config := self._configs.get(experiment)) is None and (stored := self.store.experiment(experiment)):
            config = self._configs[experiment] = stored.config
        return config

    def _drain_dead_letters(self) -> None:
        """Count up to DEAD_LETTER_BATCH dead letters in one write, then read events again: a flood of rejected
        messages must not keep the summaries behind the run."""
        taken = []
        while len(taken) < DEAD_LETTER_BATCH and (message := self.transport.receive(self.dead_letters, 0.0)):
            taken.append(message)
        if not taken:
            return
        exchanges = [str(m.headers.get("x-first-death-exchange", m.exchange)) for m in taken]
        self.store.record_dead_letters([DeadLetter(charged_experiment(exchange, m.routing_key, m.publisher), exchange,
                                                   m.routing_key, m.publisher)
                                        for m, exchange in zip(taken, exchanges, strict=True)])
        for message in taken:
            self.transport.ack(message)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self.consumer.poll(0.2)
                self._drain_dead_letters()
            except Exception:  # the transport reconnects by itself; keep consuming
                log.exception("metrics consumer error")
                self.stopping.wait(1.0)


def create_app(store: MetricsStore, broker_url: str, collector: MetricsCollector | None = None,
               topology_url: str | None = None, read_token: str | None = None,
               api_token: str | None = None) -> FastAPI:
    """`read_token`: reads need it (or `api_token`); None: reads are open."""
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if collector is not None:
            collector.close()

    app = FastAPI(title="dfca metrics", version="1", lifespan=lifespan)
    # bodies above MAX_BODY_BYTES refused (413) before they are read; reads checked against the read token
    app.add_middleware(RequestGuard, token=api_token, read_token=read_token)
    add_validation_errors(app)
    registry = CollectorRegistry()
    registry.register(RuntimeCollector(store))
    add_health_routes(app, broker_url, collector.thread.is_alive if collector is not None else (lambda: True))
    add_dashboard(app, store, topology_url)

    def experiment_or_404(experiment: str) -> Any:
        stored = store.experiment(experiment)
        if stored is None:
            raise HTTPException(404, f"no experiment {experiment!r}")
        return stored

    @app.get("/experiments")
    def list_experiments() -> list[dict[str, Any]]:
        out = []
        for experiment_id in store.experiment_ids():
            stored = store.experiment(experiment_id)
            if stored is not None:
                out.append({"id": stored.id, "status": stored.status, "name": stored.config.name})
        return out

    @app.get("/experiments/{experiment}/summary")
    def summary(experiment: str) -> dict[str, Any]:
        experiment_or_404(experiment)
        return summary_of(store, experiment)

    @app.get("/experiments/{experiment}/clients")
    def clients(experiment: str) -> dict[str, Any]:
        """Every client's latest evaluation, by client: its assigned and true cluster, test accuracy and train loss
        (and the algorithm's per-client extras), so that a subset (honest clients, one region) can be scored."""
        experiment_or_404(experiment)
        return {"id": experiment, **final_evaluation(store.reports(experiment), set())}

    @app.get("/experiments/{experiment}/metrics")
    def metrics(experiment: str) -> dict[str, Any]:
        stored = experiment_or_404(experiment)
        return {"id": experiment, "status": stored.status, "history": history(stored, store.reports(experiment)),
                "worker_events": store.worker_events(experiment)}

    open_streams: Counter[str] = Counter()  # event streams open, per client address

    @app.get("/experiments/{experiment}/events", responses={429: {"description": "too many open event streams"}})
    async def events(experiment: str, request: Request) -> StreamingResponse:
        await asyncio.to_thread(experiment_or_404, experiment)
        client = request.client.host if request.client is not None else "unknown"
        if open_streams[client] >= MAX_STREAMS_PER_CLIENT or sum(open_streams.values()) >= MAX_STREAMS:
            raise HTTPException(429, f"too many open event streams (at most {MAX_STREAMS_PER_CLIENT} per client and "
                                f"{MAX_STREAMS} in all); close one, or poll /experiments/{{id}}/metrics",
                                headers={"Retry-After": "5"})
        open_streams[client] += 1

        async def counted() -> AsyncIterator[str]:
            try:
                async for chunk in progress_stream(store, experiment):
                    yield chunk
            finally:
                open_streams[client] -= 1

        return StreamingResponse(counted(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def results_or_404(make: Any, experiment: str) -> dict[str, bytes]:
        experiment_or_404(experiment)
        try:
            return make(store, experiment)  # type: ignore[no-any-return]
        except NoResults as err:
            raise HTTPException(404, str(err)) from err

    def one_file(files: dict[str, bytes], experiment: str, name: str) -> Response:
        if name not in files:
            raise HTTPException(404, f"experiment {experiment!r} has no file {name!r}; it has {sorted(files)}")
        media = ("image/png" if name.endswith(".png") else "application/json" if name.endswith(".json")
                 else "application/octet-stream")
        return Response(files[name], media_type=media,
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})

    def add_file_routes(kind: str, make: Any) -> None:
        """GET /experiments/{id}/<kind> lists the files, GET /experiments/{id}/<kind>/{name} serves one."""

        @app.get(f"/experiments/{{experiment}}/{kind}", name=f"list {kind}")
        def listing(experiment: str) -> dict[str, Any]:
            return {"id": experiment, "files": sorted(results_or_404(make, experiment))}

        @app.get(f"/experiments/{{experiment}}/{kind}/{{name}}", name=f"one of the {kind}")
        def one(experiment: str, name: str) -> Response:
            return one_file(results_or_404(make, experiment), experiment, name)

    add_file_routes("models", model_files)
    add_file_routes("plots", plot_files)

    @app.get("/metrics", include_in_schema=False)
    def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


async def progress_stream(store: MetricsStore, experiment: str) -> AsyncIterator[str]:
    """`progress` after every new round report (its absolute `round` and, as people count it, `phase`, `phase_round`
    and `phase_rounds`), `status` on every status change; ends when the run does."""
    last_id, last_status, idle = 0, "", 0.0
    while True:
        stored = await asyncio.to_thread(store.experiment, experiment)
        if stored is None:
            return
        reports = await asyncio.to_thread(store.reports, experiment, last_id)
        if reports:
            last_id = await asyncio.to_thread(store.last_report_id, experiment)
            latest = reports[-1]
            yield sse("progress", {"round": latest.round, **schedule_of(stored.config).phase_fields(latest.round - 1),
                                   "worker": latest.worker, "complete": latest.complete,
                                   "seconds": latest.seconds, "status": stored.status})
            idle = 0.0
        if stored.status != last_status:
            last_status = stored.status
            yield sse("status", {"status": stored.status, "failed_clients": stored.failed_clients})
            if stored.status in TERMINAL_STATUSES:
                yield sse("summary", await asyncio.to_thread(summary_of, store, experiment))
                return
        await asyncio.sleep(SSE_POLL_S)
        idle += SSE_POLL_S
        if idle >= SSE_KEEPALIVE_S:
            idle = 0.0
            yield ": keepalive\n\n"


def main() -> None:
    settings = ServiceSettings.from_env("metrics")
    configure_logging("metrics", settings.log_level)
    warn_if_shared_user(settings.broker_url, "metrics")
    try:
        store = MetricsStore(settings.metrics_db_url)
    except StateDirUnwritable as err:
        log.error("%s", err)
        raise SystemExit(f"dfca metrics: {err}") from None
    transport = connect_transport(settings.broker_url, name="dfca-metrics")
    collector = MetricsCollector(transport, store, deployment_tag(settings.topology_url))
    collector.open()
    try:
        serve(create_app(store, settings.broker_url, collector, settings.topology_url, settings.read_token,
                         settings.api_token), settings.host, settings.port)
    finally:
        collector.close()
        transport.close()
        log.info("metrics service stopped")
