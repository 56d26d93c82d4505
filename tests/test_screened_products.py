"""core.screened_gossip's products with a step's arrivals: taken at the (row, message) pairs that are read alone
(CSR, where they are few) they give what the products of every pair give at those pairs."""

from __future__ import annotations

import pytest
import torch
from test_driver_equivalence import DEVICES

from dfca.core import screened_gossip as sg
from dfca.core import sparse_factor

M, S, K = 12, 15, 3
SHAPES = {"w": (40, 16), "b": (5,)}  # one tensor taken at the pairs alone, one (narrow) at every pair
CLOSE: dict[str, float] = {"rtol": 1e-5, "atol": 1e-4}  # float32 sums of 640 products, taken in another order


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test on the CPU and on a GPU. On a GPU the pairs are taken alone only on far sparser graphs than these
    few rows: the GPU's density is raised to the CPU's, so the sampled products run on cuSPARSE here too."""
    if request.param != "cpu":
        monkeypatch.setattr(sg, "GPU_SPARSE_DENSITY", sg.SAMPLED_DENSITY)
        monkeypatch.setattr(sparse_factor, "GPU_SPARSE_DENSITY", sg.SAMPLED_DENSITY)
    return request.param


def models(rows: int, generator: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    return {n: torch.randn(rows, K, *shape, generator=generator).to(device) for n, shape in SHAPES.items()}


def step_inputs(density: float, device: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], ...]:
    g = torch.Generator().manual_seed(seed)
    own, arrived, anchor = models(M, g, device), models(S, g, device), models(M, g, device)
    own_den = torch.rand(M, K, generator=g) * (torch.rand(M, K, generator=g) < 0.6)  # some rows hold no weight
    arrived_den = torch.rand(S, K, generator=g) + 0.1
    read = torch.rand(M, S, K, generator=g) < density
    step = {n: torch.randn(M, *shape, generator=g).to(device) for n, shape in SHAPES.items()}
    clusters = torch.randint(0, K, (M,), generator=g)
    screen = sg.Screen(anchor, torch.ones(M, device=device), clusters.to(device), 1.0, step=step)
    return own, own_den.to(device), arrived, arrived_den.to(device), read.to(device), screen


@pytest.mark.parametrize("density", [0.1, 0.25])
def test_distances_at_the_pairs_read_are_those_of_every_pair(density: float, device: str) -> None:
    own, own_den, arrived, arrived_den, read, screen = step_inputs(density, device)
    assert sg.taken_alone(read)  # few enough: taken at the pairs alone
    every = sg.estimate_distances(arrived, arrived_den, own, own_den, screen)
    screen.cached.clear()
    sampled = sg.estimate_distances(arrived, arrived_den, own, own_den, screen, read)
    torch.testing.assert_close(sampled[read], every[read], **CLOSE)
    # and the distances themselves, formed from the estimates
    centre = {n: torch.where((own_den > sg.MIN_WEIGHT).view(M, K, *[1] * len(shape)),
                             own[n] / own_den.clamp_min(sg.MIN_WEIGHT).view(M, K, *[1] * len(shape)),
                             screen.anchor[n]) for n, shape in SHAPES.items()}
    estimate = {n: arrived[n] / arrived_den.view(S, K, *[1] * len(shape)) for n, shape in SHAPES.items()}
    direct = sum((centre[n].unsqueeze(1) - estimate[n].unsqueeze(0)).pow(2).reshape(M, S, K, -1).sum(3)
                 for n in SHAPES).sqrt()
    torch.testing.assert_close(sampled[read].float(), direct[read], rtol=1e-4, atol=1e-4)


def test_step_products_at_the_pairs_read_are_those_of_every_pair(device: str) -> None:
    _, _, arrived, _, read, screen = step_inputs(0.1, device, seed=1)
    pairs = read[:, :, 0]
    assert sg.taken_alone(pairs)
    every = sg.step_products(arrived, screen, torch.ones(M, S, dtype=torch.bool, device=device))
    assert not sg.taken_alone(torch.ones(M, S, dtype=torch.bool, device=device))  # all of them: the dense product
    sampled = sg.step_products(arrived, screen, pairs)
    torch.testing.assert_close(sampled[pairs], every[pairs], **CLOSE)
    assert (sampled[~pairs] == 0).all()


@pytest.mark.parametrize("density", [0.1, 0.9])
def test_the_mix_of_few_kept_pairs_is_the_mix_of_them_as_a_sum(density: float, device: str) -> None:
    own, own_den, arrived, arrived_den, read, _ = step_inputs(density, device, seed=2)
    delivered = read.any(2)
    clean, scale = sg.budgeted(arrived_den, 1.0 + (K - 1) * 0.5)
    keep = read & delivered.unsqueeze(2)
    out, den = sg.mixed(own, own_den, delivered, arrived, clean, scale, keep)
    divisor = delivered.sum(1).float() + 1
    for n, shape in SHAPES.items():
        expected = own[n].clone()
        for i in range(M):
            for s in range(S):
                for j in range(K):
                    if keep[i, s, j]:
                        expected[i, j] += scale[s, j] * arrived[n][s, j]
        expected /= divisor.view(M, 1, *[1] * len(shape))
        torch.testing.assert_close(out[n], expected, **CLOSE)
    torch.testing.assert_close(den, (own_den + (keep.float() * clean.unsqueeze(0)).sum(1)) / divisor.unsqueeze(1))


def test_a_merges_distances_at_the_pairs_read_are_those_of_every_pair(device: str) -> None:
    _, _, arrived, _, read, screen = step_inputs(0.1, device, seed=3)
    models = {n: v[:, 0] for n, v in arrived.items()}  # S models, one cluster each
    part = torch.randint(0, K, (S,), generator=torch.Generator().manual_seed(4)).to(device)
    delivered = read[:, :, 0]
    assert sg.taken_alone(delivered)
    every, every_along = sg.message_distances(models, part, screen)
    sampled, sampled_along = sg.message_distances(models, part, screen, delivered)
    assert every_along is not None and sampled_along is not None
    torch.testing.assert_close(sampled[delivered], every[delivered], **CLOSE)
    torch.testing.assert_close(sampled_along[delivered], every_along[delivered], **CLOSE)
    trained = {n: screen.anchor[n].clone() for n in SHAPES}  # theta_i: the anchor, its own cluster moved by its step
    for n in SHAPES:
        trained[n][torch.arange(M, device=device), screen.clusters] += screen.step[n]
    direct = sum((models[n].unsqueeze(0) - trained[n][:, part]).pow(2).reshape(M, S, -1).sum(2) for n in SHAPES).sqrt()
    torch.testing.assert_close(sampled[delivered].float(), direct[delivered], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("density", [0.1, 1.0])
def test_a_merges_products_with_anchors_and_steps_in_one_matrix_are_those_taken_apart(
        density: float, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the anchors and the steps fit in FUSED_BYTES, one product with both gives the distances and the step
    products that two products (one with each) give, at every pair and at the pairs read alone."""
    _, _, arrived, _, read, screen = step_inputs(density, device, seed=6)
    models = {n: v[:, 0] for n, v in arrived.items()}
    part = torch.randint(0, K, (S,), generator=torch.Generator().manual_seed(7)).to(device)
    delivered = read[:, :, 0]
    assert sg.anchors_and_steps(screen, "w") is not None  # these few rows: fused
    fused, fused_along = sg.message_distances(models, part, screen, delivered)
    monkeypatch.setattr(sg, "FUSED_BYTES", 0)
    screen.cached.clear()
    assert sg.anchors_and_steps(screen, "w") is None
    apart, apart_along = sg.message_distances(models, part, screen, delivered)
    assert fused_along is not None and apart_along is not None
    torch.testing.assert_close(fused[delivered], apart[delivered], **CLOSE)
    torch.testing.assert_close(fused_along[delivered], apart_along[delivered], **CLOSE)


def test_products_at_many_pairs_a_row_taken_in_column_blocks_are_those_of_every_pair(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, where the rows read take more than WHOLE_ROW_ENTRIES pairs each, the sampled product is taken a block
    of PAIR_BLOCK columns at a time (blocks that do not divide the row here): the same products, in float64 sums."""
    monkeypatch.setattr(sg, "PAIR_BLOCK", 100)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(10, 640, generator=g), torch.randn(60, 640, generator=g)
    read = torch.rand(10, 60, generator=g).argsort(1) < 2 * sg.WHOLE_ROW_ENTRIES  # 24 pairs a row
    rows, cols = read.nonzero(as_tuple=True)
    torch.testing.assert_close(sg.pair_products(a, b, rows, cols), (a @ b.T)[rows, cols].double(), **CLOSE)


def test_pairs_that_many_a_row_read_are_taken_alone_only_where_fewer_of_all_are_read() -> None:
    """taken_alone on CPU: up to SAMPLED_DENSITY of the pairs where rows read few, WIDE_ROW_DENSITY where each row
    reads more than WHOLE_ROW_ENTRIES (a sampled product then runs in column blocks, several dense multiply-adds a
    pair)."""
    few_rows = torch.zeros(8, 40, dtype=torch.bool)
    few_rows[:, :10] = True  # 10 a row, a quarter of all
    assert sg.taken_alone(few_rows)
    many = torch.zeros(8, 100, dtype=torch.bool)
    many[:, :25] = True  # 25 a row, a quarter of all
    assert not sg.taken_alone(many)
    many[:, 15:25] = False  # 15 a row, 0.15 of all
    assert sg.taken_alone(many)
    wide = torch.zeros(8, 100, 2, dtype=torch.bool)  # [R, S, k]: each (row, cluster) a row of pairs
    wide[:, :25, 0] = wide[:, 25:50, 1] = True  # 25 a (row, cluster), a quarter of all
    assert not sg.taken_alone(wide)
    narrow = torch.zeros(8, 40, 2, dtype=torch.bool)
    narrow[:, :10, 0] = narrow[:, 10:20, 1] = True  # 10 a (row, cluster), a quarter of all
    assert sg.taken_alone(narrow)
