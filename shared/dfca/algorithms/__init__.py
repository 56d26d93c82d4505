"""The algorithms, by config name: each one file, run unchanged by the simulator and the message driver.

Adding one: write `algorithms/<name>.py` against `algorithms.base.Algorithm` (and a central role, if it
has one, against the same interface), then register it here and in `config.ALGORITHMS`.
"""

from __future__ import annotations

from dfca.algorithms.base import Algorithm, Evaluation, Exchange, HostContext, Inbox, Outbox
from dfca.algorithms.dfca import DFCA
from dfca.algorithms.dfedavgm import DFedAvgM, LocalOnly
from dfca.algorithms.dpmm_cfl import DPMMServer
from dfca.algorithms.fedcref import FedCRef
from dfca.algorithms.fedkmeans import DistKMeans, FedKMeans
from dfca.algorithms.fedspd import FedSPD
from dfca.algorithms.fesem import FeSEMServer
from dfca.algorithms.ifca import IFCA, IFCAServer
from dfca.algorithms.server_clustering import ClusteredClients

CLIENTS: dict[str, type[Algorithm]] = {
    "dfca": DFCA,
    "ifca": IFCA,
    "dfedavgm": DFedAvgM,
    "fedspd": FedSPD,
    "local": LocalOnly,
    "fedkmeans": FedKMeans,
    "distkmeans": DistKMeans,
    "dpmm_cfl": ClusteredClients,
    "fesem": ClusteredClients,
    "fedcref": FedCRef,
}
# central roles (the aggregator runs them)
SERVERS: dict[str, type[Algorithm]] = {"ifca": IFCAServer, "dpmm_cfl": DPMMServer, "fesem": FeSEMServer}


def clients_of(ctx: HostContext) -> Algorithm:
    """The algorithm of `ctx.cfg.algorithm` for the clients `ctx.clients`."""
    name = ctx.cfg.algorithm
    if name not in CLIENTS:
        raise ValueError(f"algorithm: {name!r} is not implemented yet (available: {sorted(CLIENTS)})")
    return CLIENTS[name](ctx)


def server_of(ctx: HostContext) -> Algorithm | None:
    """The central role of `ctx.cfg.algorithm`, or None for a serverless one."""
    role = SERVERS.get(ctx.cfg.algorithm)
    return role(ctx) if role is not None else None


__all__ = ["CLIENTS", "SERVERS", "Algorithm", "Evaluation", "Exchange", "HostContext", "Inbox", "Outbox",
           "clients_of", "server_of"]
