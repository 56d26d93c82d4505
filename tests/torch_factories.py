"""Model factories the tests name in configs (`model: {kind: torch, factory: "torch_factories:NAME"}`; tests/ is on
the path), each `make(input_shape, num_classes, **options) -> nn.Module`, and some that a run must refuse."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 16) -> nn.Module:
    """The built-in MLP as a module: Linear(d, h), ReLU, Linear(h, classes) ("1.weight" is w1 transposed)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))


def batch_norm_cnn(input_shape: tuple[int, ...], num_classes: int, channels: int = 6) -> nn.Module:
    return nn.Sequential(nn.Conv2d(input_shape[0], channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(channels * (input_shape[1] // 2) * (input_shape[2] // 2), num_classes))


def dropout_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 32, p: float = 0.3) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.LayerNorm(hidden), nn.ReLU(),
                         nn.Dropout(p), nn.Linear(hidden, num_classes))


class DataDependent(nn.Module):
    """Branches on its input's values: vmap cannot batch that (a Python `if` on a batched tensor)."""

    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1)
        if x.sum() > 0:
            x = x * 0.5
        return self.linear(x)


def data_dependent(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return DataDependent(math.prod(input_shape), num_classes)


def not_a_module(input_shape: tuple[int, ...], num_classes: int) -> object:
    return {"weights": [1, 2, 3]}


def too_many_classes(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes + 1))


def not_finite(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    module = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
    with torch.no_grad():
        module[1].weight[0, 0] = float("nan")
    return module


def raises(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    raise RuntimeError("this factory always fails")
