"""What `dfca up` makes at start without a broker: where the broker is, which node its users land on, tokens on
disk, and the warning every service gives under a shared broker user."""

from __future__ import annotations

import json
import logging
import socket
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dfca.cli import stack_credentials as credentials
from dfca.cli.launcher import Stack, StackOptions, prepare_credentials, service_env
from dfca.runtime.service.broker_identity import warn_if_shared_user


def fake_rabbitmqctl(tmp_path: Path, amqp_port: int) -> list[str]:
    """A rabbitmqctl whose node listens on `amqp_port` and that records every call."""
    script = tmp_path / "rabbitmqctl.py"
    script.write_text(
        "import json, sys\n"
        f"open({str(tmp_path / 'calls')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"print(json.dumps({{'listeners': [{{'port': {amqp_port}, 'protocol': 'amqp'}}, "
        "{'port': 25672, 'protocol': 'clustering'}]}))\n")
    return [sys.executable, str(script)]


def test_the_broker_address_comes_from_the_url_without_credentials() -> None:
    assert credentials.BrokerAddress.of("amqp://127.0.0.1:5673/dfca") == credentials.BrokerAddress(
        "amqp", "127.0.0.1", 5673, "dfca")
    assert credentials.BrokerAddress.of("amqps://u:p@broker/dfca").port == 5671


def test_users_are_never_made_on_a_node_that_does_not_serve_the_broker_url(tmp_path: Path) -> None:
    """The machine's default node listens on 5672; a stack on another broker must not get its users there."""
    ctl = fake_rabbitmqctl(tmp_path, amqp_port=5672)
    with pytest.raises(credentials.CredentialsError, match=r"listens on \[5672\], not on 5999"):
        credentials.create_broker_users(ctl, credentials.BrokerAddress.of("amqp://127.0.0.1:5999/dfca"), 2, tmp_path)
    assert "import_definitions" not in (tmp_path / "calls").read_text()


def test_users_are_made_in_one_import_and_their_urls_kept_for_this_user_only(tmp_path: Path) -> None:
    ctl = fake_rabbitmqctl(tmp_path, amqp_port=5999)
    state = tmp_path / "state"
    urls = credentials.create_broker_users(ctl, credentials.BrokerAddress.of("amqp://127.0.0.1:5999/dfca"), 2, state)
    assert sorted(urls) == ["aggregator", "metrics", "topology", "worker-0", "worker-1"]
    assert urls["worker-1"].startswith("amqp://dfca-worker-1:") and urls["worker-1"].endswith("@127.0.0.1:5999/dfca")
    assert len(set(urls.values())) == 5  # a password each
    kept = state / credentials.BROKER_USERS_FILE
    assert json.loads(kept.read_text()) == urls and stat.S_IMODE(kept.stat().st_mode) == 0o600
    calls = (tmp_path / "calls").read_text().splitlines()
    assert sum("import_definitions" in c for c in calls) == 1
    assert not list(state.glob("*.definitions.json"))  # the password hashes do not stay behind


def test_dfca_up_without_a_way_to_make_users_refuses_to_start_and_names_the_ways(tmp_path: Path) -> None:
    """No silent fallback to a shared user: where the users cannot be made, the stack does not start."""
    ctl = fake_rabbitmqctl(tmp_path, amqp_port=1)
    with socket_listening() as port:
        options = StackOptions(workers=1, broker_url=f"amqp://127.0.0.1:{port}/dfca", state_dir=tmp_path / "s",
                               rabbitmqctl=" ".join(ctl))
        token_file, refusal = prepare_credentials(options)
    assert token_file is None and refusal is not None and options.broker_users is None
    for way in ("--broker-users FILE", "--rabbitmqctl", "--insecure-shared-broker-user"):
        assert way in refusal


def test_a_stack_with_an_api_token_gives_workers_a_read_token_and_never_the_api_token(tmp_path: Path) -> None:
    options = StackOptions(workers=1, state_dir=tmp_path, api_token="writer")
    Stack(options)
    assert options.read_token and options.read_token != "writer"
    worker = service_env(options, "worker", 9999, 0)
    assert worker["DFCA_READ_TOKEN"] == options.read_token and "DFCA_API_TOKEN" not in worker


def test_a_service_under_a_shared_broker_user_warns_and_a_principal_does_not(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dfca.runtime.service.broker_identity"):
        assert warn_if_shared_user("amqp://dfca:dfca@127.0.0.1:5672/dfca", "worker-0")
        assert not warn_if_shared_user("amqp://dfca-worker-0:x@127.0.0.1:5672/dfca", "worker-0")
        assert not warn_if_shared_user("memory://", "worker-0")
    assert len(caplog.records) == 1 and "shared user 'dfca'" in caplog.records[0].getMessage()


@contextmanager
def socket_listening() -> Iterator[int]:
    """A TCP port something listens on (the broker's port answers; its node is another matter)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])
