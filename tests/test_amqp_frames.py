"""The transport's AMQP frame reader (dfca.transport.amqp_frames) against pika's own decoder.

A byte stream of every kind of frame the broker sends (protocol header, methods, content headers with a
header table, body frames small and large, heartbeats) is fed to FrameReader in reads of every size from one byte
to the whole stream; the frames it gives must be pika's, in order, with nothing left over; a frame whose end
marker is wrong raises. The reader is also what every RabbitMQ test runs on (RabbitMQTransport's connections).
"""

from __future__ import annotations

import collections
import random
from types import SimpleNamespace
from typing import Any

import pika
import pytest
from pika import frame, spec
from pika.exceptions import InvalidFrameError

from dfca.transport.amqp_frames import (
    RECV_BYTES,
    SEND_BUFFERS,
    FrameReader,
    FrameReadingConnection,
    frame_bytes,
    send_gathered,
)


def stream_of_frames() -> bytes:
    body = random.Random(0).randbytes(300_000)
    properties = pika.BasicProperties(delivery_mode=2, user_id="worker-1",
                                      headers={"blake3": "ab" * 32, "round": "7", "sent_at": "1764160000.5"})
    frames: list[frame.Frame | frame.ProtocolHeader] = [
        frame.Method(0, spec.Connection.Tune(channel_max=2047, frame_max=131072, heartbeat=60)),
        frame.Method(1, spec.Basic.Deliver(consumer_tag="ctag", delivery_tag=5, redelivered=False,
                                           exchange="dfca.models", routing_key="e.worker-1.4.0")),
        frame.Header(1, len(body), properties),
        *[frame.Body(1, body[i:i + 131064]) for i in range(0, len(body), 131064)],
        frame.Heartbeat(),
        frame.Method(2, spec.Basic.Ack(delivery_tag=9, multiple=True)),
        frame.Method(1, spec.Basic.Deliver(consumer_tag="ctag", delivery_tag=6, redelivered=True,
                                           exchange="dfca.models", routing_key="e.worker-2.5.1")),
        frame.Header(1, 3, pika.BasicProperties(headers={})),
        frame.Body(1, b"abc"),
        frame.Method(1, spec.Basic.Deliver(consumer_tag="ctag", delivery_tag=7, redelivered=False,
                                           exchange="dfca.models", routing_key="e.worker-2.5.1")),
        frame.Header(1, 0, pika.BasicProperties()),  # an empty body: no body frame
        frame.ProtocolHeader(),
    ]
    return b"".join(f.marshal() for f in frames)


def pikas_frames(data: bytes) -> list[tuple[int, Any]]:
    """(length, frame) as pika's own reader decodes the stream."""
    out, offset = [], 0
    while offset < len(data):
        consumed, value = frame.decode_frame(data[offset:])
        assert value is not None
        out.append((consumed, value))
        offset += consumed
    return out


def described(frames: list[tuple[int, Any]]) -> list[tuple[int, str, Any]]:
    """Comparable: (length, the frame's type, its content)."""
    def content(value: Any) -> Any:
        if isinstance(value, frame.Body):
            return (value.channel_number, bytes(value.fragment))
        if isinstance(value, frame.Header):
            return (value.channel_number, value.body_size, vars(value.properties))
        if isinstance(value, frame.Method):
            return (value.channel_number, type(value.method).__name__, vars(value.method))
        if isinstance(value, frame.ProtocolHeader):
            return (value.major, value.minor, value.revision)
        return None
    return [(size, type(value).__name__, content(value)) for size, value in frames]


def read_in_pieces(data: bytes, sizes: list[int]) -> tuple[list[tuple[int, Any]], FrameReader]:
    reader, got, offset, i = FrameReader(), [], 0, 0
    while offset < len(data):
        size = sizes[i % len(sizes)]
        got.extend(reader.frames(data[offset:offset + size]))
        offset += size
        i += 1
    return got, reader


@pytest.mark.parametrize("sizes", [[1], [7], [8], [4096], [RECV_BYTES], [10**7], [3, 131_079, 5, 20_000]],
                         ids=lambda s: "reads of " + "/".join(map(str, s)))
def test_the_reader_gives_pikas_frames_whatever_the_reads(sizes: list[int]) -> None:
    data = stream_of_frames()
    expected = described(pikas_frames(data))
    got, reader = read_in_pieces(data, sizes)
    assert described(got) == expected
    assert reader.unread_bytes == 0 and sum(size for size, _ in got) == len(data)


def test_random_reads_give_the_same_frames() -> None:
    data = stream_of_frames()
    expected = described(pikas_frames(data))
    rng = random.Random(1)
    for _ in range(20):
        got, _ = read_in_pieces(data, [rng.randint(1, 200_000) for _ in range(50)])
        assert described(got) == expected


def test_a_frame_is_given_only_once_it_is_whole() -> None:
    body = frame.Body(3, b"x" * 1000).marshal()
    reader = FrameReader()
    assert list(reader.frames(body[:500])) == []
    assert reader.needed == len(body)  # known from the frame's header: nothing joined until it is all there
    assert list(reader.frames(body[500:-1])) == []
    [(size, value)] = list(reader.frames(body[-1:]))
    assert size == len(body) and value.fragment == b"x" * 1000 and value.channel_number == 3


def test_a_frame_without_its_end_marker_is_refused() -> None:
    broken = bytearray(frame.Body(1, b"payload").marshal())
    broken[-1] = 0
    with pytest.raises(InvalidFrameError):
        list(FrameReader().frames(bytes(broken)))
    method = bytearray(frame.Method(1, spec.Basic.Ack(delivery_tag=1)).marshal())
    method[-1] = 0
    with pytest.raises(InvalidFrameError):
        list(FrameReader().frames(bytes(method)))


def test_frame_bytes_reads_the_length_from_the_header() -> None:
    data = frame.Body(1, b"12345").marshal()
    assert frame_bytes(data) == len(data) == 7 + 5 + 1
    assert frame_bytes(data[:6]) is None
    assert frame_bytes(frame.ProtocolHeader().marshal()) == 8


def test_pika_still_reads_through_the_methods_the_reader_replaces() -> None:
    """pika hands every read to `_on_data_available` and starts each stream with `_init_connection_state`: an
    upgrade of pika that renamed them would leave the reader unused (the RabbitMQ tests would still pass)."""
    import inspect

    from pika.adapters import base_connection
    from pika.connection import Connection

    assert "self._on_data_available(data)" in inspect.getsource(base_connection.BaseConnection._proto_data_received)
    assert "self._init_connection_state()" in inspect.getsource(Connection.__init__)
    assert FrameReadingConnection._on_data_available is not Connection._on_data_available


class ShortSocket:
    """A socket whose `sendmsg` takes at most `room` bytes a call (a partial send, as a full socket buffer gives),
    then raises BlockingIOError once `calls` calls were made."""

    def __init__(self, room: int, calls: int = 10**9) -> None:
        self.room, self.calls, self.sent, self.gathered = room, calls, bytearray(), []

    def sendmsg(self, buffers: list[Any]) -> int:
        if not self.calls:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        self.calls -= 1
        self.gathered.append(len(buffers))
        data = bytearray()
        for buffer in buffers:
            data += bytes(buffer[:self.room - len(data)])
            if len(data) == self.room:
                break
        self.sent += data
        return len(data)


@pytest.mark.parametrize("room", [1, 7, 100, 10_000, 1 << 30])
def test_gathered_sends_send_every_frame_in_order_whatever_each_call_takes(room: int) -> None:
    """Every buffered frame reaches the socket once, in order, whatever part of them each sendmsg takes; the
    buffered byte count follows; more frames than SEND_BUFFERS take several calls."""
    rng = random.Random(room)
    frames = [rng.randbytes(rng.randint(1, 300)) for _ in range(SEND_BUFFERS + 40)]
    sock = ShortSocket(room)
    transport = SimpleNamespace(_tx_buffers=collections.deque(frames), _sock=sock,
                                _tx_buffered_byte_count=sum(map(len, frames)))
    while transport._tx_buffers:
        send_gathered(transport)
    assert bytes(sock.sent) == b"".join(frames) and transport._tx_buffered_byte_count == 0
    if room == 1 << 30:
        assert sock.gathered == [SEND_BUFFERS, 40]


def test_a_full_socket_leaves_the_rest_buffered() -> None:
    """A send that would block raises (pika takes it as "try again when writable") and leaves what was not sent
    at the head of the buffers, counted."""
    frames = [b"a" * 10, b"b" * 10, b"c" * 10]
    sock = ShortSocket(room=15, calls=1)
    transport = SimpleNamespace(_tx_buffers=collections.deque(frames), _sock=sock, _tx_buffered_byte_count=30)
    with pytest.raises(BlockingIOError):
        send_gathered(transport)
    assert bytes(sock.sent) == b"a" * 10 + b"b" * 5
    assert [bytes(b) for b in transport._tx_buffers] == [b"b" * 5, b"c" * 10]
    assert transport._tx_buffered_byte_count == 15


def test_pika_still_sends_through_the_method_gathered_sends_replace() -> None:
    """pika's plaintext transport sends its buffers with `_produce` when its socket is writable: an upgrade of pika
    that renamed it would leave the gathered sends unused (the RabbitMQ tests would still pass)."""
    import inspect

    from pika.adapters.utils.io_services_utils import _AsyncPlaintextTransport

    assert "self._produce()" in inspect.getsource(_AsyncPlaintextTransport._on_socket_writable)
    assert "_tx_buffers" in inspect.getsource(_AsyncPlaintextTransport.__mro__[1]._produce)
