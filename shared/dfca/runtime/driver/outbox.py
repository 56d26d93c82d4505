"""An exchange's outbox encoded for the wire: one message per hosted row's message (the broker fans it out), the
bytes the hosted clients send (once per receiver, as the simulator counts them), and the copies that hosted
neighbours get in the process, as decoding the published message gives them (no broker delivery, decode or ack is
spent on those)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from dfca.algorithms import Algorithm, Exchange
from dfca.algorithms.base import check_finite
from dfca.identity import topics
from dfca.runtime.driver.delivery import Placed
from dfca.runtime.driver.hearing import Hearing
from dfca.wire.batches import encode_rows
from dfca.wire.codec import Envelope, message_bytes


@dataclass
class EncodedOutbox:
    """What to publish (exchange, routing key, body, headers), the bytes sent, the copies delivered in the process."""

    messages: list[tuple[str, str, bytes, Mapping[str, str]]] = field(default_factory=list)
    sent: int = 0  # bytes the hosted clients sent (wire.message_bytes), once per receiver
    local: list[tuple[Placed, list[int]]] = field(default_factory=list)  # a hosted row's message, the rows hearing it


def encode_outbox(algorithm: Algorithm, ex: Exchange, index: int, t: int, experiment: str, model_dtype: torch.dtype,
                  hearing: Hearing, host_of: Callable[[int], str]) -> EncodedOutbox:
    """What the hosted rows send in exchange `index` (`ex`) of round t; their models checked finite first."""
    out, spec = algorithm.send(ex), algorithm.payload(ex)
    models = algorithm.ctx.model.shapes()
    check_finite(algorithm, t, {n: out.tensors[n] for n in spec if n in models or n.split(".", 1)[-1] in models})
    heads = [Envelope(experiment, algorithm.ctx.clients[row], t, ex.name, ex.step, part)
             for row, part in zip(out.row.tolist(), out.part.tolist(), strict=True)]
    hearing_of = [hearing.rows(h.sender, ex) if h.sender in hearing.hosted else [] for h in heads]
    encoded = encode_rows(heads, spec, out.tensors, model_dtype, out.lengths, [bool(h) for h in hearing_of])
    outbox = EncodedOutbox()
    for head, rows, (body, headers, received) in zip(heads, hearing_of, encoded, strict=True):
        key = topics.model_key(experiment, host_of(head.sender), head.sender, head.part)
        outbox.messages.append((topics.MODELS_EXCHANGE, key, body, headers))
        if algorithm.side == "clients":
            receivers = 1 if ex.receiver == "server" else len(algorithm.ctx.graph.get(head.sender, ()))
            outbox.sent += message_bytes(len(body), headers, key) * receivers
        if received is not None:
            outbox.local.append((Placed(replace(head, tensors=received), index, ex), rows))
    return outbox
