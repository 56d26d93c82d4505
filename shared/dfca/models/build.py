"""The model a config names: `mlp` (the hand-written MLP), `cnn` (the paper's CNN) or `torch` (a user's module,
dfca.models.factory); both modules train through dfca.models.torch_model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dfca.sections import ModelConfig
from dfca.models.batched import BatchedModel
from dfca.models.factory import build_module
from dfca.models.mlp import MLP
from dfca.models.paper_cnn import PaperCNN
from dfca.models.torch_model import TorchModel


def build_model(
    kind: str, input_shape: tuple[int, ...], hidden: int, classes: int, device: torch.device | str = "cpu", *,
    factory: str | None = None, options: dict[str, Any] | None = None, allowed: Sequence[str] | None = None,
) -> BatchedModel:
    """`mlp`: the hand-written MLP; `cnn`: the paper's CNN; `torch`: the module `factory` makes (dfca.models.factory;
    `allowed`: the runtime's allow-list, None for `dfca run`). Both modules train through dfca.models.torch_model."""

    if kind == "mlp":
        return MLP(math.prod(input_shape), hidden, classes)
    if kind == "cnn":
        c, side = input_shape[0], input_shape[1]
        return TorchModel(lambda: PaperCNN(c, side, classes), PaperCNN(c, side, classes), input_shape, classes,
                          "the paper's CNN").to(torch.device(device))
    if kind == "torch":
        if not factory:
            raise ValueError("model.factory: kind torch needs a factory, `package.module:function`")
        kwargs = dict(options or {})
        make, module = build_module(factory, kwargs, input_shape, classes, allowed)
        shape = tuple(input_shape)
        return TorchModel(lambda: make(shape, classes, **kwargs), module, input_shape, classes,
                          factory).to(torch.device(device))
    raise ValueError(f"model.kind: unknown model {kind!r} (mlp, cnn or torch)")


def model_from_config(model: ModelConfig, input_shape: tuple[int, ...], classes: int,
                      device: torch.device | str = "cpu", allowed: Sequence[str] | None = None) -> BatchedModel:
    """The model a config's `model` section names, for data of `input_shape` and `classes`."""
    return build_model(model.kind, input_shape, model.hidden, classes, device, factory=model.factory,
                       options=model.options, allowed=allowed)
