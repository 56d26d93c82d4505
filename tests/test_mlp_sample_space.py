"""The MLP's local SGD in sample space (first_layer="samples") is the textbook step (first_layer="weights")
rearranged: the same values, within float tolerance, for every option the step has."""

from __future__ import annotations

import pytest
import torch
from test_driver_equivalence import DEVICES

from dfca.config import ExperimentConfig
from dfca.data import build_federated_data
from dfca.models.batched import client_permutations, in_order, put_in_order
from dfca.models.mlp import MLP


def trained(form: str, init: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, orders: torch.Tensor,
            batch: int, momentum: float, mask: torch.Tensor | None, classes: int = 10) -> dict[str, torch.Tensor]:
    p = {k: v.clone() for k, v in init.items()}
    MLP(x.shape[-1], init["w1"].shape[-1], classes, form).sgd(p, x, y, 0.1, orders, batch, momentum, mask)
    return p


def float64_problem(clients: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Generator]:
    """A small float64 problem: init models, data [clients, 22, 30], labels, 3 epochs of orders, its generator."""
    n, d, h = 22, 30, 16
    g = torch.Generator().manual_seed(seed)
    init = {k: v.double() for k, v in MLP(d, h, 10).init(clients, g).items()}
    x = torch.rand(clients, n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (clients, n), generator=g)
    return init, x, y, client_permutations(list(range(clients)), n, 3), g


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("batch", [4, 7])  # 7 leaves a short last batch of the 22 samples
def test_sample_space_sgd_is_the_weight_space_sgd_in_float64(momentum: float, masked: bool, batch: int) -> None:
    clients, n = 5, 22
    init, x, y, orders, g = float64_problem(clients, 0)
    mask = None
    if masked:
        mask = torch.rand(clients, n, generator=g) < 0.6
        mask[2] = False  # a client with nothing to train on
    weights = trained("weights", init, x, y, orders, batch, momentum, mask)
    samples = trained("samples", init, x, y, orders, batch, momentum, mask)
    for k in init:
        assert (weights[k] - init[k]).abs().max() > 0.01  # training moved every parameter
        torch.testing.assert_close(samples[k], weights[k], rtol=0, atol=1e-12)
    if masked:
        for k in init:
            torch.testing.assert_close(samples[k][2], init[k][2], rtol=0, atol=0)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sample_space_sgd_on_mnist_errs_no_more_than_the_weight_space_sgd(momentum: float) -> None:
    """In float32 on the bundled MNIST (80 samples, 5 epochs, batch 10), each form's distance from a float64 run
    is float rounding, of the same size for both."""
    cfg = ExperimentConfig.model_validate({
        "name": "t", "clusters": 2, "rounds": 1,
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": 8, "train_per_client": 80,
                 "test_per_client": 10}, "model": {"kind": "mlp", "hidden": 200}})
    data = build_federated_data(cfg)
    x, y = data.x_train.reshape(8, 80, -1), data.y_train
    init = MLP(784, 200, 10).init(8, torch.Generator().manual_seed(0))
    orders = client_permutations(list(range(8)), 80, 5)
    exact = trained("weights", {k: v.double() for k, v in init.items()}, x.double(), y, orders, 10, momentum, None)
    for form in ("weights", "samples"):
        p = trained(form, init, x, y, orders, 10, momentum, None)
        for k in init:
            moved = float((exact[k] - init[k]).abs().max())
            assert float((p[k].double() - exact[k]).abs().max()) < 1e-5 * max(moved, 1.0), (form, k)


def test_auto_picks_the_form_with_fewer_multiply_adds() -> None:
    mlp = MLP(784, 200, 10)
    assert mlp.sgd_form(80, 5) == "samples"  # the peers' workload: 73 against 251 M multiply-adds
    assert mlp.sgd_form(66, 5) == "samples"
    assert mlp.sgd_form(80, 1) == "weights"  # one epoch: forming K and P0 costs more than it saves
    assert mlp.sgd_form(2_000, 5) == "weights"  # many samples: K alone costs more
    assert MLP(2, 32, 4).sgd_form(40, 5) == "weights"  # blobs: two features, nothing to save
    assert MLP(784, 200, 10, "weights").sgd_form(80, 5) == "weights"
    cost = mlp.first_layer_multiply_adds(80, 5)
    assert cost == {"weights": 5 * 80 * 2 * 784 * 200,
                    "samples": 80 * 80 * 784 + 2 * 80 * 784 * 200 + 5 * 80 * 80 * 200}
    with pytest.raises(ValueError, match="first_layer"):
        MLP(4, 4, 2, "dual")


def test_in_order_and_put_in_order_are_per_client_gathers_and_scatters() -> None:
    t = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    order = torch.tensor([[2, 0, 3, 1], [1, 3, 0, 2]])
    got = in_order(t, order)
    for b in range(2):
        torch.testing.assert_close(got[b], t[b, order[b]])
    back = torch.zeros_like(t)
    put_in_order(back, order, got)
    torch.testing.assert_close(back, t)
    labels = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert in_order(labels, order).tolist() == [[7, 5, 8, 6], [2, 4, 1, 3]]


@pytest.mark.parametrize("device", DEVICES)
def test_both_forms_agree_on_every_device(device: str) -> None:
    """On each device the machine has (a GPU's `cuda` case runs where one is present), the two forms agree with
    each other and with the CPU."""
    g = torch.Generator().manual_seed(3)
    init = MLP(50, 24, 10).init(6, g)
    x, y = torch.rand(6, 30, 50, generator=g), torch.randint(0, 10, (6, 30), generator=g)
    orders = client_permutations(list(range(6)), 30, 4)
    cpu = trained("weights", init, x, y, orders, 5, 0.9, None)
    on = {k: v.to(device) for k, v in init.items()}
    for form in ("weights", "samples"):
        p = trained(form, on, x.to(device), y.to(device), orders, 5, 0.9, None)
        for k in init:
            assert p[k].device.type == torch.device(device).type
            torch.testing.assert_close(p[k].cpu(), cpu[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["weights", "samples"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_clients_trained_in_blocks_of_any_size_train_as_each_alone(
    form: str, momentum: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLP.client_block groups clients into blocks by their working set; a client's training must not depend on which
    block it is in or how big that block is (in float64 the blocks agree to the last bit but for BLAS's blocking)."""
    clients, n, d, h = 11, 22, 30, 16
    init, x, y, orders, g = float64_problem(clients, 3)
    mask = torch.rand(clients, n, generator=g) < 0.7
    results = []
    for fewest, size in ((1, 1), (4, 4), (32, 11)):  # each client alone; blocks of 4, 4, 3; one block of 11
        monkeypatch.setattr("dfca.models.mlp.CLIENT_BLOCK", fewest)
        monkeypatch.setattr("dfca.models.mlp.BLOCK_BYTES", 0)
        assert MLP(d, h, 10, form).client_block(clients, n, form) == size
        results.append(trained(form, init, x, y, orders, 5, momentum, mask))
    for k in init:
        assert (results[0][k] - init[k]).abs().max() > 0.01
        for other in results[1:]:
            torch.testing.assert_close(other[k], results[0][k], rtol=0, atol=1e-12)


def test_client_blocks_are_even_and_follow_the_working_set() -> None:
    mlp = MLP(784, 200, 10)
    assert mlp.client_block(100, 80, "samples") == 100  # 154 KB a client: the benchmark's 100 in one block
    assert mlp.client_block(1000, 80, "samples") == 100  # ten blocks of 100 (104 fit 16 MB)
    assert mlp.client_block(100, 80, "weights") == 25  # w1 is 627 KB a client: four even blocks, not 32+32+32+4
    assert mlp.client_block(240, 66, "samples") == 120  # 123 KB a client at 66 samples: 136 fit, two blocks of 120
    assert MLP(784, 2048, 10).client_block(240, 66, "samples") == 30  # 1.1 MB a client: at least 32, evened
    assert mlp.client_block(0, 80, "samples") == 1  # nothing to train: still a valid step
    assert mlp.client_block(3000, 80, "samples", device_type="cuda") == 3000  # a GPU: up to 1 GiB a block
    assert mlp.client_block(10000, 80, "samples", device_type="cuda") == 5000
    assert mlp.client_block(3000, 80, "weights", device_type="cuda") == 1500  # 1,712 fit: two blocks
    empty = {k: v[:0] for k, v in mlp.init(1, torch.Generator().manual_seed(0)).items()}
    mlp.sgd(empty, torch.zeros(0, 80, 784), torch.zeros(0, 80, dtype=torch.long), 0.1,
            client_permutations([], 80, 5), 10)


def test_client_permutations_are_each_clients_own_seeded_randperms() -> None:
    """The sample orders (one generator reseeded per client, stacked once) are the definition: each client's own
    torch.Generator seeded with its seed, one randperm per epoch; results everywhere depend on it."""
    seeds = [0, 5, 2**61 + 7, 123456789]
    orders = client_permutations(seeds, 66, 5)
    for b, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(seed)
        for e in range(5):
            assert torch.equal(orders[b, e], torch.randperm(66, generator=g))
    assert client_permutations(seeds, 66, 0).shape == (4, 0, 66)
    assert client_permutations([], 66, 5).shape == (0, 5, 66)
