"""The run's clustering metrics' own matching and ARI (dfca.core.label_matching) against the definitions they
replace: scipy.optimize.linear_sum_assignment's least total cost and sklearn.metrics.adjusted_rand_score."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import adjusted_rand_score

from dfca.core.label_matching import (
    adjusted_rand_index,
    contingency,
    label_matching,
    matched_agreement,
    min_cost_matching,
)


def random_costs(rng: np.random.Generator, trials: int) -> list[np.ndarray]:
    costs = []
    for trial in range(trials):
        n, m = (int(x) for x in rng.integers(1, 9, size=2))
        kind = trial % 3  # small integers (many ties), Gaussian, negated counts (a matching that maximises)
        costs.append(rng.integers(0, 5, size=(n, m)).astype(float) if kind == 0
                     else rng.normal(size=(n, m)) if kind == 1 else -rng.integers(0, 50, size=(n, m)).astype(float))
    return costs


def test_the_matching_costs_what_scipys_costs_on_square_and_rectangular_matrices() -> None:
    for cost in random_costs(np.random.default_rng(0), 600):
        rows, cols = min_cost_matching(cost)
        ref_rows, ref_cols = linear_sum_assignment(cost)
        assert len(rows) == min(cost.shape)
        assert len(set(rows.tolist())) == len(rows) and len(set(cols.tolist())) == len(cols)  # one-to-one
        assert (np.diff(rows) > 0).all()  # rows ascending, as scipy returns them
        assert cost[rows, cols].sum() == pytest.approx(cost[ref_rows, ref_cols].sum(), abs=1e-9)


def test_a_large_matching_costs_what_scipys_costs() -> None:
    cost = np.random.default_rng(1).normal(size=(120, 90))
    rows, cols = min_cost_matching(cost)
    assert cost[rows, cols].sum() == pytest.approx(cost[linear_sum_assignment(cost)].sum(), abs=1e-9)


def test_the_matching_refuses_what_is_not_a_finite_matrix() -> None:
    with pytest.raises(ValueError, match="matrix"):
        min_cost_matching(np.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        min_cost_matching(np.array([[0.0, np.inf], [1.0, 2.0]]))


def test_an_empty_matrix_has_an_empty_matching() -> None:
    rows, cols = min_cost_matching(np.zeros((0, 3)))
    assert rows.size == 0 and cols.size == 0


def test_the_ari_is_scikit_learns_for_labelings_of_every_kind() -> None:
    rng = np.random.default_rng(2)
    for trial in range(800):
        n = int(rng.integers(0, 60))
        a = rng.integers(0, int(rng.integers(1, 6)), size=n)
        b = a.copy() if trial % 4 == 0 else rng.integers(0, int(rng.integers(1, 6)), size=n)
        if trial % 7 == 0:
            b = (b + 3) * 10  # other label values, the same partition
        assert adjusted_rand_index(a, b) == pytest.approx(adjusted_rand_score(a, b), abs=1e-12)


def test_the_ari_of_a_relabelled_partition_is_one_and_of_a_split_one_below_one() -> None:
    truth = np.array([0, 0, 0, 1, 1, 1])
    assert adjusted_rand_index(truth, 1 - truth) == 1.0
    assert adjusted_rand_index(truth, np.zeros(6)) == pytest.approx(0.0)
    assert adjusted_rand_index(truth, np.array([0, 0, 1, 2, 2, 2])) == pytest.approx(
        adjusted_rand_score(truth, [0, 0, 1, 2, 2, 2]))


def test_the_matched_agreement_counts_items_under_the_best_relabelling() -> None:
    a = np.array([0, 0, 1, 1, 2, 2, 2])
    b = np.array([5, 5, 7, 7, 9, 9, 7])  # one item off under 0->5, 1->7, 2->9
    assert matched_agreement(a, b) == pytest.approx(6 / 7)
    assert matched_agreement(np.array([0, 1, 2]), np.array([0, 0, 0])) == pytest.approx(1 / 3)  # unequal counts
    assert matched_agreement(np.array([], dtype=int), np.array([], dtype=int)) == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        contingency([0, 1], [0])


def test_the_label_matching_is_one_to_one_and_scores_the_matched_agreement() -> None:
    rng = np.random.default_rng(2)
    for _ in range(200):
        a, b = rng.integers(0, rng.integers(1, 6), size=40) * 3, rng.integers(0, rng.integers(1, 6), size=40)
        mapping = label_matching(a, b)
        assert len(mapping) == min(len(set(a)), len(set(b))) and len(set(mapping.values())) == len(mapping)
        assert set(mapping) <= set(a.tolist()) and set(mapping.values()) <= set(b.tolist())
        agree = sum(int(x in mapping and mapping[x] == y) for x, y in zip(a.tolist(), b.tolist(), strict=True))
        assert agree / len(a) == pytest.approx(matched_agreement(a, b))
