"""The interface every batched model implements, and the sample orders its training walks.

A parameter set is a plain `dict[str, Tensor]`; every tensor has the same leading batch shape (a client, or client x
cluster, dimension).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    pass

Params = dict[str, Tensor]


Batch = tuple[slice, "Tensor | None"]  # positions in an epoch's sample order; which hold kept samples


def client_permutations(seeds: Sequence[int], n: int, epochs: int, counts: Sequence[int] | None = None) -> Tensor:
    """[B, epochs, n] per-client sample orders, each from the client's own seed (grouping-independent).

    counts: each client's real samples (the rest of its n rows is padding): its order is a permutation of its own
    count, the padding after it, so a client's order depends on its own samples only, not on how wide it is padded.
    """
    g = torch.Generator()
    rows = []
    for b, seed in enumerate(seeds):
        g.manual_seed(int(seed))
        own = n if counts is None else int(counts[b])
        tail = torch.arange(own, n)
        rows.extend(torch.cat([torch.randperm(own, generator=g), tail]) if own < n else torch.randperm(n, generator=g)
                    for _ in range(epochs))
    if not rows:
        return torch.empty(len(seeds), epochs, n, dtype=torch.long)
    return torch.stack(rows).view(len(seeds), epochs, n)


def step_streams(seeds: Sequence[int], kept: Tensor, length: int) -> Tensor:
    """[B, length] sample positions for fixed-step local SGD: client b walks seeded permutations of its kept positions
    (where kept [B, n] holds), a fresh permutation each time one is used up, so its batches never hold padding.

    Depends only on the client's seed and kept positions, not on its padded width or the clients beside it; a client
    with no kept position gets position 0 throughout (the caller leaves it untrained)."""
    g = torch.Generator()
    out = torch.zeros(len(seeds), length, dtype=torch.long)
    kept = kept.cpu()  # one copy from the device, not one a client
    for b, seed in enumerate(seeds):
        own = kept[b].nonzero().flatten()
        if own.numel() == 0 or length == 0:
            continue
        g.manual_seed(int(seed))
        walks = -(-length // own.numel())
        out[b] = own[torch.rand(walks, own.numel(), generator=g).argsort(dim=1).flatten()[:length]]
    return out


def masked_orders(orders: Tensor, sample_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Move each client's masked-out samples to the end of every epoch's order, keeping the order of the rest.

    orders [B, epochs, n], sample_mask [B, n] -> (orders, valid [B, epochs, n] bool: position holds a kept sample).
    """
    valid = torch.gather(sample_mask.unsqueeze(1).expand_as(orders), 2, orders)
    position = torch.arange(orders.shape[2], device=orders.device).expand_as(orders)
    rank = torch.where(valid, position, position + orders.shape[2])  # kept samples first, both halves in order
    perm = rank.argsort(dim=2)
    return torch.gather(orders, 2, perm), torch.gather(valid, 2, perm)


def _flat_rows(order: Tensor) -> Tensor:
    """[B, n] per-client positions -> [B * n] rows of a [B * n, ...] view of a [B, n, ...] tensor."""
    return (order + torch.arange(order.shape[0], device=order.device).unsqueeze(1) * order.shape[1]).flatten()


def in_order(t: Tensor, order: Tensor) -> Tensor:
    """t [B, n, ...] with client b's samples in order[b] ([B, n]): t[b, order[b]] for every b, as one copy."""
    rows = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).index_select(0, _flat_rows(order))
    return rows.view(t.shape)


def put_in_order(t: Tensor, order: Tensor, src: Tensor) -> None:
    """The inverse of in_order, in place: t[b, order[b]] = src[b] for every b (t contiguous)."""
    t.view(t.shape[0] * t.shape[1], *t.shape[2:]).index_copy_(0, _flat_rows(order), src.reshape(-1, *t.shape[2:]))


def first_layer_multiply_adds(samples: int, epochs: int, inputs: int, width: int) -> dict[str, int]:
    """A client's multiply-adds in a first linear layer (`inputs` -> `width`) for `epochs` epochs over `samples`
    samples, trained in weight space or in sample space (MLP's docstring)."""
    n, d, h = samples, inputs, width
    return {"weights": epochs * n * 2 * d * h,  # forward and weight gradient of every sample
            "samples": n * n * d + 2 * n * d * h + epochs * n * n * h}  # K; P0 and X^T U; K_b U per sample


class BatchedModel(ABC):
    """A model family whose parameters are stacked over a leading batch of clients."""

    @abstractmethod
    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    @abstractmethod
    def init(self, n: int, generator: torch.Generator) -> Params:
        """n independent initialisations, [n, *shape] each."""

    @abstractmethod
    def logits(self, params: Params, x: Tensor) -> Tensor:
        """params [B, ...], x [B, n, *input] -> [B, n, classes]."""

    @abstractmethod
    def sgd(
        self, params: Params, x: Tensor, y: Tensor, lr: float, orders: Tensor, batch_size: int,
        momentum: float = 0.0, sample_mask: Tensor | None = None,
    ) -> None:
        """Local SGD in place (eq. 5). orders [B, epochs, n] gives each client's sample order.

        sample_mask [B, n] bool: train client b only on its samples where the mask is True (in the
        order `orders` gives them, in batches of batch_size); a client with no such sample is untouched.
        """

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes().values())

    def last_layer(self) -> list[str]:
        """The names of the final layer's tensors: what DPMM-CFL and FeSEM cluster by default."""
        return list(self.shapes())[-2:]

    def to(self, device: torch.device) -> BatchedModel:
        """Compute on `device` (parameters are passed in; a model holding modules moves them)."""
        return self
