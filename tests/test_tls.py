"""TLS on both wires, with self-signed certificates the test makes (openssl):

- AMQPS: a private RabbitMQ node with a TLS listener; `RabbitMQTransport("amqps://...")` verifies the broker
  against the CA in SSL_CERT_FILE (pika's and httpx's default contexts read it), moves a message, and refuses
  a broker whose certificate it cannot verify;
- HTTPS: the topology service with DFCA_TLS_CERT and DFCA_TLS_KEY answers HTTPS only; the `dfca` commands'
  client reaches it with the CA in SSL_CERT_FILE and refuses it without.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from free_ports import free_port
from rabbitmq_node import RabbitMQNode, RabbitMQNodeError, server_bin_dir
from runtime_fixtures import TOKEN

from dfca.cli.runtime_client import Endpoints, RuntimeClient
from dfca.runtime.control.coordinator import Coordinator
from dfca.runtime.service.http_service import server_config
from dfca.transport import InMemoryBroker, InMemoryTransport, RabbitMQTransport, TransportError
from services.topology.main import create_app

pytestmark = [pytest.mark.rabbitmq]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA and a server certificate for localhost / 127.0.0.1 signed by it; and a CA nobody used."""
    d = tmp_path_factory.mktemp("tls")
    files = {name: d / f"{name}.pem" for name in ("ca", "ca_key", "server", "server_key", "csr", "other_ca",
                                                    "other_key")}
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=dfca test CA",
            "-keyout", str(files["ca_key"]), "-out", str(files["ca"]))
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=another CA",
            "-keyout", str(files["other_key"]), "-out", str(files["other_ca"]))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", str(files["server_key"]),
            "-out", str(files["csr"]))
    (d / "san.ext").write_text("subjectAltName = DNS:localhost, IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", str(files["csr"]), "-CA", str(files["ca"]), "-CAkey", str(files["ca_key"]),
            "-CAcreateserial", "-days", "2", "-extfile", str(d / "san.ext"), "-out", str(files["server"]))
    for name in ("server_key",):
        files[name].chmod(0o644)  # the broker runs as this user; it must read the key
    return files


@pytest.fixture(scope="module")
def tls_node(certificates: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitMQNode]:
    if server_bin_dir() is None:
        pytest.fail("RabbitMQ is not installed (scripts/install_rabbitmq.sh)")
    tls_port = free_port()
    extra = (f"listeners.ssl.default = {tls_port}\n"
             f"ssl_options.cacertfile = {certificates['ca']}\n"
             f"ssl_options.certfile = {certificates['server']}\n"
             f"ssl_options.keyfile = {certificates['server_key']}\n"
             "ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n")
    try:
        node = RabbitMQNode.start_new(tmp_path_factory.mktemp("tls-node"), extra_config=extra)
    except RabbitMQNodeError as err:
        pytest.fail(str(err))
    node.tls_port = tls_port  # type: ignore[attr-defined]
    try:
        yield node
    finally:
        node.stop()


def test_amqps_moves_messages_and_refuses_a_broker_it_cannot_verify(tls_node: RabbitMQNode,
                                                                     certificates: dict[str, Path],
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     unique_id: str) -> None:
    url = f"amqps://dfca:dfca@localhost:{tls_node.tls_port}/dfca"  # type: ignore[attr-defined]
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates["ca"]))
    with RabbitMQTransport(url, name="tls") as transport:
        transport.declare_exchange(f"{unique_id}.x")
        transport.declare_queue(f"{unique_id}.q")
        transport.bind(f"{unique_id}.q", f"{unique_id}.x", "#")
        transport.publish(f"{unique_id}.x", "a.b", b"over TLS")
        message = transport.receive(f"{unique_id}.q", 10.0)
        assert message is not None and message.body == b"over TLS" and message.publisher == "dfca"
        transport.ack(message)
        transport.delete_queue(f"{unique_id}.q")
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates["other_ca"]))  # a broker signed by an unknown CA
    with pytest.raises(TransportError):
        RabbitMQTransport(url, name="tls-untrusted", publish_timeout=5)
    with pytest.raises(TransportError):  # plain AMQP on the TLS port gets no broker
        RabbitMQTransport(f"amqp://dfca:dfca@localhost:{tls_node.tls_port}/dfca",  # type: ignore[attr-defined]
                          name="plain-on-tls", publish_timeout=5)


def test_the_api_over_https(certificates: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFCA_TLS_CERT", str(certificates["server"]))
    monkeypatch.setenv("DFCA_TLS_KEY", str(certificates["server_key"]))
    coordinator = Coordinator(InMemoryTransport(InMemoryBroker()), "dtls", workers=1)
    port = free_port()
    server = uvicorn.Server(server_config(create_app(coordinator, TOKEN, "memory://"), "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        monkeypatch.setenv("SSL_CERT_FILE", str(certificates["ca"]))
        client = RuntimeClient(Endpoints(f"https://localhost:{port}", f"https://localhost:{port}", TOKEN))
        assert client.topology.get("/experiments").json() == []
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to the HTTPS port
            httpx.get(f"http://127.0.0.1:{port}/livez", timeout=5)
        monkeypatch.setenv("SSL_CERT_FILE", str(certificates["other_ca"]))
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            RuntimeClient(Endpoints(f"https://localhost:{port}", f"https://localhost:{port}", TOKEN)) \
                .topology.get("/experiments")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        coordinator.close()
