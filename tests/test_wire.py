"""Wire format: safetensors + headers, one decoder for every message; bad payloads are rejected, never applied."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
import torch
from blake3 import blake3
from safetensors.torch import load as st_load
from safetensors.torch import save

from dfca.core.quantize import dequantize
from dfca.identity import topics
from dfca.wire.codec import (
    CHECKSUM,
    WIRE_VERSION,
    Envelope,
    PayloadRejected,
    Spec,
    TensorSpec,
    WireTensors,
    as_received,
    body_bytes,
    checksum,
    decode_message,
    encode_message,
    headers_of,
    message_bytes,
    quantize_rows,
    serialize,
    shape_of,
    stacked,
)
from dfca.wire.safetensors_layout import to_bytes

W0 = "worker-0"  # the host word of every client when one worker hosts them all
AGG = "aggregator"  # the host word of a central role

MODEL: Spec = {"w": TensorSpec((3, 4)), "b": TensorSpec((4,))}
GOSSIP: Spec = {"num.w": TensorSpec((2, 3, 4)), "num.b": TensorSpec((2, 4)), "den": TensorSpec((2,), "float32")}
SEED: Spec = {**MODEL, "score": TensorSpec((), "float64"), "origin": TensorSpec((), "int64")}
KEY = topics.model_key("exp1", W0, 7, 1)


def model_message() -> Envelope:
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
    return Envelope("exp1", 7, 3, "models", 0, 1, tensors)


def gossip_message() -> Envelope:
    g = torch.Generator().manual_seed(1)
    return Envelope("exp1", 7, 3, "gossip", 2, 1, {"num.w": torch.randn(2, 3, 4, generator=g),
                                                   "num.b": torch.randn(2, 4, generator=g),
                                                   "den": torch.tensor([1 / 3, 0.0])})


def decode(body: bytes, headers: dict[str, str], spec: Spec = MODEL, key: str = KEY) -> Envelope:
    return decode_message(key, body, headers, "exp1", lambda _head: spec)


def rejected(call: Callable[[], object]) -> str:
    with pytest.raises(PayloadRejected) as err:
        call()
    return err.value.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_the_body_is_the_file_safetensors_torch_writer_makes(dtype: torch.dtype) -> None:
    """encode_message writes through safetensors' numpy writer (faster); the bytes are the torch writer's, byte for
    byte, for every payload dtype and every kind of tensor (models, float32 and float64 weights, int64 indices)."""
    g = torch.Generator().manual_seed(2)
    tensors = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g),
               "score": torch.tensor(0.25, dtype=torch.float64), "origin": torch.tensor(5)}
    envelope = Envelope("exp1", 7, 3, "seed", 0, 1, tensors)
    body, _ = encode_message(envelope, SEED, dtype)
    written = st_load(body)
    assert body == save(written) and set(written) >= set(SEED)
    assert written["origin"].dtype == torch.int64 and written["score"].dtype == torch.float64


def test_roundtrip_float32_exact() -> None:
    body, headers = encode_message(model_message(), MODEL)
    got = decode(body, headers)
    assert (got.experiment, got.sender, got.round, got.exchange, got.step, got.part) == ("exp1", 7, 3, "models", 0, 1)
    for k in MODEL:
        assert torch.equal(got.tensors[k], model_message().tensors[k])
    assert headers[CHECKSUM] == checksum(body)


def test_float16_payload_is_half_the_size_and_close_and_weights_stay_exact() -> None:
    body32, _ = encode_message(model_message(), MODEL)
    body16, headers = encode_message(model_message(), MODEL, torch.float16)
    assert len(body16) < len(body32)
    got = decode(body16, headers)
    assert got.tensors["w"].dtype == torch.float32
    torch.testing.assert_close(got.tensors["w"], model_message().tensors["w"], atol=1e-2, rtol=1e-2)
    body, headers = encode_message(gossip_message(), GOSSIP, torch.float16)
    gossip = decode(body, headers, GOSSIP)
    assert torch.equal(gossip.tensors["den"], gossip_message().tensors["den"])  # 1/3 survives exactly
    seed = Envelope("exp1", 7, 0, "seed", 0, 1, {**model_message().tensors, "score": torch.tensor(0.1 + 1e-12,
                                                                                              dtype=torch.float64),
                                                  "origin": torch.tensor(12)})
    got_seed = decode(*encode_message(seed, SEED, torch.float16), SEED)
    assert float(got_seed.tensors["score"]) == 0.1 + 1e-12 and int(got_seed.tensors["origin"]) == 12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8])
def test_lossy_payloads_decode_to_what_the_simulator_delivers(dtype: torch.dtype) -> None:
    """as_received (the simulator's delivery) gives exactly what the receiver decodes, and weights stay exact."""
    message = gossip_message()
    body, headers = encode_message(message, GOSSIP, dtype)
    got = decode(body, headers, GOSSIP)
    expected = as_received(GOSSIP, message.tensors, dtype)
    for name in GOSSIP:
        assert torch.equal(got.tensors[name], expected[name]), name
    assert torch.equal(got.tensors["den"], message.tensors["den"])
    torch.testing.assert_close(got.tensors["num.w"], message.tensors["num.w"], atol=0.02, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_the_senders_own_copy_is_what_the_receiver_decodes(dtype: torch.dtype) -> None:
    """encode_message's `received` (a worker's copy for its own clients): the decoded values exactly, in tensors
    that do not share the sent ones' memory (folding changes the sent state in place)."""
    message = gossip_message()
    received = WireTensors()
    body, headers = encode_message(message, GOSSIP, dtype, received)
    got = decode(body, headers, GOSSIP)
    assert set(received) == set(GOSSIP)
    for name in GOSSIP:
        assert received[name].dtype == got.tensors[name].dtype and torch.equal(received[name], got.tensors[name]), name
        assert received[name].untyped_storage().data_ptr() != message.tensors[name].untyped_storage().data_ptr()


def test_int8_payload_is_a_quarter_and_its_scales_are_checked() -> None:
    g = torch.Generator().manual_seed(2)
    big: Spec = {"w": TensorSpec((200, 784)), "b": TensorSpec((200,))}
    message = Envelope("exp1", 7, 3, "models", 0, 1, {"w": torch.randn(200, 784, generator=g),
                                                      "b": torch.randn(200, generator=g)})
    body32, _ = encode_message(message, big)
    body8, headers = encode_message(message, big, torch.int8)
    assert len(body8) < 0.26 * len(body32)
    assert len(body8) == body_bytes(big, {"w": (200, 784), "b": (200,)}, torch.int8)
    got = decode(body8, headers, big)
    row_max = message.tensors["w"].abs().amax(1, keepdim=True)
    assert bool(((got.tensors["w"] - message.tensors["w"]).abs() <= row_max / 254 + 1e-6).all())
    tensors = st_load(body8)
    nan_one, inf_one = tensors["w#scale"].clone(), tensors["w#scale"].clone()
    nan_one[1], inf_one[2] = float("nan"), float("inf")
    for bad, reason in ((-tensors["w#scale"], "non_finite"), (nan_one, "non_finite"), (inf_one, "non_finite"),
                        (tensors["w#scale"][:3], "shape"),
                        (tensors["w#scale"].double(), "dtype")):
        forged, forged_headers = resigned({**tensors, "w#scale": bad}, message, big, torch.int8)
        assert rejected(lambda: decode(forged, forged_headers, big)) == reason  # noqa: B023
    missing, missing_headers = resigned({"w": tensors["w"], "b": tensors["b"]}, message, big, torch.int8)
    assert rejected(lambda: decode(missing, missing_headers, big)) == "shape"


def test_message_bytes_count_body_headers_and_routing_key() -> None:
    body, headers = encode_message(model_message(), MODEL)
    table = 4 + sum(1 + len(k) + 1 + 4 + len(v) for k, v in headers.items())
    assert message_bytes(len(body), headers, KEY) == len(body) + table + 1 + len(KEY)
    assert headers_of(model_message(), torch.float32, headers[CHECKSUM]) == headers


def test_garbage_bytes_rejected() -> None:
    body = b"\x00garbage" * 10
    headers = {**encode_message(model_message(), MODEL)[1], CHECKSUM: checksum(body)}
    assert rejected(lambda: decode(body, headers)) == "decode"


def test_checksum_mismatch_rejected() -> None:
    body, headers = encode_message(model_message(), MODEL)
    tampered = body[:-1] + bytes([body[-1] ^ 1])
    assert rejected(lambda: decode(tampered, headers)) == "checksum"


def test_a_message_of_another_wire_version_is_rejected_as_such() -> None:
    """A worker of an earlier release (wire version 2: a SHA-256 checksum under `sha256`) is told apart from a
    corrupted body."""
    body, headers = encode_message(model_message(), MODEL)
    old = {**{k: v for k, v in headers.items() if k != CHECKSUM}, "sha256": hashlib.sha256(body).hexdigest(),
           "version": "2", CHECKSUM: checksum(body)}
    with pytest.raises(PayloadRejected) as err:
        decode(body, old)
    assert err.value.reason == "version" and "'2'" in str(err.value)
    assert headers["version"] == WIRE_VERSION


def test_the_checksum_is_the_bodys_blake3() -> None:
    body, headers = encode_message(model_message(), MODEL)
    assert headers[CHECKSUM] == blake3(body).hexdigest() and len(headers[CHECKSUM]) == 64


def test_wrong_names_and_shapes_rejected() -> None:
    body, headers = encode_message(model_message(), MODEL)
    assert rejected(lambda: decode(body, headers, {"w": TensorSpec((4, 3)), "b": TensorSpec((4,))})) == "shape"
    assert rejected(lambda: decode(body, headers, {"w": TensorSpec((3, 4))})) == "shape"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rejected(bad: float) -> None:
    message = model_message()
    message.tensors["w"][1, 2] = bad
    body, headers = encode_message(message, MODEL)
    assert rejected(lambda: decode(body, headers)) == "non_finite"


def resigned(tensors: dict[str, torch.Tensor], like: Envelope, spec: Spec,
             dtype: torch.dtype = torch.float32) -> tuple[bytes, dict[str, str]]:
    body = save(tensors)
    return body, {**encode_message(like, spec, dtype)[1], CHECKSUM: checksum(body)}


def test_wrong_dtype_rejected() -> None:
    body, headers = resigned({"w": torch.zeros(3, 4, dtype=torch.int32), "b": torch.zeros(4)}, model_message(), MODEL)
    assert rejected(lambda: decode(body, headers)) == "dtype"


@pytest.mark.parametrize("drop", ["round", "exchange", "step", "part", "sender", CHECKSUM, "version"])
def test_missing_header_rejected(drop: str) -> None:
    body, headers = encode_message(model_message(), MODEL)
    del headers[drop]
    assert rejected(lambda: decode(body, headers)) == "bad_header"


def test_headers_are_checked_against_the_routing_key_and_experiment() -> None:
    body, headers = encode_message(model_message(), MODEL)
    assert rejected(lambda: decode(body, headers, key=topics.model_key("exp1", W0, 8, 1))) == "spoofed"
    assert rejected(lambda: decode(body, headers, key=topics.model_key("exp1", W0, 7, 0))) == "spoofed"
    server_key = topics.model_key("exp1", AGG, topics.SERVER_SENDER, 1)
    assert rejected(lambda: decode(body, headers, key=server_key)) == "spoofed"
    assert rejected(lambda: decode(body, headers, key="exp1.7")) == "routing_key"
    assert rejected(lambda: decode(body, headers, key="exp1.-1.1")) == "routing_key"  # no client id is negative
    assert rejected(lambda: decode_message(KEY.replace("exp1", "exp2"), body, {**headers, "experiment": "exp2"},
                                           "exp1", lambda _h: MODEL)) == "experiment"


def test_the_exchange_decides_the_payload() -> None:
    """`spec_of` sees the headers first: a gossip message is checked as gossip, and an unknown exchange refused."""
    body, headers = encode_message(gossip_message(), GOSSIP)
    seen: list[str] = []

    def spec_of(head: Envelope) -> Spec:
        seen.append(head.exchange)
        if head.exchange != "gossip":
            raise PayloadRejected("exchange", head.exchange)
        return GOSSIP

    got = decode_message(KEY, body, headers, "exp1", spec_of)
    assert seen == ["gossip"] and got.step == 2 and torch.equal(got.tensors["den"], gossip_message().tensors["den"])
    model_body, model_headers = encode_message(model_message(), MODEL)
    assert rejected(lambda: decode_message(KEY, model_body, model_headers, "exp1", spec_of)) == "exchange"
    assert rejected(lambda: decode(body, headers, MODEL)) == "shape"  # a gossip payload is no model


@pytest.mark.parametrize("damage,reason", [
    (lambda t: t.update({"num.w": torch.full((2, 3, 4), float("nan"))}), "non_finite"),
    (lambda t: t.update({"den": torch.tensor([float("inf"), 0.0])}), "non_finite"),
    (lambda t: t.update({"den": torch.tensor([-0.5, 1.0])}), "negative"),
    (lambda t: t.update({"den": torch.zeros(3)}), "shape"),
    (lambda t: t.update({"num.b": torch.zeros(2, 5)}), "shape"),
    (lambda t: t.pop("num.b"), "shape"),
    (lambda t: t.update({"num.c": torch.zeros(4)}), "shape"),
    (lambda t: t.update({"num.w": torch.zeros(2, 3, 4, dtype=torch.int32)}), "dtype"),
])
def test_bad_gossip_payloads_rejected(damage: Callable[[dict[str, torch.Tensor]], object], reason: str) -> None:
    tensors = {n: t.clone() for n, t in gossip_message().tensors.items()}
    damage(tensors)
    body, headers = resigned(tensors, gossip_message(), GOSSIP)
    assert rejected(lambda: decode(body, headers, GOSSIP)) == reason


def test_an_index_must_be_an_integer() -> None:
    seed = Envelope("exp1", 7, 0, "seed", 0, 1, {**model_message().tensors, "score": torch.tensor(0.5),
                                                 "origin": torch.tensor(3)})
    tensors = {**{n: t for n, t in seed.tensors.items()}, "origin": torch.tensor(3.0)}
    body, headers = resigned(tensors, seed, SEED)
    assert rejected(lambda: decode(body, headers, SEED)) == "dtype"


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32, torch.float16])
def test_an_outbox_quantized_in_one_call_encodes_each_message_byte_for_byte_as_alone(dtype: torch.dtype) -> None:
    """quantize_rows rounds a whole outbox [S, ...] in one call per tensor (the message driver's publish); each
    message encoded from its row's codes is the same body, headers and local copy as encoding it alone, ragged
    payloads (a first dimension cut to the message's length) included."""
    g = torch.Generator().manual_seed(3)
    spec: Spec = {**GOSSIP, "num.w": TensorSpec((2, 3, 4), ragged=True)}
    outbox = {"num.w": torch.randn(5, 2, 3, 4, generator=g) * torch.logspace(-3, 3, 5).view(5, 1, 1, 1),
              "num.b": torch.randn(5, 2, 4, generator=g), "den": torch.rand(5, 2, generator=g)}
    outbox["num.w"][2] = 0.0  # a row of zeros: scale 0
    codes = quantize_rows(spec, outbox, dtype)
    assert set(codes) == ({"num.w", "num.b"} if dtype == torch.int8 else set())
    for s, rows in enumerate([2, 1, 2, 2, 1]):
        tensors = {"num.w": outbox["num.w"][s][:rows], "num.b": outbox["num.b"][s], "den": outbox["den"][s]}
        envelope = Envelope("exp1", 7, 3, "gossip", 2, 1, tensors)
        mine = {n: (c[s][:rows], scale[s][:rows]) if spec[n].ragged else (c[s], scale[s])
                for n, (c, scale) in codes.items()}
        alone_copy, batched_copy = WireTensors(), WireTensors()
        assert encode_message(envelope, spec, dtype, alone_copy) == encode_message(envelope, spec, dtype,
                                                                                   batched_copy, mine)
        assert alone_copy.keys() == batched_copy.keys()
        assert all(torch.equal(alone_copy[n], batched_copy[n]) for n in alone_copy)


def test_decoded_codes_are_stacked_as_the_floats_would_be() -> None:
    """A decoded int8 payload keeps its model tensors as codes until read: reading one gives the dequantized values,
    and `stacked` over many messages (codes stacked, dequantized once; the message driver's inbox) equals
    torch.stack of each message's dequantized values bit for bit, also beside float payloads and a sender's own
    copy, whose shapes `shape_of` gives without dequantizing."""
    g = torch.Generator().manual_seed(4)
    messages = [Envelope("exp1", 7, 3, "gossip", s, 1, {"num.w": torch.randn(2, 3, 4, generator=g) * 10 ** (s - 2),
                                                        "num.b": torch.randn(2, 4, generator=g),
                                                        "den": torch.rand(2, generator=g)}) for s in range(4)]
    messages[1].tensors["num.w"][0] = 0.0  # a zero row: scale 0
    decoded = [decode(*encode_message(m, GOSSIP, torch.int8), GOSSIP).tensors for m in messages[:3]]
    own = WireTensors()
    encode_message(messages[3], GOSSIP, torch.int8, own)
    payloads = [*decoded, own]
    assert all(isinstance(p, WireTensors) and p.codes("num.w") is not None for p in payloads)
    assert all(shape_of(p, "num.w") == (2, 3, 4) and p.codes("num.w") is not None for p in payloads)
    floats = [{n: dequantize(*p.codes(n)) if p.codes(n) is not None else p[n] for n in GOSSIP} for p in payloads]
    for name in GOSSIP:
        together = stacked(payloads, name)
        assert together.dtype == torch.float32 and torch.equal(together, torch.stack([f[name] for f in floats]))
    assert torch.equal(decoded[0]["num.w"], floats[0]["num.w"]) and decoded[0].codes("num.w") is None  # now read
    mixed = [decoded[0], {"num.w": torch.ones(2, 3, 4)}]
    assert torch.equal(stacked(mixed, "num.w"), torch.stack([floats[0]["num.w"], torch.ones(2, 3, 4)]))
    assert list(decoded[1]) == list(GOSSIP) and len(decoded[1]) == len(GOSSIP)


def test_the_body_is_safetensors_own_file_byte_for_byte() -> None:
    """serialize (header plus views, dfca.wire.safetensors_layout) writes the bytes safetensors' own writer writes, for
    every dtype a payload or a checkpoint holds, 0-d and empty tensors and metadata included, and the file is
    contiguous CPU tensors only."""
    g = torch.Generator().manual_seed(5)
    dtypes = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.int32,
              torch.float32, torch.float64, torch.int64)
    tensors: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(dtypes):
        tensors[f"t{len(dtypes) - i}"] = (torch.rand(3, 2, generator=g) * 100).to(dtype)
        tensors[f"s{i}"], tensors[f"e{i}"] = torch.tensor(1.5).to(dtype), torch.zeros(0, 3, dtype=dtype)
    assert serialize(tensors) == save(tensors)
    assert to_bytes(tensors, {"round": "3"}) == save(tensors, metadata={"round": "3"})
    w = torch.randn(4, 3, generator=g)
    assert serialize({"w": w.t()}) == save({"w": w.t().contiguous()})  # serialize makes a transposed view contiguous
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        to_bytes({"w": torch.randn(4, 3).t()})
