"""pika's SelectConnection with a frame reader that copies a frame's bytes once.

pika's reader (1.3, and 1.4.4 here) reads the socket 4 kB at a time, appends each read to one bytes buffer
(`buffer += data`: the whole buffer copied every 4 kB, so a frame of n bytes costs O(n^2 / 4 kB) of copying)
and, after every frame it decodes, copies what is left (`buffer = buffer[n:]`). Consuming a 104 kB model
message cost 620-680 us of CPU here that way (a scratch loop of 400 messages over the runtime's transport).
`FrameReader` keeps the reads in a list until the frame begun is whole, joins them once, decodes every whole
frame from that buffer (a body frame's payload is one slice of it) and keeps the rest; `FrameReadingConnection`
reads up to RECV_BYTES a call.
Frames other than body frames (methods, content headers, heartbeats, the protocol header) are decoded by pika's
own `decode_frame`, from a slice that holds exactly the frame.

Sending, pika writes each frame it buffered with a `send` call of its own: a published message is three (method,
content header, body), an ack one, so an outbox of 8 messages took 24 system calls. `send_gathered` hands every
buffered frame to one `sendmsg` (up to SEND_BUFFERS at a time); a plaintext connection's transport sends that way.
"""

from __future__ import annotations

import itertools
import struct
import types
from collections.abc import Iterator
from typing import Any

import pika
from pika import frame, spec
from pika.adapters.utils.io_services_utils import _AsyncPlaintextTransport
from pika.exceptions import InvalidFrameError

RECV_BYTES = 1 << 17  # per socket read (pika: 4096)
SEND_BUFFERS = 512  # frames per sendmsg call (Linux takes up to 1024, IOV_MAX)
_HEADER = struct.Struct(">BHL")  # frame type, channel, payload size
_PROTOCOL_HEADER = b"AMQP"  # a protocol header frame (8 bytes), which the broker sends on a version mismatch
_PROTOCOL_HEADER_BYTES = 8


def frame_bytes(buffer: bytes, offset: int = 0) -> int | None:
    """The length of the frame that begins at `offset` (header, payload, end marker), or None while its header is
    not all there."""
    if buffer[offset:offset + 4] == _PROTOCOL_HEADER:
        return _PROTOCOL_HEADER_BYTES
    if len(buffer) - offset < spec.FRAME_HEADER_SIZE:
        return None
    _, _, size = _HEADER.unpack_from(buffer, offset)
    return spec.FRAME_HEADER_SIZE + size + spec.FRAME_END_SIZE


class FrameReader:
    """The frames of a byte stream fed to it in reads of any size, each frame's bytes copied once."""

    def __init__(self) -> None:
        self.unread: list[bytes] = []  # reads since the last whole frame
        self.unread_bytes = 0
        self.needed = spec.FRAME_HEADER_SIZE  # bytes before the frame begun may be whole

    def frames(self, data: bytes) -> Iterator[tuple[int, Any]]:
        """(its length in bytes, the frame) for every frame that `data` completes, in order. InvalidFrameError for a
        frame without its end marker; anything else pika's decode_frame raises."""
        self.unread.append(data)
        self.unread_bytes += len(data)
        if self.unread_bytes < self.needed:
            return
        buffer = self.unread[0] if len(self.unread) == 1 else b"".join(self.unread)
        self.unread, self.unread_bytes, self.needed = [], 0, spec.FRAME_HEADER_SIZE
        offset, end = 0, len(buffer)
        while offset < end:
            size = frame_bytes(buffer, offset)
            if size is None or offset + size > end:
                rest = buffer[offset:] if offset else buffer
                self.unread, self.unread_bytes, self.needed = [rest], len(rest), size or spec.FRAME_HEADER_SIZE
                return
            yield size, self._decoded(buffer, offset, size)
            offset += size

    @staticmethod
    def _decoded(buffer: bytes, offset: int, size: int) -> Any:
        if buffer[offset] == spec.FRAME_BODY:  # (a protocol header begins with "A")
            if buffer[offset + size - 1] != spec.FRAME_END:
                raise InvalidFrameError("Invalid FRAME_END marker")
            channel = _HEADER.unpack_from(buffer, offset)[1]
            return frame.Body(channel, buffer[offset + spec.FRAME_HEADER_SIZE:offset + size - spec.FRAME_END_SIZE])
        consumed, value = frame.decode_frame(buffer[offset:offset + size])
        if consumed != size or value is None:
            raise InvalidFrameError(f"a frame of {size} bytes decoded as {consumed}")
        return value


def send_gathered(transport: Any) -> None:
    """pika's `_AsyncTransportBase._produce`, with the buffered frames sent together: each `sendmsg` takes up to
    SEND_BUFFERS of them, and a partial send leaves the rest of its last frame at the head of the buffers. Raises
    what `sendmsg` raises (a full socket's BlockingIOError, which pika's caller takes as "try again later")."""
    buffers = transport._tx_buffers
    while buffers:
        sent = transport._sock.sendmsg(list(itertools.islice(buffers, SEND_BUFFERS)))
        transport._tx_buffered_byte_count -= sent
        while sent:
            head = buffers[0]
            if sent < len(head):
                buffers[0] = memoryview(head)[sent:]
                break
            buffers.popleft()
            sent -= len(head)


class FrameReadingConnection(pika.SelectConnection):
    """A SelectConnection whose incoming frames are read by a FrameReader, RECV_BYTES a socket read."""

    _reader: FrameReader

    def _init_connection_state(self) -> None:
        super()._init_connection_state()
        self._reader = FrameReader()  # a new stream: nothing read before belongs to it

    def _proto_connection_made(self, transport: Any) -> None:
        if hasattr(transport, "_MAX_RECV_BYTES"):
            transport._MAX_RECV_BYTES = RECV_BYTES
        if type(transport) is _AsyncPlaintextTransport and hasattr(transport, "_tx_buffers"):
            transport._produce = types.MethodType(send_gathered, transport)
        super()._proto_connection_made(transport)

    def _on_data_available(self, data_in: bytes) -> None:
        reader = self._reader
        for size, value in reader.frames(data_in):
            self.bytes_received += size
            self._process_frame(value)
            if self._reader is not reader:  # the frame closed the stream: the rest of this read is not for the next
                return
