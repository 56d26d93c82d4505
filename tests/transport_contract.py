"""The contract every `Transport` keeps: one suite, run on each implementation.

A test module subclasses `TransportContract` (the name does not start with `Test`, so pytest
collects only the subclasses) and provides two fixtures:

- `connect`: a callable returning a NEW transport connected to the same broker (several per test
  are used, e.g. to check that unacknowledged messages return when a connection closes);
- `names`: a `Names` giving exchange and queue names unique to the test.

Negative checks ("nothing arrives") avoid sleeping where they can: a sentinel message that must
arrive is published after the one that must not, and FIFO order from one publisher to one queue
means the sentinel arriving first proves the other was not routed.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from dfca.identity import topics
from dfca.transport import Message, QueueLimits, Transport, TransportError
from dfca.wire.codec import Envelope, TensorSpec, decode_message, encode_message

W0 = "worker-0"  # the host word of every client when one worker hosts them all

PATIENCE_S = 10.0  # how long to wait for a message that must arrive
QUIET_S = 0.3  # how long to wait when checking that a queue is empty

Connect = Callable[[], Transport]


@dataclass
class Names:
    """Names unique to one test; records what it created so a broker fixture can clean up."""

    prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:12]}")
    exchanges: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)

    def exchange(self, label: str) -> str:
        name = f"{self.prefix}.x.{label}"
        self.exchanges.append(name)
        return name

    def queue(self, label: str) -> str:
        name = f"{self.prefix}.q.{label}"
        self.queues.append(name)
        return name


def must_receive(transport: Transport, queue: str) -> Message:
    message = transport.receive(queue, PATIENCE_S)
    assert message is not None, f"no message arrived on {queue} within {PATIENCE_S} s"
    return message


def receive_until(transport: Transport, queue: str, sentinel: bytes) -> list[Message]:
    """Receive and ack until the message whose body is `sentinel` (included)."""
    received: list[Message] = []
    while not received or received[-1].body != sentinel:
        message = must_receive(transport, queue)
        transport.ack(message)
        received.append(message)
    return received


def topic_setup(transport: Transport, names: Names, bindings: dict[str, list[str]]) -> tuple[str, dict[str, str]]:
    """A topic exchange and one queue per label, bound with the given keys."""
    exchange = names.exchange("topic")
    transport.declare_exchange(exchange, "topic")
    queues = {}
    for label, keys in bindings.items():
        queue = names.queue(label)
        transport.declare_queue(queue)
        for key in keys:
            transport.bind(queue, exchange, key)
        queues[label] = queue
    return exchange, queues


def dead_letter_pair(transport: Transport, names: Names) -> tuple[str, str, str, str]:
    """A fanout dead-letter exchange with its queue `dead`, and a topic exchange whose queue `main` (bound to
    every key) dead-letters there: (dead-letter exchange, exchange, dead, main)."""
    dlx, exchange = names.exchange("dlx"), names.exchange("main")
    transport.declare_exchange(dlx, "fanout")
    transport.declare_exchange(exchange, "topic")
    dead, queue = names.queue("dead"), names.queue("main")
    transport.declare_queue(dead)
    transport.bind(dead, dlx, "")
    transport.declare_queue(queue, dead_letter_exchange=dlx)
    transport.bind(queue, exchange, "#")
    return dlx, exchange, dead, queue


class TransportContract:
    """The shared contract; see the module docstring for the fixtures a subclass provides."""

    @pytest.fixture
    def transport(self, connect: Connect) -> Transport:
        return connect()

    def test_topic_routing_follows_amqp_star_and_hash(self, transport: Transport, names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {
            "hash": ["a.#", "end"], "star": ["a.*.c", "end"], "exact": ["a.c", "end"], "all": ["#"],
        })
        sent = ["a", "a.b.c", "a.c", "b.a", "a.b.c.d", "a.b.b", "b.a.c"]
        for key in sent:
            transport.publish(exchange, key, key.encode())
        transport.publish(exchange, "end", b"end")

        def keys(label: str) -> list[str]:
            return [m.routing_key for m in receive_until(transport, queues[label], b"end")]

        assert keys("hash") == ["a", "a.b.c", "a.c", "a.b.c.d", "a.b.b", "end"]
        assert keys("star") == ["a.b.c", "end"]
        assert keys("exact") == ["a.c", "end"]
        assert keys("all") == [*sent, "end"]

    def test_model_routing_is_keyed_by_neighbour_and_cluster(self, transport: Transport, names: Names) -> None:
        experiment = names.prefix
        exchange, queues = topic_setup(transport, names, {
            "client1": [topics.neighbour_binding(experiment, 2), topics.neighbour_binding(experiment, 3)],
            "cluster1": [f"{experiment}.*.*.1"],
        })
        sent = [topics.model_key(experiment, W0, s, c) for s, c in [(2, 0), (4, 0), (3, 1), (4, 1), (2, 5), (22, 0)]]
        for key in sent:
            transport.publish(exchange, key, key.encode())
        sentinel = topics.model_key(experiment, W0, 3, 1)
        transport.publish(exchange, sentinel, b"end")

        def senders_and_clusters(label: str) -> list[tuple[int, int]]:
            received = receive_until(transport, queues[label], b"end")
            return [topics.parse_model_key(m.routing_key)[2:] for m in received]

        client1, cluster1 = senders_and_clusters("client1"), senders_and_clusters("cluster1")
        assert client1 == [(2, 0), (3, 1), (2, 5), (3, 1)]
        assert cluster1 == [(3, 1), (4, 1), (3, 1)]

    def test_a_delivered_message_names_its_publisher(self, transport: Transport, names: Names) -> None:
        """The broker stamps (RabbitMQ: validates) the publishing connection's user on every message."""
        exchange, queues = topic_setup(transport, names, {"all": ["#"]})
        transport.publish(exchange, "a.b", b"hello")
        message = transport.receive(queues["all"], timeout=5.0)
        assert message is not None and message.body == b"hello"
        assert message.publisher == transport.user
        transport.ack(message)

    def test_unbind_stops_delivery(self, transport: Transport, names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {"q": ["k1", "k2"]})
        queue = queues["q"]
        transport.publish(exchange, "k1", b"before")
        assert [m.body for m in receive_until(transport, queue, b"before")] == [b"before"]
        transport.unbind(queue, exchange, "k1")
        transport.publish(exchange, "k1", b"after-unbind")
        transport.publish(exchange, "k2", b"end")
        assert [m.body for m in receive_until(transport, queue, b"end")] == [b"end"]
        assert transport.receive(queue, QUIET_S) is None

    def test_no_delivery_without_binding(self, transport: Transport, names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {"bound": ["x"], "unbound": []})
        transport.publish(exchange, "y", b"unroutable")  # matches nothing: dropped, no error
        transport.publish(exchange, "x", b"end")
        assert [m.body for m in receive_until(transport, queues["bound"], b"end")] == [b"end"]
        assert transport.receive(queues["unbound"], QUIET_S) is None

    def test_fanout_ignores_routing_key(self, transport: Transport, names: Names) -> None:
        exchange = names.exchange("fan")
        transport.declare_exchange(exchange, "fanout")
        queues = [names.queue("a"), names.queue("b")]
        for queue in queues:
            transport.declare_queue(queue)
            transport.bind(queue, exchange, "")
        transport.publish(exchange, "any.key.at.all", b"hello")
        for queue in queues:
            message = must_receive(transport, queue)
            assert (message.body, message.routing_key, message.exchange) == (b"hello", "any.key.at.all", exchange)

    def test_ack_removes_the_message(self, connect: Connect, names: Names) -> None:
        first = connect()
        exchange, queues = topic_setup(first, names, {"q": ["k"]})
        first.publish(exchange, "k", b"once")
        message = must_receive(first, queues["q"])
        first.ack(message)
        with pytest.raises(TransportError):
            first.ack(message)  # a message is settled once
        first.close()
        second = connect()
        assert second.receive(queues["q"], QUIET_S) is None

    def test_ack_many_removes_every_message_and_names_one_it_could_not_ack(self, connect: Connect,
                                                                           names: Names) -> None:
        first = connect()
        exchange, queues = topic_setup(first, names, {"q": ["k"]})
        for i in range(5):
            first.publish(exchange, "k", f"m{i}".encode())
        taken = [must_receive(first, queues["q"]) for _ in range(5)]
        first.ack(taken[0])
        with pytest.raises(TransportError):
            first.ack_many(taken)  # taken[0] is settled already: the other four are acked all the same
        first.close()
        second = connect()
        assert second.receive(queues["q"], QUIET_S) is None
        second.close()

    def test_reject_with_requeue_redelivers(self, transport: Transport, names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {"q": ["k"]})
        transport.publish(exchange, "k", b"again", {"h": "1"})
        first = must_receive(transport, queues["q"])
        assert not first.redelivered
        transport.reject(first, requeue=True)
        second = must_receive(transport, queues["q"])
        assert (second.body, second.redelivered, dict(second.headers)) == (b"again", True, {"h": "1"})
        transport.ack(second)
        assert transport.receive(queues["q"], QUIET_S) is None

    def test_reject_without_requeue_dead_letters(self, transport: Transport, names: Names) -> None:
        _, exchange, dead, queue = dead_letter_pair(transport, names)

        transport.publish(exchange, "exp.7.1", b"poison", {"reason": "test"})
        transport.reject(must_receive(transport, queue), requeue=False)
        dead_letter = must_receive(transport, dead)
        assert (dead_letter.body, dead_letter.routing_key) == (b"poison", "exp.7.1")
        assert dead_letter.headers["reason"] == "test"
        # where it was published and why it died, as RabbitMQ says the first time (the metrics service files dead
        # letters under the experiment their routing key names on that exchange)
        assert dead_letter.headers["x-first-death-exchange"] == exchange
        assert dead_letter.headers["x-first-death-queue"] == queue
        assert dead_letter.headers["x-first-death-reason"] == "rejected"
        transport.ack(dead_letter)
        assert transport.receive(queue, QUIET_S) is None

    def test_a_bounded_queue_drops_its_oldest_messages_to_the_dead_letter_exchange(self, transport: Transport,
                                                                                   names: Names) -> None:
        """A flood cannot fill the broker: past max_length (or max_bytes) the oldest messages are dead-lettered, the
        publisher is never refused, and what is left is the newest."""
        dlx, exchange, dead, _ = dead_letter_pair(transport, names)
        by_length, by_bytes = names.queue("length"), names.queue("bytes")
        transport.declare_queue(by_length, dlx, QueueLimits(max_length=3))
        transport.declare_queue(by_bytes, None, QueueLimits(max_bytes=250))
        transport.bind(by_length, exchange, "a")
        transport.bind(by_bytes, exchange, "b")
        for i in range(5):
            transport.publish(exchange, "a", f"m{i}".encode())
            transport.publish(exchange, "b", bytes([i]) * 100)
        kept = [must_receive(transport, by_length) for _ in range(3)]
        assert [m.body for m in kept] == [b"m2", b"m3", b"m4"] and transport.receive(by_length, QUIET_S) is None
        dropped = [must_receive(transport, dead) for _ in range(2)]
        assert sorted(m.body for m in dropped) == [b"m0", b"m1"]
        assert {m.headers["x-first-death-reason"] for m in dropped} == {"maxlen"}
        newest = [must_receive(transport, by_bytes) for _ in range(2)]
        assert [m.body[0] for m in newest] == [3, 4] and transport.receive(by_bytes, QUIET_S) is None
        for message in kept + dropped + newest:
            transport.ack(message)

    def test_unacked_messages_return_after_close(self, connect: Connect, names: Names) -> None:
        first = connect()
        exchange, queues = topic_setup(first, names, {"q": ["k"]})
        for body in (b"m1", b"m2"):
            first.publish(exchange, "k", body)
        taken = must_receive(first, queues["q"])
        assert taken.body == b"m1"
        first.close()
        with pytest.raises(TransportError):
            first.ack(taken)  # the connection is gone

        second = connect()
        returned = [must_receive(second, queues["q"]) for _ in range(2)]
        assert sorted(m.body for m in returned) == [b"m1", b"m2"]
        assert next(m for m in returned if m.body == b"m1").redelivered
        for message in returned:
            second.ack(message)

    def test_headers_and_binary_bodies_are_byte_exact(self, transport: Transport, names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {"q": ["#"]})
        spec = {"w": TensorSpec((64, 32)), "b": TensorSpec((32,))}
        update = Envelope(names.prefix, 3, 7, "models", 0, 1, {"w": torch.randn(64, 32), "b": torch.randn(32)})
        model_body, model_headers = encode_message(update, spec)
        bodies = [
            (os.urandom(1 << 20), {"kind": "random", "unicode": "naïve ✓"}),
            (bytes(range(256)) * 4, {"kind": "all-bytes"}),
            (b"", {"kind": "empty"}),
            (model_body, model_headers),
        ]
        for body, headers in bodies:
            transport.publish(exchange, "m.k", body, headers)
        for body, headers in bodies:
            message = must_receive(transport, queues["q"])
            assert message.body == body
            assert dict(message.headers) == headers
            transport.ack(message)
        decoded = decode_message(topics.model_key(names.prefix, W0, 3, 1), model_body, model_headers, names.prefix,
                                 lambda _head: spec)
        assert torch.equal(decoded.tensors["w"], update.tensors["w"])

    def test_fifo_order_from_one_publisher(self, transport: Transport, names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {"q": ["k"]})
        for i in range(200):
            transport.publish(exchange, "k", str(i).encode())
        received = [int(m.body) for m in receive_until(transport, queues["q"], b"199")]
        assert received == list(range(200))

    def test_receive_times_out_with_none_on_an_empty_queue(self, transport: Transport, names: Names) -> None:
        queue = names.queue("empty")
        transport.declare_queue(queue)
        assert transport.receive(queue, QUIET_S) is None
        assert transport.receive(queue) is None

    def test_publish_many_delivers_each_in_order(self, transport: Transport, names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {"a": ["a"], "b": ["b"]})
        transport.publish_many([(exchange, "a" if i % 2 else "b", str(i).encode(), {"i": str(i)}) for i in range(40)])
        for label, first in (("b", 0), ("a", 1)):
            got = [must_receive(transport, queues[label]) for _ in range(20)]
            assert [int(m.body) for m in got] == list(range(first, 40, 2))
            assert all(m.headers["i"] == m.body.decode() for m in got)
            for m in got:
                transport.ack(m)

    def test_pipelined_publishes_arrive_in_order_and_are_all_confirmed(self, transport: Transport,
                                                                         names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {"a": ["a"], "b": ["b"]})
        for lo in range(0, 40, 10):  # several hand-overs before one wait for their confirms
            transport.publish_pipelined([(exchange, "a" if i % 2 else "b", str(i).encode(), {"i": str(i)})
                                         for i in range(lo, lo + 10)])
        transport.await_confirms()
        transport.await_confirms()  # nothing left: returns at once
        for label, first in (("b", 0), ("a", 1)):
            got = [must_receive(transport, queues[label]) for _ in range(20)]
            assert [int(m.body) for m in got] == list(range(first, 40, 2))
            for m in got:
                transport.ack(m)

        exchange, queues = topic_setup(transport, names, {"a": ["a"], "b": ["b"], "c": ["c"]})
        order = [queues["a"], queues["b"], queues["c"]]
        assert transport.receive_any(order, QUIET_S) is None
        timer = threading.Timer(0.3, lambda: transport.publish(exchange, "c", b"late"))
        began = time.monotonic()
        timer.start()
        got = transport.receive_any(order, PATIENCE_S)
        waited = time.monotonic() - began
        timer.join()
        assert got is not None and got[0] == 2 and got[1].body == b"late"
        assert waited < PATIENCE_S / 2, waited  # woken by the arrival, not by the timeout
        transport.ack(got[1])
        transport.publish(exchange, "a", b"first")
        got = transport.receive_any(order, PATIENCE_S)
        assert got is not None and got[0] == 0 and got[1].body == b"first"
        transport.ack(got[1])

    def test_concurrent_publishers_and_consumers_lose_nothing(self, transport: Transport, names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {"q": ["load.#"]})
        threads_n, per_thread = 4, 200
        received: list[bytes] = []
        lock = threading.Lock()
        errors: list[BaseException] = []

        def publish(thread: int) -> None:
            try:
                for i in range(per_thread):
                    transport.publish(exchange, f"load.{thread}", f"{thread}-{i}".encode())
            except BaseException as err:
                errors.append(err)

        def consume() -> None:
            give_up = time.monotonic() + 120
            try:
                while time.monotonic() < give_up:
                    with lock:
                        if len(received) >= threads_n * per_thread:
                            return
                    message = transport.receive(queues["q"], QUIET_S)
                    if message is not None:
                        transport.ack(message)
                        with lock:
                            received.append(message.body)
            except BaseException as err:
                errors.append(err)

        workers = [threading.Thread(target=publish, args=(t,)) for t in range(threads_n)]
        workers += [threading.Thread(target=consume) for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
        assert not errors
        assert len(received) == threads_n * per_thread
        assert set(received) == {f"{t}-{i}".encode() for t in range(threads_n) for i in range(per_thread)}

    def test_missing_queue_exchange_and_closed_transport_raise(self, connect: Connect, names: Names) -> None:
        transport = connect()
        with pytest.raises(TransportError):
            transport.receive(names.queue("never-declared"))
        with pytest.raises(TransportError):
            transport.publish(names.exchange("never-declared"), "k", b"x")
        with pytest.raises(TransportError):
            transport.declare_exchange(names.exchange("odd-kind"), "headers-or-whatever")
        transport.close()
        transport.close()  # idempotent
        with pytest.raises(TransportError):
            transport.declare_queue(names.queue("late"))

    def test_exchange_kind_conflict_raises(self, transport: Transport, names: Names) -> None:
        exchange = names.exchange("kind")
        transport.declare_exchange(exchange, "topic")
        transport.declare_exchange(exchange, "topic")  # same kind: idempotent
        with pytest.raises(TransportError):
            transport.declare_exchange(exchange, "fanout")

    def test_deleted_queue_stops_receiving(self, transport: Transport, names: Names) -> None:
        exchange, queues = topic_setup(transport, names, {"q": ["k"]})
        transport.publish(exchange, "k", b"lost-with-the-queue")
        assert transport.receive(queues["q"], PATIENCE_S) is not None
        transport.delete_queue(queues["q"])
        with pytest.raises(TransportError):
            transport.receive(queues["q"], QUIET_S)
        transport.publish(exchange, "k", b"nowhere")  # binding went with the queue; no error

    def test_close_wakes_a_blocked_receive_with_none(self, connect: Connect, names: Names) -> None:
        transport = connect()
        queue = names.queue("idle")
        transport.declare_queue(queue)
        assert transport.receive(queue) is None  # consumer running
        results: list[object] = []

        def wait() -> None:
            try:
                results.append(transport.receive(queue, 60))
            except TransportError:
                results.append("closed before receive started")  # the thread lost the race: also fine

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(QUIET_S)  # lets the waiter block first (the usual case); not an assertion
        transport.close()
        waiter.join(30)
        assert not waiter.is_alive()
        assert results in ([None], ["closed before receive started"])
