"""The transport interface: AMQP topic-exchange semantics, pull-style receive.

Every driver and service talks through this class only. Two implementations
share one contract test suite (`tests/transport_contract.py`):
`InMemoryTransport` (embedded default, tests) and `RabbitMQTransport` (pika).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

POLL_S = 0.005  # how often the generic receive_any looks again
Outgoing = tuple[str, str, bytes, Mapping[str, str] | None]  # exchange, routing key, body, headers


class TransportError(RuntimeError):
    """The transport could not do what was asked (closed, unknown exchange, ...)."""


@dataclass(frozen=True)
class Message:
    """One delivered message. `tag` identifies it for `ack`/`reject` on the same transport. `publisher`: the
    user its publisher connected as, proven by the broker (RabbitMQ refuses a `user_id` that is not the
    connection's user); empty when the publisher did not say."""

    exchange: str
    routing_key: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    tag: int = 0
    redelivered: bool = False
    publisher: str = ""


@lru_cache(maxsize=1 << 16)
def topic_matches(binding_key: str, routing_key: str) -> bool:
    """AMQP 0-9-1 topic matching: `*` is exactly one word, `#` is zero or more words. Remembered per pair: the
    in-memory broker asks it for every binding of every message (a lockstep round of the runtime benchmark's
    config asked 1,900 times, 8% of the round's CPU), and the same few keys come back every round."""
    pattern = binding_key.split(".") if binding_key else []
    words = routing_key.split(".") if routing_key else []

    def match(p: int, w: int) -> bool:
        if p == len(pattern):
            return w == len(words)
        if pattern[p] == "#":
            return any(match(p + 1, k) for k in range(w, len(words) + 1))
        if w == len(words):
            return False
        return (pattern[p] == "*" or pattern[p] == words[w]) and match(p + 1, w + 1)

    return match(0, 0)


@dataclass(frozen=True)
class QueueLimits:
    """Bounds of one queue, so that no publisher can fill a broker. Past `max_length` messages or `max_bytes` of
    bodies the oldest message is dropped (dead-lettered where the queue has a dead-letter exchange): a flood
    pushes out its own backlog, and publishers are never refused. `expires_s`: the queue is deleted after this
    long without a consumer; `message_ttl_s`: a message is dropped (dead-lettered) after this long. The
    in-memory transport keeps the length bounds; expiry and TTL are the broker's."""

    max_length: int | None = None
    max_bytes: int | None = None
    expires_s: float | None = None
    message_ttl_s: float | None = None

    def arguments(self) -> dict[str, object]:
        """The RabbitMQ queue arguments."""
        args: dict[str, object] = {"x-overflow": "drop-head"}
        if self.max_length is not None:
            args["x-max-length"] = int(self.max_length)
        if self.max_bytes is not None:
            args["x-max-length-bytes"] = int(self.max_bytes)
        if self.expires_s is not None:
            args["x-expires"] = int(self.expires_s * 1000)
        if self.message_ttl_s is not None:
            args["x-message-ttl"] = int(self.message_ttl_s * 1000)
        return args


class Transport(ABC):
    """Publish to exchanges, consume from queues, with topic routing.

    Semantics both implementations keep:
    - `publish` returns once the broker has accepted the message (publisher confirm);
      a message that matches no binding is dropped, as in AMQP. `publish_pipelined` hands messages over
      without waiting; `await_confirms` then returns once the broker has accepted every one of them.
    - `receive` pops the next message of a queue or returns None after `timeout` seconds; `receive_any`
      does so for the first of several queues to have one, waking as soon as one arrives.
    - A received message stays unacknowledged until `ack`; `reject(requeue=False)` sends it
      to the queue's dead-letter exchange; `reject(requeue=True)` redelivers it.
    - Fanout exchanges ignore the routing key.
    - Every published message carries the transport's `user` as its publisher (`Message.publisher`), and
      the broker refuses to let one user publish as another.
    - Messages are persistent (they outlive a broker restart) unless published with `persistent=False`.
    """

    user: str = ""  # the broker user this transport connected as
    connections: int = 1  # connections opened so far; more than one: the broker may have lost what was not persistent

    @abstractmethod
    def declare_exchange(self, name: str, kind: str = "topic") -> None: ...

    @abstractmethod
    def declare_queue(self, name: str, dead_letter_exchange: str | None = None,
                      limits: QueueLimits | None = None) -> None: ...

    @abstractmethod
    def delete_queue(self, name: str) -> None: ...

    @abstractmethod
    def bind(self, queue: str, exchange: str, binding_key: str) -> None: ...

    @abstractmethod
    def unbind(self, queue: str, exchange: str, binding_key: str) -> None: ...

    @abstractmethod
    def publish(
        self, exchange: str, routing_key: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> None: ...

    def publish_many(self, messages: Sequence[Outgoing]) -> None:
        """Publish each (exchange, routing key, body, headers) in order; returns once the broker accepted all.
        This one publishes them one by one; RabbitMQ awaits the batch's confirms together."""
        for exchange, routing_key, body, headers in messages:
            self.publish(exchange, routing_key, body, headers)

    def publish_pipelined(self, messages: Sequence[Outgoing], persistent: bool = True) -> None:
        """Hand `messages` over in order without awaiting the broker's confirms (`await_confirms` does): the
        publisher goes on while they travel. Not `persistent`: the broker keeps them in memory only, so a broker
        that restarts before they are consumed loses them (`connections` then grows: the publisher sends them
        again if they still matter). This one publishes them at once, leaving nothing to await."""
        self.publish_many(messages)

    def await_confirms(self) -> None:
        """Return once every message handed to `publish_pipelined` so far is confirmed; TransportError if the
        broker refused one or a confirm did not come in time. Here every publish was confirmed when it returned."""
        return None

    def confirmation(self) -> Callable[[], None]:
        """`await_confirms` for the messages handed to `publish_pipelined` so far, to be called later (from any
        thread, once): later publishes are not its business, and `await_confirms` no longer waits for these. Here
        there is nothing to await."""
        return _nothing_to_await

    @abstractmethod
    def receive(self, queue: str, timeout: float = 0.0) -> Message | None: ...

    def receive_any(self, queues: Sequence[str], timeout: float = 0.0) -> tuple[int, Message] | None:
        """The next message of any of `queues`, as (its queue's index, the message), or None after `timeout`
        seconds. This one polls; the implementations wake when a message arrives."""
        deadline = time.monotonic() + timeout
        while True:
            for index, queue in enumerate(queues):
                if (message := self.receive(queue, 0.0)) is not None:
                    return index, message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(POLL_S, remaining))

    @abstractmethod
    def ack(self, message: Message) -> None: ...

    def ack_many(self, messages: Sequence[Message]) -> None:
        """Acknowledge every one of `messages`, as `ack` does each; a message that cannot be acked (settled
        already, a lost connection) raises TransportError after the others are acked."""
        error: TransportError | None = None
        for message in messages:
            try:
                self.ack(message)
            except TransportError as err:
                error = error or err
        if error is not None:
            raise error

    @abstractmethod
    def reject(self, message: Message, requeue: bool = False) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nothing_to_await() -> None:
    return None
