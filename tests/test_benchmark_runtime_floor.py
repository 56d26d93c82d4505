"""benchmarks/runtime_benchmark.py's pieces that need no stack: the drivers' floor measures the run the simulator
makes, and the transport comparison sends messages as large as the benchmark's gossip messages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dfca.algorithms import Exchange
from dfca.config import ExperimentConfig
from dfca.data import build_federated_data
from dfca.graph import build_graph, neighbours
from dfca.simulator import simulate
from dfca.transport import InMemoryBroker, InMemoryTransport
from dfca.wire.codec import Envelope, encode_message
from harness.lockstep import client_driver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from runtime_benchmark import (  # noqa: E402
    bench_config,
    cores_bound,
    drivers_floor,
    gossip_body_bytes,
    simulator_round_seconds,
)


def test_the_drivers_floor_times_the_simulators_run_and_every_phase_of_it() -> None:
    cfg = bench_config(2)
    cfg["data"] = {**cfg["data"], "clients": 9, "train_per_client": 40, "test_per_client": 20}
    threads = torch.get_num_threads()
    cpu, phases, accuracy, phases_cpu = drivers_floor(cfg, workers=3)
    assert torch.get_num_threads() == threads  # one thread inside only
    simulated = simulate(ExperimentConfig.model_validate(cfg)).summary["test_accuracy"]
    # the same run: lockstep drivers agree with the simulator to float rounding (folded in chunks, in another order),
    # which may flip one test prediction (the benchmark's own config: 0.8850 against 0.8867, one sample of 600)
    one_sample = 1 / (cfg["data"]["clients"] * cfg["data"]["test_per_client"])
    assert accuracy == pytest.approx(simulated, abs=one_sample + 1e-9)
    assert accuracy > 0.5  # and a run that learned
    assert cpu > 0 and all(phases[p] > 0 for p in ("train", "publish", "receive", "mix"))
    assert phases["wait"] < phases["receive"]  # lockstep: everything due has arrived when a driver collects
    # each phase's CPU time (the one thread's): within its seconds, and the phases together most of the process's CPU
    assert all(0 < phases_cpu[p] <= phases[p] * 1.05 + 1e-3 for p in ("train", "publish", "receive", "mix"))
    assert 0.5 * cpu < sum(phases_cpu.values()) <= cpu * 1.05


def test_the_transport_comparison_sends_bodies_as_large_as_a_gossip_message() -> None:
    config = ExperimentConfig.model_validate(bench_config(2))
    data = build_federated_data(config)
    graph = neighbours(build_graph(config.topology, config.data.clients, config.seed))
    driver = client_driver(config, "size", [0], data.subset([0]), graph, InMemoryTransport(InMemoryBroker()))
    spec = driver.algorithm.payload(Exchange("gossip"))
    tensors = {name: torch.rand(s.shape) for name, s in spec.items()}
    body, _ = encode_message(Envelope("size", 0, 9, "gossip", 0, 0, tensors), spec, torch.int8)
    assert config.runtime.payload_dtype == "int8" and config.model.hidden == 64
    assert gossip_body_bytes(64) == len(body)


def test_the_simulators_baseline_is_its_round_less_the_consensus_metrics_no_runtime_round_computes() -> None:
    """The simulator times each round with its consensus metrics (Disp_j, index consistency) inside and says how
    long they took; the benchmark's baseline leaves them out (a runtime round computes none: no worker sees every
    client's models), and puts each round's kind in the same-work figures."""
    cfg = bench_config(3)
    cfg["data"] = {**cfg["data"], "clients": 9, "train_per_client": 40, "test_per_client": 20}
    history = simulate(ExperimentConfig.model_validate(cfg)).history
    assert all(0 < h["consensus_seconds"] < h["seconds"] for h in history)
    assert all("index_consistency" in h and "disagreement" in h for h in history)
    sim = simulator_round_seconds(cfg, repeats=1)
    assert 0 < sim.same_work < sim.seconds and sim.accuracy > 0.5
    assert sim.by_kind and all(v > 0 for v in sim.by_kind.values())
    assert sim.by_kind.keys() <= {"seeding", "merge", "gossip"}


def test_the_cores_bound_is_the_runtimes_cpu_spread_over_the_cores_and_the_goals_cpu_budget() -> None:
    # a measured 24-client run: 0.273 CPU-s a round on 2 cores, the drivers alone 0.100, the simulator 0.029 s
    bound = cores_bound(runtime_cpu=0.273, drivers_cpu=0.100, simulator_round=0.029, cores=2)
    assert bound.least_round == pytest.approx(0.1365)
    assert bound.least_ratio == pytest.approx(0.1365 / 0.029)
    assert bound.budget == pytest.approx(2.5 * 0.029 * 2)
    assert bound.drivers_share == pytest.approx(0.100 / 0.145)
    # 16 cores: the same CPU would allow 0.59x, and the drivers would use 9% of the budget
    wide = cores_bound(runtime_cpu=0.273, drivers_cpu=0.100, simulator_round=0.029, cores=16)
    assert wide.least_ratio == pytest.approx(0.273 / 16 / 0.029)
    assert wide.drivers_share == pytest.approx(0.0862, abs=1e-4)  # 0.100 / (2.5 x 0.029 x 16)
