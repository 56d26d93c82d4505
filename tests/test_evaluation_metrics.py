"""Disp_j and the cross-client index consistency, against their definitions on small models."""

from __future__ import annotations

import pytest
import torch
from test_driver_equivalence import DEVICES

from dfca.results import evaluation
from dfca.results.evaluation import disagreement, index_consistency


def params_of(n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, k, 5, 3, generator=g), "b": torch.randn(n, k, 3, generator=g)}


def flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    n, k = params["w"].shape[:2]
    return torch.cat([t.reshape(n, k, -1) for t in params.values()], 2)


def test_disagreement_is_mean_squared_distance_to_the_network_mean() -> None:
    params = params_of(7, 3, seed=0)
    f = flat(params)
    expected = [float(((f[:, j] - f[:, j].mean(0)) ** 2).sum(1).mean()) for j in range(3)]
    for got, want in zip(disagreement(params), expected, strict=True):
        assert abs(got - want) < 1e-4 * max(1.0, want)
    same = {name: t[:1].repeat(7, 1, *[1] * (t.dim() - 2)) for name, t in params.items()}
    assert disagreement(same) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_disagreement_of_nearly_agreeing_models_is_accurate_over_several_blocks_of_rows(device: str) -> None:
    """After consensus the models differ by little: Disp_j must not vanish in rounding (the shifted form), also
    with more clients than one block of rows (evaluation.SPREAD_ROWS) and a short last block."""
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(1, 2, 40, 30, generator=g) * 5 + 3, "b": torch.randn(1, 2, 30, generator=g)}
    params = {name: t + 1e-4 * torch.randn(21, *t.shape[1:], generator=g) for name, t in base.items()}
    f = flat(params).double()
    expected = [float(((f[:, j] - f[:, j].mean(0)) ** 2).sum(1).mean()) for j in range(2)]
    got = disagreement({name: t.to(device) for name, t in params.items()})
    for value, want in zip(got, expected, strict=True):
        assert abs(value - want) < 1e-4 * want and want > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["auto", "edges", "gram", "blocks", "blocks of 1"])
def test_index_consistency_counts_edges_whose_nearest_match_is_the_identity(
        device: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each form on each device against the definition: edge by edge from views, from one Gram matrix, in blocks
    of gathered edges (every edge in one block, and one edge a block)."""
    if form == "blocks of 1":
        monkeypatch.setattr(evaluation, "GPU_EDGE_BLOCK_BYTES", 1)
        form = "blocks"
    n, k = 6, 3
    base = params_of(1, k, seed=1)
    params = {name: t.repeat(n, 1, *[1] * (t.dim() - 2)) + 0.01 * torch.randn(n, k, *t.shape[2:])
              for name, t in base.items()}
    ring = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        ring[i, (i + 1) % n] = ring[(i + 1) % n, i] = True

    def consistency(params: dict[str, torch.Tensor], adjacency: torch.Tensor) -> float:
        return index_consistency({name: t.to(device) for name, t in params.items()}, adjacency.to(device),
                                 form)  # type: ignore[arg-type]

    assert consistency(params, ring) == 1.0
    for t in params.values():  # client 2 swaps its clusters 0 and 1: its two ring edges disagree
        t[2, [0, 1]] = t[2, [1, 0]].clone()
    assert consistency(params, ring) == (n - 2) / n
    # against the definition: nearest cluster by L2 over all parameters, per edge; on a dense random graph with
    # every client's clusters shuffled
    g = torch.Generator().manual_seed(3)
    for t in params.values():
        for i in range(n):
            t[i] = t[i][torch.randperm(k, generator=g)].clone()
    dense = torch.rand(n, n, generator=g) < 0.7
    dense = torch.triu(dense, 1) | torch.triu(dense, 1).T
    dense[n - 1, :] = dense[:, n - 1] = False  # a client without edges: the Gram form gathers the others
    f = flat(params)
    src, dst = torch.nonzero(torch.triu(dense, 1), as_tuple=True)
    ok = sum(bool((torch.cdist(f[a], f[b]).argmin(1) == torch.arange(k)).all()) for a, b in zip(src, dst, strict=True))
    assert 0 < ok < src.numel() and consistency(params, dense) == ok / src.numel()
    assert consistency(params, torch.zeros(n, n, dtype=torch.bool)) == 1.0  # no edges


def test_auto_takes_the_gram_form_on_small_dense_graphs_and_edges_on_large_sparse_ones() -> None:
    k, h = 2, 64
    def per_client(n: int) -> list[torch.Tensor]:
        return [torch.zeros(n, k, 784 * h), torch.zeros(n, k, h * 10)]
    g = torch.Generator().manual_seed(0)
    dense = torch.triu(torch.rand(24, 24, generator=g) < 0.5, 1)  # the runtime benchmark's graph: ~140 edges
    assert evaluation.gram_is_cheaper(k, per_client(24), *torch.nonzero(dense, as_tuple=True))
    src = torch.randperm(1000, generator=g)[:200]  # 200 edges sampled among 1,000 clients
    dst = torch.randperm(1000, generator=g)[:200]
    assert not evaluation.gram_is_cheaper(k, per_client(1000), src, dst)
