"""`:start` refuses what cannot run, with a message that says what to do; a finished experiment keeps its round
across a restart of the topology service; the topology names the workers' clients `worker_clients`."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest
from fastapi.testclient import TestClient
from test_runtime_control_plane import AUTH, TOKEN, small

from dfca.config import ExperimentConfig
from dfca.runtime.coordinator import Coordinator
from dfca.runtime.experiments import ExperimentRecord
from dfca.runtime.messages import PresenceEvent, WorkerEvent
from dfca.transport import InMemoryBroker, InMemoryTransport
from services.topology.main import create_app


def coordinator(workers: int | None = None, state_dir: Path | None = None) -> Coordinator:
    c = Coordinator(InMemoryTransport(InMemoryBroker()), "dtest", workers=workers, state_dir=state_dir)
    c.open()
    return c


def test_ifca_without_an_aggregator_is_refused_at_start_and_runs_once_one_announces_itself() -> None:
    c = coordinator(workers=3)
    with TestClient(create_app(c, TOKEN, "memory://")) as client:
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
    with TestClient(create_app(c, TOKEN, "memory://")) as client:
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
