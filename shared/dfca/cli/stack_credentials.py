"""The secrets `dfca up` makes at start, kept in its state directory (each file readable by this user only).

- Tokens: without DFCA_API_TOKEN, `dfca up` generates the API token (`<state dir>/api-token`); without
  DFCA_READ_TOKEN, the read token (`<state dir>/read-token`) that workers and the aggregator read with. Every read of
  either REST API then needs one of them (dfca.runtime.service.http_service).
- Broker users: without `--broker-users FILE`, `dfca up` creates one broker user per principal on the node behind
  `--broker` (dfca.identity.broker_users: their rights), with fresh passwords, in one `rabbitmqctl import_definitions`
  call, and keeps their URLs in `<state dir>/broker-users.json`. Before that it checks that the node `rabbitmqctl`
  reaches listens on the broker URL's AMQP port, so the users never land on another node of the machine.

A shared broker user for every process is only ever what `--insecure-shared-broker-user` asks for.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from dfca.identity import broker_users
from dfca.identity.broker_setup import VHOST

API_TOKEN_FILE = "api-token"
READ_TOKEN_FILE = "read-token"
BROKER_USERS_FILE = "broker-users.json"
CTL_TIMEOUT_S = 120.0


class CredentialsError(RuntimeError):
    """The stack's broker users could not be made; the message says what to do instead."""


def token_file(state_dir: Path, name: str, token: str) -> Path:
    """Write a generated token to `<state dir>/<name>` (mode 600); returns the file."""
    path = state_dir / name
    broker_users.write_private(path, token + "\n")
    return path


def new_token() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker of a URL listens, and its vhost (credentials are not needed: users are made by rabbitmqctl)."""

    scheme: str
    host: str
    port: int
    vhost: str

    @classmethod
    def of(cls, url: str) -> BrokerAddress:
        parts = urlsplit(url)
        scheme = parts.scheme or "amqp"
        port = parts.port or (5671 if scheme == "amqps" else 5672)
        return cls(scheme, parts.hostname or "127.0.0.1", port, unquote(parts.path.lstrip("/")) or "/")

    def listening(self, timeout: float = 3.0) -> bool:
        """Something accepts TCP connections on the broker's port."""
        try:
            socket.create_connection((self.host, self.port), timeout=timeout).close()
        except OSError:
            return False
        return True


def user_of_url(url: str) -> str:
    return unquote(urlsplit(url).username or "")


def node_amqp_ports(ctl: list[str]) -> set[int]:
    """The AMQP ports of the node `ctl` (a rabbitmqctl command line) reaches; raises CredentialsError."""
    done = _run([*ctl, "-q", "status", "--formatter", "json"])
    try:
        listeners = json.loads(done.stdout).get("listeners", [])
        return {int(item["port"]) for item in listeners if str(item.get("protocol", "")).startswith("amqp")}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CredentialsError(f"`{shlex.join(ctl)} status` said something unexpected: {err}") from err


def create_broker_users(ctl: list[str], address: BrokerAddress, workers: int, state_dir: Path) -> dict[str, str]:
    """Make (or re-password) one user per principal of a stack of `workers` workers on the node of `address`; write
    their URLs to `<state dir>/broker-users.json` and return them (principal -> AMQP URL)."""
    if address.vhost != VHOST:
        raise CredentialsError(f"the broker URL names vhost {address.vhost!r}; the principals' rights are on {VHOST!r}")
    ports = node_amqp_ports(ctl)
    if address.port not in ports:
        raise CredentialsError(f"the RabbitMQ node `{shlex.join(ctl)}` reaches listens on {sorted(ports)}, not on "
                               f"{address.port}: point --rabbitmqctl at the broker's node (e.g. 'rabbitmqctl -n NODE')")
    passwords = {p: new_token() for p in broker_users.principals_of(workers)}
    document = {"vhosts": [{"name": VHOST}], **broker_users.principal_records(passwords)}
    definitions = state_dir / "broker-users.definitions.json"  # password hashes only; gone once imported
    broker_users.write_private(definitions, json.dumps(document))
    try:
        _run([*ctl, "-q", "import_definitions", str(definitions.resolve())])
    finally:
        definitions.unlink(missing_ok=True)
    urls = {p: broker_users.principal_url(p, pw, address.host, address.port, scheme=address.scheme)
            for p, pw in passwords.items()}
    broker_users.write_urls(state_dir / BROKER_USERS_FILE, urls)
    return urls


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CTL_TIMEOUT_S, check=False,
                              env=os.environ.copy())
    except (OSError, subprocess.TimeoutExpired) as err:
        raise CredentialsError(f"`{shlex.join(command[:3])} ...` failed: {err}") from err
    if done.returncode != 0:
        raise CredentialsError(f"`{shlex.join(command[:3])} ...` failed: {(done.stderr or done.stdout).strip()[-400:]}")
    return done
