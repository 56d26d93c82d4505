"""One broker user per principal, each with the least privileges its job needs (see dfca.identity.principals).

Resource permissions (RabbitMQ's configure / write / read regular expressions over exchange and queue names)
and topic permissions (over routing keys on a topic exchange), derived from the names in dfca.identity.topics:

- topology: publishes control (any key) and `<exp>.experiment` events; consumes its events queue; declares
  the exchanges, the dead-letter queue, the server queues and every worker's queues, and makes their bindings:
  each worker's queue of models (topics.worker_queue) bound to whom its clients hear, at an experiment's start and
  for edges added during a run, deleted at its end; each worker's control queue bound to the deployment's commands.
- metrics: publishes nothing; consumes and declares its events queue and its dead-letter tap.
- aggregator: publishes models keyed `<exp>.aggregator.server.<part>` and its presence; consumes and
  declares its control queue and the server queues.
- worker-i: publishes models keyed `<exp>.worker-i.<client>.<part>`, its events and presence (not an
  experiment's status); consumes its control queue and its queues of models. Nothing else: no configure right at
  all (it declares, deletes and binds no queue: binding needs write on the queue and read on the exchange, and it
  has neither), no write on the dead-letter exchange or on any queue, no read on any exchange.

So a worker's credentials cannot publish a control command (no write on `dfca.control`), a model under another
worker's host word, an experiment's status or a dead letter; cannot declare a queue (of any name: `dfca.<anything>.
worker-i.inbox` included), bind one to any key, or consume, delete or redeclare another worker's queues or the
server's queue; and cannot declare or delete exchanges. Every queue it can read was declared by the topology service
with length, bytes and expiry limits (topics.MODEL_QUEUE_LIMITS, topics.SERVICE_QUEUE_LIMITS). The broker also
refuses a message whose `user_id` is not its publisher's user, so receivers know who published what
(`Message.publisher`).

What these permissions cannot express (and receivers check instead): that client c is hosted by worker
c % workers (the message driver rejects a model whose host word is not its sender's host); that a worker's
event is about that worker (topology and metrics reject an event published by another principal). Which keys a
worker's queue may be bound to (its clients' neighbours, a graph that changes during a run) is no permission either:
the topology service makes every binding, from the experiment's graph.

Command line:
    python -m dfca.identity.broker_users create --workers 3 --out .dfca/broker-users.json   # rabbitmqctl on this
    machine
    python -m dfca.identity.broker_users definitions --workers 3 --out .dfca/broker-users.json > definitions.json
    python -m dfca.identity.broker_users definitions --workers 3 --host rabbitmq --out .dfca/broker-users.json \
        --compose-env .env > .dfca/broker-definitions.json     # scripts/compose_broker_users.sh
    python -m dfca.identity.broker_users k8s --workers 2 --out-dir DIR  # scripts/k8s_secret.sh
`create` makes (or re-passwords) the users with fresh random passwords through `rabbitmqctl` and writes each
principal's AMQP URL to `--out` (mode 600); `dfca up --broker-users FILE` runs every process as its own user.
`definitions` prints a broker definitions document (broker/definitions.json plus the principals' users and
permissions, password hashes only) for a broker that loads definitions at boot (Docker Compose, Kubernetes);
`--compose-env` also sets DFCA_BROKER_URL_<PRINCIPAL> and DFCA_BROKER_DEFINITIONS in an env file that
docker-compose.yml reads. `k8s` writes the files scripts/k8s_secret.sh makes Kubernetes Secrets of (the broker's
user records without any shared user, and one URL file per principal).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from dfca.identity import principals, topics
from dfca.identity.broker_setup import VHOST, broker_definitions, rabbitmq_password_hash

WORD = "[A-Za-z0-9_-]+"  # a routing-key or queue-name word (topics.check_word)
NUMBER = "[0-9]+"
NOTHING = "^$"  # matches no resource name


@dataclass(frozen=True)
class Permissions:
    """A principal's rights in the vhost: resource regexes and topic-exchange routing-key regexes."""

    configure: str
    write: str
    read: str
    topics: dict[str, tuple[str, str]]  # exchange -> (write, read) routing-key regexes


def _any(*names: str) -> str:
    return "^(" + "|".join(names) + ")$" if names else NOTHING


def _exact(name: str) -> str:
    return re.escape(name)


def worker_queues(host: str) -> str:
    """Every experiment's queue of the worker `host` (topics.worker_queue)."""
    return rf"dfca\.{WORD}\.{re.escape(host)}\.inbox"


SERVER_QUEUES = rf"dfca\.{WORD}\.server"  # topics.server_queue
ALL_WORKER_QUEUES = rf"dfca\.{WORD}\.worker-{NUMBER}\.inbox"
ALL_WORKER_CONTROL_QUEUES = (re.escape(topics.worker_control_queue("DEPLOYMENTWORD", 0))
                             .replace("DEPLOYMENTWORD", WORD).removesuffix("0") + NUMBER)
EXCHANGES = tuple(_exact(name) for name in topics.EXCHANGES)
MODELS, CONTROL, EVENTS, DLX = (_exact(topics.MODELS_EXCHANGE), _exact(topics.CONTROL_EXCHANGE),
                                _exact(topics.METRICS_EXCHANGE), _exact(topics.DEAD_LETTER_EXCHANGE))
ANY_KEY = ".*"


def _own_queue(kind: str) -> str:
    """A deployment's queue named by topics' `kind` function, with the deployment word open."""
    probe = "DEPLOYMENTWORD"
    name = {"events-topology": lambda: topics.events_queue(probe, principals.TOPOLOGY),
            "events-metrics": lambda: topics.events_queue(probe, principals.METRICS),
            "tap": lambda: topics.dead_letter_tap_queue(probe),
            "aggregator-control": lambda: topics.aggregator_control_queue(probe)}[kind]()
    return re.escape(name).replace(probe, WORD)


def _worker_control_queue(ordinal: int) -> str:
    probe = "DEPLOYMENTWORD"
    return re.escape(topics.worker_control_queue(probe, ordinal)).replace(probe, WORD)


PRESENCE_KEYS = re.escape(topics.presence_key("DEPLOYMENTWORD")).replace("DEPLOYMENTWORD", WORD)


def event_keys(*kinds: str) -> list[str]:
    """dfca.metrics keys of any deployment and experiment (topics.metrics_key) of these kinds."""
    probe = re.escape(topics.metrics_key("DEPLOYMENTWORD", "EXPERIMENTWORD", "KINDWORD"))
    return [probe.replace("DEPLOYMENTWORD", WORD).replace("EXPERIMENTWORD", WORD).replace("KINDWORD", kind)
            for kind in kinds]


def worker_event_keys(ordinal: int) -> str:
    """What a worker may publish on dfca.metrics: its events (not an experiment's status) and its presence."""
    return _any(*event_keys("round", "worker", "final_models"), PRESENCE_KEYS)


def permissions_of(principal: str) -> Permissions:
    if principal == principals.TOPOLOGY:
        own = _own_queue("events-topology")
        queues = (own, ALL_WORKER_QUEUES, ALL_WORKER_CONTROL_QUEUES, SERVER_QUEUES, _exact(topics.DEAD_LETTER_QUEUE))
        return Permissions(
            configure=_any(*EXCHANGES, *queues),
            write=_any(CONTROL, EVENTS, DLX, *queues),
            read=_any(MODELS, CONTROL, EVENTS, DLX, *queues),
            topics={topics.METRICS_EXCHANGE: (_any(*event_keys("experiment")), ANY_KEY),
                    topics.MODELS_EXCHANGE: (NOTHING, ANY_KEY)})
    if principal == principals.METRICS:
        own = (_own_queue("events-metrics"), _own_queue("tap"))
        return Permissions(configure=_any(*own), write=_any(DLX, *own), read=_any(EVENTS, DLX, *own),
                           topics={topics.METRICS_EXCHANGE: (NOTHING, ANY_KEY)})
    if principal == principals.AGGREGATOR:
        own = (_own_queue("aggregator-control"), SERVER_QUEUES)
        server_keys = re.escape(topics.model_key("EXPERIMENT", principals.AGGREGATOR, topics.SERVER_SENDER, 0))
        server_keys = server_keys.replace("EXPERIMENT", WORD).removesuffix("0") + NUMBER
        return Permissions(
            configure=_any(*own), write=_any(MODELS, EVENTS, DLX, *own), read=_any(MODELS, CONTROL, *own),
            topics={topics.MODELS_EXCHANGE: (_any(server_keys), ANY_KEY),
                    topics.METRICS_EXCHANGE: (_any(PRESENCE_KEYS), ANY_KEY)})
    match = re.fullmatch(r"worker-([0-9]+)", principal)
    if match is None:
        raise ValueError(f"{principal!r} is not a principal")
    ordinal = int(match.group(1))
    own = (_worker_control_queue(ordinal), worker_queues(principal))
    model_keys = rf"{WORD}\.{re.escape(principal)}\.{NUMBER}\.{NUMBER}"
    return Permissions(  # consume its own queues, publish models and events: nothing to configure or bind
        configure=NOTHING, write=_any(MODELS, EVENTS), read=_any(*own),
        topics={topics.MODELS_EXCHANGE: (_any(model_keys), ANY_KEY),
                topics.METRICS_EXCHANGE: (worker_event_keys(ordinal), ANY_KEY)})


def principals_of(workers: int) -> list[str]:
    """Every principal of a deployment with `workers` workers."""
    return [*principals.SERVICES, *(principals.worker(i) for i in range(workers))]


def rabbitmqctl_commands(principal: str, password: str, vhost: str = VHOST) -> list[list[str]]:
    """rabbitmqctl argument lists that make `principal`'s user (or give it a new password) with its rights."""
    user = principals.user_of(principal)
    rights = permissions_of(principal)
    commands = [["add_user", user, password], ["change_password", user, password], ["set_user_tags", user],
                ["set_permissions", "-p", vhost, user, rights.configure, rights.write, rights.read],
                ["clear_topic_permissions", "-p", vhost, user]]
    commands += [["set_topic_permissions", "-p", vhost, user, exchange, write, read]
                 for exchange, (write, read) in rights.topics.items()]
    return commands


def principal_records(passwords: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """The definitions' `users`, `permissions` and `topic_permissions` of the principals (password hashes)."""
    records: dict[str, list[dict[str, Any]]] = {"users": [], "permissions": [], "topic_permissions": []}
    for principal, password in passwords.items():
        user, rights = principals.user_of(principal), permissions_of(principal)
        records["users"].append({"name": user, "password_hash": rabbitmq_password_hash(password),
                                 "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": [], "limits": {}})
        records["permissions"].append({"user": user, "vhost": VHOST, "configure": rights.configure,
                                       "write": rights.write, "read": rights.read})
        records["topic_permissions"] += [{"user": user, "vhost": VHOST, "exchange": exchange, "write": write,
                                          "read": read} for exchange, (write, read) in rights.topics.items()]
    return records


def definitions(passwords: dict[str, str]) -> dict[str, Any]:
    """broker/definitions.json's document plus a user per principal (password hashes), with its rights."""
    document = broker_definitions(rabbitmq_password_hash(os.environ.get("DFCA_BROKER_PASSWORD", "dfca")))
    for key, records in principal_records(passwords).items():
        document[key] += records
    return document


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by this user only (it holds a password or a hash)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def write_k8s_files(directory: Path, passwords: dict[str, str], host: str, port: int) -> None:
    """What scripts/k8s_secret.sh turns into Secrets: the broker's `users.json`, `permissions.json` and
    `topic_permissions.json` (JSON arrays the broker pod's init container puts into its definitions; no
    shared user) and each principal's AMQP URL in `url-<principal>`."""
    for key, records in principal_records(passwords).items():
        write_private(directory / f"{key}.json", json.dumps(records, indent=2) + "\n")
    for principal, password in passwords.items():
        write_private(directory / f"url-{principal}", principal_url(principal, password, host, port))


def principal_url(principal: str, password: str, host: str, port: int, vhost: str = VHOST,
                  scheme: str = "amqp") -> str:
    return f"{scheme}://{quote(principals.user_of(principal), safe='')}:{quote(password, safe='')}@{host}:{port}/" \
           f"{quote(vhost, safe='')}"


def write_urls(path: Path, urls: dict[str, str]) -> None:
    """The principals' URLs (they hold passwords): readable by this user only."""
    write_private(path, json.dumps(urls, indent=2))


def read_urls(path: Path) -> dict[str, str]:
    """What `write_urls` wrote; raises ValueError naming what is wrong."""
    try:
        urls = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read broker users from {path}: {err}") from err
    if not isinstance(urls, dict) or \
            not all(principals.is_principal(k) and isinstance(v, str) for k, v in urls.items()):
        raise ValueError(f"{path} must map principals (topology, metrics, aggregator, worker-<i>) to AMQP URLs")
    return urls


def env_name(principal: str) -> str:
    """docker-compose.yml's variable for a principal's URL: DFCA_BROKER_URL_WORKER_0, DFCA_BROKER_URL_TOPOLOGY."""
    return "DFCA_BROKER_URL_" + principal.upper().replace("-", "_")


def update_env_file(path: Path, values: dict[str, str]) -> None:
    """Set `values` in a KEY=value file (docker compose's .env), keeping its other lines; mode 600."""
    lines = path.read_text().splitlines() if path.exists() else []
    kept = [line for line in lines if line.split("=", 1)[0].strip() not in values]
    text = "\n".join([*kept, *(f"{k}={v}" for k, v in values.items())]) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dfca.identity.broker_users", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("create", "definitions", "k8s"):
        sub = commands.add_parser(name)
        sub.add_argument("--workers", type=int, required=True, help="worker ordinals 0..N-1 get a user each")
        if name == "k8s":
            sub.add_argument("--out-dir", type=Path, required=True,
                             help="where the broker's records and each principal's url-<principal> go (mode 600)")
        else:
            sub.add_argument("--out", type=Path, required=True, help="where the principals' AMQP URLs go (mode 600)")
        sub.add_argument("--host", default="rabbitmq" if name == "k8s" else "127.0.0.1", help="broker host in the URLs")
        sub.add_argument("--port", type=int, default=5672)
    commands.choices["create"].add_argument("--rabbitmqctl", default="rabbitmqctl",
                                            help="how to run rabbitmqctl (e.g. 'sudo rabbitmqctl -n rabbit@host')")
    commands.choices["definitions"].add_argument(
        "--compose-env", type=Path, help="also set the principals' URLs in this env file (docker compose's .env), "
        "with DFCA_BROKER_DEFINITIONS=DEFINITIONS_PATH")
    commands.choices["definitions"].add_argument("--definitions-path", default="./.dfca/broker-definitions.json",
                                                 help="where the printed definitions are saved (for the env file)")
    args = parser.parse_args(argv)
    if not 1 <= args.workers <= 1000:
        parser.error("--workers must be 1..1000")
    passwords = {p: secrets.token_urlsafe(24) for p in principals_of(args.workers)}
    if args.command == "k8s":
        write_k8s_files(args.out_dir, passwords, args.host, args.port)
        print(f"{len(passwords)} broker users; their records and URLs are in {args.out_dir}", file=sys.stderr)
        return 0
    if args.command == "create":
        ctl = shlex.split(args.rabbitmqctl)
        for principal, password in passwords.items():
            for command in rabbitmqctl_commands(principal, password):
                done = subprocess.run([*ctl, *command], capture_output=True, text=True, check=False)
                if done.returncode != 0 and command[0] != "add_user":  # add_user fails for an existing user
                    print(f"rabbitmqctl {command[0]} {principals.user_of(principal)} failed: "
                          f"{(done.stderr or done.stdout).strip()[-300:]}", file=sys.stderr)
                    return 1
    else:
        print(json.dumps(definitions(passwords), indent=2))
    urls = {p: principal_url(p, pw, args.host, args.port) for p, pw in passwords.items()}
    if getattr(args, "compose_env", None) is not None:
        update_env_file(args.compose_env, {**{env_name(p): url for p, url in urls.items()},
                                           "DFCA_BROKER_DEFINITIONS": args.definitions_path})
    write_urls(args.out, urls)
    print(f"{len(passwords)} broker users; their URLs are in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
