"""runtime.driver.ledger on its own: no transport, broker or algorithm; a fake clock for its deadlines."""

from __future__ import annotations

from dfca.algorithms import Exchange
from dfca.runtime.driver.ledger import Identity, Ledger, Placement

MODELS = Exchange("models", averaged=True, stale_ok=True)
GOSSIP = [Exchange("gossip", step=s) for s in range(2)]


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def ledger(staleness: str = "drop", clock: FakeClock | None = None) -> Ledger[str]:
    return Ledger("clients", staleness, clock or FakeClock())


def identity(sender: int, t: int, ex: Exchange, receiver: int = 0, part: int = 0) -> Identity:
    return (receiver, sender, t, ex.name, ex.step, part)


def opened(book: Ledger[str], t: int, index: int, ex: Exchange, expected: dict[int, int] | None = None) -> list[str]:
    book.begin_round(t)
    return book.open(index, ex, [expected if expected is not None else {1: 1, 2: 1}])


def test_a_message_is_used_at_most_once() -> None:
    book = ledger()
    opened(book, 0, 0, MODELS)
    assert book.place(identity(1, 0, MODELS), 0, 0, MODELS, "m1") is Placement.OPEN
    assert book.place(identity(1, 0, MODELS), 0, 0, MODELS, "m1 again") is Placement.DUPLICATE
    assert book.place(identity(1, 0, MODELS, part=1), 0, 0, MODELS, "another part") is Placement.OPEN


def test_a_later_exchanges_message_is_held_once_and_released_when_its_exchange_opens() -> None:
    book = ledger()
    opened(book, 0, 0, GOSSIP[0])
    step_1 = identity(1, 0, GOSSIP[1])
    assert book.place(step_1, 0, 1, GOSSIP[1], "step 1") is Placement.HELD
    assert book.place(step_1, 0, 1, GOSSIP[1], "step 1 again") is Placement.DUPLICATE
    assert book.place(identity(2, 3, MODELS), 0, 0, MODELS, "round 3") is Placement.HELD  # a later round
    assert book.held == ["step 1", "round 3"]
    released = book.open(1, GOSSIP[1], [{1: 1}])
    assert released == ["step 1", "round 3"] and book.held == [] and not book.held_ids
    assert book.place(step_1, 0, 1, GOSSIP[1], "step 1") is Placement.OPEN  # the caller places it again
    assert book.place(identity(2, 3, MODELS), 0, 0, MODELS, "round 3") is Placement.HELD  # still later


def test_a_stale_message_is_merged_one_round_later_when_staleness_is_merge() -> None:
    book = ledger("merge")
    opened(book, 1, 0, MODELS)
    assert book.place(identity(1, 0, MODELS), 0, 0, MODELS, "round 0") is Placement.MERGED
    assert book.place(identity(1, 0, MODELS), 0, 0, MODELS, "round 0 again") is Placement.DUPLICATE
    assert book.waiting == [{1: 1, 2: 1}]  # a merged message is no message of this round


def test_a_stale_message_is_dropped_when_staleness_is_drop() -> None:
    book = ledger("drop")
    opened(book, 1, 0, MODELS)
    assert book.place(identity(1, 0, MODELS), 0, 0, MODELS, "round 0") is Placement.DROPPED
    assert book.place(identity(1, 0, MODELS), 0, 0, MODELS, "round 0 again") is Placement.DUPLICATE


def test_only_a_message_of_the_round_before_of_an_exchange_that_takes_stale_ones_is_merged() -> None:
    book = ledger("merge")
    opened(book, 2, 0, MODELS)
    assert book.place(identity(1, 0, MODELS), 0, 0, MODELS, "two rounds old") is Placement.DROPPED
    opened(book, 1, 1, GOSSIP[1])
    assert book.place(identity(1, 1, GOSSIP[0]), 0, 0, GOSSIP[0], "the step before") is Placement.DROPPED
    assert book.place(identity(2, 0, GOSSIP[1]), 0, 1, GOSSIP[1], "not stale_ok") is Placement.DROPPED
    server = Ledger[str]("server", "merge", FakeClock())
    server.begin_round(1)
    server.open(0, MODELS, [{}])  # the open exchange is the clients' (receiver clients), not the server's
    assert server.place(identity(1, 0, MODELS), 0, 0, MODELS, "round 0") is Placement.DROPPED


def test_the_open_exchange_waits_for_every_part_of_every_expected_sender() -> None:
    book = ledger()
    opened(book, 0, 0, MODELS, {1: 2, 2: 1})
    book.place(identity(1, 0, MODELS, part=0), 0, 0, MODELS, "1/0")
    assert book.due() and book.waiting == [{1: 1, 2: 1}]
    book.place(identity(1, 0, MODELS, part=1), 0, 0, MODELS, "1/1")
    book.place(identity(9, 0, MODELS), 0, 0, MODELS, "not expected")
    assert book.waiting == [{2: 1}]
    book.forget(2)  # cut off
    assert not book.due() and book.close() == set() and book.missed == set()


def test_senders_still_due_when_the_exchange_closes_missed_it() -> None:
    book = ledger()
    opened(book, 0, 0, MODELS, {1: 1, 2: 1})
    book.place(identity(1, 0, MODELS), 0, 0, MODELS, "1")
    assert book.close() == {2} and book.missed == {2}
    book.begin_round(1)
    assert book.missed == set()


def test_the_deadline_passes_on_the_clock_the_ledger_is_given() -> None:
    clock = FakeClock(100.0)
    book = ledger(clock=clock)
    opened(book, 0, 0, Exchange("models", wait=2.0))
    assert book.deadline(timeout=5.0) == 110.0
    clock.t = 109.9
    assert not book.expired(5.0)
    clock.t = 110.0
    assert book.expired(5.0)


def test_an_exchange_that_needs_an_arrival_counts_its_deadline_from_the_first() -> None:
    clock = FakeClock(100.0)
    book = ledger(clock=clock)
    upload = Exchange("upload", receiver="clients", needs_arrival=True)
    opened(book, 0, 0, upload)
    clock.t = 1000.0
    assert book.deadline(5.0) is None and not book.expired(5.0)  # never closes empty
    book.place(identity(1, 0, upload), 0, 0, upload, "first")
    clock.t = 1003.0
    book.place(identity(2, 0, upload), 0, 0, upload, "second")
    assert book.first_arrival == 1000.0 and book.deadline(5.0) == 1005.0
    clock.t = 1005.0
    assert book.expired(5.0)


def test_identities_of_rounds_before_the_last_are_forgotten_at_its_end() -> None:
    book = ledger("merge")
    opened(book, 0, 0, MODELS)
    book.place(identity(1, 0, MODELS), 0, 0, MODELS, "round 0")
    book.end_round()
    assert identity(1, 0, MODELS) in book.seen  # a redelivery in round 1 is a duplicate, not merged
    opened(book, 1, 0, MODELS)
    assert book.place(identity(1, 0, MODELS), 0, 0, MODELS, "redelivered") is Placement.DUPLICATE
    book.end_round()
    assert book.seen == set()
