"""Local update, DFCA eq. 5: only the assigned cluster's model trains."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dfca.core.params import gather_clusters, scatter_clusters
from dfca.models.batched import BatchedModel, Params, client_permutations


def sample_orders(seeds: Sequence[int], n: int, epochs: int, counts: Tensor | None,
                  sample_mask: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor | None]]:
    """(orders [M, epochs, n], the sgd keywords that keep it on real samples): a client's order permutes its own
    `counts` samples; the mask (its real samples, and of those `sample_mask`'s) keeps padding out of every step."""
    if counts is None:
        return client_permutations(seeds, n, epochs), {"sample_mask": sample_mask}
    real = torch.arange(n, device=counts.device).unsqueeze(0) < counts.unsqueeze(1)
    mask = real if sample_mask is None else real & sample_mask
    return client_permutations(seeds, n, epochs, counts.tolist()), {"sample_mask": mask}


def round_seeds(seed: int, clients: Sequence[int], round_: int) -> list[int]:
    """Per-client, per-round sample-order seeds; independent of how clients are grouped into hosts."""
    return [(seed * 1_000_003 + c * 7_919 + round_ * 104_729) % (2**62) for c in clients]


def train_assigned(
    model: BatchedModel,
    params: Params,
    assigned: Tensor,
    x: Tensor,
    y: Tensor,
    *,
    lr: float,
    epochs: int,
    batch_size: int,
    seeds: Sequence[int],
    momentum: float = 0.0,
    counts: Tensor | None = None,
) -> None:
    """theta_{i,c(i)} <- theta_{i,c(i)} - lr * grad F_client(theta_{i,c(i)}, D_i), for `epochs` epochs.

    counts [M]: each client's real samples, the first of its rows (None: every row): a client does its epochs over
    its own samples, ceil(count / batch_size) steps an epoch, and never over padding."""
    if epochs <= 0:
        return
    chosen = gather_clusters(params, assigned)
    orders, keep = sample_orders(seeds, y.shape[1], epochs, counts)
    model.sgd(chosen, x, y, lr, orders, batch_size, momentum, **keep)
    scatter_clusters(params, assigned, chosen)
