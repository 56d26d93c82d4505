"""Comparing two labelings of the same items: the best one-to-one matching of their classes (the Hungarian method)
and the adjusted Rand index. Every clustering metric of a run uses them (its ARI and matched accuracy each round,
FedCRef's ACC of eq. 4, the soft assignment's mixture error), so they are written here in numpy instead of
importing scipy.optimize (0.6 s) and scikit-learn (2.2 s) for two small functions: that import was a run's first
round's seconds (2.6 s of the demo's 9.7 s here) and a metrics service's first report. Both are pinned to scipy's
and scikit-learn's results in tests/test_label_matching.py.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def min_cost_matching(cost: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols): a one-to-one matching of the rows and columns of cost [n, m] with the least total cost,
    min(n, m) pairs, rows ascending, as scipy.optimize.linear_sum_assignment returns them (the same least total;
    where several matchings tie, it may pick another). The shortest augmenting path form of the Hungarian method:
    each row in turn joins the matching along the cheapest path of reduced costs c_ij - u_i - v_j, O(n^2 m)."""
    c = np.asarray(cost, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"cost must be a matrix, got shape {c.shape}")
    if not np.isfinite(c).all():
        raise ValueError("cost holds a non-finite entry")
    transposed = c.shape[0] > c.shape[1]
    a = c.T if transposed else c  # n <= m: every row is matched
    n, m = a.shape
    u = np.zeros(n + 1)  # row potentials; index 0 and column 0 are the path's virtual start
    v = np.zeros(m + 1)  # column potentials
    owner = np.zeros(m + 1, dtype=np.int64)  # owner[j]: the row (1-based) matched to column j, 0 if none
    for i in range(1, n + 1):
        owner[0] = i
        came_from = np.zeros(m + 1, dtype=np.int64)  # the column before j on the cheapest path to it
        slack = np.full(m + 1, np.inf)  # the cheapest reduced cost reaching each column so far
        used = np.zeros(m + 1, dtype=bool)
        j0 = 0
        while owner[j0] != 0:
            used[j0] = True
            i0 = owner[j0]
            free = ~used
            reduced = np.empty(m + 1)
            reduced[0] = np.inf
            reduced[1:] = a[i0 - 1] - u[i0] - v[1:]
            better = free & (reduced < slack)
            slack[better] = reduced[better]
            came_from[better] = j0
            candidates = np.where(free, slack, np.inf)
            j1 = int(np.argmin(candidates))
            delta = candidates[j1]
            taken = np.nonzero(used)[0]
            u[owner[taken]] += delta
            v[taken] -= delta
            slack[free] -= delta
            j0 = j1
        while j0 != 0:  # flip the path: each column on it takes the row before it
            j1 = came_from[j0]
            owner[j0] = owner[j1]
            j0 = j1
    cols = np.nonzero(owner[1:])[0]
    rows = owner[1:][cols] - 1
    if transposed:
        rows, cols = cols, rows
    order = np.argsort(rows, kind="stable")
    return rows[order].astype(np.int64), cols[order].astype(np.int64)


def contingency(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """counts[x, y]: how many items a labels with its x-th class and b with its y-th (classes in sorted order)."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    if a.shape != b.shape:
        raise ValueError(f"the labelings differ in length: {a.size} and {b.size}")
    if a.size == 0:
        return np.zeros((0, 0), dtype=np.int64)
    _, ai = np.unique(a, return_inverse=True)
    _, bi = np.unique(b, return_inverse=True)
    counts = np.zeros((ai.max() + 1, bi.max() + 1), dtype=np.int64)
    np.add.at(counts, (ai.ravel(), bi.ravel()), 1)
    return counts


def matched_agreement(a: ArrayLike, b: ArrayLike) -> float:
    """The share of items whose labels agree under the best one-to-one relabelling of a's classes onto b's
    (1.0 for no items)."""
    counts = contingency(a, b)
    if counts.size == 0:
        return 1.0
    rows, cols = min_cost_matching(-counts)
    return float(counts[rows, cols].sum() / counts.sum())


def label_matching(a: ArrayLike, b: ArrayLike) -> dict[int, int]:
    """a's class -> the b class it is matched to under the best one-to-one relabelling (the one `matched_agreement`
    scores); a's classes left over when a has more classes than b are not in it."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    counts = contingency(a, b)
    if counts.size == 0:
        return {}
    rows, cols = min_cost_matching(-counts)
    a_classes, b_classes = np.unique(a), np.unique(b)
    return {int(a_classes[r]): int(b_classes[c]) for r, c in zip(rows, cols, strict=True)}


def adjusted_rand_index(truth: ArrayLike, predicted: ArrayLike) -> float:
    """The adjusted Rand index (Hubert and Arabie 1985) from the pair confusion matrix, in exact integers, as
    sklearn.metrics.adjusted_rand_score computes it: 1.0 where the two agree on every pair (one class each
    included), 0 in expectation for independent labelings."""
    counts = contingency(truth, predicted)
    n = int(counts.sum())
    same_both = int((counts.astype(object) ** 2).sum())  # sum_xy n_xy^2 (Python integers: no overflow)
    same_truth = int((counts.sum(1).astype(object) ** 2).sum())
    same_predicted = int((counts.sum(0).astype(object) ** 2).sum())
    tp = same_both - n  # ordered pairs of distinct items together in both
    fp = same_predicted - same_both  # together in the prediction only
    fn = same_truth - same_both  # together in the truth only
    tn = n * n - fp - fn - same_both
    if fn == 0 and fp == 0:
        return 1.0
    return 2.0 * (tp * tn - fn * fp) / ((tp + fn) * (fn + tn) + (tp + fp) * (fp + tn))
