"""benchmarks/kernel_floor.py records what a piece of tensor code runs: every product with its FLOPs, the other
kernels by kind, each timed alone (index calls with their own indices); recording does not change what the code
computes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_floor import kernel_floor  # noqa: E402
from test_driver_equivalence import DEVICES  # noqa: E402

from dfca.models.batched import client_permutations  # noqa: E402
from dfca.models.mlp import MLP  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
def test_calls_are_sorted_by_kind_and_products_counted_by_their_shapes(device: str) -> None:
    a, b, c = (torch.randn(3, 4, 5, device=device), torch.randn(3, 5, 6, device=device),
               torch.randn(3, 4, 6, device=device))
    rows = torch.tensor([2, 0], device=device)
    out: dict[str, torch.Tensor] = {}

    def code() -> None:
        p = torch.bmm(a, b)  # 2 * 3 * 4 * 5 * 6 FLOPs
        q = torch.baddbmm(c, a, b)  # the same product, and an add
        out["y"] = (p + q).relu()[:, 1:].index_select(0, rows)  # two elementwise, a view, an indexed copy
        out["z"] = torch.zeros(3, device=device)  # a tensor created: nothing to time

    floor = kernel_floor(code)
    assert floor.calls == {"product": 2, "elementwise": 2, "view": 1, "data movement": 1, "not timed": 1}
    assert floor.product_flops == 2 * (2 * 3 * 4 * 5 * 6)
    assert floor.seconds.keys() == {"product", "elementwise", "data movement"}
    assert all(seconds > 0 for seconds in floor.seconds.values())
    assert [count for _, count, _, _ in floor.product_shapes] == [1, 1]
    expected = (torch.bmm(a, b) + torch.baddbmm(c, a, b)).relu()[:, 1:].index_select(0, rows)
    assert torch.equal(out["y"], expected)  # recorded while it ran, computed as without the recorder


@pytest.mark.parametrize("form", ["weights", "samples"])
def test_the_mlp_steps_products_are_the_flops_the_benchmark_counts(form: str) -> None:
    """simulator_round.py divides by 2 x MLP.first_layer_multiply_adds + 6hc a sample and epoch; the products the
    kernel actually runs must add up to exactly that, in either form and with a short last batch."""
    clients, n, d, h, c, epochs, batch = 5, 22, 30, 16, 10, 3, 7
    mlp = MLP(d, h, c, form)
    params = mlp.init(clients, torch.Generator().manual_seed(0))
    x, y = torch.rand(clients, n, d), torch.randint(0, c, (clients, n))
    orders = client_permutations(list(range(clients)), n, epochs)
    floor = kernel_floor(lambda: mlp.sgd(params, x, y, 0.1, orders, batch))
    executed = clients * (2 * mlp.first_layer_multiply_adds(n, epochs)[form] + 6 * h * c * epochs * n)
    assert floor.product_flops == executed
