"""Per-client tensors: what every driver hosts, images or feature vectors, on a device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class FederatedData:
    """Per-client tensors; client i's train set is (x_train[i], y_train[i])."""

    x_train: torch.Tensor  # [N, n_train, C, H, W] float32 in [0, 1]
    y_train: torch.Tensor  # [N, n_train] int64
    x_test: torch.Tensor  # [N, n_test, C, H, W] float32 in [0, 1]
    y_test: torch.Tensor  # [N, n_test] int64
    true_cluster: torch.Tensor  # [N] int64: the client's distribution (for mixtures, the primary one)
    num_classes: int
    mixture: torch.Tensor | None = None  # [N, k] float32 realised train share of each distribution (mixture only)
    train_distribution: torch.Tensor | None = None  # [N, n_train] int64 distribution of every train sample
    test_distribution: torch.Tensor | None = None  # [N, n_test] int64 distribution of every test sample
    rotations: tuple[int, ...] = ()  # degrees of each distribution j

    def __post_init__(self) -> None:
        n = self.x_train.shape[0]
        per_client = [
            self.y_train,
            self.x_test,
            self.y_test,
            self.true_cluster,
            self.mixture,
            self.train_distribution,
            self.test_distribution,
        ]
        if any(t is not None and t.shape[0] != n for t in per_client):
            raise ValueError("FederatedData: every per-client tensor must have the same first dimension N")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """(C, H, W) of an image, or (d,) of a feature vector."""
        return tuple(int(s) for s in self.x_train.shape[2:])

    @property
    def num_clients(self) -> int:
        return int(self.x_train.shape[0])

    def subset(self, clients: Sequence[int]) -> FederatedData:
        """The same data restricted to `clients` (in the given order)."""
        index = torch.as_tensor(list(clients), dtype=torch.long, device=self.x_train.device)
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> FederatedData:
        """The same data on `device` (itself when it is there already)."""
        if self.x_train.device == torch.device(device):
            return self
        return self._map(lambda t: t.to(device))

    def _map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> FederatedData:
        def each(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else f(t)

        return FederatedData(
            x_train=f(self.x_train),
            y_train=f(self.y_train),
            x_test=f(self.x_test),
            y_test=f(self.y_test),
            true_cluster=f(self.true_cluster),
            num_classes=self.num_classes,
            mixture=each(self.mixture),
            train_distribution=each(self.train_distribution),
            test_distribution=each(self.test_distribution),
            rotations=self.rotations,
        )
