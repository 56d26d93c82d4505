"""Clustering and consensus metrics: ARI, matched assignment accuracy, Disp_j (DFCA section 4)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from dfca.core.label_matching import adjusted_rand_index, matched_agreement
from dfca.core.params import cluster_views
from dfca.models.batched import Params


def truth_known(truth: Tensor) -> bool:
    """Whether every client's true cluster is known: a folder federation without clusters.json has -1 everywhere,
    and then no ARI or matched cluster accuracy is reported at all."""
    return truth.numel() > 0 and bool((truth >= 0).all())


def clustering_scores(assigned: Tensor, truth: Tensor, ari: str = "ari") -> dict[str, float]:
    """{ari: ARI, "cluster_acc": matched accuracy} against the true clusters, or {} where they are unknown."""
    if not truth_known(truth):
        return {}
    return {ari: cluster_ari(assigned, truth), "cluster_acc": cluster_accuracy(assigned, truth)}


def cluster_ari(assigned: Tensor, truth: Tensor) -> float:
    """The adjusted Rand index of the clients' assignment against their true clusters."""
    return adjusted_rand_index(truth.cpu().numpy(), assigned.cpu().numpy())


def cluster_accuracy(assigned: Tensor, truth: Tensor) -> float:
    """Share of clients whose assignment matches the truth under the best label matching (Hungarian)."""
    return matched_agreement(assigned.cpu().numpy(), truth.cpu().numpy())


def assignment_counts(assigned: Tensor, k: int) -> list[int]:
    return torch.bincount(assigned, minlength=k).tolist()


def populated_clusters(assigned: Tensor) -> int:
    return int(assigned.unique().numel())


SPREAD_ROWS = 8  # clients' deviations taken at once (a [8, D] scratch that stays in cache, not [N, D])
GPU_SPREAD_ROWS = 256  # on a GPU: fewer launches


@torch.no_grad()
def disagreement(params: Params) -> list[float]:
    """Disp_j = 1/N sum_i ||theta_ij - mean_i theta_ij||^2, per cluster j."""
    k = next(iter(params.values())).shape[1]
    return [float(sum(spread(v) for v in cluster_views(params, j))) for j in range(k)]


def spread(v: Tensor) -> float:
    """1/N sum_i ||v_i - mean_i v_i||^2 for v [N, ...]: the population variance over the N rows, summed over
    coordinates. One pass, SPREAD_ROWS rows at a time, over the deviations from the first row r (the shifted
    form, accurate where the rows nearly agree, 0 where they are the same): 1/N sum ||v_i - r||^2 - ||mean - r||^2.
    0.07 s a cluster for 1,000 clients of an MLP h=200 here, where `v.var(0)` took 0.56 s."""
    n = v.shape[0]
    flat = v.reshape(n, -1)
    first = flat[0].clone()
    step = SPREAD_ROWS if flat.device.type == "cpu" else GPU_SPREAD_ROWS
    scratch = torch.empty(min(n, step), flat.shape[1], dtype=flat.dtype, device=flat.device)
    shift = torch.zeros(flat.shape[1], dtype=torch.float64, device=flat.device)  # sum of v_i - r
    squares = torch.zeros((), dtype=torch.float64, device=flat.device)  # sum of ||v_i - r||^2
    for lo in range(0, n, step):
        rows = flat[lo : lo + step]
        d = torch.sub(rows, first, out=scratch[: rows.shape[0]])
        shift.add_(d.sum(0))
        squares.add_(d.square_().sum())  # torch's cascaded sum: 1e-7 relative here, where sdot erred 1e-5
    return max(0.0, float(squares) / n - float(shift.square().sum()) / n**2)


GPU_EDGE_BLOCK_BYTES = 256 << 20  # on a GPU: the edges' models gathered and compared at once, up to this much per side


ConsistencyForm = Literal["auto", "edges", "gram", "blocks"]


@torch.no_grad()
def index_consistency(params: Params, adjacency: Tensor, form: ConsistencyForm = "auto") -> float:
    """Share of graph edges (i, m) across which cluster indices mean the same thing.

    For an edge, cluster j at i is matched to the nearest cluster at m (L2 over parameters);
    the edge is consistent when that matching is the identity for every j. 1.0 means every
    neighbour pair agrees on what each index is; DFCA-LI starts near 1/k!.

    Three forms of one computation (`auto` picks; the others are for tests and benchmarks):
    - `edges`, on the CPU: edge by edge, from views of the two clients' models (no gathered copies). The
      simulator passes at most 200 sampled edges (simulator.sampled_edges); 0.10 s for them at 1,000 clients of
      an MLP h=200 here, where gathering the edges' models and every client's norms took 0.86 s.
    - `gram`, on the CPU where it costs less (`gram_is_cheaper`: small dense graphs): every pair's inner products
      from one Gram matrix of the edges' clients' models. The edge by edge form's ~60 small operations an edge
      were 57% of the runtime benchmark's 24-client simulator round and 43% of the demo's.
    - `blocks`, on a GPU, where the edge by edge loop is 60 kernel launches and a synchronisation an edge: blocks
      of edges whose gathered models take at most GPU_EDGE_BLOCK_BYTES a side, a few launches a block.
    """
    k = next(iter(params.values())).shape[1]
    if k == 1:
        return 1.0
    src, dst = torch.nonzero(torch.triu(adjacency, diagonal=1), as_tuple=True)
    if src.numel() == 0:
        return 1.0
    n = adjacency.shape[0]
    per_client = [t.view(n, k, -1) for t in params.values()]  # [N, k, D_t] views, no copy
    if form == "auto":
        form = auto_form(k, per_client, src, dst)
    if form == "gram":
        return int(gram_nearest_is_identity(per_client, src, dst).sum()) / src.numel()
    if form == "edges":
        consistent = sum(int(nearest_is_identity(per_client, i, m)) for i, m in zip(src.tolist(), dst.tolist(),
                                                                                      strict=True))
        return consistent / src.numel()
    edge_bytes = sum(v[0].numel() * v.element_size() for v in per_client)  # one client's k models
    step = max(1, GPU_EDGE_BLOCK_BYTES // edge_bytes)
    count = torch.zeros((), dtype=torch.int64, device=src.device)
    for lo in range(0, src.numel(), step):
        count += nearest_is_identity(per_client, src[lo : lo + step], dst[lo : lo + step]).sum()
    return int(count) / src.numel()


def nearest_is_identity(per_client: list[Tensor], i: int | Tensor, m: int | Tensor) -> Tensor:
    """For the edge (i, m), or the edges (i[e], m[e]): whether the nearest cluster at m (squared L2 over every
    parameter tensor, [N, k, D_t] each) of each cluster j at i is j. An int indexes views; a tensor gathers."""
    gathered = [(v[i], v[m]) for v in per_client]  # each tensor's two sides, gathered once
    dots = sum(a @ b.transpose(-1, -2) for a, b in gathered)  # [.., k, k]: <theta_ij, theta_ml>
    norms_i = sum(a.square().sum(-1) for a, _ in gathered)  # [.., k]: ||theta_ij||^2
    norms_m = sum(b.square().sum(-1) for _, b in gathered)
    return nearest_is_own(norms_i, norms_m, dots)


def nearest_is_own(norms_i: Tensor, norms_m: Tensor, dots: Tensor) -> Tensor:
    """[..] bool from ||theta_ij||^2 [.., k], ||theta_ml||^2 [.., k] and <theta_ij, theta_ml> [.., k, k]: whether
    each cluster j's nearest (squared L2) at the other side is j."""
    dist = norms_i.unsqueeze(-1) + norms_m.unsqueeze(-2) - 2 * dots  # squared L2, [.., k, k]
    return (dist.argmin(-1) == torch.arange(dist.shape[-1], device=dist.device)).all(-1)



def auto_form(k: int, per_client: list[Tensor], src: Tensor, dst: Tensor) -> ConsistencyForm:
    """The form `auto` takes for these edges: blocks on a GPU; on the CPU the Gram matrix where it is cheaper."""
    if per_client[0].device.type != "cpu":
        return "blocks"
    return "gram" if gram_is_cheaper(k, per_client, src, dst) else "edges"

EDGE_OVERHEAD_MULTIPLY_ADDS = 20e6  # what an edge's ~60 small operations cost on the CPU, in a matmul's multiply-adds


def gram_is_cheaper(k: int, per_client: list[Tensor], src: Tensor, dst: Tensor) -> bool:
    """Whether one Gram matrix of the edges' clients' models ((|U| k)^2 D multiply-adds in a few large products)
    costs less than the edges one by one (E k^2 D multiply-adds in small products, plus each edge's overhead):
    small dense graphs, as the demo's and the runtime benchmark's."""
    clients = torch.unique(torch.cat([src, dst])).numel()
    d = sum(v.shape[2] for v in per_client)
    return (clients * k) ** 2 * d <= src.numel() * (k * k * d + EDGE_OVERHEAD_MULTIPLY_ADDS)


def gram_nearest_is_identity(per_client: list[Tensor], src: Tensor, dst: Tensor) -> Tensor:
    """`nearest_is_identity` of every edge (src[e], dst[e]) at once, from the Gram matrix of the edges' clients'
    models: <theta_ij, theta_ml> for every pair, the squared norms on its diagonal."""
    clients, index = torch.unique(torch.cat([src, dst]), return_inverse=True)
    n, k = per_client[0].shape[:2]
    every = clients.numel() == n  # all clients: the [N k, D_t] views, no copy
    rows = [(v if every else v[clients]).reshape(clients.numel() * k, -1) for v in per_client]  # [|U| k, D_t]
    gram: Tensor = sum(f @ f.T for f in rows)  # type: ignore[assignment]
    norms = gram.diagonal().view(-1, k)  # [|U|, k]
    pairs = gram.view(-1, k, clients.numel(), k).permute(0, 2, 1, 3)  # [|U|, |U|, k, k]
    i, m = index[: src.numel()], index[src.numel() :]
    return nearest_is_own(norms[i], norms[m], pairs[i, m])
