"""The topology service without a broker: REST contract, control messages, experiment lifecycle rules."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dfca.config import ExperimentConfig
from dfca.graph import neighbours
from dfca.identity import topics
from dfca.identity.broker_setup import bind_to_deployment, ensure_broker_topology
from dfca.identity.principals import host_of
from dfca.identity.sharding import assignment, clients_of
from dfca.runtime.control.coordinator import Coordinator
from dfca.runtime.control.experiments import BARRIER_TIMEOUT_S, EventRefused, ExperimentRecord, dead_after
from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.protocol.messages import (
    GoCommand,
    PresenceEvent,
    RoundReport,
    StartCommand,
    StopCommand,
    TopologyChange,
    WorkerEvent,
    decode_control,
)
from dfca.runtime.service.http_service import MAX_BODY_BYTES
from dfca.runtime.service.state_dirs import StateDirUnwritable
from dfca.runtime.worker.worker_agent import WorkerAgent
from dfca.simulator import prepare
from dfca.transport import InMemoryBroker, InMemoryTransport
from harness.lockstep import client_driver
from services.metrics.main import MetricsCollector
from services.topology.main import create_app

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def small(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "name": "cp", "clusters": 2, "rounds": 3, "seed": 1,
        "data": {"dataset": "digits", "rotations": [0, 180], "clients": 9, "train_per_client": 20,
                 "test_per_client": 5},
        "model": {"kind": "mlp", "hidden": 8}, "topology": {"kind": "erdos_renyi", "p": 0.5},
        "runtime": {"round_timeout": 2.0},
    }
    cfg.update(overrides)
    return cfg


class Probe:
    """Everything published on dfca.control, read back from a queue of its own."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self.transport = InMemoryTransport(broker)
        self.transport.declare_exchange(topics.CONTROL_EXCHANGE, "topic")
        self.transport.declare_queue("probe")
        self.transport.bind("probe", topics.CONTROL_EXCHANGE, "#")

    def commands(self) -> list[StartCommand | GoCommand | StopCommand | TopologyChange]:
        out = []
        while (message := self.transport.receive("probe")) is not None:
            out.append(decode_control(message.body))
            self.transport.ack(message)
        return out


@pytest.fixture
def broker() -> InMemoryBroker:
    return InMemoryBroker()


@pytest.fixture
def coordinator(broker: InMemoryBroker) -> Coordinator:
    coordinator = Coordinator(InMemoryTransport(broker), "dtest", workers=3)
    coordinator.open()
    return coordinator


@pytest.fixture
def client(coordinator: Coordinator) -> Iterator[TestClient]:
    with TestClient(create_app(coordinator, TOKEN, "memory://")) as test_client:
        yield test_client


def test_mutating_calls_need_the_bearer_token(client: TestClient, coordinator: Coordinator) -> None:
    assert client.post("/experiments", json=small()).status_code == 401
    assert client.post("/experiments", json=small(), headers={"Authorization": "Bearer wrong"}).status_code == 401
    created = client.post("/experiments", json=small(), headers=AUTH)
    assert created.status_code == 201
    experiment = created.json()["id"]
    assert client.post(f"/experiments/{experiment}:start").status_code == 401
    assert client.post(f"/experiments/{experiment}:stop").status_code == 401
    # an API token guards reads too: with any token set, nothing is read without one
    for path in ("/experiments", f"/experiments/{experiment}", f"/experiments/{experiment}/topology"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert client.get(path, headers=AUTH).status_code == 200, path
    assert client.get("/livez").status_code == 200
    with TestClient(create_app(coordinator, None, "memory://")) as no_token:
        refused = no_token.post("/experiments", json=small(), headers=AUTH)
        assert refused.status_code == 401 and "DFCA_API_TOKEN" in refused.json()["detail"]


def test_a_read_token_guards_reads_and_cannot_write(coordinator: Coordinator) -> None:
    read = {"Authorization": "Bearer reader"}
    with TestClient(create_app(coordinator, TOKEN, "memory://", read_token="reader")) as guarded:
        experiment = guarded.post("/experiments", json=small(), headers=AUTH).json()["id"]
        for path in ("/experiments", f"/experiments/{experiment}", f"/experiments/{experiment}/topology"):
            assert guarded.get(path).status_code == 401, path
            assert guarded.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
            assert guarded.get(path, headers=read).status_code == 200, path
            assert guarded.get(path, headers=AUTH).status_code == 200, path  # the API token reads too
            assert guarded.get(f"{path}?access_token=reader").status_code == 200, path
        for path in ("/livez", "/openapi.json"):
            assert guarded.get(path).status_code == 200, path
        assert guarded.post(f"/experiments/{experiment}:start", headers=read).status_code == 401  # reading only


def test_delete_forgets_a_finished_experiment_and_refuses_a_running_one(client: TestClient) -> None:
    created = client.post("/experiments", json=small(), headers=AUTH).json()["id"]
    running = client.post("/experiments", json=small(name="r"), headers=AUTH).json()["id"]
    assert client.post(f"/experiments/{running}:start", headers=AUTH).status_code == 200
    assert client.delete(f"/experiments/{created}").status_code == 401
    conflict = client.delete(f"/experiments/{running}", headers=AUTH)
    assert conflict.status_code == 409 and "stop it" in conflict.json()["detail"]
    assert client.delete(f"/experiments/{created}", headers=AUTH).json() == {"id": created, "deleted": True}
    assert client.get(f"/experiments/{created}", headers=AUTH).status_code == 404
    assert client.delete(f"/experiments/{created}", headers=AUTH).status_code == 404
    assert client.post(f"/experiments/{running}:stop", headers=AUTH).status_code == 200
    assert [e["id"] for e in client.get("/experiments", headers=AUTH).json()] == [running]


def test_bodies_are_refused_before_they_are_read(client: TestClient) -> None:
    """Without the token the body is never read (401 whatever its size); a body above the limit is 413, declared
    or streamed in chunks; NaN and infinity in a config are 422 naming the field, never 500."""
    huge = b"x" * (MAX_BODY_BYTES + 1)
    assert client.post("/experiments", content=huge).status_code == 401
    assert client.post("/experiments", content=huge, headers=AUTH).status_code == 413
    chunks = (b"x" * 65536 for _ in range(MAX_BODY_BYTES // 65536 + 2))
    assert client.post("/experiments", content=chunks, headers=AUTH).status_code == 413
    for value in ("NaN", "Infinity", "1e30"):
        body = small()
        text = json.dumps(body).replace('"train": {', f'"train": {{"lr": {value}, ', 1) if "train" in body else \
            json.dumps(body)[:-1] + f', "train": {{"lr": {value}}}}}'
        response = client.post("/experiments", content=text.encode(),
                               headers={**AUTH, "Content-Type": "application/json"})
        assert response.status_code == 422 and "lr" in str(response.json()["detail"]), (value, response.text)


@pytest.mark.parametrize("body,field", [
    (small(clusters=0), "clusters"),
    (small(data={"dataset": "digits", "clients": "many"}), "clients"),
    ({**small(), "roundz": 3}, "roundz"),
    (small(algorithm="fedavg"), "algorithm"),  # every algorithm of the schema runs; an unknown one does not
    (small(topology={"kind": "erdos_renyi", "p": 0.01, "max_tries": 2}), "topology"),
])
def test_an_invalid_config_gets_422_naming_the_field(client: TestClient, body: dict[str, Any], field: str) -> None:
    response = client.post("/experiments", json=body, headers=AUTH)
    assert response.status_code == 422
    assert any(field in error["loc"] for error in response.json()["detail"]), response.json()


@pytest.mark.parametrize("method,path", [
    ("get", "/experiments/nope"), ("get", "/experiments/nope/topology"), ("post", "/experiments/nope:start"),
    ("post", "/experiments/nope:stop"), ("post", "/experiments/nope/edges"),
])
def test_unknown_experiments_get_404(client: TestClient, method: str, path: str) -> None:
    kwargs: dict[str, Any] = {"headers": AUTH}
    if path.endswith("edges"):
        kwargs["json"] = {"add": [[0, 1]]}
    assert getattr(client, method)(path, **kwargs).status_code == 404


def test_start_tells_workers_their_graph_and_stop_tells_them_to_stop(client: TestClient,
                                                                    broker: InMemoryBroker) -> None:
    probe = Probe(broker)
    experiment = client.post("/experiments", json=small(), headers=AUTH).json()["id"]
    assert client.get(f"/experiments/{experiment}", headers=AUTH).json()["status"] == "created"
    started = client.post(f"/experiments/{experiment}:start", headers=AUTH)
    assert started.status_code == 200 and started.json()["status"] == "running"
    assert client.post(f"/experiments/{experiment}:start", headers=AUTH).status_code == 409
    (start,) = probe.commands()
    assert isinstance(start, StartCommand) and start.deployment == "dtest" and start.workers == 3
    topology = client.get(f"/experiments/{experiment}/topology", headers=AUTH).json()
    assert start.neighbours == {int(c): m for c, m in topology["neighbours"].items()}
    assert all(start.neighbours[c] and c not in start.neighbours[c] for c in range(9))
    assert topology["worker_clients"] == {str(w): clients_of(w, 3, 9) for w in range(3)}
    stopped = client.post(f"/experiments/{experiment}:stop", headers=AUTH)
    assert stopped.json()["status"] == "stopping"
    assert [type(c) for c in probe.commands()] == [StopCommand]


def test_edge_changes_rebind_and_reach_workers_with_an_effective_round(client: TestClient,
                                                                      broker: InMemoryBroker) -> None:
    probe = Probe(broker)
    experiment = client.post("/experiments", json=small(), headers=AUTH).json()["id"]
    client.post(f"/experiments/{experiment}:start", headers=AUTH)
    probe.commands()
    before = client.get(f"/experiments/{experiment}/topology", headers=AUTH).json()
    heard = {host_of(w, 3): {m for c in clients_of(w, 3, 9) for m in before["neighbours"][str(c)]} for w in range(3)}
    # a new edge whose u's worker heard nothing from v before: its queue must be bound to v now
    u, v = next((a, b) for a in range(9) for b in range(a + 1, 9)
                if [a, b] not in before["edges"] and b not in heard[host_of(a, 3)] and before["edges"][0] != [a, b])
    removed = before["edges"][0]
    changed = client.post(f"/experiments/{experiment}/edges", json={"add": [[u, v]], "remove": [removed]},
                          headers=AUTH)
    assert changed.status_code == 200
    after = changed.json()
    assert after["version"] == before["version"] + 1 and [u, v] in after["edges"] and removed not in after["edges"]
    (change,) = probe.commands()
    assert isinstance(change, TopologyChange) and change.version == after["version"] and change.effective_round == 2
    assert v in change.neighbours[u] and u in change.neighbours[v]
    # the new edge's queue is bound at once: a model from v reaches the queue of u's worker
    transport = InMemoryTransport(broker)
    transport.publish(topics.MODELS_EXCHANGE, topics.model_key(experiment, host_of(v, 3), v, 0), b"x", {})
    assert transport.receive(topics.worker_queue(experiment, host_of(u, 3))) is not None
    bad = client.post(f"/experiments/{experiment}/edges", json={"add": [[3, 3]]}, headers=AUTH)
    assert bad.status_code == 422


def worker_event(w: int, state: str, at: float, round_: int = 0) -> WorkerEvent:
    return WorkerEvent(deployment="d", experiment="e", worker=w, incarnation=f"i{w}", state=state,  # type: ignore[arg-type]
                       round=round_, at=at)


def test_record_lifecycle_barrier_death_and_completion() -> None:
    import networkx as nx

    cfg = ExperimentConfig.model_validate(small())
    record = ExperimentRecord.new("e", cfg, nx.complete_graph(9), workers=3)
    record.start(now=100.0)
    for w in (0, 1):
        record.observe(worker_event(w, "ready", 101.0), now=101.0)
    assert not record.barrier_passed(now=102.0)  # worker 2 not ready yet
    assert record.barrier_passed(now=100.0 + BARRIER_TIMEOUT_S + 1)  # ... unless the barrier timed out
    record.observe(worker_event(2, "ready", 102.0), now=102.0)
    assert record.barrier_passed(now=102.0)
    record.go = True
    for w in (0, 1):
        record.observe(RoundReport(deployment="d", experiment="e", worker=w, incarnation=f"i{w}", round=1,
                                   clients=clients_of(w, 3, 9), complete=True, seconds=1.0, at=103.0), now=103.0)
    assert record.round == 0  # worker 2 has not finished a round
    limit = dead_after(cfg)
    assert record.mark_dead(now=102.0 + limit + 1, grace_since=102.0 + limit) == []  # a fresh grace period
    assert record.mark_dead(now=102.0 + limit + 1) == [2]
    assert record.round == 1
    for w in (0, 1):
        record.observe(worker_event(w, "finished", 200.0, 3), now=200.0)
        record.observe(worker_event(w, "running", 199.0, 2), now=200.5)  # an older heartbeat arriving late
    assert record.settle(now=201.0) == "completed"
    record.observe(worker_event(0, "running", 150.0, 2).model_copy(update={"incarnation": "old"}), now=201.0)
    assert record.worker_views[0].state == "running"  # a new incarnation (e.g. a restart) speaks
    record.observe(worker_event(0, "finished", 202.0, 3), now=202.0)  # ... and the retired one cannot
    assert record.worker_views[0].state == "running" and record.worker_views[0].incarnations == 2
    record.observe(worker_event(0, "finished", 203.0, 3).model_copy(update={"incarnation": "old"}), now=203.0)
    record.finish("completed", now=201.0)
    assert record.failed_clients == clients_of(2, 3, 9)


def test_events_no_worker_of_the_run_can_send_are_refused() -> None:
    """A forged `finished` at round 999, or from a worker the run does not have, cannot end an experiment."""
    import networkx as nx

    cfg = ExperimentConfig.model_validate(small())
    record = ExperimentRecord.new("e", cfg, nx.complete_graph(9), workers=3)
    record.start(now=100.0)
    for forged in (worker_event(0, "finished", 101.0, 999), worker_event(5, "finished", 101.0, 1)):
        with pytest.raises(EventRefused):
            record.observe(forged, now=101.0)
    assert all(v.state == "pending" and v.round == 0 for v in record.worker_views.values())
    assert record.settle(now=102.0) is None and record.status == "running"


def test_an_experiment_with_no_finished_worker_failed() -> None:
    import networkx as nx

    record = ExperimentRecord.new("e", ExperimentConfig.model_validate(small()), nx.complete_graph(9), workers=2)
    record.start(now=0.0)
    record.go = True
    record.observe(worker_event(0, "failed", 1.0), now=1.0)
    assert record.settle(now=1.0) is None
    record.observe(worker_event(1, "failed", 1.0), now=1.0)
    assert record.settle(now=1.0) == "failed"


def test_the_worker_count_comes_from_presence_when_not_configured(broker: InMemoryBroker) -> None:
    coordinator = Coordinator(InMemoryTransport(broker), "dtest", workers=None)
    cfg = ExperimentConfig.model_validate(small())
    assert cfg.runtime.workers is None and coordinator.worker_count(cfg) == 1
    coordinator.on_event(PresenceEvent(deployment="dtest", worker=1, workers=4))
    coordinator.on_event(PresenceEvent(deployment="other", worker=0, workers=7))
    assert coordinator.worker_count(cfg) == 4


def test_sharding_covers_every_client_once() -> None:
    plan = assignment(10, 3)
    assert sorted(c for clients in plan.values() for c in clients) == list(range(10))
    assert plan[1] == [1, 4, 7] and clients_of(4, 5, 3) == []
    with pytest.raises(ValueError):
        clients_of(3, 3, 10)


def test_records_survive_a_topology_restart_and_an_unwritable_folder_is_refused(broker: InMemoryBroker,
                                                                                   tmp_path: Path) -> None:
    ensure_broker_topology(InMemoryTransport(broker))
    first = Coordinator(InMemoryTransport(broker), "dtest", workers=3, state_dir=tmp_path / "records")
    record = first.create(ExperimentConfig.model_validate(small()))
    first.start(record.id)
    again = Coordinator(InMemoryTransport(broker), "dtest", workers=3, state_dir=tmp_path / "records")
    restored = again.get(record.id)
    assert restored.status == "running" and restored.edges == record.edges and restored.config == record.config
    assert set(restored.worker_views) == {0, 1, 2}
    (tmp_path / "file").write_text("")
    with pytest.raises(StateDirUnwritable, match="DFCA_CHECKPOINT_DIR: cannot write the state folder"):
        Coordinator(InMemoryTransport(broker), "dtest", workers=3, state_dir=tmp_path / "file" / "records")


def test_a_worker_done_before_a_topology_restart_is_not_presumed_dead_after_it(broker: InMemoryBroker,
                                                                               tmp_path: Path) -> None:
    """A worker that finished the run never speaks again. Its `finished` is saved when it arrives, so the topology
    service restarted after it (as Kubernetes restarts a killed pod) still counts it finished: when the last worker
    finishes the run completes with no failed clients, even long after the restart's grace period."""
    ensure_broker_topology(InMemoryTransport(broker))
    clock = [1000.0]
    first = Coordinator(InMemoryTransport(broker), "dtest", workers=3, state_dir=tmp_path / "records",
                        clock=lambda: clock[0])
    record = first.create(ExperimentConfig.model_validate(small()))
    first.start(record.id)
    rounds = record.config.rounds

    def event(w: int, state: str) -> WorkerEvent:
        return WorkerEvent(deployment="dtest", experiment=record.id, worker=w, incarnation=f"i{w}",
                           state=state, round=rounds if state == "finished" else 1, at=clock[0])  # type: ignore[arg-type]

    for w in range(3):
        first.on_event(event(w, "ready"))
    first.tick()
    assert first.get(record.id).go
    for w in (0, 2):
        first.on_event(event(w, "finished"))
    again = Coordinator(InMemoryTransport(broker), "dtest", workers=3, state_dir=tmp_path / "records",
                        clock=lambda: clock[0])
    restored = again.get(record.id)
    assert {w: v.state for w, v in restored.worker_views.items()} == {0: "finished", 1: "running", 2: "finished"}
    clock[0] += 10 * dead_after(record.config)
    again.on_event(event(1, "finished"))
    again.tick()
    final = again.get(record.id)
    assert final.status == "completed" and final.failed_clients == []


def test_every_queue_a_deployment_declares_is_deleted_once_its_consumers_are_gone(
        client: TestClient, coordinator: Coordinator, broker: InMemoryBroker, tmp_path: Path) -> None:
    """The topology and metrics services' event queues, the dead-letter tap, a worker's control queue and its queue
    of models, and a central role's queue all carry an expiry (x-expires): on a shared broker a deployment that is
    gone leaves nothing that goes on collecting later deployments' messages. Only the one shared dead-letter
    queue stays."""
    agent = WorkerAgent("dtest", 0, 3, lambda _prefetch: InMemoryTransport(broker), tmp_path / "checkpoints", None)
    agent.start()
    collector = MetricsCollector(InMemoryTransport(broker), MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}"),
                                 "dtest")
    collector.open()
    try:
        coordinator.aggregator_seen = coordinator.clock()  # an aggregator announced itself: IFCA may start
        experiment = client.post("/experiments", json=small(algorithm="ifca"), headers=AUTH).json()["id"]
        assert client.post(f"/experiments/{experiment}:start", headers=AUTH).status_code == 200
        cfg = ExperimentConfig.model_validate(small())
        ctx = prepare(cfg)
        client_driver(cfg, experiment, clients_of(0, 3, 9), ctx.data.subset(clients_of(0, 3, 9)),
                      neighbours(ctx.graph), InMemoryTransport(broker), workers=3)
        declared = {name: queue.limits for name, queue in broker.queues.items()}
    finally:
        agent.shutdown(2.0)
        collector.close()
    expected = {topics.events_queue("dtest", "topology"), topics.events_queue("dtest", "metrics"),
                topics.dead_letter_tap_queue("dtest"), topics.worker_control_queue("dtest", 0),
                topics.worker_queue(experiment, "worker-0"), topics.server_queue(experiment)}
    assert expected <= set(declared), sorted(declared)
    lasting = {name for name, limits in declared.items() if limits is None or not limits.expires_s}
    assert lasting == {topics.DEAD_LETTER_QUEUE}, lasting


class ConfirmLog(InMemoryTransport):
    """An in-memory transport that logs how each publish was made and when confirms were awaited."""

    def __init__(self, broker: InMemoryBroker) -> None:
        super().__init__(broker)
        self.calls: list[str] = []

    def publish_pipelined(self, messages: Any, persistent: bool = True) -> None:
        self.calls.append("pipelined")
        InMemoryTransport.publish_many(self, messages)

    def publish_many(self, messages: Any) -> None:
        self.calls.append("confirmed")
        super().publish_many(messages)

    def await_confirms(self) -> None:
        self.calls.append("await")
        super().await_confirms()


def test_a_deployments_service_queues_get_its_own_messages_only(broker: InMemoryBroker, tmp_path: Path) -> None:
    """Control commands and events are keyed by deployment, and each service's queue is bound to its own
    deployment's keys: a queue another stack left on the broker (a finished test's, a benchmark's) receives nothing of
    this one's traffic. An upgraded queue loses the bind-everything key earlier versions gave it. A worker's round
    report is handed over without awaiting its confirm, which the worker's next event awaits first."""
    ensure_broker_topology(InMemoryTransport(broker))
    left_over = InMemoryTransport(broker)  # another deployment's queues, one of them bound the old way too
    for exchange, queue in ((topics.METRICS_EXCHANGE, topics.events_queue("dold", "metrics")),
                            (topics.CONTROL_EXCHANGE, topics.worker_control_queue("dold", 0))):
        left_over.declare_queue(queue)
        bind_to_deployment(left_over, queue, exchange, "dold")
    upgraded = topics.events_queue("dtest", "metrics")
    left_over.declare_queue(upgraded)
    left_over.bind(upgraded, topics.METRICS_EXCHANGE, topics.ALL_KEYS)

    coordinator = Coordinator(InMemoryTransport(broker), "dtest", workers=1)
    coordinator.open()
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    collector = MetricsCollector(InMemoryTransport(broker), store, "dtest")
    collector.open()  # binds `upgraded` to dtest's keys and drops its "#"
    agent = WorkerAgent("dtest", 0, 1, lambda _prefetch: InMemoryTransport(broker), tmp_path / "checkpoints", None)
    agent.start()
    reporting = ConfirmLog(broker)
    reporter = WorkerAgent("dtest", 1, 2, lambda _prefetch: reporting, tmp_path / "checkpoints", None)
    try:
        with TestClient(create_app(coordinator, TOKEN, "memory://")) as client:
            experiment = client.post("/experiments", json=small(), headers=AUTH).json()["id"]
            assert client.post(f"/experiments/{experiment}:start", headers=AUTH).status_code == 200
        for t in (1, 2):
            reporter.emit(RoundReport(deployment="dtest", experiment=experiment, worker=1, incarnation="i", round=t,
                                      clients=[], complete=True, seconds=0.1))
        reporter.emit(WorkerEvent(deployment="dtest", experiment=experiment, worker=1, incarnation="i",
                                  state="finished", round=2))
        assert reporting.calls == ["await", "pipelined", "await", "pipelined", "await", "confirmed"]
        # this deployment's services heard the start and the events; the other deployment's queues nothing
        assert experiment in agent.runners
        assert (topics.ALL_KEYS not in {key for queue, key in broker.bindings[topics.METRICS_EXCHANGE]
                                        if queue == upgraded})
        for queue in (topics.events_queue("dold", "metrics"), topics.worker_control_queue("dold", 0)):
            assert left_over.receive(queue) is None, queue
        # the keys name the deployment first, and a dead letter's experiment is read past it
        key = topics.metrics_key("dtest", experiment, "round")
        assert key.startswith("dtest.") and topics.experiment_of_key(topics.METRICS_EXCHANGE, key) == experiment
        model_key = topics.model_key(experiment, "worker-0", 3, 0)
        assert topics.experiment_of_key(topics.MODELS_EXCHANGE, model_key) == experiment
    finally:
        agent.shutdown(2.0)
        reporter.shutdown(1.0)
        collector.close()
