"""The first factor of a product with the models, dense or CSR: whichever multiplies faster here.

A gossip or merge matrix over N clients has about degree x N entries. Where it is at most SPARSE_DENSITY full,
`Tensor.addmm_` with a CSR first factor (in place, on CPU) beats the dense product on this project's machine:
- on narrow blocks of the models (a few MB, which stay in cache through a gossip round's steps: stepwise
  consensus), a stored entry costs about 4.5 dense multiply-adds at N = 100-240 and 8 at N = 1,000; at N=240 with
  24 neighbours (density 0.1) CSR took 0.45 of the dense time;
- in DFCA's one-hop fold at N=240 with 24 neighbours ([240 x 60] coefficients of a cluster's senders times their
  models), CSR took 0.4-0.45 of the dense time;
- on wide products ([N, N] x [N, 65,536]) about SPARSE_ENTRY_COST (9) multiply-adds' time an entry: at N=240
  and density 0.1 as long as the dense product, at N=1,000 and 3,000 with 10 neighbours 1/10 and 1/30 of it.
(Timed in development, under load, the narrow-block and fold ratios with scratch scripts: compare ratios;
the end-to-end effect is docs/performance.md's paper-scale run.)

On a GPU the dense product runs near the chip's peak, so CSR (cuSPARSE) pays only on sparser graphs: at most
GPU_SPARSE_DENSITY full, which large graphs are (10 neighbours of 1,000 clients: 0.01). There a dense step costs
N^2 multiply-adds a model column, almost all of them by zero: at 10,000 clients a gossip step's dense products
took about 1.3 s of an H100's time (docs/performance.md).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

SPARSE_DENSITY = 0.12
GPU_SPARSE_DENSITY = 0.02
SPARSE_ENTRY_COST = 9


def product_factor(a: Tensor, cpu_density: float | None = None, cpu_row_entries: float | None = None) -> Tensor:
    """a [R, C] float (dense or CSR) as the first factor of addmm_: CSR where at most `cpu_density` (default
    SPARSE_DENSITY) of it is non-zero (GPU_SPARSE_DENSITY on a GPU) and, on CPU with `cpu_row_entries`, its rows hold
    at most that many entries on average, else dense."""
    if a.dim() != 2 or a.shape[0] < 2:
        return a
    sparse = a.layout == torch.sparse_csr
    cpu = a.device.type == "cpu"
    density = (SPARSE_DENSITY if cpu_density is None else cpu_density) if cpu else GPU_SPARSE_DENSITY
    entries = a._nnz() if sparse else int(a.count_nonzero())
    wide = cpu and cpu_row_entries is not None and entries > cpu_row_entries * a.shape[0]  # many entries a row
    if entries > density * a.numel() or wide:
        return a.to_dense() if sparse else a
    if sparse:
        return a
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the products used are tested (core tests)
        warnings.simplefilter("ignore", UserWarning)
        return a.to_sparse_csr()


def columns(a: Tensor, cols: Tensor) -> Tensor:
    """a[:, cols] for a dense or CSR a (a CSR one stays sparse: no dense [R, C] copy on large graphs)."""
    if a.layout != torch.sparse_csr:
        return a[:, cols]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return a.to_sparse_coo().index_select(1, cols).to_sparse_csr()
