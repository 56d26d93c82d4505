"""`:start` refuses what cannot run, with a message that says what to do; a finished experiment keeps its round
across a restart of the topology service; the topology names the workers' clients `worker_clients`; GET /deployment
lists the workers and the aggregator heard from, and the aggregator is ready only once listed there."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import networkx as nx
import pytest
from fastapi.testclient import TestClient
from free_ports import free_port
from test_runtime_control_plane import AUTH, TOKEN, small

from dfca.config import ExperimentConfig
from dfca.runtime.control.coordinator import PRESENT_FOR_S, Coordinator
from dfca.runtime.control.experiments import HEARTBEAT_S, ExperimentRecord
from dfca.runtime.protocol.messages import PresenceEvent, WorkerEvent
from dfca.runtime.service.registration import known_to_topology
from dfca.transport import InMemoryBroker, InMemoryTransport, connect_transport
from services.aggregator.main import Aggregator
from services.aggregator.main import create_app as create_aggregator_app
from services.topology.main import create_app


def coordinator(workers: int | None = None, state_dir: Path | None = None) -> Coordinator:
    c = Coordinator(InMemoryTransport(InMemoryBroker()), "dtest", workers=workers, state_dir=state_dir)
    c.open()
    return c


def test_ifca_without_an_aggregator_is_refused_at_start_and_runs_once_one_announces_itself() -> None:
    c = coordinator(workers=3)
    with TestClient(create_app(c, TOKEN, "memory://"), headers=AUTH) as client:
        experiment = client.post("/experiments", json=small(algorithm="ifca"), headers=AUTH).json()["id"]
        refused = client.post(f"/experiments/{experiment}:start", headers=AUTH)
        assert refused.status_code == 409 and "aggregator" in refused.json()["detail"]
        assert client.get(f"/experiments/{experiment}").json()["status"] == "created"
        c.on_event(PresenceEvent(role="aggregator", deployment="dtest", worker=0, workers=1))
        assert client.post(f"/experiments/{experiment}:start", headers=AUTH).json()["status"] == "running"
        dfca = client.post("/experiments", json=small(name="dfca"), headers=AUTH).json()["id"]  # needs none
        assert client.post(f"/experiments/{dfca}:start", headers=AUTH).status_code == 200


def test_runtime_workers_that_disagree_with_the_workers_present_is_refused() -> None:
    c = coordinator()
    for ordinal in range(3):
        c.on_event(PresenceEvent(deployment="dtest", worker=ordinal, workers=3))
    with TestClient(create_app(c, TOKEN, "memory://"), headers=AUTH) as client:
        five = client.post("/experiments", json=small(runtime={"workers": 5}), headers=AUTH).json()["id"]
        refused = client.post(f"/experiments/{five}:start", headers=AUTH)
        assert refused.status_code == 409
        assert "runtime.workers is 5 but 3 workers are present" in refused.json()["detail"]
        three = client.post("/experiments", json=small(name="b", runtime={"workers": 3}), headers=AUTH).json()["id"]
        assert client.post(f"/experiments/{three}:start", headers=AUTH).status_code == 200
        unset = client.post("/experiments", json=small(name="c"), headers=AUTH).json()["id"]
        started = client.post(f"/experiments/{unset}:start", headers=AUTH).json()
        assert started["workers"] == 3
        topology = client.get(f"/experiments/{unset}/topology").json()
        assert "assignment" not in topology and sorted(topology["worker_clients"]) == ["0", "1", "2"]


def test_a_finished_experiment_keeps_its_round_across_a_restart(tmp_path: Path) -> None:
    record = ExperimentRecord.new("e", ExperimentConfig.model_validate(small()), nx.complete_graph(9), workers=2)
    record.start(now=0.0)
    record.go = True
    for worker in (0, 1):
        record.observe(WorkerEvent(deployment="d", experiment="e", worker=worker, incarnation="a", state="finished",
                                   round=3, at=1.0), now=1.0)
    assert record.settle(now=1.0) == "completed"
    record.finish("completed", now=1.0)
    assert record.round == 3
    restored = ExperimentRecord.from_json(record.to_json())
    assert restored.status == "completed" and restored.round == 3


@pytest.mark.parametrize("workers", [None, 2])
def test_the_topology_service_restores_finished_rounds_from_its_state_folder(tmp_path: Path,
                                                                              workers: int | None) -> None:
    first = coordinator(workers=workers, state_dir=tmp_path)
    record = first.create(ExperimentConfig.model_validate(small()))
    with first.lock:
        record.status, record.saved_round = "completed", 3  # as a run that finished and was saved
        first._changed(record, announce=False)
    second = coordinator(workers=workers, state_dir=tmp_path)
    assert second.get(record.id).public()["round"] == 3


def test_the_deployment_lists_the_workers_and_aggregator_heard_from_recently() -> None:
    now = [1000.0]
    c = Coordinator(InMemoryTransport(InMemoryBroker()), "dtest", workers=3, clock=lambda: now[0])
    c.open()
    with TestClient(create_app(c, TOKEN, "memory://"), headers=AUTH) as client:
        view = client.get("/deployment").json()
        assert view == {"deployment": "dtest", "workers": 3, "workers_present": [], "aggregator": False, "data": {},
                        "data_refused": {}}
        assert not known_to_topology(client, "http://127.0.0.1:9", "aggregator")
        for ordinal in (2, 0):
            c.on_event(PresenceEvent(deployment="dtest", worker=ordinal, workers=3))
        c.on_event(PresenceEvent(role="aggregator", deployment="dtest", worker=0, workers=1))
        c.on_event(PresenceEvent(deployment="other", worker=1, workers=3))  # another deployment's worker
        view = client.get("/deployment").json()
        assert view["workers_present"] == [0, 2] and view["aggregator"] is True
        assert known_to_topology(client, "http://127.0.0.1:9", "aggregator")
        assert known_to_topology(client, "http://127.0.0.1:9", "worker", 2)
        assert not known_to_topology(client, "http://127.0.0.1:9", "worker", 1)
        now[0] += PRESENT_FOR_S + 0.1  # silent since: no longer present
        view = client.get("/deployment").json()
        assert view["workers_present"] == [] and view["aggregator"] is False
        assert not known_to_topology(client, "http://127.0.0.1:9", "worker", 2)


def test_an_unreachable_topology_service_knows_nobody() -> None:
    with httpx.Client(timeout=2.0) as http:
        assert not known_to_topology(http, f"http://127.0.0.1:{free_port()}", "aggregator")
        assert known_to_topology(http, None, "worker", 0)  # on an in-memory bus with no topology URL


def test_the_aggregator_is_ready_only_once_the_topology_service_knows_it() -> None:
    """Its broker reachable and its consumer running, an aggregator whose announcement the topology service has not
    heard (here: announced before the service's event queue existed) answers 503, and IFCA is refused; once the
    service hears the next announcement, /readyz passes and IFCA starts, with no other step between."""
    bus = f"memory://ready-{uuid.uuid4().hex[:8]}"
    coordinator = Coordinator(connect_transport(bus), "dready", workers=3)
    topology = TestClient(create_app(coordinator, TOKEN, bus), headers=AUTH)
    aggregator = Aggregator("dready", bus, f"http://127.0.0.1:{free_port()}")  # running_specs: refused, retried
    aggregator._http = topology  # its readiness question reaches the in-process topology service
    try:
        aggregator.open()  # announces itself at once: nobody consumes the events yet
        with TestClient(create_aggregator_app(aggregator, bus)) as health:
            refused = health.get("/readyz")
            assert refused.status_code == 503 and refused.json() == {"status": "unavailable", "broker": True,
                                                                     "service": False}
            coordinator.open()
            experiment = topology.post("/experiments", json=small(algorithm="ifca"), headers=AUTH).json()["id"]
            assert topology.post(f"/experiments/{experiment}:start", headers=AUTH).status_code == 409
            deadline = time.monotonic() + 5 * HEARTBEAT_S
            while health.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the topology service never heard the aggregator"
                time.sleep(0.1)
            assert topology.get("/deployment").json()["aggregator"] is True
            assert topology.post(f"/experiments/{experiment}:start", headers=AUTH).status_code == 200
    finally:
        aggregator.close()
        coordinator.close()
