"""dfca's broker topology: the exchanges of `dfca.identity.topics` and the dead-letter queue.

- `ensure_broker_topology(transport)`: services call it at start; idempotent, on any `Transport`.
- `bind_to_deployment(transport, queue, exchange, deployment)`: a service's queue of commands or events, bound to
  its deployment's keys only.
- `broker_definitions(password_hash)`: the RabbitMQ definitions document (vhost `dfca`, user
  `dfca`, permissions, exchanges, dead-letter queue and binding). `broker/definitions.json` is
  this document with the local-development password `dfca`; a test keeps them equal.
- `rabbitmq_password_hash(password)`: the `rabbit_password_hashing_sha256` hash RabbitMQ stores.

Command line:
    python -m dfca.identity.broker_setup declare [URL]      # URL defaults to DFCA_BROKER_URL
    python -m dfca.identity.broker_setup definitions        # password from DFCA_BROKER_PASSWORD
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import secrets
from typing import Any

from dfca.identity import topics
from dfca.transport.base import Transport, TransportError

log = logging.getLogger(__name__)

VHOST = "dfca"
USER = "dfca"
DEV_PASSWORD = "dfca"
RABBITMQ_VERSION = "3.10.8"


def ensure_broker_topology(transport: Transport) -> None:
    """Declare dfca's exchanges and the dead-letter queue. A broker user that may not (403: a worker's, the
    metrics service's or the aggregator's own user, see dfca.identity.broker_users) uses what the broker has: the
    topology service's user or the broker's definitions declared them; publishing checks they exist."""
    try:
        for name, kind in topics.EXCHANGES.items():
            transport.declare_exchange(name, kind)
        transport.declare_queue(topics.DEAD_LETTER_QUEUE, limits=topics.DEAD_LETTER_LIMITS)
        transport.bind(topics.DEAD_LETTER_QUEUE, topics.DEAD_LETTER_EXCHANGE, "")
    except TransportError as err:
        if "403" not in str(err):
            raise
        log.info("broker user %r may not declare dfca's exchanges (%s): using the broker's", transport.user, err)


def bind_to_deployment(transport: Transport, queue: str, exchange: str, deployment: str) -> None:
    """Bind a service's queue of commands or events to its own deployment's keys (topics.deployment_keys), and
    remove the bind-everything key that earlier versions gave it (its queue is durable: an upgraded deployment
    would go on receiving every other stack's messages)."""
    transport.bind(queue, exchange, topics.deployment_keys(deployment))
    transport.unbind(queue, exchange, topics.ALL_KEYS)


def rabbitmq_password_hash(password: str, salt: bytes | None = None) -> str:
    """base64(salt + sha256(salt + password)) with a 4-byte salt, as RabbitMQ's sha256 hashing."""
    salt = secrets.token_bytes(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def password_matches(password_hash: str, password: str) -> bool:
    raw = base64.b64decode(password_hash)
    return rabbitmq_password_hash(password, raw[:4]) == password_hash


def broker_definitions(password_hash: str) -> dict[str, Any]:
    return {
        "rabbit_version": RABBITMQ_VERSION,
        "rabbitmq_version": RABBITMQ_VERSION,
        "users": [{
            "name": USER,
            "password_hash": password_hash,
            "hashing_algorithm": "rabbit_password_hashing_sha256",
            "tags": [],  # least privilege: no management or administrator rights for the app user
            "limits": {},
        }],
        "vhosts": [{"name": VHOST}],
        "permissions": [{"user": USER, "vhost": VHOST, "configure": ".*", "write": ".*", "read": ".*"}],
        "topic_permissions": [],
        "parameters": [],
        "global_parameters": [],
        "policies": [],
        "queues": [{
            "name": topics.DEAD_LETTER_QUEUE, "vhost": VHOST, "durable": True, "auto_delete": False,
            "arguments": topics.DEAD_LETTER_LIMITS.arguments(),
        }],
        "exchanges": [
            {"name": name, "vhost": VHOST, "type": kind, "durable": True, "auto_delete": False,
             "internal": False, "arguments": {}}
            for name, kind in topics.EXCHANGES.items()
        ],
        "bindings": [{
            "source": topics.DEAD_LETTER_EXCHANGE, "vhost": VHOST, "destination": topics.DEAD_LETTER_QUEUE,
            "destination_type": "queue", "routing_key": "", "arguments": {},
        }],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dfca.identity.broker_setup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    declare = commands.add_parser("declare", help="declare the exchanges and the dead-letter queue")
    declare.add_argument("url", nargs="?", default=None)
    commands.add_parser("definitions", help="print definitions.json (password from DFCA_BROKER_PASSWORD)")
    args = parser.parse_args(argv)
    if args.command == "declare":
        from dfca.transport import connect_transport

        with connect_transport(args.url) as transport:
            ensure_broker_topology(transport)
        print(f"declared {len(topics.EXCHANGES)} exchanges and {topics.DEAD_LETTER_QUEUE}")
    else:
        password = os.environ.get("DFCA_BROKER_PASSWORD", DEV_PASSWORD)
        print(json.dumps(broker_definitions(rabbitmq_password_hash(password)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
