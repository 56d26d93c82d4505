"""The distributed runtime against a real RabbitMQ: services as OS processes, driven over REST.

- end to end through `dfca up` (3 workers), with bad input published straight to the broker;
- synchronous batch mode equals the simulator (final models allclose);
- a malformed message on every exchange does not change a run;
- a worker, the topology and the metrics service SIGKILLed in turn and restarted lose nothing; a worker killed for
  good is reported;
- a stop in the first round stops the work (worker CPU measured) and releases the queues.
The broker restart is in test_broker_least_privilege.py (a private node, per-principal users).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pika
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from runtime_fixtures import (
    TOKEN,
    Api,
    free_port,
    free_port_block,
    log_tails,
    rotated_mnist,
    running_stack,
    total_rounds,
)
from safetensors import safe_open
from safetensors.torch import load_file, save

from dfca.algorithms import schedule_of
from dfca.cli.launcher import Stack
from dfca.config import ExperimentConfig
from dfca.graph import build_graph
from dfca.identity import principals, topics
from dfca.identity.principals import host_of
from dfca.identity.sharding import clients_of
from dfca.models.build import build_model
from dfca.simulator import simulate
from dfca.wire.codec import CHECKSUM, WIRE_VERSION, Envelope, TensorSpec, checksum, encode_message

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

WORKERS = 3  # every stack here runs 3 workers
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ACCURACY_BAR = 0.85
ARI_BAR = 0.95


@pytest.fixture(scope="module")
def stack(rabbitmq_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One supervised 3-worker stack shared by the equivalence and fault tests of this module; its services may
    import the model factories under examples/ (DFCA_MODEL_FACTORIES)."""
    with running_stack(tmp_path_factory.mktemp("stack"), rabbitmq_url, model_factories=str(EXAMPLES)) as running:
        yield running


@pytest.fixture(scope="module")
def simulated() -> dict[str, Any]:
    """The embedded run of the fault tests' config: the unfaulted reference."""
    return simulate(ExperimentConfig.model_validate(rotated_mnist())).summary


# -- bad input, published with plain pika -------------------------------------------------------------------
def bad_model_messages(experiment: str, sender: int, impostor: int) -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(reason, routing key, body, headers): garbage, wrong shapes, NaN weights, spoofed sender; each a seed
    candidate of round 1 (a seeding round of the default DFCA), so only its payload or sender is wrong."""
    assert schedule_of(ExperimentConfig.model_validate(rotated_mnist())).seeding(1) is not None
    shapes = build_model("mlp", (1, 28, 28), 64, 10).shapes()
    spec = {**{n: TensorSpec(s) for n, s in shapes.items()}, "score": TensorSpec((), "float64"),
            "origin": TensorSpec((), "int64")}
    key = topics.model_key(experiment, host_of(sender, WORKERS), sender, 0)

    def candidate(fill: float, claimed_sender: int) -> dict[str, torch.Tensor]:
        return {**{n: torch.full(s, fill) for n, s in shapes.items()}, "score": torch.tensor(0.5, dtype=torch.float64),
                "origin": torch.tensor(claimed_sender)}

    def headers(body: bytes) -> dict[str, str]:
        return {"experiment": experiment, "sender": str(sender), "round": "1", "exchange": "seed", "step": "0",
                "part": "0", CHECKSUM: checksum(body), "dtype": "float32", "version": WIRE_VERSION}

    garbage = os.urandom(4096)
    wrong = save({name: torch.zeros(3, 3) for name in shapes})
    nan = save(candidate(math.nan, sender))
    real, real_headers = encode_message(Envelope(experiment, impostor, 1, "seed", 0, 0, candidate(0.0, impostor)), spec)
    return [
        ("decode", key, garbage, headers(garbage)),
        ("shape", key, wrong, headers(wrong)),
        ("non_finite", key, nan, headers(nan)),
        ("spoofed", key, real, real_headers),  # headers say `impostor`, the routing key says `sender`
    ]


def publish_raw(url: str, messages: list[tuple[str, str, bytes, dict[str, str]]]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for exchange, key, body, headers in messages:
            channel.basic_publish(exchange, key, body, pika.BasicProperties(headers=headers, delivery_mode=2))
    finally:
        connection.close()


# -- end to end ---------------------------------------------------------------------------------------------
def test_end_to_end_over_rest_with_bad_input(rabbitmq_url: str, tmp_path: Path) -> None:
    topology_port, metrics_port = free_port(), free_port()
    env = {**os.environ, "DFCA_API_TOKEN": TOKEN, "DFCA_BROKER_URL": rabbitmq_url}
    up = subprocess.Popen(
        [sys.executable, "-m", "dfca.cli", "up", "--workers", "3", "--topology-port", str(topology_port),
         "--metrics-port", str(metrics_port), "--worker-port-base", str(free_port_block(3)),
         "--state-dir", str(tmp_path), "--log-files", "--insecure-shared-broker-user"],  # the shared test node
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert up.stdout is not None
    printed: list[str] = []  # dfca up's output, read as it comes
    reader = threading.Thread(target=printed.extend, args=(iter(up.stdout.readline, ""),), daemon=True)
    reader.start()
    api = Api(f"http://127.0.0.1:{topology_port}", f"http://127.0.0.1:{metrics_port}")
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("dfca up: ready:") for line in list(printed)):  # what a user waits for
            assert up.poll() is None and time.monotonic() < deadline, f"dfca up did not come up: {printed}"
            time.sleep(0.2)
        assert ready(api)  # the ready line comes once every process is known to the topology service
        known = api.topology.get("/deployment").json()
        assert known["workers"] == 3 and known["workers_present"] == [0, 1, 2], known

        # the REST contract: 401 without the token, 422 naming the field, 404 for an unknown id
        anonymous = httpx.post(f"http://127.0.0.1:{topology_port}/experiments", json=rotated_mnist())
        assert anonymous.status_code == 401
        invalid = api.topology.post("/experiments", json=rotated_mnist(clusters=0))
        assert invalid.status_code == 422
        assert any("clusters" in error["loc"] for error in invalid.json()["detail"])
        typo = api.topology.post("/experiments", json={**rotated_mnist(), "roundz": 3})
        assert typo.status_code == 422 and any("roundz" in error["loc"] for error in typo.json()["detail"])
        assert api.topology.get("/experiments/nope-123").status_code == 404
        assert api.topology.post("/experiments/nope-123:start").status_code == 404
        assert api.metrics.get("/experiments/nope-123/summary").status_code == 404

        cfg = rotated_mnist(name="e2e")
        experiment = api.create_and_start(cfg)
        api.wait_round(experiment, 1)
        graph = build_graph(ExperimentConfig.model_validate(cfg).topology, 24, 0)
        sender = max(graph.nodes, key=graph.degree)  # its bad models reach the most clients
        impostor = next(c for c in graph.nodes if c != sender)
        bad = bad_model_messages(experiment, sender, impostor)
        deployment = topics.deployment_tag(f"http://127.0.0.1:{topology_port}")  # the stack's (DFCA_TOPOLOGY_URL)
        publish_raw(rabbitmq_url, [(topics.MODELS_EXCHANGE, key, body, h) for _, key, body, h in bad]
                    + [(topics.CONTROL_EXCHANGE, topics.control_key(deployment, experiment, "start"),
                        b"\x00not json", {})])

        final = api.wait_finished(experiment)
        assert final["status"] == "completed", final
        assert final["failed_clients"] == []
        summary = api.summary(experiment)
        assert summary["clients"] == 24 and summary["rounds_completed"] == total_rounds(cfg)
        assert summary["cluster_ari"] >= ARI_BAR, summary
        assert summary["test_accuracy"] >= ACCURACY_BAR, summary
        messages = summary["messages"]
        for reason, *_ in bad:  # every kind of bad model was rejected by at least one client, nothing crashed
            assert messages["rejected"].get(reason, 0) >= 1, messages
        assert messages["rejected_total"] <= 4 * graph.degree(sender)
        assert messages["dead_lettered"] >= messages["rejected_total"] + 1  # + the garbage control message
        assert messages["applied"] > 0 and messages["timeouts"] == 0

        history = api.metrics.get(f"/experiments/{experiment}/metrics").json()["history"]
        assert [h["round"] for h in history] == list(range(1, total_rounds(cfg) + 1))
        prometheus = api.metrics.get("/metrics").text
        assert f'dfca_messages_rejected_total{{experiment="{experiment}",reason="spoofed"}}' in prometheus
        assert f'dfca_experiment_round{{experiment="{experiment}"}} {float(total_rounds(cfg))}' in prometheus
        cpu = {s.labels["worker"]: s.value for family in text_string_to_metric_families(prometheus)
               for s in family.samples if s.name == "dfca_worker_phase_cpu_seconds_total"
               and s.labels["experiment"] == experiment and s.labels["phase"] == "train"}
        assert sorted(cpu) == ["0", "1", "2"] and all(v > 0 for v in cpu.values()), cpu  # each worker trained
        with api.metrics.stream("GET", f"/experiments/{experiment}/events") as events:
            body = "".join(events.iter_text())
        assert "event: status" in body and "event: summary" in body
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        reader.join(10)
        output = "".join(printed)
        if up.returncode != 0:
            print(output[-3000:], log_tails(tmp_path))
    assert up.returncode == 0, "dfca up did not stop cleanly on SIGTERM"
    assert not ready(api), "services still answer after dfca up stopped"


def ready(api: Api) -> bool:
    try:
        return api.topology.get("/readyz").status_code == 200 and api.metrics.get("/readyz").status_code == 200
    except httpx.HTTPError:
        return False


# -- equivalence --------------------------------------------------------------------------------------------
def poison_on_every_exchange(deployment: str, experiment: str) -> list[tuple[str, str, bytes, dict[str, str]]]:
    """One message per exchange whose chunk headers cannot be valid (part 5 of 1): it used to raise inside the
    transport's delivery callback, abort the connection and come back for good."""
    pill = {"x-chunk-id": "pill", "x-chunk-index": "5", "x-chunk-count": "1"}
    return [(topics.MODELS_EXCHANGE, topics.model_key(experiment, host_of(client, WORKERS), client, 0), b"pill", pill)
            for client in range(12)] \
        + [(topics.CONTROL_EXCHANGE, topics.control_key(deployment, experiment, "stop"), b"pill", pill),
           (topics.METRICS_EXCHANGE, topics.metrics_key(deployment, experiment, "round"), b"pill", pill),
           (topics.DEAD_LETTER_EXCHANGE, f"{experiment}.pill", b"pill", pill)]


def test_synchronous_batch_run_matches_the_simulator_through_poison_messages(stack: Stack, rabbitmq_url: str) -> None:
    """A malformed message on every exchange during the run is dead-lettered once and the run ends exactly where
    the simulator does (no reconnect loop, nothing lost, no round timed out)."""
    cfg = rotated_mnist(name="equiv", aggregation="batch", rounds=4, seed=5,
                        data={"clients": 12, "train_per_client": 40},
                        runtime={"round_timeout": 120.0, "payload_dtype": "float32"})  # exact: no rounding to flip
    api = Api.of(stack)
    experiment = api.create_and_start(cfg)
    api.wait_round(experiment, 1)
    publish_raw(rabbitmq_url, poison_on_every_exchange(topics.deployment_tag(stack.options.topology_url),
                                                       experiment))
    assert api.wait_finished(experiment)["status"] == "completed"
    summary = api.summary(experiment)
    assert summary["messages"]["timeouts"] == 0
    assert summary["messages"]["dead_lettered"] >= 12  # each pill, once per queue it reached
    logs = "".join(p.read_text(errors="replace") for p in (stack.options.state_dir / "logs").glob("*.log"))
    assert "cannot be taken apart" in logs and "lost its connection" not in logs
    sim = simulate(ExperimentConfig.model_validate(cfg))
    for ordinal in range(3):
        path = stack.options.state_dir / "checkpoints" / experiment / f"{ordinal}.safetensors"
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        clients = json.loads(meta["clients"])
        assert clients == clients_of(ordinal, 3, 12) and int(meta["round"]) == total_rounds(cfg) - 1
        tensors = load_file(str(path))
        for name, simulated_params in sim.algorithm.params.items():
            torch.testing.assert_close(tensors[f"params.{name}"], simulated_params[clients], rtol=1e-4, atol=1e-5)


def test_a_users_module_runs_on_every_worker_by_name_and_ends_where_the_simulator_ends(stack: Stack) -> None:
    """`model.kind: torch` over RabbitMQ: the config carries the factory's name (a file under the allowed examples/
    folder); every worker imports it, trains its clients' copies, sends state_dict-named tensors, and the run ends
    at the simulator's models. A factory outside DFCA_MODEL_FACTORIES is refused with 422 before any worker trains."""
    api = Api.of(stack)
    outside = rotated_mnist(name="refused", model={"kind": "torch", "factory": "os:getcwd"})
    refused = api.topology.post("/experiments", json=outside)
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "model.factory"], refused.text
    factory = f"{EXAMPLES / 'tabular_mlp' / 'model.py'}:make"
    cfg = rotated_mnist(name="module", aggregation="batch", rounds=3, seed=5,
                        data={"clients": 12, "train_per_client": 40},
                        model={"kind": "torch", "factory": factory, "options": {"hidden": 32, "dropout": 0.0}},
                        dfca={"variant": "paper"}, runtime={"round_timeout": 120.0, "payload_dtype": "float32"})
    experiment = api.create_and_start(cfg)
    assert api.wait_finished(experiment)["status"] == "completed"
    summary = api.summary(experiment)
    assert summary["messages"]["timeouts"] == 0 and summary["messages"]["rejected_total"] == 0, summary
    sim = simulate(ExperimentConfig.model_validate(cfg))
    assert set(sim.algorithm.params) == {"1.weight", "1.bias", "2.weight", "2.bias", "5.weight", "5.bias",
                                         "6.weight", "6.bias", "9.weight", "9.bias"}
    for ordinal in range(3):
        path = stack.options.state_dir / "checkpoints" / experiment / f"{ordinal}.safetensors"
        tensors = load_file(str(path))
        clients = clients_of(ordinal, 3, 12)
        for name, simulated_params in sim.algorithm.params.items():
            torch.testing.assert_close(tensors[f"params.{name}"], simulated_params[clients], rtol=1e-3, atol=1e-4)


# -- faults -------------------------------------------------------------------------------------------------
def test_worker_topology_and_metrics_killed_midway_lose_nothing(stack: Stack, simulated: dict[str, Any]) -> None:
    """SIGKILL a worker, then the topology service, then the metrics service, during one run: each comes back (as
    Kubernetes would restart it), the worker resumes from its checkpoint, the run completes with the unfaulted
    accuracy, and the metrics history has every round."""
    cfg = rotated_mnist(name="restart")
    api = Api.of(stack)
    experiment = api.create_and_start(cfg)
    api.wait_round(experiment, 4)  # round 4 of 18: in or just after the 8 seeding rounds
    for service, next_round in (("worker-1", 6), ("topology", 9), ("metrics", None)):
        old_pid = stack.services[service].pid
        stack.kill(service, signal.SIGKILL)  # the supervisor starts it again, like Kubernetes
        stack.wait_ready(timeout=90, names=[service])
        assert stack.services[service].pid != old_pid
        if next_round is not None:
            api.wait_round(experiment, next_round)
    final = api.wait_finished(experiment)
    assert final["status"] == "completed" and final["failed_clients"] == [], final
    restarted = final["worker_states"]["1"]  # (the restarted topology service counts incarnations afresh)
    assert restarted["resumed_from"] is not None and restarted["resumed_from"] >= 3, \
        "the restarted worker should resume from its checkpoint, not round 0"
    rounds = total_rounds(cfg)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the restarted metrics service catches up from its durable queue
        history = api.metrics.get(f"/experiments/{experiment}/metrics").json()["history"]
        if len(history) == rounds:
            break
        time.sleep(0.5)
    assert [h["round"] for h in history] == list(range(1, rounds + 1))
    summary = api.summary(experiment)
    assert summary["clients"] == 24 and summary["resumed_from"] == {"1": restarted["resumed_from"]}
    assert abs(summary["test_accuracy"] - simulated["test_accuracy"]) <= 0.02, (summary, simulated)
    assert summary["cluster_ari"] >= ARI_BAR


def test_a_worker_paused_past_the_run_is_reported_and_leaves_cleanly_when_it_comes_back(stack: Stack,
                                                                                         rabbitmq_url: str) -> None:
    """SIGSTOP a worker at round 3: to the others it is dead (no heartbeat, no messages), so the run completes
    without its clients and says so. SIGCONT after the run: the worker finds the experiment over, reports
    `stopped`, and deletes the client queues its reconnect declared again (they used to stay on the broker)."""
    cfg = rotated_mnist(name="lost")
    api = Api.of(stack)
    experiment = api.create_and_start(cfg)
    api.wait_round(experiment, 3)
    paused = stack.services["worker-2"].pid
    assert paused is not None
    os.kill(paused, signal.SIGSTOP)
    try:
        final = api.wait_finished(experiment)
    finally:
        os.kill(paused, signal.SIGCONT)
    lost = clients_of(2, WORKERS, 24)
    assert final["status"] == "completed", final
    assert final["failed_clients"] == lost
    assert final["worker_states"]["2"]["state"] == "dead"
    rounds = total_rounds(cfg)
    assert all(final["worker_states"][w]["state"] == "finished" and final["worker_states"][w]["round"] == rounds
               for w in ("0", "1"))
    summary = api.summary(experiment)
    assert summary["failed_clients"] == lost and summary["clients"] == 24 - len(lost)
    assert summary["messages"]["timeouts"] >= 1  # the neighbours waited for the lost clients, then carried on
    assert summary["cluster_ari"] >= ARI_BAR
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # it wakes mid-round, finds its queues gone, reconnects, then asks
        status = httpx.get(f"http://127.0.0.1:{stack.services['worker-2'].port}/status", timeout=5).json()
        if status["experiments"][experiment]["state"] != "running":
            break
        time.sleep(1.0)
    assert status["experiments"][experiment]["state"] == "stopped", status
    assert queues_of(rabbitmq_url, experiment) == [], "the returning worker left its queues behind"
    assert stack.services["worker-2"].pid == paused  # the same process came back: nothing restarted it


# -- stop means stop ------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks of 1/100 s


def queues_of(url: str, experiment: str) -> list[str]:
    """The experiment's worker queues that still exist (a passive declare of each worker's queue)."""
    left = []
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        for ordinal in range(WORKERS):
            channel = connection.channel()
            try:
                channel.queue_declare(topics.worker_queue(experiment, principals.worker(ordinal)), passive=True)
                left.append(str(ordinal))
                channel.close()
            except pika.exceptions.ChannelClosedByBroker:
                pass
    finally:
        connection.close()
    return left


def test_a_stop_in_the_first_round_stops_the_work(stack: Stack, rabbitmq_url: str) -> None:
    """Stopped in its first round, an experiment ends on every worker within that round: each reports it
    stopped, goes idle (CPU from /proc) and the experiment's queues are gone."""
    stack.wait_ready(timeout=90)
    api = Api.of(stack)
    # a first round of seconds: seeding trains each client's local model for 60 epochs of 400 images
    cfg = rotated_mnist(name="stop", rounds=50, model={"kind": "mlp", "hidden": 512},
                        data={"train_per_client": 400}, dfca={"seed_epochs": 60})
    experiment = api.create_and_start(cfg)
    workers = [stack.services[f"worker-{i}"] for i in range(3)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the workers are computing: stop now, inside round 0
        if all(w.pid and cpu_seconds(w.pid) > 0 for w in workers) and api.experiment(experiment)["status"] == \
                "running":
            break
        time.sleep(0.2)
    time.sleep(1.0)
    assert api.experiment(experiment)["round"] == 0
    assert api.topology.post(f"/experiments/{experiment}:stop").status_code == 200
    api.wait_until(experiment, lambda s: s["status"] == "stopped", 30, "stopped")
    for i in range(len(workers)):
        status = api_status(stack.options.worker_port_base + i)
        assert status["experiments"][experiment]["state"] == "stopped", status
    time.sleep(1.0)
    before = {w.name: cpu_seconds(w.pid) for w in workers if w.pid}
    time.sleep(5.0)
    burnt = {name: cpu_seconds(w.pid) - before[name] for name, w in zip(before, workers, strict=True)}
    assert all(seconds < 0.5 for seconds in burnt.values()), f"CPU seconds in 5 s after the stop: {burnt}"
    assert queues_of(rabbitmq_url, experiment) == []


def api_status(port: int) -> dict:
    return dict(httpx.get(f"http://127.0.0.1:{port}/status", timeout=10).json())


def test_a_stacks_service_queues_are_deleted_when_it_ends(rabbitmq_url: str, tmp_path: Path) -> None:
    """Every stack a test or a benchmark starts is a new deployment (free ports): the queues its services declared
    for themselves (events, control, the dead-letter tap) are there while it runs, and gone after running_stack
    stops it (Stack.delete_service_queues), instead of staying on the shared broker for 6 hours."""
    def exists(name: str) -> bool:
        connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        try:
            connection.channel().queue_declare(name, passive=True)
            return True
        except pika.exceptions.ChannelClosedByBroker:
            return False
        finally:
            if connection.is_open:
                connection.close()

    with running_stack(tmp_path, rabbitmq_url, workers=2) as running:
        deployment = topics.deployment_tag(running.options.topology_url)
        names = topics.service_queues(deployment, 2)
        there = {name for name in names if exists(name)}
    assert there == set(names) - {topics.aggregator_control_queue(deployment)}  # this stack has no aggregator
    assert not any(exists(name) for name in names)
