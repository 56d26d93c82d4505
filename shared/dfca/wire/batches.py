"""Many messages of one exchange encoded, or decoded, together: the bytes, headers, checks and values of
dfca.wire.codec's
one-message functions, in a few tensor operations for a batch instead of some forty for each message.

A worker's driver publishes every hosted row's message of an exchange at once and takes what arrived at its queue
up to FOLD_BATCH messages at a time. Each message stays its own safetensors file with its own checksum (the wire
format does not change); what the batch shares is the work around the bytes, which on this project's machine was
most of a message's cost (a torch or safetensors call costs 3-5 us whatever its size, and a message took dozens):
- `encode_rows`: an outbox's tensors [S, ...] are converted to their wire dtypes once (8-bit codes for every row
  in one call, `quantize_rows`), the file's header is written once, and each row's body is joined from views of
  its rows: the bytes `encode_message` gives, and the same sender's copy (`received`);
- `decode_messages`: each message's headers, exchange and checksum are checked as `decode_message` checks them; a
  body whose header is, byte for byte, the one this payload's file has (`payload_layout`: what `encode_message`
  writes for the exchange's spec and the dtype the headers name) is copied into one buffer with the others of its
  layout, its tensors are views of that buffer, and their values are checked for the whole batch at once (finite
  values, non-negative weights, valid scales). Any other body (another writer's layout, a ragged payload, garbage)
  is read alone by `read_body`, and so is every message of a batch in which a value check fails: the same
  rejections, with the same reasons, as `decode_message` gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import lru_cache

import numpy as np
import torch

from dfca.wire.codec import (
    PAYLOAD_DTYPES,
    SCALE,
    BatchRow,
    Codes,
    Envelope,
    PayloadRejected,
    Spec,
    TensorSpec,
    WireTensors,
    check_checksum,
    checksum,
    encode_message,
    headers_of,
    quantize_rows,
    read_body,
    read_headers,
    scales_valid,
    wire_dtype,
    wire_layout,
)
from dfca.wire.safetensors_layout import DTYPE_NAMES, Layout, byte_view, layout

TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
Encoded = tuple[bytes, dict[str, str], WireTensors | None]  # a message's body, headers and its sender's copy


# -- encoding ---------------------------------------------------------------------------------------------------
def encode_rows(heads: Sequence[Envelope], spec: Spec, tensors: Mapping[str, torch.Tensor], model_dtype: torch.dtype,
                lengths: torch.Tensor | None = None, received: Sequence[bool] | None = None) -> list[Encoded]:
    """`encode_message` for every row s of an outbox: `tensors` hold the rows [S, ...], `heads[s]` is row s's
    envelope (its tensors are not read), `lengths[s]` the rows of its ragged tensors that it sends (None: not
    ragged). Where `received[s]`, row s's sender's copy as `encode_message` fills it, else None."""
    wanted = list(received) if received is not None else [False] * len(heads)
    codes = quantize_rows(spec, tensors, model_dtype)
    quantized = model_dtype == torch.int8
    if lengths is not None or any(s.ragged for s in spec.values()) or (
            quantized and any(s.kind == "model" and n not in codes for n, s in spec.items())):
        return [_encode_row(s, head, spec, tensors, model_dtype, codes, lengths, wanted[s])
                for s, head in enumerate(heads)]
    wire: dict[str, torch.Tensor] = {}  # each wire tensor, every row's: [S, ...]
    copies: dict[str, torch.Tensor] = {}  # the senders' copies of what is not sent as codes
    for n, s in spec.items():
        if s.kind == "model" and quantized:
            wire[n], wire[n + SCALE] = (c.contiguous() for c in codes[n])
            continue
        t = tensors[n].detach().to("cpu")
        wire[n] = t.to(wire_dtype(s, model_dtype)).contiguous()
        if any(wanted):  # copies: what was sent may be state that folding changes in place
            copies[n] = (wire[n].to(t.dtype) if s.kind == "model" else t).clone()
    rows = len(heads)
    file = layout({n: (DTYPE_NAMES[w.dtype], tuple(w.shape[1:])) for n, w in wire.items()})
    data = [byte_view(wire[e.name]).reshape(rows, -1) for e in file.entries]  # [S, bytes] views
    sent_copies = {n: t.unbind(0) for n, t in copies.items()}
    code_rows = {n: (wire[n], wire[n + SCALE]) for n in spec if n + SCALE in wire}  # [S, ...] each
    out: list[Encoded] = []
    for s, head in enumerate(heads):
        body = b"".join([file.prefix, *(d[s] for d in data)])
        copy = _payload(spec, code_rows, sent_copies, s) if wanted[s] else None
        out.append((body, headers_of(head, model_dtype, checksum(body)), copy))
    return out


def _encode_row(s: int, head: Envelope, spec: Spec, tensors: Mapping[str, torch.Tensor], model_dtype: torch.dtype,
                codes: Mapping[str, Codes], lengths: torch.Tensor | None, wanted: bool) -> Encoded:
    """Row s alone, through encode_message (ragged payloads)."""
    rows = None if lengths is None else int(lengths[s])

    def mine(n: str, t: torch.Tensor) -> torch.Tensor:
        return t[s][:rows] if spec[n].ragged else t[s]

    envelope = replace(head, tensors={n: mine(n, tensors[n]) for n in spec})
    copy = WireTensors() if wanted else None
    row_codes = {n: (mine(n, c), mine(n, scale)) for n, (c, scale) in codes.items()}
    body, headers = encode_message(envelope, spec, model_dtype, copy, row_codes)
    return body, headers, copy


# -- decoding ---------------------------------------------------------------------------------------------------
Arrival = tuple[str, bytes, Mapping[str, object]]  # a message's routing key, body and headers


def decode_messages(messages: Sequence[Arrival], experiment: str,
                    spec_of: Callable[[Envelope], Spec]) -> list[Envelope | PayloadRejected]:
    """`decode_message` of each message: its envelope, or the PayloadRejected that decoding it alone raises."""
    results: list[Envelope | PayloadRejected | None] = [None] * len(messages)
    groups: dict[Layout, list[tuple[int, Envelope, Spec]]] = {}
    for i, (key, body, headers) in enumerate(messages):
        try:
            head = read_headers(key, headers, experiment)
            spec = spec_of(head)
            check_checksum(body, headers)
            file = payload_layout(spec, str(headers.get("dtype")))
            if file is not None and len(body) == file.size and body[:len(file.prefix)] == file.prefix:
                groups.setdefault(file, []).append((i, head, spec))
                continue
            results[i] = replace(head, tensors=read_body(body, headers, spec))
        except PayloadRejected as err:
            results[i] = err
    for file, members in groups.items():
        bodies = [messages[i][1] for i, _, _ in members]
        quantized = str(messages[members[0][0]][2].get("dtype")) == "int8"
        payloads = _read_together(file, members[0][2], bodies, quantized)
        for m, (i, head, spec) in enumerate(members):
            if payloads is not None:
                results[i] = replace(head, tensors=payloads[m])
                continue
            try:  # a value failed its check: each message of the batch alone, for the reason of each
                results[i] = replace(head, tensors=read_body(messages[i][1], messages[i][2], spec))
            except PayloadRejected as err:
                results[i] = err
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def payload_layout(spec: Spec, dtype: str) -> Layout | None:
    """The file `encode_message` writes for a payload of this spec under the model dtype a message's
    headers name (`wire_layout`); None where there is no one file (ragged tensors) or the dtype is not one of
    PAYLOAD_DTYPES."""
    return _payload_layout(tuple(spec.items()), dtype)


@lru_cache(maxsize=256)
def _payload_layout(spec: tuple[tuple[str, TensorSpec], ...], dtype: str) -> Layout | None:
    """payload_layout, once per spec and dtype (a message's decode asks for it)."""
    if dtype not in PAYLOAD_DTYPES or any(s.ragged for _, s in spec):
        return None
    return wire_layout(dict(spec), {n: tuple(s.shape) for n, s in spec}, PAYLOAD_DTYPES[dtype])


def _read_together(file: Layout, spec: Spec, bodies: list[bytes], quantized: bool) -> list[WireTensors] | None:
    """The bodies (each `file`'s layout, checksums checked) as payloads whose tensors are views of one buffer, as
    `read_body` reads them; None where any value fails its check (the caller reads each alone)."""
    count, stride = len(bodies), -(-file.size // 8) * 8  # rows 8-byte aligned: every tensor's view is aligned
    buffer = torch.empty((count, stride), dtype=torch.uint8)
    rows = buffer.numpy()
    for m, body in enumerate(bodies):
        rows[m, :file.size] = np.frombuffer(body, dtype=np.uint8)
    views = {e.name: buffer[:, e.start:e.end].view(TORCH_DTYPES[e.dtype]).reshape(count, *e.shape)
             for e in file.entries}
    values: dict[str, tuple[torch.Tensor, ...]] = {}
    codes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> the batch's codes [B, ...], scales [B, ...]
    scales = []
    for name, s in spec.items():
        t = views[name]
        if s.kind == "model" and quantized:
            codes[name] = (t, views[name + SCALE])
            scales.append(views[name + SCALE].reshape(count, -1))
            continue
        if s.kind != "int64":
            t = t.to(torch.float64 if s.kind == "float64" else torch.float32)
            if not bool(torch.isfinite(t).all()) or (s.kind != "model" and bool((t < 0).any())):
                return None
        values[name] = t.unbind(0)
    if scales and not scales_valid(torch.cat(scales, 1)):
        return None
    return [_payload(spec, codes, values, m) for m in range(count)]


def _payload(spec: Spec, codes: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
             values: Mapping[str, Sequence[torch.Tensor]], row: int) -> WireTensors:
    """Row `row`'s payload, in the spec's order: its codes and scales where a tensor has them (with the batch they
    are a row of, for `stacked`), else its values."""
    payload = WireTensors()
    for name in spec:
        if name in codes:
            payload.put_row(name, BatchRow(*codes[name], row))
        else:
            payload.put(name, values[name][row])
    return payload
