"""Federated k-means over networks (Yang, Rastelli and Jung): GTVMin's local update, batched over nodes.

Node i holds k centroids W_i [k, d] and its points X_i [m_i, d]; its neighbours' centroids V_i' [k, d]
arrive by message. The discrepancy between two centroid sets is eq. (4),

    d(W, V) = sum_c min_c' ||w_c - v_c'||^2 + sum_c min_c' ||v_c - w_c'||^2,

and node i's update (8) minimises  a * L_i(W) + alpha * sum_{i' in N(i)} d(W, V_i')  by alternating
    (E1) each point to its nearest centroid,
    (E2) each neighbour centroid to its nearest local centroid (min I of (8)),
    (E3) each local centroid to its nearest centroid at each neighbour (min II of (8)),
    (M)  eq. (11): w_c = [a sum_{r: c_r = c} x_r + alpha (sum_{(i',c') in U_c} v_i'c' + sum_{i'} v_{i', b_i'c})]
                         / [a |{r: c_r = c}| + alpha (|U_c| + d_i)],
until the objective falls by less than `tol` (relatively) or after `passes` passes. `a` is the weight of a
data point: 1 makes (8) the node's part of (7) with L_i of (6) (and, at alpha = 1 without (E3), exactly
k-means on the augmented dataset (9)); 1 / m_i is the normalisation (8) and (11) print (algorithms.fedkmeans
says which the config picks). (11) divides by max(., 1); read literally that pulls every centroid whose
weights sum below 1 towards the origin (at alpha = 0 always, where the update must be plain k-means), so we
read it as a guard: a centroid with nothing assigned (no point, no matched neighbour centroid) keeps its place.

Rows are nodes; a node's neighbours are padded to the largest degree D with `mask` [M, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def squared_distances(a: Tensor, b: Tensor) -> Tensor:
    """[..., p, d], [..., q, d] -> [..., p, q] squared Euclidean distances."""
    return (a.unsqueeze(-2) - b.unsqueeze(-3)).pow(2).sum(-1)


def set_distance(w: Tensor, v: Tensor) -> Tensor:
    """Eq. (4) between centroid sets [..., k, d] and [..., k', d] -> [...]."""
    dist = squared_distances(w, v)
    return dist.min(-1).values.sum(-1) + dist.min(-2).values.sum(-1)


def kmeans_plus_plus(points: Tensor, k: int, seed: int) -> Tensor:
    """k-means++ seeding of one node's points [m, d] -> [k, d]: scikit-learn's greedy variant (each step keeps the
    best of 2 + log k candidates), on the CPU from `seed`, so every driver and device draws the same."""
    from sklearn.cluster import kmeans_plusplus  # when used: slow to import

    m = points.shape[0]
    if k > m:
        raise ValueError(f"k-means++ needs at least k={k} points, the node has {m}")
    centres, _ = kmeans_plusplus(points.detach().cpu().double().numpy(), k, random_state=seed % 2**31)
    return torch.from_numpy(centres).to(points.device, points.dtype)


@dataclass
class Neighbours:
    """Each node's neighbours' centroids, padded: centroids [M, D, k, d], mask [M, D] (True: a real neighbour)."""

    centroids: Tensor
    mask: Tensor

    @property
    def degree(self) -> Tensor:
        return self.mask.sum(1).to(self.centroids.dtype)


def node_objective(points: Tensor, w: Tensor, near: Neighbours, alpha: float, point_weight: Tensor,
                   with_e3: bool = True) -> Tensor:
    """(8) at every node: a * L_i(W_i) + alpha * sum over neighbours of d(W_i, V_i') (component II only with E3). [M]"""
    nearest = squared_distances(points, w).min(-1).values
    data = nearest.sum(-1) * point_weight if point_weight.dim() == 1 else (nearest * point_weight).sum(-1)
    if alpha == 0 or near.centroids.shape[1] == 0:
        return data
    dist = squared_distances(near.centroids, w.unsqueeze(1))  # [M, D, k' (neighbour), k (local)]
    coupling = dist.min(-1).values.sum(-1)  # I: each neighbour centroid to its nearest local one
    if with_e3:
        coupling = coupling + dist.min(-2).values.sum(-1)  # II: each local centroid to its nearest at i'
    return data + alpha * (coupling * near.mask).sum(1)


def gtv_update(points: Tensor, w: Tensor, near: Neighbours, alpha: float, point_weight: Tensor,
               with_e3: bool = True, passes: int = 20, tol: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Node update (8) by (E1)-(E3) and (M), eq. (11), from centroids w [M, k, d]. Returns (w, objective [M]).

    points [M, m, d]; point_weight [M]: a, the weight of one point (1, or 1 / m_i); or [M, m], each point's
    (0 for a padding row of a node with fewer than m points).
    """
    M, k, _ = w.shape
    objective = node_objective(points, w, near, alpha, point_weight, with_e3)
    for _ in range(passes):
        e1 = torch.nn.functional.one_hot(squared_distances(points, w).argmin(-1), k).to(w.dtype)  # [M, m, k]
        if point_weight.dim() == 1:
            num = point_weight.view(M, 1, 1) * e1.transpose(1, 2) @ points  # [M, k, d]
            den = point_weight.view(M, 1) * e1.sum(1)  # [M, k]
        else:
            weighted = e1 * point_weight.unsqueeze(2)
            num, den = weighted.transpose(1, 2) @ points, weighted.sum(1)
        if alpha > 0 and near.centroids.shape[1] > 0:
            dist = squared_distances(near.centroids, w.unsqueeze(1))  # [M, D, k', k]
            live = near.mask.to(w.dtype).view(M, -1, 1, 1)
            e2 = torch.nn.functional.one_hot(dist.argmin(-1), k).to(w.dtype) * live  # [M, D, k', k]: v_i'c' -> c
            num = num + alpha * torch.einsum("ajpc,ajpd->acd", e2, near.centroids)
            den = den + alpha * e2.sum((1, 2))
            if with_e3:
                e3 = torch.nn.functional.one_hot(dist.argmin(-2), k).to(w.dtype) * live.squeeze(-1).unsqueeze(-1)
                # e3 [M, D, k (local c), k' (theirs)]: b_{i',c}, the neighbour's centroid nearest to w_c
                num = num + alpha * torch.einsum("ajcp,ajpd->acd", e3, near.centroids)
                den = den + alpha * e3.sum((1, 3))
        empty = den <= 0  # nothing assigned: the centroid keeps its place (our reading of (11)'s max(., 1))
        w = torch.where(empty.unsqueeze(-1), w, num / den.clamp_min(1e-300).unsqueeze(-1))
        new_objective = node_objective(points, w, near, alpha, point_weight, with_e3)
        drop = (objective - new_objective) / objective.abs().clamp_min(1e-12)
        objective = new_objective
        if bool((drop <= tol).all()):
            break
    return w, objective


def distributed_kmeans_step(points: Tensor, m: Tensor, dual: Tensor, near: Neighbours, eta: float,
                            point_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One iteration of distributed k-means (Forero, Cano and Giannakis 2011, D-KM): consensus on centroids of the
    same index between neighbours, by the primal-dual (ADMM) method with step eta.

        v_jk(t)   = v_jk(t-1) + eta/2 sum_{j' in N_j} (m_jk(t) - m_j'k(t))
        m_jk(t+1) = [sum_{n: x_jn nearest m_jk(t)} x_jn - 2 v_jk(t) + eta sum_{j' in N_j} (m_jk(t) + m_j'k(t))]
                    / [|{n: x_jn nearest m_jk(t)}| + 2 eta |N_j|]

    m [M, k, d]: the nodes' centroids at t; dual [M, k, d]: v(t-1); point_mask [M, n]: a node's real points (the
    rest is padding). Returns (m(t+1), v(t)).
    """
    k = m.shape[1]
    live = near.mask.to(m.dtype).view(*near.mask.shape, 1, 1)
    theirs = (near.centroids * live).sum(1)  # [M, k, d]
    degree = near.degree.view(-1, 1, 1)
    dual = dual + eta / 2 * (degree * m - theirs)
    e1 = torch.nn.functional.one_hot(squared_distances(points, m).argmin(-1), k).to(m.dtype)  # [M, n, k]
    if point_mask is not None:
        e1 = e1 * point_mask.unsqueeze(2).to(m.dtype)
    num = e1.transpose(1, 2) @ points - 2 * dual + eta * (degree * m + theirs)
    den = e1.sum(1).unsqueeze(-1) + 2 * eta * degree
    new = torch.where(den > 0, num / den.clamp_min(1e-300), m)
    return new, dual
