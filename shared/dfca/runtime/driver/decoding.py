"""The message driver's decoder: what arrived together decoded together (dfca.wire.batches.decode_messages: the
routing key against the headers, the experiment, an exchange that the message's round has, payload names, shapes
and values), once for all copies of one message, each message placed in its round's exchanges once."""

from __future__ import annotations

import json
from collections.abc import Sequence

from dfca.algorithms import Algorithm, Exchange
from dfca.runtime.driver.delivery import Placed
from dfca.transport import Message
from dfca.wire.batches import decode_messages
from dfca.wire.codec import Envelope, PayloadRejected, Spec


def exchange_of(head: Envelope, algorithm: Algorithm, current_round: int,
                current: Sequence[Exchange]) -> tuple[int, Exchange]:
    """The index and exchange a message belongs to (`current`: the exchanges of `current_round`); PayloadRejected
    if its round has no such exchange."""
    total = algorithm.schedule.total_rounds
    if not 0 <= head.round < total:
        raise PayloadRejected("round", f"round {head.round} outside 0..{total - 1}")
    exchanges = current if head.round == current_round else algorithm.exchanges(head.round)
    for index, ex in enumerate(exchanges):
        if (ex.name, ex.step) == (head.exchange, head.step):
            return index, ex
    raise PayloadRejected("exchange", f"round {head.round} has no exchange {head.exchange!r} step {head.step}")


def distinct_messages(messages: Sequence[Message]) -> tuple[list[Message], list[int]]:
    """The distinct messages (the same routing key, headers and body: the body is compared, not only its stated
    checksum), and which of them each message is."""
    firsts: dict[tuple[str, str], list[int]] = {}  # key and headers -> the distinct messages that have them
    distinct: list[Message] = []
    which: list[int] = []
    for message in messages:
        same = firsts.setdefault((message.routing_key, json.dumps(message.headers, sort_keys=True, default=str)), [])
        at = next((i for i in same if distinct[i].body == message.body), None)
        if at is None:
            at = len(distinct)
            same.append(at)
            distinct.append(message)
        which.append(at)
    return distinct, which


def decode_placed(messages: Sequence[Message], experiment: str, algorithm: Algorithm, current_round: int,
                  current: Sequence[Exchange]) -> list[Placed | PayloadRejected]:
    """Each message decoded and placed in its round's exchanges, or the PayloadRejected that decoding it alone
    raises; copies of one message decode to the same Placed."""
    distinct, which = distinct_messages(messages)
    looked_up: dict[tuple[int, str, int], tuple[int, Exchange]] = {}  # (round, exchange, step) -> its place

    def spec_of(head: Envelope) -> Spec:
        claim = (head.round, head.exchange, head.step)
        if claim not in looked_up:
            looked_up[claim] = exchange_of(head, algorithm, current_round, current)
        if not 0 <= head.part < algorithm.k:
            raise PayloadRejected("cluster", f"part {head.part} outside 0..{algorithm.k - 1}")
        return algorithm.payload(looked_up[claim][1])

    decoded = decode_messages([(m.routing_key, m.body, m.headers) for m in distinct], experiment, spec_of)
    placed = [d if isinstance(d, PayloadRejected) else Placed(d, *looked_up[(d.round, d.exchange, d.step)])
              for d in decoded]
    return [placed[at] for at in which]
