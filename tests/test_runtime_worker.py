"""The worker side without a broker: deferred acks, liveness, the runner's checkpoint resume and messages."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dfca.config import ExperimentConfig
from dfca.graph import build_graph, neighbours
from dfca.identity import topics
from dfca.runtime.driver.host_transport import HostTransport, RunInterrupted
from dfca.runtime.driver.liveness import NeighbourLiveness
from dfca.runtime.protocol.messages import (
    FinalModelsShare,
    GoCommand,
    MessageInvalid,
    RoundReport,
    StartCommand,
    StopCommand,
    TopologyChange,
    WorkerEvent,
    decode_control,
    decode_event,
    encode,
)
from dfca.runtime.worker.client_runner import ClientRunner, RunSpec, checkpoint_path
from dfca.simulator import simulate
from dfca.transport import InMemoryBroker, InMemoryTransport


def small(**overrides: Any) -> ExperimentConfig:
    """The paper's one-message-per-neighbour rounds: these tests count messages and time out rounds.

    Robust (gossip-step) rounds on the worker are covered by tests/test_driver_messages.py and
    tests/test_runtime_robust_rabbitmq.py.
    """
    cfg: dict[str, Any] = {
        "name": "w", "clusters": 2, "rounds": 4, "seed": 2, "aggregation": "batch", "dfca": {"variant": "paper"},
        "data": {"dataset": "digits", "rotations": [0, 180], "clients": 8, "train_per_client": 30,
                 "test_per_client": 10},
        "model": {"kind": "mlp", "hidden": 16}, "train": {"lr": 0.1, "local_epochs": 2, "batch_size": 10},
        "topology": {"kind": "erdos_renyi", "p": 0.5}, "runtime": {"round_timeout": 0.3},
    }
    cfg.update(overrides)
    return ExperimentConfig.model_validate(cfg)


def test_acks_wait_for_flush_so_a_crash_before_the_checkpoint_loses_nothing() -> None:
    broker = InMemoryBroker()
    sender = InMemoryTransport(broker)
    sender.declare_exchange(topics.MODELS_EXCHANGE, "topic")
    sender.declare_queue("q")
    sender.bind("q", topics.MODELS_EXCHANGE, "#")
    host = HostTransport(InMemoryTransport(broker))
    host.publish(topics.MODELS_EXCHANGE, "e.3.0", b"model", {"round": "5"})
    message = host.receive("q")
    assert message is not None and float(message.headers["sent_at"]) <= time.time()
    assert host.take_bytes_published() == len(b"model")
    host.ack(message)
    host.close()  # crashed before flush_acks: the broker redelivers
    again = HostTransport(InMemoryTransport(broker))
    redelivered = again.receive("q")
    assert redelivered is not None and redelivered.redelivered
    again.ack(redelivered)
    assert again.flush_acks() == 1
    again.close()
    assert InMemoryTransport(broker).receive("q") is None  # acked for good
    again = HostTransport(InMemoryTransport(broker))
    again.interrupt()
    with pytest.raises(RunInterrupted):
        again.receive("q")


def test_neighbours_are_given_up_after_repeated_misses_and_revived_when_they_catch_up() -> None:
    live = NeighbourLiveness(dead_after=2)
    live.sighted(2, 1)
    live.observe_round(expected={1, 2, 3}, missing={2})
    assert live.dead == set()
    live.observe_round(expected={1, 2, 3}, missing={2})
    assert live.dead == {2}
    live.observe_round(expected={1, 3}, missing=set())  # not waited for: stays dead
    assert live.dead == {2}
    assert live.revive(live.sightings, current_round=4) == []  # nothing new from it: still silent
    assert live.revive({2: 4}, current_round=4) == [2]
    assert live.dead == set()


def test_a_paused_neighbour_that_makes_progress_is_waited_for_again_while_it_catches_up() -> None:
    """A worker paused for many rounds comes back far behind: each round it runs as long as everyone else's, so it
    would never catch up unheard. A model of any later round than it had sent before it went silent revives it;
    missing again, it is given up again, and revived by its next progress, until it is level."""
    live = NeighbourLiveness(dead_after=2)
    live.sighted(2, 3)
    for _ in range(2):
        live.observe_round(expected={1, 2}, missing={2})
    assert live.dead == {2}
    live.sighted(2, 3)  # a redelivery of what it had sent: no progress
    assert live.revive(live.sightings, current_round=40) == [] and live.dead == {2}
    live.sighted(2, 4)  # it is back, far behind
    assert live.revive(live.sightings, current_round=40) == [2] and live.dead == set()
    for _ in range(2):
        live.observe_round(expected={1, 2}, missing={2})
    assert live.dead == {2}
    live.sighted(2, 20)
    assert live.revive(live.sightings, current_round=42) == [2]


def run_single_worker(cfg: ExperimentConfig, checkpoints: Path, experiment: str, broker: InMemoryBroker,
                      events: list[RoundReport | WorkerEvent]) -> ClientRunner:
    graph = neighbours(build_graph(cfg.topology, cfg.data.clients, cfg.seed))
    spec = RunSpec("d", experiment, cfg, workers=1, ordinal=0, neighbours=graph, go=True)
    runner = ClientRunner(spec, lambda _prefetch: InMemoryTransport(broker), events.append, checkpoints)
    runner.start()
    runner.join(120)
    assert runner.finished and runner.status.state == "finished", runner.status
    return runner


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    """Stop after 2 rounds, resume from the checkpoint for 2 more: the simulator's 4-round models."""
    cfg = small()
    broker = InMemoryBroker()
    first: list[RoundReport | WorkerEvent] = []
    run_single_worker(cfg.model_copy(update={"rounds": 2}), tmp_path, "resume", broker, first)
    assert [e.round for e in first if isinstance(e, RoundReport)] == [1, 2]
    second: list[RoundReport | WorkerEvent] = []
    runner = run_single_worker(cfg, tmp_path, "resume", broker, second)
    assert runner.status.resumed_from == 2
    assert [e.state for e in second if isinstance(e, WorkerEvent)] == ["resumed", "finished"]
    assert [e.round for e in second if isinstance(e, RoundReport)] == [3, 4]
    tensors = load_file(str(checkpoint_path(tmp_path, "resume", 0)))
    sim = simulate(cfg)
    for name, params in sim.algorithm.params.items():
        torch.testing.assert_close(tensors[f"params.{name}"], params, rtol=1e-4, atol=1e-5)
    final = [e for e in second if isinstance(e, RoundReport)][-1]
    assert final.evaluation is not None and final.complete
    share = second[-2]  # the worker's share of the final models goes out before `finished`
    assert isinstance(share, FinalModelsShare) and share.worker == 0
    assert final.stats["timeouts"] == 0 and final.stats["applied"] > 0
    # where the round loop's CPU went: each phase's CPU time within its seconds, and the loop's thread in all (from
    # the first round's start to this report) at least what its phases took
    cpu, seconds = final.stats["cpu_seconds"], final.stats["seconds"]
    assert all(0 <= cpu[p] <= seconds[p] + 1e-3 for p in seconds) and cpu["train"] > 0 and cpu["receive"] > 0
    assert sum(cpu[p] for p in seconds) - 1e-3 <= cpu["loop"] <= sum(seconds.values()) + 1.0


def test_clients_carry_on_without_a_silent_neighbour_worker(tmp_path: Path) -> None:
    """Worker 1 never starts: worker 0's clients wait `round_timeout` twice, then stop waiting."""
    cfg = small(rounds=5, aggregation="sequential")
    graph = neighbours(build_graph(cfg.topology, cfg.data.clients, cfg.seed))
    events: list[RoundReport | WorkerEvent] = []
    spec = RunSpec("d", "alone", cfg, workers=2, ordinal=0, neighbours=graph, go=True)
    broker = InMemoryBroker()
    runner = ClientRunner(spec, lambda _prefetch: InMemoryTransport(broker), events.append, tmp_path)
    runner.start()
    runner.join(120)
    reports = [e for e in events if isinstance(e, RoundReport)]
    assert [r.round for r in reports] == [1, 2, 3, 4, 5] and runner.status.state == "finished"
    assert [r.complete for r in reports] == [False, False, True, True, True]
    assert reports[-1].stats["timeouts"] == 2
    assert set(reports[-1].dead_neighbours) == {c for c in range(8) if c % 2 == 1 and any(
        c in graph[m] for m in range(0, 8, 2))}
    with safe_open(str(checkpoint_path(tmp_path, "alone", 0)), "pt") as f:
        assert json.loads(f.metadata()["clients"]) == [0, 2, 4, 6]


def test_a_stop_command_ends_the_runner_promptly(tmp_path: Path) -> None:
    cfg = small(rounds=50, runtime={"round_timeout": 60.0})
    graph = neighbours(build_graph(cfg.topology, cfg.data.clients, cfg.seed))
    events: list[RoundReport | WorkerEvent] = []
    spec = RunSpec("d", "stop", cfg, workers=2, ordinal=0, neighbours=graph, go=True)  # worker 1 never comes
    broker = InMemoryBroker()
    runner = ClientRunner(spec, lambda _prefetch: InMemoryTransport(broker), events.append, tmp_path)
    runner.start()
    deadline = time.monotonic() + 60
    while runner.status.state != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    began = time.monotonic()
    runner.post(StopCommand(deployment="d", experiment="stop"))
    runner.join(30)
    assert runner.finished and time.monotonic() - began < 30  # not the 60 s round timeout
    assert events[-1].kind == "worker" and events[-1].state == "stopped"


def test_control_and_event_documents_round_trip_and_garbage_is_refused() -> None:
    cfg = small()
    start = StartCommand(deployment="d", experiment="e", config=cfg, workers=2, neighbours={0: [1], 1: [0]})
    assert decode_control(encode(start)) == start
    report = RoundReport(deployment="d", experiment="e", worker=0, incarnation="x", round=1, clients=[0],
                         complete=True, seconds=0.5)
    assert decode_event(encode(report)) == report
    for garbage in (b"\x00\xff", b"{}", b'{"kind": "start", "deployment": "d"}', encode(report)):
        with pytest.raises(MessageInvalid):
            decode_control(garbage)


def test_a_topology_change_is_applied_before_its_effective_round(tmp_path: Path) -> None:
    cfg = small(rounds=4)
    graph = neighbours(build_graph(cfg.topology, cfg.data.clients, cfg.seed))
    u, v = next((a, b) for a in range(8) for b in graph[a] if a < b)
    changed = {c: [m for m in ms if {c, m} != {u, v}] for c, ms in graph.items()}
    events: list[RoundReport | WorkerEvent] = []
    broker = InMemoryBroker()
    spec = RunSpec("d", "dyn", cfg, workers=1, ordinal=0, neighbours=graph)  # waits for go
    runner = ClientRunner(spec, lambda _prefetch: InMemoryTransport(broker), events.append, tmp_path)
    runner.post(TopologyChange(deployment="d", experiment="dyn", version=1, effective_round=2, neighbours=changed))
    runner.start()
    runner.post(GoCommand(deployment="d", experiment="dyn"))
    runner.join(120)
    assert runner.status.state == "finished" and runner.driver is not None
    assert runner.driver.neighbours == changed
    reports = [e for e in events if isinstance(e, RoundReport)]
    assert all(r.complete for r in reports)  # nobody waited for the removed edge
    per_round = [r.stats["applied"] for r in reports]
    edges_before, edges_after = sum(map(len, graph.values())), sum(map(len, changed.values()))
    assert per_round == [edges_before, 2 * edges_before, 2 * edges_before + edges_after,
                         2 * edges_before + 2 * edges_after]
