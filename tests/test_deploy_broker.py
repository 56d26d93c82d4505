"""The Kubernetes broker configuration boots a real RabbitMQ: the rabbitmq-config ConfigMap, rendered by the
broker pod's init container with the dfca-broker-users Secret, loads on a private node. Every principal's
Secret URL logs in as that principal's own user, there is no shared user (dfca/dfca is refused), dfca's
exchanges exist, and a worker's user cannot publish a control command."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pika
import pika.exceptions
import pytest
from deploy_manifest import (
    K8S_DIR,
    Manifest,
    find_manifest,
    load_manifests,
    local_broker_url,
    start_k8s_broker,
    with_cluster_secrets,
)
from rabbitmq_node import RabbitMQNode, RabbitMQNodeError

from dfca.identity import principals, topics

pytestmark = pytest.mark.rabbitmq


@pytest.fixture(scope="module")
def manifests() -> list[Manifest]:
    return with_cluster_secrets(load_manifests(K8S_DIR))


@pytest.fixture(scope="module")
def k8s_configured_node(manifests: list[Manifest], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitMQNode]:
    try:
        node = start_k8s_broker(manifests, tmp_path_factory.mktemp("k8s-broker"))
    except (RuntimeError, RabbitMQNodeError) as err:
        pytest.fail(str(err))
    try:
        yield node
    finally:
        node.stop()


def principal_urls(manifests: list[Manifest], node: RabbitMQNode) -> dict[str, str]:
    """Each principal's URL from its Secret, pointed at the private node."""
    urls = {}
    for doc in manifests:
        name = doc["metadata"]["name"]
        if doc["kind"] == "Secret" and name.startswith("dfca-broker-") and name != "dfca-broker-users":
            urls[name.removeprefix("dfca-broker-")] = local_broker_url(doc["stringData"]["url"], node.port)
    return urls


def connect(url: str) -> pika.BlockingConnection:
    params = pika.URLParameters(url)
    params.connection_attempts = 1
    return pika.BlockingConnection(params)


def test_k8s_broker_has_one_user_per_principal_and_no_shared_one(manifests: list[Manifest],
                                                                  k8s_configured_node: RabbitMQNode) -> None:
    urls = principal_urls(manifests, k8s_configured_node)
    workers = int(find_manifest(manifests, "ConfigMap", "dfca-config")["data"]["DFCA_WORKERS"])
    assert set(urls) == {*principals.SERVICES, *(principals.worker(i) for i in range(workers))}
    for url in urls.values():
        connection = connect(url)
        try:
            channel = connection.channel()
            for exchange, kind in topics.EXCHANGES.items():
                channel.exchange_declare(exchange, kind, passive=True)
        finally:
            connection.close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        connect(f"amqp://dfca:dfca@127.0.0.1:{k8s_configured_node.port}/dfca")
    users = k8s_configured_node.ctl("list_users", "--formatter", "json")
    assert users.returncode == 0, users.stderr
    assert sorted(user["user"] for user in json.loads(users.stdout)) == sorted(map(principals.user_of, urls))


def test_k8s_worker_user_cannot_publish_control(manifests: list[Manifest], k8s_configured_node: RabbitMQNode) -> None:
    connection = connect(principal_urls(manifests, k8s_configured_node)[principals.worker(0)])
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            channel.basic_publish(topics.CONTROL_EXCHANGE, "anything", b"{}",
                                  pika.BasicProperties(user_id=principals.user_of(principals.worker(0))))
        assert refused.value.reply_code == 403
    finally:
        if connection.is_open:
            connection.close()
