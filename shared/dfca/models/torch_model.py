"""Any torch module, batched over clients: every client's copy trains and predicts at once (torch.func).

A client's model is the module's state: its parameters and its floating-point buffers (BatchNorm's running mean
and variance), named by `state_dict` keys, stacked over a leading client dimension like every BatchedModel's. A
training step is one call for a block of clients:

    g_b, s_b' = grad(L)(theta_b, s_b; X_b, y_b)   for every client b at once (vmap over b)
    L(theta, s; X, y) = loss(functional_call(module, (theta, s), X), y)      cross-entropy unless the module says

then the SGD step theta_b <- theta_b - lr g_b (heavy ball with momentum: v_b <- mu v_b + g_b, theta_b -= lr v_b,
torch.optim.SGD's rule). Each client keeps its own shuffle (`orders`), its own BatchNorm statistics (s_b: the
module updates them in train mode from the client's own batches) and draws its own dropout masks
(vmap(randomness="different")).

With a sample mask (FedSPD trains each cluster on the samples it owns) a batch holds a different number of kept
samples per client; clients are grouped by that count and each group steps on exactly its kept samples, so a
BatchNorm's batch statistics never see a masked sample. A client with no kept sample in a batch takes no step.
Modules that hold batch norm skip batches of one sample (batch statistics need two).

A Sequential whose first layer is an nn.Linear on the flattened sample (the MLPs people write) trains that layer in
sample space where it is less arithmetic, exactly as the built-in MLP does (dfca.models.mlp.MLP): SGD only ever adds
rows of the client's own samples to it, so W_t = W_0 + U_t^T X and b_t = b_0 + 1^T U_t, and a batch's
pre-activations are P0_b + K_b U_t with P0 = X W_0^T + b_0 and K = X X^T + 1 formed once a call; the step takes the
gradient of the loss with respect to those pre-activations (and the later layers' parameters) and writes it into
U's rows of the batch. Chosen per call by multiply-adds (`first_layer_form`), never under a sample mask.

Evaluation (`logits`) runs the module in eval mode: BatchNorm uses each client's running statistics, dropout is off.
Integer buffers (BatchNorm's `num_batches_tracked`) are not carried: they only matter to BatchNorm with
`momentum=None`, whose cumulative average then restarts at every local update.

A module vmap cannot batch (data-dependent control flow such as `if x.sum() > 0`, `.item()`, or an operator with no
batching rule that raises) trains and predicts client by client instead, with the same arithmetic, after a warning
that names vmap's reason. The probe that decides runs once, on two clients, when the model is built.

Randomness: initial weights come from the factory itself under a per-model seed, on the CPU, so a run's models are
the same on every device and driver. Dropout masks come from torch's generator seeded from the clients' sample
orders: a run is repeatable, though two drivers that group clients differently draw different masks.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from dfca.models.batched import BatchedModel, Params, first_layer_multiply_adds, in_order, masked_orders

log = logging.getLogger(__name__)

CPU_SAMPLES_PER_CALL = 512  # samples of all clients in one vmapped call on the CPU: bounds activation memory (the
# paper's CNN: about 0.6 GB a round at 512, 1.1 GB at 1024, and no faster at 1024; benchmarks/torch_models.py)
GPU_SAMPLES_PER_CALL = 1 << 14  # the paper CNN: about 3 GB of activations a call
BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)
Loss = Callable[[Tensor, Tensor], Tensor]


def default_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


class TorchModel(BatchedModel):
    """`make()` returns a fresh module (the user's factory with its arguments bound); `template` is one made already.

    `loss`: the module's own `dfca_loss(output, target)` when it defines one, else cross-entropy (the mean over the
    batch). `last_layer`: the module's `dfca_last_layer` (a submodule's name) when set, else the last submodule, in
    registration order, that holds parameters of its own.
    """

    def __init__(self, make: Callable[[], nn.Module], template: nn.Module, input_shape: tuple[int, ...],
                 classes: int, name: str = "torch module") -> None:
        self.make, self.module, self.name = make, template.float(), name
        self.input_shape, self.classes = tuple(input_shape), classes
        self.param_names = [n for n, p in template.named_parameters() if p.requires_grad]
        state = template.state_dict(keep_vars=True)
        carried = set(self.param_names) | {n for n, b in template.named_buffers() if b.is_floating_point()}
        self.names = [n for n in state if n in carried]  # state_dict order: the wire's and the files' names
        self._shapes = {n: tuple(state[n].shape) for n in self.names}
        self.frozen = {n: t.detach() for n, t in state.items() if n not in carried}  # int buffers, frozen params
        own_loss = getattr(template, "dfca_loss", None)
        self.loss: Loss = own_loss if callable(own_loss) else default_loss
        self.has_batch_norm = any(isinstance(m, BATCH_NORMS) for m in template.modules())
        self.device = torch.device("cpu")
        self.vmappable = True
        self._probe()
        self.first = first_linear(template, self.input_shape) if self.vmappable else None
        self.rest = template[int(self.first) + 1 :] if self.first is not None else None  # keeps the names

    # -- BatchedModel ------------------------------------------------------------------------------------------
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def to(self, device: torch.device) -> TorchModel:
        self.device = torch.device(device)
        self.module.to(self.device)
        self.frozen = {n: t.to(self.device) for n, t in self.frozen.items()}
        return self

    def init(self, n: int, generator: torch.Generator) -> Params:
        """n models, each made by the factory under its own seed drawn from `generator`, on the CPU."""
        seeds = torch.randint(0, 2**62, (n,), generator=generator).tolist()
        stacks: dict[str, list[Tensor]] = {k: [] for k in self.names}
        for seed in seeds:
            with torch.random.fork_rng(devices=[]):  # the factory draws from the global generator; keep it as it was
                torch.manual_seed(seed)
                state = self.make().float().state_dict()
            for k in self.names:
                stacks[k].append(state[k].detach().clone())
        if not seeds:
            return {k: torch.empty(0, *s) for k, s in self._shapes.items()}
        return {k: torch.stack(v) for k, v in stacks.items()}

    def last_layer(self) -> list[str]:
        chosen = getattr(self.module, "dfca_last_layer", None)
        layers = [(prefix, m) for prefix, m in self.module.named_modules()
                  if any(p.requires_grad for p in m.parameters(recurse=False))]
        if chosen is not None:
            layers = [(p, m) for p, m in layers if p == chosen]
            if not layers:
                raise ValueError(f"{self.name}: dfca_last_layer {chosen!r} names no submodule with parameters")
        prefix, module = layers[-1]
        return [f"{prefix}.{n}" if prefix else n for n, p in module.named_parameters(recurse=False) if p.requires_grad]

    @torch.no_grad()
    def logits(self, params: Params, x: Tensor) -> Tensor:
        """params [B, ...], x [B, n, *input] -> [B, n, classes], in eval mode, in blocks of clients and samples."""
        self.module.eval()
        b, n = x.shape[:2]
        per_call = self._samples_per_call(x.device)
        samples = max(1, min(n, per_call))
        clients = max(1, per_call // samples)
        out = torch.empty(b, n, self.classes, device=x.device, dtype=x.dtype)
        for lo in range(0, b, clients):
            rows = slice(lo, lo + clients)
            p = {k: v[rows] for k, v in params.items()}
            for s in range(0, n, samples):
                out[rows, s : s + samples] = self._forward(p, x[rows, s : s + samples])
        return out

    def sgd(
        self, params: Params, x: Tensor, y: Tensor, lr: float, orders: Tensor, batch_size: int,
        momentum: float = 0.0, sample_mask: Tensor | None = None,
    ) -> None:
        orders = orders.to(x.device)
        valid = None
        if sample_mask is not None:
            orders, valid = masked_orders(orders, sample_mask)
        self.module.train()
        in_samples = valid is None and self.first_layer_form(y.shape[1], orders.shape[1]) == "samples"
        clients = max(1, self._samples_per_call(x.device) // max(1, min(batch_size, y.shape[1])))
        if in_samples:
            clients = x.shape[0]  # in sample space a client's step state is small (K, P0 and U: n x n, n x h)
        seed = int(orders[:, :, : min(4, orders.shape[2])].sum()) * 1_000_003 + orders.shape[0]
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            torch.manual_seed(seed)  # dropout: the same masks every time the same clients train the same orders
            for lo in range(0, x.shape[0], clients):
                rows = slice(lo, lo + clients)
                block = {k: v[rows] for k, v in params.items()}  # views: the steps write into params
                if in_samples:
                    self._sgd_block_samples(block, x[rows], y[rows], lr, orders[rows], batch_size, momentum)
                else:
                    self._sgd_block(block, x[rows], y[rows], lr, orders[rows], batch_size, momentum,
                                    None if valid is None else valid[rows])

    # -- the batched step ---------------------------------------------------------------------------------------
    def _sgd_block(self, params: Params, x: Tensor, y: Tensor, lr: float, orders: Tensor, bs: int,
                   momentum: float, valid: Tensor | None) -> None:
        theta = {k: params[k] for k in self.param_names}
        vel = {k: torch.zeros_like(v) for k, v in theta.items()} if momentum > 0 else None
        least = 2 if self.has_batch_norm else 1
        for epoch in range(orders.shape[1]):
            order = orders[:, epoch]
            xe, ye = in_order(x, order), in_order(y, order)
            steps = orders.shape[2] if valid is None else int(valid[:, epoch].sum(1).max())
            for lo in range(0, steps, bs):
                if valid is None:
                    width = min(bs, steps - lo)
                    groups = [(None, width)] if width >= least else []
                else:
                    counts = valid[:, epoch, lo : lo + bs].sum(1)
                    groups = [(None if bool((counts == c).all()) else (counts == c).nonzero().flatten(), int(c))
                              for c in counts.unique().tolist() if c >= least]
                for rows, width in groups:
                    batch = slice(lo, lo + width)  # kept samples come first in the order (masked_orders)
                    if rows is None:
                        self._step(params, theta, vel, xe[:, batch], ye[:, batch], lr, momentum)
                    else:
                        sub = {k: v.index_select(0, rows) for k, v in params.items()}
                        sub_vel = None if vel is None else {k: v.index_select(0, rows) for k, v in vel.items()}
                        sub_theta = {k: sub[k] for k in self.param_names}
                        self._step(sub, sub_theta, sub_vel, xe[rows, batch], ye[rows, batch], lr, momentum)
                        for k, v in sub.items():
                            params[k].index_copy_(0, rows, v)
                        if vel is not None and sub_vel is not None:
                            for k, v in sub_vel.items():
                                vel[k].index_copy_(0, rows, v)

    # -- the first layer in sample space ------------------------------------------------------------------------
    def first_layer_form(self, samples: int, epochs: int) -> str:
        """"samples" where the first Linear's sample-space step is fewer multiply-adds (dfca.models.mlp.MLP's count)."""
        if self.first is None:
            return "weights"
        h, d = self._shapes[f"{self.first}.weight"]
        cost = first_layer_multiply_adds(samples, epochs, d, h)
        return "samples" if cost["samples"] < cost["weights"] else "weights"

    def _sgd_block_samples(self, params: Params, x: Tensor, y: Tensor, lr: float, orders: Tensor, bs: int,
                           momentum: float) -> None:
        assert self.first is not None
        w_name, b_name = f"{self.first}.weight", f"{self.first}.bias"
        bias = b_name in params
        xf = x.reshape(x.shape[0], x.shape[1], -1)  # [B, n, d]
        gram = torch.bmm(xf, xf.transpose(1, 2))  # K = X X^T (+ 1 with a bias)
        p0 = torch.bmm(xf, params[w_name].transpose(1, 2))  # P0 = X W_0^T + b_0
        if bias:
            gram.add_(1.0)
            p0.add_(params[b_name].unsqueeze(1))
        u = torch.zeros_like(p0)
        vel_u = torch.zeros_like(p0) if momentum > 0 else None
        theta = {k: params[k] for k in self.param_names if k not in (w_name, b_name)}
        vel = {k: torch.zeros_like(v) for k, v in theta.items()} if momentum > 0 else None
        buffers = {k: v for k, v in params.items() if k not in self.param_names}
        least = 2 if self.has_batch_norm else 1
        rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1) * x.shape[1]
        for epoch in range(orders.shape[1]):
            order = orders[:, epoch]
            for lo in range(0, orders.shape[2], bs):
                idx = order[:, lo : lo + bs]  # [B, b] sample indices
                if idx.shape[1] < least:
                    continue
                flat = (idx + rows).flatten()
                k_rows = gram.reshape(-1, gram.shape[2]).index_select(0, flat).view(*idx.shape, -1)
                pre = torch.baddbmm(p0.reshape(-1, p0.shape[2]).index_select(0, flat).view(*idx.shape, -1), k_rows, u)
                yb = torch.gather(y, 1, idx)
                grads, d_pre, new_buffers = self._rest_grads(theta, buffers, pre, yb)
                with torch.no_grad():
                    self._apply(theta, vel, grads, lr, momentum)
                    for k, v in new_buffers.items():
                        params[k].copy_(v)
                    if vel_u is None:  # only the batch's rows of U change
                        u.view(-1, u.shape[2]).index_add_(0, flat, d_pre.reshape(-1, u.shape[2]), alpha=-lr)
                    else:  # the velocity decays in every row: the gradient in sample space, dense
                        vel_u.mul_(momentum).view(-1, u.shape[2]).index_add_(0, flat, d_pre.reshape(-1, u.shape[2]))
                        u.add_(vel_u, alpha=-lr)
        params[w_name].baddbmm_(u.transpose(1, 2), xf)  # W = W_0 + U^T X
        if bias:
            params[b_name].add_(u.sum(1))

    def _rest_loss(self, theta: Params, buffers: Params, pre: Tensor, yb: Tensor) -> tuple[Tensor, Params]:
        """The loss of the layers after the first, from its pre-activations."""
        assert self.rest is not None
        return self._module_loss(self.rest, theta, buffers, pre, yb)

    def _rest_grads(self, theta: Params, buffers: Params, pre: Tensor, yb: Tensor) -> tuple[Params, Tensor, Params]:
        (grads, d_pre), state = vmap(grad(self._rest_loss, argnums=(0, 2), has_aux=True),
                                     randomness="different")(theta, buffers, pre, yb)
        return grads, d_pre, state

    @staticmethod
    def _apply(theta: Params, vel: Params | None, grads: Params, lr: float, momentum: float) -> None:
        """The SGD step of torch.optim.SGD (heavy ball with `vel`), in place, every tensor at once."""
        if not theta:
            return
        if vel is None:
            torch._foreach_add_(list(theta.values()), [grads[k] for k in theta], alpha=-lr)
            return
        velocity = [vel[k] for k in theta]
        torch._foreach_mul_(velocity, momentum)
        torch._foreach_add_(velocity, [grads[k] for k in theta])
        torch._foreach_add_(list(theta.values()), velocity, alpha=-lr)

    def _step(self, params: Params, theta: Params, vel: Params | None, xb: Tensor, yb: Tensor, lr: float,
              momentum: float) -> None:
        """One SGD step of every row of `params` on its batch xb [B, b, ...], yb [B, b], in place."""
        buffers = {k: v for k, v in params.items() if k not in theta}
        grads, new_buffers = self._grads(theta, buffers, xb, yb)
        with torch.no_grad():
            self._apply(theta, vel, grads, lr, momentum)
            for k, v in new_buffers.items():
                params[k].copy_(v)

    def _loss(self, theta: Params, buffers: Params, xb: Tensor, yb: Tensor) -> tuple[Tensor, Params]:
        return self._module_loss(self.module, theta, buffers, xb, yb)

    def _module_loss(self, module: nn.Module, theta: Params, buffers: Params, inputs: Tensor, yb: Tensor
                     ) -> tuple[Tensor, Params]:
        """One client's loss through `module`, and its buffers as the forward left them (BatchNorm updates them in
        train mode); the buffers and frozen tensors are cloned, so that the transforms see no captured mutation."""
        state = {k: v.clone() for k, v in buffers.items()}
        frozen = {k: v.clone() for k, v in self.frozen.items()}
        output = functional_call(module, (theta, state, frozen), (inputs,))
        return self.loss(output, yb), state

    def _grads(self, theta: Params, buffers: Params, xb: Tensor, yb: Tensor) -> tuple[Params, Params]:
        if self.vmappable:
            return vmap(grad(self._loss, has_aux=True), randomness="different")(theta, buffers, xb, yb)  # type: ignore[no-any-return]
        one = grad(self._loss, has_aux=True)
        rows = [one({k: v[b] for k, v in theta.items()}, {k: v[b] for k, v in buffers.items()}, xb[b], yb[b])
                for b in range(xb.shape[0])]
        return ({k: torch.stack([r[0][k] for r in rows]) for k in theta},
                {k: torch.stack([r[1][k] for r in rows]) for k in buffers})

    def _forward(self, params: Params, x: Tensor) -> Tensor:
        def one(p: Params, xb: Tensor) -> Tensor:
            return functional_call(self.module, (p, self.frozen), (xb,))  # type: ignore[no-any-return]

        if self.vmappable:
            return vmap(one, randomness="different")(params, x)  # type: ignore[no-any-return]
        return torch.stack([one({k: v[b] for k, v in params.items()}, x[b]) for b in range(x.shape[0])])

    def _samples_per_call(self, device: torch.device) -> int:
        return CPU_SAMPLES_PER_CALL if device.type == "cpu" else GPU_SAMPLES_PER_CALL

    # -- can vmap batch it? ------------------------------------------------------------------------------------
    def _probe(self) -> None:
        """Run the batched step and forward once on two clients of two samples each (on the CPU, on copies); a
        module vmap cannot batch trains client by client, after a warning that names the reason."""
        params = self.init(2, torch.Generator().manual_seed(0))
        x = torch.randn(2, 2, *self.input_shape, generator=torch.Generator().manual_seed(0))
        y = torch.zeros(2, 2, dtype=torch.long)
        try:
            with torch.random.fork_rng(devices=[]):
                self.module.train()
                theta = {k: params[k] for k in self.param_names}
                buffers = {k: v for k, v in params.items() if k not in theta}
                vmap(grad(self._loss, has_aux=True), randomness="different")(theta, buffers, x, y)
                self.module.eval()
                with torch.no_grad():
                    vmap(lambda p, xb: functional_call(self.module, (p, self.frozen), (xb,)),
                         randomness="different")(params, x)
        except Exception as err:  # vmap raises RuntimeError/ValueError with its reason; any failure falls back
            self.vmappable = False
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            message = (f"{self.name}: torch.func.vmap cannot batch this module over clients ({type(err).__name__}: "
                       f"{reason[:300]}); it trains and predicts one client at a time instead (same results, "
                       "slower)")
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            log.warning(message)


def first_linear(module: nn.Module, input_shape: tuple[int, ...]) -> str | None:
    """The name of a Sequential's first layer when it is a trainable nn.Linear on the whole flattened sample (only
    nn.Flatten() before it, or a one-dimensional sample), else None."""
    if not isinstance(module, nn.Sequential):
        return None
    flat = len(input_shape) == 1
    for name, child in module.named_children():
        if isinstance(child, nn.Flatten) and child.start_dim == 1 and child.end_dim == -1:
            flat = True
            continue
        trainable = all(p.requires_grad for p in child.parameters())
        return name if isinstance(child, nn.Linear) and flat and trainable and name.isdigit() else None
    return None
