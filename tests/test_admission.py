"""runtime.driver.admission on its own: no transport, broker or algorithm, only routing keys, publishers and rounds."""

from __future__ import annotations

import pytest

from dfca.algorithms.base import SERVER
from dfca.identity import topics
from dfca.runtime.driver.admission import (
    BLOCK_AFTER_INVALID,
    MAX_ROUNDS_AHEAD,
    NEAR_ROUNDS,
    Admission,
    Refusal,
    Screening,
)

EXP = "exp"


def key(sender: int, host: str) -> str:
    return topics.model_key(EXP, host, sender, 0)


def worker_0(proven: bool = True) -> Admission:
    """Worker 0 of 2, hosting clients 0 and 2, connected as its own principal (or the shared user)."""
    return Admission(workers=2, own_user="dfca-worker-0" if proven else "dfca", hosted=[0, 2])


def test_a_client_is_hosted_by_worker_c_mod_workers_and_a_central_role_by_the_aggregator() -> None:
    gate = Admission(workers=3, own_user="dfca")
    assert [gate.host_of(c) for c in range(5)] == ["worker-0", "worker-1", "worker-2", "worker-0", "worker-1"]
    assert gate.host_of(SERVER) == "aggregator"


def test_a_copy_of_a_hosted_clients_message_is_not_decoded() -> None:
    assert worker_0().screen(key(2, "worker-0"), "dfca-worker-0") is Screening.LOCAL_COPY


def test_a_message_published_by_its_senders_host_is_decoded() -> None:
    assert worker_0().screen(key(3, "worker-1"), "dfca-worker-1") is Screening.DECODE
    assert worker_0().screen(topics.model_key(EXP, "aggregator", SERVER, 1), "dfca-aggregator") is Screening.DECODE


@pytest.mark.parametrize("proven", [True, False], ids=["per-principal users", "shared user"])
def test_a_routing_key_that_names_another_host_is_refused(proven: bool) -> None:
    verdict = worker_0(proven).screen(key(3, "worker-0"), "dfca-worker-0" if proven else "dfca")
    assert isinstance(verdict, Refusal) and verdict.reason == "publisher"


def test_a_proven_publisher_must_be_the_senders_host_and_a_shared_user_proves_nothing() -> None:
    forged = worker_0(proven=True).screen(key(3, "worker-1"), "dfca-worker-0")  # worker 0's user, worker 1's client
    assert isinstance(forged, Refusal) and forged.reason == "publisher" and "'dfca-worker-0'" in forged.detail
    assert worker_0(proven=False).screen(key(3, "worker-1"), "dfca") is Screening.DECODE


def test_a_malformed_routing_key_is_left_to_the_decoder() -> None:
    assert worker_0().screen("not.a.key", "dfca-worker-1") is Screening.DECODE


def test_a_proven_sender_is_cut_off_at_the_limit_of_invalid_messages_in_a_round() -> None:
    gate = worker_0()
    flood = key(3, "worker-1")
    assert [gate.count_invalid(flood, redelivered=False) for _ in range(BLOCK_AFTER_INVALID - 1)] == \
        [None] * (BLOCK_AFTER_INVALID - 1)
    assert 3 not in gate.blocked
    assert gate.count_invalid(flood, redelivered=False) == 3
    assert gate.blocked == {3}
    assert gate.count_invalid(flood, redelivered=False) is None  # cut off once


def test_counts_against_a_sender_start_again_each_round() -> None:
    gate = worker_0()
    for _ in range(BLOCK_AFTER_INVALID - 1):
        gate.count_invalid(key(3, "worker-1"), redelivered=False)
    gate.begin_round()
    assert gate.count_invalid(key(3, "worker-1"), redelivered=False) is None and not gate.blocked


def test_the_brokers_redeliveries_a_shared_user_and_a_central_role_are_never_cut_off() -> None:
    proven, shared = worker_0(proven=True), worker_0(proven=False)
    for _ in range(2 * BLOCK_AFTER_INVALID):
        assert proven.count_invalid(key(3, "worker-1"), redelivered=True) is None
        assert proven.count_invalid(topics.model_key(EXP, "aggregator", SERVER, 0), redelivered=False) is None
        assert proven.count_invalid("junk", redelivered=False) is None
        assert shared.count_invalid(key(3, "worker-1"), redelivered=False) is None
    assert not proven.blocked and not shared.blocked


def test_the_limit_is_the_gates_own() -> None:
    gate = Admission(workers=2, own_user="dfca-worker-0", block_after=2)
    assert gate.count_invalid(key(1, "worker-1"), redelivered=False) is None
    assert gate.count_invalid(key(1, "worker-1"), redelivered=False) == 1


def test_a_round_more_than_max_rounds_ahead_is_refused() -> None:
    gate = Admission(workers=2, own_user="dfca-worker-0", hosted=[0, 2], near_rounds=MAX_ROUNDS_AHEAD + 5)
    assert gate.admit_round(3, 5 + MAX_ROUNDS_AHEAD, 5) is None
    assert gate.admit_round(3, 4, 5) is None  # stale: the ledger's business
    refusal = gate.admit_round(3, 6 + MAX_ROUNDS_AHEAD, 5)
    assert refusal is not None and refusal.reason == "future_round"
    assert Admission(workers=1, own_user="dfca", max_rounds_ahead=0).admit_round(1, 6, 5) is not None


def test_a_model_is_let_in_only_once_its_round_is_near() -> None:
    """Worker 0 of 3 at round 5: worker 1's client 1 may send round 6 (NEAR_ROUNDS ahead), not round 7, however many
    rounds it claims to have run; only another host's models move the window for it."""
    gate = Admission(workers=3, own_user="dfca-worker-0", hosted=[0, 3])
    assert NEAR_ROUNDS == 1
    assert gate.admit_round(1, 6, 5) is None
    early = gate.admit_round(1, 7, 5)
    assert early is not None and early.reason == "future_round" and "worker-1" in early.detail
    assert gate.admit_round(4, 7, 5) is not None  # client 4 is on worker 1 too: its host cannot vouch for itself
    assert gate.admit_round(2, 6, 5) is None  # worker 2 has reached round 6 ...
    assert gate.admit_round(1, 7, 5) is None  # ... so worker 1's round 7 is near now
    assert gate.admit_round(2, 8, 5) is None and gate.admit_round(1, 9, 5) is None  # a run that went on without us
    assert gate.admit_round(1, 11, 5) is not None


def test_models_sent_before_the_run_starts_are_refused_past_its_first_rounds() -> None:
    """Pre-sent lies: 3,000 rounds of models from one worker before `go` get in for rounds 0 and 1 only."""
    gate = Admission(workers=3, own_user="dfca-worker-0", hosted=[0, 3])
    admitted = [t for t in range(3_000) if gate.admit_round(1, t, 0) is None]
    assert admitted == [0, 1]


@pytest.mark.parametrize("proven", [True, False], ids=["per-principal users", "shared user"])
def test_two_different_bodies_for_one_message_are_equivocation(proven: bool) -> None:
    gate = worker_0(proven)
    assert gate.equivocation((3, 4, "models", 0, 0), "a" * 64) is None
    assert gate.equivocation((3, 4, "models", 0, 0), "a" * 64) is None  # a copy (a redelivery) is no lie
    assert gate.equivocation((3, 4, "models", 0, 1), "b" * 64) is None  # another part is another message
    lie = gate.equivocation((3, 4, "models", 0, 0), "c" * 64)
    assert lie is not None and lie.reason == "equivocation" and "client 3" in lie.detail
    assert gate.proven is proven  # the driver cuts the sender off only where its key is proven its own
    gate.end_round(6)
    assert gate.equivocation((3, 4, "models", 0, 0), "c" * 64) is None  # forgotten: round 4 is stale at round 6


def test_a_repeat_published_again_after_a_new_connection_is_let_off_once_per_message_until_its_round_is_stale() -> None:
    gate = worker_0()
    assert gate.resent((3, 4, "gossip", 1, 0))  # the first copy published again: let off
    assert not gate.resent((3, 4, "gossip", 1, 0))  # a second one counts
    assert gate.resent((3, 4, "gossip", 2, 0))  # another step is another message
    gate.end_round(5)
    assert not gate.resent((3, 4, "gossip", 1, 0))  # round 4 is still near at round 5
    gate.end_round(6)
    assert gate.resent((3, 4, "gossip", 1, 0))  # forgotten with its round
