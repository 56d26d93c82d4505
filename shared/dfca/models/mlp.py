"""The built-in MLP, batched over clients: an explicit forward and backward with the SGD step fused in place, its first
layer in sample space where that is less arithmetic (docs/performance.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    pass
from dfca.models.batched import (
    Batch,
    BatchedModel,
    Params,
    first_layer_multiply_adds,
    in_order,
    masked_orders,
    put_in_order,
)

CLIENT_BLOCK = 32  # the fewest clients trained together (the MLP: more where their working set is small)
BLOCK_BYTES = 16 << 20  # the MLP trains as many clients together as keep their per-step working set this small
GPU_BLOCK_BYTES = 1 << 30  # on a GPU, where each kernel launch costs more than a small block's arithmetic


class MLP(BatchedModel):
    """x -> Linear(d, h) -> ReLU -> Linear(h, classes); the paper uses h = 2048.

    Local SGD runs in one of two exactly equivalent forms (`first_layer`; "auto" picks the one with fewer
    multiply-adds for the call's sample count and epochs):

    - "weights": the textbook step. Each batch's forward X_b w1 and weight gradient X_b^T dH_b cost 2 bs d h
      multiply-adds, and every step reads and writes all of w1.
    - "samples": SGD only ever adds rows of the client's own samples to w1, so after any number of steps
      w1_t = w1_0 + X^T U_t and b1_t = b1_0 + 1^T U_t for some U_t [n, h] that starts at 0 and collects
      -lr dH_b in the rows of batch b. A batch's pre-activations are then X_b w1_t + b1_t = P0_b + K_b U_t with
      P0 = X w1_0 + b1_0 and the Gram matrix K = X X^T + 1 [n, n], formed once. A step costs bs n h instead
      of 2 bs d h, and w1 is touched twice a call (P0 at the start, w1 += X^T U at the end): for the paper's
      66 samples of 784 pixels, h = 2048 and 5 epochs, 0.52 against 2.25 GFLOP per client.
      Heavy-ball momentum keeps its velocity in sample space too: vel(w1) = X^T V, V <- mu V + G.
    """

    def __init__(self, input_dim: int, hidden: int, classes: int, first_layer: str = "auto") -> None:
        if first_layer not in ("auto", "weights", "samples"):
            raise ValueError(f"first_layer: {first_layer!r} is not auto, weights or samples")
        self.d, self.h, self.c = input_dim, hidden, classes
        self.first_layer = first_layer

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {"w1": (self.d, self.h), "b1": (self.h,), "w2": (self.h, self.c), "b2": (self.c,)}

    def init(self, n: int, generator: torch.Generator) -> Params:
        # torch.nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias
        def uniform(shape: tuple[int, ...], fan_in: int) -> Tensor:
            bound = 1.0 / math.sqrt(fan_in)
            return (torch.rand((n, *shape), generator=generator) * 2 - 1) * bound

        return {
            "w1": uniform((self.d, self.h), self.d),
            "b1": uniform((self.h,), self.d),
            "w2": uniform((self.h, self.c), self.h),
            "b2": uniform((self.c,), self.h),
        }

    def logits(self, params: Params, x: Tensor) -> Tensor:
        x = x.reshape(*x.shape[:2], math.prod(x.shape[2:]))
        h = torch.bmm(x, params["w1"]).add_(params["b1"].unsqueeze(1)).relu_()
        return torch.bmm(h, params["w2"]).add_(params["b2"].unsqueeze(1))

    def first_layer_multiply_adds(self, samples: int, epochs: int) -> dict[str, int]:
        """A client's first-layer multiply-adds for `epochs` epochs over `samples` samples, in each form."""
        return first_layer_multiply_adds(samples, epochs, self.d, self.h)

    def sgd_form(self, samples: int, epochs: int) -> str:
        if self.first_layer != "auto":
            return self.first_layer
        cost = self.first_layer_multiply_adds(samples, epochs)
        return "samples" if cost["samples"] < cost["weights"] else "weights"

    def sgd(
        self, params: Params, x: Tensor, y: Tensor, lr: float, orders: Tensor, batch_size: int,
        momentum: float = 0.0, sample_mask: Tensor | None = None,
    ) -> None:
        x = x.reshape(*x.shape[:2], math.prod(x.shape[2:]))
        orders = orders.to(x.device)
        valid = None
        if sample_mask is not None:
            orders, valid = masked_orders(orders, sample_mask)
        form = self.sgd_form(y.shape[1], orders.shape[1])
        block_sgd = self._sgd_block_samples if form == "samples" else self._sgd_block
        size = self.client_block(x.shape[0], y.shape[1], form, momentum > 0, x.device.type)
        for lo in range(0, x.shape[0], size):
            block = slice(lo, lo + size)
            p = {k: v[block] for k, v in params.items()}  # views: the block's step writes into params
            block_valid = None if valid is None else valid[block]
            block_sgd(p, x[block], y[block], lr, orders[block], batch_size, momentum, block_valid)

    def client_block(
        self, clients: int, samples: int, form: str, momentum: bool = False, device_type: str = "cpu"
    ) -> int:
        """How many clients train together: what keeps the state a step reads and writes within BLOCK_BYTES (at
        least CLIENT_BLOCK), in blocks of equal size. Each of a step's kernel calls has a fixed cost on top of its
        work, so fewer blocks cost less. The weights form touches w1 (d x h) every step: 32 clients of 784 x 200
        are 20 MB. The samples form touches K (n x n), P0 and u (n x h each): 154 KB a client at 80 samples and
        h = 200, so the benchmark's 100 clients train as one block: 1.2-1.4x faster than blocks of 32 at batch 10
        and 1.1x at batch 50 on its data (docs/performance.md). On a GPU no cache is to be kept and a kernel launch
        costs more than a small block's arithmetic: blocks of up to GPU_BLOCK_BYTES (thousands of clients)."""
        n, h = samples, self.h
        floats = self.d * h * (2 if momentum else 1) if form == "weights" else n * n + n * h * (3 if momentum else 2)
        budget = BLOCK_BYTES if device_type == "cpu" else GPU_BLOCK_BYTES
        size = max(1, min(clients, max(CLIENT_BLOCK, budget // (4 * floats))))
        blocks = max(1, -(-clients // size))
        return max(1, -(-clients // blocks))

    @staticmethod
    def _epochs(orders: Tensor, bs: int, valid: Tensor | None) -> Iterator[tuple[Tensor, list[Batch]]]:
        """Each epoch's sample order [B, n] and its batches: positions in that order, and with a mask which of
        them hold a kept sample [B, b] (masked_orders puts those first)."""
        for epoch in range(orders.shape[1]):
            steps = orders.shape[2] if valid is None else int(valid[:, epoch].sum(1).max())
            yield orders[:, epoch], [(slice(lo, lo + bs), None if valid is None else valid[:, epoch, lo : lo + bs])
                                     for lo in range(0, steps, bs)]

    def _head_backward(self, h: Tensor, w2t: Tensor, b2: Tensor, onehot: Tensor, keep: Tensor | None) -> Tensor:
        """dL/dlogits of the batch's mean cross-entropy from hidden activations h [B, b, hidden] (w2t: w2 transposed,
        [B, classes, hidden]): (softmax - onehot) / m; with a mask, the mean is over each client's kept samples."""
        g = torch.bmm(h, w2t.transpose(1, 2)).add_(b2.unsqueeze(1)).softmax(-1).sub_(onehot)
        if keep is None:
            return g.div_(onehot.shape[1])
        k = keep.to(g.dtype)
        return g.mul_((k / k.sum(1, keepdim=True).clamp(min=1.0)).unsqueeze(2))

    @staticmethod
    def _step(p: Params, grads: Params, lr: float, momentum: float, vel: Params | None, keep: Tensor | None) -> None:
        """p[k] -= lr * grads[k] for each k in grads, or the heavy-ball step (DFedAvgM) when vel is given."""
        if vel is None:  # fused in-place SGD step
            for k, grad in grads.items():
                p[k].add_(grad, alpha=-lr)
        elif keep is None:
            for k, grad in grads.items():
                vel[k].mul_(momentum).add_(grad)
                p[k].add_(vel[k], alpha=-lr)
        else:  # momentum with a mask: a client without a sample in this batch takes no step
            active = keep.any(1)
            for k, grad in grads.items():
                shape = (active.shape[0],) + (1,) * (grad.dim() - 1)
                step = vel[k] * momentum + grad
                vel[k] = torch.where(active.view(shape), step, vel[k])
                p[k].sub_(vel[k] * (lr * active.float()).view(shape))

    def _sgd_block(
        self, p: Params, x: Tensor, y: Tensor, lr: float, orders: Tensor, bs: int, momentum: float,
        valid: Tensor | None = None,
    ) -> None:
        """The "weights" form. w2 is trained transposed ([B, classes, hidden]: its products are faster so)."""
        state = {"w1": p["w1"], "b1": p["b1"], "w2t": p["w2"].transpose(1, 2).contiguous(), "b2": p["b2"]}
        w1, b1, w2t, b2 = state.values()
        vel = {k: torch.zeros_like(v) for k, v in state.items()} if momentum > 0 else None
        for order, batches in self._epochs(orders, bs, valid):
            xe, onehot = in_order(x, order), F.one_hot(in_order(y, order), self.c).to(x.dtype)
            for pos, keep in batches:
                xb = xe[:, pos]  # [B, b, d]
                h = torch.bmm(xb, w1).add_(b1.unsqueeze(1)).relu_()
                g = self._head_backward(h, w2t, b2, onehot[:, pos], keep)
                dh = torch.ops.aten.threshold_backward(torch.bmm(g, w2t), h, 0.0)
                grads = {"w1": torch.bmm(xb.transpose(1, 2), dh), "b1": dh.sum(1),
                         "w2t": torch.bmm(g.transpose(1, 2), h), "b2": g.sum(1)}
                self._step(state, grads, lr, momentum, vel, keep)
        p["w2"].copy_(w2t.transpose(1, 2))

    def _sgd_block_samples(
        self, p: Params, x: Tensor, y: Tensor, lr: float, orders: Tensor, bs: int, momentum: float,
        valid: Tensor | None = None,
    ) -> None:
        """The "samples" form: w1 = w1_0 + X^T u, b1 = b1_0 + 1^T u, with u [B, n, hidden] updated instead of w1.

        Within an epoch K, P0 and u are held in the epoch's sample order, so that a batch is a slice of them.
        """
        w1, b1 = p["w1"], p["b1"]
        gram = torch.bmm(x, x.transpose(1, 2)).add_(1.0)  # K = X X^T + 1
        p0 = torch.bmm(x, w1).add_(b1.unsqueeze(1))  # P0 = X w1_0 + b1_0
        u = torch.zeros_like(p0)  # u (and with momentum its velocity) in the data's sample order
        vel_u = torch.zeros_like(p0) if momentum > 0 else None
        state = {"w2t": p["w2"].transpose(1, 2).contiguous(), "b2": p["b2"]}
        w2t, b2 = state.values()
        vel = {k: torch.zeros_like(v) for k, v in state.items()} if momentum > 0 else None
        for order, batches in self._epochs(orders, bs, valid):
            ke = torch.gather(in_order(gram, order), 2, order.unsqueeze(1).expand_as(gram))  # rows and columns
            pe, onehot = in_order(p0, order), F.one_hot(in_order(y, order), self.c).to(x.dtype)
            state["u"] = in_order(u, order)
            if vel is not None and vel_u is not None:
                vel["u"] = in_order(vel_u, order)
            for pos, keep in batches:
                pre = torch.baddbmm(pe[:, pos], ke[:, pos], state["u"])  # X_b w1_t + b1_t = P0_b + K_b U_t
                h = pre.relu()
                g = self._head_backward(h, w2t, b2, onehot[:, pos], keep)
                dh = torch.ops.aten.threshold_backward(torch.bmm(g, w2t), pre, 0.0)
                grads = {"w2t": torch.bmm(g.transpose(1, 2), h), "b2": g.sum(1)}
                if vel is None:  # only the batch's rows of u change
                    state["u"][:, pos].add_(dh, alpha=-lr)
                else:  # the velocity decays in every row: the gradient in sample space, dense
                    grads["u"] = torch.zeros_like(state["u"])
                    grads["u"][:, pos] = dh
                self._step(state, grads, lr, momentum, vel, keep)
            put_in_order(u, order, state["u"])
            if vel is not None and vel_u is not None:
                put_in_order(vel_u, order, vel["u"])
        w1.baddbmm_(x.transpose(1, 2), u)
        b1.add_(u.sum(1))
        p["w2"].copy_(w2t.transpose(1, 2))
