"""The metrics service without a broker: storage, the summary's numbers, REST, SSE and Prometheus."""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy
import torch
import uvicorn
from fastapi.testclient import TestClient
from free_ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from dfca.config import ExperimentConfig
from dfca.identity import topics
from dfca.results.evaluation import cluster_ari
from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.protocol.messages import ExperimentEvent, RoundReport, WorkerEvent, encode
from dfca.runtime.service.event_consumer import QueueConsumer
from dfca.transport import InMemoryBroker, InMemoryTransport
from services.metrics.main import MAX_STREAMS_PER_CLIENT, MetricsCollector, create_app

CFG = ExperimentConfig.model_validate({"name": "m", "clusters": 2, "rounds": 2,
                                       "data": {"dataset": "digits", "clients": 4}})


def report(worker: int, round_: int, incarnation: str = "a", evaluate: bool = True, **stats: Any) -> RoundReport:
    clients = [worker, worker + 2]
    evaluation = {"clients": clients, "assigned": [0, 1], "test_accuracy": [0.5 + 0.1 * round_, 0.9],
                  "train_loss": [1.0, 0.5], "true_cluster": [0, 1]} if evaluate else None
    return RoundReport(deployment="d", experiment="m1", worker=worker, incarnation=incarnation, round=round_,
                       clients=clients, complete=True, seconds=1.0 + worker, evaluation=evaluation,
                       stats={"published": 2 * round_, "applied": 3 * round_, "timeouts": 0,
                              "seconds": {"train": 0.5 * round_ if incarnation == "a" else 0.25, "publish": 0.1},
                              "cpu_seconds": {"train": 0.4 * round_ if incarnation == "a" else 0.2,
                                              "loop": 0.9 * round_},
                              **stats},
                       bytes_published=200, at=1000.0 + round_)


@pytest.fixture
def store(tmp_path: Path) -> MetricsStore:
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    collector = MetricsCollector(InMemoryTransport(), store, "d")  # only its event handler is used
    collector.on_event(ExperimentEvent(deployment="d", experiment="m1", status="running", config=CFG, at=1000.0))
    collector.on_event(ExperimentEvent(deployment="other", experiment="x", status="running", config=CFG))
    for worker in (0, 1):
        collector.on_event(report(worker, 1))
    collector.on_event(report(0, 2, rejected={"spoofed": 2}))
    collector.on_event(report(0, 2, rejected={"spoofed": 2}))  # redelivered: stored once
    collector.on_event(WorkerEvent(deployment="d", experiment="m1", worker=1, incarnation="b", state="resumed",
                                   round=1, resumed_from=1, device="cuda:0 (NVIDIA H100 80GB HBM3)"))
    collector.on_event(report(1, 2, incarnation="b", republished=4))  # after a broker restart
    collector.on_event(ExperimentEvent(deployment="d", experiment="m1", status="completed", config=CFG, at=1010.0))
    store.record_dead_letter("m1", "dfca.models", "m1.3.0")
    return store


def test_the_summary_has_summary_json_fields_and_runtime_counts(store: MetricsStore) -> None:
    with TestClient(create_app(store, "memory://")) as client:
        summary = client.get("/experiments/m1/summary").json()
        assert client.get("/experiments/x/summary").status_code == 404  # another deployment's experiment
    for key in ("algorithm", "rounds", "test_accuracy", "cluster_ari", "cluster_acc", "populated_clusters",
                "wall_seconds", "seconds_per_round", "assignment_counts", "clients"):
        assert key in summary
    assert summary["status"] == "completed" and summary["clients"] == 4
    assert summary["test_accuracy"] == pytest.approx((0.7 + 0.9 + 0.7 + 0.9) / 4)
    assert summary["cluster_ari"] == cluster_ari(torch.tensor([0, 1, 0, 1]), torch.tensor([0, 1, 0, 1])) == 1.0
    assert summary["wall_seconds"] == pytest.approx(10.0)
    assert summary["seconds_per_round"] == pytest.approx(2.0)  # the slowest worker per round
    messages = summary["messages"]
    # worker 1's first incarnation counted to round 1, its second from scratch: totals add up per incarnation
    assert messages["applied"] == 6 + 3 + 6 and messages["rejected"] == {"spoofed": 2}
    assert messages["dead_lettered"] == 1 and messages["republished"] == 4
    assert summary["worker_restarts"] == {} and summary["resumed_from"] == {"1": 1}
    assert summary["devices"] == {"1": "cuda:0 (NVIDIA H100 80GB HBM3)"}  # worker 0 sent no state with one


def test_a_store_written_before_worker_devices_opens_and_keeps_its_rows(tmp_path: Path) -> None:
    """A metrics database from before `worker_events.device` existed: the store adds the column on open, keeps the
    old rows (device empty) and stores new events with their device."""
    path = tmp_path / "old.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    with engine.begin() as connection:  # the table as the previous version created it
        connection.execute(sqlalchemy.text(
            "CREATE TABLE worker_events (id INTEGER PRIMARY KEY, experiment VARCHAR(80), worker INTEGER, "
            "incarnation VARCHAR(16), state VARCHAR(20), round INTEGER, resumed_from INTEGER, detail TEXT, "
            "at FLOAT)"))
        connection.execute(sqlalchemy.text(
            "INSERT INTO worker_events (experiment, worker, incarnation, state, round, detail, at) "
            "VALUES ('m1', 0, 'a', 'ready', 0, '', 1.0)"))
    engine.dispose()
    store = MetricsStore(f"sqlite:///{path}")
    store.record_worker(WorkerEvent(deployment="d", experiment="m1", worker=0, incarnation="a", state="running",
                                    round=1, device="cpu"))
    assert [(e["state"], e["device"]) for e in store.worker_events("m1")] == [("ready", ""), ("running", "cpu")]
    assert MetricsStore(f"sqlite:///{path}").worker_events("m1")[1]["device"] == "cpu"  # opened again: as it was


def test_a_read_token_guards_the_metrics_reads_but_not_probes_prometheus_or_the_page(store: MetricsStore) -> None:
    with TestClient(create_app(store, "memory://", read_token="reader", api_token="writer")) as client:
        for path in ("/experiments/m1/summary", "/experiments/m1/metrics", "/ui/api/scores", "/ui/api/overview/m1"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers={"Authorization": "Bearer reader"}).status_code == 200, path
            assert client.get(path, headers={"Authorization": "Bearer writer"}).status_code == 200, path
        with client.stream("GET", "/experiments/m1/events?access_token=reader") as events:  # a browser's EventSource
            assert events.status_code == 200 and "event: summary" in "".join(events.iter_text())
        for path in ("/livez", "/metrics", "/ui", "/ui/static/app.js"):
            assert client.get(path).status_code == 200, path


def test_failed_clients_are_left_out_of_the_summary(store: MetricsStore) -> None:
    store.record_experiment(ExperimentEvent(deployment="d", experiment="m1", status="completed", config=CFG,
                                            failed_clients=[1, 3], at=1010.0))
    with TestClient(create_app(store, "memory://")) as client:
        summary = client.get("/experiments/m1/summary").json()
    assert summary["failed_clients"] == [1, 3] and summary["clients"] == 2
    assert summary["test_accuracy"] == pytest.approx((0.7 + 0.9) / 2)


def test_history_sse_and_prometheus(store: MetricsStore) -> None:
    with TestClient(create_app(store, "memory://")) as client:
        metrics = client.get("/experiments/m1/metrics").json()
        assert [h["round"] for h in metrics["history"]] == [1, 2]
        assert metrics["history"][0]["bytes_sent_per_client"] == pytest.approx(100.0)
        assert metrics["history"][1]["cluster_accuracy"] == [pytest.approx(0.7), pytest.approx(0.9)]
        with client.stream("GET", "/experiments/m1/events") as events:
            body = "".join(events.iter_text())
        assert body.index("event: progress") < body.index("event: status") < body.index("event: summary")
        text = client.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    m1 = (("experiment", "m1"),)
    assert samples[("dfca_experiment_round", m1)] == 2.0
    assert samples[("dfca_worker_round", (("experiment", "m1"), ("worker", "1")))] == 2.0
    assert samples[("dfca_messages_rejected_total", (("experiment", "m1"), ("reason", "spoofed")))] == 2.0
    assert samples[("dfca_messages_dead_lettered_total", m1)] == 1.0
    assert samples[("dfca_messages_applied_total", m1)] == 15.0
    assert samples[("dfca_messages_republished_total", m1)] == 4.0
    assert samples[("dfca_cluster_accuracy", (("cluster", "1"), ("experiment", "m1")))] == pytest.approx(0.9)
    assert samples[("dfca_experiment_status", (("experiment", "m1"), ("status", "completed")))] == 1.0
    # where each worker's round loop went, summed over its incarnations (worker 1: "a" ran round 1, "b" round 2)
    phase = (("experiment", "m1"), ("phase", "train"), ("worker", "1"))
    assert samples[("dfca_worker_phase_seconds_total", phase)] == pytest.approx(0.5 + 0.25)
    assert samples[("dfca_worker_phase_cpu_seconds_total", phase)] == pytest.approx(0.4 + 0.2)
    assert samples[("dfca_worker_phase_cpu_seconds_total", (("experiment", "m1"), ("phase", "loop"),
                                                             ("worker", "0")))] == pytest.approx(2 * 0.9)


def test_forged_reports_are_dead_lettered_and_the_service_keeps_answering(tmp_path: Path) -> None:
    """Reports that no worker of the run can send (a round beyond the run, unequal lists, an accuracy above 1,
    NaN) are refused and dead-lettered; the honest history, the summary and /metrics stay as they were."""
    broker = InMemoryBroker()
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    collector = MetricsCollector(InMemoryTransport(broker), store, "d")
    collector.open()
    try:
        publisher = InMemoryTransport(broker)

        def publish(document: Any) -> None:
            body = document if isinstance(document, bytes) else encode(document)
            publisher.publish(topics.METRICS_EXCHANGE, topics.metrics_key("d", "m1", "round"), body)

        publish(ExperimentEvent(deployment="d", experiment="m1", status="running", config=CFG, at=1000.0))
        publish(report(0, 1))
        publish(report(0, 999, evaluate=False))  # the run has 2 rounds
        lopsided = report(1, 1).model_dump()
        lopsided["evaluation"]["test_accuracy"] = [0.5]
        above = report(1, 1).model_dump()
        above["evaluation"]["test_accuracy"] = [1.5, 0.9]
        for forged in (lopsided, above):
            publish(json.dumps(forged).encode())
        publish(json.dumps(report(1, 1).model_dump()).replace('"seconds": 2.0', '"seconds": NaN').encode())
        publish(report(1, 1))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (collector.consumer.rejected < 4 or collector.consumer.handled < 3):
            time.sleep(0.05)
        assert collector.consumer.rejected == 4 and collector.consumer.handled == 3
        while time.monotonic() < deadline and not store.dead_letter_counts().get("m1"):
            time.sleep(0.05)
        assert store.dead_letter_counts()["m1"] == 4
        with TestClient(create_app(store, "memory://")) as client:
            summary = client.get("/experiments/m1/summary")
            assert summary.status_code == 200 and summary.json()["messages"]["dead_lettered"] == 4
            assert [h["round"] for h in client.get("/experiments/m1/metrics").json()["history"]] == [1]
            assert client.get("/metrics").status_code == 200
    finally:
        collector.close()


def test_event_streams_are_limited_per_client(tmp_path: Path) -> None:
    """A client cannot open event streams without bound: past the limit it gets 429 until it closes one."""
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    store.record_experiment(ExperimentEvent(deployment="d", experiment="m1", status="running", config=CFG, at=1.0))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(store, "memory://"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/experiments/m1/events"
    try:
        with httpx.Client(timeout=10) as client, ExitStack() as streams:
            opened = [streams.enter_context(client.stream("GET", url)) for _ in range(MAX_STREAMS_PER_CLIENT)]
            assert all(r.status_code == 200 for r in opened)
            refused = client.get(url)
            assert refused.status_code == 429 and "too many open event streams" in refused.text
            opened[0].close()
            deadline = time.monotonic() + 10
            while (again := client.get(url, timeout=2)) and again.status_code == 429 and time.monotonic() < deadline:
                time.sleep(0.2)
    except httpx.ReadTimeout:
        again = None  # the stream was accepted and is open: a 200 whose body never ends while the run goes on
    finally:
        server.should_exit = True
        thread.join(5)
    assert again is None or again.status_code == 200


def commits_of(store: MetricsStore) -> list[int]:
    """A list that grows by one at every commit of the store's database."""
    commits: list[int] = []
    sqlalchemy.event.listen(store.engine, "commit", lambda _conn: commits.append(1))
    return commits


def test_writes_inside_one_batch_commit_once_and_all_or_nothing(tmp_path: Path) -> None:
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    commits = commits_of(store)
    running = WorkerEvent(deployment="d", experiment="m1", worker=0, incarnation="a", state="running", round=1)
    with store.writes():
        store.record_experiment(ExperimentEvent(deployment="d", experiment="m1", status="running", config=CFG))
        for worker in (0, 1):
            store.record_round(report(worker, 1))
        store.record_round(report(0, 1))  # redelivered inside the same batch: still stored once
        store.record_worker(running)
        store.record_worker(running)  # a heartbeat repeating the state
        store.record_dead_letters([("m1", "dfca.models", "m1.3.0")])
    assert len(commits) == 1
    assert [(r.worker, r.round) for r in store.reports("m1")] == [(0, 1), (1, 1)]
    assert [e["state"] for e in store.worker_events("m1")] == ["running"] and store.dead_letters("m1") == 1
    finished = running.model_copy(update={"state": "finished", "round": 2})
    with pytest.raises(RuntimeError), store.writes():
        store.record_round(report(0, 2))
        store.record_worker(finished)
        raise RuntimeError("the batch fails")
    assert [r.round for r in store.reports("m1")] == [1, 1]  # nothing of the failed batch
    store.record_worker(finished)  # not taken for stored: the failed batch's state change is written now
    assert [e["state"] for e in store.worker_events("m1")] == ["running", "finished"]


def test_the_collector_stores_events_that_arrive_together_in_one_commit_and_refuses_only_the_bad_one(
        tmp_path: Path) -> None:
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    collector = MetricsCollector(InMemoryTransport(), store, "d")
    commits = commits_of(store)
    refusals = collector.on_events([
        ExperimentEvent(deployment="d", experiment="m1", status="running", config=CFG),
        report(0, 1), report(0, 999, evaluate=False), report(1, 1),  # the run has 2 rounds
    ])
    assert [type(r).__name__ if r else None for r in refusals] == [None, None, "EventRefused", None]
    assert len(commits) == 1 and [r.round for r in store.reports("m1")] == [1, 1]


def test_a_batch_its_handler_cannot_take_is_handled_again_one_by_one() -> None:
    """QueueConsumer with handle_many: what is there at once goes to it together; if it fails, each document goes
    to the one-by-one handler, which sets aside only the one it cannot take."""
    transport = InMemoryTransport()
    transport.declare_exchange(topics.METRICS_EXCHANGE)
    transport.declare_queue("q")
    transport.bind("q", topics.METRICS_EXCHANGE, "#")
    batches: list[list[int]] = []
    handled: list[int] = []

    def handle_many(documents: list[int]) -> list[Exception | None]:
        batches.append(documents)
        if 3 in documents:
            raise RuntimeError("the store is down for this batch")
        return [None] * len(documents)

    def handle(document: int) -> None:
        if document == 3:
            raise RuntimeError("this one cannot be stored")
        handled.append(document)

    consumer = QueueConsumer(transport, "q", json.loads, handle, lambda _d: "metrics", handle_many=handle_many,
                             batch=2)
    for document in (1, 2, 3, 4, 5):
        transport.publish(topics.METRICS_EXCHANGE, "k", json.dumps(document).encode())
    assert consumer.poll(0.0) == 5
    assert batches == [[1, 2], [3, 4]]  # at most `batch` together (one left over: on its own)
    assert handled == [4, 5]  # the failed batch again one by one: 3 set aside, 4 stored; then 5
    assert consumer.handled == 4 and consumer.rejected == 1
    assert transport.receive("q", 0.0) is None  # each settled: acked or dead-lettered


def test_documents_that_come_a_little_apart_share_a_batch_within_the_linger() -> None:
    """A round's reports come from each worker a few ms apart: with `linger` the consumer waits for the next one
    before handling what it has, so they go to `handle_many` (one store transaction) together."""
    transport = InMemoryTransport()
    transport.declare_exchange(topics.METRICS_EXCHANGE)
    transport.declare_queue("q")
    transport.bind("q", topics.METRICS_EXCHANGE, "#")
    batches: list[list[int]] = []

    def handle_many(documents: list[int]) -> list[Exception | None]:
        batches.append(documents)
        return [None] * len(documents)

    consumer = QueueConsumer(transport, "q", json.loads, batches.append, lambda _d: "metrics",
                             handle_many=handle_many, batch=10, linger=1.0)

    def publish_apart() -> None:
        for document in (1, 2, 3):
            transport.publish(topics.METRICS_EXCHANGE, "k", json.dumps(document).encode())
            time.sleep(0.05)

    publisher = threading.Thread(target=publish_apart)
    publisher.start()
    assert consumer.poll(5.0) == 3
    publisher.join()
    assert batches == [[1, 2, 3]] and consumer.handled == 3
