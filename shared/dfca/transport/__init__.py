"""One transport interface, two implementations: in-memory and RabbitMQ.

`connect_transport(url)` picks one by URL: `memory://` gives an `InMemoryTransport` on a broker
shared by the whole process (`memory://<name>` on a separate named broker); `amqp://` and
`amqps://` give a `RabbitMQTransport`. `None` means `DFCA_BROKER_URL` (see `dfca.settings`).
"""

from __future__ import annotations

import threading
from typing import Any

from dfca.transport.base import Message, QueueLimits, Transport, TransportError, topic_matches
from dfca.transport.memory import InMemoryBroker, InMemoryTransport
from dfca.transport.rabbitmq import RabbitMQTransport

__all__ = [
    "InMemoryBroker",
    "InMemoryTransport",
    "Message",
    "QueueLimits",
    "RabbitMQTransport",
    "Transport",
    "TransportError",
    "connect_transport",
    "process_memory_broker",
    "topic_matches",
]

_memory_brokers: dict[str, InMemoryBroker] = {}
_memory_brokers_lock = threading.Lock()


def process_memory_broker(name: str = "") -> InMemoryBroker:
    """The in-memory broker that every `memory://<name>` transport of this process shares."""
    with _memory_brokers_lock:
        return _memory_brokers.setdefault(name, InMemoryBroker())


def connect_transport(url: str | None = None, **rabbitmq_options: Any) -> Transport:
    """A connected transport for `url`; `rabbitmq_options` go to `RabbitMQTransport`."""
    if url is None:
        from dfca.settings import DEFAULT_BROKER_URL, env

        url = env("DFCA_BROKER_URL", DEFAULT_BROKER_URL) or DEFAULT_BROKER_URL
    scheme, _, rest = url.partition("://")
    if scheme == "memory":
        return InMemoryTransport(process_memory_broker(rest.strip("/")))
    if scheme in ("amqp", "amqps"):
        return RabbitMQTransport(url, **rabbitmq_options)
    raise TransportError(f"unsupported broker URL scheme {scheme!r} (use memory:// or amqp://)")
