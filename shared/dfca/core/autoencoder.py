"""Batched fully connected autoencoders: R independent models as stacked tensors (FedCRef's AE_iq and AE_G).

Widths d-100-64-32-64-100-d by default: ReLU between layers, a linear code, a sigmoid output (pixels lie in
[0, 1]). A sample's reconstruction error is the mean squared error over its d pixels, eq. (1)'s l.

Training is Adam on the mean error over each model's own samples (eq. 1), minibatches drawn per model from its
own seeded permutation. Adam is per coordinate, so R models trained in one batch follow the path each would
follow alone (models with the same number of steps per epoch share a fused Adam).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

Params = dict[str, Tensor]
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
EVAL_CHUNK = 4096  # samples per forward pass when evaluating many models


def widths(dim: int, encoder: list[int]) -> list[int]:
    """[d, *encoder, *reversed(encoder[:-1]), d]."""
    return [dim, *encoder, *reversed(encoder[:-1]), dim]


def shapes(dim: int, encoder: list[int]) -> dict[str, tuple[int, ...]]:
    w = widths(dim, encoder)
    out: dict[str, tuple[int, ...]] = {}
    for layer, (a, b) in enumerate(zip(w[:-1], w[1:], strict=True)):
        out[f"w{layer}"] = (b, a)
        out[f"b{layer}"] = (b,)
    return out


def init(rows: int, dim: int, encoder: list[int], seed: int, device: torch.device | str = "cpu") -> Params:
    """`rows` copies of one seeded initialisation (uniform +-1/sqrt(fan_in), as torch.nn.Linear)."""
    g = torch.Generator().manual_seed(seed)
    out: Params = {}
    layout = shapes(dim, encoder)
    for name, shape in layout.items():
        bound = 1.0 / math.sqrt(layout["w" + name[1:]][1])  # fan_in of the layer
        one = (torch.rand(shape, generator=g) * 2 - 1) * bound
        out[name] = one.unsqueeze(0).repeat(rows, *([1] * len(shape))).to(device)
    return out


def reconstruct(params: Params, x: Tensor) -> Tensor:
    """x [R, n, d] (or [n, d], shared by all R models) -> reconstructions [R, n, d]."""
    layers = len(params) // 2
    code = layers // 2 - 1
    h = x
    for layer in range(layers):
        w, b = params[f"w{layer}"], params[f"b{layer}"]
        h = torch.matmul(h, w.transpose(1, 2)) + b.unsqueeze(1)
        if layer == layers - 1:
            h = torch.sigmoid(h)
        elif layer != code:
            h = torch.relu(h)
    return h


@torch.no_grad()
def errors(params: Params, x: Tensor) -> Tensor:
    """Per-sample reconstruction errors: x [R, n, d] -> [R, n]; x [n, d] (every model on the same samples) -> [R, n]."""
    if x.dim() == 2:
        return torch.cat([(reconstruct(params, part) - part).pow(2).mean(-1)
                          for part in x.split(EVAL_CHUNK)], 1) if x.shape[0] else x.new_zeros(rows_of(params), 0)
    return (reconstruct(params, x) - x).pow(2).mean(-1)


def rows_of(params: Params) -> int:
    return int(next(iter(params.values())).shape[0])


def orders(count: int, seed: int, epochs: int) -> Tensor:
    """`epochs` seeded permutations of a model's `count` samples, one after another: [epochs * count]."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randperm(count, generator=g) for _ in range(epochs)]) if count else torch.zeros(0).long()


def train(params: Params, x: Tensor, counts: list[int], seeds: list[int], epochs: int, lr: float,
          batch: int) -> Params:
    """Adam on eq. (1): model r on its samples x[r, :counts[r]] (x [R, n_max, d]) for `epochs` passes of minibatches
    of `batch` (an epoch's last one shorter), each pass in a seeded order. Returns new parameters.

    Models that take the same number of steps are stepped together by one fused Adam (per coordinate, so each
    follows its own path, whichever models share its batch)."""
    trained = {n: v.detach().clone() for n, v in params.items()}
    steps = [math.ceil(n / batch) for n in counts]
    for group in sorted(set(steps) - {0}):
        rows = [r for r, s in enumerate(steps) if s == group]
        part = train_group({n: v[rows] for n, v in trained.items()}, x[rows], [counts[r] for r in rows],
                           [seeds[r] for r in rows], epochs, lr, batch, group)
        index = torch.tensor(rows, device=x.device)
        for n in trained:
            trained[n][index] = part[n]
    return trained


def train_group(params: Params, x: Tensor, counts: list[int], seeds: list[int], epochs: int, lr: float, batch: int,
                steps: int) -> Params:
    """`train` for models that all take `steps` minibatches per epoch."""
    if epochs == 0:
        return params
    leaves = {n: v.clone().requires_grad_(True) for n, v in params.items()}
    opt = torch.optim.Adam(list(leaves.values()), lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                           fused=x.device.type in ("cpu", "cuda"))
    span = steps * batch  # columns per epoch; model r fills the first counts[r]
    index = torch.zeros(len(counts), epochs * span, dtype=torch.long)
    valid = torch.zeros(len(counts), epochs * span, dtype=torch.bool)
    for r, (n, seed) in enumerate(zip(counts, seeds, strict=True)):
        order = orders(n, seed, epochs).view(epochs, n)
        for e in range(epochs):
            index[r, e * span: e * span + n] = order[e]
            valid[r, e * span: e * span + n] = True
    index, valid = index.to(x.device), valid.to(x.device)
    rows = torch.arange(len(counts), device=x.device).unsqueeze(1)
    for start in range(0, epochs * span, batch):
        cols = slice(start, start + batch)
        mask = valid[:, cols].float()
        xb = x[rows, index[:, cols]]
        per_sample = (reconstruct(leaves, xb) - xb).pow(2).mean(-1)
        loss = ((per_sample * mask).sum(1) / mask.sum(1).clamp(min=1)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {n: v.detach() for n, v in leaves.items()}


def code(params: Params, x: Tensor) -> Tensor:
    """The encoder's output (the bottleneck) of x [R, n, d] -> [R, n, code]."""
    layers = len(params) // 2
    h = x
    with torch.no_grad():
        for layer in range(layers // 2):
            h = torch.matmul(h, params[f"w{layer}"].transpose(1, 2)) + params[f"b{layer}"].unsqueeze(1)
            if layer != layers // 2 - 1:
                h = torch.relu(h)
    return h
