"""The baselines through the worker's ClientRunner, without a broker (in-memory transport).

- IFCA: the server (as the aggregator runs it) closes rounds by its deadline when a worker never comes,
  stops waiting for that worker's clients, and finishes; the present clients finish every round.
- FedSPD and DFedAvgM: stopped after 2 rounds and resumed from the checkpoint, a run ends where the
  simulator's does (centers, u_is, the final phase's personalised models).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dfca.config import ExperimentConfig
from dfca.graph import build_graph, neighbours
from dfca.identity.sharding import clients_of
from dfca.runtime.aggregator.central_roles import ServerRole
from dfca.runtime.protocol.messages import RoundReport, StartCommand, WorkerEvent
from dfca.runtime.worker.client_runner import ClientRunner, RunSpec, checkpoint_path
from dfca.simulator import simulate
from dfca.transport import InMemoryBroker, InMemoryTransport


def small(**overrides: Any) -> ExperimentConfig:
    cfg: dict[str, Any] = {
        "name": "b", "clusters": 2, "rounds": 4, "seed": 2, "aggregation": "batch",
        "data": {"dataset": "digits", "rotations": [0, 180], "clients": 8, "train_per_client": 30,
                 "test_per_client": 10},
        "model": {"kind": "mlp", "hidden": 16}, "train": {"lr": 0.1, "local_epochs": 2, "batch_size": 10},
        "topology": {"kind": "erdos_renyi", "p": 0.5}, "runtime": {"round_timeout": 1.0},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return ExperimentConfig.model_validate(cfg)


def run_worker(cfg: ExperimentConfig, experiment: str, broker: InMemoryBroker, checkpoints: Path,
               workers: int = 1) -> tuple[ClientRunner, list[RoundReport | WorkerEvent]]:
    graph = neighbours(build_graph(cfg.topology, cfg.data.clients, cfg.seed))
    events: list[RoundReport | WorkerEvent] = []
    spec = RunSpec("d", experiment, cfg, workers=workers, ordinal=0, neighbours=graph, go=True)
    runner = ClientRunner(spec, lambda _prefetch: InMemoryTransport(broker), events.append, checkpoints)
    runner.start()
    runner.join(120)
    assert runner.finished and runner.status.state == "finished", runner.status
    return runner, events


def test_the_ifca_server_carries_on_without_a_worker_that_never_came(tmp_path: Path) -> None:
    cfg = small(algorithm="ifca", rounds=5)
    broker = InMemoryBroker()
    command = StartCommand(deployment="d", experiment="ifca", config=cfg, workers=2, neighbours={})
    role = ServerRole(command, InMemoryTransport(broker))
    assert isinstance(role, ServerRole)
    stop = threading.Event()
    server_thread = threading.Thread(target=role.run, args=(stop,), daemon=True)
    server_thread.start()
    try:
        runner, events = run_worker(cfg, "ifca", broker, tmp_path, workers=2)  # worker 1 never starts
        server_thread.join(60)
    finally:
        stop.set()
    assert not server_thread.is_alive(), "the IFCA server hangs"
    progress = role.progress()
    absent = clients_of(1, 2, 8)
    assert progress["round"] == cfg.rounds and progress["presumed_dead"] == absent
    assert progress["stats"]["timeouts"] >= 2  # it waited for the absent clients, then stopped waiting
    assert progress["stats"]["applied"] == cfg.rounds * len(clients_of(0, 2, 8))
    reports = [e for e in events if isinstance(e, RoundReport)]
    assert [r.round for r in reports] == list(range(1, cfg.rounds + 1))
    assert reports[-1].complete and reports[-1].evaluation is not None
    assert runner.driver is not None and runner.driver.algorithm.model_round == cfg.rounds  # type: ignore[attr-defined]


@pytest.mark.parametrize("algorithm", ["fedspd", "dfedavgm"])
def test_a_resumed_baseline_run_ends_where_the_simulator_does(algorithm: str, tmp_path: Path) -> None:
    cfg = small(algorithm=algorithm, init="local", train={"momentum": 0.9}, fedspd={"final_epochs": 2})
    broker = InMemoryBroker()
    first, _ = run_worker(cfg.model_copy(update={"rounds": 2}), "resume", broker, tmp_path)
    second, events = run_worker(cfg, "resume", broker, tmp_path)
    assert second.status.resumed_from == 2
    assert [e.round for e in events if isinstance(e, RoundReport)] == [3, 4]
    sim = simulate(cfg)
    tensors = load_file(str(checkpoint_path(tmp_path, "resume", 0)))
    for name, params in sim.algorithm.params.items():
        torch.testing.assert_close(tensors[f"params.{name}"], params, rtol=1e-4, atol=1e-5)
    final = [e for e in events if isinstance(e, RoundReport)][-1]
    assert final.evaluation is not None and final.complete
    if algorithm == "fedspd":
        personal = sim.algorithm.personal  # type: ignore[attr-defined]
        for name, params in personal.items():
            torch.testing.assert_close(tensors[f"personal.{name}"], params, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(final.evaluation["mixture"]), sim.algorithm.shares)  # type: ignore[attr-defined]


def test_the_ifca_role_ends_when_the_experiment_is_over_without_uploads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No worker ever uploads and the topology service reports the experiment over: the server returns."""
    cfg = small(algorithm="ifca")
    command = StartCommand(deployment="d", experiment="gone", config=cfg, workers=1, neighbours={})
    role = ServerRole(command, InMemoryTransport(InMemoryBroker()), topology_url="http://topology.invalid")
    monkeypatch.setattr("dfca.runtime.aggregator.central_roles.OVER_CHECK_S", 0.1)
    asked: list[bool] = []
    monkeypatch.setattr(role, "experiment_over", lambda: asked.append(True) or len(asked) >= 2)
    thread = threading.Thread(target=role.run, args=(threading.Event(),), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and len(asked) == 2 and role.progress()["round"] == 0

