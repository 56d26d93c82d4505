"""The core's math: running average (eq. 8) == batch average (eq. 7); argmin assignment (eq. 4)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dfca.core import (
    assign_clusters,
    gather_clusters,
    mix_clusters,
    mixing_matrices,
    running_average,
    scatter_clusters,
    self_weights,
    train_assigned,
)
from dfca.core.consensus import consensus_weights, gossip_matrix, ratio_consensus
from dfca.core.params import flatten_cluster
from dfca.models import MLP


def random_params(n: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, k, 3, 4, generator=g), "b": torch.randn(n, k, 4, generator=g)}


@pytest.mark.parametrize("self_weight", [1.0, 0.0])
def test_running_average_any_order_equals_batch_average(self_weight: float) -> None:
    g = torch.Generator().manual_seed(1)
    own = {"w": torch.randn(5, 3, generator=g)}
    arrivals = [{"w": torch.randn(5, 3, generator=g)} for _ in range(4)]
    batch = (self_weight * own["w"] + sum(a["w"] for a in arrivals)) / (self_weight + len(arrivals))
    for order in itertools.permutations(range(4)):
        current = {"w": own["w"].clone()}
        for r, i in enumerate(order, start=1):
            running_average(current, arrivals[i], r, self_weight)
        torch.testing.assert_close(current["w"], batch, rtol=1e-5, atol=1e-6)


def test_mixing_matrix_is_eq7() -> None:
    """Client 0 with neighbours 1 (cluster 0) and 2 (cluster 1): cluster 0 averages {0, 1}, cluster 1 {0, 2}."""
    params = random_params(3, 2)
    before = {n: t.clone() for n, t in params.items()}
    adjacency = torch.tensor([[0, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    assigned = torch.tensor([0, 0, 1])
    mix_clusters(params, mixing_matrices(adjacency, assigned, self_weights(assigned, 2, "paper")))
    for name in params:
        torch.testing.assert_close(params[name][0, 0], (before[name][0, 0] + before[name][1, 0]) / 2)
        torch.testing.assert_close(params[name][0, 1], (before[name][0, 1] + before[name][2, 1]) / 2)
        # client 1 hears only from client 0, which sent cluster 0; its cluster 1 is untouched
        torch.testing.assert_close(params[name][1, 0], (before[name][1, 0] + before[name][0, 0]) / 2)
        torch.testing.assert_close(params[name][1, 1], before[name][1, 1])


@pytest.mark.parametrize("merge", ["paper", "fresh"])
def test_never_overwrites_a_cluster_that_received_nothing(merge: str) -> None:
    n, k = 6, 3
    params = random_params(n, k, seed=3)
    before = {name: t.clone() for name, t in params.items()}
    g = torch.Generator().manual_seed(0)
    adjacency = torch.rand(n, n, generator=g) < 0.5
    adjacency = (adjacency | adjacency.T) & ~torch.eye(n, dtype=torch.bool)
    assigned = torch.tensor([0, 0, 1, 1, 0, 1])  # nobody sent cluster 2
    mix_clusters(params, mixing_matrices(adjacency, assigned, self_weights(assigned, k, merge)))
    for name in params:
        torch.testing.assert_close(params[name][:, 2], before[name][:, 2], rtol=0, atol=0)
    # a client with no neighbour in cluster j keeps its own copy of j
    for i in range(n):
        for j in range(2):
            senders = [m for m in range(n) if adjacency[i, m] and assigned[m] == j]
            if not senders:
                for name in params:
                    torch.testing.assert_close(params[name][i, j], before[name][i, j], rtol=0, atol=0)


def test_fresh_merge_drops_stale_own_copy_only_for_untrained_clusters() -> None:
    params = random_params(2, 2)
    before = {name: t.clone() for name, t in params.items()}
    adjacency = torch.tensor([[0, 1], [1, 0]], dtype=torch.bool)
    assigned = torch.tensor([0, 1])
    mix_clusters(params, mixing_matrices(adjacency, assigned, self_weights(assigned, 2, "fresh")))
    # client 0 trained cluster 0 and heard cluster 1 from client 1: takes client 1's model as is
    torch.testing.assert_close(params["w"][0, 1], before["w"][1, 1])
    torch.testing.assert_close(params["w"][0, 0], before["w"][0, 0])


def test_assignment_is_argmin_of_loss() -> None:
    losses = torch.tensor([[0.5, 0.2, 0.9], [0.1, 0.3, 0.2], [2.0, 1.0, 0.5]])
    assert assign_clusters(losses).tolist() == [1, 0, 2]


def test_only_the_assigned_model_trains() -> None:
    model = MLP(8, 5, 3)
    n, k = 4, 3
    base = model.init(n * k, torch.Generator().manual_seed(0))
    params = {name: t.reshape(n, k, *t.shape[1:]).clone() for name, t in base.items()}
    before = {name: t.clone() for name, t in params.items()}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 20, 8, generator=g), torch.randint(0, 3, (n, 20), generator=g)
    assigned = torch.tensor([2, 0, 1, 2])
    train_assigned(model, params, assigned, x, y, lr=0.1, epochs=2, batch_size=5, seeds=[1, 2, 3, 4])
    for i in range(n):
        for j in range(k):
            changed = not torch.equal(params["w1"][i, j], before["w1"][i, j])
            assert changed == (j == assigned[i]), (i, j)


def test_gather_scatter_roundtrip() -> None:
    params = random_params(4, 3)
    clusters = torch.tensor([2, 1, 0, 2])
    chosen = gather_clusters(params, clusters)
    torch.testing.assert_close(chosen["w"][0], params["w"][0, 2])
    chosen["w"] += 1.0
    scatter_clusters(params, clusters, chosen)
    torch.testing.assert_close(params["w"][3, 2], chosen["w"][3])


def test_fused_mlp_sgd_matches_autograd() -> None:
    """The hand-written backward with the in-place SGD step equals torch autograd + SGD."""
    model = MLP(6, 7, 3)
    p = model.init(2, torch.Generator().manual_seed(0))
    ref = {name: t.clone().requires_grad_(True) for name, t in p.items()}
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(2, 8, 6, generator=g), torch.randint(0, 3, (2, 8), generator=g)
    orders = torch.stack([torch.arange(8), torch.arange(8).flip(0)]).unsqueeze(1)  # [2, 1 epoch, 8]
    model.sgd(p, x, y, 0.5, orders, batch_size=4)
    opt = torch.optim.SGD(list(ref.values()), lr=0.5)
    for lo in range(0, 8, 4):
        idx = orders[:, 0, lo : lo + 4]
        rows = torch.arange(2).unsqueeze(1)
        opt.zero_grad()
        logits = model.logits(ref, x[rows, idx])
        loss = sum(torch.nn.functional.cross_entropy(logits[b], y[b, idx[b]]) for b in range(2))
        loss.backward()
        opt.step()
    for name in p:
        torch.testing.assert_close(p[name], ref[name].detach(), rtol=1e-4, atol=1e-5)


def dense_mix(params: dict[str, torch.Tensor], W: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """The definition: theta_{.,j} <- W[j] @ [theta_{.,j}; extra], on flattened copies. -> [N, k, D]."""
    out = []
    for j in range(W.shape[0]):
        flat = flatten_cluster(params, j)
        out.append(W[j] @ (flat if extra is None else torch.cat([flat, extra])))
    return torch.stack(out, 1)


def all_clusters(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N, k, D]: every cluster flattened."""
    return torch.stack([flatten_cluster(params, j) for j in range(params["w"].shape[1])], 1)


@pytest.mark.parametrize("merge", ["paper", "fresh"])
@pytest.mark.parametrize("late", [0, 3])
def test_mix_clusters_equals_the_dense_product(merge: str, late: int) -> None:
    """mix_clusters multiplies only the weighted columns, in place; the result is W[j] @ theta_j all the same."""
    n, k = 12, 3
    g = torch.Generator().manual_seed(4)
    params = random_params(n, k, seed=4)
    flat_before = all_clusters(params)
    delivered = torch.rand(n, n + late, generator=g) < 0.25
    delivered[:, :n] &= ~torch.eye(n, dtype=torch.bool)
    delivered[0] = False  # a client that hears nothing keeps its models
    sent = torch.randint(0, k, (n + late,), generator=g)
    sent[:n][sent[:n] == 2] = 0  # nobody trained cluster 2 this round (only late models of it, if any)
    extra = torch.randn(late, flat_before.shape[2], generator=g) if late else None
    W = mixing_matrices(delivered, sent, self_weights(sent[:n], k, merge))
    expected = dense_mix(params, W, extra)
    mix_clusters(params, W, extra=extra)
    got = all_clusters(params)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0], flat_before[0])
    assert not torch.equal(got, flat_before)


@pytest.mark.parametrize("untrained_weight", [0.0, 0.3])
def test_ratio_consensus_equals_the_dense_ratio(untrained_weight: float) -> None:
    """theta_j <- P^G (m_j theta_j) / P^G m_j where reached, else the own copy (core.consensus)."""
    n, k = 14, 3
    g = torch.Generator().manual_seed(5)
    params = random_params(n, k, seed=5)
    adjacency = torch.rand(n, n, generator=g) < 0.15
    adjacency = (adjacency | adjacency.T) & ~torch.eye(n, dtype=torch.bool)
    adjacency[3] = adjacency[:, 3] = False  # isolated: untouched unless it trained the cluster itself
    assigned = torch.randint(0, k, (n,), generator=g)
    assigned[assigned == 2] = 1  # cluster 2 is trained by nobody
    m = consensus_weights(assigned, k, untrained_weight)
    steps = [gossip_matrix(adjacency)] * 3
    walk = steps[0] @ steps[0] @ steps[0]
    expected = []
    for j in range(k):
        flat = flatten_cluster(params, j)
        num, den = walk @ (m[:, j : j + 1] * flat), walk @ m[:, j]
        expected.append(torch.where((den > 1e-3).unsqueeze(1), num / den.clamp_min(1e-3).unsqueeze(1), flat))
    ratio_consensus(params, m, steps)
    for j in range(k):
        torch.testing.assert_close(flatten_cluster(params, j), expected[j], rtol=1e-5, atol=1e-6)
