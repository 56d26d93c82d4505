"""RabbitMQ transport: the `Transport` contract over AMQP 0-9-1 with pika.

Threading. Pika is not thread-safe, so one I/O thread owns the connection: a `SelectConnection`
on a private `IOLoop`. Every call from another thread is marshalled onto that loop with
`IOLoop.add_callback_threadsafe`, and the calling thread waits on a `concurrent.futures.Future`.
Incoming frames are read by dfca.transport.amqp_frames (one copy a frame; pika's own reader copied a
frame's bytes again for every 4 kB read). What the I/O thread keeps in flight is in
dfca.transport.rabbitmq_records; chunked messages' headers in dfca.transport.chunking.
The I/O thread uses separate channels so that a failing operation cannot disturb the others:

- an *admin* channel for declare/bind/unbind/delete and passive checks, run one at a time so a
  broker error (404, 406, ...) is reported as `TransportError` to exactly the caller that caused it;
- a *publish* channel in confirm mode: `publish` returns once the broker has confirmed the message
  (a negative confirm raises `TransportError`). Messages are persistent (delivery_mode=2) unless
  published with `persistent=False` (delivery_mode=1: kept in memory only); a message that matches no
  binding is dropped, as in AMQP;
- one *consumer* channel per consumed queue. `receive(queue)` starts a consumer lazily (manual
  acks, `basic_qos` prefetch per channel) whose deliveries go into a thread-safe local buffer;
  `receive` pops from that buffer. `ack`/`reject` are sent on the channel the message came from.

Exchanges and queues are durable; `declare_queue(name, dead_letter_exchange)` sets the
`x-dead-letter-exchange` argument. Closing the transport closes the connection, so the broker
returns the messages that were not acknowledged to their queues.

Reconnection. After a lost connection (broker restart, network) the I/O thread reconnects with
exponential backoff (0.25 s doubling up to 5 s), redeclares every exchange, queue and binding this
transport declared, then resumes its consumers and resends unconfirmed publishes. Messages that
were unacknowledged when the connection died are redelivered by the broker (`redelivered=True`);
acking or rejecting one of the stale copies is a no-op (logged), so consumers must tolerate
duplicates (dfca applies a model at most once per identity). Publishes during an outage block and
are retried until `publish_timeout` (default 60 s), then raise `TransportError`; a publish that
timed out while in flight may still have been delivered. Declarations wait for the same deadline.

Large messages. RabbitMQ 3.10 refuses bodies above `max_message_size` (default 128 MiB). Bodies
longer than `chunk_bytes` (default 16 MiB) are published as several messages that carry the user
headers plus `x-chunk-id` (uuid of the logical message), `x-chunk-index` (0-based) and
`x-chunk-count`. The consumer of each queue reassembles the parts (in any order, interleaved with
other messages) into one `Message`; acking or rejecting it acks or rejects all its parts together,
and a rejected message is dead-lettered part by part (a dead-letter consumer using this transport
reassembles it again). While parts are held, the channel prefetch is raised so a chunked message
larger than `prefetch` parts can always complete. Header names starting with `x-chunk-` are
reserved. The parts of a message whose publisher died midway stay unacknowledged until this
transport closes.

A delivery that cannot be taken apart (malformed chunk headers: a part outside its count, counts that
disagree, more than MAX_CHUNKS parts) is delivered as it is, with header `x-unreadable` saying why, so
that its consumer rejects and counts it; nothing a message carries escapes into pika's callback.

Headers. Header values are delivered as strings; broker-added tables such as `x-death` are not
exposed (the string headers `x-first-death-*` are). Every message is published with `user_id` set to the
URL's user, which RabbitMQ validates; deliveries carry it as `Message.publisher`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue as queue_module
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pika
import pika.exceptions
from pika.adapters.select_connection import IOLoop
from pika.channel import Channel

from dfca.transport.amqp_frames import FrameReadingConnection
from dfca.transport.base import Message, Outgoing, QueueLimits, Transport, TransportError
from dfca.transport.chunking import (
    CHUNK_COUNT,
    CHUNK_ID,
    MAX_CHUNKS,
    RESERVED_HEADER_PREFIX,
    chunk_headers,
    chunk_position,
    delivered_headers,
    split_body,
)
from dfca.transport.rabbitmq_records import (
    AdminOp,
    Consumer,
    Delivery,
    Frame,
    PartialMessage,
    Publish,
    Topology,
)

log = logging.getLogger(__name__)

UNREADABLE_HEADER = "x-unreadable"  # set on a delivery the transport could not take apart; its value says why
EXCHANGE_KINDS = ("topic", "fanout", "direct")
MAX_PREFETCH = 65535  # basic.qos prefetch_count is an AMQP short
RECONNECT_FIRST_DELAY_S = 0.25
RECONNECT_MAX_DELAY_S = 5.0
CLOSE_TIMEOUT_S = 15.0
SETTLED_CHUNK_IDS_KEPT = 4096


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _resolve(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Complete a future unless its waiter already gave up (cancelled) or it is done."""
    try:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _broker_error(reason: BaseException) -> TransportError:
    if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
        return TransportError(f"broker refused: {reason.reply_code} {reason.reply_text}")
    return TransportError(f"channel closed: {reason!r}")


class RabbitMQTransport(Transport):
    """`Transport` over a RabbitMQ broker at `url` (amqp:// or amqps://). See the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        prefetch: int = 64,
        heartbeat: int = 30,
        chunk_bytes: int = 16 << 20,
        publish_timeout: float = 60.0,
        name: str = "dfca",
    ) -> None:
        if prefetch < 1 or chunk_bytes < 1 or publish_timeout <= 0:
            raise ValueError("prefetch, chunk_bytes and publish_timeout must be positive")
        self.url = url
        self.prefetch = min(prefetch, MAX_PREFETCH)
        self.chunk_bytes = chunk_bytes
        self.publish_timeout = publish_timeout
        self.name = name
        self.connections = 0  # connections opened so far: 1 unless it had to reconnect
        self._params = pika.URLParameters(url)
        self.user = str(self._params.credentials.username)  # stamped as user_id: the broker proves it
        self._params.heartbeat = heartbeat
        self._params.connection_attempts = 1
        self._params.socket_timeout = 10
        self._params.blocked_connection_timeout = max(publish_timeout, 60.0)
        self._params.client_properties = {"connection_name": name}

        # Shared between user threads and the I/O thread.
        self._lock = threading.Lock()
        self._arrival = threading.Condition()  # notified on every delivery (receive_any waits on it)
        self._arrivals = 0
        self._closed = False
        self._tags = itertools.count(1)
        self._deliveries: dict[int, Delivery] = {}
        self._unconfirmed: list[Publish] = []  # publish_pipelined's records until await_confirms or confirmation()
        self._consumers: dict[str, Consumer] = {}
        self._known_exchanges: set[str] = {""}
        self._consumer_start_lock = threading.Lock()
        self._connected = threading.Event()
        self._fatal: TransportError | None = None

        # I/O-thread state.
        self._ioloop = IOLoop()
        self._conn: pika.SelectConnection | None = None
        self._closing = False
        self._reconnect_delay = RECONNECT_FIRST_DELAY_S
        self._reconnect_timer: object | None = None
        self._ever_connected = False
        self._topology = Topology()
        self._admin_channel: Channel | None = None
        self._admin_ops: collections.deque[AdminOp] = collections.deque()
        self._admin_busy: AdminOp | None = None
        self._topology_restored = False
        self._publish_channel: Channel | None = None
        self._publish_ready = False
        self._pending: collections.deque[Publish] = collections.deque()
        self._inflight: dict[int, Publish] = {}
        self._publish_seq = 0

        self._thread = threading.Thread(target=self._run, name=f"{name}-amqp-io", daemon=True)
        self._thread.start()
        if not self._connected.wait(publish_timeout) or self._fatal is not None:
            error = self._fatal or TransportError(
                f"cannot connect to {redact_url(url)} within {publish_timeout:g} s"
            )
            self.close()
            raise error

    # ------------------------------------------------------------------ public API

    def declare_exchange(self, name: str, kind: str = "topic") -> None:
        if kind not in EXCHANGE_KINDS:
            raise TransportError(f"unsupported exchange kind {kind!r}")

        def run(ch: Channel, done: Callable[[Frame], None]) -> None:
            ch.exchange_declare(name, exchange_type=kind, durable=True, callback=done)

        def remember() -> None:
            self._topology.exchanges[name] = kind

        self._admin(f"declare exchange {name!r}", run, remember)
        with self._lock:
            self._known_exchanges.add(name)

    def declare_queue(self, name: str, dead_letter_exchange: str | None = None,
                      limits: QueueLimits | None = None) -> None:
        """A queue that exists with other arguments (declared by an older version, say) is used as it is, with a
        warning: RabbitMQ cannot change a queue's arguments (it answers 406); delete the queue to get them."""
        arguments: dict[str, Any] | None = {
            **({"x-dead-letter-exchange": dead_letter_exchange} if dead_letter_exchange else {}),
            **(limits.arguments() if limits is not None else {})} or None

        def run(ch: Channel, done: Callable[[Frame], None], args: dict[str, Any] | None = arguments,
                passive: bool = False) -> None:
            ch.queue_declare(name, durable=True, passive=passive, arguments=args, callback=done)

        def remember(args: dict[str, Any] | None = arguments, passive: bool = False) -> None:
            self._topology.queues[name] = (args, passive)

        try:
            self._admin(f"declare queue {name!r}", run, remember)
        except TransportError as err:
            if "406" not in str(err) or arguments is None:
                raise
            log.warning("%s: queue %r exists with other arguments (%s); using it as it is, without %s",
                        self.name, name, err, arguments)
            self._admin(f"declare queue {name!r}", lambda ch, done: run(ch, done, None, True),
                        lambda: remember(None, True))

    def delete_queue(self, name: str) -> None:
        def run(ch: Channel, done: Callable[[Frame], None]) -> None:
            ch.queue_delete(name, callback=done)

        def forget() -> None:
            self._topology.queues.pop(name, None)
            self._topology.bindings = {b for b in self._topology.bindings if b[0] != name}

        self._admin(f"delete queue {name!r}", run, forget)
        with self._lock:
            consumer = self._consumers.pop(name, None)
        if consumer is not None:
            self._submit(lambda: self._retire_consumer(consumer))

    def bind(self, queue: str, exchange: str, binding_key: str) -> None:
        def run(ch: Channel, done: Callable[[Frame], None]) -> None:
            ch.queue_bind(queue, exchange, routing_key=binding_key, callback=done)

        def remember() -> None:
            self._topology.bindings.add((queue, exchange, binding_key))

        self._admin(f"bind {queue!r} to {exchange!r} with {binding_key!r}", run, remember)

    def unbind(self, queue: str, exchange: str, binding_key: str) -> None:
        def run(ch: Channel, done: Callable[[Frame], None]) -> None:
            ch.queue_unbind(queue, exchange, routing_key=binding_key, callback=done)

        def forget() -> None:
            self._topology.bindings.discard((queue, exchange, binding_key))

        self._admin(f"unbind {queue!r} from {exchange!r} with {binding_key!r}", run, forget)

    def publish(
        self, exchange: str, routing_key: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> None:
        self.publish_many([(exchange, routing_key, body, headers)])

    def publish_many(self, messages: Sequence[Outgoing]) -> None:
        """All of `messages` handed to the I/O thread at once, then every confirm awaited: one round trip's wait
        for the batch instead of one per message; returns once the broker has accepted every one."""
        self._confirmed(self._hand_over(messages))

    def publish_pipelined(self, messages: Sequence[Outgoing], persistent: bool = True) -> None:
        """Handed to the I/O thread at once; their confirms are awaited by `await_confirms`. Not `persistent`:
        delivery mode 1, so the broker writes no copy to disk (on the runtime benchmark's config about a third of
        the RabbitMQ node's CPU a round), and loses them if it restarts before they are consumed."""
        records = self._hand_over(messages, persistent)
        with self._lock:
            self._unconfirmed.extend(records)

    def await_confirms(self) -> None:
        self.confirmation()()

    def confirmation(self) -> Callable[[], None]:
        with self._lock:
            records, self._unconfirmed = self._unconfirmed, []
        return lambda: self._confirmed(records)

    def _hand_over(self, messages: Sequence[Outgoing], persistent: bool = True) -> list[Publish]:
        self._check_open()
        deadline = time.monotonic() + self.publish_timeout
        records = [r for exchange, key, body, headers in messages
                   for r in self._records(exchange, key, body, headers, deadline, persistent)]
        self._submit(lambda: self._enqueue_publishes(records))
        return records

    def _confirmed(self, records: list[Publish]) -> None:
        """Wait for each record's confirm (until its deadline); TransportError for a refusal or a timeout."""
        for record in records:
            try:
                record.future.result(timeout=max(record.deadline - time.monotonic(), 0.0))
            except TimeoutError:
                for r in records:
                    r.future.cancel()
                raise TransportError(
                    f"publish to {record.exchange!r} not confirmed within {self.publish_timeout:g} s"
                ) from None

    def _records(self, exchange: str, routing_key: str, body: bytes, headers: Mapping[str, str] | None,
                 deadline: float, persistent: bool = True) -> list[Publish]:
        """One message's publishes: its body in chunks of at most chunk_bytes, each with its own confirm."""
        user_headers = {str(k): str(v) for k, v in (headers or {}).items()}
        if any(k.startswith(RESERVED_HEADER_PREFIX) for k in user_headers):
            raise TransportError(f"header names starting with {RESERVED_HEADER_PREFIX!r} are reserved")
        self._check_exchange(exchange)
        parts = split_body(bytes(body), self.chunk_bytes)
        if len(parts) > MAX_CHUNKS:
            raise TransportError(f"a {len(body)}-byte body needs {len(parts)} parts of {self.chunk_bytes} bytes; "
                                 f"at most {MAX_CHUNKS}")
        chunk_id = uuid.uuid4().hex if len(parts) > 1 else ""
        return [
            Publish(
                exchange, routing_key, part,
                pika.BasicProperties(
                    delivery_mode=pika.DeliveryMode.Persistent if persistent else pika.DeliveryMode.Transient,
                    user_id=self.user,
                    headers=chunk_headers(user_headers, chunk_id, i, len(parts)) if chunk_id else user_headers,
                ),
                Future(), deadline,
            )
            for i, part in enumerate(parts)
        ]

    def receive(self, queue: str, timeout: float = 0.0) -> Message | None:
        self._check_open()
        consumer = self._consumer(queue)
        try:
            message = consumer.buffer.get(timeout=timeout) if timeout > 0 else consumer.buffer.get_nowait()
        except queue_module.Empty:
            return None
        if message is None:  # woken by close() (returns None, as in memory) or by the queue's deletion
            consumer.buffer.put(None)
            if consumer.dead and not self._closed:
                raise TransportError(f"queue {queue!r} was deleted")
            return None
        return message

    def receive_any(self, queues: Sequence[str], timeout: float = 0.0) -> tuple[int, Message] | None:
        deadline = time.monotonic() + timeout
        while True:
            with self._arrival:
                seen = self._arrivals
            for index, queue in enumerate(queues):  # not under _arrival: receive may wait on the I/O thread
                if (message := self.receive(queue, 0.0)) is not None:
                    return index, message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with self._arrival:
                if self._arrivals == seen:  # nothing arrived since the look
                    self._arrival.wait(remaining)

    def _notify_arrival(self) -> None:
        """A delivery, a close or a queue's deletion: wake every receive_any."""
        with self._arrival:
            self._arrivals += 1
            self._arrival.notify_all()

    def ack(self, message: Message) -> None:
        delivery = self._take_delivery(message)
        self._submit(lambda: self._settle(delivery, lambda ch, tag: ch.basic_ack(tag), final=True))

    def ack_many(self, messages: Sequence[Message]) -> None:
        """One hand-over to the I/O thread for all of them (`ack` wakes it once a message)."""
        deliveries: list[Delivery] = []
        error: TransportError | None = None
        for message in messages:
            try:
                deliveries.append(self._take_delivery(message))
            except TransportError as err:
                error = error or err
        if deliveries:
            self._submit(lambda: self._settle_all(deliveries))
        if error is not None:
            raise error

    def reject(self, message: Message, requeue: bool = False) -> None:
        delivery = self._take_delivery(message)
        self._submit(lambda: self._settle(
            delivery, lambda ch, tag: ch.basic_reject(tag, requeue=requeue), final=not requeue))

    def close(self) -> None:
        """Close the connection; the broker returns unacknowledged messages to their queues."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            consumers = list(self._consumers.values())
        try:
            self._ioloop.add_callback_threadsafe(self._shutdown)
        except Exception:  # the loop is already gone
            log.debug("I/O loop of %s already stopped", self.name)
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_TIMEOUT_S)
        for consumer in consumers:
            consumer.buffer.put(None)
        self._notify_arrival()

    # ------------------------------------------------------------------ user-thread helpers

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def _submit(self, callback: Callable[[], None]) -> None:
        self._check_open()
        try:
            self._ioloop.add_callback_threadsafe(callback)
        except Exception as err:
            raise TransportError(f"I/O loop of {self.name} is not running") from err

    def _admin(
        self, description: str, run: Callable[[Channel, Callable[[Frame], None]], None],
        on_success: Callable[[], None] | None = None,
    ) -> Frame:
        """Run one admin operation on the I/O thread and wait for its result."""
        self._check_open()
        future: Future[Frame] = Future()
        op = AdminOp(description, run, future, on_success, time.monotonic() + self.publish_timeout)
        self._submit(lambda: self._enqueue_admin(op))
        try:
            return future.result(timeout=self.publish_timeout)
        except TimeoutError:
            future.cancel()
            raise TransportError(f"{description}: no answer within {self.publish_timeout:g} s") from None

    def _check_exchange(self, exchange: str) -> None:
        """Publishing to a missing exchange raises, as in the in-memory transport (checked once)."""
        with self._lock:
            if exchange in self._known_exchanges:
                return

        def run(ch: Channel, done: Callable[[Frame], None]) -> None:
            ch.exchange_declare(exchange, passive=True, callback=done)

        try:
            self._admin(f"check exchange {exchange!r}", run)
        except TransportError as err:
            raise TransportError(f"exchange {exchange!r} is not declared ({err})") from err
        with self._lock:
            self._known_exchanges.add(exchange)

    def _consumer(self, queue: str) -> Consumer:
        with self._lock:
            consumer = self._consumers.get(queue)
        if consumer is not None:
            return consumer
        with self._consumer_start_lock:
            with self._lock:
                consumer = self._consumers.get(queue)
            if consumer is not None:
                return consumer

            def run(ch: Channel, done: Callable[[Frame], None]) -> None:
                ch.queue_declare(queue, passive=True, callback=done)

            try:
                self._admin(f"check queue {queue!r}", run)
            except TransportError as err:
                raise TransportError(f"queue {queue!r} is not declared ({err})") from err
            consumer = Consumer(queue)
            with self._lock:
                self._consumers[queue] = consumer
            self._submit(lambda: self._open_consumer(consumer))
            try:
                consumer.started.result(timeout=self.publish_timeout)
            except TimeoutError:
                with self._lock:
                    self._consumers.pop(queue, None)
                self._submit(lambda: self._retire_consumer(consumer))
                raise TransportError(f"consumer of {queue!r} did not start") from None
            return consumer

    def _take_delivery(self, message: Message) -> Delivery:
        self._check_open()
        with self._lock:
            delivery = self._deliveries.pop(message.tag, None)
        if delivery is None:
            raise TransportError(f"message {message.tag} is not unacknowledged on this transport")
        return delivery

    # ------------------------------------------------------------------ I/O thread: connection

    def _run(self) -> None:
        self._connect()
        try:
            self._ioloop.start()
        finally:
            self._fail_everything(TransportError("transport is closed"))
            self._ioloop.close()
            self._connected.set()

    def _connect(self) -> None:
        self._reconnect_timer = None
        if self._closing:
            return
        self._conn = FrameReadingConnection(
            self._params,
            on_open_callback=self._on_connection_open,
            on_open_error_callback=self._on_connection_open_error,
            on_close_callback=self._on_connection_closed,
            custom_ioloop=self._ioloop,
        )

    def _on_connection_open(self, conn: pika.SelectConnection) -> None:
        if conn is not self._conn:
            return
        log.info("%s connected to %s", self.name, redact_url(self.url))
        self.connections += 1
        self._reconnect_delay = RECONNECT_FIRST_DELAY_S
        self._topology_restored = False
        self._open_admin_channel()

    def _on_connection_open_error(self, conn: pika.SelectConnection, error: BaseException) -> None:
        if self._closing:
            self._ioloop.stop()
            return
        refused = (pika.exceptions.ProbableAuthenticationError, pika.exceptions.ProbableAccessDeniedError,
                   pika.exceptions.AuthenticationError)
        if not self._ever_connected and isinstance(error, refused):
            self._fatal = TransportError(f"broker at {redact_url(self.url)} refused the login: {error!r}")
            self._connected.set()
            self._closing = True
            self._ioloop.stop()
            return
        log.warning("%s cannot connect to %s: %r", self.name, redact_url(self.url), error)
        self._schedule_reconnect()

    def _on_connection_closed(self, conn: pika.SelectConnection, reason: BaseException) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._on_channels_lost(reason)
        if self._closing:
            self._ioloop.stop()
            return
        log.warning("%s lost its connection: %r; reconnecting", self.name, reason)
        self._schedule_reconnect()

    def _schedule_reconnect(self) -> None:
        delay = self._reconnect_delay
        self._reconnect_delay = min(self._reconnect_delay * 2, RECONNECT_MAX_DELAY_S)
        self._reconnect_timer = self._ioloop.call_later(delay, self._connect)

    def _on_channels_lost(self, reason: BaseException) -> None:
        """The connection died: forget its channels; work waits for (or is redone on) the next one."""
        if self._admin_channel is not None:
            self._on_admin_channel_closed(self._admin_channel, reason)
        if self._publish_channel is not None:
            self._on_publish_channel_closed(self._publish_channel, reason)
        with self._lock:
            consumers = list(self._consumers.values())
        for consumer in consumers:
            if consumer.channel is not None:
                self._on_consumer_channel_closed(consumer, consumer.channel, reason)

    def _open_connection_ready(self) -> bool:
        return self._conn is not None and self._conn.is_open and not self._closing

    def _on_topology_restored(self) -> None:
        """Admin channel is up and the declared topology is back: start publishing and consuming."""
        self._ever_connected = True
        self._open_publish_channel()
        with self._lock:
            consumers = list(self._consumers.values())
        for consumer in consumers:
            if consumer.channel is None and not consumer.dead:
                self._open_consumer(consumer)
        self._connected.set()

    def _shutdown(self) -> None:
        self._closing = True
        if self._reconnect_timer is not None:
            self._ioloop.remove_timeout(self._reconnect_timer)
            self._reconnect_timer = None
        self._fail_everything(TransportError("transport is closed"))
        conn = self._conn
        if conn is None or conn.is_closed:
            self._ioloop.stop()
            return
        try:
            conn.close()
        except pika.exceptions.ConnectionWrongStateError:
            self._ioloop.stop()

    def _fail_everything(self, error: TransportError) -> None:
        for op in [*self._admin_ops, *([self._admin_busy] if self._admin_busy else [])]:
            if op.future is not None:
                _resolve(op.future, error=error)
        self._admin_ops.clear()
        self._admin_busy = None
        for record in [*self._pending, *self._inflight.values()]:
            _resolve(record.future, error=error)
        self._pending.clear()
        self._inflight.clear()
        with self._lock:
            consumers = list(self._consumers.values())
        for consumer in consumers:
            _resolve(consumer.started, error=error)

    # ------------------------------------------------------------------ I/O thread: admin channel

    def _open_admin_channel(self) -> None:
        if self._open_connection_ready():
            assert self._conn is not None
            self._conn.channel(on_open_callback=self._on_admin_channel_open)

    def _on_admin_channel_open(self, channel: Channel) -> None:
        self._admin_channel = channel
        channel.add_on_close_callback(self._on_admin_channel_closed)
        if not self._topology_restored:
            self._topology_restored = True
            self._admin_ops.extendleft(reversed(self._restore_topology_ops()))
        self._pump_admin()

    def _restore_topology_ops(self) -> list[AdminOp]:
        ops: list[AdminOp] = []
        topology = self._topology
        for name, kind in topology.exchanges.items():
            ops.append(AdminOp(f"redeclare exchange {name!r}",
                                lambda ch, done, n=name, k=kind: ch.exchange_declare(
                                    n, exchange_type=k, durable=True, callback=done)))
        for name, (arguments, passive) in topology.queues.items():
            ops.append(AdminOp(f"redeclare queue {name!r}",
                                lambda ch, done, n=name, a=arguments, p=passive: ch.queue_declare(
                                    n, durable=True, passive=p, arguments=a, callback=done)))
        for queue, exchange, key in topology.bindings:
            ops.append(AdminOp(f"rebind {queue!r} to {exchange!r} with {key!r}",
                                lambda ch, done, q=queue, e=exchange, k=key: ch.queue_bind(
                                    q, e, routing_key=k, callback=done)))
        ops.append(AdminOp("topology restored", lambda ch, done: (self._on_topology_restored(), done(None))))
        return ops

    def _enqueue_admin(self, op: AdminOp) -> None:
        self._admin_ops.append(op)
        self._pump_admin()

    def _pump_admin(self) -> None:
        while self._admin_busy is None and self._admin_channel is not None and self._admin_ops:
            op = self._admin_ops.popleft()
            if op.future is not None:
                if not op.started:
                    if not op.future.set_running_or_notify_cancel():
                        continue  # the caller gave up before it ran
                    op.started = True
                elif time.monotonic() > op.deadline:
                    _resolve(op.future, error=TransportError(f"{op.description}: timed out"))
                    continue
            self._admin_busy = op
            try:
                op.run(self._admin_channel, lambda frame, op=op: self._on_admin_done(op, frame))
            except Exception as err:  # pika refused to send it (e.g. a bad argument)
                self._admin_busy = None
                if op.future is not None:
                    _resolve(op.future, error=TransportError(f"{op.description}: {err!r}"))

    def _on_admin_done(self, op: AdminOp, frame: Frame) -> None:
        if self._admin_busy is not op:
            return
        self._admin_busy = None
        if op.on_success is not None:
            op.on_success()
        if op.future is not None:
            _resolve(op.future, frame)
        self._pump_admin()

    def _on_admin_channel_closed(self, channel: Channel, reason: BaseException) -> None:
        if channel is not self._admin_channel:
            return
        self._admin_channel = None
        op, self._admin_busy = self._admin_busy, None
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            # The running operation caused it: report it, carry on with a fresh channel.
            if op is not None:
                log.debug("%s: %s failed: %r", self.name, op.description, reason)
                if op.future is not None:
                    _resolve(op.future, error=TransportError(f"{op.description}: {_broker_error(reason)}"))
                else:
                    log.warning("%s: %s failed: %r", self.name, op.description, reason)
            self._open_admin_channel()
        elif op is not None:
            self._admin_ops.appendleft(op)  # connection lost: run it again after reconnecting

    # ------------------------------------------------------------------ I/O thread: publishing

    def _open_publish_channel(self) -> None:
        if self._open_connection_ready():
            assert self._conn is not None
            self._conn.channel(on_open_callback=self._on_publish_channel_open)

    def _on_publish_channel_open(self, channel: Channel) -> None:
        self._publish_channel = channel
        self._publish_seq = 0
        channel.add_on_close_callback(self._on_publish_channel_closed)

        def confirm_ok(_frame: Frame) -> None:
            if channel is self._publish_channel:
                self._publish_ready = True
                self._flush_publishes()

        channel.confirm_delivery(self._on_confirm, callback=confirm_ok)

    def _enqueue_publishes(self, records: list[Publish]) -> None:
        self._pending.extend(records)
        self._flush_publishes()

    def _flush_publishes(self) -> None:
        channel = self._publish_channel
        while self._publish_ready and channel is not None and channel.is_open and self._pending:
            record = self._pending.popleft()
            if not record.started:
                if not record.future.set_running_or_notify_cancel():
                    continue
                record.started = True
            elif time.monotonic() > record.deadline or record.future.done():
                _resolve(record.future, error=TransportError("publish timed out during an outage"))
                continue
            channel.basic_publish(record.exchange, record.routing_key, record.body, record.properties)
            self._publish_seq += 1
            self._inflight[self._publish_seq] = record

    def _on_confirm(self, frame: Frame) -> None:
        method = frame.method
        tag = method.delivery_tag
        if method.multiple:
            tags = list(itertools.takewhile(lambda t: t <= tag, self._inflight))
        else:
            tags = [tag] if tag in self._inflight else []
        nacked = isinstance(method, pika.spec.Basic.Nack)
        for t in tags:
            record = self._inflight.pop(t)
            if nacked:
                _resolve(record.future, error=TransportError(f"broker rejected a message to {record.exchange!r}"))
            else:
                _resolve(record.future)

    def _on_publish_channel_closed(self, channel: Channel, reason: BaseException) -> None:
        if channel is not self._publish_channel:
            return
        self._publish_channel = None
        self._publish_ready = False
        unconfirmed = list(self._inflight.values())
        self._inflight.clear()
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            # e.g. 404: an exchange was deleted under us; the unconfirmed messages' fate is unknown.
            with self._lock:
                self._known_exchanges.intersection_update({"", *self._topology.exchanges})
            for record in unconfirmed:
                _resolve(record.future, error=_broker_error(reason))
            self._open_publish_channel()
        else:
            self._pending.extendleft(reversed(unconfirmed))  # resend after reconnecting

    # ------------------------------------------------------------------ I/O thread: consuming

    def _open_consumer(self, consumer: Consumer) -> None:
        if self._open_connection_ready() and consumer.channel is None and not consumer.dead:
            assert self._conn is not None
            self._conn.channel(on_open_callback=lambda ch: self._on_consumer_channel_open(consumer, ch))

    def _on_consumer_channel_open(self, consumer: Consumer, channel: Channel) -> None:
        if consumer.dead or self._closing:
            channel.close()
            return
        consumer.channel = channel
        consumer.generation += 1
        generation = consumer.generation
        consumer.partial.clear()
        consumer.held_chunk_parts = 0
        consumer.qos_limit = self.prefetch
        channel.add_on_close_callback(lambda ch, reason: self._on_consumer_channel_closed(consumer, ch, reason))
        channel.add_on_cancel_callback(lambda _frame: self._on_consumer_cancelled(consumer, channel))
        channel.basic_qos(prefetch_count=self.prefetch, global_qos=True)
        channel.basic_consume(
            consumer.queue,
            on_message_callback=lambda ch, method, props, body: self._on_delivery(
                consumer, generation, ch, method, props, body),
            auto_ack=False,
            callback=lambda _frame: _resolve(consumer.started),
        )

    def _on_consumer_channel_closed(self, consumer: Consumer, channel: Channel, reason: BaseException) -> None:
        if channel is not consumer.channel:
            return
        consumer.channel = None
        self._drop_buffered(consumer)
        if isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            if reason.reply_code == 404 or not consumer.started.done():
                _resolve(consumer.started, error=_broker_error(reason))
                self._forget_consumer(consumer)
            else:
                log.warning("%s: consumer channel of %r closed: %r; reopening", self.name, consumer.queue, reason)
                self._ioloop.call_later(RECONNECT_FIRST_DELAY_S, lambda: self._open_consumer(consumer))

    def _on_consumer_cancelled(self, consumer: Consumer, channel: Channel) -> None:
        """The broker cancelled the consumer: its queue was deleted."""
        log.info("%s: consumer of %r cancelled by the broker", self.name, consumer.queue)
        self._forget_consumer(consumer)
        self._retire_consumer(consumer)

    def _forget_consumer(self, consumer: Consumer) -> None:
        consumer.dead = True
        with self._lock:
            if self._consumers.get(consumer.queue) is consumer:
                del self._consumers[consumer.queue]

    def _retire_consumer(self, consumer: Consumer) -> None:
        consumer.dead = True
        channel = consumer.channel
        consumer.channel = None
        self._drop_buffered(consumer)
        consumer.buffer.put(None)  # wake a waiting receive(); it sees the queue is gone
        self._notify_arrival()
        if channel is not None and channel.is_open:
            channel.close()

    def _drop_buffered(self, consumer: Consumer) -> None:
        """Messages buffered on a dead channel: the broker redelivers them, so drop the local copies."""
        consumer.partial.clear()
        consumer.held_chunk_parts = 0
        while True:
            try:
                message = consumer.buffer.get_nowait()
            except queue_module.Empty:
                return
            if message is not None:
                with self._lock:
                    self._deliveries.pop(message.tag, None)

    def _on_delivery(
        self, consumer: Consumer, generation: int, channel: Channel,
        method: pika.spec.Basic.Deliver, properties: pika.BasicProperties, body: bytes,
    ) -> None:
        """Nothing one message carries may escape into pika: that would abort the connection, the broker would
        redeliver the message and the consumer would loop on it for good. A delivery this transport cannot take
        apart (malformed chunk headers) is handed on as it is, with the header UNREADABLE_HEADER naming what is
        wrong: the consumer rejects it (to the dead-letter exchange, once) and counts it; a dead-letter consumer
        counts it too. Acking or rejecting it settles the parts of its chunked message held so far as well."""
        if channel is not consumer.channel or generation != consumer.generation:
            return
        try:
            self._accept_delivery(consumer, channel, method, properties, body)
        except Exception as err:  # a poison message, whatever it is
            log.warning("%s: a delivery on %r cannot be taken apart (%s); handed on marked %s", self.name,
                        consumer.queue, err, UNREADABLE_HEADER)
            self._hand_on_unreadable(consumer, channel, method, properties, body, err)

    def _accept_delivery(self, consumer: Consumer, channel: Channel, method: pika.spec.Basic.Deliver,
                       properties: pika.BasicProperties, body: bytes) -> None:
        raw = properties.headers or {}
        if CHUNK_ID not in raw:
            self._deliver(consumer, method.exchange, method.routing_key, body, raw,
                          (method.delivery_tag,), method.redelivered, None, properties.user_id)
            return
        chunk_id = str(raw[CHUNK_ID])
        if chunk_id in consumer.settled_chunk_ids:  # a duplicate part resent after a reconnect
            channel.basic_ack(method.delivery_tag)
            return
        index, count = chunk_position(raw)
        partial = consumer.partial.setdefault(chunk_id, PartialMessage(count))
        if partial.count != count:
            raise ValueError(f"chunk {chunk_id}: {CHUNK_COUNT} {count} after {partial.count}")
        if partial.parts and partial.publisher != properties.user_id:
            raise ValueError(f"chunk {chunk_id}: parts from {partial.publisher!r} and {properties.user_id!r}")
        partial.publisher = properties.user_id
        partial.parts.setdefault(index, body)
        partial.delivery_tags.append(method.delivery_tag)
        partial.redelivered |= bool(method.redelivered)
        consumer.held_chunk_parts += 1
        self._adjust_prefetch(consumer)
        if len(partial.parts) < partial.count:
            return
        del consumer.partial[chunk_id]
        whole = b"".join(partial.parts[i] for i in range(partial.count))
        self._deliver(consumer, method.exchange, method.routing_key, whole, raw,
                      tuple(partial.delivery_tags), partial.redelivered, chunk_id, partial.publisher)

    def _hand_on_unreadable(self, consumer: Consumer, channel: Channel, method: pika.spec.Basic.Deliver,
                            properties: pika.BasicProperties, body: bytes, err: Exception) -> None:
        raw = dict(properties.headers or {})
        chunk_id = str(raw.get(CHUNK_ID, ""))
        partial = consumer.partial.pop(chunk_id, None) if chunk_id else None
        tags = [method.delivery_tag]
        if partial is not None:
            held = [t for t in partial.delivery_tags if t != method.delivery_tag]
            consumer.held_chunk_parts -= len(partial.delivery_tags)
            tags = held + tags
            consumer.settled_chunk_ids[chunk_id] = None  # later parts of it are acked as duplicates
        raw[UNREADABLE_HEADER] = str(err)[:200]
        try:
            self._deliver(consumer, method.exchange, method.routing_key, body, raw, tuple(tags),
                          bool(method.redelivered), None, properties.user_id)
            self._adjust_prefetch(consumer)
        except Exception:  # not even that: drop it to the dead-letter exchange here
            log.exception("%s: dead-lettering an unreadable delivery on %r", self.name, consumer.queue)
            with contextlib.suppress(Exception):
                for tag in tags:
                    channel.basic_reject(tag, requeue=False)

    def _deliver(
        self, consumer: Consumer, exchange: str, routing_key: str, body: bytes, raw: Mapping[str, Any],
        delivery_tags: tuple[int, ...], redelivered: bool, chunk_id: str | None, publisher: str | None,
    ) -> None:
        tag = next(self._tags)
        message = Message(exchange, routing_key, body, delivered_headers(raw), tag=tag,
                          redelivered=bool(redelivered), publisher=str(publisher or ""))
        with self._lock:
            self._deliveries[tag] = Delivery(consumer, consumer.generation, delivery_tags, chunk_id)
        consumer.buffer.put(message)
        self._notify_arrival()

    def _adjust_prefetch(self, consumer: Consumer) -> None:
        """Keep room for `prefetch` messages beyond the chunk parts held, so chunked messages complete."""
        channel = consumer.channel
        if channel is None or not channel.is_open:
            return
        wanted = self.prefetch + consumer.held_chunk_parts
        if wanted > consumer.qos_limit:
            consumer.qos_limit = min(MAX_PREFETCH, self.prefetch + 2 * consumer.held_chunk_parts)
        elif consumer.held_chunk_parts == 0 and consumer.qos_limit != self.prefetch:
            consumer.qos_limit = self.prefetch
        else:
            return
        channel.basic_qos(prefetch_count=consumer.qos_limit, global_qos=True)

    def _settle_all(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            self._settle(delivery, lambda ch, tag: ch.basic_ack(tag), final=True)

    def _settle(self, delivery: Delivery, action: Callable[[Channel, int], None], final: bool) -> None:
        """Ack or reject every broker delivery behind one message; `final` unless requeued."""
        consumer = delivery.consumer
        channel = consumer.channel
        if delivery.generation != consumer.generation or channel is None or not channel.is_open:
            log.info("%s: settling a message of %r from a lost channel: the broker redelivers it",
                     self.name, consumer.queue)
            return
        for tag in delivery.delivery_tags:
            action(channel, tag)
        if delivery.chunk_id is not None:
            if final:  # later copies of its parts (resent by a reconnecting publisher) are duplicates
                consumer.settled_chunk_ids[delivery.chunk_id] = None
                while len(consumer.settled_chunk_ids) > SETTLED_CHUNK_IDS_KEPT:
                    consumer.settled_chunk_ids.popitem(last=False)
            consumer.held_chunk_parts -= len(delivery.delivery_tags)
            self._adjust_prefetch(consumer)
