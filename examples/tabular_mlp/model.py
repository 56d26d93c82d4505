"""A tabular MLP: features -> [Linear, LayerNorm, ReLU, Dropout] x depth -> Linear.

Use it with `model: {kind: torch, factory: "examples/tabular_mlp/model.py:make", options: {hidden: 64}}`; the factory
is `make(input_shape, num_classes, **options)` and flattens whatever one sample is (a row of features, or an image
read as its pixels). Each client draws its own dropout masks while it trains; evaluation runs without dropout.
"""

from __future__ import annotations

import math

from torch import nn


def make(input_shape: tuple[int, ...], num_classes: int, hidden: int = 64, depth: int = 2,
         dropout: float = 0.1) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(dropout)]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
