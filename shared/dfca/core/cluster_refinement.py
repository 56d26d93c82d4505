"""FedCRef's pure steps (Nardi, Valerio and Passarella): cluster association (eq. 2), communities (eq. 3), local
cluster refinement (Algorithm 2) and the clustering accuracy (eq. 4). No config, no messages: tensors in, out.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dfca.core.label_matching import matched_agreement


def reconstructs(own: Tensor, theirs: Tensor, mask: Tensor, alpha: float, theta: float,
                 scale: str = "relative") -> Tensor:
    """One direction of eq. (2): Pr{ Normalize_[0,1] |E_iq->iq - E_jp->iq| <= theta } >= alpha.

    own [..., n]: each sample's error under its own cluster's model; theirs [..., n]: under the other model;
    mask [..., n]: the samples of the cluster; alpha in [0, 1]. `scale` says what normalises each absolute
    difference: "relative", the sample's own error (the other model's error is within theta of the own one);
    "differences", their own min-max range over the cluster's samples (eq. 2 as printed); "errors", the min-max
    range of both error vectors together. Over a zero normaliser, a zero difference counts as 0 and any other as
    infinite; a cluster with no sample is not reconstructed. Returns a bool tensor of the leading shape.
    """
    own, theirs, mask = torch.broadcast_tensors(own, theirs, mask)
    diff = (own - theirs).abs()
    big = torch.finfo(diff.dtype).max

    def lowest(v: Tensor) -> Tensor:
        return torch.where(mask, v, big).amin(-1, keepdim=True)

    def highest(v: Tensor) -> Tensor:
        return torch.where(mask, v, -big).amax(-1, keepdim=True)

    if scale == "relative":
        low, span = torch.zeros_like(diff), own
    elif scale == "differences":
        low, span = lowest(diff), highest(diff) - lowest(diff)
    else:
        low = torch.zeros_like(diff[..., :1])
        span = torch.maximum(highest(own), highest(theirs)) - torch.minimum(lowest(own), lowest(theirs))
    excess = diff - low
    norm = torch.where(span > 0, excess / span.clamp(min=torch.finfo(diff.dtype).tiny),
                       torch.where(excess > 0, torch.full_like(diff, float("inf")), torch.zeros_like(diff)))
    count = mask.sum(-1)
    below = ((norm <= theta) & mask).sum(-1)
    return (count > 0) & (below >= alpha * count)


def communities(nodes: int, edges: np.ndarray) -> np.ndarray:
    """Eq. (3): [nodes] community ids of the association graph Gamma (edges [E, 2] of node indices): the connected
    components with at least two clusters, numbered 0.. in the order of their smallest node; -1 for an isolated
    cluster (the set I)."""
    if nodes == 0:
        return np.zeros(0, dtype=np.int64)
    e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    component = _components(nodes, e[:, 0], e[:, 1])
    sizes = np.bincount(component)
    out = np.full(nodes, -1, dtype=np.int64)
    next_id: dict[int, int] = {}
    for node in range(nodes):
        c = int(component[node])
        if sizes[c] >= 2:
            out[node] = next_id.setdefault(c, len(next_id))
    return out


def _components(nodes: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[nodes] connected-component ids of the undirected graph with edges (a[i], b[i])."""
    from scipy.sparse import coo_matrix  # when used: slow to import
    from scipy.sparse.csgraph import connected_components

    graph = coo_matrix((np.ones(len(a)), (a, b)), shape=(nodes, nodes))
    return connected_components(graph, directed=False)[1]


def merged_communities(node_of: np.ndarray, votes: np.ndarray, share: float = 0.5) -> np.ndarray:
    """Communities whose federated models reconstruct each other's clusters, joined (our addition to eq. 3).

    node_of [nodes]: each cluster's community (-1: isolated); votes [nodes, G] bool: votes[v, b] says the model of
    community b reconstructs cluster v (eq. 2, against the model of v's own community). Communities a and b are
    linked when at least `share` of a's clusters vote for b and at least `share` of b's vote for a; the linked
    components become one community each. Returns [G] the new id of each community, numbered 0.. in the order of
    their smallest cluster (as eq. 3's communities are).
    """
    groups = int(node_of.max()) + 1 if node_of.size else 0
    if groups == 0:
        return np.zeros(0, dtype=np.int64)
    member = node_of >= 0
    tally = np.zeros((groups, groups))
    np.add.at(tally, node_of[member], np.asarray(votes, dtype=float)[member, :groups])
    sizes = np.bincount(node_of[member], minlength=groups).astype(float)
    backs = tally >= share * np.maximum(sizes, 1.0)[:, None]
    linked = backs & backs.T
    np.fill_diagonal(linked, False)
    a, b = np.nonzero(linked)
    component = _components(groups, a, b)
    renumber: dict[int, int] = {}
    return np.array([renumber.setdefault(int(c), len(renumber)) for c in component], dtype=np.int64)


def refine(errors: Tensor, clusters: int) -> tuple[Tensor, Tensor]:
    """Algorithm 2 on one client: errors [models, n] of every available model (its K_i local ones, then the
    community models) on each of its samples -> (labels [n] in 0..clusters-1, selected [clusters]: the model that
    defines each new cluster).

    For p = 1..K_i: every unassigned sample's best model among those not yet selected (line 7); the model that is
    best for most of them (line 8, the lowest index on a tie) takes them as cluster p (line 9) and leaves M (line
    11). Samples still unassigned go to their best selected model (line 15).
    """
    models, n = errors.shape
    labels = torch.full((n,), -1, dtype=torch.long, device=errors.device)
    available = torch.ones(models, dtype=torch.bool, device=errors.device)
    selected = torch.zeros(clusters, dtype=torch.long, device=errors.device)
    inf = torch.tensor(float("inf"), device=errors.device, dtype=errors.dtype)
    for p in range(min(clusters, models)):
        free = labels < 0
        best = torch.where(available.unsqueeze(1), errors, inf).argmin(0)  # [n]
        votes = torch.bincount(best[free], minlength=models).masked_fill(~available, -1)
        chosen = int(votes.argmax())
        labels[free & (best == chosen)] = p
        selected[p] = chosen
        available[chosen] = False
    taken = min(clusters, models)
    rest = labels < 0
    if bool(rest.any()):
        labels[rest] = errors[selected[:taken]][:, rest].argmin(0)
    return labels, selected


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Eq. (4): ACC(a, b), the share of samples whose labels agree under the best one-to-one relabelling (Hungarian)."""
    return matched_agreement(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


def dirty_labels(categories: np.ndarray, dirtiness: float, rng: np.random.Generator) -> np.ndarray:
    """The simulated initial clustering (the paper's "dirty uniform clustering"): sample k of true category
    categories[k] starts in its category's cluster (categories ranked 0..K_i-1), or with probability `dirtiness` in
    one of the K_i - 1 other clusters, uniformly."""
    _, labels = np.unique(categories, return_inverse=True)
    k = int(labels.max()) + 1 if labels.size else 1
    if k < 2:
        return labels
    moved = rng.random(labels.size) < dirtiness
    shift = rng.integers(1, k, size=labels.size)
    return np.where(moved, (labels + shift) % k, labels)
