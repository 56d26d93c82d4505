"""FeSEM (Long et al. 2023, "Multi-center federated learning"), DPMM-CFL's baseline: k fixed centres.

Clients are `server_clustering.ClusteredClients`. Every client starts from one seeded model (as DPMM-CFL's
K_0 = 1). The server, after the uploads, runs `fesem.iterations` passes of

    E-step:  c_i = argmin_k || r(omega_i) - r(Omega_k) ||_2     r: the final layer (`representation`) or all
    M-step:  Omega_k = sum_{i: c_i = k} n_i / N_k omega_i       (a centre without members keeps its model)

stopping early when no assignment changes. In the first round the k centres are picked farthest-first among
the uploads (the first uniformly from the seed), since all k would otherwise be the one starting model.
With k = 1 every client is in the one cluster and the M-step is FedAvg.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dfca.algorithms.base import HostContext
from dfca.algorithms.server_clustering import ClusteredClients, ClusteringServer, generator_for, representation
from dfca.sections import Strict


# -- the config section `fesem:` ---------------------------------------------------------------------------------
class FeSEMConfig(Strict):
    """FeSEM (Long et al. 2023): k centres in parameter space, nearest-centre assignment, weighted averages."""

    representation: Literal["last_layer", "all"] = Field(
        "last_layer", description="the L2 distance over the final layer (as DPMM-CFL clusters) or every parameter"
    )
    iterations: int = Field(10, ge=1, le=10_000, description="E/M passes per round (stops early when stable)")


class FeSEMServer(ClusteringServer):
    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        self.clusters = ctx.cfg.clusters

    def first_centres(self, r: torch.Tensor, t: int) -> torch.Tensor:
        """[k] client indices: farthest-first from a seeded first pick."""
        first = int(generator_for(self.ctx.cfg.seed, t, 2).integers(r.shape[0]))
        chosen = [first]
        nearest = (r - r[first]).square().sum(1)
        for _ in range(1, self.clusters):
            nxt = int(nearest.argmax())
            chosen.append(nxt)
            nearest = torch.minimum(nearest, (r - r[nxt]).square().sum(1))
        return torch.tensor(chosen, device=r.device)

    def cluster(self, t: int) -> None:
        o = self.ctx.cfg.fesem
        r = self.representation(o.representation)
        k = self.clusters
        if next(iter(self.models.values())).shape[0] < k:  # the first round: k centres from the uploads
            models = {n: v[self.first_centres(r, t)].clone() for n, v in self.uploads.items()}
        else:
            models = {n: v.clone() for n, v in self.models.items()}
        assignment = None
        for _ in range(o.iterations):
            centres = representation(self.ctx.model, models, o.representation)
            new = torch.cdist(r, centres).argmin(1)
            if assignment is not None and torch.equal(new, assignment):
                break
            assignment = new
            averaged = self.average(assignment, k)
            empty = torch.bincount(assignment, minlength=k) == 0
            for n in models:
                models[n] = torch.where(empty.view(-1, *([1] * (models[n].dim() - 1))), models[n], averaged[n])
        assert assignment is not None
        self.assignment, self.models = assignment, models


class FeSEMClients(ClusteredClients):
    """FeSEM's clients: ClusteredClients, their server FeSEMServer."""

    title = "FeSEM"
    central_role = FeSEMServer
    section, Section = "fesem", FeSEMConfig
    client_per_cluster = True
