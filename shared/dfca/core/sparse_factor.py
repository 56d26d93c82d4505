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

A CSR entry reads a whole row of the second factor. Where the rows of a CSR factor hold many entries on average
(`cpu_row_entries`), the product over a wide second factor goes out of cache: `add_product` then takes it
COLUMN_BLOCK columns at a time, whose rows stay in cache while every entry reads them. One thread, cold caches, a
screened step's mix of h=200's 156,800 values a row through the clusters' [N, F] views, time over the dense
product's, whole CSR / in blocks of 1,024 columns:
- N=60, k=4, density 0.15 / 0.3 / 0.5 (9 / 18 / 30 entries a row): 0.48 / 0.51, 1.94 / 0.86, 6.5 / 1.47;
- N=100, k=2, density 0.15 / 0.3 (14 / 29): 0.92 / 0.66, 5.6 / 1.13;
- N=240, k=4, density 0.1 / 0.2 (24 / 48): 1.35 / 0.46, 2.1 / 0.85;
- N=30, k=2, density 0.13 / 0.3 (4 / 8): 0.61 / 0.87, 0.87 / 1.11 (few entries a row: whole is faster).
A blocked product costs about 3-4.5 dense multiply-adds an entry, so a factor whose rows hold many entries is
taken sparse only where at most WIDE_ROW_DENSITY of it is non-zero.

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
COLUMN_BLOCK = 1024  # columns of the second factor a CSR product with many entries a row takes at once (CPU)
WIDE_ROW_DENSITY = 0.2  # most non-zeros a CSR factor with many entries a row may hold, as a share (CPU)


def product_factor(a: Tensor, cpu_density: float | None = None, cpu_row_entries: float | None = None) -> Tensor:
    """a [R, C] float (dense or CSR) as the first factor of addmm_ or `add_product`: CSR where at most `cpu_density`
    (default SPARSE_DENSITY) of it is non-zero (GPU_SPARSE_DENSITY on a GPU), and on CPU, where with
    `cpu_row_entries` its rows hold more than that many entries on average (`add_product` takes it in column
    blocks), at most WIDE_ROW_DENSITY of it; else dense."""
    if a.dim() != 2 or a.shape[0] < 2:
        return a
    sparse = a.layout == torch.sparse_csr
    cpu = a.device.type == "cpu"
    density = (SPARSE_DENSITY if cpu_density is None else cpu_density) if cpu else GPU_SPARSE_DENSITY
    entries = a._nnz() if sparse else int(a.count_nonzero())
    if cpu and cpu_row_entries is not None and entries > cpu_row_entries * a.shape[0]:  # many entries a row
        density = min(density, WIDE_ROW_DENSITY)
    if entries > density * a.numel():
        return a.to_dense() if sparse else a
    if sparse:
        return a
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the products used are tested (core tests)
        warnings.simplefilter("ignore", UserWarning)
        return a.to_sparse_csr()


def add_product(out: Tensor, factor: Tensor, x: Tensor, cpu_row_entries: float | None = None) -> None:
    """out += factor @ x in place (out [R, F], factor [R, C] dense or CSR, x [C, F]). On CPU, a CSR factor whose rows
    hold more than `cpu_row_entries` entries on average multiplies x COLUMN_BLOCK columns at a time, through views of
    out and x (no copy)."""
    blocked = (factor.layout == torch.sparse_csr and factor.device.type == "cpu" and cpu_row_entries is not None
               and factor._nnz() > cpu_row_entries * factor.shape[0] and x.shape[1] > COLUMN_BLOCK)
    if not blocked:
        out.addmm_(factor, x)
        return
    for start in range(0, x.shape[1], COLUMN_BLOCK):
        out[:, start:start + COLUMN_BLOCK].addmm_(factor, x[:, start:start + COLUMN_BLOCK])


def columns(a: Tensor, cols: Tensor) -> Tensor:
    """a[:, cols] for a dense or CSR a (a CSR one stays sparse: no dense [R, C] copy on large graphs)."""
    if a.layout != torch.sparse_csr:
        return a[:, cols]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return a.to_sparse_coo().index_select(1, cols).to_sparse_csr()
