"""dfca.core.seeding.SeedCandidates on a host of some clients: a candidate relayed from a model hosted here is held
as a receiver holds it (rounded by the wire), and one that arrived from another host is held as it arrived (the
wire's rounding is idempotent, so it is not rounded again)."""

from __future__ import annotations

import torch
from torch import Tensor

from dfca.core.quantize import round_trip
from dfca.core.seeding import SeedCandidates


class CountingWire:
    """A lossy payload's rounding (8-bit codes), counting the models it rounds."""

    def __init__(self) -> None:
        self.rounded = 0

    def __call__(self, models: dict[str, Tensor]) -> dict[str, Tensor]:
        self.rounded += next(iter(models.values())).shape[0]
        return {n: round_trip(v) for n, v in models.items()}


def hosted_seeds(wire: CountingWire) -> tuple[SeedCandidates, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(3)
    local = {"w": torch.randn(3, 4, 5, generator=g), "b": torch.randn(3, 5, generator=g)}
    seeds = SeedCandidates(local, torch.tensor([0, 1, 2]), wire)
    seeds.open(0, torch.tensor([0.1, 0.9, 0.2], dtype=torch.float64))
    return seeds, local


def test_a_candidate_from_another_host_is_held_as_it_arrived_and_a_hosted_one_rounded() -> None:
    wire = CountingWire()
    seeds, local = hosted_seeds(wire)
    g = torch.Generator().manual_seed(4)
    arrived = {n: round_trip(torch.randn(1, *v.shape[1:], generator=g)) for n, v in local.items()}  # off the wire
    # client 7 (hosted elsewhere, score 0.5) reaches rows 0 and 2; client 1 (hosted here, score 0.9) reaches row 0
    seeds.offer(torch.tensor([[True, True], [False, False], [True, False]]), torch.tensor([0.5, 0.9],
                dtype=torch.float64), torch.tensor([7, 1]),
                {n: torch.cat([arrived[n], local[n][1:2]]) for n in local})
    assert seeds.origin.tolist() == [1, 1, 7]
    models = seeds.models()
    for n, v in local.items():
        assert torch.equal(models[n][0], round_trip(v[1:2])[0])  # a hosted model, as a receiver holds it
        assert torch.equal(models[n][1], v[1])  # the row's own
        assert torch.equal(models[n][2], arrived[n][0])  # as it arrived
        assert torch.equal(round_trip(arrived[n]), arrived[n])  # the rounding it is spared changes nothing
    assert wire.rounded == 1  # row 0's alone


def test_the_check_sees_each_candidate_as_the_rows_would_hold_it() -> None:
    wire = CountingWire()
    seeds, local = hosted_seeds(wire)
    arrived = {n: round_trip(torch.full((1, *v.shape[1:]), 0.3)) for n, v in local.items()}
    seen: list[dict[str, Tensor]] = []

    def check(rows: Tensor, held: dict[str, Tensor]) -> Tensor:
        seen.append({n: v.clone() for n, v in held.items()})
        return torch.ones(rows.shape[0], dtype=torch.bool)

    seeds.offer(torch.tensor([[True, True], [False, False], [False, False]]), torch.tensor([0.5, 0.95],
                dtype=torch.float64), torch.tensor([7, 1]),
                {n: torch.cat([arrived[n], local[n][1:2]]) for n in local}, check)
    (held,) = seen
    for n, v in local.items():
        assert torch.equal(held[n][0], round_trip(v[1:2])[0])  # row 0 likes client 1's best: hosted, rounded
    assert seeds.origin.tolist() == [1, 1, 2]
    seen.clear()
    seeds.offer(torch.tensor([[False], [False], [True]]), torch.tensor([0.5], dtype=torch.float64),
                torch.tensor([7]), arrived, check)
    (held,) = seen
    for n in local:
        assert torch.equal(held[n][0], arrived[n][0])  # another host's copy, as it arrived
    assert wire.rounded == 1  # the check's hosted candidate alone (models() not read)
