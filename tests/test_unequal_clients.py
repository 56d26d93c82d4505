"""Clients of unequal size: every algorithm trains and scores each client on its own samples only (padding never
leaks), sample-weighted averages weigh real counts, padding memory stays bounded, and a ragged rotated federation
still recovers its clusters."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from dfca.algorithms import HostContext, clients_of
from dfca.algorithms import dfca as dfca_algorithm
from dfca.algorithms.client_data import local_sgd, sample_counts
from dfca.config import ExperimentConfig
from dfca.core import gather_clusters, round_seeds
from dfca.data.shards import BUCKET_ABOVE, BUCKET_SPREAD, from_clients
from dfca.graph import neighbours
from dfca.models.batched import client_permutations, step_streams
from dfca.models.build import model_from_config
from dfca.simulator import prepare, simulate
from harness.ragged import cut, poisoned, spread_sizes


def small(algorithm: str, **top: Any) -> ExperimentConfig:
    base: dict[str, Any] = {
        "name": "ragged", "algorithm": algorithm, "init": "global", "clusters": 2, "rounds": 2, "seed": 5,
        "data": {"dataset": "digits", "rotations": [0, 180], "clients": 8, "train_per_client": 30,
                 "test_per_client": 10},
        "model": {"kind": "mlp", "hidden": 16},
        "train": {"lr": 0.1, "local_epochs": 2, "batch_size": 8},
        "topology": {"kind": "erdos_renyi", "p": 0.5},
        "dfca": {"traffic": "full"},
    }
    if algorithm in ("fedkmeans", "distkmeans"):
        base["clusters"] = 3
        base["data"] = {"dataset": "blobs", "clients": 8, "train_per_client": 20, "test_per_client": 10}
    if algorithm in ("dpmm_cfl", "fesem"):
        base["data"] = {**base["data"], "partition": "dirichlet", "groups": 2}
        base["data"].pop("rotations")
    return ExperimentConfig.model_validate({**base, **top})


ALGORITHMS = ["dfca", "ifca", "dfedavgm", "fedspd", "local", "fedkmeans", "distkmeans", "dpmm_cfl", "fesem"]


def ragged_data(cfg: ExperimentConfig, least: int = 5, wide: bool = False) -> Any:
    data = prepare(cfg).data
    n = data.y_train.shape[1]
    sizes = spread_sizes(n, data.num_clients, least)
    if wide:  # one client far larger than the rest: the federation is bucketed
        sizes = [max(least, s // 4) for s in sizes]
        sizes[0] = n
    return cut(data, sizes, spread_sizes(data.y_test.shape[1], data.num_clients, 3))


def final_state(cfg: ExperimentConfig, data: Any) -> dict[str, torch.Tensor]:
    result = simulate(cfg, data=data)
    return {k: v for k, v in result.algorithm.state().items() if v.is_floating_point()}


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_padding_values_change_nothing(algorithm: str, wide: bool) -> None:
    """Every algorithm ends in the same state, to the bit, whatever the padding rows hold: nothing reads them."""
    cfg = small(algorithm)
    data = ragged_data(cfg, wide=wide)
    assert data.is_ragged and data.is_bucketed == wide
    clean, dirty = final_state(cfg, data), final_state(cfg, poisoned(data, seed=3))
    assert clean.keys() == dirty.keys()
    for name, value in clean.items():
        assert torch.equal(value, dirty[name]), name


@pytest.mark.parametrize("wide", [False, True])
def test_the_screens_losses_taken_with_eq1s_are_its_data_tests_on_the_same_samples(
        wide: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss of last round's model that a screened round limits its estimates by comes from the pass that takes
    eq. 1's losses: it is the data test's own on the client's first samples, padding or no, bucketed or not."""
    monkeypatch.setattr(dfca_algorithm, "SCREEN_SAMPLES", 7)  # some clients hold fewer (5), some many more
    cfg = small("dfca", dfca={"traffic": "full", "variant": "robust", "screen": True})
    algorithm = simulate(cfg, data=ragged_data(cfg, wide=wide)).algorithm
    assert isinstance(algorithm, dfca_algorithm.DFCA) and algorithm.screen_losses is not None
    rows = torch.arange(cfg.data.clients)
    for j in range(cfg.clusters):
        alone = algorithm.sample_loss(rows, gather_clusters(algorithm.params, torch.full_like(rows, j)))
        torch.testing.assert_close(algorithm.screen_losses[:, j], alone, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(algorithm.screen_losses, algorithm.losses)  # the first samples, not all of them



@pytest.mark.parametrize("wide", [False, True])
def test_a_merges_data_test_of_one_model_on_several_rows_is_each_rows_own(
        wide: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge's end tests each arriving model on the samples of every row that received it in one forward pass
    (`model_sample_loss`): each row's loss is the one `sample_loss` takes row by row, padding or no, bucketed or
    not."""
    monkeypatch.setattr(dfca_algorithm, "SCREEN_SAMPLES", 7)  # some clients hold fewer (5), some many more
    cfg = small("dfca", dfca={"variant": "robust", "screen": True})
    algorithm = simulate(cfg, data=ragged_data(cfg, wide=wide)).algorithm
    assert isinstance(algorithm, dfca_algorithm.DFCA)
    rows = torch.arange(cfg.data.clients).flip(0)[::2]  # some rows, out of order
    for sender in (0, 3):
        model = {n: v[sender, 1] for n, v in algorithm.params.items()}
        copies = {n: v.unsqueeze(0).expand(rows.shape[0], *v.shape) for n, v in model.items()}  # one per row
        each = algorithm.sample_loss(rows, copies)
        torch.testing.assert_close(algorithm.model_sample_loss(rows, model), each, rtol=1e-5, atol=1e-6)


def test_fedcref_ignores_padding() -> None:
    cfg = ExperimentConfig.model_validate({
        "name": "ragged", "algorithm": "fedcref", "rounds": 2, "seed": 3,
        "data": {"dataset": "digits", "clients": 6, "samples_per_category": 30},
        "fedcref": {"layers": [16, 8], "local_epochs": 1, "fedavg_rounds": 1, "batch_size": 16}})
    data = prepare(cfg).data
    counts = (data.y_train >= 0).sum(1).tolist()
    ragged = cut(data, [max(10, c - 13 * i) for i, c in enumerate(counts)])
    clean, dirty = simulate(cfg, data=ragged), simulate(cfg, data=poisoned(ragged, seed=1))
    assert clean.summary["final_acc"] == dirty.summary["final_acc"]
    assert clean.summary["communities_found"] == dirty.summary["communities_found"]


def test_equal_clients_given_as_a_list_run_as_the_built_in_federation() -> None:
    """from_clients over clients of one size builds the same tensors: the run is the built-in run, to the bit."""
    cfg = small("dfca")
    data = prepare(cfg).data
    same = cut(data, [data.y_train.shape[1]] * data.num_clients)
    assert not same.is_ragged
    a, b = final_state(cfg, data), final_state(cfg, same)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sample_weights_are_each_clients_real_count() -> None:
    cfg = small("ifca")
    data = ragged_data(cfg)
    ctx = prepare(cfg, data)
    counts = data.train_sizes
    assert torch.equal(sample_counts(data), counts.float())
    model = model_from_config(cfg.model, data.input_shape, data.num_classes, "cpu")
    hosted = HostContext(cfg, model, data, list(range(data.num_clients)), neighbours(ctx.graph), torch.device("cpu"))
    ifca = clients_of(hosted)
    ifca.begin_round(0)
    upload = ifca.send(ifca.exchanges(0)[0])
    assert torch.equal(upload.tensors["samples"], counts.float())
    # DFCA's one-hop merge: each message carries its sender's n_i, and a client's own copy weighs its own
    dfca_cfg = small("dfca", dfca={"variant": "paper"})
    dfca = clients_of(HostContext(dfca_cfg, model, data, list(range(data.num_clients)), neighbours(ctx.graph),
                                  torch.device("cpu")))
    round_ = dfca.schedule.total_rounds - 1
    dfca.begin_round(round_)
    (models,) = dfca.exchanges(round_)
    out = dfca.send(models)
    assert torch.equal(out.tensors["samples"], counts.float()[out.row])
    assert torch.equal(dfca.weight.max(1).values, counts.float())
    # federated k-means: a point weighs 1 / m_i of its own node, padding nothing
    km_cfg = small("fedkmeans")
    km_data = ragged_data(km_cfg)
    km = clients_of(HostContext(km_cfg, model, km_data, list(range(km_data.num_clients)), {}, torch.device("cpu")))
    m = km_data.train_sizes
    assert torch.allclose(km.point_weight.sum(1), torch.ones(km_data.num_clients))
    assert torch.equal((km.point_weight > 0).sum(1), m)


def test_a_clients_sample_order_is_its_own_whatever_its_padding() -> None:
    """A client permutes its own samples (padding last), the same at any padded width; a full client as before."""
    seeds, counts = [11, 12, 13], [4, 9, 9]
    narrow = client_permutations(seeds, 9, 2, counts)
    wide = client_permutations(seeds, 30, 2, counts)
    assert torch.equal(wide[:, :, :9], narrow)
    assert torch.equal(narrow[1:], client_permutations(seeds[1:], 9, 2))
    assert sorted(narrow[0, 1, :4].tolist()) == [0, 1, 2, 3] and narrow[0, 0, 4:].tolist() == list(range(4, 9))


def lognormal_sizes(clients: int, median: float, most: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.round(rng.lognormal(math.log(median), 1.0, clients)), 2, most).astype(int)
    sizes[0] = most
    return sizes.tolist()


def test_padding_memory_is_bounded_by_size_buckets() -> None:
    """Lognormal sizes (median 100, max 2,000) would pad to ~12x the real rows: buckets keep it under BUCKET_SPREAD,
    every client in exactly one bucket, its own samples intact, and a worker's part still bucketed and counted."""
    sizes = lognormal_sizes(200, 100, 2000, seed=0)
    assert 200 * max(sizes) > BUCKET_ABOVE * sum(sizes)
    train = [(torch.full((n, 3), float(i)), torch.full((n,), i % 10)) for i, n in enumerate(sizes)]
    test = [(torch.full((5, 3), float(i)), torch.full((5,), i % 10)) for i in range(200)]
    data = from_clients(train, test, torch.arange(200) % 2, 10)
    assert data.is_bucketed and data.padding_overhead <= BUCKET_SPREAD
    rows = torch.cat([r for r, _ in data.blocks() if r is not None])
    assert sorted(rows.tolist()) == list(range(200))
    for rows_, part in data.blocks():
        assert part.train_sizes.max() <= BUCKET_SPREAD * part.train_sizes.min()
        assert torch.equal(part.train_sizes, torch.tensor(sizes)[rows_])
    (x, y), (xt, _) = data.client_shards(57)
    assert x.shape[0] == sizes[57] and bool((x == 57).all()) and bool((y == 57 % 10).all()) and xt.shape[0] == 5
    whole = data.padded()
    assert whole.x_train.shape[1] == max(sizes) and torch.equal(whole.train_sizes, torch.tensor(sizes))
    part = data.subset([5, 0, 57])
    assert torch.equal(part.train_sizes, torch.tensor([sizes[5], sizes[0], sizes[57]]))
    assert part.is_ragged and bool((part.client_shards(2)[0][0] == 57).all())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("local_steps", [None, 10])
def test_a_ragged_rotated_federation_recovers_its_clusters(local_steps: int | None) -> None:
    """Rotated MNIST (k = 2), clients of 20 to 400 samples: DFCA in the simulator finds both clusters (ARI >= 0.95),
    and the summary reports the sizes and the padding overhead; also when every client does 10 steps a round."""
    cfg = ExperimentConfig.model_validate({
        "name": "ragged", "algorithm": "dfca", "clusters": 2, "rounds": 10, "seed": 1,
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": 12, "train_per_client": 400,
                 "test_per_client": 50},
        "model": {"kind": "mlp", "hidden": 32},
        "train": {"lr": 0.1, "local_epochs": 1, "batch_size": 20, "local_steps": local_steps},
        "topology": {"kind": "erdos_renyi", "p": 0.4},
    })
    data = prepare(cfg).data
    sizes = spread_sizes(400, 12, 20)
    ragged = cut(data, sizes, [max(10, s // 8) for s in sizes])
    assert min(ragged.train_sizes.tolist()) == 20 and max(ragged.train_sizes.tolist()) == 400
    result = simulate(cfg, data=ragged)
    assert result.summary["cluster_ari"] >= 0.95
    assert result.summary["samples_per_client"][0] == 20 and result.summary["samples_per_client"][2] == 400
    assert result.summary["padding_overhead"] == pytest.approx(ragged.padding_overhead)
    assert result.summary["test_accuracy"] > 0.6


FIXED_STEPS = {"lr": 0.1, "local_epochs": 2, "batch_size": 8, "local_steps": 3}


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("algorithm", ["dfca", "ifca", "dfedavgm", "fedspd"])
def test_fixed_local_steps_never_read_padding(algorithm: str, wide: bool) -> None:
    """With train.local_steps every algorithm still ends in the same state, to the bit, whatever the padding holds."""
    cfg = small(algorithm, train={**FIXED_STEPS, "momentum": 0.5 if algorithm == "dfedavgm" else 0.0})
    data = ragged_data(cfg, wide=wide)
    clean, dirty = final_state(cfg, data), final_state(cfg, poisoned(data, seed=3))
    assert clean.keys() == dirty.keys()
    for name, value in clean.items():
        assert torch.equal(value, dirty[name]), name
    assert any(not torch.equal(value, final_state(small(algorithm), data)[name]) for name, value in clean.items())


def test_a_fixed_step_stream_walks_fresh_permutations_of_the_clients_own_samples() -> None:
    """Each run of n_i positions is a permutation of the client's own (kept) samples, whatever its padded width; a
    client with no kept sample gets none."""
    narrow = torch.arange(9).unsqueeze(0) < torch.tensor([[4], [9], [0]])
    wide = torch.arange(30).unsqueeze(0) < torch.tensor([[4], [9], [0]])
    stream = step_streams([11, 12, 13], narrow, 20)
    assert torch.equal(stream, step_streams([11, 12, 13], wide, 20))
    for lo in range(0, 16, 4):
        assert sorted(stream[0, lo : lo + 4].tolist()) == [0, 1, 2, 3]
    assert sorted(stream[1, :9].tolist()) == list(range(9)) and sorted(stream[1, 9:18].tolist()) == list(range(9))
    assert not torch.equal(stream[0, :4], stream[0, 4:8]) or not torch.equal(stream[0, 4:8], stream[0, 8:12])
    assert stream[2].tolist() == [0] * 20
    chosen = torch.tensor([[True, False, True, False, True, False, False, False, False]])
    assert sorted(step_streams([11], chosen, 6)[0, :3].tolist()) == [0, 2, 4]


def test_every_client_does_exactly_its_local_steps_on_its_own_samples() -> None:
    """local_sgd with local_steps equals a hand loop on each client alone: epochs x local_steps steps of batch_size
    samples, walking its own samples (step_streams), small and large clients alike, bucketed or not."""
    cfg = small("ifca")
    data = ragged_data(cfg, wide=True)
    assert data.is_bucketed
    model = model_from_config(cfg.model, data.input_shape, data.num_classes, "cpu")
    start = model.init(data.num_clients, torch.Generator().manual_seed(0))
    seeds = round_seeds(cfg.seed, list(range(data.num_clients)), 0)
    trained = {k: v.clone() for k, v in start.items()}
    epochs, steps, batch, lr = 2, 3, 8, 0.1
    local_sgd(model, trained, data, lr=lr, epochs=epochs, batch_size=batch, seeds=seeds, local_steps=steps)
    for client in range(data.num_clients):
        (x, y), _ = data.client_shards(client)
        order = step_streams([seeds[client]], torch.ones(1, x.shape[0], dtype=torch.bool), epochs * steps * batch)[0]
        p = {k: v[client : client + 1].clone() for k, v in start.items()}
        for lo in range(0, order.numel(), batch):
            pick = order[lo : lo + batch]
            for v in p.values():
                v.requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(model.logits(p, x[pick].unsqueeze(0))[0], y[pick])
            grads = torch.autograd.grad(loss, list(p.values()))
            p = {k: (v - lr * g).detach() for (k, v), g in zip(p.items(), grads, strict=True)}
        for k, v in p.items():
            assert torch.allclose(trained[k][client], v[0], atol=1e-5), (client, k)
    assert data.train_sizes.min() < batch < data.train_sizes.max()  # clients smaller and larger than one batch
