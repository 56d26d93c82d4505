"""The wire format of algorithm messages: safetensors bytes plus string headers.

A message is what one hosted row sends in one exchange: named tensors, checked against the exchange's
payload spec, and the headers experiment, sender, round, exchange, step, part, blake3 (the body's checksum), dtype
and version.
Its routing key is `<experiment>.<sender>.<part>` (dfca.identity.topics). Tensors travel as CPU tensors: model
tensors in `runtime.payload_dtype` (float32, float16, bfloat16, or int8: codes plus a float32 scale per row,
`<name>#scale`, core.quantize), weights in float32 or float64, indices in int64. Nothing that crosses a
process boundary is pickled. `as_received` is what a payload's values are after the trip, for a driver that
delivers without encoding (the simulator); `message_bytes` is what a message costs on the wire: its body,
its headers and its routing key, as both drivers count it.

`decode_message` is the one decoder: it checks the routing key against the headers (a spoofed sender or
part), the experiment, the exchange (`spec_of` names its payload, or rejects an exchange the round does
not have), the wire version, the checksum, and every tensor's name, shape, dtype and values (NaN/Inf; negative
weights). A message that fails raises `PayloadRejected`; callers count and dead-letter it and never apply it.

The checksum is BLAKE3 (256 bits, hex): a cryptographic hash, since a receiver tells two bodies of one message apart
by it (equivocation, runtime.driver.admission), and about three times as fast as SHA-256 (wire version 2) on this
project's machine: 20 against 61 us a 109 kB body, and each body is hashed when it is sent and again when it arrives.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, NamedTuple

import torch
from blake3 import blake3
from safetensors.torch import load as st_load

from dfca.core.quantize import dequantize, quantize, round_trip, round_trip_into
from dfca.identity import topics
from dfca.wire.safetensors_layout import DTYPE_NAMES, Layout, layout, to_bytes

WIRE_VERSION = "3"  # 3: the checksum is BLAKE3 (2: SHA-256)
CHECKSUM = "blake3"  # the header that holds the body's checksum
HEADER_KEYS = ("experiment", "sender", "round", "exchange", "step", "part", CHECKSUM, "dtype", "version")
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
PAYLOAD_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
SCALE = "#scale"  # suffix of an int8 model tensor's scales
CHECKSUM_HEX = 64


@dataclass(frozen=True)
class TensorSpec:
    """A payload tensor: its shape, and its kind on the wire (model: `runtime.payload_dtype`).

    `ragged`: the first dimension may be anything from 1 to shape[0] (a server's K_t cluster models, where K_t
    changes from round to round); the rest of the shape is exact.
    """

    shape: tuple[int, ...]
    kind: Literal["model", "float32", "float64", "int64"] = "model"
    ragged: bool = False

    def fits(self, shape: tuple[int, ...]) -> bool:
        if not self.ragged:
            return shape == tuple(self.shape)
        return len(shape) == len(self.shape) and 1 <= shape[0] <= self.shape[0] and shape[1:] == self.shape[1:]


Spec = Mapping[str, TensorSpec]


@dataclass(frozen=True)
class Envelope:
    """One message: who sent it, in which round and exchange, routed by which part, carrying what."""

    experiment: str
    sender: int
    round: int
    exchange: str
    step: int
    part: int
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)


Codes = tuple[torch.Tensor, torch.Tensor]  # a model tensor's int8 codes and float32 scales on the CPU (core.quantize)


class BatchRow(NamedTuple):
    """Row `row` of the codes [B, ...] and scales [B, ...] of B messages decoded together (dfca.wire.batches)."""

    codes: torch.Tensor
    scales: torch.Tensor
    row: int


class WireTensors(Mapping[str, torch.Tensor]):
    """A payload as it came off the wire (or as a sender's own copy of what it sent): model tensors that travelled
    as 8-bit codes are kept as (codes, scale) and dequantized when first read. A driver stacking many messages
    (`stacked`) stacks their int8 codes and dequantizes once, instead of making a float copy of every message and
    copying those again into the stack."""

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}
        self._codes: dict[str, Codes] = {}
        self._rows: dict[str, BatchRow] = {}
        self._names: list[str] = []

    def put(self, name: str, value: torch.Tensor) -> None:
        self._names.append(name)
        self._values[name] = value

    def put_codes(self, name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
        self._names.append(name)
        self._codes[name] = (codes, scale)

    def put_row(self, name: str, row: BatchRow) -> None:
        """Codes that are a row of a batch's (messages decoded together, an outbox's rows), kept with their batch so
        `stacked` can take the batch's rows at once; the row's own views are taken only if it is read alone."""
        self._names.append(name)
        self._rows[name] = row

    def codes(self, name: str) -> Codes | None:
        """(codes, scale) of a model tensor that has not been read as floats yet; None otherwise."""
        if name in self._values:
            return None
        if name not in self._codes and (row := self._rows.get(name)) is not None:
            self._codes[name] = (row.codes[row.row], row.scales[row.row])
        return self._codes.get(name)

    def batch_row(self, name: str) -> BatchRow | None:
        """The decoded batch this tensor's codes are a row of, where they are one and have not been read as floats."""
        return self._rows.get(name) if name not in self._values else None

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape (the codes have the float tensor's shape): nothing is dequantized for it."""
        if (row := self._rows.get(name)) is not None:
            return tuple(row.codes.shape[1:])
        held = self._codes.get(name)
        return tuple((held[0] if held is not None else self._values[name]).shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._values:
            held = self.codes(name)
            if held is None:
                raise KeyError(name)
            self._values[name] = dequantize(*held)
        return self._values[name]

    def __contains__(self, name: object) -> bool:  # without dequantizing (Mapping's would read the tensor)
        return name in self._values or name in self._codes or name in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def shape_of(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A payload tensor's shape, without dequantizing it."""
    return tensors.shape(name) if isinstance(tensors, WireTensors) else tuple(tensors[name].shape)


def stacked(payloads: list[Mapping[str, torch.Tensor]], name: str) -> torch.Tensor:
    """torch.stack of the payloads' `name` tensors, value for value; where all of them hold 8-bit codes, the codes
    are stacked and dequantized in one pass, and where those are rows of one decoded batch, taken from it as one
    slice (or one gather) instead of stacking them again."""
    rows = [p.batch_row(name) if isinstance(p, WireTensors) else None for p in payloads]
    first = rows[0]
    if first is not None and all(r is not None and r.codes is first.codes for r in rows):
        taken = [r.row for r in rows if r is not None]
        if taken == list(range(taken[0], taken[0] + len(taken))):
            run = slice(taken[0], taken[0] + len(taken))
            return dequantize(first.codes[run], first.scales[run])
        index = torch.tensor(taken)
        return dequantize(first.codes.index_select(0, index), first.scales.index_select(0, index))
    held = [p.codes(name) if isinstance(p, WireTensors) else None for p in payloads]
    if all(h is not None for h in held):
        return dequantize(torch.stack([h[0] for h in held if h]), torch.stack([h[1] for h in held if h]))
    return torch.stack([p[name] for p in payloads])


class PayloadRejected(ValueError):
    """A message that must not be applied. `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def checksum(body: bytes) -> str:
    """The body's BLAKE3 digest, 64 hex digits."""
    return blake3(body).hexdigest()


def wire_dtype(spec: TensorSpec, model_dtype: torch.dtype) -> torch.dtype:
    return {"model": model_dtype, "float32": torch.float32, "float64": torch.float64, "int64": torch.int64}[spec.kind]


def quantize_rows(spec: Spec, tensors: Mapping[str, torch.Tensor], model_dtype: torch.dtype) -> dict[str, Codes]:
    """Under int8, the (codes, scale) of every model tensor of an outbox, [R, ...] whole, in one call each: the
    codes of row r are those `encode_message` computes for that row's message alone (a scale per row of the last
    dimension), without R small calls. Nothing under other payload dtypes, or for a tensor without a dimension
    beside the rows."""
    if model_dtype != torch.int8:
        return {}
    return {n: quantize(tensors[n].detach().to("cpu")) for n, s in spec.items()
            if s.kind == "model" and tensors[n].dim() >= 2}


def encode_message(
    envelope: Envelope, spec: Spec, model_dtype: torch.dtype = torch.float32,
    received: WireTensors | None = None, quantized: Mapping[str, Codes] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The message's body and headers. `received`: filled, where given, with what decoding the message gives (CPU
    tensors of its own, as_received's values), from the codes just computed: a sender's copy for receivers in its
    own process. `quantized`: under int8, model tensors' (codes, scale) on the CPU already computed (`quantize_rows`:
    a whole outbox in one call), used instead of the envelope's values, which are then not read."""
    tensors: dict[str, torch.Tensor] = {}
    for n, s in spec.items():
        if s.kind == "model" and model_dtype == torch.int8:
            given = quantized.get(n) if quantized is not None else None
            tensors[n], tensors[n + SCALE] = given or quantize(envelope.tensors[n].detach().to("cpu"))
            if received is not None:
                received.put_codes(n, tensors[n], tensors[n + SCALE])
        else:
            t = envelope.tensors[n].detach().to("cpu")
            tensors[n] = t.to(wire_dtype(s, model_dtype))
            if received is not None:  # a copy: what was sent may be state that folding changes in place
                received.put(n, (tensors[n].to(t.dtype) if s.kind == "model" else t).clone())
    body = serialize(tensors)
    return body, headers_of(envelope, model_dtype, checksum(body))


def serialize(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The safetensors file of CPU tensors, the same bytes as safetensors.torch.save, built from views of the
    tensors with one copy (dfca.wire.safetensors_layout: 0.25 ms less per 109 kB message than safetensors' writer)."""
    return to_bytes({n: t.contiguous() for n, t in tensors.items()})


def headers_of(envelope: Envelope, model_dtype: torch.dtype, digest: str = "0" * CHECKSUM_HEX) -> dict[str, str]:
    """A message's headers (`digest`: its body's checksum; a placeholder of the same length for counting)."""
    return {
        "experiment": envelope.experiment,
        "sender": str(envelope.sender),
        "round": str(envelope.round),
        "exchange": envelope.exchange,
        "step": str(envelope.step),
        "part": str(envelope.part),
        CHECKSUM: digest,
        "dtype": str(model_dtype).removeprefix("torch."),
        "version": WIRE_VERSION,
    }


def message_bytes(body: int, headers: Mapping[str, str], routing_key: str) -> int:
    """What one message costs on the wire, as both drivers count it: the body, the headers as an AMQP field table
    (per entry: key length byte, key, type byte, 4-byte length, value; 4 bytes for the table), the routing key
    (a length byte and the key). The broker's frame overhead (about 20 bytes a frame) is not counted."""
    table = 4 + sum(1 + len(k.encode()) + 1 + 4 + len(v.encode()) for k, v in headers.items())
    return body + table + 1 + len(routing_key.encode())


def as_received(spec: Spec, tensors: Mapping[str, torch.Tensor], model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The payload's values as the receiver decodes them: model tensors rounded to `model_dtype` (or its int8
    codes) and back to float32; weights and indices travel exactly."""
    if model_dtype == torch.float32:
        return dict(tensors)
    return {n: model_as_received(t, model_dtype) if spec[n].kind == "model" else t for n, t in tensors.items()}


def model_as_received(t: torch.Tensor, model_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """A model tensor [..., C] as the receiver decodes it (in t's dtype): each row of its last dimension is rounded
    on its own, so rows of it may be rounded apart, as blocks. `out`: a contiguous float32 tensor of t's shape to
    write it into (no new tensor as large as t)."""
    if out is None:
        return round_trip(t) if model_dtype == torch.int8 else t.to(model_dtype).to(t.dtype)
    if model_dtype == torch.int8:
        return round_trip_into(t, out)
    return out.copy_(t.to(model_dtype))


def body_bytes(spec: Spec, shapes: Mapping[str, tuple[int, ...]], model_dtype: torch.dtype = torch.float32) -> int:
    """The length of `encode_message`'s body for tensors of these shapes (the safetensors header included),
    without the tensors: what the simulator counts as sent for a message the message driver would publish."""
    return wire_layout(spec, shapes, model_dtype).size


def wire_layout(spec: Spec, shapes: Mapping[str, tuple[int, ...]], model_dtype: torch.dtype) -> Layout:
    """The safetensors file `encode_message` writes for tensors of these shapes: each tensor at its wire dtype, and
    under int8 each model tensor's scales beside its codes."""
    entries = [(n, DTYPE_NAMES[wire_dtype(s, model_dtype)], tuple(shapes[n])) for n, s in spec.items()]
    if model_dtype == torch.int8:
        entries += [(n + SCALE, "F32", tuple(shapes[n])[:-1]) for n, s in spec.items() if s.kind == "model"]
    return _file_layout(tuple(sorted(entries)))


@lru_cache(maxsize=256)
def _file_layout(entries: tuple[tuple[str, str, tuple[int, ...]], ...]) -> Layout:
    return layout({n: (dtype, shape) for n, dtype, shape in entries})


def _int_header(headers: Mapping[str, object], key: str) -> int:
    try:
        return int(str(headers[key]))
    except (KeyError, ValueError) as err:
        raise PayloadRejected("bad_header", f"header {key!r} missing or not an integer") from err


def read_headers(routing_key: str, headers: Mapping[str, object], experiment: str) -> Envelope:
    """The message's envelope without its tensors, checked against its routing key and experiment."""
    for key in HEADER_KEYS:
        if key not in headers:
            raise PayloadRejected("bad_header", f"header {key!r} missing")
    if str(headers["version"]) != WIRE_VERSION:
        raise PayloadRejected("version", f"wire version {str(headers['version'])[:20]!r}; this worker reads "
                              f"{WIRE_VERSION!r} (every worker of a deployment runs the same release)")
    try:
        key_experiment, _host, sender, part = topics.parse_model_key(routing_key)
    except ValueError as err:
        raise PayloadRejected("routing_key", str(err)) from err
    head = Envelope(str(headers["experiment"]), _int_header(headers, "sender"), _int_header(headers, "round"),
                    str(headers["exchange"]), _int_header(headers, "step"), _int_header(headers, "part"))
    if (head.experiment, head.sender, head.part) != (key_experiment, sender, part):
        raise PayloadRejected("spoofed", f"headers say sender {head.sender} part {head.part}, routing key "
                              f"{routing_key!r}")
    if head.experiment != experiment:
        raise PayloadRejected("experiment", f"a message of experiment {head.experiment!r}")
    return head


def read_tensors(body: bytes, headers: Mapping[str, object], spec: Spec) -> WireTensors:
    """The payload's tensors, checked against `spec`: models read as float32 (8-bit codes when first read)."""
    check_checksum(body, headers)
    return read_body(body, headers, spec)


def check_checksum(body: bytes, headers: Mapping[str, object]) -> None:
    if checksum(body) != str(headers.get(CHECKSUM)):
        raise PayloadRejected("checksum", f"the {CHECKSUM} checksum of the body does not match its header")


def read_body(body: bytes, headers: Mapping[str, object], spec: Spec) -> WireTensors:
    """read_tensors of a body whose checksum was checked."""
    try:
        tensors = st_load(bytes(body))
    except Exception as err:  # safetensors raises several types on garbage
        raise PayloadRejected("decode", f"not a safetensors payload: {err}") from err
    quantized = str(headers.get("dtype")) == "int8"
    names = set(spec) | ({n + SCALE for n, s in spec.items() if s.kind == "model"} if quantized else set())
    if set(tensors) != names:
        raise PayloadRejected("shape", f"tensor names {sorted(tensors)} != {sorted(names)}")
    out, scales = WireTensors(), []
    for name, s in spec.items():
        t = tensors[name]
        if not s.fits(tuple(t.shape)):
            expected = f"(1..{s.shape[0]}, {', '.join(map(str, s.shape[1:]))})" if s.ragged else str(tuple(s.shape))
            raise PayloadRejected("shape", f"{name} has shape {tuple(t.shape)}, expected {expected}")
        if s.kind == "int64":
            if t.dtype != torch.int64:
                raise PayloadRejected("dtype", f"{name} has dtype {t.dtype}, expected int64")
            out.put(name, t)
            continue
        if s.kind == "model" and quantized:
            out.put_codes(name, *_checked_codes(name, t, tensors[name + SCALE]))
            scales.append(tensors[name + SCALE].reshape(-1))
            continue
        if t.dtype not in FLOATS:
            raise PayloadRejected("dtype", f"{name} has dtype {t.dtype}")
        t = t.to(torch.float64 if s.kind == "float64" else torch.float32)
        if not torch.isfinite(t).all():
            raise PayloadRejected("non_finite", f"{name} contains NaN or Inf")
        if s.kind != "model" and bool((t < 0).any()):
            raise PayloadRejected("negative", f"{name} holds a negative weight")
        out.put(name, t)
    if scales and not scales_valid(torch.cat(scales)):  # all of them in one reduction; then find the culprit
        bad = next(n for n, s in spec.items() if s.kind == "model" and not scales_valid(tensors[n + SCALE]))
        raise PayloadRejected("non_finite", f"{bad}{SCALE} holds a negative or non-finite scale")
    return out


def _checked_codes(name: str, codes: torch.Tensor, scale: torch.Tensor) -> Codes:
    if codes.dtype != torch.int8 or scale.dtype != torch.float32:
        raise PayloadRejected("dtype", f"{name} has dtypes {codes.dtype}, {scale.dtype}; expected int8 and float32")
    if tuple(scale.shape) != tuple(codes.shape)[:-1]:
        raise PayloadRejected("shape", f"{name}{SCALE} has shape {tuple(scale.shape)}, expected "
                              f"{tuple(codes.shape)[:-1]}")
    return codes, scale


def scales_valid(scale: torch.Tensor) -> bool:
    """Every scale finite and >= 0, in one reduction: NaN makes the least scale NaN (not >= 0), an infinity the
    largest."""
    if not scale.numel():
        return True
    least, largest = (float(v) for v in torch.aminmax(scale))
    return least >= 0.0 and math.isfinite(largest)


def decode_message(
    routing_key: str, body: bytes, headers: Mapping[str, object], experiment: str,
    spec_of: Callable[[Envelope], Spec],
) -> Envelope:
    """Check and decode one message; `spec_of(envelope)` gives its exchange's payload or raises PayloadRejected."""
    head = read_headers(routing_key, headers, experiment)
    tensors = read_tensors(body, headers, spec_of(head))
    return Envelope(head.experiment, head.sender, head.round, head.exchange, head.step, head.part, tensors)
