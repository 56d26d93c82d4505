"""Least privilege on the broker: one user per principal (dfca.identity.broker_users), publishers proven by the broker.

A private RabbitMQ node boots with the principals' users from `dfca.identity.broker_users.definitions` (as a
Compose broker does); one of them is re-passworded with the `rabbitmqctl` commands of
`python -m dfca.identity.broker_users create`. With one worker's own credentials a compromised worker
tries the attacks measured with the shared credentials (docs/security.md): the broker refuses a model key
claiming another worker's client, a control command, an experiment's status, a forged `user_id`, and any use of another
worker's queues; what the broker cannot tell apart (a worker's event about another worker, a model of a
client the key's host does not host) the receivers reject. A whole run on per-principal users completes with
the honest result while the forger works and the broker restarts midway.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pika
import pika.exceptions
import pytest
import torch
from rabbitmq_node import RabbitMQNode, RabbitMQNodeError, server_bin_dir
from runtime_fixtures import Api, rotated_mnist, running_stack, total_rounds

from dfca.config import ExperimentConfig
from dfca.identity import principals, topics
from dfca.identity.broker_setup import VHOST, ensure_broker_topology
from dfca.identity.broker_users import (
    definitions,
    permissions_of,
    principal_url,
    principals_of,
    rabbitmqctl_commands,
    read_urls,
    write_urls,
)
from dfca.identity.sharding import clients_of
from dfca.results.evaluation import cluster_ari
from dfca.runtime.driver.admission import BLOCK_AFTER_INVALID
from dfca.runtime.protocol.messages import StopCommand, WorkerEvent, encode
from dfca.simulator import simulate
from dfca.transport import RabbitMQTransport, TransportError

WORKERS = 3


def allowed(regex: str, name: str) -> bool:
    """RabbitMQ matches permission regexes unanchored (ours anchor themselves)."""
    return re.search(regex, name) is not None


# -- the permissions, without a broker ----------------------------------------------------------------------
def test_each_principal_may_touch_its_own_names_and_no_one_elses() -> None:
    exp, dep = "e1x", "d0123456789"
    w0, w1 = permissions_of("worker-0"), permissions_of("worker-1")
    own_queues = [topics.worker_queue(exp, "worker-0"), topics.worker_control_queue(dep, 0)]
    others = [topics.worker_queue(exp, "worker-1"), topics.worker_control_queue(dep, 1),
              topics.server_queue(exp), topics.events_queue(dep, "topology"), topics.DEAD_LETTER_QUEUE]
    for queue in own_queues:  # consumed, never declared, deleted or bound (binding needs write on the queue)
        assert allowed(w0.read, queue) and not allowed(w0.configure, queue) and not allowed(w0.write, queue), queue
    for queue in others:
        assert not any(allowed(r, queue) for r in (w0.configure, w0.write, w0.read)), queue
    for exchange in topics.EXCHANGES:  # no worker declares, deletes or binds from an exchange
        assert not allowed(w0.configure, exchange) and not allowed(w0.read, exchange), exchange
    assert not allowed(w0.write, topics.CONTROL_EXCHANGE) and allowed(w0.write, topics.MODELS_EXCHANGE)
    assert not allowed(w0.write, topics.DEAD_LETTER_EXCHANGE)
    assert w0.configure == "^$"  # no queue of any name
    models_write = w1.topics[topics.MODELS_EXCHANGE][0]
    assert allowed(models_write, topics.model_key(exp, "worker-1", 4, 0))
    assert not allowed(models_write, topics.model_key(exp, "worker-0", 3, 0))
    assert not allowed(models_write, topics.model_key(exp, "aggregator", topics.SERVER_SENDER, 0))
    events_write = w1.topics[topics.METRICS_EXCHANGE][0]
    assert allowed(events_write, topics.metrics_key(dep, exp, "round"))
    assert allowed(events_write, topics.presence_key(dep))
    assert not allowed(events_write, topics.metrics_key(dep, exp, "experiment"))
    assert allowed(permissions_of(principals.TOPOLOGY).topics[topics.METRICS_EXCHANGE][0],
                   topics.metrics_key(dep, exp, "experiment"))
    topology = permissions_of(principals.TOPOLOGY)
    assert allowed(topology.write, topics.CONTROL_EXCHANGE) and not allowed(topology.write, topics.MODELS_EXCHANGE)
    anyones = (topics.worker_queue(exp, "worker-1"), topics.server_queue(exp), topics.events_queue(dep, "topology"),
               topics.worker_control_queue(dep, 12))
    assert all(allowed(topology.configure, q) and allowed(topology.write, q) for q in anyones)
    assert allowed(topology.read, topics.CONTROL_EXCHANGE) and allowed(topology.read, topics.MODELS_EXCHANGE)
    metrics = permissions_of(principals.METRICS)
    assert not allowed(metrics.write, topics.METRICS_EXCHANGE) and allowed(metrics.read, topics.METRICS_EXCHANGE)
    aggregator = permissions_of(principals.AGGREGATOR)
    assert allowed(aggregator.topics[topics.MODELS_EXCHANGE][0],
                   topics.model_key(exp, "aggregator", topics.SERVER_SENDER, 1))
    assert not allowed(aggregator.topics[topics.MODELS_EXCHANGE][0], topics.model_key(exp, "worker-0", 3, 1))


def test_definitions_carry_every_principal_with_hashes_only(tmp_path: Path) -> None:
    passwords = {p: f"secret-{p}" for p in principals_of(2)}
    document = definitions(passwords)
    users = {u["name"] for u in document["users"]}
    assert users == {"dfca", *(principals.user_of(p) for p in passwords)}
    assert "secret-" not in json.dumps(document)
    assert {t["user"] for t in document["topic_permissions"]} >= {"dfca-worker-0", "dfca-worker-1"}
    urls = {p: principal_url(p, pw, "127.0.0.1", 5672) for p, pw in passwords.items()}
    write_urls(tmp_path / "users.json", urls)
    assert (tmp_path / "users.json").stat().st_mode & 0o077 == 0
    assert read_urls(tmp_path / "users.json") == urls
    (tmp_path / "bad.json").write_text('{"root": "amqp://x"}')
    with pytest.raises(ValueError, match="must map principals"):
        read_urls(tmp_path / "bad.json")


# -- on a broker ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def principal_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RabbitMQNode, dict[str, str]]]:
    """A private node that boots with the services' and workers 0-1's users from `definitions` (as Compose's broker
    does); worker 2's user is made with the `rabbitmqctl` commands
    `python -m dfca.identity.broker_users create` runs. (Not
    one of the definitions' users: a broker that loads definitions at boot resets their passwords on a restart.)"""
    if server_bin_dir() is None:
        pytest.fail("RabbitMQ is not installed (scripts/install_rabbitmq.sh)")
    passwords = {p: f"pw-{p}-0123456789" for p in principals_of(WORKERS - 1)}
    try:
        node = RabbitMQNode.start_new(tmp_path_factory.mktemp("principals"), definitions=definitions(passwords))
    except RabbitMQNodeError as err:
        pytest.fail(str(err))
    try:
        passwords["worker-2"] = "made-by-rabbitmqctl"
        for command in rabbitmqctl_commands("worker-2", passwords["worker-2"]):
            done = node.ctl(*command)
            assert done.returncode == 0 or command[0] == "add_user", (command, done.stderr)
        yield node, {p: principal_url(p, pw, "127.0.0.1", node.port) for p, pw in passwords.items()}
    finally:
        node.stop()


@pytest.fixture(scope="module")
def principal_urls(principal_node: tuple[RabbitMQNode, dict[str, str]]) -> dict[str, str]:
    return principal_node[1]


@pytest.fixture
def as_worker_1(principal_urls: dict[str, str]) -> Iterator[RabbitMQTransport]:
    transport = RabbitMQTransport(principal_urls["worker-1"], publish_timeout=10, name="forger")
    try:
        yield transport
    finally:
        transport.close()


pytestmark = [pytest.mark.rabbitmq]


def test_the_broker_refuses_what_a_worker_may_not_do(principal_node: tuple[RabbitMQNode, dict[str, str]],
                                                     as_worker_1: RabbitMQTransport, unique_id: str) -> None:
    principal_urls = principal_node[1]
    with RabbitMQTransport(principal_urls["topology"], name="topology") as topology:
        ensure_broker_topology(topology)  # the topology service's user declares exchanges and any worker's queue
        theirs = topics.worker_queue(unique_id, "worker-0")
        topology.declare_queue(theirs, topics.DEAD_LETTER_EXCHANGE, topics.MODEL_QUEUE_LIMITS)
        topology.bind(theirs, topics.MODELS_EXCHANGE, topics.neighbour_binding(unique_id, 1))
    forger = as_worker_1
    ensure_broker_topology(forger)  # refused (403) and tolerated: the exchanges are there
    assert forger.user == "dfca-worker-1"

    def refused(action: object, code: str = "403") -> None:
        with pytest.raises(TransportError, match=code):
            action()  # type: ignore[operator]

    # a model whose routing key claims worker 0's client
    refused(lambda: forger.publish(topics.MODELS_EXCHANGE, topics.model_key(unique_id, "worker-0", 0, 0), b"x"))
    # a control command: only the topology service publishes on dfca.control
    stop = encode(StopCommand(deployment="d0", experiment=unique_id))
    refused(lambda: forger.publish(topics.CONTROL_EXCHANGE, topics.control_key("d0", unique_id, "stop"), stop))
    # an experiment's status
    refused(lambda: forger.publish(topics.METRICS_EXCHANGE, topics.metrics_key("d0", unique_id, "experiment"),
                                   b"{}"))
    # another worker's queue: consume, delete, declare
    refused(lambda: forger.receive(theirs, 1.0))
    refused(lambda: forger.delete_queue(theirs))
    refused(lambda: forger.declare_queue(topics.worker_queue(unique_id + "b", "worker-0")))
    refused(lambda: forger.declare_exchange("dfca.mine"))
    # a queue under its own name for an experiment of its choosing, to bind to every key: no queue of any name, and
    # no binding of any queue, not even its own (the topology service makes a worker's bindings)
    mine = topics.worker_queue(unique_id + "x", "worker-1")
    refused(lambda: forger.declare_queue(mine, topics.DEAD_LETTER_EXCHANGE, topics.MODEL_QUEUE_LIMITS))
    refused(lambda: forger.declare_queue(topics.worker_control_queue("d0", 1), topics.DEAD_LETTER_EXCHANGE,
                                         topics.SERVICE_QUEUE_LIMITS))
    own = topics.worker_queue(unique_id, "worker-1")
    with RabbitMQTransport(principal_urls["topology"], name="topology") as topology:
        topology.declare_queue(own, topics.DEAD_LETTER_EXCHANGE, topics.MODEL_QUEUE_LIMITS)
    for exchange, key in ((topics.MODELS_EXCHANGE, topics.experiment_binding(unique_id)),
                          (topics.MODELS_EXCHANGE, topics.ALL_KEYS), (topics.CONTROL_EXCHANGE, topics.ALL_KEYS),
                          (topics.MODELS_EXCHANGE, topics.neighbour_binding(unique_id, 0))):
        refused(lambda exchange=exchange, key=key: forger.bind(own, exchange, key))
    refused(lambda: forger.delete_queue(own))
    # the dead-letter exchange: only the broker dead-letters
    refused(lambda: forger.publish(topics.DEAD_LETTER_EXCHANGE, topics.model_key(unique_id, "worker-1", 1, 0), b""))
    # its own client's model is accepted, and arrives with the broker-proven publisher
    forger.publish(topics.MODELS_EXCHANGE, topics.model_key(unique_id, "worker-1", 1, 0), b"mine")
    with RabbitMQTransport(principal_urls["worker-0"], name="worker-0") as worker_0:
        message = worker_0.receive(theirs, 10.0)
        assert message is not None and message.body == b"mine" and message.publisher == "dfca-worker-1"
        worker_0.reject(message)  # dead-lettered by the broker: a worker needs no right on the dead-letter exchange
    with RabbitMQTransport(principal_urls["topology"], name="topology") as topology:
        dead = topology.receive(topics.DEAD_LETTER_QUEUE, 10.0)
        while dead is not None and dead.body != b"mine":  # an earlier test's dead letters
            topology.ack(dead)
            dead = topology.receive(topics.DEAD_LETTER_QUEUE, 10.0)
        assert dead is not None and dead.publisher == "dfca-worker-1"
        topology.ack(dead)
        # every queue a worker can read has a length, a size and an expiry
        listed = principal_node[0].ctl("list_queues", "-p", VHOST, "name", "arguments", "--no-table-headers")
        arguments = {line.split("\t")[0]: line for line in listed.stdout.splitlines()}
        for queue in (theirs, own):
            assert all(limit in arguments[queue] for limit in ("x-max-length", "x-max-length-bytes", "x-expires"))
            topology.delete_queue(queue)
    # a user_id that is not the publisher's own: the broker closes the channel (406 PRECONDITION_FAILED)
    connection = pika.BlockingConnection(pika.URLParameters(principal_urls["worker-1"]))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="user_id property set to 'dfca-topology'"):
            channel.basic_publish(topics.MODELS_EXCHANGE, topics.model_key(unique_id, "worker-1", 1, 0), b"x",
                                  pika.BasicProperties(user_id="dfca-topology"))
    finally:
        connection.close()


def test_a_run_on_per_principal_users_ignores_a_compromised_worker_and_survives_a_broker_restart(
        principal_node: tuple[RabbitMQNode, dict[str, str]], as_worker_1: RabbitMQTransport, tmp_path: Path) -> None:
    """One 3-worker run, every process its own broker user, reads behind a read token: worker 1's credentials
    forge a stop, a `finished` event for worker 0 and models of worker 0's client, and flood junk under worker 1's
    own clients; then the broker restarts (its users and permissions persist). The run completes with the honest
    result and no process restarted."""
    private_rabbitmq, principal_urls = principal_node
    with running_stack(tmp_path, private_rabbitmq.url, workers=WORKERS, broker_users=principal_urls,
                       read_token="reader") as stack:
        api = Api.of(stack)  # it sends the API token, which reads too
        assert httpx.get(f"{stack.options.topology_url}/experiments").status_code == 401  # reads need a token
        # 60 rounds: the outage (after round 3) must fall inside the run on a fast machine too, where 8 rounds
        # (0.1-0.2 s each) ended before the broker went down (CI, 16bc1dd), and while this test's own process is
        # starved by a loaded machine (30 rounds ended before its poll saw round 3)
        cfg = rotated_mnist(name="least-privilege", rounds=60)
        experiment = api.create_and_start(cfg)
        api.wait_round(experiment, 1)
        deployment = topics.deployment_tag(stack.options.topology_url)
        forger = as_worker_1
        with pytest.raises(TransportError, match="403"):  # a forged stop never reaches a worker
            forger.publish(topics.CONTROL_EXCHANGE, topics.control_key(deployment, experiment, "stop"),
                           encode(StopCommand(deployment=deployment, experiment=experiment)))
        # worker 0 "finished" and a model "from" worker 0's client 0: the broker lets worker 1 publish them
        # under its own name; topology, metrics and the clients see who published them and reject them
        finished = WorkerEvent(deployment=deployment, experiment=experiment, worker=0, incarnation="forged",
                               state="finished", round=total_rounds(cfg))
        forger.publish(topics.METRICS_EXCHANGE, topics.metrics_key(deployment, experiment, "worker"),
                       encode(finished))
        for part in range(2):
            forger.publish(topics.MODELS_EXCHANGE, topics.model_key(experiment, "worker-1", 0, part), b"forged")
        # a junk flood under worker 1's own clients' keys: the broker lets it through, the receivers see who sent
        # it and cut those clients off after BLOCK_AFTER_INVALID malformed messages each in one round (a flood: the
        # messages go over together; a worker's queue gets each once, whichever of its clients hear the sender)
        junk = [(topics.MODELS_EXCHANGE, topics.model_key(experiment, "worker-1", client, 0), b"junk", None)
                for _ in range(2 * BLOCK_AFTER_INVALID) for client in clients_of(1, WORKERS, 24)]
        forger.publish_many(junk)

        api.wait_round(experiment, 3)
        private_rabbitmq.stop()
        try:
            during = api.experiment(experiment)  # REST works without the broker
            assert during["status"] == "running" and during["round"] < total_rounds(cfg), \
                ("the outage must fall in the run", during)
            time.sleep(3)  # a real outage: reconnect attempts fail for a while
        finally:
            private_rabbitmq.start()  # the module's node: the next test needs it up whatever happened here

        final = api.wait_finished(experiment, timeout=300)
        assert final["status"] == "completed" and final["failed_clients"] == [], final
        assert min(int(w["incarnations"]) for w in final["worker_states"].values()) == 1  # no process restarted
        summary = api.summary(experiment)
        assert summary["clients"] == 24 and summary["rounds_completed"] == total_rounds(cfg)
        # a third of the clients cut off from the others in whichever round the flood lands, and an outage whose
        # rounds time out: 0.848-0.882 over nine runs on the 2-core machine, ARI 1.00 in every one
        assert summary["cluster_ari"] >= 0.95 and summary["test_accuracy"] >= 0.83, summary
        assert summary["messages"]["rejected"].get("publisher", 0) >= 1, summary["messages"]
        assert summary["messages"]["blocked"] >= 1, summary["messages"]  # the flooded clients were cut off
        # the restarted broker lost the models it held in memory: their senders published them again
        assert summary["messages"]["republished"] >= 1, summary["messages"]
        for name in ("topology", "metrics"):
            assert "only worker-0 may publish it" in (tmp_path / "logs" / f"{name}.log").read_text(), name


def test_a_compromised_worker_hijacking_seeding_and_consensus_costs_the_honest_clients_at_most_3_points(
        principal_node: tuple[RabbitMQNode, dict[str, str]], tmp_path: Path) -> None:
    """Worker 1 of 3 runs with its own credentials and forges what its 8 clients send (DFCA_FORGE, harness.forgery):
    the seed hijack (an all-zero model at an inflated score, in every seeding round) and consensus hijack (a
    huge weight on the zero model, in every gossip step). With `dfca.screen` the 16 honest clients end within 3
    points of their accuracy in the honest run, with their clusters recovered; the forgeries are refused and
    dropped, and counted."""
    private_rabbitmq, principal_urls = principal_node
    # 150 images per client: dropping the liars' messages drops their clients' data too, which with 80 images each
    # alone costs the honest clients 3 points (benchmarks/byzantine.py measures both)
    cfg = rotated_mnist(name="byzantine", rounds=8, dfca={"screen": True}, data={"train_per_client": 150})
    reference = simulate(ExperimentConfig.model_validate(cfg)).simulation.algorithm.evaluate()
    honest = [c for c in range(24) if c % WORKERS != 1]
    honest_accuracy = float(reference.test_accuracy[honest].mean())
    with running_stack(tmp_path, private_rabbitmq.url, workers=WORKERS, broker_users=principal_urls,
                       forge={1: "seed=inflate,gossip=inflate"}) as stack:
        api = Api.of(stack)
        experiment = api.create_and_start(cfg)
        final = api.wait_finished(experiment, timeout=300)
        assert final["status"] == "completed", final
        clients = api.metrics.get(f"/experiments/{experiment}/clients").json()
        summary = api.summary(experiment)
    rows = [i for i, c in enumerate(clients["clients"]) if c in honest]
    assert len(rows) == len(honest)
    accuracy = sum(clients["test_accuracy"][i] for i in rows) / len(rows)
    ari = cluster_ari(torch.tensor([clients["assigned"][i] for i in rows]),
                      torch.tensor([clients["true_cluster"][i] for i in rows]))
    assert accuracy >= honest_accuracy - 0.03, (accuracy, honest_accuracy)
    assert ari >= 0.9, ari
    messages = summary["messages"]
    assert messages["rejected"].get("seed_model", 0) > 0 and messages["screened"] > 0, messages
    assert "FORGES its clients' messages" in (tmp_path / "logs" / "worker-1.log").read_text()
