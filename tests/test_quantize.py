"""core.quantize: 8-bit codes with a scale per row, pinned to their definition."""

from __future__ import annotations

import torch

from dfca.core.quantize import LEVELS, dequantize, quantize, round_trip, round_trip_into


def test_codes_are_the_rounded_ratio_to_each_rows_largest_magnitude() -> None:
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    codes, scale = quantize(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and scale.shape == (3, 5)
    expected_scale = x.abs().amax(-1) / LEVELS
    torch.testing.assert_close(scale, expected_scale)
    assert torch.equal(codes, (x / expected_scale.unsqueeze(-1)).round().to(torch.int8))
    assert int(codes.abs().max()) == LEVELS
    assert bool(((dequantize(codes, scale) - x).abs() <= expected_scale.unsqueeze(-1) / 2 + 1e-7).all())


def test_a_row_of_zeros_stays_zero_and_a_second_trip_changes_nothing() -> None:
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    x[2] = 0.0
    once = round_trip(x)
    assert torch.equal(once[2], torch.zeros(9))
    assert torch.equal(round_trip(once), once)
    assert round_trip(x.double()).dtype == torch.float64


def test_the_one_copy_round_trip_is_decoding_the_codes_value_for_value() -> None:
    x = torch.randn(6, 4, 33, generator=torch.Generator().manual_seed(2)) * 5
    x[3, 1] = 0.0
    assert torch.equal(round_trip(x), dequantize(*quantize(x)))
    assert torch.equal(round_trip(torch.tensor(2.5)), dequantize(*quantize(torch.tensor(2.5))))


def test_the_round_trip_into_a_buffer_is_the_round_trip_value_for_value() -> None:
    x = torch.randn(5, 3, 17, generator=torch.Generator().manual_seed(3)) * 4
    x[1, 2] = 0.0
    out = torch.full_like(x, float("nan"))
    assert round_trip_into(x, out) is out
    assert torch.equal(out, round_trip(x))
    in_place = x.clone()  # the buffer may be x itself
    assert torch.equal(round_trip_into(in_place, in_place), round_trip(x))
    assert torch.equal(round_trip_into(torch.tensor(-1.5), torch.empty(())), round_trip(torch.tensor(-1.5)))
