"""How fast a piece of tensor code could run if each of its kernels ran alone: the measured floor under a rate.

    floor = kernel_floor(lambda: model.sgd(...))

Runs the code once under a dispatch mode that records every aten call it makes with its arguments' shapes,
strides and dtypes, then times each distinct call alone (on fresh tensors of those layouts, filled with random
numbers, warmed up, best of three loops) and adds them up, grouped:

- products: bmm, baddbmm, mm, addmm (and their in-place forms), with their FLOPs (a multiply-add counts two);
- elementwise: every other call whose tensors are all floating point (ReLU, softmax, add_, sums, copies);
- data movement: calls that take integer or boolean tensors (index_select, index_copy_, gather, scatter_, one_hot,
  masks), replayed with the very indices they were given (random floats for their other tensors);
- not timed: calls with no tensor argument (randperm, arange, zeros: they create one) and views (slice,
  transpose, view: no kernel), counted only.

The products' seconds are the least the code could take at those shapes with these kernels even if nothing else
cost anything, so the products' FLOPs over them bound the rate the code's executed FLOPs can reach; what the code
takes beyond all the kernels' seconds alone is Python and dispatch between them. Used by simulator_round.py for
the MLP's local SGD (docs/performance.md, "The simulator's round").
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
PRODUCTS = {aten.bmm.default, aten.baddbmm.default, aten.baddbmm_.default, aten.mm.default, aten.addmm.default,
            aten.addmm_.default}
VIEWS = {aten.slice.Tensor, aten.transpose.int, aten.view.default, aten.unsqueeze.default, aten.select.int,
         aten.expand.default, aten.as_strided.default, aten.alias.default, aten.t.default, aten.permute.default,
         aten.squeeze.dim, aten._unsafe_view.default, aten._local_scalar_dense.default}


@dataclass(frozen=True)
class TensorLayout:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    values: torch.Tensor | None = field(default=None, compare=False, hash=False)  # an integer/boolean tensor's own

    def materialize(self) -> torch.Tensor:
        """A tensor of this layout (its own storage, broadcast strides kept) over random numbers, or over the
        recorded values of an integer or boolean tensor (indices must stay in range)."""
        if self.values is not None:  # a copy of the values (contiguous), broadcast where the original was
            src = self.values
            for dim, (size, stride) in enumerate(zip(self.shape, self.stride, strict=True)):
                if stride == 0 and size > 0:
                    src = src.narrow(dim, 0, 1)
            return src.clone().expand(self.shape)
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True) if s > 0)
        if any(s == 0 for s in self.shape):
            extent = 0
        flat = torch.randn(extent, dtype=self.dtype, device=self.device)
        return flat.as_strided(self.shape, self.stride)


def _layout(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        kept = None if value.dtype.is_floating_point else value.detach().clone()
        return TensorLayout(tuple(value.shape), tuple(value.stride()), value.dtype, value.device, kept)
    if isinstance(value, (list, tuple)):
        return tuple(_layout(v) for v in value)
    return value


@dataclass(frozen=True)
class Call:
    op: Any
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    def tensors(self) -> list[TensorLayout]:
        out: list[TensorLayout] = []

        def walk(v: Any) -> None:
            if isinstance(v, TensorLayout):
                out.append(v)
            elif isinstance(v, tuple):
                for item in v:
                    walk(item)
        walk(self.args)
        walk(tuple(v for _, v in self.kwargs))
        return out

    @property
    def kind(self) -> str:
        if self.op in VIEWS:
            return "view"
        if self.op in PRODUCTS:
            return "product"
        if not self.tensors():
            return "not timed"
        return "elementwise" if all(t.dtype.is_floating_point for t in self.tensors()) else "data movement"

    def flops(self) -> int:
        """2 m k n per product (times the batch for bmm/baddbmm); 0 for other calls."""
        if self.op not in PRODUCTS:
            return 0
        a, b = (self.args[0], self.args[1]) if self.op in (aten.bmm.default, aten.mm.default) else self.args[1:3]
        return 2 * math.prod(a.shape) * b.shape[-1]

    def seconds_alone(self, target: float = 0.005) -> float:
        """Seconds of one call, run alone on fresh tensors of its layouts: best of three timed loops."""
        def build(v: Any) -> Any:
            if isinstance(v, TensorLayout):
                return v.materialize()
            if isinstance(v, tuple):
                return tuple(build(item) for item in v)
            return v
        args, kwargs = build(self.args), {k: build(v) for k, v in self.kwargs}
        run = self.op
        sync = torch.cuda.synchronize if any(t.device.type == "cuda" for t in self.tensors()) else (lambda: None)
        run(*args, **kwargs)
        sync()
        t0 = time.perf_counter()
        run(*args, **kwargs)
        sync()
        reps = max(1, min(1000, int(target / max(time.perf_counter() - t0, 1e-7))))
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                run(*args, **kwargs)
            sync()
            best = min(best, (time.perf_counter() - t0) / reps)
        return best


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[Call] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self.calls[Call(func, _layout(tuple(args)), tuple(sorted((k, _layout(v)) for k, v in kwargs.items())))] += 1
        return func(*args, **kwargs)


@dataclass
class Floor:
    """What `code` runs, by kind: calls made, seconds if each ran alone, and the products' FLOPs."""

    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    product_flops: int = 0
    product_shapes: list[tuple[str, int, float, int]] = field(default_factory=list)  # call, count, s alone, FLOPs


def kernel_floor(code: Callable[[], Any]) -> Floor:
    """Record `code`'s aten calls (running it once: it must be safe to run again) and time each one alone."""
    recorder = _Recorder()
    with recorder:
        code()
    floor = Floor()
    for call, count in recorder.calls.items():
        kind = call.kind
        floor.calls[kind] = floor.calls.get(kind, 0) + count
        if kind in ("view", "not timed"):
            continue
        alone = call.seconds_alone()
        floor.seconds[kind] = floor.seconds.get(kind, 0.0) + count * alone
        if kind == "product":
            floor.product_flops += count * call.flops()
            shapes = " x ".join(str(list(t.shape)) for t in call.tensors())
            floor.product_shapes.append((f"{call.op.__name__} {shapes}", count, alone, call.flops()))
    floor.product_shapes.sort(key=lambda row: -row[1] * row[2])
    return floor
