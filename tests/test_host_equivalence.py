"""Two drivers, one core: the message-driven hosts and the simulator agree in synchronous batch mode."""

from __future__ import annotations

import pytest
import torch

from dfca.algorithms import build_algorithm
from dfca.config import ExperimentConfig
from dfca.evaluation import cluster_ari, populated_clusters
from dfca.graph import neighbours
from dfca.host import run_hosts_lockstep
from dfca.simulator import prepare, simulate
from dfca.transport import InMemoryBroker, InMemoryTransport


def small_config(**overrides: object) -> ExperimentConfig:
    base = {
        "name": "equiv", "algorithm": "dfca", "init": "global", "aggregation": "batch", "clusters": 2,
        "rounds": 3, "seed": 3,
        "data": {"dataset": "digits", "rotations": [0, 180], "clients": 10, "train_per_client": 30,
                 "test_per_client": 10},
        "model": {"kind": "mlp", "hidden": 16},
        "train": {"lr": 0.1, "local_epochs": 2, "batch_size": 10},
        "topology": {"kind": "erdos_renyi", "p": 0.4},
    }
    base.update(overrides)
    return ExperimentConfig.model_validate(base)


@pytest.mark.parametrize("init,aggregation,hosts", [("global", "batch", 3), ("local", "batch", 2),
                                                    ("global", "sequential", 1)])
def test_hosts_match_simulator(init: str, aggregation: str, hosts: int) -> None:
    cfg = small_config(init=init, aggregation=aggregation, dfca={"variant": "paper"})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    broker = InMemoryBroker()
    built = run_hosts_lockstep(cfg, ctx.data, neighbours(ctx.graph), lambda: InMemoryTransport(broker), hosts)
    sim_params = sim.algorithm.params  # [N, k, ...]
    for h in built:
        assert h.stats.applied > 0 and not h.stats.rejected and h.stats.timeouts == 0
        for name, tensor in h.params.items():
            torch.testing.assert_close(tensor, sim_params[name][h.clients], rtol=1e-4, atol=1e-5)
    # every client applied exactly one model per neighbour per round
    applied = sum(h.stats.applied for h in built)
    assert applied == cfg.rounds * int(ctx.adjacency.sum())


@pytest.mark.parametrize("init,hosts", [("global", 2), ("local", 3)])
def test_robust_hosts_match_simulator(init: str, hosts: int) -> None:
    """Ratio consensus over message-driven gossip steps equals the simulator's P^G (m theta) / P^G m."""
    cfg = small_config(init=init, rounds=4, dfca={"variant": "robust", "seeding": "none", "warmup_rounds": 2,
                                                  "warmup_gossip_steps": 3, "gossip_steps": 2})
    steps = [cfg.dfca.steps_at(t) for t in range(cfg.rounds)]
    assert steps == [3, 3, 2, 2]
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    broker = InMemoryBroker()
    built = run_hosts_lockstep(cfg, ctx.data, neighbours(ctx.graph), lambda: InMemoryTransport(broker), hosts)
    sim_params = sim.algorithm.params
    for h in built:
        assert not h.stats.rejected and h.stats.timeouts == 0 and h.stats.stale_dropped == 0
        assert h.gossip is None
        for name, tensor in h.params.items():
            torch.testing.assert_close(tensor, sim_params[name][h.clients], rtol=1e-4, atol=1e-5)
    # one gossip message per neighbour and step, each applied once; one published per client and step
    assert sum(h.stats.applied for h in built) == sum(steps) * int(ctx.adjacency.sum())
    assert sum(h.stats.published for h in built) == sum(steps) * cfg.data.clients


def test_robust_then_paper_rounds_match_simulator() -> None:
    """gossip_steps 0: the warm-up rounds use consensus, the later ones eq. 7 (sequential eq. 8 here)."""
    cfg = small_config(aggregation="sequential", rounds=3,
                       dfca={"variant": "robust", "seeding": "none", "warmup_rounds": 1, "warmup_gossip_steps": 2,
                             "gossip_steps": 0})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    broker = InMemoryBroker()
    built = run_hosts_lockstep(cfg, ctx.data, neighbours(ctx.graph), lambda: InMemoryTransport(broker), 2)
    for h in built:
        for name, tensor in h.params.items():
            torch.testing.assert_close(tensor, sim.algorithm.params[name][h.clients], rtol=1e-4, atol=1e-5)
    edges = int(ctx.adjacency.sum())
    assert sum(h.stats.applied for h in built) == 2 * edges + 2 * edges


@pytest.mark.parametrize("init,aggregation,hosts,variant", [("global", "batch", 2, "robust"),
                                                            ("local", "sequential", 3, "paper")])
def test_seeding_hosts_match_simulator(init: str, aggregation: str, hosts: int, variant: str) -> None:
    """Farthest-first seeding (one candidate message per neighbour and round), then training: host == simulator."""
    cfg = small_config(init=init, aggregation=aggregation, clusters=2, rounds=7,
                       dfca={"variant": variant, "seeding": "farthest", "flood_rounds": 3, "seed_epochs": 2,
                             "warmup_rounds": 1, "warmup_gossip_steps": 2, "gossip_steps": 0})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    assert sim.algorithm.training_start == 6  # k * flood_rounds seeding rounds, then training
    broker = InMemoryBroker()
    built = run_hosts_lockstep(cfg, ctx.data, neighbours(ctx.graph), lambda: InMemoryTransport(broker), hosts)
    for h in built:
        assert not h.stats.rejected and h.stats.timeouts == 0 and h.seeding is None
        for name, tensor in h.params.items():
            torch.testing.assert_close(tensor, sim.algorithm.params[name][h.clients], rtol=1e-4, atol=1e-5)


def test_seeding_gives_every_client_the_same_seeds_of_distinct_clusters() -> None:
    """After k floods every client holds the same k models, each fitting one true cluster (farthest-first)."""
    cfg = small_config(rounds=1, dfca={"seeding": "farthest", "flood_rounds": 3, "seed_epochs": 40})
    assert cfg.seeding_rounds == 6 and cfg.total_rounds == 7  # the seeding comes before the training rounds
    ctx = prepare(cfg)
    algo = build_algorithm(ctx)
    for t in range(cfg.seeding_rounds):
        algo.run_round(t, ctx.adjacency)
    for name, tensor in algo.params.items():
        assert torch.equal(tensor, tensor[:1].expand_as(tensor)), name  # identical at every client
        assert not torch.equal(tensor[0, 0], tensor[0, 1])
    assigned = algo.evaluate().assigned
    assert cluster_ari(assigned, ctx.data.true_cluster) == 1.0 and populated_clusters(assigned) == 2
