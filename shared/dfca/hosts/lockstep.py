"""Every algorithm's hosts in one thread, in phases (all train, [the IFCA server averages,] all merge).

For tests and benchmarks on the in-memory transport: with synchronous delivery the result must equal
the simulator's (`dfca.host.run_hosts_lockstep` is DFCA's original; this one covers every algorithm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dfca.config import ExperimentConfig
from dfca.data import FederatedData
from dfca.host import ClientHost, lockstep_round
from dfca.hosts import build_host
from dfca.hosts.base import Graph
from dfca.hosts.ifca_server import IFCAServer
from dfca.transport import Transport


@dataclass
class LockstepRun:
    hosts: list[ClientHost]
    server: IFCAServer | None


def run_lockstep(
    cfg: ExperimentConfig,
    data: FederatedData,
    graph: Graph,
    transport_factory: Callable[[], Transport],
    hosts: int = 2,
    experiment: str = "lockstep",
) -> LockstepRun:
    n = data.num_clients
    groups = [list(range(h, n, hosts)) for h in range(hosts)]
    built = [build_host(cfg, experiment, g, data.subset(g), graph, transport_factory()) for g in groups]
    server = None
    if cfg.algorithm == "ifca":
        server = IFCAServer(cfg, experiment, transport_factory(), built[0].model)
        server.setup()
    for h in built:
        h.setup()
    for t in range(cfg.total_rounds):
        if server is None:
            lockstep_round(built, t)
            continue
        for h in built:
            h.local_step(t)
        if not server.collect():
            raise RuntimeError(f"round {t}: the IFCA server stopped")
        server.close_round()
        for h in built:
            if not h.collect(timeout=5.0):
                raise RuntimeError(f"round {t}: host missed models in lockstep mode")
        for h in built:
            h.finish_round()
    return LockstepRun(built, server)
