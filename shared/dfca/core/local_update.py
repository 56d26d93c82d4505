"""Local update, DFCA eq. 5: only the assigned cluster's model trains."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from dfca.core.params import gather_clusters, scatter_clusters
from dfca.models.batched import BatchedModel, Params, client_permutations


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
) -> None:
    """theta_{i,c(i)} <- theta_{i,c(i)} - lr * grad F_client(theta_{i,c(i)}, D_i), for `epochs` epochs."""
    if epochs <= 0:
        return
    chosen = gather_clusters(params, assigned)
    orders = client_permutations(seeds, y.shape[1], epochs)
    model.sgd(chosen, x, y, lr, orders, batch_size, momentum)
    scatter_clusters(params, assigned, chosen)
