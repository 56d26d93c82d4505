"""Seconds per simulator round, split by phase, against a per-client PyTorch autograd loop, and how close each phase
comes to the machine's matrix-multiply rate.

    python benchmarks/simulator_round.py [--clients 100] [--hidden 200] [--batch 10] [--epochs 5] [--rounds 5]
                                         [--device cpu] [--out docs/results/simulator_round_runs.jsonl]

Prints one table: the simulator's round of DFCA's paper rule (dfca.simulator.Simulation, timed by phase:
training is the algorithm's `begin_round`, aggregation its exchange, assignment/inference the next round's loss
matrix and the evaluation), the same round done the way reference implementations do it (one nn.Module and
optimizer step per client, state dicts averaged in Python), and their ratio. For each phase: the floating-point
operations it executes (multiply-adds count two), its GFLOP/s, and that as a fraction of a plain matrix multiply
timed in the same run on the same device (1024x784x1024 on the CPU; 8192x8192x8192 float32 on a GPU, whose small
products are launch-bound). With `--device cuda` both rounds and every reference run on the GPU, and each timed
span ends with torch.cuda.synchronize(). Training is counted twice: the FLOPs the simulator's kernel executes
(the MLP's "samples" form where it is cheaper, models.MLP) and the textbook step's (4dh + 6hc a sample: the
forward and the weight gradients, no input gradient for the first layer), whose rate can exceed the matmul's
because the kernel does less arithmetic for the same SGD. Each phase is the median round after the first (a
warm-up); the matmul reference is the best of three loops. A second table times the MLP's local SGD alone in
both forms on the same data. A third puts that call beside its floor (benchmarks/kernel_floor.py): the products
it multiplies, each timed alone at its shapes and layouts, then with its elementwise and its index/reorder kernels
too; the products' FLOPs over their seconds alone is the most the call's executed FLOP/s could reach with these
kernels if nothing else cost anything, and the call beyond all its kernels is Python and dispatch. Appends the
figures, the commit and the machine's load to --out. Goal: simulator round <= 0.5x the per-client loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from kernel_floor import Floor, kernel_floor
from resumable_runs import commit
from rich.console import Console
from rich.table import Table
from torch import nn

from dfca.algorithms import Algorithm
from dfca.config import ExperimentConfig
from dfca.models.batched import client_permutations
from dfca.models.mlp import MLP
from dfca.simulator import Simulation, keep_run_heap, prepare


def config(args: argparse.Namespace) -> ExperimentConfig:
    return ExperimentConfig.model_validate({
        "name": "bench", "clusters": 2, "rounds": args.rounds, "seed": 0,
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": args.clients,
                 "train_per_client": args.train, "test_per_client": 10, "permute_per_cluster": True},
        "model": {"kind": "mlp", "hidden": args.hidden},
        "train": {"lr": 0.1, "local_epochs": args.epochs, "batch_size": args.batch},
        "topology": {"kind": "erdos_renyi", "p": 0.15}, "dfca": {"variant": "paper"}, "device": args.device,
    })


def synchronize() -> None:
    """Wait for the GPU's queued work, so a timed span holds its kernels (nothing on the CPU)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed_phases(algo: Algorithm) -> list[dict[str, float]]:
    """Wrap the algorithm's steps (once) so that each call adds its seconds to its phase in the last dict."""
    rounds: list[dict[str, float]] = []
    phases = {"begin_round": "training", "send": "aggregation", "receive": "aggregation",
              "end_exchange": "aggregation", "end_round": "assignment + inference",
              "evaluate": "assignment + inference"}
    for method, phase in phases.items():
        step = getattr(algo, method)

        def wrapper(*args, step=step, phase=phase):  # type: ignore[no-untyped-def]
            synchronize()
            t0 = time.perf_counter()
            out = step(*args)
            synchronize()
            rounds[-1][phase] = rounds[-1].get(phase, 0.0) + time.perf_counter() - t0
            return out

        setattr(algo, method, wrapper)
    return rounds


def vectorized_rounds(sim: Simulation, rounds: int) -> list[dict[str, float]]:
    """Each round's seconds by phase: the simulator's round, then the evaluation a record makes."""
    times = timed_phases(sim.algorithm)
    for t in range(rounds):
        times.append({})
        sim.run_round(t)
        sim.algorithm.evaluate()
    return times


class RefMLP(nn.Module):
    def __init__(self, d: int, h: int, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def per_client_round(ctx, states: list[list[dict[str, torch.Tensor]]]) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The reference style: a module per client, autograd, Python-level averaging of state dicts."""
    cfg, d = ctx.cfg, ctx.data
    n, k = len(states), cfg.clusters
    net = RefMLP(d.x_train[0, 0].numel(), cfg.model.hidden, d.num_classes).to(ctx.device)
    times: dict[str, float] = {}
    synchronize()
    t0 = time.perf_counter()
    assigned = []
    with torch.no_grad():
        for i in range(n):
            losses = []
            for j in range(k):
                net.load_state_dict(states[i][j])
                losses.append(nn.functional.cross_entropy(net(d.x_train[i]), d.y_train[i]).item())
            c = min(range(k), key=losses.__getitem__)
            assigned.append(c)
            net.load_state_dict(states[i][c])
            (net(d.x_test[i]).argmax(1) == d.y_test[i]).float().mean()
    synchronize()
    times["assignment + inference"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        net.load_state_dict(states[i][assigned[i]])
        opt = torch.optim.SGD(net.parameters(), lr=cfg.train.lr)
        for _ in range(cfg.train.local_epochs):
            perm = torch.randperm(d.y_train.shape[1])
            for lo in range(0, perm.numel(), cfg.train.batch_size):
                idx = perm[lo : lo + cfg.train.batch_size]
                opt.zero_grad()
                nn.functional.cross_entropy(net(d.x_train[i, idx]), d.y_train[i, idx]).backward()
                opt.step()
        states[i][assigned[i]] = {k_: v.detach().clone() for k_, v in net.state_dict().items()}
    synchronize()
    times["training"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    adj = ctx.adjacency
    new = [[dict(s) for s in row] for row in states]
    for i in range(n):
        for j in range(k):
            senders = [m for m in range(n) if adj[i, m] and assigned[m] == j]
            if senders:
                new[i][j] = {name: (states[i][j][name] + sum(states[m][j][name] for m in senders)) / (len(senders) + 1)
                             for name in states[i][j]}
    states[:] = new
    synchronize()
    times["aggregation"] = time.perf_counter() - t0
    return times


def phase_flops(cfg: ExperimentConfig, ctx: Any, batch_sgd_form: str) -> dict[str, float]:
    """FLOPs of one round's phases as the simulator executes them, and the textbook training's."""
    d, h, c, k = ctx.data.x_train[0, 0].numel(), cfg.model.hidden, ctx.data.num_classes, cfg.clusters
    n, n_test, epochs, clients = ctx.data.y_train.shape[1], ctx.data.y_test.shape[1], cfg.train.local_epochs, ctx.n
    mlp = MLP(d, h, c)
    params = d * h + h + h * c + c
    second_layer = 6 * h * c * epochs * n  # forward, weight gradient, input gradient
    executed = 2 * mlp.first_layer_multiply_adds(n, epochs)[batch_sgd_form] + second_layer
    return {
        "training": clients * executed,
        "training (textbook)": clients * (4 * d * h * epochs * n + second_layer),
        "assignment + inference": clients * 2 * (d * h + h * c) * (k * n + n_test),  # k losses, one model tested
        "aggregation": 2 * clients * clients * params,  # eq. 7: cluster j mixes the N/k copies that trained it
    }


def sgd_forms(ctx: Any, cfg: ExperimentConfig, repeats: int = 3) -> dict[str, float]:
    """Seconds of the MLP's local SGD alone (every client, one model each) in each form, best of `repeats`."""
    d = ctx.data.x_train[0, 0].numel()
    x, y = ctx.data.x_train.reshape(ctx.n, -1, d), ctx.data.y_train
    init = {name: t.to(ctx.device) for name, t in
            MLP(d, cfg.model.hidden, ctx.data.num_classes).init(ctx.n, torch.Generator().manual_seed(0)).items()}
    orders = client_permutations(list(range(ctx.n)), y.shape[1], cfg.train.local_epochs)
    best = {}
    for form in ("weights", "samples"):
        model = MLP(d, cfg.model.hidden, ctx.data.num_classes, form)
        for _ in range(repeats):
            params = {name: t.clone() for name, t in init.items()}
            synchronize()
            t0 = time.perf_counter()
            model.sgd(params, x, y, cfg.train.lr, orders, cfg.train.batch_size)
            synchronize()
            best[form] = min(best.get(form, float("inf")), time.perf_counter() - t0)
    return best


def product_gflops(a: torch.Tensor, b: torch.Tensor, reps: int, loops: int = 3) -> float:
    """GFLOP/s of a @ b (batched where a and b are), warmed up once: the best of `loops` loops of `reps` products
    (on this shared machine one loop swung 135-176 GFLOP/s between runs minutes apart)."""
    a @ b
    best = float("inf")
    for _ in range(loops):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * a[..., 0].numel() * a.shape[-1] * b.shape[-1] * reps / best / 1e9


def reference_shape(device: torch.device) -> tuple[int, int, int]:
    return (1024, 784, 1024) if device.type == "cpu" else (8192, 8192, 8192)


def matmul_gflops(device: torch.device, reps: int = 20) -> float:
    m, k, n = reference_shape(device)
    return product_gflops(torch.randn(m, k, device=device), torch.randn(k, n, device=device), reps)


def training_floor(ctx: Any, cfg: ExperimentConfig) -> Floor:
    """The auto form's local SGD (every client, one model each), its kernels each timed alone (kernel_floor)."""
    d = ctx.data.x_train[0, 0].numel()
    x, y = ctx.data.x_train.reshape(ctx.n, -1, d), ctx.data.y_train
    model = MLP(d, cfg.model.hidden, ctx.data.num_classes)
    params = {name: t.to(ctx.device) for name, t in model.init(ctx.n, torch.Generator().manual_seed(0)).items()}
    orders = client_permutations(list(range(ctx.n)), y.shape[1], cfg.train.local_epochs)
    return kernel_floor(lambda: model.sgd(params, x, y, cfg.train.lr, orders, cfg.train.batch_size))


def print_floor(console: Console, floor: Floor, actual: float, mm: float, row: dict[str, Any]) -> None:
    """The third table: local SGD's kernels each timed alone, added up kind by kind, against the whole call (best
    of 3, `actual` s); what the call takes beyond all of them is Python and dispatch."""
    gflop = floor.product_flops / 1e9
    table = Table(title="local SGD's kernels, each timed alone at the shapes and layouts it runs them "
                        "(benchmarks/kernel_floor.py): the floor under its rate")
    for column in ("what", "calls", "seconds", "GFLOP/s of its FLOPs", "of matmul", "of the products alone"):
        table.add_column(column, justify="left" if column == "what" else "right")
    products = floor.seconds.get("product", 0.0)
    calls, seconds, rows = 0, 0.0, []
    for kind, what in (("product", "products alone"), ("elementwise", "+ elementwise kernels alone"),
                       ("data movement", "+ index/reorder kernels alone")):
        calls, seconds = calls + floor.calls.get(kind, 0), seconds + floor.seconds.get(kind, 0.0)
        rows.append((what, calls, seconds))
    rows.append(("the call itself (best of 3)", sum(floor.calls.values()), actual))
    for what, n, s in rows:
        rate = gflop / s
        table.add_row(what, str(n), f"{s:.3f}", f"{rate:.1f}", f"{rate / mm:.2f}", f"{products / s:.2f}")
    console.print(table)
    console.print(f"the call beyond all its kernels alone (Python, dispatch): {actual - seconds:.3f} s; not timed: "
                  f"{floor.calls.get('not timed', 0)} tensors created, {floor.calls.get('view', 0)} views; "
                  f"products' FLOPs {gflop:.2f} GFLOP")
    for call, count, alone, flops in floor.product_shapes[:8]:
        console.print(f"  {count:4d} x {call}: {alone * 1e6:.0f} us each, {flops / alone / 1e9 / mm:.2f} of matmul")
    row["floor"] = {"calls": floor.calls, "seconds": floor.seconds, "product_gflop": gflop,
                    "products_of_matmul": gflop / products / mm if products else None,
                    "kernels_of_matmul": gflop / seconds / mm, "call_seconds": actual,
                    "call_of_products": products / actual, "call_beyond_kernels_seconds": actual - seconds,
                    "product_shapes": [list(shape) for shape in floor.product_shapes]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--hidden", type=int, default=200)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--train", type=int, default=80)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both rounds and the references run")
    p.add_argument("--out", type=Path, default=Path("docs/results/simulator_round_runs.jsonl"),
                   help="JSON lines file the figures are appended to")
    args = p.parse_args()
    torch.set_flush_denormal(True)
    load = os.getloadavg()[0]
    ctx = prepare(config(args))
    keep_run_heap(ctx)  # as simulate() does
    cfg = ctx.cfg
    sim = Simulation(ctx)
    params = {n: t.clone() for n, t in sim.algorithm.params.items()}  # type: ignore[attr-defined]
    states = [[{"fc1.weight": params["w1"][i, j].T.clone(), "fc1.bias": params["b1"][i, j].clone(),
                "fc2.weight": params["w2"][i, j].T.clone(), "fc2.bias": params["b2"][i, j].clone()}
               for j in range(cfg.clusters)] for i in range(ctx.n)]
    vec = vectorized_rounds(sim, args.rounds)
    ref = [per_client_round(ctx, states) for _ in range(args.rounds)]
    forms = sgd_forms(ctx, cfg)
    mm = matmul_gflops(ctx.device)
    floor = training_floor(ctx, cfg)
    phases = ["training", "assignment + inference", "aggregation"]

    def median(rows: list[dict[str, float]], key: str) -> float:  # the median round after the first (a warm-up)
        return statistics.median(r[key] for r in rows[1:] or rows)

    d, h = ctx.data.x_train[0, 0].numel(), cfg.model.hidden
    form = MLP(d, h, ctx.data.num_classes).sgd_form(ctx.data.y_train.shape[1], cfg.train.local_epochs)
    flops = phase_flops(cfg, ctx, form)
    table = Table(title=f"one round: {ctx.n} clients, MLP h={h}, batch {args.batch}, {args.epochs} local epochs, "
                        f"{args.train} samples/client, k={cfg.clusters}, on {ctx.device}; matmul reference "
                        f"{'x'.join(map(str, reference_shape(ctx.device)))} {mm:.1f} GFLOP/s")
    for column in ("phase", "simulator s", "per-client loop s", "ratio", "GFLOP", "GFLOP/s", "of matmul"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    row: dict[str, Any] = {"commit": commit(), "load_before": load, "threads": torch.get_num_threads(),
                           "device": torch.cuda.get_device_name() if ctx.device.type == "cuda" else "cpu",
                           "matmul_shape": reference_shape(ctx.device),
                           "args": vars(args) | {"out": str(args.out)}, "matmul_gflops": mm, "sgd_form": form,
                           "phases": {}}
    for ph in [*phases, "training (textbook)"]:
        a, b = median(vec, ph.split(" (")[0]), median(ref, ph.split(" (")[0])
        rate = flops[ph] / a / 1e9
        table.add_row(ph, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x", f"{flops[ph] / 1e9:.2f}", f"{rate:.1f}",
                      f"{rate / mm:.2f}")
        row["phases"][ph] = {"seconds": a, "reference_seconds": b, "gflop": flops[ph] / 1e9, "gflops": rate,
                             "of_matmul": rate / mm}
    va, rb = sum(median(vec, ph) for ph in phases), sum(median(ref, ph) for ph in phases)
    table.add_row("[bold]round", f"[bold]{va:.3f}", f"[bold]{rb:.3f}", f"[bold]{va / rb:.2f}x (goal <= 0.5x)")
    row["round_seconds"], row["reference_round_seconds"] = va, rb
    console = Console(width=150)
    console.print(table)
    sgd = Table(title=f"local SGD alone ({ctx.n} clients, one model each), best of 3; auto picks {form!r}")
    for column in ("form", "seconds", "GFLOP executed", "GFLOP/s", "of matmul", "textbook GFLOP/s"):
        sgd.add_column(column, justify="left" if column == "form" else "right")
    textbook = flops["training (textbook)"]
    for name, seconds in forms.items():
        executed = phase_flops(cfg, ctx, name)["training"]
        sgd.add_row(name, f"{seconds:.3f}", f"{executed / 1e9:.2f}", f"{executed / seconds / 1e9:.1f}",
                    f"{executed / seconds / 1e9 / mm:.2f}", f"{textbook / seconds / 1e9:.1f}")
        row[f"sgd_{name}"] = {"seconds": seconds, "gflop": executed / 1e9, "gflops": executed / seconds / 1e9}
    console.print(sgd)
    print_floor(console, floor, forms[form], mm, row)
    row["load_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    console.print(f"appended to {args.out} (commit {row['commit']}, load {load:.2f} -> {row['load_after']:.2f})")


if __name__ == "__main__":
    main()
