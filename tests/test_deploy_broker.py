"""The Kubernetes broker configuration boots a real RabbitMQ: the rabbitmq-config ConfigMap, rendered
by the broker pod's init container with a Secret password, loads on a private node; the Secret's
password logs in as dfca, the local-development password does not, and dfca's exchanges exist."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest
from deploy_manifest import K8S_DIR, load_manifests, run_broker_init_container, with_cluster_secret
from rabbitmq_node import RabbitMQNode, RabbitMQNodeError, node_config, server_bin_dir

from dfca import topics

pytestmark = pytest.mark.rabbitmq

SECRET_PASSWORD = "k8s-Secret.pass_word~1"


@pytest.fixture
def k8s_configured_node(tmp_path: Path) -> Iterator[RabbitMQNode]:
    bin_dir = server_bin_dir()
    if bin_dir is None:
        pytest.skip("RabbitMQ is not installed (scripts/install_rabbitmq.sh)")
    rendered = run_broker_init_container(with_cluster_secret(load_manifests(K8S_DIR)), SECRET_PASSWORD,
                                         tmp_path / "pod")
    assert rendered.returncode == 0, rendered.stderr
    node = RabbitMQNode(tmp_path / "node", bin_dir)
    definitions = tmp_path / "pod" / "config" / "definitions.json"
    conf = (tmp_path / "pod" / "config" / "rabbitmq.conf").read_text()
    (node.base_dir / "rabbitmq.conf").write_text(node_config(conf, definitions))
    try:
        node.start()
    except RabbitMQNodeError as err:
        pytest.fail(str(err))
    try:
        yield node
    finally:
        node.stop()


def connect(node: RabbitMQNode, password: str) -> pika.BlockingConnection:
    params = pika.URLParameters(f"amqp://dfca:{password}@127.0.0.1:{node.port}/dfca")
    params.connection_attempts = 1
    return pika.BlockingConnection(params)


def test_k8s_broker_config_boots_with_the_secret_password(k8s_configured_node: RabbitMQNode) -> None:
    connection = connect(k8s_configured_node, SECRET_PASSWORD)
    try:
        channel = connection.channel()
        for exchange, kind in topics.EXCHANGES.items():
            channel.exchange_declare(exchange, kind, passive=True)
    finally:
        connection.close()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        connect(k8s_configured_node, "dfca")
    users = k8s_configured_node.ctl("list_users", "--formatter", "json")
    assert users.returncode == 0, users.stderr
    assert [user["user"] for user in json.loads(users.stdout)] == ["dfca"]
