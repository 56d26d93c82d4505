"""A small residual CNN for 32x32 images (CIFAR-10), ResNet-8 in the style of He et al.: a 3x3 stem, three stages of
one residual block each (16, 32, 64 channels; the last two halve the resolution), global average pooling and a
linear head. About 78k parameters at width 16.

Use it with `model: {kind: torch, factory: "examples/resnet_cifar/model.py:make", options: {width: 16}}`; the factory
is `make(input_shape, num_classes, **options)`. Any input size works (the pooling is global); the BatchNorm layers'
running statistics are each client's own (docs/configuration.md, "Your own model").
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN, plus the input (through a strided 1x1 conv where the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet8(nn.Module):
    def __init__(self, channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def make(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    """input_shape: (channels, height, width) of one image."""
    return ResNet8(input_shape[0], num_classes, width)
