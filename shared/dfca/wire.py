"""The wire format of algorithm messages: safetensors bytes plus string headers.

A message is what one hosted row sends in one exchange: named tensors, checked against the exchange's
payload spec, and the headers experiment, sender, round, exchange, step, part, sha256, dtype and version.
Its routing key is `<experiment>.<sender>.<part>` (dfca.topics). Tensors travel as CPU tensors: model
tensors in `runtime.payload_dtype`, weights in float32 or float64, indices in int64. Nothing that crosses
a process boundary is pickled.

`decode_message` is the one decoder: it checks the routing key against the headers (a spoofed sender or
part), the experiment, the exchange (`spec_of` names its payload, or rejects an exchange the round does
not have), the checksum, and every tensor's name, shape, dtype and values (NaN/Inf; negative weights).
A message that fails raises `PayloadRejected`; callers count and dead-letter it and never apply it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dfca import topics

WIRE_VERSION = "2"
HEADER_KEYS = ("experiment", "sender", "round", "exchange", "step", "part", "sha256", "dtype", "version")
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


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
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class PayloadRejected(ValueError):
    """A message that must not be applied. `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _wire_dtype(spec: TensorSpec, model_dtype: torch.dtype) -> torch.dtype:
    return {"model": model_dtype, "float32": torch.float32, "float64": torch.float64, "int64": torch.int64}[spec.kind]


def encode_message(
    envelope: Envelope, spec: Spec, model_dtype: torch.dtype = torch.float32
) -> tuple[bytes, dict[str, str]]:
    tensors = {n: envelope.tensors[n].detach().to("cpu", _wire_dtype(s, model_dtype)).contiguous()
               for n, s in spec.items()}
    body = st_save(tensors)
    headers = {
        "experiment": envelope.experiment,
        "sender": str(envelope.sender),
        "round": str(envelope.round),
        "exchange": envelope.exchange,
        "step": str(envelope.step),
        "part": str(envelope.part),
        "sha256": sha256(body),
        "dtype": str(model_dtype).removeprefix("torch."),
        "version": WIRE_VERSION,
    }
    return body, headers


def body_bytes(spec: Spec, shapes: Mapping[str, tuple[int, ...]], model_dtype: torch.dtype = torch.float32) -> int:
    """The length of `encode_message`'s body for tensors of these shapes (the safetensors header included),
    without the tensors: what the simulator counts as sent for a message the message driver would publish."""
    key = tuple(sorted((n, tuple(shapes[n]), str(_wire_dtype(s, model_dtype))) for n, s in spec.items()))
    return _body_bytes(key)


@lru_cache(maxsize=256)
def _body_bytes(key: tuple[tuple[str, tuple[int, ...], str], ...]) -> int:
    dtypes = {str(d): d for d in (torch.float16, torch.float32, torch.float64, torch.int64)}
    return len(st_save({n: torch.empty(shape, dtype=dtypes[d]) for n, shape, d in key}))


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


def read_tensors(body: bytes, headers: Mapping[str, object], spec: Spec) -> dict[str, torch.Tensor]:
    """The payload's tensors, checked against `spec`: models come back as float32."""
    if sha256(body) != str(headers.get("sha256")):
        raise PayloadRejected("checksum", "sha256 of the body does not match its header")
    try:
        tensors = st_load(bytes(body))
    except Exception as err:  # safetensors raises several types on garbage
        raise PayloadRejected("decode", f"not a safetensors payload: {err}") from err
    if set(tensors) != set(spec):
        raise PayloadRejected("shape", f"tensor names {sorted(tensors)} != {sorted(spec)}")
    out: dict[str, torch.Tensor] = {}
    for name, s in spec.items():
        t = tensors[name]
        if not s.fits(tuple(t.shape)):
            expected = f"(1..{s.shape[0]}, {', '.join(map(str, s.shape[1:]))})" if s.ragged else str(tuple(s.shape))
            raise PayloadRejected("shape", f"{name} has shape {tuple(t.shape)}, expected {expected}")
        if s.kind == "int64":
            if t.dtype != torch.int64:
                raise PayloadRejected("dtype", f"{name} has dtype {t.dtype}, expected int64")
            out[name] = t
            continue
        if t.dtype not in FLOATS:
            raise PayloadRejected("dtype", f"{name} has dtype {t.dtype}")
        t = t.to(torch.float64 if s.kind == "float64" else torch.float32)
        if not torch.isfinite(t).all():
            raise PayloadRejected("non_finite", f"{name} contains NaN or Inf")
        if s.kind != "model" and bool((t < 0).any()):
            raise PayloadRejected("negative", f"{name} holds a negative weight")
        out[name] = t
    return out


def decode_message(
    routing_key: str, body: bytes, headers: Mapping[str, object], experiment: str,
    spec_of: Callable[[Envelope], Spec],
) -> Envelope:
    """Check and decode one message; `spec_of(envelope)` gives its exchange's payload or raises PayloadRejected."""
    head = read_headers(routing_key, headers, experiment)
    tensors = read_tensors(body, headers, spec_of(head))
    return Envelope(head.experiment, head.sender, head.round, head.exchange, head.step, head.part, tensors)
