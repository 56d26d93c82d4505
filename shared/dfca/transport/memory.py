"""In-memory transport: a thread-safe broker with AMQP topic-exchange semantics."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from dfca.transport.base import Message, QueueLimits, Transport, TransportError, topic_matches


@dataclass
class _Queue:
    name: str
    dead_letter_exchange: str | None
    limits: QueueLimits | None = None
    ready: deque[Message] = field(default_factory=deque)
    unacked: dict[int, Message] = field(default_factory=dict)


class InMemoryBroker:
    """Shared state behind any number of `InMemoryTransport` connections."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.exchanges: dict[str, str] = {}
        self.queues: dict[str, _Queue] = {}
        self.bindings: dict[str, set[tuple[str, str]]] = {}  # exchange -> {(queue, key)}
        self.tags = itertools.count(1)

    def route(self, exchange: str, routing_key: str, body: bytes, headers: Mapping[str, str],
              publisher: str = "") -> int:
        """Deliver to every matching queue; returns how many queues got the message. Holds the lock."""
        kind = self.exchanges.get(exchange)
        if kind is None:
            raise TransportError(f"exchange {exchange!r} is not declared")
        targets = {
            q
            for q, key in self.bindings.get(exchange, ())
            if kind == "fanout" or (kind == "direct" and key == routing_key) or
            (kind == "topic" and topic_matches(key, routing_key))
        }
        for q in targets:
            queue = self.queues[q]
            queue.ready.append(Message(exchange, routing_key, bytes(body), dict(headers), tag=next(self.tags),
                                       publisher=publisher))
            self._bound(queue)
        if targets:
            self.lock.notify_all()
        return len(targets)


    def _bound(self, queue: _Queue) -> None:
        """Drop the oldest ready messages past the queue's limits, dead-lettering them (RabbitMQ's drop-head)."""
        limits = queue.limits
        if limits is None:
            return
        while queue.ready and ((limits.max_length is not None and len(queue.ready) > limits.max_length) or
                               (limits.max_bytes is not None and
                                sum(len(m.body) for m in queue.ready) > limits.max_bytes)):
            self.dead_letter(queue, queue.ready.popleft(), "maxlen")

    def dead_letter(self, queue: _Queue, message: Message, reason: str) -> None:
        """To the queue's dead-letter exchange, if it has one, with the headers RabbitMQ adds the first time a
        message dies: where it was published, the queue it died in and why. Holds the lock."""
        if queue.dead_letter_exchange not in self.exchanges:
            return
        first = {"x-first-death-exchange": message.exchange, "x-first-death-queue": queue.name,
                 "x-first-death-reason": reason}
        self.route(queue.dead_letter_exchange, message.routing_key, message.body, first | dict(message.headers),
                   message.publisher)


class InMemoryTransport(Transport):
    """One connection to an `InMemoryBroker`; several may share a broker across threads. `user` stands for
    the broker user: it is the publisher of every message this transport publishes."""

    def __init__(self, broker: InMemoryBroker | None = None, user: str = "") -> None:
        self.broker = broker or InMemoryBroker()
        self.user = user
        self.closed = False
        self._mine: dict[int, str] = {}  # unacked tag -> queue, for this connection

    def _check(self) -> None:
        if self.closed:
            raise TransportError("transport is closed")

    def declare_exchange(self, name: str, kind: str = "topic") -> None:
        self._check()
        if kind not in ("topic", "fanout", "direct"):
            raise TransportError(f"unsupported exchange kind {kind!r}")
        with self.broker.lock:
            old = self.broker.exchanges.setdefault(name, kind)
            if old != kind:
                raise TransportError(f"exchange {name!r} exists with kind {old!r}")

    def declare_queue(self, name: str, dead_letter_exchange: str | None = None,
                      limits: QueueLimits | None = None) -> None:
        self._check()
        with self.broker.lock:
            self.broker.queues.setdefault(name, _Queue(name, dead_letter_exchange, limits))

    def delete_queue(self, name: str) -> None:
        self._check()
        with self.broker.lock:
            self.broker.queues.pop(name, None)
            for keys in self.broker.bindings.values():
                keys -= {b for b in keys if b[0] == name}

    def bind(self, queue: str, exchange: str, binding_key: str) -> None:
        self._check()
        with self.broker.lock:
            if queue not in self.broker.queues:
                raise TransportError(f"queue {queue!r} is not declared")
            if exchange not in self.broker.exchanges:
                raise TransportError(f"exchange {exchange!r} is not declared")
            self.broker.bindings.setdefault(exchange, set()).add((queue, binding_key))

    def unbind(self, queue: str, exchange: str, binding_key: str) -> None:
        self._check()
        with self.broker.lock:
            self.broker.bindings.get(exchange, set()).discard((queue, binding_key))

    def publish(
        self, exchange: str, routing_key: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        self._check()
        with self.broker.lock:
            self.broker.route(exchange, routing_key, body, headers or {}, self.user)

    def receive(self, queue: str, timeout: float = 0.0) -> Message | None:
        got = self.receive_any([queue], timeout)
        return None if got is None else got[1]

    def receive_any(self, queues: Sequence[str], timeout: float = 0.0) -> tuple[int, Message] | None:
        self._check()
        with self.broker.lock:
            found = []
            for queue in queues:
                q = self.broker.queues.get(queue)
                if q is None:
                    raise TransportError(f"queue {queue!r} is not declared")
                found.append(q)

            def first_ready() -> int | None:
                return next((i for i, q in enumerate(found) if q.ready), None)

            if first_ready() is None and timeout > 0:
                self.broker.lock.wait_for(lambda: first_ready() is not None or self.closed, timeout)
            index = first_ready()
            if index is None or self.closed:
                return None
            msg = found[index].ready.popleft()
            found[index].unacked[msg.tag] = msg
            self._mine[msg.tag] = queues[index]
            return index, msg

    def _settle(self, message: Message) -> tuple[_Queue, Message]:
        queue = self._mine.pop(message.tag, None)
        q = self.broker.queues.get(queue) if queue else None
        if q is None or message.tag not in q.unacked:
            raise TransportError(f"message {message.tag} is not unacknowledged on this transport")
        return q, q.unacked.pop(message.tag)

    def ack(self, message: Message) -> None:
        self._check()
        with self.broker.lock:
            self._settle(message)

    def reject(self, message: Message, requeue: bool = False) -> None:
        self._check()
        with self.broker.lock:
            q, msg = self._settle(message)
            if requeue:
                q.ready.appendleft(replace(msg, redelivered=True))
                self.broker.lock.notify_all()
            else:
                self.broker.dead_letter(q, msg, "rejected")

    def close(self) -> None:
        """Close the connection; its unacknowledged messages go back to their queues, as in AMQP."""
        if self.closed:
            return
        with self.broker.lock:
            for tag, queue in self._mine.items():
                q = self.broker.queues.get(queue)
                if q is not None and tag in q.unacked:
                    q.ready.appendleft(replace(q.unacked.pop(tag), redelivered=True))
            self._mine.clear()
            self.closed = True
            self.broker.lock.notify_all()
