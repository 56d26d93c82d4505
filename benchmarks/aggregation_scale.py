"""Aggregation at the DFCA paper's scale: the core's mixing against the dense product, same run, same inputs.

    python benchmarks/aggregation_scale.py [--clients 240] [--clusters 4] [--hidden 2048 200] [--p 0.1] [--repeat 2]

For each hidden size it times, on one ER graph and one random assignment:
- eq. 7, the paper rule's round as DFCA does it in the simulator (every client's assigned model gathered,
  grouped by cluster, then `core.aggregation.fold_models`), against the dense baseline
  theta_j <- W[j] @ flatten(theta_j) for every j (a [N, N] product over all clients' copies, on a
  flattened copy of the models);
- robust DFCA's ratio consensus over 3 gossip steps (`core.consensus.ratio_consensus`) against the
  dense P^G (m_j theta_j) / P^G m_j on flattened copies.
Both sides produce the same models (checked on every 30th client); the table prints seconds and the ratio core / dense.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import networkx as nx
import torch
from rich.console import Console
from rich.table import Table

from dfca.core import fold_models, self_weights
from dfca.core.consensus import consensus_weights, gossip_matrix, ratio_consensus
from dfca.core.params import cluster_views, flatten_cluster
from dfca.models.batched import Params
from dfca.models.mlp import MLP

PROBE = 30  # compare every 30th client's models between the two sides


def write_back(params: Params, j: int, flat: torch.Tensor) -> None:
    """The inverse of flatten_cluster: write [N, D] back into cluster j."""
    offset = 0
    for view in cluster_views(params, j):
        view.copy_(flat[:, offset : offset + view.shape[1]])
        offset += view.shape[1]


def dense_weights(adjacency: torch.Tensor, assigned: torch.Tensor, self_w: torch.Tensor) -> torch.Tensor:
    """Eq. 7 as matrices, by definition: W[j][i] = (w_ii e_i + the neighbours that sent cluster j) / their sum."""
    n, k = self_w.shape
    sent = torch.nn.functional.one_hot(assigned, k).T.float()
    W = adjacency.float().unsqueeze(0) * sent.unsqueeze(1)
    W[:, torch.arange(n), torch.arange(n)] = self_w.T
    empty = W.sum(2) == 0
    W[:, torch.arange(n), torch.arange(n)] += empty.float()
    return W / W.sum(2, keepdim=True)


def one_hop(params: Params, adjacency: torch.Tensor, assigned: torch.Tensor, self_w: torch.Tensor) -> None:
    """DFCA's paper-rule merge in the simulator: send (gather, grouped by cluster), then fold."""
    order = assigned.argsort(stable=True)
    part = assigned[order]
    sent = {name: t[order, part] for name, t in params.items()}
    fold_models(params, self_w.clone(), adjacency[:, order], part, sent)


def dense_mix(params: Params, W: torch.Tensor) -> None:
    for j in range(W.shape[0]):
        write_back(params, j, W[j] @ flatten_cluster(params, j))


def dense_consensus(params: Params, m: torch.Tensor, steps: list[torch.Tensor]) -> None:
    for j in range(m.shape[1]):
        flat = flatten_cluster(params, j)
        num, den = m[:, j : j + 1] * flat, m[:, j]
        for P in steps:
            num, den = P @ num, P @ den
        reached = den > 1e-3
        write_back(params, j, torch.where(reached.unsqueeze(1), num / den.clamp_min(1e-3).unsqueeze(1), flat))


def client_copies(model: MLP, n: int, k: int) -> Params:
    """[n, k, ...]: k shared models plus small per-client noise, as after a round of local training (seeded)."""
    g = torch.Generator().manual_seed(1)
    params = {name: t.unsqueeze(0).repeat(n, 1, *[1] * (t.dim() - 1)) for name, t in model.init(k, g).items()}
    for t in params.values():
        for client in t:  # one client at a time: a noise tensor the size of the stack would double the memory
            client.add_(torch.randn(client.shape, generator=g), alpha=0.01)
    return params


def timed(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=240)
    ap.add_argument("--clusters", type=int, default=4)
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 200])
    ap.add_argument("--p", type=float, default=0.1, help="Erdos-Renyi edge probability")
    ap.add_argument("--repeat", type=int, default=2, help="best of this many timings")
    args = ap.parse_args()
    n, k = args.clients, args.clusters
    g = torch.Generator().manual_seed(0)
    graph = nx.erdos_renyi_graph(n, args.p, seed=0)
    adjacency = torch.zeros(n, n, dtype=torch.bool)
    for a, b in graph.edges:
        adjacency[a, b] = adjacency[b, a] = True
    assigned = torch.randint(0, k, (n,), generator=g)
    self_w = self_weights(assigned, k, "paper")
    W = dense_weights(adjacency, assigned, self_w)
    m = consensus_weights(assigned, k, 0.0)
    steps = [gossip_matrix(adjacency)] * 3
    walk = steps[2] @ steps[1] @ steps[0]
    table = Table(title=f"aggregation, N={n} k={k} ER p={args.p}: seconds per round (best of {args.repeat})")
    for col in ("model", "MB per model", "operation", "dense baseline s", "core s", "core / dense", "max |diff|"):
        table.add_column(col, justify="right")
    torch.set_flush_denormal(True)
    for hidden in args.hidden:
        model = MLP(784, hidden, 10)
        mb = model.num_params() * 4 / 2**20
        for label, core, dense in (
            ("eq. 7 mixing (paper rule)", lambda p: one_hop(p, adjacency, assigned, self_w),
             lambda p: dense_mix(p, W)),
            ("ratio consensus, G=3", lambda p: ratio_consensus(p, m, walk), lambda p: dense_consensus(p, m, steps)),
        ):
            a = client_copies(model, n, k)
            dense_s = timed(lambda d=dense, a=a: d(a), args.repeat)
            probe = {name: t[::PROBE].clone() for name, t in a.items()}  # one stack at a time: 6 GB at h=2048
            del a
            b = client_copies(model, n, k)  # the same models again
            core_s = timed(lambda c=core, b=b: c(b), args.repeat)
            diff = max(float((probe[name] - t[::PROBE]).abs().max()) for name, t in b.items())
            table.add_row(f"MLP h={hidden}", f"{mb:.1f}", label, f"{dense_s:.2f}", f"{core_s:.2f}",
                          f"{core_s / dense_s:.2f}x", f"{diff:.1e}")
            del b
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
