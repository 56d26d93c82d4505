"""The transport a worker's message driver talks through: a thin wrapper over any `Transport`.

It adds three things the round loop needs, without touching the driver:
- acks are deferred: the runner takes a round's (`take_acks()`) and sends them (`ack_now`) once the
  round's checkpoint is on disk. A worker killed mid-round loses no neighbour model: the broker redelivers the
  unacknowledged ones to the restarted worker, which resumes from that checkpoint.
  Rejections (dead-lettering) are not deferred.
- published messages carry a `sent_at` header; deliveries measure the lag from it.
- `interrupt()` makes the next `receive` raise `RunInterrupted`, so a stop never waits for a
  round timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from dfca.identity import topics
from dfca.transport import Message, QueueLimits, Transport
from dfca.transport.base import Outgoing

SENT_AT_HEADER = "sent_at"


class RunInterrupted(Exception):
    """The runner was asked to stop while its driver was waiting for messages."""


class HostTransport(Transport):
    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.user = inner.user
        self._pending_acks: list[Message] = []
        self._interrupted = threading.Event()
        self.lag_total = 0.0
        self.lag_count = 0
        self.bytes_published = 0

    # -- the additions ---------------------------------------------------------------------------
    def flush_acks(self) -> int:
        pending = self.take_acks()
        self.ack_now(pending)
        return len(pending)

    def take_acks(self) -> list[Message]:
        """The deferred acks so far, to be sent (`ack_now`) once what they depend on is done; later acks wait."""
        pending, self._pending_acks = self._pending_acks, []
        return pending

    def ack_now(self, messages: list[Message]) -> None:
        """Acknowledge messages taken by `take_acks` (from any thread)."""
        self.inner.ack_many(messages)

    def interrupt(self) -> None:
        self._interrupted.set()

    def take_bytes_published(self) -> int:
        published, self.bytes_published = self.bytes_published, 0
        return published

    def take_lag(self) -> float:
        """Mean delivery lag since the last call, in seconds (0 when nothing arrived)."""
        mean = self.lag_total / self.lag_count if self.lag_count else 0.0
        self.lag_total, self.lag_count = 0.0, 0
        return mean

    def _note(self, message: Message) -> None:
        if message.exchange != topics.MODELS_EXCHANGE:
            return
        try:
            lag = time.time() - float(str(message.headers[SENT_AT_HEADER]))
        except (KeyError, ValueError):
            return
        if 0 <= lag < 3600:
            self.lag_total += lag
            self.lag_count += 1

    # -- Transport ---------------------------------------------------------------------------------
    def declare_exchange(self, name: str, kind: str = "topic") -> None:
        self.inner.declare_exchange(name, kind)

    def declare_queue(self, name: str, dead_letter_exchange: str | None = None,
                      limits: QueueLimits | None = None) -> None:
        self.inner.declare_queue(name, dead_letter_exchange, limits)

    def delete_queue(self, name: str) -> None:
        self.inner.delete_queue(name)

    def bind(self, queue: str, exchange: str, binding_key: str) -> None:
        self.inner.bind(queue, exchange, binding_key)

    def unbind(self, queue: str, exchange: str, binding_key: str) -> None:
        self.inner.unbind(queue, exchange, binding_key)

    def publish(
        self, exchange: str, routing_key: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        self.publish_many([(exchange, routing_key, body, headers)])

    def publish_many(self, messages: Sequence[Outgoing]) -> None:
        self.inner.publish_many(self._stamped(messages))

    def publish_pipelined(self, messages: Sequence[Outgoing]) -> None:
        self.inner.publish_pipelined(self._stamped(messages))

    def await_confirms(self) -> None:
        self.inner.await_confirms()

    def confirmation(self) -> Callable[[], None]:
        return self.inner.confirmation()

    def _stamped(self, messages: Sequence[Outgoing]) -> list[Outgoing]:
        """The messages with their send time (for the delivery lag), counted as published."""
        now = f"{time.time():.6f}"
        self.bytes_published += sum(len(body) for _, _, body, _ in messages)
        return [(exchange, key, body, {**(headers or {}), SENT_AT_HEADER: now})
                for exchange, key, body, headers in messages]

    def receive(self, queue: str, timeout: float = 0.0) -> Message | None:
        if self._interrupted.is_set():
            raise RunInterrupted
        message = self.inner.receive(queue, timeout)
        if message is not None:
            self._note(message)
        return message

    def receive_any(self, queues: Sequence[str], timeout: float = 0.0) -> tuple[int, Message] | None:
        if self._interrupted.is_set():
            raise RunInterrupted
        got = self.inner.receive_any(queues, timeout)
        if got is not None:
            self._note(got[1])
        return got

    def ack(self, message: Message) -> None:
        self._pending_acks.append(message)

    def reject(self, message: Message, requeue: bool = False) -> None:
        self.inner.reject(message, requeue)

    def close(self) -> None:
        """Close the connection; deferred acks are dropped, so the broker redelivers those messages."""
        self._pending_acks.clear()
        self.inner.close()
