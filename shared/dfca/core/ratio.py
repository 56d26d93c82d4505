"""Ratio consensus's (num, den) pairs: when a pair holds an estimate, and the estimate num / den.

Shared by plain consensus (core.consensus) and screened gossip (core.screened_gossip), so that both agree on what
counts as no weight (the robustness tests' forged pairs use it too).
"""

from __future__ import annotations

import torch
from torch import Tensor

MIN_WEIGHT = 1e-3  # den at or below this: no trained copy has reached the client, the pair holds no estimate


def trailing(t: Tensor, like: Tensor) -> Tensor:
    """t [M, ...] viewed with trailing singleton dimensions, to broadcast against `like`."""
    return t.reshape(*t.shape, *[1] * (like.dim() - t.dim()))


def ratio_estimate(num: Tensor, den: Tensor, own: Tensor) -> Tensor:
    """num / den where den > MIN_WEIGHT, else `own`; den's shape is a prefix of num's (e.g. [M, k] and [M, k, ...])."""
    reached = trailing(den > MIN_WEIGHT, num)
    return torch.where(reached, num / trailing(den.clamp_min(MIN_WEIGHT), num), own)
