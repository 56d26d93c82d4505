"""What RabbitMQTransport (dfca.transport.rabbitmq) keeps about its work in flight: admin calls, publishes
awaiting their confirms, consumers and their deliveries, chunked messages being reassembled, and the topology
it redeclares after a reconnect. All of it but a consumer's `buffer` is its I/O thread's alone."""

from __future__ import annotations

import collections
import math
import queue as queue_module
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pika
from pika.channel import Channel

from dfca.transport.base import Message

Frame = Any  # a pika method frame; its payload is only passed through


@dataclass
class AdminOp:
    """One declare/bind/delete/check call, run alone on the admin channel."""

    description: str
    run: Callable[[Channel, Callable[[Frame], None]], None]
    future: Future[Frame] | None = None
    on_success: Callable[[], None] | None = None
    deadline: float = math.inf
    started: bool = False


@dataclass
class Publish:
    exchange: str
    routing_key: str
    body: bytes
    properties: pika.BasicProperties
    future: Future[None]
    deadline: float
    started: bool = False


@dataclass
class PartialMessage:
    count: int
    parts: dict[int, bytes] = field(default_factory=dict)
    delivery_tags: list[int] = field(default_factory=list)
    redelivered: bool = False
    publisher: str | None = None


@dataclass
class Consumer:
    """The consumer of one queue; `buffer` is shared with user threads, the rest is I/O-thread state."""

    queue: str
    started: Future[None] = field(default_factory=Future)
    buffer: queue_module.Queue[Message | None] = field(default_factory=queue_module.Queue)
    channel: Channel | None = None
    generation: int = 0
    dead: bool = False
    partial: dict[str, PartialMessage] = field(default_factory=dict)
    settled_chunk_ids: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)
    held_chunk_parts: int = 0
    qos_limit: int = 0


@dataclass(frozen=True)
class Delivery:
    """What a `Message.tag` stands for: broker delivery tags on one channel generation."""

    consumer: Consumer
    generation: int
    delivery_tags: tuple[int, ...]
    chunk_id: str | None  # set for a reassembled chunked message


@dataclass
class Topology:
    """Everything this transport declared, redeclared after a reconnect. I/O-thread state."""

    exchanges: dict[str, str] = field(default_factory=dict)
    queues: dict[str, tuple[dict[str, Any] | None, bool]] = field(default_factory=dict)  # name -> (args, passive)
    bindings: set[tuple[str, str, str]] = field(default_factory=set)  # (queue, exchange, key)
