"""The transport contract on RabbitMQTransport, plus chunking, reconnection and login checks.

Contract tests use the shared node (`rabbitmq_url`); the restart test uses a private node.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator

import pika
import pytest
from rabbitmq_node import RabbitMQNode
from transport_contract import Connect, Names, TransportContract, dead_letter_pair, must_receive

from dfca.identity import topics
from dfca.identity.broker_setup import ensure_broker_topology
from dfca.transport import Message, RabbitMQTransport, Transport, TransportError, connect_transport
from dfca.transport.amqp_frames import FrameReadingConnection, send_gathered
from dfca.transport.chunking import CHUNK_COUNT, CHUNK_ID, CHUNK_INDEX
from dfca.transport.rabbitmq import UNREADABLE_HEADER

W0 = "worker-0"  # the host word of every client when one worker hosts them all

pytestmark = pytest.mark.rabbitmq


def delete_names(url: str, names: Names) -> None:
    """Remove what a test declared from the shared broker."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for queue in names.queues:
            channel.queue_delete(queue)
        for exchange in names.exchanges:
            channel.exchange_delete(exchange)
    finally:
        connection.close()


@pytest.fixture
def names(rabbitmq_url: str) -> Iterator[Names]:
    scope = Names()
    yield scope
    delete_names(rabbitmq_url, scope)


@pytest.fixture
def connect(rabbitmq_url: str) -> Iterator[Connect]:
    opened: list[Transport] = []

    def make(**options: object) -> Transport:
        opened.append(RabbitMQTransport(rabbitmq_url, name="dfca-test", **options))  # type: ignore[arg-type]
        return opened[-1]

    yield make
    for transport in opened:
        transport.close()


class TestRabbitMQTransport(TransportContract):
    """Fixtures `connect` and `names` come from this module."""


def raw_messages(url: str, queue: str) -> list[tuple[dict[str, object], bytes]]:
    """Everything in `queue`, read with plain pika (no reassembly)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        messages = []
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return messages
            messages.append((dict(properties.headers or {}), body))
    finally:
        connection.close()


def test_bodies_above_chunk_bytes_travel_in_parts_and_arrive_whole(
    connect: Connect, names: Names, rabbitmq_url: str
) -> None:
    transport = connect(chunk_bytes=64 << 10, prefetch=4)  # 16 parts > prefetch: must still complete
    exchange = names.exchange("big")
    transport.declare_exchange(exchange, "topic")
    consumed, inspected = names.queue("consumed"), names.queue("raw")
    for queue in (consumed, inspected):
        transport.declare_queue(queue)
        transport.bind(queue, exchange, "m.#")
    body = os.urandom(1 << 20)
    headers = {"blake3": "abc", "sender": "4"}
    transport.publish(exchange, "m.small", b"before")
    transport.publish(exchange, "m.big", body, headers)
    transport.publish(exchange, "m.small", b"after")

    received = [must_receive(transport, consumed) for _ in range(3)]
    assert [m.body for m in received] == [b"before", body, b"after"]
    assert dict(received[1].headers) == headers
    for message in received:
        transport.ack(message)

    parts = raw_messages(rabbitmq_url, inspected)
    big_parts = [(h, b) for h, b in parts if CHUNK_ID in h]
    assert len(parts) == 2 + 16 and len(big_parts) == 16
    assert {h[CHUNK_COUNT] for h, _ in big_parts} == {"16"}
    assert all(len(b) <= 64 << 10 and h["sender"] == "4" for h, b in big_parts)
    ordered = sorted(big_parts, key=lambda hb: int(str(hb[0][CHUNK_INDEX])))
    assert b"".join(b for _, b in ordered) == body


def test_deliveries_are_read_by_the_frame_reader_and_arrive_whole(connect: Connect, names: Names) -> None:
    """Bodies of every size around the broker's frame size (131072 bytes: one body frame or several), interleaved
    with tiny ones, arrive byte for byte through the transport's own frame reader (dfca.transport.amqp_frames)."""
    transport = connect(prefetch=8)
    assert isinstance(transport, RabbitMQTransport)
    exchange, queue = names.exchange("frames"), names.queue("frames")
    transport.declare_exchange(exchange, "topic")
    transport.declare_queue(queue)
    transport.bind(queue, exchange, "m.#")
    rng = random.Random(3)
    bodies = [rng.randbytes(n) for n in (0, 1, 131_063, 131_064, 131_065, 104_000, 5, 400_000, 262_128, 17)]
    transport.publish_many([(exchange, f"m.{i}", body, {"i": str(i)}) for i, body in enumerate(bodies)])
    received = []
    for _ in bodies:
        received.append(must_receive(transport, queue))
        transport.ack(received[-1])  # room for the next under prefetch 8
    assert [(m.routing_key, m.headers["i"], m.body) for m in received] == [
        (f"m.{i}", str(i), body) for i, body in enumerate(bodies)]
    connection = transport._conn
    assert isinstance(connection, FrameReadingConnection)
    assert connection.bytes_received > sum(map(len, bodies)) and connection._reader.unread_bytes == 0
    assert connection._transport._produce.__func__ is send_gathered  # and sent with gathered sends


def test_chunked_message_requeues_and_dead_letters_as_a_whole(connect: Connect, names: Names) -> None:
    transport = connect(chunk_bytes=64 << 10, prefetch=2)
    _, exchange, dead, queue = dead_letter_pair(transport, names)
    body = os.urandom(300_000)  # 5 parts

    transport.publish(exchange, "k", body, {"h": "v"})
    first = must_receive(transport, queue)
    transport.reject(first, requeue=True)
    second = must_receive(transport, queue)
    assert (second.body, second.redelivered) == (body, True)
    transport.reject(second, requeue=False)
    dead_letter = must_receive(transport, dead)
    assert dead_letter.body == body and dead_letter.headers["h"] == "v"
    transport.ack(dead_letter)
    assert transport.receive(queue, 0.3) is None and transport.receive(dead, 0.3) is None


MALFORMED_CHUNKS = [
    {CHUNK_ID: "a", CHUNK_INDEX: "5", CHUNK_COUNT: "1"},  # a part beyond the message's end
    {CHUNK_ID: "b", CHUNK_INDEX: "-1", CHUNK_COUNT: "2"},
    {CHUNK_ID: "c", CHUNK_INDEX: "0", CHUNK_COUNT: "0"},
    {CHUNK_ID: "d", CHUNK_INDEX: "0", CHUNK_COUNT: str(10**12)},  # would be held forever
    {CHUNK_ID: "e", CHUNK_INDEX: "zero", CHUNK_COUNT: "1"},
    {CHUNK_ID: "f", CHUNK_COUNT: "1"},
    {CHUNK_ID: "g", CHUNK_INDEX: "0", CHUNK_COUNT: "2"},  # then part 1 of "g" claims 3 parts
    {CHUNK_ID: "g", CHUNK_INDEX: "1", CHUNK_COUNT: "3"},
    {CHUNK_ID: "h", CHUNK_INDEX: b"\xff", CHUNK_COUNT: True},
]


def test_malformed_chunks_are_handed_on_marked_unreadable_and_the_consumer_goes_on(
    connect: Connect, names: Names, rabbitmq_url: str
) -> None:
    """A poison pill used to raise inside pika's callback: the connection aborted, the broker redelivered it, and
    the consumer looped for good. Now it arrives marked `x-unreadable`, once, in order, and rejecting it
    dead-letters it (with the part of its chunked message held before it)."""
    transport = connect(prefetch=4)
    _, exchange, dead, queue = dead_letter_pair(transport, names)
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        channel = connection.channel()
        for i, headers in enumerate(MALFORMED_CHUNKS):
            channel.basic_publish(exchange, "k", f"pill {i}".encode(), pika.BasicProperties(headers=headers))
            channel.basic_publish(exchange, "k", f"good {i}".encode())
    finally:
        connection.close()

    good, pills = [], []
    while len(good) < len(MALFORMED_CHUNKS):
        message = must_receive(transport, queue)
        if UNREADABLE_HEADER in message.headers:
            pills.append(message.body)
            transport.reject(message, requeue=False)
        else:
            good.append(message.body)
            transport.ack(message)
    assert good == [f"good {i}".encode() for i in range(len(MALFORMED_CHUNKS))]
    assert transport.receive(queue, 0.5) is None
    assert isinstance(transport, RabbitMQTransport) and transport.connections == 1  # no abort, no redelivery loop
    # "g" part 0 was held until its part 1 contradicted it: the two go together, handed on as one message
    assert sorted(pills) == sorted(f"pill {i}".encode() for i in range(len(MALFORMED_CHUNKS)) if i != 6)
    dead_letters = sorted(body for _, body in raw_messages(rabbitmq_url, dead))
    assert dead_letters == sorted(f"pill {i}".encode() for i in range(len(MALFORMED_CHUNKS)))


def full_queue(transport: Transport, names: Names, url: str) -> tuple[str, str]:
    """A topic exchange and a queue bound to it under key "k" that holds one message and refuses further publishes
    (the broker nacks them)."""
    exchange, queue = names.exchange("topic"), names.queue("full")
    transport.declare_exchange(exchange, "topic")
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
        channel.queue_bind(queue, exchange, "k")
    finally:
        connection.close()
    return exchange, queue


def test_a_refused_pipelined_publish_surfaces_at_await_confirms(connect: Connect, names: Names,
                                                                  rabbitmq_url: str) -> None:
    """publish_pipelined does not wait; the broker's nack of one of its messages (a full queue that refuses
    publishes) is raised by the next await_confirms, and the one after it has nothing left to raise."""
    transport = connect()
    exchange, queue = full_queue(transport, names, rabbitmq_url)
    transport.publish_pipelined([(exchange, "k", b"first", {}), (exchange, "k", b"second", {})])
    with pytest.raises(TransportError, match="rejected"):
        transport.await_confirms()
    transport.await_confirms()
    assert [body for _, body in raw_messages(rabbitmq_url, queue)] == [b"first"]


def test_a_body_of_too_many_parts_is_refused(connect: Connect) -> None:
    with pytest.raises(TransportError, match="at most 1024"):
        connect(chunk_bytes=16).publish(topics.MODELS_EXCHANGE, "k", b"x" * (16 * 1024 + 1))


def test_reserved_headers_are_refused(connect: Connect) -> None:
    with pytest.raises(TransportError):
        connect().publish(topics.MODELS_EXCHANGE, "k", b"x", {CHUNK_INDEX: "0"})


def test_wrong_password_fails_at_connect() -> None:
    with pytest.raises(TransportError, match="refused"):
        RabbitMQTransport("amqp://dfca:wrong-password@127.0.0.1:5672/dfca", publish_timeout=20)


def test_connect_transport_gives_rabbitmq_for_amqp_urls(rabbitmq_url: str) -> None:
    transport = connect_transport(rabbitmq_url, prefetch=8)
    try:
        assert isinstance(transport, RabbitMQTransport) and transport.prefetch == 8
        ensure_broker_topology(transport)
    finally:
        transport.close()


def test_survives_a_broker_restart(private_rabbitmq: RabbitMQNode, unique_id: str) -> None:
    node = private_rabbitmq
    transport = RabbitMQTransport(node.url, name="restart-test")
    impatient = RabbitMQTransport(node.url, name="impatient", publish_timeout=1.5)
    try:
        # The node booted broker/definitions.json: the dfca exchanges exist without declaring them.
        transport.publish(topics.MODELS_EXCHANGE, "nobody.listens", b"")
        ensure_broker_topology(transport)
        queue = topics.worker_queue(unique_id, W0)
        transport.declare_queue(queue, dead_letter_exchange=topics.DEAD_LETTER_EXCHANGE)
        transport.bind(queue, topics.MODELS_EXCHANGE, topics.experiment_binding(unique_id))

        def publish(numbers: range) -> None:
            for i in numbers:
                transport.publish(topics.MODELS_EXCHANGE, topics.model_key(unique_id, W0, i, 0), str(i).encode())

        publish(range(10))
        held = [must_receive(transport, queue) for _ in range(3)]  # unacknowledged across the restart
        # a queue no consumer reads yet: a persistent message outlives the restart, one in memory only does not
        unread, unread_key = topics.worker_queue(unique_id + "u", W0), topics.model_key(unique_id + "u", W0, 0, 0)
        transport.declare_queue(unread)
        transport.bind(unread, topics.MODELS_EXCHANGE, unread_key)
        for body, persistent in ((b"persistent", True), (b"in memory", False)):
            transport.publish_pipelined([(topics.MODELS_EXCHANGE, unread_key, body, None)], persistent=persistent)
        transport.await_confirms()
        assert transport.connections == 1

        node.stop()
        errors: list[BaseException] = []
        publisher = threading.Thread(target=lambda: _capture(errors, publish, range(10, 20)))
        publisher.start()  # blocks in publish until the broker is back
        with pytest.raises(TransportError):
            impatient.publish(topics.MODELS_EXCHANGE, "k", b"gives up after 1.5 s")
        impatient.close()  # closing while disconnected works
        node.start()
        publisher.join(120)
        assert not publisher.is_alive() and not errors

        for message in held:
            transport.ack(message)  # stale: a no-op, the broker redelivers them
        got: dict[int, Message] = {}
        while len(got) < 20:
            message = must_receive(transport, queue)
            got.setdefault(int(message.body), message)
            transport.ack(message)
        assert sorted(got) == list(range(20))
        assert all(got[int(m.body)].redelivered for m in held)
        assert transport.receive(queue, 0.5) is None
        assert transport.connections == 2  # a publisher can tell that what it kept in memory may be lost
        assert must_receive(transport, unread).body == b"persistent" and transport.receive(unread, 0.5) is None
    finally:
        impatient.close()
        transport.close()


def test_redeclares_its_topology_on_a_broker_that_lost_it(
    private_rabbitmq: RabbitMQNode, unique_id: str
) -> None:
    node = private_rabbitmq
    transport = RabbitMQTransport(node.url, name="topology-test")
    try:
        exchange, queue = f"{unique_id}.own", topics.worker_queue(unique_id, W0)
        transport.declare_exchange(exchange, "topic")
        transport.declare_queue(queue)
        transport.bind(queue, exchange, topics.neighbour_binding(unique_id, 5))
        assert transport.receive(queue, 0.1) is None  # the consumer exists before the reset

        node.reset()  # the broker comes back without our exchange, queue and binding
        transport.publish(exchange, topics.model_key(unique_id, W0, 5, 0), b"routed again")
        message = must_receive(transport, queue)
        assert message.body == b"routed again"
        transport.ack(message)
    finally:
        transport.close()


def _capture(errors: list[BaseException], fn: object, *args: object) -> None:
    try:
        fn(*args)  # type: ignore[operator]
    except BaseException as err:
        errors.append(err)


def test_a_confirmation_awaits_the_messages_handed_over_before_it(connect: Connect, names: Names,
                                                                   rabbitmq_url: str) -> None:
    """confirmation() takes the pipelined messages so far: called later (here on another thread) it raises the
    broker's nack of one of them; await_confirms then waits for those published after it only."""
    transport = connect()
    exchange, queue = full_queue(transport, names, rabbitmq_url)
    transport.publish_pipelined([(exchange, "k", b"first", {}), (exchange, "k", b"second", {})])
    confirmation = transport.confirmation()
    transport.publish_pipelined([(exchange, "other", b"routed nowhere", {})])
    transport.await_confirms()  # only the last one: the nack of "second" is the confirmation's
    errors: list[BaseException] = []
    waiter = threading.Thread(target=_capture, args=(errors, confirmation))
    waiter.start()
    waiter.join(30)
    assert len(errors) == 1 and isinstance(errors[0], TransportError) and "rejected" in str(errors[0])
    assert [body for _, body in raw_messages(rabbitmq_url, queue)] == [b"first"]
