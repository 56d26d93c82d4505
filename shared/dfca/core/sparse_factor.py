"""The first factor of a product with the models, dense or CSR: whichever multiplies faster here.

A gossip or merge matrix over N clients has about degree x N entries. Where it is at most SPARSE_DENSITY full,
`Tensor.addmm_` with a CSR first factor (in place, on CPU) beat the dense product on this project's machine: one
product [N, N] x [N, C] at N=240 with 24 neighbours (density 0.1) took about as long either way, at N=1,000 and
3,000 with 10 neighbours 1/10 and 1/30 of the dense time, about SPARSE_ENTRY_COST dense multiply-adds' time per
stored entry (measured under load: compare ratios, docs/performance.md).
"""

from __future__ import annotations

import warnings

from torch import Tensor

SPARSE_DENSITY = 0.05
SPARSE_ENTRY_COST = 9


def product_factor(a: Tensor) -> Tensor:
    """a [R, C] float as the first factor of addmm_: CSR where at most SPARSE_DENSITY of it is non-zero (CPU)."""
    if a.dim() != 2 or a.device.type != "cpu" or a.shape[0] < 2 or a.count_nonzero() > SPARSE_DENSITY * a.numel():
        return a
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the products used are tested (core tests)
        warnings.simplefilter("ignore", UserWarning)
        return a.to_sparse_csr()
