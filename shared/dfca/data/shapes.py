"""What one sample of a federation looks like, from its config alone (no file is read): the input shape a model
gets and the number of classes. The topology service checks a user's model against it before any worker loads data;
tests/test_model_factory.py pins it to the loaders' own shapes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dfca.data.femnist import FEMNIST_CLASSES
from dfca.data.idx import EMNIST_BALANCED_CLASSES

if TYPE_CHECKING:
    from dfca.sections import DataConfig

IMAGE_SHAPES: dict[str, tuple[int, ...]] = {
    "mnist-bundled": (1, 28, 28), "mnist": (1, 28, 28), "emnist": (1, 28, 28), "femnist": (1, 28, 28),
    "cifar10": (3, 32, 32), "digits": (1, 8, 8),
}
CLASSES = {"mnist-bundled": 10, "mnist": 10, "emnist": EMNIST_BALANCED_CLASSES, "femnist": FEMNIST_CLASSES,
           "cifar10": 10, "digits": 10}


def sample_shape(data: DataConfig) -> tuple[tuple[int, ...], int]:
    """(input shape of one sample, number of classes) of a labelled federation."""
    if data.dataset not in IMAGE_SHAPES:
        raise ValueError(f"data.dataset: {data.dataset} holds unlabelled points; no classifier trains on it")
    shape = (data.feature_dim,) if data.features == "projection" else IMAGE_SHAPES[data.dataset]
    return shape, CLASSES[data.dataset]
