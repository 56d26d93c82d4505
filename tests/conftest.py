"""Shared fixtures.

- `rabbitmq_url`: an administrator's URL of vhost `dfca` on the machine's shared RabbitMQ node, installed and
  started on demand with scripts/install_rabbitmq.sh and scripts/start_rabbitmq.sh, which writes that URL (a
  generated password) to ~/.dfca/broker-admin-url (DFCA_BROKER_ADMIN_FILE); a node set up before the script made
  one answers to the old development user dfca/dfca. Outside CI the tests that need it are skipped when RabbitMQ
  cannot be installed; with CI=true that is a failure. DFCA_TEST_BROKER_URL points the tests at another broker.
- `private_rabbitmq`: a RabbitMQ node of the test module's own (tests/rabbitmq_node.py), for tests
  that stop, restart or reset the broker; the shared node is never stopped. Tests in one module
  share the node (booting one takes seconds), so they use unique names and leave it running.
- `unique_id`: a fresh experiment id / name prefix, so runs and tests never collide on a broker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rabbitmq_node import RabbitMQNode, RabbitMQNodeError, server_bin_dir  # noqa: E402


@pytest.fixture(autouse=True)
def subnormal_floats() -> Iterator[None]:
    """The simulator sets flush-to-zero for the whole process when it runs (torch.set_flush_denormal), and then a
    subnormal such as 5e-324 reads as 0.0 everywhere in it, pydantic's parsing included: an earlier test's run must
    not leave it on for the next."""
    yield
    if "torch" in sys.modules:
        sys.modules["torch"].set_flush_denormal(False)

REPO = Path(__file__).resolve().parents[1]
LEGACY_BROKER_URL = "amqp://dfca:dfca@127.0.0.1:5672/dfca"  # a node set up before the administrator's file


from dfca.settings import broker_admin_url as admin_url  # noqa: E402


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
    """Skip, or fail in CI where RabbitMQ must work."""
    if in_ci():
        pytest.fail(f"RabbitMQ is required in CI: {reason}")
    pytest.skip(reason)


def broker_answers(url: str) -> bool:
    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 3
    try:
        pika.BlockingConnection(params).close()
    except pika.exceptions.AMQPError:
        return False
    return True


def run_script(name: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "scripts" / name)],
        capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "DFCA_RABBITMQ_PLUGINS": os.environ.get("DFCA_RABBITMQ_PLUGINS", "none")},
    )


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    given = os.environ.get("DFCA_TEST_BROKER_URL")
    if given:
        if broker_answers(given):
            return given
        unavailable(f"DFCA_TEST_BROKER_URL={given} does not answer")
    for url in (admin_url(), LEGACY_BROKER_URL):
        if url is not None and broker_answers(url):
            return url
    installed = run_script("install_rabbitmq.sh", timeout=600)
    if installed.returncode != 0:
        unavailable(f"cannot install RabbitMQ: {installed.stderr.strip()[-500:]}")
    started = run_script("start_rabbitmq.sh", timeout=300)
    url = admin_url()
    if started.returncode != 0 or url is None or not broker_answers(url):
        pytest.fail(f"RabbitMQ did not start:\n{started.stdout[-2000:]}\n{started.stderr[-2000:]}")
    return url


@pytest.fixture(scope="module")
def private_rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitMQNode]:
    if server_bin_dir() is None:
        installed = run_script("install_rabbitmq.sh", timeout=600)
        if installed.returncode != 0 or server_bin_dir() is None:
            unavailable("RabbitMQ is not installed and cannot be installed")
    try:
        node = RabbitMQNode.start_new(tmp_path_factory.mktemp("rabbitmq-node"))
    except RabbitMQNodeError as err:
        pytest.fail(str(err))
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture
def unique_id() -> str:
    """A routing-key-safe id (letters and digits) no other test or run uses."""
    return f"t{uuid.uuid4().hex[:12]}"
