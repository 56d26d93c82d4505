"""Messages encoded and decoded together (dfca.wire.batches) are what dfca.wire.codec gives one message at a time:
the same
bytes and headers, the same values, the same rejections with the same reasons, whatever else shares the batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save

from dfca.identity import topics
from dfca.wire.batches import decode_messages, encode_rows, payload_layout
from dfca.wire.codec import (
    CHECKSUM,
    Envelope,
    PayloadRejected,
    Spec,
    TensorSpec,
    WireTensors,
    checksum,
    decode_message,
    encode_message,
    stacked,
)

W0 = "worker-0"
GOSSIP: Spec = {"num.w": TensorSpec((2, 3, 4)), "num.b": TensorSpec((2, 4)), "den": TensorSpec((2,), "float32")}
SEED: Spec = {"w": TensorSpec((3, 4)), "b": TensorSpec((4,)), "score": TensorSpec((), "float64"),
              "origin": TensorSpec((), "int64")}
DTYPES = [torch.int8, torch.float32, torch.float16, torch.bfloat16]


def outbox(spec: Spec, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """[rows, ...] tensors of `spec`, at scales far apart, a row of zeros among them, weights >= 0."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, s in spec.items():
        if s.kind == "int64":
            out[n] = torch.randint(0, 50, (rows, *s.shape), generator=g)
        elif s.kind == "model":
            scales = torch.logspace(-3, 3, rows).view(-1, *[1] * len(s.shape))
            out[n] = torch.randn(rows, *s.shape, generator=g) * scales
            out[n][1] = 0.0
        else:
            out[n] = torch.rand(rows, *s.shape, generator=g, dtype=torch.float64 if s.kind == "float64" else None)
    return out


def heads(exchange: str, rows: int, round_: int = 3) -> list[Envelope]:
    return [Envelope("exp1", 10 + s, round_, exchange, 0, s % 2) for s in range(rows)]


def alone(head: Envelope, spec: Spec, tensors: dict[str, torch.Tensor], s: int, dtype: torch.dtype,
          copy: WireTensors | None = None) -> tuple[bytes, dict[str, str]]:
    return encode_message(replace(head, tensors={n: t[s] for n, t in tensors.items()}), spec, dtype, copy)


def same_payload(a: object, b: object) -> bool:
    assert isinstance(a, WireTensors) and isinstance(b, WireTensors)
    if list(a) != list(b):
        return False
    for n in a:
        codes_a, codes_b = a.codes(n), b.codes(n)
        if (codes_a is None) != (codes_b is None):
            return False
        if codes_a is not None and codes_b is not None:
            if not all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(codes_a, codes_b, strict=True)):
                return False
        if not (torch.equal(a[n], b[n]) and a[n].dtype == b[n].dtype):
            return False
    return True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec,exchange", [(GOSSIP, "gossip"), (SEED, "seed")])
def test_an_outbox_encodes_each_row_as_encode_message_does(spec: Spec, exchange: str, dtype: torch.dtype) -> None:
    """Every row's body and headers byte for byte, and the sender's copy for the rows that want one (values, codes
    and dtypes), for every payload dtype, 0-d weights and indices included."""
    rows = 5
    tensors, envelopes = outbox(spec, rows), heads(exchange, rows)
    wanted = [True, False, True, True, False]
    encoded = encode_rows(envelopes, spec, tensors, dtype, received=wanted)
    for s, (body, headers, copy) in enumerate(encoded):
        mine = WireTensors()
        assert (body, headers) == alone(envelopes[s], spec, tensors, s, dtype, mine)
        assert (copy is not None) == wanted[s]
        if copy is not None:
            assert same_payload(copy, mine)


def test_a_ragged_outbox_encodes_each_row_cut_to_its_length() -> None:
    spec: Spec = {**GOSSIP, "num.w": TensorSpec((2, 3, 4), ragged=True)}
    tensors, envelopes, lengths = outbox(spec, 4), heads("gossip", 4), torch.tensor([2, 1, 2, 1])
    encoded = encode_rows(envelopes, spec, tensors, torch.int8, lengths, [True] * 4)
    for s, (body, headers, copy) in enumerate(encoded):
        cut = {**{n: t[s] for n, t in tensors.items()}, "num.w": tensors["num.w"][s][:int(lengths[s])]}
        mine = WireTensors()
        assert (body, headers) == encode_message(replace(envelopes[s], tensors=cut), spec, torch.int8, mine)
        assert copy is not None and same_payload(copy, mine)


def key_of(head: Envelope) -> str:
    return topics.model_key(head.experiment, W0, head.sender, head.part)


def arrivals(spec: Spec, exchange: str, dtype: torch.dtype, rows: int = 4,
             seed: int = 0) -> list[tuple[str, bytes, dict[str, str]]]:
    envelopes = heads(exchange, rows)
    encoded = encode_rows(envelopes, spec, outbox(spec, rows, seed), dtype)
    return [(key_of(h), body, headers) for h, (body, headers, _) in zip(envelopes, encoded, strict=True)]


def one_by_one(messages: list[tuple[str, bytes, dict[str, str]]], spec_of: Callable[[Envelope], Spec]
               ) -> list[Envelope | PayloadRejected]:
    out: list[Envelope | PayloadRejected] = []
    for key, body, headers in messages:
        try:
            out.append(decode_message(key, body, headers, "exp1", spec_of))
        except PayloadRejected as err:
            out.append(err)
    return out


def agree(together: list[Envelope | PayloadRejected], apart: list[Envelope | PayloadRejected]) -> bool:
    assert len(together) == len(apart)
    for a, b in zip(together, apart, strict=True):
        if isinstance(a, PayloadRejected) or isinstance(b, PayloadRejected):
            if not (isinstance(a, PayloadRejected) and isinstance(b, PayloadRejected) and a.reason == b.reason
                    and str(a) == str(b)):
                return False
        elif replace(a, tensors={}) != replace(b, tensors={}) or not same_payload(a.tensors, b.tensors):
            return False
    return True


def by_exchange(head: Envelope) -> Spec:
    if head.exchange == "gossip":
        return GOSSIP
    if head.exchange == "seed":
        return SEED
    raise PayloadRejected("exchange", f"no exchange {head.exchange!r}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_decodes_to_what_each_message_decodes_to_alone(dtype: torch.dtype) -> None:
    """Two exchanges' payloads mixed in one batch (two layouts), read from one buffer each: the same envelopes and
    tensors (codes kept as codes) as decode_message gives each; the fast path is taken (the layout is the file
    encode_message writes)."""
    messages = arrivals(GOSSIP, "gossip", dtype) + arrivals(SEED, "seed", dtype, seed=1)
    messages = [messages[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    together = decode_messages(messages, "exp1", by_exchange)
    assert agree(together, one_by_one(messages, by_exchange))
    assert all(isinstance(e, Envelope) for e in together)
    layout = payload_layout(GOSSIP, str(dtype).removeprefix("torch."))
    assert layout is not None and all(len(m[1]) == layout.size for m in messages[::2])


def damaged(message: tuple[str, bytes, dict[str, str]], spec: Spec, change: Callable[[dict[str, torch.Tensor]], object]
            ) -> tuple[str, bytes, dict[str, str]]:
    """The message's tensors as written, changed, written again by safetensors' own writer and signed again."""
    key, body, headers = message
    from safetensors.torch import load

    tensors = dict(load(body))
    change(tensors)
    new = save(tensors)
    return key, new, {**headers, CHECKSUM: checksum(new)}


@pytest.mark.parametrize("damage", [
    lambda m: (m[0], m[1][:-1], {**m[2], CHECKSUM: checksum(m[1][:-1])}),  # truncated: decode
    lambda m: (m[0], b"junk" * 10, {**m[2], CHECKSUM: checksum(b"junk" * 10)}),  # not safetensors
    lambda m: (m[0], m[1], {**m[2], CHECKSUM: "0" * 64}),  # checksum
    lambda m: (m[0], m[1], {**m[2], "sender": "99"}),  # spoofed: headers against the routing key
    lambda m: (m[0], m[1], {**m[2], "exchange": "merge"}),  # no such exchange
    lambda m: (m[0], m[1], {**m[2], "experiment": "other"}),
    lambda m: damaged(m, GOSSIP, lambda t: t["den"].fill_(-1.0)),  # negative weight, same layout
    lambda m: damaged(m, GOSSIP, lambda t: t["den"].fill_(float("nan"))),
    lambda m: damaged(m, GOSSIP, lambda t: t["num.w#scale"].fill_(float("inf"))),  # same layout, bad scale
    lambda m: damaged(m, GOSSIP, lambda t: t["num.b#scale"].fill_(-1.0)),
    lambda m: damaged(m, GOSSIP, lambda t: t.pop("num.b#scale")),  # another layout: names
    lambda m: damaged(m, GOSSIP, lambda t: t.update({"den": torch.ones(3)})),  # shape
    lambda m: damaged(m, GOSSIP, lambda t: t.update({"num.w": t["num.w"].to(torch.int16)})),  # dtype
])
def test_a_bad_message_in_a_batch_is_rejected_for_its_own_reason_and_the_rest_decode(
        damage: Callable[[tuple[str, bytes, dict[str, str]]], tuple[str, bytes, dict[str, str]]]) -> None:
    messages = arrivals(GOSSIP, "gossip", torch.int8, rows=5)
    messages[2] = damage(messages[2])
    together = decode_messages(messages, "exp1", by_exchange)
    assert agree(together, one_by_one(messages, by_exchange))
    assert isinstance(together[2], PayloadRejected)
    assert all(isinstance(together[i], Envelope) for i in (0, 1, 3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_non_finite_float_payload_is_rejected_in_a_batch(dtype: torch.dtype) -> None:
    messages = arrivals(GOSSIP, "gossip", dtype, rows=3)
    messages[1] = damaged(messages[1], GOSSIP, lambda t: t["num.w"].view(-1)[5].fill_(float("inf")))
    together = decode_messages(messages, "exp1", by_exchange)
    assert agree(together, one_by_one(messages, by_exchange))
    assert isinstance(together[1], PayloadRejected) and together[1].reason == "non_finite"


def test_another_writers_file_of_the_same_tensors_decodes_alone_to_the_same_values() -> None:
    """A file with metadata in its header is not the layout this payload's file has: it is read on its own (no
    shared buffer), and decodes as decode_message decodes it."""
    messages = arrivals(GOSSIP, "gossip", torch.int8, rows=3)
    key, body, headers = messages[1]
    from safetensors.torch import load

    other = save(dict(load(body)), metadata={"writer": "someone else"})
    messages[1] = (key, other, {**headers, CHECKSUM: checksum(other)})
    together = decode_messages(messages, "exp1", by_exchange)
    assert agree(together, one_by_one(messages, by_exchange))
    assert all(isinstance(e, Envelope) for e in together)


def test_messages_read_together_do_not_share_memory_one_would_change() -> None:
    """Each decoded payload is its own rows of the batch's buffer: changing one message's float values in place
    leaves the others' as decoded."""
    messages = arrivals(GOSSIP, "gossip", torch.float32, rows=3)
    first, second = (e for e in decode_messages(messages, "exp1", by_exchange)[:2])
    assert isinstance(first, Envelope) and isinstance(second, Envelope)
    before = second.tensors["num.w"].clone()
    first.tensors["num.w"].add_(1.0)
    assert torch.equal(second.tensors["num.w"], before)


def test_rows_of_a_decoded_batch_stack_to_what_each_message_decodes_to() -> None:
    """`stacked` takes the codes of messages decoded together from their batch (one slice for consecutive rows, one
    gather otherwise) instead of stacking them again: the values torch.stack of each message's decoded tensors
    gives, for every order and subset of the batch, alone or beside a message decoded by itself."""
    messages = arrivals(GOSSIP, "gossip", torch.int8, rows=5)
    batch = [e for e in decode_messages(messages, "exp1", by_exchange) if isinstance(e, Envelope)]
    apart = [e for e in one_by_one(messages, by_exchange) if isinstance(e, Envelope)]
    assert len(batch) == len(apart) == 5
    assert all(batch[0].tensors.batch_row(n) is not None for n in ("num.w", "num.b"))  # the batch path is there
    other = [e for e in decode_messages(arrivals(GOSSIP, "gossip", torch.int8, rows=2, seed=3), "exp1", by_exchange)
             if isinstance(e, Envelope)]
    for rows, extra in [([0, 1, 2, 3, 4], []), ([1, 2, 3], []), ([4, 0, 2], []), ([3], []), ([0, 1], other[:1]),
                        ([2], other)]:
        payloads = [batch[r].tensors for r in rows] + [e.tensors for e in extra]
        reference = [apart[r].tensors for r in rows] + [e.tensors for e in extra]
        for name in GOSSIP:
            got = stacked(payloads, name)
            want = torch.stack([p[name] for p in reference])
            assert got.dtype == want.dtype and torch.equal(got, want), (rows, len(extra), name)


def test_a_decoded_batch_row_read_as_floats_stacks_its_floats() -> None:
    """A payload whose tensor was read (dequantized) is stacked from what was read, as before."""
    batch = [e for e in decode_messages(arrivals(GOSSIP, "gossip", torch.int8, rows=3), "exp1", by_exchange)
             if isinstance(e, Envelope)]
    read = batch[1].tensors["num.w"]
    assert batch[1].tensors.batch_row("num.w") is None and batch[0].tensors.batch_row("num.w") is not None
    got = stacked([e.tensors for e in batch], "num.w")
    assert torch.equal(got[1], read) and torch.equal(got[0], batch[0].tensors["num.w"])


def test_senders_copies_of_an_outbox_stack_to_what_their_messages_decode_to() -> None:
    """The sender's copies `encode_rows` makes for hosted neighbours are rows of the outbox's codes: stacked alone
    (a worker whose every other sender was cut off folds only those) or beside decoded messages, the values the
    messages decode to."""
    envelopes, tensors = heads("gossip", 4), outbox(GOSSIP, 4)
    encoded = encode_rows(envelopes, GOSSIP, tensors, torch.int8, received=[True] * 4)
    copies = [c for _, _, c in encoded]
    assert all(isinstance(c, WireTensors) for c in copies)
    decoded = [e for e in one_by_one([(key_of(h), b, hd) for h, (b, hd, _) in zip(envelopes, encoded, strict=True)],
                                     by_exchange) if isinstance(e, Envelope)]
    other = [e for e in decode_messages(arrivals(GOSSIP, "gossip", torch.int8, rows=2, seed=3), "exp1", by_exchange)
             if isinstance(e, Envelope)]
    for rows, extra in [([0, 1, 2, 3], []), ([3, 1], []), ([2], other)]:
        payloads = [copies[r] for r in rows] + [e.tensors for e in extra]
        reference = [decoded[r].tensors for r in rows] + [e.tensors for e in extra]
        for name in GOSSIP:
            got = stacked([p for p in payloads if p is not None], name)
            assert torch.equal(got, torch.stack([p[name] for p in reference])), (rows, name)
