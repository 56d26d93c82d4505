"""A compromised host among honest ones, in lockstep: what its forgeries (harness.forgery) cost the honest clients.

tests/test_byzantine.py and benchmarks/byzantine.py measure the defences this way, in memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch

from dfca.algorithms import Algorithm, schedule_of
from dfca.config import ExperimentConfig
from dfca.data import FederatedData
from dfca.results.evaluation import cluster_ari
from dfca.transport import InMemoryBroker, InMemoryTransport
from harness.forgery import Attack, Forger
from harness.lockstep import LockstepRun, client_driver, lockstep_round

Graph = Mapping[int, Sequence[int]]


def run_with_forger(cfg: ExperimentConfig, data: FederatedData, graph: Graph, attack: Attack, hosts: int = 3,
                    forger: int = 1, timeout: float = 0.5) -> LockstepRun:
    """`cfg` over `hosts` in-memory drivers in lockstep, host `forger` compromised: it runs the algorithm, but its
    clients send what `attack` forges (harness.forgery). An exchange whose forgeries were refused closes after
    `timeout`, as on the runtime."""
    return forged_run(cfg, data, graph, attack, schedule_of(cfg).total_rounds, hosts, forger, timeout)


def forged_run(cfg: ExperimentConfig, data: FederatedData, graph: Graph, attack: Attack, rounds: int, hosts: int = 3,
               forger: int = 1, timeout: float = 0.5) -> LockstepRun:
    """run_with_forger's first `rounds` rounds."""
    broker = InMemoryBroker()
    n = data.num_clients
    groups = [list(range(h, n, hosts)) for h in range(hosts)]
    drivers = [client_driver(cfg, "forged", g, data.subset(g), graph, InMemoryTransport(broker), workers=hosts)
               for g in groups]
    drivers[forger].algorithm = cast(Algorithm, Forger(drivers[forger].algorithm, attack, cfg.seed))
    run = LockstepRun(drivers, None)
    for t in range(rounds):
        lockstep_round(run, t, timeout, strict=False)
    return run


def honest_scores(run: LockstepRun, forger: int) -> dict[str, float]:
    """Mean test accuracy and ARI over the clients of every host but `forger`, and what their drivers refused."""
    accuracy, assigned, truth = [], [], []
    refused = 0
    for h, driver in enumerate(run.drivers):
        if h == forger:
            continue
        ev = driver.algorithm.evaluate()
        accuracy += ev.test_accuracy.tolist()
        assigned += ev.assigned.tolist()
        truth += driver.algorithm.data().true_cluster.tolist()
        refused += sum(driver.stats.rejected.values())
    return {"test_accuracy": sum(accuracy) / len(accuracy),
            "cluster_ari": cluster_ari(torch.tensor(assigned), torch.tensor(truth)),
            "rejected": refused, "screened": sum(d.stats.screened for h, d in enumerate(run.drivers) if h != forger)}
