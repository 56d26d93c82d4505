"""8-bit payloads: a float tensor as int8 codes and one float32 scale per row of its last dimension.

    s_r = max_c |x_rc| / 127,   q_rc = round(x_rc / s_r) in [-127, 127],   x_rc ~ q_rc s_r

The error of a coordinate is at most s_r / 2, 1/254 of its row's largest magnitude. A row of zeros has
scale 0 and comes back as zeros. Quantising what `dequantize` returned gives the same codes again, so a
value that crossed the wire once crosses it again unchanged (the simulator rounds what it delivers with
these functions, the message driver encodes with them; both drivers see the same numbers).
"""

from __future__ import annotations

import torch
from torch import Tensor

LEVELS = 127


def _rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x as float32 rows [R, C] (a 0-d tensor is one row of one) and each row's scale s_r [R]."""
    x = x.detach().float()
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    peak = torch.maximum(rows.amax(1), -rows.amin(1))  # max |x_rc| without an |x| copy (aminmax is slower here)
    return rows, peak.abs_() / LEVELS  # abs: a row of zeros has scale +0, whichever zero maximum(0, -0) gives


def _codes(rows: Tensor, scale: Tensor) -> Tensor:
    """round(x_rc / s_r) clamped to [-LEVELS, LEVELS], as float32 (a new tensor; a row of zeros has scale 0: its
    codes are 0 / tiny = 0)."""
    codes = rows / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    return codes.round_().clamp_(-LEVELS, LEVELS)


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """(codes int8 [..., C], scale float32 [...]) of a float tensor [..., C]; a 0-d tensor is one row of one."""
    rows, scale = _rows(x)
    return _codes(rows, scale).to(torch.int8).reshape(x.shape), scale.reshape(x.shape[:-1])


def dequantize(codes: Tensor, scale: Tensor) -> Tensor:
    """The float32 tensor that (codes, scale) stand for: a float32 copy of the codes, scaled in place. Both passes
    are vectorised; `torch.mul(codes, scale)` does it in one pass but converts each int8 code on its own, and took
    1.1-1.7x as long on one thread for a batch of arrivals read from flushed caches, as a driver meets them
    (`benchmarks/wire_batches.py`)."""
    return codes.to(torch.float32, copy=True).mul_(scale.float().unsqueeze(-1) if codes.dim() else scale.float())


def round_trip_into(x: Tensor, out: Tensor) -> Tensor:
    """round_trip(x) written into out, a contiguous float32 tensor of x's shape (x may be out itself): no tensor
    as large as x is allocated, and x is read twice (its scales, then its codes), where the same buffer is rounded
    again and again."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    dest = out.view(rows.shape)
    scale = torch.maximum(rows.amax(1), -rows.amin(1)).float().abs_().div_(LEVELS)
    torch.div(rows, scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1), out=dest)
    dest.round_().clamp_(-LEVELS, LEVELS).mul_(scale.unsqueeze(1))
    return out


def round_trip(x: Tensor) -> Tensor:
    """What x is after crossing the wire as 8-bit codes, in x's dtype and on its device: dequantize(*quantize(x)),
    value for value (codes are integers below 128, exact in float32), in one working copy instead of four."""
    rows, scale = _rows(x)
    return _codes(rows, scale).mul_(scale.unsqueeze(1)).reshape(x.shape).to(x.dtype)
