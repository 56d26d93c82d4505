"""Federations of unequal clients for tests: a built-in federation cut to chosen sizes, and its padding poisoned."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dfca.data import FederatedData
from dfca.data.shards import SizeBucket, from_clients


def cut(data: FederatedData, train_sizes: Sequence[int], test_sizes: Sequence[int] | None = None) -> FederatedData:
    """`data` with client i cut to its first train_sizes[i] train samples (and test_sizes[i] test samples)."""
    test_sizes = test_sizes if test_sizes is not None else [data.y_test.shape[1]] * data.num_clients
    train = [(data.x_train[i, :n], data.y_train[i, :n]) for i, n in enumerate(train_sizes)]
    test = [(data.x_test[i, :n], data.y_test[i, :n]) for i, n in enumerate(test_sizes)]
    return from_clients(train, test, data.true_cluster, data.num_classes, data.client_names)


def spread_sizes(n: int, clients: int, least: int) -> list[int]:
    """Sizes from `least` to n over the clients, in a scrambled order (client i is not the i-th smallest)."""
    steps = [least + (n - least) * j // max(1, clients - 1) for j in range(clients)]
    return [steps[(i * 7) % clients] for i in range(clients)] if clients % 7 else steps[::-1]


def poisoned(data: FederatedData, seed: int = 0) -> FederatedData:
    """A copy of `data` whose padding rows hold other (finite) features and labels: nothing may change."""
    g = torch.Generator().manual_seed(seed)

    def poison(d: FederatedData) -> FederatedData:
        out = FederatedData(**{f: getattr(d, f) for f in d.__dataclass_fields__})
        for xs, ys, mask in ((out.x_train, out.y_train, d.train_mask), (out.x_test, out.y_test, d.test_mask)):
            if mask is None:
                continue
            pad = ~mask
            noise = torch.rand(xs.shape, generator=g).to(xs.device) * 3 - 1
            xs[pad] = noise[pad].to(xs.dtype)
            ys[pad] = torch.randint(0, d.num_classes, ys.shape, generator=g).to(ys.device)[pad]
        return out

    clone = FederatedData(**{f: (v.clone() if isinstance(v := getattr(data, f), torch.Tensor) else v)
                             for f in data.__dataclass_fields__})
    clone.buckets = tuple(SizeBucket(b.rows, poison(FederatedData(
        **{f: (v.clone() if isinstance(v := getattr(b.data, f), torch.Tensor) else v)
           for f in b.data.__dataclass_fields__}))) for b in data.buckets)
    return poison(clone) if not data.buckets else clone
