"""The transport a worker's message driver talks through: a thin wrapper over any `Transport`.

It adds four things the round loop needs, without touching the driver:
- acks are deferred: the runner takes a round's (`take_acks()`) and sends them (`ack_now`) once the
  round's checkpoint is on disk. A worker killed mid-round loses no neighbour model: the broker redelivers the
  unacknowledged ones to the restarted worker, which resumes from that checkpoint.
  Rejections (dead-lettering) are not deferred.
- published messages carry a `sent_at` header; deliveries measure the lag from it.
- `interrupt()` makes the next `receive` raise `RunInterrupted`, so a stop never waits for a
  round timeout.
- models are published in the broker's memory only (not persistent: RabbitMQ writes no copy of each to disk,
  about a third of its CPU on the runtime benchmark's config), and the models of the sender's last
  RETAINED_ROUNDS rounds are kept: when the connection had to be opened again (the broker may have restarted and
  lost them), they are published again, marked REPUBLISHED_HEADER. A neighbour is at most a round behind the
  sender while it still needs its models (it waits for them); a receiver that used a model already drops the copy
  (a repeat marked so does not count against its sender, once per message: runtime.driver.admission). A round
  whose models would take the kept ones past RETAINED_BYTES is published persistent instead, and not kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from dfca.identity import topics
from dfca.transport import Message, QueueLimits, Transport
from dfca.transport.base import Outgoing

SENT_AT_HEADER = "sent_at"
REPUBLISHED_HEADER = "republished"  # on a model published again after a new connection: that connection's number
RETAINED_ROUNDS = 2  # the sender's rounds whose models are published again after a new connection
RETAINED_BYTES = 256 << 20  # at most this many bytes of models kept for that; beyond, models are persistent

log = logging.getLogger(__name__)


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
        self.republished = 0  # models published again after a new connection
        self._retained: dict[int, list[Outgoing]] = {}  # round -> its models as published (stamped)
        self._connections = inner.connections

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

    def publish_pipelined(self, messages: Sequence[Outgoing], persistent: bool = True) -> None:
        """Models are published not persistent and kept to be published again after a new connection (see the
        module's docstring) where the batch is all models and fits RETAINED_BYTES; anything else as asked."""
        self._republish_if_reconnected()
        stamped = self._stamped(messages)
        self.inner.publish_pipelined(stamped, persistent=persistent and not self._retain(stamped))

    def _retain(self, messages: list[Outgoing]) -> bool:
        """Keep `messages` (True) where each is a model of a round and they fit beside the models of the last
        RETAINED_ROUNDS rounds; older rounds' models are let go."""
        rounds = [r for exchange, _, _, headers in messages if (r := round_of(exchange, headers)) is not None]
        if not messages or len(rounds) < len(messages):
            return False
        newest = max([*rounds, *self._retained])
        for old in [r for r in self._retained if r <= newest - RETAINED_ROUNDS]:
            del self._retained[old]
        kept = sum(len(body) for round_ in self._retained.values() for _, _, body, _ in round_)
        if kept + sum(len(body) for _, _, body, _ in messages) > RETAINED_BYTES:
            return False
        for message, r in zip(messages, rounds, strict=True):
            self._retained.setdefault(r, []).append(message)
        return True

    def _republish_if_reconnected(self) -> None:
        """After a new connection, the kept models once more, marked REPUBLISHED_HEADER."""
        if (connections := self.inner.connections) == self._connections:
            return
        self._connections = connections
        again = [(exchange, key, body, {**(headers or {}), REPUBLISHED_HEADER: str(connections)})
                 for kept in self._retained.values() for exchange, key, body, headers in kept]
        if again:
            log.warning("connection %d: publishing the %d models of rounds %s again (a restarted broker lost what "
                        "it held in memory)", connections, len(again), sorted(self._retained))
            self.inner.publish_pipelined(again, persistent=False)
            self.republished += len(again)

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
        self._republish_if_reconnected()
        message = self.inner.receive(queue, timeout)
        if message is not None:
            self._note(message)
        return message

    def receive_any(self, queues: Sequence[str], timeout: float = 0.0) -> tuple[int, Message] | None:
        if self._interrupted.is_set():
            raise RunInterrupted
        self._republish_if_reconnected()
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


def round_of(exchange: str, headers: Mapping[str, str] | None) -> int | None:
    """The round a published model names in its headers; None for anything else."""
    if exchange != topics.MODELS_EXCHANGE or headers is None:
        return None
    try:
        return int(headers["round"])
    except (KeyError, ValueError):
        return None
