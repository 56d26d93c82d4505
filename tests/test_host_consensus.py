"""Robust DFCA's gossip steps on concurrent hosts: held later steps, duplicates, bad payloads, timeouts."""

from __future__ import annotations

import threading

import torch

from dfca import topics
from dfca.graph import neighbours
from dfca.host import ClientHost
from dfca.simulator import prepare, simulate
from dfca.transport import InMemoryBroker, InMemoryTransport
from dfca.wire import ConsensusUpdate, encode_consensus
from tests.test_host_equivalence import small_config


def robust_config(rounds: int = 3) -> object:
    return small_config(rounds=rounds, dfca={"variant": "robust", "seeding": "none", "warmup_rounds": 2,
                                             "warmup_gossip_steps": 3, "gossip_steps": 2})


def build_hosts(cfg: object, broker: InMemoryBroker, count: int) -> tuple[list[ClientHost], object]:
    ctx = prepare(cfg)  # type: ignore[arg-type]
    graph = neighbours(ctx.graph)
    n = ctx.data.num_clients
    hosts = []
    for h in range(count):
        group = list(range(h, n, count))
        host = ClientHost(cfg, "robust", group, ctx.data.subset(group),  # type: ignore[arg-type]
                          {c: graph[c] for c in group}, InMemoryTransport(broker))
        host.setup()
        hosts.append(host)
    return hosts, ctx


def test_threaded_hosts_with_noise_match_simulator() -> None:
    """Each host runs its rounds in its own thread (local_step + collect, as a worker does); a spoofed,
    a non-finite and a duplicated gossip message are injected. The result is still the simulator's."""
    cfg = robust_config()
    broker = InMemoryBroker()
    hosts, ctx = build_hosts(cfg, broker, 3)
    sim = simulate(cfg, data=ctx.data)  # type: ignore[arg-type]
    injector = InMemoryTransport(broker)
    sender = hosts[0].clients[0]
    shapes = hosts[0].shapes
    k = cfg.clusters  # type: ignore[attr-defined]
    junk = ConsensusUpdate("robust", sender, 0, 0, {n: torch.zeros(k, *s) for n, s in shapes.items()},
                           torch.ones(k))
    body, headers = encode_consensus(junk)
    injector.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", sender + 1, 0), body, headers)  # spoofed
    nan = ConsensusUpdate("robust", sender, 0, 0, {n: torch.full((k, *s), float("nan")) for n, s in shapes.items()},
                          torch.ones(k))
    body, headers = encode_consensus(nan)
    injector.publish(topics.MODELS_EXCHANGE, topics.model_key("robust", sender, 0), body, headers)
    errors: list[BaseException] = []

    def run(host: ClientHost) -> None:
        try:
            for t in range(cfg.rounds):  # type: ignore[attr-defined]
                if not host.run_round(t, timeout=30.0):
                    raise RuntimeError(f"round {t} incomplete")
        except BaseException as err:  # noqa: BLE001 - surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(h,)) for h in hosts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors and not any(th.is_alive() for th in threads)
    rejected = sum((h.stats.rejected for h in hosts), start=__import__("collections").Counter())
    receivers = sum(1 for h in hosts for c in h.clients if sender in h.neighbours[c])
    receivers_spoof = sum(1 for h in hosts for c in h.clients if sender + 1 in h.neighbours[c])
    assert rejected["non_finite"] == receivers and rejected["spoofed"] == receivers_spoof
    steps = sum(cfg.dfca.steps_at(t) for t in range(cfg.rounds))  # type: ignore[attr-defined]
    assert sum(h.stats.applied for h in hosts) == steps * int(ctx.adjacency.sum())  # type: ignore[attr-defined]
    for h in hosts:
        assert h.stats.timeouts == 0
        for name, tensor in h.params.items():
            torch.testing.assert_close(tensor, sim.algorithm.params[name][h.clients], rtol=1e-4, atol=1e-5)


def test_duplicate_and_stale_gossip_messages_are_not_mixed_twice() -> None:
    cfg = robust_config(rounds=1)
    broker = InMemoryBroker()
    hosts, ctx = build_hosts(cfg, broker, 2)
    a, b = hosts
    client = next(c for c in a.clients if any(m in b.clients for m in a.neighbours[c]))
    peer = next(m for m in a.neighbours[client] if m in b.clients)
    for h in hosts:
        h.local_step(0)
    # b's step-0 messages delivered twice: a copy of every message in a's queue is published again
    queue = a.queue(client)
    first = []
    while (msg := a.transport.receive(queue, 0.0)) is not None:
        first.append(msg)
        a.handle(client, msg)
    assert any(m for m in first)
    peer_msg = next(m for m in first if m.routing_key == topics.model_key("robust", peer, 0))
    applied = a.stats.applied
    a.transport.publish(topics.MODELS_EXCHANGE, peer_msg.routing_key, peer_msg.body, peer_msg.headers)
    while (msg := a.transport.receive(queue, 0.0)) is not None:
        a.handle(client, msg)
    assert a.stats.duplicates == 1 and a.stats.applied == applied
    a.consensus_collect(0, 5.0)
    b.consensus_collect(0, 5.0)
    # a step-0 message arriving after step 0 closed is dropped, not mixed into step 1
    a.gossip_seen.clear()
    a.transport.publish(topics.MODELS_EXCHANGE, peer_msg.routing_key, peer_msg.body, peer_msg.headers)
    a.consensus_publish(1)
    while (msg := a.transport.receive(queue, 0.0)) is not None:
        if msg.headers.get("step") == "0":
            a.handle(client, msg)
    assert a.stats.stale_dropped == 1


def test_gossip_step_times_out_without_a_neighbour() -> None:
    """A host whose neighbours never gossip: each step times out, den stays m, theta keeps its own copy."""
    cfg = robust_config(rounds=1)
    broker = InMemoryBroker()
    hosts, _ = build_hosts(cfg, broker, 2)
    a = hosts[0]
    a.local_step(0)
    trained = {n: v.clone() for n, v in a.params.items()}
    assert a.collect(timeout=0.2) is False
    assert a.stats.timeouts == cfg.dfca.steps_at(0)  # type: ignore[attr-defined]
    lonely = [c for c in a.clients if not any(m in a.clients for m in a.neighbours[c])]
    assert lonely and all(a.waiting[c] == set(a.neighbours[c]) for c in lonely)
    for c in lonely:  # nothing arrived: num/den = theta for the trained cluster, the rest keep their copy
        r = a.row[c]
        for n in a.params:
            torch.testing.assert_close(a.params[n][r], trained[n][r])
