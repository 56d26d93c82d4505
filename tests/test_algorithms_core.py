"""The baselines' pure math: Metropolis-Hastings gossip, FedSPD eq. 1 and eq. 2, the IFCA server average (each a
weighted running average, core.aggregation.fold_models), per-datapoint clustering and masked local SGD."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from dfca.core import fold_models
from dfca.core.mixing import metropolis_hastings_weights
from dfca.core.soft_assignment import (
    datapoint_clusters,
    draw_clusters,
    mixture_error,
    mixture_shares,
    personalised_models,
)
from dfca.graph import adjacency_matrix
from dfca.models.batched import client_permutations
from dfca.models.mlp import MLP


def random_adjacency(n: int, p: float, seed: int) -> torch.Tensor:
    return adjacency_matrix(nx.erdos_renyi_graph(n, p, seed=seed), n)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metropolis_hastings_is_symmetric_doubly_stochastic_on_the_graph(seed: int) -> None:
    adjacency = random_adjacency(12, 0.3, seed)
    W = metropolis_hastings_weights(adjacency)
    torch.testing.assert_close(W, W.T)
    torch.testing.assert_close(W.sum(0), torch.ones(12))
    torch.testing.assert_close(W.sum(1), torch.ones(12))
    assert (W >= 0).all()
    off_graph = ~adjacency & ~torch.eye(12, dtype=torch.bool)
    assert (W[off_graph] == 0).all()
    assert (W.diagonal() > 0).all()


def test_metropolis_hastings_weight_of_an_edge() -> None:
    """Path 0-1-2: degrees 1, 2, 1, so every edge weighs 1 / (1 + 2) and w_00 = 2/3, w_11 = 1/3."""
    adjacency = torch.tensor([[0, 1, 0], [1, 0, 1], [0, 1, 0]], dtype=torch.bool)
    expected = torch.tensor([[2, 1, 0], [1, 1, 1], [0, 1, 2]]) / 3.0
    torch.testing.assert_close(metropolis_hastings_weights(adjacency), expected)


def mh_gossip(params: dict[str, torch.Tensor], W: torch.Tensor, delivered: torch.Tensor) -> None:
    """DFedAvgM's step as the algorithm folds it: own weight w_ii, then w_im for every model that arrived."""
    n = W.shape[0]
    sources = {name: t[:, 0].clone() for name, t in params.items()}
    fold_models(params, W.diagonal().unsqueeze(1).clone(), delivered.float() * W, torch.zeros(n, dtype=torch.long),
                sources)


def test_lost_message_is_renormalised_away() -> None:
    adjacency = torch.tensor([[0, 1, 0], [1, 0, 1], [0, 1, 0]], dtype=torch.bool)
    W = metropolis_hastings_weights(adjacency)
    x = {"w": torch.tensor([[[1.0]], [[2.0]], [[4.0]]])}  # [3 clients, 1 model, 1]
    delivered = adjacency.clone()
    delivered[1, 2] = False  # client 1 does not hear from 2
    mh_gossip(x, W, delivered)
    torch.testing.assert_close(x["w"][1, 0], torch.tensor([0.5 * 2.0 + 0.5 * 1.0]))  # (1/3, 1/3) renormalised
    torch.testing.assert_close(x["w"][0, 0], torch.tensor([2 / 3 * 1.0 + 1 / 3 * 2.0]))  # lost nothing: W's row
    lonely = {"w": torch.tensor([[[1.0]], [[2.0]], [[4.0]]])}
    mh_gossip(lonely, W, torch.zeros(3, 3, dtype=torch.bool))
    torch.testing.assert_close(lonely["w"], torch.tensor([[[1.0]], [[2.0]], [[4.0]]]))


def test_gossip_with_metropolis_hastings_keeps_the_mean_and_reaches_consensus() -> None:
    adjacency = random_adjacency(10, 0.4, 3)
    assert nx.is_connected(nx.from_numpy_array(adjacency.int().numpy()))
    W = metropolis_hastings_weights(adjacency)
    params = {"w": torch.randn(10, 1, 6, generator=torch.Generator().manual_seed(0))}
    mean = params["w"].mean(0).clone()
    spread = float(params["w"].var(0).sum())
    for _ in range(60):
        mh_gossip(params, W, adjacency)
    torch.testing.assert_close(params["w"].mean(0), mean, rtol=1e-5, atol=1e-5)
    assert float(params["w"].var(0).sum()) < 1e-3 * spread


def test_fedspd_eq1_averages_only_the_neighbours_that_updated_the_same_cluster() -> None:
    """Star around client 0. Clients 0, 1, 3 update cluster 0; client 2 updates cluster 1. Eq. 1 as FedSPD folds
    it: the own copy weighs 1 for the selected cluster only, and only models of that cluster join."""
    adjacency = torch.tensor([[0, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    selected = torch.tensor([0, 0, 1, 0])
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 2, 5, generator=g)}
    before = params["w"].clone()
    sent = {"w": before[torch.arange(4), selected]}
    same = adjacency & (selected.unsqueeze(0) == selected.unsqueeze(1))
    fold_models(params, torch.nn.functional.one_hot(selected, 2).float(), same, selected, sent)
    w = params["w"]
    torch.testing.assert_close(w[0, 0], (before[0, 0] + before[1, 0] + before[3, 0]) / 3)
    torch.testing.assert_close(w[1, 0], (before[1, 0] + before[0, 0]) / 2)
    torch.testing.assert_close(w[2, 1], before[2, 1])  # nobody around it updated cluster 1
    # clusters a client did not select stay as they were, whatever arrived
    torch.testing.assert_close(w[0, 1], before[0, 1])
    torch.testing.assert_close(w[2, 0], before[2, 0])
    torch.testing.assert_close(w[1, 1], before[1, 1])


def test_ifca_server_average_weights_by_samples_and_keeps_unreturned_clusters() -> None:
    """The server's fold: the old model weighs 0, each upload its sample count."""
    models = {"w": torch.zeros(1, 3, 2), "b": torch.full((1, 3), 7.0)}
    updates = {"w": torch.tensor([[1.0, 1.0], [4.0, 4.0], [10.0, 0.0]]), "b": torch.tensor([1.0, 2.0, 3.0])}
    clusters = torch.tensor([0, 0, 2])
    samples = torch.tensor([[30.0, 10.0, 5.0]])
    fold_models(models, torch.zeros(1, 3), samples, clusters, updates)
    out = {n: t[0] for n, t in models.items()}
    torch.testing.assert_close(out["w"][0], torch.tensor([1.75, 1.75]))  # (30 * 1 + 10 * 4) / 40
    torch.testing.assert_close(out["b"][0], torch.tensor(1.25))
    torch.testing.assert_close(out["w"][1], torch.zeros(2))  # nobody returned cluster 1
    torch.testing.assert_close(out["b"][1], torch.tensor(7.0))
    torch.testing.assert_close(out["w"][2], torch.tensor([10.0, 0.0]))
    untouched = {"w": torch.zeros(1, 3, 2)}
    fold_models(untouched, torch.zeros(1, 3), torch.zeros(1, 0), clusters[:0], {"w": updates["w"][:0]})
    torch.testing.assert_close(untouched["w"], torch.zeros(1, 3, 2))  # every upload missed the deadline


def test_datapoint_clusters_and_shares() -> None:
    losses = torch.tensor([[[0.1, 2.0, 0.3, 0.9], [1.0, 0.5, 0.2, 0.1]]])  # [1 client, k=2, n=4]
    labels = datapoint_clusters(losses)
    assert labels.tolist() == [[0, 1, 1, 1]]
    torch.testing.assert_close(mixture_shares(labels, 2), torch.tensor([[0.25, 0.75]]))


def test_draw_clusters_follows_the_shares() -> None:
    shares = torch.tensor([[0.2, 0.8], [1.0, 0.0]]).repeat(2000, 1)
    drawn = draw_clusters(shares, list(range(shares.shape[0])))
    assert (drawn[1::2] == 0).all()  # a cluster with share 0 is never drawn
    assert abs(float(drawn[0::2].float().mean()) - 0.8) < 0.03
    # a client's draw depends on its own seed only, not on who is drawn with it
    assert torch.equal(draw_clusters(shares[10:20], list(range(10, 20))), drawn[10:20])


def test_personalised_model_is_the_share_weighted_sum() -> None:
    params = {"w": torch.tensor([[[1.0, 0.0], [0.0, 4.0]]])}  # [1 client, k=2, 2]
    out = personalised_models(params, torch.tensor([[0.25, 0.75]]))
    torch.testing.assert_close(out["w"], torch.tensor([[0.25, 3.0]]))


def test_mixture_error_ignores_label_switching() -> None:
    truth = torch.tensor([[0.3, 0.7], [0.9, 0.1], [0.5, 0.5]])
    assert mixture_error(truth[:, [1, 0]], truth) == pytest.approx(0.0)
    assert mixture_error(torch.full((3, 2), 0.5), truth) == pytest.approx((0.2 + 0.4 + 0.0) / 3)


@pytest.mark.parametrize("form", ["weights", "samples"])
def test_masked_sgd_trains_on_the_masked_samples_only(form: str) -> None:
    """Training with a mask equals training on the kept samples alone, in the same order; an all-true
    mask changes nothing; a client with an empty mask is untouched. In both forms of the MLP's step."""
    model = MLP(16, 8, 3, form)
    g = torch.Generator().manual_seed(0)
    init = model.init(3, g)
    x, y = torch.randn(3, 12, 16, generator=g), torch.randint(0, 3, (3, 12), generator=g)
    orders = client_permutations([1, 2, 3], 12, 2)
    for momentum in (0.0, 0.9):
        plain = {n: t.clone() for n, t in init.items()}
        model.sgd(plain, x, y, 0.1, orders, 4, momentum)
        full = {n: t.clone() for n, t in init.items()}
        model.sgd(full, x, y, 0.1, orders, 4, momentum, sample_mask=torch.ones(3, 12, dtype=torch.bool))
        for n in init:
            torch.testing.assert_close(full[n], plain[n])
        keep = torch.zeros(3, 12, dtype=torch.bool)
        keep[0, :5] = True
        keep[1, 2:11] = True  # client 2 keeps nothing
        masked = {n: t.clone() for n, t in init.items()}
        model.sgd(masked, x, y, 0.1, orders, 4, momentum, sample_mask=keep)
        for b in range(2):
            kept = keep[b].nonzero().flatten()
            sub_orders = torch.stack([torch.searchsorted(kept, o[keep[b, o]]) for o in orders[b]]).unsqueeze(0)
            ref = {n: t[b : b + 1].clone() for n, t in init.items()}
            model.sgd(ref, x[b : b + 1, kept], y[b : b + 1, kept], 0.1, sub_orders, 4, momentum)
            for n in init:
                torch.testing.assert_close(masked[n][b], ref[n][0])
        for n in init:
            torch.testing.assert_close(masked[n][2], init[n][2])
