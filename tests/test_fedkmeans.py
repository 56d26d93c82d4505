"""Federated k-means over networks (GTVMin, Algorithm 1) and distributed k-means: the update (11) by hand, k-means on
the augmented dataset (9), the objective (7) never rising one node at a time, the metrics of (12), bad input, and
both drivers agreeing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

from dfca.config import ConfigError, ExperimentConfig, parse_config
from dfca.core.kmeans import Neighbours, gtv_update, kmeans_plus_plus, set_distance
from dfca.graph import neighbours
from dfca.identity import topics
from dfca.simulator import prepare, simulate
from dfca.transport import InMemoryBroker, InMemoryTransport
from dfca.wire.codec import Envelope, TensorSpec, encode_message
from harness.lockstep import LockstepRun, client_driver, lockstep_round, run_lockstep

W0 = "worker-0"  # the host word of every client when one worker hosts them all


def blobs_config(**overrides: Any) -> ExperimentConfig:
    base: dict[str, Any] = {
        "name": "km", "algorithm": "fedkmeans", "clusters": 3, "rounds": 30, "seed": 0, "aggregation": "batch",
        "data": {"dataset": "blobs", "clients": 10, "train_per_client": 100, "test_per_client": 30},
        "topology": {"kind": "erdos_renyi", "p": 0.7},
    }
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_config(base)


def one_node(points: list[float], mine: list[float], theirs: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        Neighbours]:
    """One node in R^1: its points [1, m, 1], centroids [1, k, 1], and its neighbours' centroids."""
    x = torch.tensor(points).view(1, -1, 1)
    w = torch.tensor(mine).view(1, -1, 1)
    v = torch.tensor(theirs).view(1, len(theirs), len(mine), 1)
    return x, w, Neighbours(v, torch.ones(1, len(theirs), dtype=torch.bool))


@pytest.mark.parametrize("weight,expected", [(1.0, [2 / 3, 11.0]), (1 / 3, [0.8, 11.5])])
def test_one_pass_of_eq_11_by_hand(weight: float, expected: list[float]) -> None:
    """Points 0, 1, 10; centroids 0.5, 10; one neighbour with centroids 1, 12; alpha 0.5.
    (E1): 0 and 1 go to c0, 10 to c1. (E2): the neighbour's 1 is nearest c0, its 12 nearest c1.
    (E3): c0's nearest neighbour centroid is 1, c1's is 12. (M), eq. (11), with a point weight a:
      w0 = (a (0 + 1) + 0.5 (1 + 1)) / (2a + 0.5 (1 + 1)),  w1 = (a 10 + 0.5 (12 + 12)) / (a + 0.5 (1 + 1)):
    a = 1: 2/3 and 11; a = 1/3 (the 1/m_i of (11)): 0.8 and 11.5."""
    x, w, near = one_node([0.0, 1.0, 10.0], [0.5, 10.0], [[1.0, 12.0]])
    updated, _ = gtv_update(x, w, near, 0.5, torch.tensor([weight]), passes=1)
    torch.testing.assert_close(updated.flatten(), torch.tensor(expected))


def test_without_e3_a_pass_uses_only_the_matched_neighbour_centroids() -> None:
    x, w, near = one_node([0.0, 1.0, 10.0], [0.5, 10.0], [[1.0, 12.0]])
    updated, _ = gtv_update(x, w, near, 0.5, torch.tensor([1.0]), with_e3=False, passes=1)
    torch.testing.assert_close(updated.flatten(), torch.tensor([(1 + 0.5) / 2.5, (10 + 6) / 1.5]))


@pytest.mark.parametrize("data_weight", ["one", "mean"])
def test_alpha_1_without_e3_is_k_means_on_the_augmented_dataset(data_weight: str) -> None:
    """(9): the node's points and its neighbours' centroids as one dataset; with a point weight 1 that is plain
    k-means (Lloyd from the same start), with 1/m_i (as (11) prints) k-means with those sample weights."""
    g = torch.Generator().manual_seed(0)
    m, k = 60, 3
    centres = torch.tensor([[0.0, 0.0], [6.0, 0.0], [0.0, 6.0]])
    x = (centres.repeat(m // 3, 1) + torch.randn(m, 2, generator=g)).unsqueeze(0)
    theirs = (centres.unsqueeze(0) + 0.5 * torch.randn(4, k, 2, generator=g)).unsqueeze(0)  # 4 neighbours
    w0 = kmeans_plus_plus(x[0], k, 3).unsqueeze(0)
    a = 1.0 if data_weight == "one" else 1.0 / m
    ours, _ = gtv_update(x, w0, Neighbours(theirs, torch.ones(1, 4, dtype=torch.bool)), 1.0, torch.tensor([a]),
                         with_e3=False, passes=100, tol=0.0)
    augmented = torch.cat([x[0], theirs[0].reshape(-1, 2)]).double().numpy()
    weights = np.concatenate([np.full(m, a), np.ones(4 * k)])
    lloyd = KMeans(k, init=w0[0].double().numpy(), n_init=1, max_iter=100, tol=0.0, algorithm="lloyd")
    reference = lloyd.fit(augmented, sample_weight=weights).cluster_centers_
    torch.testing.assert_close(ours[0].double(), torch.from_numpy(reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("selection", ["round_robin", "random"])
@pytest.mark.parametrize("geometry", ["isotropic", "anisotropic"])
def test_one_node_per_iteration_never_raises_the_objective_7(selection: str, geometry: str) -> None:
    cfg = blobs_config(rounds=40, eval_every=1, fedkmeans={"selection": selection, "alpha": 0.7},
                       data={"geometry": geometry, "train_per_client": 40})
    objective = [h["objective"] for h in simulate(cfg).history]
    assert all(b <= a * (1 + 1e-6) for a, b in zip(objective, objective[1:], strict=False)), objective
    assert objective[-1] < objective[0]  # and it falls


def test_an_empty_cluster_keeps_its_centroid() -> None:
    """A centroid that no point (and, alone, no neighbour) chooses stays where it is, never jumps to the origin."""
    x, w, near = one_node([0.0, 1.0, 2.0], [1.0, 50.0], [])
    updated, _ = gtv_update(x, w, near, 0.0, torch.tensor([1.0]), passes=5)
    torch.testing.assert_close(updated.flatten(), torch.tensor([1.0, 50.0]))


def test_metrics_of_eq_12_on_a_hand_made_case() -> None:
    """Every node holding the centralised solution: GCD = CV = 0; one node off by 1 in one coordinate of one
    centroid: d of (4) is 2 with every set, so GCD = 2 / (2 n k) and CV sums it over that node and its neighbours."""
    from dfca.algorithms.fedkmeans import centralised_centroids, kmeans_metrics

    cfg = blobs_config(data={"clients": 4})
    ctx = prepare(cfg)
    reference = centralised_centroids(cfg, ctx.data.x_train.reshape(-1, 2))
    w = reference.expand(4, 3, 2).clone()
    graph = {0: [1, 2], 1: [0], 2: [0, 3], 3: [2]}
    exact = kmeans_metrics(cfg, ctx.data, graph, {"clients": [0, 1, 2, 3], "centroids": w.tolist()})
    assert exact["gcd"] == pytest.approx(0.0, abs=1e-9) and exact["cv"] == pytest.approx(0.0, abs=1e-9)
    w[1, 0, 0] += 1.0
    assert float(set_distance(w[1], w[0])) == pytest.approx(2.0)
    off = kmeans_metrics(cfg, ctx.data, graph, {"clients": [0, 1, 2, 3], "centroids": w.tolist()})
    assert off["gcd"] == pytest.approx(2.0 / (2 * 4 * 3))
    # per node: 0 sees 1 (d 2) and 2 (0): 1.0; 1 sees 0: 2.0; 2 and 3: 0; n_eff = 4
    assert off["cv"] == pytest.approx((1.0 + 2.0) / (2 * 3 * 4))
    assert off["point_ari"] > 0.9


def test_configs_that_cannot_run_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="clusters feature vectors"):
        parse_config({"algorithm": "fedkmeans", "clusters": 3})  # images without a feature map
    with pytest.raises(ConfigError, match="clusters: k=5 centroids need at least k points"):
        blobs_config(clusters=5, data={"train_per_client": 4})
    with pytest.raises(ConfigError, match="blobs holds unlabelled points"):
        blobs_config(algorithm="dfca")
    with pytest.raises(ConfigError, match="anisotropic"):
        blobs_config(data={"geometry": "anisotropic", "feature_dim": 3})
    projected = parse_config({"algorithm": "fedkmeans", "clusters": 10, "data": {
        "dataset": "digits", "features": "projection", "feature_dim": 8, "rotations": [0], "clients": 4,
        "train_per_client": 40, "test_per_client": 10}, "topology": {"kind": "complete"}, "rounds": 3})
    summary = simulate(projected).summary  # real data through a fixed projection
    assert {"gcd", "cv", "point_ari", "objective"} <= set(summary) and summary["point_ari"] > 0.1


@pytest.mark.parametrize("algorithm,selection", [("fedkmeans", "parallel"), ("fedkmeans", "round_robin"),
                                                 ("distkmeans", "parallel")])
def test_both_drivers_agree(algorithm: str, selection: str) -> None:
    cfg = blobs_config(algorithm=algorithm, rounds=8, fedkmeans={"selection": selection})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    broker = InMemoryBroker()
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), lambda: InMemoryTransport(broker), 3)
    for d in run.drivers:
        torch.testing.assert_close(d.algorithm.params["centroids"], sim.algorithm.params["centroids"][d.ids])  # type: ignore[attr-defined]
        assert d.stats.applied == 8 * sum(len(d.neighbours[c]) for c in d.ids) and not d.stats.rejected


def test_bad_neighbour_centroids_are_rejected_and_the_run_goes_on() -> None:
    """A neighbour's centroids with NaN, or of the wrong shape, are dead-lettered; the node uses the real ones."""
    cfg = blobs_config(rounds=3)
    ctx = prepare(cfg)
    graph = neighbours(ctx.graph)
    sim = simulate(cfg, data=ctx.data)
    broker = InMemoryBroker()
    groups = ([c for c in range(10) if c % 2 == 0], [c for c in range(10) if c % 2 == 1])
    run = LockstepRun([client_driver(cfg, "lockstep", g, ctx.data.subset(g), graph, InMemoryTransport(broker),
                                     workers=2) for g in groups], None)  # queues bound: forgeries reach 0's neighbours
    for bad in (torch.full((3, 2), float("nan")), torch.zeros(3, 5)):
        body, headers = encode_message(Envelope("lockstep", 0, 0, "centroids", 0, 0, {"centroids": bad}),
                                       {"centroids": TensorSpec(tuple(bad.shape))})
        InMemoryTransport(broker).publish(topics.MODELS_EXCHANGE, topics.model_key("lockstep", W0, 0, 0), body, headers)
    for t in range(cfg.rounds):
        lockstep_round(run, t)
    rejected = sum(d.stats.rejected["non_finite"] + d.stats.rejected["shape"] for d in run.drivers)
    # each worker hearing node 0 from another worker gets both (node 0's own worker delivers its messages itself,
    # its queue is not bound to node 0's key)
    assert rejected == 2 * sum(1 for g in groups if 0 not in g and set(g) & set(graph[0])) == 2
    for d in run.drivers:
        torch.testing.assert_close(d.algorithm.params["centroids"], sim.algorithm.params["centroids"][d.ids])  # type: ignore[attr-defined]


def test_gtv_beats_local_k_means_on_isotropic_blobs() -> None:
    """The benchmark's must-have at test scale: p = 0.7, m_i = 200, isotropic, 10 runs: GCD(alpha=1) < GCD(alpha=0)."""
    gcd = {alpha: [simulate(blobs_config(seed=s, rounds=60, eval_every=60, data={"train_per_client": 200},
                                         fedkmeans={"alpha": alpha})).summary["gcd"] for s in range(10)]
           for alpha in (0.0, 1.0)}
    assert np.mean(gcd[1.0]) < np.mean(gcd[0.0]), gcd
