"""The algorithms, by config name: each one file, run unchanged by the simulator and the message driver.

Adding one (docs/algorithms.md): write `algorithms/<name>.py` with its clients class against
`algorithms.base.Algorithm` (its central role, config section and schedule, if it has them, in the same
file, named by the class's `central_role`, `section`/`Section` and `Schedule`), then register it below:
one line. The config schema (dfca.config), both drivers and the CLI read everything else from the class.
"""

from __future__ import annotations

from dfca.algorithms.base import (
    CLIENTS,
    Algorithm,
    Evaluation,
    Exchange,
    HostContext,
    Inbox,
    Outbox,
    algorithm_class,
    register,
    schedule_of,
    unregister,
)
from dfca.algorithms.dfca import DFCA
from dfca.algorithms.dfedavgm import DFedAvgM, LocalOnly
from dfca.algorithms.dpmm_cfl import DPMMClients
from dfca.algorithms.fedcref import FedCRef
from dfca.algorithms.fedkmeans import DistKMeans, FedKMeans
from dfca.algorithms.fedspd import FedSPD
from dfca.algorithms.fesem import FeSEMClients
from dfca.algorithms.ifca import IFCA

register("dfca", DFCA)  # the first is the config's default
register("ifca", IFCA)
register("dfedavgm", DFedAvgM)
register("fedspd", FedSPD)
register("local", LocalOnly)
register("fedkmeans", FedKMeans)
register("distkmeans", DistKMeans)
register("dpmm_cfl", DPMMClients)
register("fesem", FeSEMClients)
register("fedcref", FedCRef)


def central_roles() -> dict[str, type[Algorithm]]:
    """The central roles by algorithm name (the aggregator runs them)."""
    return {name: c.central_role for name, c in CLIENTS.items() if c.central_role is not None}


def has_central_role(name: str) -> bool:
    """Whether the algorithm `name` has a server side (the aggregator runs it); False for a name not registered."""
    return name in CLIENTS and CLIENTS[name].central_role is not None


def clients_of(ctx: HostContext) -> Algorithm:
    """The algorithm of `ctx.cfg.algorithm` for the clients `ctx.clients`."""
    return algorithm_class(ctx.cfg.algorithm)(ctx)


def server_of(ctx: HostContext) -> Algorithm | None:
    """The central role of `ctx.cfg.algorithm`, or None for a serverless one."""
    role = algorithm_class(ctx.cfg.algorithm).central_role
    return role(ctx) if role is not None else None


__all__ = ["CLIENTS", "Algorithm", "Evaluation", "Exchange", "HostContext", "Inbox", "Outbox", "algorithm_class",
           "central_roles", "clients_of", "has_central_role", "register", "schedule_of", "server_of", "unregister"]
