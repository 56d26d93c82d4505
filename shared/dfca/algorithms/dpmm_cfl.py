"""DPMM-CFL (the paper's Algorithm 1): clustered FL with an unknown number of clusters.

Clients are `server_clustering.ClusteredClients` (train Omega_{c_i}, upload omega_i, take c_i^t and
Omega_{c_i}^t). The server, each round after the uploads:

    line 8:   c^t ~ p(c | omega_{1:M}^t, alpha, G0)      split-merge MCMC (core.dpmm) over the clients'
                                                         representations (the final layer by default)
    line 9:   K_t = the number of distinct clusters in c^t (relabelled 0..K_t-1 by first member)
    line 13:  Omega_k^t = sum_{i: c_i = k} n_i / N_k omega_i^t                     eq. (3)

What the paper leaves open, each a `dpmm:` option (defaults in brackets):
- the likelihood covariance Sigma = s I [pooled: s is, every round, the pooled within-cluster variance per
  dimension of the representations under the chain's starting assignments (last round's; in round 1 everyone
  is in one cluster, so s is the total variance and only clear splits are taken)]. `nearest` (the median
  squared distance from a client to its nearest other client, / 2d) over-splits: a client's nearest neighbour
  is closer than a typical member of its cluster (K = 4-5 for 3 groups, in 3 of 3 seeds we tried). A fixed s
  is the third choice: K grows as s shrinks.
- sweeps per round [3], each `proposals` split-merge proposals [20] (Jain-Neal, t = `launch_scans` [5]
  restricted Gibbs scans to the launch state) then `gibbs_scans` [1] collapsed Gibbs scans; `sampler: gibbs`
  drops the split-merge proposals, for comparison;
- the chain restarts from last round's assignments [previous], or from one cluster every round;
- cluster averages weighted by samples as eq. (3) [samples], or uniformly as Algorithm 1's line 13 prints;
- a cluster that opens this round starts from its members' average [members] (what eq. 3 gives: its members
  trained this round), from the model its members came from [parent], or from a fresh random model [random].
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Literal

import torch
from pydantic import Field

from dfca.algorithms.base import HostContext
from dfca.algorithms.server_clustering import ClusteredClients, ClusteringServer, generator_for
from dfca.core.dpmm import DPMMSampler, NormalNormal, canonical, nearest_neighbour_variance, pooled_variance
from dfca.models.batched import Params
from dfca.sections import Strict


# -- the config section `dpmm:` ----------------------------------------------------------------------------------
class DPMMConfig(Strict):
    """DPMM-CFL (Sec. 2-3 of the paper; see algorithms.dpmm_cfl for what the paper leaves open)."""

    alpha: float = Field(1.0, gt=0.0, le=1e6, description="DP concentration: how readily new clusters open")
    sigma0: float = Field(1.0, gt=0.0, le=1e6, description="G0 = N(0, sigma0^2 I), the base measure")
    likelihood_var: Annotated[float, Field(gt=0.0, le=1e12)] | Literal["nearest", "pooled"] = Field(
        "pooled", description="s in Sigma = s I, the likelihood covariance (it drives the inferred K), or a rule "
        "that sets it every round: pooled, the within-cluster variance per dimension under the chain's starting "
        "assignments; nearest, the median squared distance from a client to its nearest other client / 2d",
    )
    sampler: Literal["split_merge", "gibbs"] = Field(
        "split_merge", description="split_merge: Jain-Neal restricted Gibbs split-merge plus Gibbs scans; gibbs: "
        "collapsed Gibbs scans only (for comparison)",
    )
    sweeps: int = Field(3, ge=1, le=10_000, description="sampler sweeps per round")
    proposals: int = Field(20, ge=0, le=100_000, description="split-merge proposals per sweep")
    gibbs_scans: int = Field(1, ge=0, le=1000, description="collapsed Gibbs scans per sweep")
    launch_scans: int = Field(5, ge=0, le=1000, description="t: restricted Gibbs scans that build a launch state")
    restart: Literal["previous", "one_cluster"] = Field(
        "previous", description="the chain starts from last round's assignments, or from one cluster every round"
    )
    weighting: Literal["samples", "uniform"] = Field(
        "samples", description="cluster model: eq. (3), weights n_i / N_k; or Algorithm 1's 1 / m_k"
    )
    new_cluster: Literal["members", "parent", "random"] = Field(
        "members", description="a cluster that opens this round starts from the average of its members' models "
        "(eq. 3), from the model its members came from, or from a fresh random model",
    )
    representation: Literal["last_layer", "all"] = Field(
        "last_layer", description="what the sampler clusters: the final layer's weights and bias (the paper), or "
        "every parameter",
    )


class DPMMServer(ClusteringServer):
    """DPMM-CFL's server: sample the partition, then average within clusters."""

    def __init__(self, ctx: HostContext) -> None:
        super().__init__(ctx)
        self.options = ctx.cfg.dpmm

    def cluster(self, t: int) -> None:
        o = self.options
        x = self.representation(o.representation).cpu().numpy()
        previous = self.assignment.tolist()
        labels = previous if o.restart == "previous" else [0] * len(previous)
        if o.likelihood_var == "nearest":
            s = nearest_neighbour_variance(x)
        elif o.likelihood_var == "pooled":
            s = pooled_variance(x, labels)
        else:
            s = float(o.likelihood_var)
        sampler = DPMMSampler(x, o.alpha, NormalNormal(s, o.sigma0**2), generator_for(self.ctx.cfg.seed, t, 1),
                              o.launch_scans)
        for _ in range(o.sweeps):
            if o.sampler == "split_merge":
                for _ in range(o.proposals):
                    labels = sampler.split_merge(labels)
            for _ in range(o.gibbs_scans):
                labels = sampler.gibbs_scan(labels)
        labels = canonical(labels)
        assignment = torch.tensor(labels, dtype=torch.long, device=self.ctx.device)
        clusters = max(labels) + 1
        models = self.average(assignment, clusters, o.weighting)
        if o.new_cluster != "members":
            self.start_new_clusters(models, assignment, previous, t)
        self.assignment, self.models = assignment, models
        st = sampler.stats
        self.chain = torch.tensor([st.splits_proposed, st.splits_accepted, st.merges_proposed, st.merges_accepted],
                                  dtype=torch.float32, device=self.ctx.device)

    def start_new_clusters(self, models: Params, assignment: torch.Tensor, previous: list[int], t: int) -> None:
        """A cluster is new when the old cluster most of its members came from went to a larger new cluster
        first; it starts from that old cluster's model (parent) or a fresh random one (random)."""
        labels = assignment.tolist()
        sizes = Counter(labels)
        claimed: set[int] = set()
        for k in sorted(sizes, key=lambda k: (-sizes[k], k)):
            parent = Counter(previous[i] for i, c in enumerate(labels) if c == k).most_common(1)[0][0]
            if parent not in claimed:
                claimed.add(parent)
                continue
            if self.options.new_cluster == "parent":
                start = {n: v[parent] for n, v in self.models.items()}
            else:
                fresh = self.ctx.model.init(1, torch.Generator().manual_seed(self.ctx.cfg.seed * 7_919 + t * 31 + k))
                start = {n: v[0].to(self.ctx.device) for n, v in fresh.items()}
            for n in models:
                models[n][k] = start[n]



class DPMMClients(ClusteredClients):
    """DPMM-CFL's clients: ClusteredClients, their server DPMMServer; the sampler infers K."""

    title = "DPMM-CFL"
    central_role = DPMMServer
    section, Section = "dpmm", DPMMConfig
    infers_clusters = True
