"""The lockstep test driver: several message drivers (and a central role's) in one thread, exchange by exchange.

Every driver begins the round; for each exchange all of them publish, then all collect, then all close it;
then every driver ends the round. With synchronous delivery the result must equal the simulator's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dfca.algorithms import HostContext, clients_of, server_of
from dfca.algorithms.base import SERVER
from dfca.config import ExperimentConfig
from dfca.data import FederatedData
from dfca.models import build_model
from dfca.runtime.message_driver import MessageDriver
from dfca.schedule import RoundSchedule
from dfca.transport import Transport

Graph = Mapping[int, Sequence[int]]


def client_driver(cfg: ExperimentConfig, experiment: str, clients: Sequence[int], data: FederatedData, graph: Graph,
                  transport: Transport, device: str = "cpu", workers: int = 1) -> MessageDriver:
    """A driver of `clients` (data: their shards) over `transport`, its queues set up; `workers`: client c is
    hosted by worker c % workers (its routing keys and queue names say so)."""
    model = build_model(cfg.model.kind, data.input_shape, cfg.model.hidden, data.num_classes, device)
    ctx = HostContext(cfg, model, data.to(device), list(clients), {c: list(m) for c, m in graph.items()},
                      torch.device(device))
    driver = MessageDriver(clients_of(ctx), experiment, transport, workers=workers)
    driver.setup()
    return driver


def server_driver(cfg: ExperimentConfig, experiment: str, data: FederatedData, transport: Transport,
                  device: str = "cpu") -> MessageDriver | None:
    """The central role's driver, for an algorithm that has one."""
    model = build_model(cfg.model.kind, data.input_shape, cfg.model.hidden, data.num_classes, device)
    server = server_of(HostContext(cfg, model, None, [SERVER], {}, torch.device(device)))
    if server is None:
        return None
    driver = MessageDriver(server, experiment, transport)
    driver.setup()
    return driver


@dataclass
class LockstepRun:
    drivers: list[MessageDriver]
    server: MessageDriver | None

    @property
    def everyone(self) -> list[MessageDriver]:
        return self.drivers if self.server is None else [*self.drivers, self.server]


def lockstep_round(run: LockstepRun, t: int, timeout: float = 5.0) -> None:
    everyone = run.everyone
    for d in everyone:
        d.begin_round(t)
    for index in range(len(everyone[0].exchanges)):
        for d in everyone:
            d.start_exchange(index)
        for d in everyone:
            if not d.collect(timeout):
                raise RuntimeError(f"round {t}: {d.ids} missed messages of exchange {index} in lockstep mode")
        for d in everyone:
            d.end_exchange()
    for d in everyone:
        d.end_round()


def run_lockstep(
    cfg: ExperimentConfig,
    data: FederatedData,
    graph: Graph,
    transport_factory: Callable[[], Transport],
    hosts: int = 2,
    experiment: str = "lockstep",
    device: str = "cpu",
) -> LockstepRun:
    """Run `cfg` with its clients split over `hosts` drivers (client c on driver c % hosts), in lockstep."""
    n = data.num_clients
    groups = [list(range(h, n, hosts)) for h in range(hosts)]
    drivers = [client_driver(cfg, experiment, g, data.subset(g), graph, transport_factory(), device) for g in groups]
    run = LockstepRun(drivers, server_driver(cfg, experiment, data, transport_factory(), device))
    for t in range(RoundSchedule(cfg).total_rounds):
        lockstep_round(run, t)
    return run
