"""The lockstep driver: several message drivers (and a central role's) in one thread, exchange by exchange.

Every driver begins the round; for each exchange all of them publish, then all collect, then all close it;
then every driver ends the round. With synchronous delivery the result must equal the simulator's (the tests
prove it for every algorithm); harness.forged_lockstep runs a compromised host among honest ones this way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dfca.algorithms import HostContext, clients_of, schedule_of, server_of
from dfca.algorithms.base import SERVER
from dfca.config import ExperimentConfig
from dfca.data import FederatedData
from dfca.models.build import model_from_config
from dfca.runtime.driver.message_driver import MessageDriver
from dfca.transport import Transport

Graph = Mapping[int, Sequence[int]]


def client_driver(cfg: ExperimentConfig, experiment: str, clients: Sequence[int], data: FederatedData, graph: Graph,
                  transport: Transport, device: str = "cpu", workers: int = 1,
                  queue: str | None = None) -> MessageDriver:
    """A driver of `clients` (data: their shards) over `transport`, its queue set up; `workers`: client c is
    hosted by worker c % workers (its routing keys and queue name say so); `queue`: a name of its own where the
    drivers do not split the clients that way (by default, its worker's queue)."""
    model = model_from_config(cfg.model, data.input_shape, data.num_classes, device)
    ctx = HostContext(cfg, model, data.to(device), list(clients), {c: list(m) for c, m in graph.items()},
                      torch.device(device))
    driver = MessageDriver(clients_of(ctx), experiment, transport, workers=workers, queue=queue)
    driver.setup()
    return driver


def server_driver(cfg: ExperimentConfig, experiment: str, data: FederatedData, transport: Transport,
                  device: str = "cpu", workers: int = 1) -> MessageDriver | None:
    """The central role's driver, for an algorithm that has one (`workers`: as the clients' drivers have it)."""
    model = model_from_config(cfg.model, data.input_shape, data.num_classes, device)
    server = server_of(HostContext(cfg, model, None, [SERVER], {}, torch.device(device)))
    if server is None:
        return None
    driver = MessageDriver(server, experiment, transport, workers=workers)
    driver.setup()
    return driver


@dataclass
class LockstepRun:
    drivers: list[MessageDriver]
    server: MessageDriver | None

    @property
    def everyone(self) -> list[MessageDriver]:
        return self.drivers if self.server is None else [*self.drivers, self.server]


def lockstep_round(run: LockstepRun, t: int, timeout: float = 5.0, strict: bool = True) -> None:
    """Round t on every driver. `strict`: a message missing when an exchange closes is an error (it cannot be, with
    honest hosts); else the exchange closes after `timeout` as on the runtime (a host's messages were refused)."""
    everyone = run.everyone
    for d in everyone:
        d.begin_round(t)
    for index in range(len(everyone[0].exchanges)):
        for d in everyone:
            d.start_exchange(index)
        for d in everyone:
            if not d.collect(timeout) and strict:
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
    drivers = [client_driver(cfg, experiment, g, data.subset(g), graph, transport_factory(), device, workers=hosts)
               for g in groups]
    run = LockstepRun(drivers, server_driver(cfg, experiment, data, transport_factory(), device, hosts))
    for t in range(schedule_of(cfg).total_rounds):
        lockstep_round(run, t)
    return run
