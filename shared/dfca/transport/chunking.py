"""Bodies larger than a transport's `chunk_bytes` travel as several messages: the headers that say which part of
which message each is, and the string headers a delivery carries once they are taken off (see
dfca.transport.rabbitmq, "Large messages")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

CHUNK_ID = "x-chunk-id"
CHUNK_INDEX = "x-chunk-index"
CHUNK_COUNT = "x-chunk-count"
RESERVED_HEADER_PREFIX = "x-chunk-"
MAX_CHUNKS = 1024  # parts of one chunked message: 16 GiB at the default chunk size


def split_body(body: bytes, chunk_bytes: int) -> list[bytes]:
    """The parts a body is published as: one part when it fits in `chunk_bytes`."""
    if len(body) <= chunk_bytes:
        return [body]
    count = math.ceil(len(body) / chunk_bytes)
    return [body[i * chunk_bytes:(i + 1) * chunk_bytes] for i in range(count)]


def chunk_headers(headers: Mapping[str, str], chunk_id: str, index: int, count: int) -> dict[str, str]:
    return {**headers, CHUNK_ID: chunk_id, CHUNK_INDEX: str(index), CHUNK_COUNT: str(count)}


def chunk_position(raw: Mapping[str, Any]) -> tuple[int, int]:
    """(index, count) of a chunked message's part; ValueError unless 0 <= index < count <= MAX_CHUNKS."""
    try:
        index, count = int(raw[CHUNK_INDEX]), int(raw[CHUNK_COUNT])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"chunk headers {CHUNK_INDEX}/{CHUNK_COUNT} missing or not integers") from err
    if not 0 <= index < count <= MAX_CHUNKS:
        raise ValueError(f"chunk part {index} of {count} (at most {MAX_CHUNKS} parts)")
    return index, count


def delivered_headers(raw: Mapping[str, Any] | None) -> dict[str, str]:
    """AMQP header table -> the string headers a `Message` carries (chunking headers removed)."""
    headers: dict[str, str] = {}
    for key, value in (raw or {}).items():
        if key.startswith(RESERVED_HEADER_PREFIX):
            continue
        if isinstance(value, str):
            headers[key] = value
        elif isinstance(value, bytes):
            headers[key] = value.decode("utf-8", errors="replace")
        elif isinstance(value, bool | int | float):
            headers[key] = str(value)
    return headers
