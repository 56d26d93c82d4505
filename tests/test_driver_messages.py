"""The message driver on concurrent hosts: gossip steps held, duplicated, stale, malformed or timed out; and the
running average's memory bound (a client folds each model as it arrives, whatever its degree)."""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
from test_driver_equivalence import small_config

from dfca.algorithms import schedule_of
from dfca.algorithms.dfca import DFCA
from dfca.config import ExperimentConfig
from dfca.graph import neighbours
from dfca.identity import topics
from dfca.runtime.driver import admission, decoding, driver_stats, folding
from dfca.runtime.driver.delivery import Placed
from dfca.runtime.driver.host_transport import REPUBLISHED_HEADER, HostTransport
from dfca.runtime.driver.message_driver import MessageDriver
from dfca.simulator import prepare, simulate
from dfca.transport import InMemoryBroker, InMemoryTransport, Message
from dfca.wire.codec import Envelope, PayloadRejected, Spec, TensorSpec, encode_message
from harness.lockstep import LockstepRun, client_driver, lockstep_round

W0 = "worker-0"  # the host word of every client when one worker hosts them all


def robust_config(rounds: int = 3) -> ExperimentConfig:
    return small_config(rounds=rounds, dfca={"variant": "robust", "seeding": "none", "warmup_rounds": 2,
                                             "warmup_gossip_steps": 3, "gossip_steps": 2})


def build_drivers(cfg: ExperimentConfig, broker: InMemoryBroker, count: int) -> tuple[list[MessageDriver], Any]:
    ctx = prepare(cfg)
    graph = neighbours(ctx.graph)
    n = ctx.data.num_clients
    groups = [list(range(h, n, count)) for h in range(count)]
    return [client_driver(cfg, "robust", g, ctx.data.subset(g), graph, InMemoryTransport(broker), workers=count)
            for g in groups], ctx


def host(client: int, workers: int) -> str:
    return f"worker-{client % workers}"


def gossip(sender: int, k: int, shapes: dict[str, tuple[int, ...]], fill: float) -> tuple[Envelope, Spec]:
    spec = {**{f"num.{n}": TensorSpec((k, *s)) for n, s in shapes.items()}, "den": TensorSpec((k,), "float32")}
    tensors = {name: torch.full(s.shape, fill) for name, s in spec.items()}
    tensors["den"] = torch.ones(k)
    return Envelope("robust", sender, 0, "gossip", 0, 0, tensors), spec


def test_threaded_drivers_with_noise_match_the_simulator() -> None:
    """Each driver runs its rounds in its own thread (as a worker does); a spoofed, a non-finite and a duplicated
    gossip message are injected. The result is still the simulator's."""
    cfg = robust_config()
    broker = InMemoryBroker()
    drivers, ctx = build_drivers(cfg, broker, 3)
    sim = simulate(cfg, data=ctx.data)
    injector = InMemoryTransport(broker)
    sender = drivers[0].ids[0]
    shapes = ctx.model.shapes()
    k = cfg.clusters
    junk, spec = gossip(sender, k, shapes, 0.0)
    body, headers = encode_message(junk, spec)
    injector.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", host(sender + 1, 3), sender + 1, 0), body,
                     headers)  # spoofed: the body says it is `sender`'s
    nan, _ = gossip(sender, k, shapes, float("nan"))
    body, headers = encode_message(nan, spec)
    injector.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", W0, sender, 0), body, headers)
    errors: list[BaseException] = []

    def run(driver: MessageDriver) -> None:
        try:
            for t in range(cfg.rounds):
                if not driver.run_round(t, timeout=30.0):
                    raise RuntimeError(f"round {t} incomplete")
        except BaseException as err:  # noqa: BLE001 - surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(d,)) for d in drivers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors and not any(th.is_alive() for th in threads)
    rejected = sum((d.stats.rejected for d in drivers), start=Counter())
    receivers = sum(1 for d in drivers if sender in d.heard())  # a worker checks a message once for its clients
    receivers_spoof = sum(1 for d in drivers if sender + 1 in d.heard())
    assert rejected["non_finite"] == receivers and rejected["spoofed"] == receivers_spoof
    steps = sum(schedule_of(cfg).gossip_steps(t) for t in range(cfg.rounds))
    assert sum(d.stats.applied for d in drivers) == steps * int(ctx.adjacency.sum())
    for d in drivers:
        assert d.stats.timeouts == 0
        for name, tensor in d.algorithm.params.items():  # type: ignore[attr-defined]
            torch.testing.assert_close(tensor, sim.algorithm.params[name][d.ids], rtol=1e-4, atol=1e-5)


def test_duplicate_and_stale_gossip_messages_are_not_mixed_twice() -> None:
    cfg = robust_config(rounds=1)
    broker = InMemoryBroker()
    (a, b), _ = build_drivers(cfg, broker, 2)
    row, client = next((r, c) for r, c in enumerate(a.ids) if any(m in b.ids for m in a.neighbours[c]))
    peer = next(m for m in a.neighbours[client] if m in b.ids)
    for d in (a, b):
        d.begin_round(0)
        d.start_exchange(0)
    # b's step-0 messages delivered twice: a copy of a message in a's queue is published again
    first = []
    while (msg := a.transport.receive(a.queue, 0.0)) is not None:
        first.append(msg)
        a.handle(msg)
    peer_msg = next(m for m in first if m.routing_key == topics.model_key("robust", host(peer, 2), peer, 0))
    applied = a.stats.applied
    hearing = len(a.hearing.rows_of[peer])  # a's clients that neighbour the peer: each would have mixed it
    assert row in a.hearing.rows_of[peer]
    a.transport.publish(topics.MODELS_EXCHANGE, peer_msg.routing_key, peer_msg.body, peer_msg.headers)
    while (msg := a.transport.receive(a.queue, 0.0)) is not None:
        a.handle(msg)
    assert a.stats.duplicates == hearing and a.stats.applied == applied
    for d in (a, b):
        assert d.collect(5.0)
        d.end_exchange()
    # a step-0 message arriving after step 0 closed is dropped, not mixed into step 1
    a.ledger.seen.clear()
    a.transport.publish(topics.MODELS_EXCHANGE, peer_msg.routing_key, peer_msg.body, peer_msg.headers)
    a.start_exchange(1)
    while (msg := a.transport.receive(a.queue, 0.0)) is not None:
        if msg.headers.get("step") == "0":
            a.handle(msg)
    assert a.stats.stale_dropped == hearing


def test_gossip_step_times_out_without_a_neighbour() -> None:
    """A driver whose neighbours never gossip: each step times out, den stays m, theta keeps its own copy."""
    cfg = robust_config(rounds=1)
    broker = InMemoryBroker()
    (a, _), _ = build_drivers(cfg, broker, 2)
    a.begin_round(0)
    trained = {n: v.clone() for n, v in a.algorithm.params.items()}  # type: ignore[attr-defined]
    complete = True
    for index in range(len(a.exchanges)):
        a.start_exchange(index)
        complete &= a.collect(timeout=0.2)
        a.end_exchange()
    a.end_round()
    assert complete is False
    assert a.stats.timeouts == schedule_of(cfg).gossip_steps(0)
    lonely = [r for r, c in enumerate(a.ids) if not any(m in a.ids for m in a.neighbours[c])]
    assert lonely and all(set(a.neighbours[a.ids[r]]) <= a.ledger.missed for r in lonely)
    for r in lonely:  # nothing arrived: num/den = theta for the trained cluster, the rest keep their copy
        for n in trained:
            torch.testing.assert_close(a.algorithm.params[n][r], trained[n][r])  # type: ignore[attr-defined]


def receiver_and_peer(cfg: ExperimentConfig, broker: InMemoryBroker) -> tuple[MessageDriver, int, int, Any, Spec]:
    """Two drivers; the first's row `row` hears client `peer` of the second: (driver, row, peer, shapes, spec)."""
    (a, b), _ = build_drivers(cfg, broker, 2)
    row, client = next((r, c) for r, c in enumerate(a.ids) if any(m in b.ids for m in a.neighbours[c]))
    peer = next(m for m in a.neighbours[client] if m in b.ids)
    shapes = a.algorithm.ctx.model.shapes()
    return a, row, peer, shapes, {n: TensorSpec(s) for n, s in shapes.items()}


def worker_0_and_forger(proven: bool) -> tuple[MessageDriver, int, InMemoryTransport]:
    """Worker 0 of 2 (the paper rule), a client `peer` of worker 1 that neighbours it, and a transport with worker 1's
    user (or, not `proven`, the shared one)."""
    cfg = small_config(dfca={"variant": "paper"})
    broker = InMemoryBroker()
    ctx = prepare(cfg)
    ours = list(range(0, ctx.data.num_clients, 2))
    a = client_driver(cfg, "robust", ours, ctx.data.subset(ours), neighbours(ctx.graph),
                      InMemoryTransport(broker, user="dfca-worker-0" if proven else "dfca"), workers=2)
    peer = next(m for c in ours for m in a.neighbours[c] if m % 2 == 1)
    return a, peer, InMemoryTransport(broker, user="dfca-worker-1" if proven else "dfca")


@pytest.mark.parametrize("proven", [True, False], ids=["per-principal users", "shared user"])
def test_a_proven_sender_flooding_junk_is_cut_off_and_no_longer_waited_for(proven: bool) -> None:
    """Worker 1's credentials flood junk under its own client's key: worker 0's driver, which sees the broker-proven
    publisher, unbinds that client from its queues and stops waiting for it. Under a shared broker user nobody can
    tell who sent the junk (a forger could frame an honest client), so nobody is cut off."""
    a, peer, forger = worker_0_and_forger(proven)
    flood = admission.BLOCK_AFTER_INVALID + 5
    for _ in range(flood):
        forger.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", "worker-1", peer, 0), b"junk", {})
    a.begin_round(0)
    a.start_exchange(0)
    rows = [r for r, c in enumerate(a.ids) if peer in a.neighbours[c]]
    while (msg := a.transport.receive(a.queue, 0.0)) is not None:
        a.handle(msg)
    assert a.stats.rejected["bad_header"] == flood  # one delivery to the worker, however many of its clients hear it
    assert (peer in a.blocked, a.stats.blocked) == ((True, 1) if proven else (False, 0))
    assert rows and all((peer in a.ledger.waiting[r]) != proven for r in rows)
    forger.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", "worker-1", peer, 0), b"more junk", {})
    delivered = a.transport.receive(a.queue, 0.0)
    assert (delivered is None) == proven  # cut off: the broker routes nothing more to us


def test_a_flood_of_junk_is_logged_a_few_lines_a_round_and_counted_in_full(caplog: pytest.LogCaptureFixture) -> None:
    """Under a shared broker user nobody can be cut off: each junk message is rejected, counted in the stats, and
    only the first LOGGED_REJECTIONS_PER_ROUND are logged one by one; one line at the round's end says how many
    more there were (a flood must not flood the logs)."""
    a, peer, forger = worker_0_and_forger(proven=False)
    flood = 3 * driver_stats.LOGGED_REJECTIONS_PER_ROUND
    for _ in range(flood):
        forger.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", "worker-1", peer, 0), b"junk", {})
    a.begin_round(0)
    a.start_exchange(0)
    with caplog.at_level("WARNING", logger="dfca.runtime.driver.message_driver"):
        while (msg := a.transport.receive(a.queue, 0.0)) is not None:
            a.handle(msg)
        a.end_exchange()
        a.end_round()
    lines = [r.getMessage() for r in caplog.records]
    assert a.stats.rejected["bad_header"] == flood
    assert sum(line.startswith("rejected message") for line in lines) == driver_stats.LOGGED_REJECTIONS_PER_ROUND
    summary = f"{flood - driver_stats.LOGGED_REJECTIONS_PER_ROUND} more rejected messages not logged"
    assert sum(summary in line for line in lines) == 1


@pytest.mark.parametrize("proven", [True, False], ids=["per-principal users", "shared user"])
def test_a_proven_sender_flooding_copies_of_a_valid_message_is_cut_off(proven: bool) -> None:
    """Repeats of one well-formed model, published under worker 1's own client's key: the first is used, the repeats
    are duplicates, and past BLOCK_AFTER_INVALID of them in a round the sender is cut off where publishers are
    proven (a repeat the broker redelivers itself does not count)."""
    a, peer, forger = worker_0_and_forger(proven)
    shapes = a.algorithm.ctx.model.shapes()
    envelope = Envelope("robust", peer, 0, "models", 0, 0, {n: torch.zeros(s) for n, s in shapes.items()})
    body, headers = encode_message(envelope, {n: TensorSpec(s) for n, s in shapes.items()})
    a.begin_round(0)
    a.start_exchange(0)
    for _ in range(admission.BLOCK_AFTER_INVALID + 5):
        forger.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", "worker-1", peer, 0), body, headers)
        while (msg := a.transport.receive(a.queue, 0.0)) is not None:
            a.handle(msg)
    assert a.stats.duplicates >= admission.BLOCK_AFTER_INVALID - 1 or peer in a.blocked
    assert (peer in a.blocked) == proven and a.stats.rejected.total() == 0


def test_a_repeat_published_again_after_a_new_connection_is_let_off_once_per_message() -> None:
    """A sender's host publishes its kept models again after its connection to the broker was opened anew (marked
    REPUBLISHED_HEADER): a receiver that used one already counts the copy as a duplicate, not against the sender.
    Only once per message: a flood of copies so marked still cuts a proven sender off."""
    a, peer, forger = worker_0_and_forger(proven=True)
    shapes = a.algorithm.ctx.model.shapes()
    envelope = Envelope("robust", peer, 0, "models", 0, 0, {n: torch.zeros(s) for n, s in shapes.items()})
    body, headers = encode_message(envelope, {n: TensorSpec(s) for n, s in shapes.items()})
    key = topics.model_key("robust", "worker-1", peer, 0)

    def send(marked: bool) -> None:
        forger.publish(topics.MODELS_EXCHANGE, key, body, {**headers, **({REPUBLISHED_HEADER: "2"} if marked else {})})
        while (msg := a.transport.receive(a.queue, 0.0)) is not None:
            a.handle(msg)

    a.begin_round(0)
    a.start_exchange(0)
    send(marked=False)  # used
    send(marked=True)  # published again after a broker restart: a duplicate (for each row hearing it), let off
    rows = len(a.hearing.rows_of[peer])
    assert a.stats.duplicates == rows and a.admission.invalid[peer] == 0 and peer not in a.blocked
    send(marked=False)  # an unmarked repeat counts, as before
    assert a.stats.duplicates == 2 * rows and a.admission.invalid[peer] == 1
    for _ in range(admission.BLOCK_AFTER_INVALID):  # marked copies of a message let off once count from then on
        send(marked=True)
    assert peer in a.blocked and a.stats.rejected.total() == 0


def test_a_message_redelivered_after_a_restart_is_a_duplicate_not_merged_again(tmp_path: Any) -> None:
    """A worker checkpoints round 0 and crashes before its acks: the broker redelivers what it had folded. With
    `staleness: merge` a round-0 model arriving in round 1 would be merged again; the checkpoint carries the
    dedupe set, so the restarted driver counts it as a duplicate."""
    cfg = small_config(dfca={"variant": "paper"}, runtime={"staleness": "merge"})
    ctx = prepare(cfg)
    graph = neighbours(ctx.graph)
    groups = [list(range(0, 10, 2)), list(range(1, 10, 2))]
    broker = InMemoryBroker()
    a, b = (client_driver(cfg, "robust", g, ctx.data.subset(g), graph, InMemoryTransport(broker), workers=2)
            for g in groups)
    lockstep_round(LockstepRun([a, b], None), 0)
    a.save_checkpoint(tmp_path / "a.safetensors")
    again_broker = InMemoryBroker()
    again = client_driver(cfg, "robust", groups[0], ctx.data.subset(groups[0]), graph, InMemoryTransport(again_broker),
                          workers=2)
    assert again.load_checkpoint(tmp_path / "a.safetensors") == 0
    row, client = next((r, c) for r, c in enumerate(again.ids) if any(m in groups[1] for m in again.neighbours[c]))
    peer = next(m for m in again.neighbours[client] if m in groups[1])
    part = int(b.algorithm.assigned[b.ids.index(peer)])  # what the peer sent in round 0
    shapes = again.algorithm.ctx.model.shapes()
    redelivered = Envelope("robust", peer, 0, "models", 0, part, {n: torch.zeros(s) for n, s in shapes.items()})
    key = topics.model_key("robust", host(peer, 2), peer, part)
    InMemoryTransport(again_broker).publish(topics.MODELS_EXCHANGE, key,
                                            *encode_message(redelivered, {n: TensorSpec(s) for n, s in shapes.items()}))
    again.begin_round(1)
    again.start_exchange(0)
    while (msg := again.transport.receive(again.queue, 0.0)) is not None:
        again.handle(msg)
    assert row in again.hearing.rows_of[peer]
    assert (again.stats.duplicates, again.stats.stale_merged) == (len(again.hearing.rows_of[peer]), 0)


def test_a_message_of_an_exchange_its_round_does_not_have_is_rejected() -> None:
    cfg = small_config(dfca={"variant": "paper"})
    broker = InMemoryBroker()
    a, row, peer, shapes, spec = receiver_and_peer(cfg, broker)
    forged = Envelope("robust", peer, 0, "gossip", 0, 0, {n: torch.zeros(s) for n, s in shapes.items()})
    body, headers = encode_message(forged, spec)  # a paper-rule round has no gossip step
    injector = InMemoryTransport(broker)
    injector.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", host(peer, 2), peer, 0), body, headers)
    future = Envelope("robust", peer, 99, "models", 0, 0, {n: torch.zeros(s) for n, s in shapes.items()})
    injector.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", host(peer, 2), peer, 0),
                     *encode_message(future, spec))
    a.begin_round(0)
    a.start_exchange(0)
    while (msg := a.transport.receive(a.queue, 0.0)) is not None:
        a.handle(msg)
    assert a.stats.rejected == Counter({"exchange": 1, "round": 1}) and a.stats.applied == 0


def test_models_far_in_the_future_are_rejected_and_repeats_are_held_once() -> None:
    """A forger cannot pile up unacknowledged messages (which would fill the prefetch window and stall the run):
    beyond MAX_ROUNDS_AHEAD it is rejected and counted, and a repeat of a held message is a duplicate."""
    cfg = small_config(rounds=40, dfca={"variant": "paper"})
    broker = InMemoryBroker()
    a, row, peer, shapes, spec = receiver_and_peer(cfg, broker)
    injector = InMemoryTransport(broker)
    ahead = admission.MAX_ROUNDS_AHEAD
    for t in [1, 1, 1, ahead, ahead + 1, 35, 35]:
        forged = Envelope("robust", peer, t, "models", 0, 0, {n: torch.zeros(s) for n, s in shapes.items()})
        injector.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", host(peer, 2), peer, 0),
                         *encode_message(forged, spec))
    a.begin_round(0)
    a.start_exchange(0)
    while (msg := a.transport.receive(a.queue, 0.0)) is not None:
        a.handle(msg)
    hearing = a.hearing.rows_of[peer]  # every hosted client that neighbours the peer holds its own copy
    # round 1 is near (NEAR_ROUNDS ahead of round 0): held; the rest is refused, however far ahead
    assert row in hearing and a.stats.rejected == Counter({"future_round": 4})
    assert a.stats.duplicates == 2 * len(hearing)
    held = sorted((d.envelope.round, d.row) for d in a.ledger.held)
    assert held == sorted((1, r) for r in hearing)


@pytest.mark.parametrize("proven", [True, False], ids=["per-principal users", "shared user"])
def test_a_second_body_for_one_message_is_equivocation_and_cuts_a_proven_sender_off(proven: bool) -> None:
    """Worker 1's credentials send a model for its client's round 1 early, then a different one for the same round:
    the second is refused and counted (`equivocation`), and worker 0's driver, which sees the broker-proven
    publisher, cuts the client off, its held model included (never folded). Under a shared user nobody is cut off
    (anyone could have sent either)."""
    a, peer, forger = worker_0_and_forger(proven)
    shapes = a.algorithm.ctx.model.shapes()
    spec = {n: TensorSpec(s) for n, s in shapes.items()}
    for value in (0.0, 1.0, 0.0):
        lie = Envelope("robust", peer, 1, "models", 0, 0, {n: torch.full(s, value) for n, s in shapes.items()})
        forger.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", "worker-1", peer, 0),
                       *encode_message(lie, spec))
    a.begin_round(0)
    a.start_exchange(0)
    while (msg := a.transport.receive(a.queue, 0.0)) is not None:
        a.handle(msg)
    assert a.stats.rejected["equivocation"] == 1
    assert (peer in a.blocked, a.stats.blocked) == ((True, 1) if proven else (False, 0))
    if not proven:
        assert any(d.envelope.sender == peer for d in a.ledger.held)  # the first body waits for round 1
        return
    a.end_exchange()
    a.end_round()
    a.begin_round(1)
    a.start_exchange(0)
    assert not any(d.envelope.sender == peer for d in a.ledger.held) and a.stats.applied == 0


def test_a_cut_off_senders_queued_messages_are_refused_at_once_not_acknowledged_at_the_checkpoint() -> None:
    """Worker 1's credentials send two bodies for its client's round 1 (the second cuts the client off), then many
    more for later rounds and the same round, all queued before worker 0 reads any: what comes from the cut-off
    sender is rejected (`cut_off`) at once. A worker's acks wait for the round's checkpoint: acknowledged, these
    would hold the prefetch window until the round's end, and every honest message queued behind them with it."""
    cfg = small_config(rounds=40, dfca={"variant": "paper"})
    broker = InMemoryBroker()
    ctx = prepare(cfg)
    ours = list(range(0, ctx.data.num_clients, 2))
    transport = HostTransport(InMemoryTransport(broker, user="dfca-worker-0"))
    a = client_driver(cfg, "robust", ours, ctx.data.subset(ours), neighbours(ctx.graph), transport, workers=2)
    peer = next(m for c in ours for m in a.neighbours[c] if m % 2 == 1)
    forger = InMemoryTransport(broker, user="dfca-worker-1")
    shapes = a.algorithm.ctx.model.shapes()
    spec = {n: TensorSpec(s) for n, s in shapes.items()}
    more = 30
    for t, value in [(1, 0.0), (1, 1.0), *((1 + i % 2, 2.0 + i) for i in range(more))]:
        lie = Envelope("robust", peer, t, "models", 0, 0, {n: torch.full(s, value) for n, s in shapes.items()})
        forger.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", "worker-1", peer, 0),
                       *encode_message(lie, spec))
    a.begin_round(0)
    a.start_exchange(0)
    while (msg := a.transport.receive(a.queue, 0.0)) is not None:
        a.handle(msg)
    assert peer in a.blocked and a.stats.rejected == Counter({"equivocation": 1, "cut_off": more})
    assert a.stats.not_neighbour == 0 and transport.take_acks() == []  # nothing of it waits for the checkpoint


# -- the running average's memory bound ----------------------------------------------------------------------
def peak_decoded_models(degree: int, aggregation: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """A star: client 0 hears `degree` neighbours in one paper-rule round. Returns the most decoded models alive
    at once at client 0's driver, and the numbers in client 0's state."""
    cfg = small_config(aggregation=aggregation, rounds=1, dfca={"variant": "paper"},
                       data={"clients": degree + 1, "train_per_client": 5, "test_per_client": 2},
                       train={"local_epochs": 0})
    ctx = prepare(cfg)
    graph = {0: list(range(1, degree + 1)), **{c: [0] for c in range(1, degree + 1)}}
    broker = InMemoryBroker()
    centre = client_driver(cfg, "star", [0], ctx.data.subset([0]), graph, InMemoryTransport(broker),
                           queue=topics.worker_queue("star", "worker-0"))
    others = list(range(1, degree + 1))
    rest = client_driver(cfg, "star", others, ctx.data.subset(others), graph, InMemoryTransport(broker),
                         queue=topics.worker_queue("star", "worker-1"))  # two queues: the centre is not c % workers
    alive: list[weakref.ref[torch.Tensor]] = []
    peak = 0
    decode = decoding.decode_messages

    def counting(*args: Any, **kwargs: Any) -> list[Envelope | PayloadRejected]:
        nonlocal peak
        decoded = decode(*args, **kwargs)
        for envelope in decoded:
            assert isinstance(envelope, Envelope)
            if envelope.sender != 0:
                alive[:] = [r for r in alive if r() is not None]
                alive.append(weakref.ref(envelope.tensors["w1"]))
                peak = max(peak, len(alive))
        return decoded

    monkeypatch.setattr(decoding, "decode_messages", counting)
    lockstep_round(LockstepRun([rest, centre], None), 0)
    assert centre.stats.applied == degree
    state = sum(t.numel() for t in centre.algorithm.state().values())
    return peak, state


def test_a_client_with_200_neighbours_holds_no_more_model_copies_than_one_with_16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sequential aggregation folds arriving models as they come (eq. 8), at most FOLD_BATCH decoded at a time,
    and the same k models of state, for 16 neighbours, 50 or 200. Batch aggregation (eq. 7) holds the round's
    models: 50."""
    assert folding.FOLD_BATCH == 16
    few, few_state = peak_decoded_models(2, "sequential", monkeypatch)
    assert few == 2
    sixteen, sixteen_state = peak_decoded_models(16, "sequential", monkeypatch)
    many, many_state = peak_decoded_models(50, "sequential", monkeypatch)
    most, most_state = peak_decoded_models(200, "sequential", monkeypatch)
    assert sixteen == many == most == 16 and few_state == sixteen_state == many_state == most_state
    held, _ = peak_decoded_models(50, "batch", monkeypatch)
    assert held == 50


class OneAtATime(InMemoryTransport):
    """Messages trickle in: a look without waiting finds nothing after one message, until the driver waits."""

    def __init__(self, broker: InMemoryBroker) -> None:
        super().__init__(broker)
        self.given = False

    def receive(self, queue: str, timeout: float = 0.0) -> Message | None:
        if timeout == 0.0 and self.given:
            return None
        message = super().receive(queue, 0.0)
        self.given = timeout == 0.0 and message is not None
        return message


def star_drivers(cfg: ExperimentConfig, degree: int, trickle: bool) -> tuple[MessageDriver, MessageDriver]:
    """(centre, rest): client 0 on one worker, the centre of a star of `degree` neighbours hosted on another, its
    messages all there at once or trickling in one by one."""
    ctx = prepare(cfg)
    graph = {0: list(range(1, degree + 1)), **{c: [0] for c in range(1, degree + 1)}}
    broker = InMemoryBroker()
    transport = OneAtATime(broker) if trickle else InMemoryTransport(broker)
    centre = client_driver(cfg, "star", [0], ctx.data.subset([0]), graph, transport,
                           queue=topics.worker_queue("star", "worker-0"))
    others = list(range(1, degree + 1))
    rest = client_driver(cfg, "star", others, ctx.data.subset(others), graph, InMemoryTransport(broker),
                         queue=topics.worker_queue("star", "worker-1"))
    return centre, rest


def star_folds(degree: int, trickle: bool) -> tuple[int, dict[str, torch.Tensor]]:
    """A paper-rule round at the centre of a star of `degree` neighbours on another worker, its messages all there
    at once or trickling in one by one: the algorithm's folds at the centre, and the centre's state."""
    cfg = small_config(aggregation="sequential", rounds=1, dfca={"variant": "paper"}, train={"local_epochs": 0},
                       data={"clients": degree + 1, "train_per_client": 5, "test_per_client": 2})
    centre, rest = star_drivers(cfg, degree, trickle)
    folds = 0
    receive = centre.algorithm.receive

    def counted(*args: Any) -> int:
        nonlocal folds
        folds += 1
        return receive(*args)

    centre.algorithm.receive = counted  # type: ignore[method-assign]
    lockstep_round(LockstepRun([rest, centre], None), 0)
    assert centre.stats.applied == degree
    return folds, centre.algorithm.state()


def test_messages_that_trickle_in_are_folded_in_batches_with_the_same_result() -> None:
    """A fold costs about the same whatever it holds, so messages arriving one by one are not folded one by one:
    they wait for the next, up to FOLD_BATCH distinct ones, or until none is due; the running average is the one
    of all of them arriving at once."""
    folds_at_once, at_once = star_folds(20, trickle=False)
    folds_trickling, trickling = star_folds(20, trickle=True)
    assert folds_at_once == folds_trickling == 2  # 16, then the last 4: not 20 folds of one
    assert at_once.keys() == trickling.keys()
    for name, value in at_once.items():
        torch.testing.assert_close(trickling[name], value, rtol=1e-6, atol=1e-7)


def star_gossip_receives(degree: int, trickle: bool, monkeypatch: pytest.MonkeyPatch, held: bool = True
                         ) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Two robust, screened rounds at the centre of a star of `degree` neighbours on another worker (messages all
    there at once or trickling in): how many inboxes each of round 1's screened gossip steps handed the centre's
    algorithm, and the centre's state. held=False: as if the algorithm folded what arrives as it comes."""
    cfg = small_config(aggregation="sequential", rounds=2, dfca={"variant": "robust", "seeding": "none",
                                                                 "warmup_rounds": 0, "gossip_steps": 2},
                       data={"clients": degree + 1, "train_per_client": 5, "test_per_client": 2})
    assert cfg.dfca.screen
    if not held:
        monkeypatch.setattr(DFCA, "holds_arrivals", lambda self, ex: False)
    centre, rest = star_drivers(cfg, degree, trickle)
    inboxes: Counter[int] = Counter()
    receive = centre.algorithm.receive

    def counted(ex: Any, inbox: Any) -> int:
        consensus = getattr(centre.algorithm, "consensus", None)
        if ex.name == "gossip" and centre.round == 1:
            assert consensus is not None and consensus.screen is not None
            inboxes[ex.step] += 1
        return receive(ex, inbox)

    centre.algorithm.receive = counted  # type: ignore[method-assign]
    run = LockstepRun([rest, centre], None)
    for t in range(2):
        lockstep_round(run, t)
    return [inboxes[step] for step in sorted(inboxes)], centre.algorithm.state()


@pytest.mark.parametrize("trickle", [False, True])
def test_a_screened_gossip_step_gets_its_arrivals_in_one_inbox(trickle: bool, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """A screened gossip step keeps what arrives until the step ends and mixes it all at once (holds_arrivals), so
    the driver hands it over in one inbox, not FOLD_BATCH messages at a time for the step to join again; the step
    ends where it ends with the messages in pieces."""
    whole, state = star_gossip_receives(20, trickle, monkeypatch)
    assert whole == [1, 1]  # 20 messages, each step
    pieces, in_pieces = star_gossip_receives(20, trickle, monkeypatch, held=False)
    assert pieces == [2, 2]  # 16, then 4
    assert state.keys() == in_pieces.keys()
    for name, value in state.items():
        torch.testing.assert_close(in_pieces[name], value, rtol=1e-6, atol=1e-7)


class CountedConfirms(InMemoryTransport):
    """Counts what is handed over without confirms, and who awaits them."""

    def __init__(self, broker: InMemoryBroker) -> None:
        super().__init__(broker)
        self.pipelined, self.awaited_at_once, self.confirmed = 0, 0, []  # type: ignore[var-annotated]

    def publish_pipelined(self, messages: Any, persistent: bool = True) -> None:
        super().publish_pipelined(messages, persistent)
        self.pipelined += len(messages)

    def await_confirms(self) -> None:
        self.awaited_at_once += 1

    def confirmation(self) -> Any:
        count, self.pipelined = self.pipelined, 0
        return lambda: self.confirmed.append(count)


def test_under_confirm_later_a_round_ends_without_its_confirms_and_hands_them_on() -> None:
    """A worker's driver (confirm_later) does not wait at the round's end for the broker's confirms of its
    messages: take_confirmation gives what awaits exactly that round's (the checkpoint writer calls it before the
    round's checkpoint is written); a driver without it awaits them in end_round, as central roles need."""
    cfg = robust_config(rounds=1)
    ctx = prepare(cfg)
    broker, graph, n = InMemoryBroker(), neighbours(ctx.graph), ctx.data.num_clients
    later, now = (client_driver(cfg, "exp", list(range(h, n, 2)), ctx.data.subset(list(range(h, n, 2))), graph,
                                CountedConfirms(broker), workers=2) for h in (0, 1))
    later.confirm_later = True
    lockstep_round(LockstepRun([later, now], None), 0)
    assert isinstance(later.transport, CountedConfirms) and isinstance(now.transport, CountedConfirms)
    assert later.transport.awaited_at_once == 0 and now.transport.awaited_at_once == 1
    later.take_confirmation()()
    assert later.transport.confirmed == [later.stats.published] and later.stats.published > 0
    assert later.unconfirmed is None  # taken once


def test_a_message_fanned_out_to_several_hosted_clients_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A star whose centre's neighbours all live on one worker: the centre's model reaches that worker's queue once,
    and the worker decodes it once for all of them (and folds it into each); a copy whose body differs from the
    decoded one (same key and headers) is decoded on its own and rejected."""
    degree = 6
    cfg = small_config(rounds=1, dfca={"variant": "paper"}, train={"local_epochs": 0},
                       data={"clients": degree + 1, "train_per_client": 5, "test_per_client": 2})
    ctx = prepare(cfg)
    graph = {0: list(range(1, degree + 1)), **{c: [0] for c in range(1, degree + 1)}}
    broker = InMemoryBroker()
    centre = client_driver(cfg, "star", [0], ctx.data.subset([0]), graph, InMemoryTransport(broker),
                           queue=topics.worker_queue("star", "worker-0"))
    others = list(range(1, degree + 1))
    rest = client_driver(cfg, "star", others, ctx.data.subset(others), graph, InMemoryTransport(broker),
                         queue=topics.worker_queue("star", "worker-1"))  # two queues: the centre is not c % workers
    senders: Counter[int] = Counter()
    decode = decoding.decode_messages

    def counting(*args: Any, **kwargs: Any) -> list[Envelope | PayloadRejected]:
        decoded = decode(*args, **kwargs)
        senders.update(e.sender for e in decoded if isinstance(e, Envelope))
        return decoded

    monkeypatch.setattr(decoding, "decode_messages", counting)
    lockstep_round(LockstepRun([rest, centre], None), 0)
    assert senders[0] == 1 and rest.stats.applied == degree  # one decode, folded into all six clients
    assert senders[1] == 1 and centre.stats.applied == degree

    # the same key and headers with another body, in one batch with copies: not taken from the decoded copy
    body, headers = encode_message(Envelope("star", 0, 0, "models", 0, 0, {n: torch.zeros(s) for n, s in
                                                                            ctx.model.shapes().items()}),
                                   rest.algorithm.payload(rest.exchanges[0]))
    key = topics.model_key("star", W0, 0, 0)
    tampered = bytearray(body)
    tampered[-1] ^= 1
    first, forged, again = rest._decode([Message(topics.MODELS_EXCHANGE, key, body, headers),
                                         Message(topics.MODELS_EXCHANGE, key, bytes(tampered), headers),
                                         Message(topics.MODELS_EXCHANGE, key, body, headers)])
    assert isinstance(first, Placed) and again is first and first.exchange == rest.exchanges[0]
    assert isinstance(forged, PayloadRejected) and "checksum" in str(forged)


def test_a_workers_own_clients_messages_stay_in_the_process_and_a_broker_copy_is_dropped() -> None:
    """A hosted client's gossip to hosted neighbours is delivered in the process (no broker delivery, no decode):
    each driver decodes only its other-hosted neighbours' messages, yet every (row, neighbour) pair is applied once
    and the result is the simulator's. A copy of a hosted client's message that reaches the worker's queue anyway
    (a binding another driver made) is dropped unread: not mixed twice, not held against the client."""
    cfg = robust_config()
    broker = InMemoryBroker()
    drivers, ctx = build_drivers(cfg, broker, 3)
    sim = simulate(cfg, data=ctx.data)
    decoded: list[Counter[int]] = []
    for d in drivers:
        counts: Counter[int] = Counter()
        decoded.append(counts)

        def counting(messages: list[Message], d: MessageDriver = d,
                     counts: Counter[int] = counts) -> list[Placed | PayloadRejected]:
            placed = MessageDriver._decode(d, messages)
            counts.update(p.envelope.sender for p in placed if isinstance(p, Placed))
            return placed

        d._decode = counting  # type: ignore[method-assign]
    own = drivers[0]
    hosted_sender = next(c for c in own.ids if any(m in own.ids for m in own.neighbours[c]))
    own.transport.bind(own.queue, topics.MODELS_EXCHANGE, topics.neighbour_binding("robust", hosted_sender))
    run = LockstepRun(drivers, None)
    for t in range(cfg.rounds):
        lockstep_round(run, t)
    steps = sum(schedule_of(cfg).gossip_steps(t) for t in range(cfg.rounds))
    assert sum(d.stats.applied for d in drivers) == steps * int(ctx.adjacency.sum())
    for d, counts in zip(drivers, decoded, strict=True):
        assert counts and not set(counts) & set(d.ids), (d.ids, counts)  # only other workers' clients decoded
        assert set(counts) == d.heard() and all(n == steps for n in counts.values())
        for name, tensor in d.algorithm.params.items():  # type: ignore[attr-defined]
            torch.testing.assert_close(tensor, sim.algorithm.params[name][d.ids], rtol=1e-4, atol=1e-5)
    assert own.stats.not_neighbour == steps and not own.blocked and own.stats.duplicates == 0


def test_a_worker_gets_each_message_it_needs_once_however_many_of_its_clients_hear_the_sender() -> None:
    """3 drivers (workers) in lockstep over one broker, the run's every message recorded as published: each worker
    takes exactly one delivery per message of a sender hosted elsewhere that one of its clients neighbours, and folds
    it for each of those clients (more (receiver, message) pairs than deliveries)."""
    cfg = robust_config()
    broker = InMemoryBroker()
    published: list[str] = []
    route = broker.route

    def recording(exchange: str, routing_key: str, *args: Any, **kwargs: Any) -> int:
        if exchange == topics.MODELS_EXCHANGE:
            published.append(routing_key)
        return route(exchange, routing_key, *args, **kwargs)

    broker.route = recording  # type: ignore[method-assign]
    drivers, ctx = build_drivers(cfg, broker, 3)
    run = LockstepRun(drivers, None)
    for t in range(schedule_of(cfg).total_rounds):
        lockstep_round(run, t)
    graph = neighbours(ctx.graph)
    senders = Counter(topics.parse_model_key(key).sender for key in published)
    for driver in drivers:
        heard = {m for c in driver.ids for m in graph[c]} - set(driver.ids)
        needed = sum(senders[m] for m in heard)
        assert needed > 0 and driver.stats.delivered == needed, (driver.ids, driver.stats.delivered, needed)
        assert driver.stats.not_neighbour == 0 and driver.stats.duplicates == 0
        assert driver.stats.applied > driver.stats.delivered  # one delivery, handed to every hosted neighbour
