"""What encoding and decoding an exchange's messages costs a worker, one at a time and together (dfca.wire.batches).

A worker's message driver publishes its hosted clients' gossip messages of an exchange at once and decodes what
arrived at its queue up to FOLD_BATCH (16) messages at a time. This times, for the gossip payload of each case's
MLP (k=2 clusters, 8-bit codes, the default payload dtype):
- encoding an outbox of `--rows` messages: `encode_message` row by row (from `quantize_rows`' codes, as the driver
  did before) against `encode_rows`, quantizing included in both;
- decoding 16 messages: `decode_message` one at a time against `decode_messages`, then stacking and dequantizing
  them for the fold (`wire.stacked`, as the driver's inbox does) in both;
each the median of `--repeats` timings of `--loops` calls, alternating the two ways; and stacking and dequantizing
alone, the inbox `stacked` builds from the 16 payloads decoded one at a time (each message's codes stacked again)
against those decoded together (the batch's rows taken at once); the checksum (BLAKE3) alone is timed beside them
(the part of a message's cost no batch shares); and dequantizing the 16 arrivals' first-layer codes, as
`dequantize` does (a float32 copy, scaled in place) against `torch.mul(codes, scales)` (one pass, each code
converted as it is read), each call after the caches are flushed, as a driver meets a fresh batch. Both ways
must give the same bytes and values, or the run fails. Appends one line per case, with the commit and the
machine's load, to --out.

    python benchmarks/wire_batches.py [--cases runtime,demo] [--rows 8] [--out FILE]

Cases: `runtime` (benchmarks/runtime_benchmark.py's h=64: 109 kB messages), `demo` (shared/dfca/configs/demo.yaml's
h=200: 318 kB messages).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from resumable_runs import RESULTS, append_stamped

from dfca.core.quantize import dequantize
from dfca.identity import topics
from dfca.wire.batches import decode_messages, encode_rows
from dfca.wire.codec import (
    Envelope,
    TensorSpec,
    checksum,
    decode_message,
    encode_message,
    quantize_rows,
    stacked,
)

K = 2
ARRIVALS = 16  # the driver's FOLD_BATCH
HIDDEN = {"runtime": 64, "demo": 200}


def gossip_spec(hidden: int) -> dict[str, TensorSpec]:
    shapes = {"w1": (784, hidden), "b1": (hidden,), "w2": (hidden, 10), "b2": (10,)}
    return {**{f"num.{n}": TensorSpec((K, *s)) for n, s in shapes.items()}, "den": TensorSpec((K,), "float32")}


def outbox(spec: dict[str, TensorSpec], rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    draw = {"model": torch.randn, "float32": torch.rand}  # models, and weights >= 0
    return {n: draw[s.kind](rows, *s.shape, generator=g) for n, s in spec.items()}


def timings(calls: dict[str, Callable[[], Any]], repeats: int, loops: int, cold: bool = False) -> dict[str, float]:
    """Median seconds per call of each, the ways alternating within every repeat; `cold`: the caches flushed before
    every call (a 32 MB buffer written), which is not timed."""
    flush = torch.empty(8 << 20) if cold else None
    seen: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            spent = 0.0
            for _ in range(loops):
                if flush is not None:
                    flush.fill_(1.0)
                began = time.perf_counter()
                call()
                spent += time.perf_counter() - began
            seen[name].append(spent / loops)
    return {name: statistics.median(values) for name, values in seen.items()}


def measure(case: str, rows: int, repeats: int, loops: int) -> dict[str, Any]:
    spec = gossip_spec(HIDDEN[case])
    tensors = outbox(spec, max(rows, ARRIVALS))
    sent = {n: t[:rows] for n, t in tensors.items()}
    heads = [Envelope("bench", s, 3, "gossip", 0, 0) for s in range(max(rows, ARRIVALS))]

    def one_at_a_time() -> list[tuple[bytes, dict[str, str]]]:
        codes = quantize_rows(spec, sent, torch.int8)
        out = []
        for s in range(rows):
            envelope = Envelope("bench", s, 3, "gossip", 0, 0, {n: t[s] for n, t in sent.items()})
            out.append(encode_message(envelope, spec, torch.int8, None, {n: (c[s], sc[s]) for n, (c, sc) in
                                                                         codes.items()}))
        return out

    def together() -> list[tuple[bytes, dict[str, str]]]:
        return [(body, headers) for body, headers, _ in encode_rows(heads[:rows], spec, sent, torch.int8)]

    if one_at_a_time() != together():
        raise AssertionError(f"{case}: encode_rows wrote other bytes than encode_message")
    arrived = [(topics.model_key("bench", "worker-1", h.sender, 0), body, headers) for h, (body, headers, _) in
               zip(heads, encode_rows(heads[:ARRIVALS], spec, {n: t[:ARRIVALS] for n, t in tensors.items()},
                                      torch.int8), strict=True)]

    def decode_alone() -> list[torch.Tensor]:
        envelopes = [decode_message(key, body, headers, "bench", lambda _: spec) for key, body, headers in arrived]
        return [stacked([e.tensors for e in envelopes], n) for n in spec]

    def decode_together() -> list[torch.Tensor]:
        envelopes = decode_messages(arrived, "bench", lambda _: spec)
        return [stacked([e.tensors for e in envelopes if isinstance(e, Envelope)], n) for n in spec]

    if not all(torch.equal(a, b) for a, b in zip(decode_alone(), decode_together(), strict=True)):
        raise AssertionError(f"{case}: decode_messages gave other values than decode_message")
    decoded_alone = [decode_message(k, b, h, "bench", lambda _: spec) for k, b, h in arrived]
    decoded_together = [e for e in decode_messages(arrived, "bench", lambda _: spec) if isinstance(e, Envelope)]
    encode = timings({"alone": one_at_a_time, "together": together}, repeats, loops)
    decode = timings({"alone": decode_alone, "together": decode_together}, repeats, loops)
    stack = timings({"alone": lambda: [stacked([e.tensors for e in decoded_alone], n) for n in spec],
                     "together": lambda: [stacked([e.tensors for e in decoded_together], n) for n in spec]},
                    repeats, loops)
    first = next(n for n in spec if n.endswith("w1"))
    codes, scales = quantize_rows(spec, {n: t[:ARRIVALS] for n, t in tensors.items()}, torch.int8)[first]
    if not torch.equal(dequantize(codes, scales), torch.mul(codes, scales.unsqueeze(-1))):
        raise AssertionError(f"{case}: the two ways of dequantizing gave other values")
    dequantized = timings({"copy then scale": lambda: dequantize(codes, scales),
                           "one pass": lambda: torch.mul(codes, scales.unsqueeze(-1))}, repeats, loops, cold=True)
    body = arrived[0][1]
    hashed = timings({"checksum": lambda: [checksum(b) for _, b, _ in arrived]}, repeats, loops)["checksum"]
    return {"case": case, "hidden": HIDDEN[case], "body_bytes": len(body), "rows": rows, "arrivals": ARRIVALS,
            "encode_seconds_per_message": {k: v / rows for k, v in encode.items()},
            "decode_seconds_per_message": {k: v / ARRIVALS for k, v in decode.items()},
            "stack_seconds_per_message": {k: v / ARRIVALS for k, v in stack.items()},
            "checksum_seconds_per_message": hashed / ARRIVALS,
            "dequantize_seconds_per_message": {k: v / ARRIVALS for k, v in dequantized.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="runtime,demo")
    parser.add_argument("--rows", type=int, default=8, help="messages in an encoded outbox (a worker's clients)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--loops", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(RESULTS) / "wire_batches_runs.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each of the runtime's workers computes
    load_before = os.getloadavg()[0]
    rows = [measure(case, args.rows, args.repeats, args.loops) for case in args.cases.split(",")]
    stamp = append_stamped(args.out, rows, load_before, threads=1)
    print(f"microseconds per message, medians of {args.repeats} x {args.loops} calls, one thread; 8-bit gossip "
          f"payloads, k={K}; an outbox of {args.rows} encoded, {ARRIVALS} arrivals decoded, stacked and dequantized:\n")
    print("| case | body | encode: one at a time | together | ratio | decode: one at a time | together | ratio | "
          "of which stacking: one at a time | together | ratio | checksum alone | dequantizing the first layer, cold: "
          "copy then scale | one pass |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e, d, st = r["encode_seconds_per_message"], r["decode_seconds_per_message"], r["stack_seconds_per_message"]
        q = r["dequantize_seconds_per_message"]
        print(f"| {r['case']} | {r['body_bytes'] / 1e3:.0f} kB | {e['alone'] * 1e6:.0f} | {e['together'] * 1e6:.0f} | "
              f"{e['alone'] / e['together']:.2f}x | {d['alone'] * 1e6:.0f} | {d['together'] * 1e6:.0f} | "
              f"{d['alone'] / d['together']:.2f}x | {st['alone'] * 1e6:.0f} | {st['together'] * 1e6:.0f} | "
              f"{st['alone'] / st['together']:.2f}x | {r['checksum_seconds_per_message'] * 1e6:.0f} | "
              f"{q['copy then scale'] * 1e6:.0f} | {q['one pass'] * 1e6:.0f} |")
    print(f"\nappended to {args.out} (commit {stamp['commit']}, load {load_before:.2f} -> {stamp['load_after']:.2f})")


if __name__ == "__main__":
    main()
