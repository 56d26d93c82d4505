"""runtime.driver.folding on its own: deliveries built by hand, no transport, broker or algorithm."""

from __future__ import annotations

import torch

from dfca.algorithms import Exchange
from dfca.runtime.driver.delivery import Delivery, Placed, Unsettled
from dfca.runtime.driver.folding import Ready, fold_chunks, inboxes
from dfca.wire.codec import Envelope

MODELS = Exchange("models")


def envelope(sender: int, t: int = 0, size: int = 3) -> Envelope:
    return Envelope("exp", sender, t, "models", 0, 0, {"w": torch.full((size,), float(sender))})


def deliveries(e: Envelope, rows: list[int]) -> list[Delivery]:
    fanout = Unsettled(None, len(rows))
    return [Delivery(row, None, Placed(e, 0, MODELS), fanout) for row in rows]


def test_a_fold_is_due_once_the_batch_is_full_or_nothing_more_is_expected() -> None:
    ready = Ready(batch=2)
    assert not ready.due(more_expected=False)  # nothing ready
    for d in deliveries(envelope(1), [0, 1]):  # one message, two rows: one distinct message
        ready.add(d)
    assert not ready.full() and ready.room() == 1
    assert not ready.due(more_expected=True) and ready.due(more_expected=False)
    ready.add(deliveries(envelope(2), [0])[0])
    assert ready.full() and ready.due(more_expected=True)
    assert len(ready.take()) == 3 and ready.room() == 2 and not ready.due(more_expected=False)


def test_chunks_hold_one_round_and_at_most_a_batch_of_distinct_messages() -> None:
    late = deliveries(envelope(9, t=0), [0])
    now = [d for s in (1, 2, 3) for d in deliveries(envelope(s, t=1), [0, 1])]
    chunks = list(fold_chunks(now[:2] + late + now[2:], batch=2))
    assert [[(d.envelope.round, d.envelope.sender, d.row) for d in c] for c in chunks] == [
        [(1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1)], [(1, 3, 0), (1, 3, 1)], [(0, 9, 0)]]


def test_an_inbox_has_a_column_per_distinct_message_delivered_to_the_rows_it_reached() -> None:
    chunk = deliveries(envelope(4), [2]) + deliveries(envelope(7), [0, 2])
    [(folded, inbox)] = list(inboxes(chunk, rows=3, device=torch.device("cpu")))
    assert folded == chunk and inbox.round == 0
    assert inbox.delivered.tolist() == [[False, True], [False, False], [True, True]]
    assert inbox.sender.tolist() == [4, 7] and inbox.part.tolist() == [0, 0]
    assert inbox.tensors["w"].tolist() == [[4.0] * 3, [7.0] * 3]


def test_ragged_payloads_are_folded_one_message_at_a_time() -> None:
    chunk = deliveries(envelope(4, size=2), [0]) + deliveries(envelope(7, size=5), [0, 1])
    made = list(inboxes(chunk, rows=2, device=torch.device("cpu")))
    assert [[d.envelope.sender for d in folded] for folded, _ in made] == [[4], [7, 7]]
    assert [inbox.delivered.tolist() for _, inbox in made] == [[[True], [False]], [[True], [True]]]


def test_a_message_is_settled_when_the_last_row_it_reached_is_done() -> None:
    fanout = Unsettled(None, 2)
    assert fanout.settle() is None and fanout.settle() is None  # delivered locally: nothing to acknowledge
    assert fanout.first_repeat() and not fanout.first_repeat()
