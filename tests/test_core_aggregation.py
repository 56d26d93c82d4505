"""The core's math: running average (eq. 8) == batch average (eq. 7); argmin assignment (eq. 4); ratio consensus."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_driver_equivalence import DEVICES

from dfca.core import (
    assign_clusters,
    consensus,
    fold_models,
    gather_clusters,
    scatter_clusters,
    self_weights,
    sparse_factor,
    train_assigned,
)
from dfca.core.consensus import (
    RoundedWalkConsensus,
    StepConsensus,
    WalkConsensus,
    consensus_weights,
    gossip_matrix,
    ratio_consensus,
)
from dfca.core.params import flatten_cluster
from dfca.models.mlp import MLP
from dfca.wire.codec import TensorSpec, as_received, model_as_received


def random_params(n: int, k: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, k, 3, 4, generator=g), "b": torch.randn(n, k, 4, generator=g)}


def on(device: str, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to(device) for name, t in params.items()}


def products_as(monkeypatch: pytest.MonkeyPatch, sparse: bool) -> None:
    """Every product factor (sparse_factor.product_factor) CSR, or every one dense, on any device."""
    for density in ("SPARSE_DENSITY", "GPU_SPARSE_DENSITY"):
        monkeypatch.setattr(sparse_factor, density, 1.0 if sparse else 0.0)


def one_hop(params: dict[str, torch.Tensor], adjacency: torch.Tensor, assigned: torch.Tensor, merge: str) -> None:
    """A paper-rule round's merge: every client sends its assigned model to its neighbours, all fold at once."""
    sent = {n: t[torch.arange(t.shape[0]), assigned].clone() for n, t in params.items()}
    fold_models(params, self_weights(assigned, params["w"].shape[1], merge), adjacency, assigned, sent)


def test_a_product_factor_with_many_entries_a_row_is_sparse_on_cpu_only_where_it_is_sparser() -> None:
    """CSR where the factor is sparse enough; with `cpu_row_entries`, once its rows hold more entries than that on
    average, CSR on CPU only up to WIDE_ROW_DENSITY (its product is then taken in column blocks: `add_product`)."""
    a = torch.zeros(100, 100)
    a[:, :10] = 1.0  # 10 entries a row, 10% of the pairs
    assert sparse_factor.product_factor(a, 0.3).layout == torch.sparse_csr
    assert sparse_factor.product_factor(a, 0.3, cpu_row_entries=12).layout == torch.sparse_csr
    assert sparse_factor.product_factor(a, 0.3, cpu_row_entries=8).layout == torch.sparse_csr  # 0.1 <= 0.2
    a[:, :25] = 1.0  # 25 entries a row, 25% of the pairs
    assert sparse_factor.product_factor(a, 0.3).layout == torch.sparse_csr
    assert sparse_factor.product_factor(a, 0.3, cpu_row_entries=30).layout == torch.sparse_csr
    assert sparse_factor.product_factor(a, 0.3, cpu_row_entries=12).layout == torch.strided  # 0.25 > 0.2
    assert sparse_factor.product_factor(a.to_sparse_csr(), 0.3, cpu_row_entries=12).layout == torch.strided


@pytest.mark.parametrize("entries", [3, 20])
def test_a_product_added_in_column_blocks_is_the_whole_product(entries: int, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """add_product: out += factor @ x, whole or (a CSR factor whose rows hold more entries than asked) a block of
    columns at a time through views of out and x: the same sums, into a strided out (a cluster's view)."""
    monkeypatch.setattr(sparse_factor, "COLUMN_BLOCK", 7)  # blocks that do not divide the 30 columns
    g = torch.Generator().manual_seed(0)
    rows, cols = 12, 40
    mask = torch.rand(rows, cols, generator=g).argsort(1) < entries  # `entries` a row
    a = torch.randn(rows, cols, generator=g) * mask
    x = torch.randn(cols, 2, 30, generator=g)[:, 1]  # [40, 30], rows 60 values apart
    out = torch.randn(rows, 3, 30, generator=g)
    expected = out[:, 2] + a @ x
    sparse_factor.add_product(out[:, 2], a.to_sparse_csr(), x, cpu_row_entries=10)
    torch.testing.assert_close(out[:, 2], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("self_weight", [1.0, 0.0])
def test_running_average_any_order_equals_batch_average(self_weight: float) -> None:
    """Eq. 8, one arrival at a time in any order, is eq. 7: (w_ii theta + sum of arrivals) / (w_ii + arrivals)."""
    g = torch.Generator().manual_seed(1)
    own = {"w": torch.randn(1, 1, 5, 3, generator=g)}
    arrivals = {"w": torch.randn(4, 5, 3, generator=g)}
    zero = torch.zeros(4, dtype=torch.long)
    batch = (self_weight * own["w"][0, 0] + arrivals["w"].sum(0)) / (self_weight + 4)
    together = {"w": own["w"].clone()}
    fold_models(together, torch.full((1, 1), self_weight), torch.ones(1, 4), zero, arrivals)
    torch.testing.assert_close(together["w"][0, 0], batch, rtol=1e-5, atol=1e-6)
    for order in itertools.permutations(range(4)):
        current, weight = {"w": own["w"].clone()}, torch.full((1, 1), self_weight)
        for i in order:
            fold_models(current, weight, torch.ones(1, 1), zero[:1], {"w": arrivals["w"][i : i + 1]})
        torch.testing.assert_close(current["w"][0, 0], batch, rtol=1e-5, atol=1e-6)
        assert float(weight) == self_weight + 4


def test_one_hop_merge_is_eq7() -> None:
    """Client 0 with neighbours 1 (cluster 0) and 2 (cluster 1): cluster 0 averages {0, 1}, cluster 1 {0, 2}."""
    params = random_params(3, 2)
    before = {n: t.clone() for n, t in params.items()}
    adjacency = torch.tensor([[0, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    assigned = torch.tensor([0, 0, 1])
    one_hop(params, adjacency, assigned, "paper")
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
    one_hop(params, adjacency, assigned, merge)
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
    one_hop(params, adjacency, assigned, "fresh")
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


@pytest.mark.parametrize("form", ["weights", "samples"])
def test_fused_mlp_sgd_matches_autograd(form: str) -> None:
    """The hand-written backward with the in-place SGD step equals torch autograd + SGD, in both forms."""
    model = MLP(6, 7, 3, form)
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


def all_clusters(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N, k, D]: every cluster flattened."""
    return torch.stack([flatten_cluster(params, j) for j in range(params["w"].shape[1])], 1)


@pytest.mark.parametrize("merge", ["paper", "fresh"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("sparse", [False, True])  # the arrivals' coefficients multiplied dense, or as CSR
@pytest.mark.parametrize("device", DEVICES)
def test_fold_models_equals_the_dense_definition(merge: str, weighted: bool, sparse: bool, device: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """fold_models touches only the rows that received something, in place, reading a cluster's sources as a view
    where they are contiguous; the result is (c theta + A x) / (c + A 1) per cluster all the same."""
    products_as(monkeypatch, sparse)
    n, k, s = 12, 3, 15
    g = torch.Generator().manual_seed(4)
    params = random_params(n, k, seed=4)
    flat_before = all_clusters(params)
    arrivals = (torch.rand(n, s, generator=g) < 0.25).float()
    if weighted:
        arrivals *= torch.rand(n, s, generator=g) * 3
    arrivals[0] = 0.0  # a client that hears nothing keeps its models
    cluster = torch.randint(0, 2, (s,), generator=g)  # nobody sent cluster 2
    cluster = cluster.sort().values if weighted else cluster  # contiguous runs (views) and scattered (indexed)
    sources = {"w": torch.randn(s, 3, 4, generator=g), "b": torch.randn(s, 4, generator=g)}
    own = self_weights(torch.randint(0, k, (n,), generator=g), k, merge)
    flat_sources = torch.cat([sources["w"].reshape(s, -1), sources["b"].reshape(s, -1)], 1)
    expected = flat_before.clone()
    for j in range(k):
        a = arrivals * (cluster == j).float()
        total = own[:, j] + a.sum(1)
        moved = a.sum(1) > 0
        mixed = (own[:, j : j + 1] * flat_before[:, j] + a @ flat_sources) / total.clamp_min(1e-12).unsqueeze(1)
        expected[moved, j] = mixed[moved]
    weight = own.to(device, copy=True)
    params = on(device, params)
    used = fold_models(params, weight, arrivals.to(device), cluster.to(device), on(device, sources))
    params = on("cpu", params)
    torch.testing.assert_close(all_clusters(params), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(all_clusters(params)[0], flat_before[0])
    assert used == int((arrivals > 0).sum())
    torch.testing.assert_close(weight.cpu(), own + arrivals @ torch.nn.functional.one_hot(cluster, k).float())


@pytest.mark.parametrize("payload", [torch.int8, torch.float16])
@pytest.mark.parametrize("block_bytes", [64 << 20, 200])  # 200 bytes: one row of w at a time
@pytest.mark.parametrize("untrained_weight", [0.0, 0.3])  # 0: the first step's product takes the trained rows only
@pytest.mark.parametrize("sparse", [False, True])  # each step's mask multiplied dense, or as CSR
@pytest.mark.parametrize("device", DEVICES)
def test_rounded_walk_consensus_is_step_consensus_with_rounded_messages(payload: torch.dtype, block_bytes: int,
                                                                       untrained_weight: float, sparse: bool,
                                                                       device: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's consensus under lossy payloads (RoundedWalkConsensus, block by block at the round's end)
    equals the message driver's (StepConsensus fed each step's messages as the wire rounds them), with a different
    loss mask at every step, an isolated client and a cluster nobody trained."""
    products_as(monkeypatch, sparse)
    n, k = 14, 3
    g = torch.Generator().manual_seed(6)
    params = {"w": torch.randn(n, k, 5, 4, generator=g), "b": torch.randn(n, k, 4, generator=g),
              "s": torch.randn(n, k, generator=g)}
    adjacency = torch.rand(n, n, generator=g) < 0.3
    adjacency = (adjacency | adjacency.T) & ~torch.eye(n, dtype=torch.bool)
    adjacency[3] = adjacency[:, 3] = False
    assigned = torch.randint(0, k, (n,), generator=g)
    assigned[assigned == 2] = 1
    m = consensus_weights(assigned, k, untrained_weight).to(device)
    masks = [(adjacency & (torch.rand(n, n, generator=g) > 0.2)).to(device) for _ in range(4)]
    params = on(device, params)
    spec = {f"num.{name}": TensorSpec(tuple(t.shape[1:])) for name, t in params.items()}
    stepped = {name: t.clone() for name, t in params.items()}
    step = StepConsensus(stepped, m)
    walked = RoundedWalkConsensus(m, lambda t, out: model_as_received(t, payload, out))
    walked.BLOCK_BYTES = block_bytes
    for mask in masks:
        sent = as_received({**spec, "den": TensorSpec((k,), "float32")}, step.outgoing(), payload)
        step.receive(mask, {name: t.clone() for name, t in sent.items()})
        step.step()
        assert walked.receive(mask, {}) == int(mask.sum())
    assert all((a.layout == torch.sparse_csr) == sparse for a, _ in walked.steps)
    step.finish(stepped)
    rounded = {name: t.clone() for name, t in params.items()}
    walked.finish(rounded)
    for name in params:
        assert (rounded[name] - params[name]).abs().max() > 1e-2  # the consensus moved the models
        torch.testing.assert_close(rounded[name], stepped[name], rtol=1e-6, atol=1e-6)
        if untrained_weight == 0:  # isolated: its own copy (with weight on every copy, its own mean of k)
            assert torch.equal(rounded[name][3, assigned[3]], params[name][3, assigned[3]])
        assert rounded[name].device.type == torch.device(device).type


@pytest.mark.parametrize("untrained_weight", [0.0, 0.3])
@pytest.mark.parametrize("walk_form", ["walk", "dense steps", "sparse steps"])
@pytest.mark.parametrize("device", DEVICES)
def test_ratio_consensus_equals_the_dense_ratio(untrained_weight: float, walk_form: str, device: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """theta_j <- P^G (m_j theta_j) / P^G m_j where reached, else the own copy (core.consensus), in every form:
    the simulator's walk over the whole graph, its G steps one by one (dense or CSR masks; what it picks on large
    sparse graphs) and the message driver's step-by-step num and den."""
    products_as(monkeypatch, walk_form == "sparse steps")
    monkeypatch.setattr(consensus, "steps_are_cheaper", lambda *_: walk_form != "walk")
    n, k = 14, 3
    g = torch.Generator().manual_seed(5)
    params = random_params(n, k, seed=5)
    adjacency = torch.rand(n, n, generator=g) < 0.15
    adjacency = (adjacency | adjacency.T) & ~torch.eye(n, dtype=torch.bool)
    adjacency[3] = adjacency[:, 3] = False  # isolated: untouched unless it trained the cluster itself
    assigned = torch.randint(0, k, (n,), generator=g)
    assigned[assigned == 2] = 1  # cluster 2 is trained by nobody
    m = consensus_weights(assigned, k, untrained_weight)
    P = gossip_matrix(adjacency)
    walk = P @ P @ P
    expected = []
    for j in range(k):
        flat = flatten_cluster(params, j)
        num, den = walk @ (m[:, j : j + 1] * flat), walk @ m[:, j]
        expected.append(torch.where((den > 1e-3).unsqueeze(1), num / den.clamp_min(1e-3).unsqueeze(1), flat))
    stepped = {name: t.clone() for name, t in params.items()}
    ratio_consensus(params, m, walk)
    for j in range(k):
        torch.testing.assert_close(flatten_cluster(params, j), expected[j], rtol=1e-5, atol=1e-6)
    stepped, m, adjacency = on(device, stepped), m.to(device), adjacency.to(device)
    walked, step = WalkConsensus(m), StepConsensus(stepped, m)
    for _ in range(3):
        sent = step.outgoing()
        step.receive(adjacency, {name: t.clone() for name, t in sent.items()})
        walked.receive(adjacency, {})
        step.step()
    step.finish(stepped)
    stepped = on("cpu", stepped)
    for j in range(k):
        torch.testing.assert_close(flatten_cluster(stepped, j), expected[j], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(walked.walk.cpu(), walk)
    assert all((a.layout == torch.sparse_csr) == (walk_form == "sparse steps") for a, _ in walked.steps)
    whole = on(device, random_params(n, k, seed=5))
    walked.finish(whole)
    whole = on("cpu", whole)
    for j in range(k):
        torch.testing.assert_close(flatten_cluster(whole, j), expected[j], rtol=1e-5, atol=1e-6)


def test_the_walk_is_taken_on_small_dense_graphs_and_sparse_steps_on_large_sparse_ones() -> None:
    """WalkConsensus's choice (consensus.steps_are_cheaper): the paper's N=240 ER p=0.1 multiplies the walk; 3,000
    clients with 10 neighbours each apply the 5 steps as CSR products (the dense walk would be ~30x the work)."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.zeros(1, 2, 159_010)}  # the size of one MLP h=200 a cluster; only its shape is read
    for n, p, expect in [(240, 0.1, False), (3000, 10 / 3000, True)]:
        adjacency = torch.rand(n, n, generator=g) < p
        steps = [consensus.gossip_step(adjacency) for _ in range(5)]
        m = consensus_weights(torch.randint(0, 2, (n,), generator=g), 2, 0.0)
        assert consensus.steps_are_cheaper(steps, m, params) is expect
        assert steps[0][0].layout == torch.sparse_csr  # both at most SPARSE_DENSITY full (where steps are taken)
