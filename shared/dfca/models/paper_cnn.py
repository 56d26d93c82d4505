"""The paper's CNN (DFCA A.1), trained every client at once through dfca.models.torch_model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    pass



class PaperCNN(nn.Module):
    """DFCA A.1: two conv layers, each followed by ReLU, max-pool and batch norm; then a linear head."""

    def __init__(self, channels: int, side: int, classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 32, 5, padding=2)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc = nn.Linear(64 * (side // 4) ** 2, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.bn1(F.max_pool2d(F.relu(self.conv1(x)), 2))
        x = self.bn2(F.max_pool2d(F.relu(self.conv2(x)), 2))
        return self.fc(x.flatten(1))
