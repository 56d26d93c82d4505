"""schemathesis against the OpenAPI of the topology and metrics services, in process: every operation, with and
without the token, on unknown experiments and on real ones; no response may be a server error (5xx)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_runtime_control_plane import AUTH, TOKEN, small
from test_runtime_metrics import CFG, report

from dfca.runtime.control.coordinator import Coordinator
from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.protocol.messages import ExperimentEvent
from dfca.transport import InMemoryBroker, InMemoryTransport
from services.metrics.main import MetricsCollector
from services.metrics.main import create_app as metrics_app
from services.topology.main import create_app as topology_app

EXAMPLES = 40  # per operation and token choice


def fuzz(app: FastAPI, known: list[str]) -> Counter[tuple[str, int, str]]:
    """Every operation of the app's schema; server errors by (operation, status, body start)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    errors: Counter[tuple[str, int, str]] = Counter()
    calls = 0
    for result in schema.get_all_operations():
        calls += exercise(result.ok(), known, errors)
    assert calls >= EXAMPLES * 4
    return errors


def exercise(operation: Any, known: list[str], errors: Counter[tuple[str, int, str]]) -> int:
    """EXAMPLES calls of one operation; server errors are counted into `errors`. Returns the calls made."""
    label, calls = operation.label, 0

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(), token=st.booleans(), real=st.sampled_from([None, *known]))
    def call(case: Any, token: bool, real: str | None) -> None:
        nonlocal calls
        if real is not None and "experiment" in (case.path_parameters or {}):
            case.path_parameters["experiment"] = real
        if token:
            case.headers = {**(case.headers or {}), **AUTH}
        response = case.call()
        calls += 1
        if response.status_code >= 500:
            errors[(label, response.status_code, response.text[:120])] += 1

    call()
    return calls


def test_the_topology_service_answers_no_server_error() -> None:
    coordinator = Coordinator(InMemoryTransport(InMemoryBroker()), "dfuzz", workers=3)
    coordinator.open()
    app = topology_app(coordinator, TOKEN, "memory://")
    created = coordinator.create(ExperimentConfigFrom(small()))
    started = coordinator.create(ExperimentConfigFrom(small(name="run")))
    coordinator.start(started.id)
    assert fuzz(app, [created.id, started.id]) == Counter()


def test_the_metrics_service_answers_no_server_error(tmp_path: Path) -> None:
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    collector = MetricsCollector(InMemoryTransport(), store, "d")
    collector.on_event(ExperimentEvent(deployment="d", experiment="m1", status="running", config=CFG, at=1000.0))
    for worker in (0, 1):
        collector.on_event(report(worker, 1))
    collector.on_event(ExperimentEvent(deployment="d", experiment="m1", status="completed", config=CFG, at=1010.0))
    app = metrics_app(store, "memory://")
    assert fuzz(app, ["m1"]) == Counter()


def ExperimentConfigFrom(data: dict[str, Any]) -> Any:  # noqa: N802 - reads as the type it makes
    from dfca.config import ExperimentConfig

    return ExperimentConfig.model_validate(data)


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
