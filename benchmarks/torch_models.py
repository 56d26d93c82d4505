"""A module trained for every client at once (dfca.models.torch_model) against a per-client torch loop doing the same
arithmetic, and the built-in MLP against the same MLP written as an nn.Module.

    python benchmarks/torch_models.py [--clients 100] [--train 80] [--batch 10] [--cnn-epochs 1] [--mlp-epochs 5]
                                      [--repeats 3] [--device cpu] [--only cnn,mlp] [--out FILE]

A "round" here is one local update of every client (`sgd`: shuffled batches, plain SGD, lr 0.05) and one evaluation
of every client's model on its training samples (`logits`, as the least-loss assignment does), on the bundled MNIST
(rotations 0 and 180), `--clients` clients of `--train` samples each. Cases:
- `cnn`: the paper's CNN (`model.kind: cnn`, dfca.models.paper_cnn.PaperCNN) batched through torch.func, against a
  per-client
  loop that loads each client's state into one nn.Module and steps torch.optim.SGD (what a framework that trains one
  client at a time does; the CNN's own path before it was batched);
- `mlp`: the built-in MLP (784-200-10, hand-written batched forward and backward, sample-space first layer where
  cheaper), against the same MLP as nn.Sequential through dfca.models.torch_model, and the per-client loop.
Each way starts from the same weights. The run fails unless every way ends one step of every client (its first
batch) at the same models (max |difference| within 1e-4). After a whole round the ways differ by rounding, amplified
by training: printed beside the spread the per-client loop itself shows when its start is perturbed by one part in
10^7 (the paper's CNN on MNIST amplifies that to about 1e-2 in 8 steps). Seconds: the median of `--repeats` timed
rounds after an untimed one, the ways alternating, with the heap kept as a run keeps it (dfca.heap). Peak memory:
how much one round grew the resident set of a process that runs only that way (CPU: its high-water mark, reset
just before the round, against its resident set then), or torch's allocator's peak (cuda). The CNN's executed
GFLOP/s (multiply-adds count two: forward, input and weight gradients) is set beside a plain matrix multiply's,
timed in the same run: the share of the machine's rate the loop already uses bounds what batching can gain on that
device. Appends one line per case, with the commit and load, to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from resumable_runs import RESULTS, append_stamped
from torch import nn

from dfca.config import ExperimentConfig
from dfca.data import build_federated_data
from dfca.devices import resolve_device
from dfca.heap import keep_freed_memory
from dfca.models.batched import BatchedModel, Params, client_permutations
from dfca.models.build import build_model
from dfca.models.mlp import MLP
from dfca.models.paper_cnn import PaperCNN
from dfca.models.torch_model import TorchModel

LR = 0.05
TOLERANCE = 1e-4
Ways = dict[str, tuple[Callable[..., torch.Tensor], dict[str, torch.Tensor]]]


def mlp_module(d: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def as_module(params: Params) -> Params:
    """The built-in MLP's tensors under nn.Sequential's names (Linear keeps [out, in])."""
    return {"1.weight": params["w1"].transpose(-1, -2).contiguous(), "1.bias": params["b1"].clone(),
            "3.weight": params["w2"].transpose(-1, -2).contiguous(), "3.bias": params["b2"].clone()}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PerClientLoop:
    """One nn.Module and torch.optim.SGD, client by client: load its state, step over its batches, store it back;
    then its forward on its samples, in eval mode."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module.to(device)
        self.least = 2 if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()) else 1

    def round(self, params: Params, x: torch.Tensor, y: torch.Tensor, orders: torch.Tensor, bs: int) -> torch.Tensor:
        state = self.module.state_dict()
        logits = []
        for b in range(x.shape[0]):
            with torch.no_grad():
                for k, v in params.items():
                    state[k].copy_(v[b])
            self.module.train()
            opt = torch.optim.SGD(self.module.parameters(), lr=LR)
            for epoch in range(orders.shape[1]):
                order = orders[b, epoch]
                for lo in range(0, order.numel(), bs):
                    idx = order[lo : lo + bs]
                    if idx.numel() < self.least:
                        continue
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(self.module(x[b, idx]), y[b, idx]).backward()
                    opt.step()
            self.module.eval()
            with torch.no_grad():
                for k, v in params.items():
                    v[b].copy_(state[k])
                logits.append(self.module(x[b]))
        return torch.stack(logits)


def batched_round(model: BatchedModel) -> Callable[..., torch.Tensor]:
    def run(params: Params, x: torch.Tensor, y: torch.Tensor, orders: torch.Tensor, bs: int) -> torch.Tensor:
        model.sgd(params, x, y, LR, orders, bs)
        return model.logits(params, x)

    return run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ways(ways: Ways, x: torch.Tensor, y: torch.Tensor, orders: torch.Tensor, bs: int, repeats: int,
              device: torch.device) -> dict[str, dict[str, Any]]:
    """Each way: an untimed round, then `repeats` timed rounds, the ways alternating; every round starts from the
    same weights. Returns seconds (median, all), the cuda allocator's peak growth, and the last round's models."""
    out: dict[str, dict[str, Any]] = {name: {"seconds_all": [], "peak_mib": 0.0} for name in ways}
    for repeat in range(repeats + 1):
        for name, (run, start) in ways.items():
            params = {k: v.clone() for k, v in start.items()}
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            began = time.perf_counter()
            run(params, x, y, orders, bs)
            sync(device)
            seconds = time.perf_counter() - began
            if repeat:
                out[name]["seconds_all"].append(seconds)
                if device.type == "cuda":
                    grown = (torch.cuda.max_memory_allocated(device) - base) / (1 << 20)
                    out[name]["peak_mib"] = max(out[name]["peak_mib"], grown)
            out[name]["params"] = params
    for row in out.values():
        row["seconds"] = statistics.median(row["seconds_all"])
    return out


def max_difference(a: Params, b: Params) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def matmul_gflops(device: torch.device) -> float:
    n = 1024 if device.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(3):
        sync(device)
        began = time.perf_counter()
        for _ in range(5):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - began) / 5)
    return 2 * n**3 / best / 1e9


def cnn_flops(side: int, classes: int, samples: int, steps_samples: int) -> float:
    """Executed FLOPs of a round: training (forward, input gradient of conv2 and fc, weight gradients) on
    `steps_samples` samples, evaluation (forward) on `samples`."""
    conv1 = 2 * side * side * 32 * 25  # 1 -> 32 channels, 5x5, at side x side
    conv2 = 2 * (side // 2) ** 2 * 64 * 32 * 25
    fc = 2 * 64 * (side // 4) ** 2 * classes
    forward = conv1 + conv2 + fc
    backward = conv1 + 2 * conv2 + 2 * fc  # conv1: weight gradient only (no gradient for the input images)
    return steps_samples * (forward + backward) + samples * forward


def data(clients: int, train: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ExperimentConfig.model_validate({"clusters": 2, "data": {"dataset": "mnist-bundled", "rotations": [0, 180],
                                                    "clients": clients, "train_per_client": train,
                                                    "test_per_client": 1}})
    federated = build_federated_data(cfg)
    return federated.x_train.to(device), federated.y_train.to(device)


@dataclass
class Case:
    """A case's data and ways; `baseline`: the way the others' times are divided by; `loop`/`loop_start`: the
    per-client loop and its start (in the module's names); `named`: how a way's tensors take the module's names."""

    ways: Ways
    baseline: str
    x: torch.Tensor
    y: torch.Tensor
    orders: torch.Tensor
    loop: Callable[..., torch.Tensor]
    loop_start: Params
    named: dict[str, Callable[[Params], Params]] = field(default_factory=dict)
    flops: float | None = None


def cnn_case(args: argparse.Namespace, device: torch.device) -> Case:
    x, y = data(args.clients, args.train, device)
    orders = client_permutations(range(args.clients), args.train, args.cnn_epochs).to(device)
    model = build_model("cnn", (1, 28, 28), 0, 10, device)
    assert isinstance(model, TorchModel)
    start = {k: v.to(device) for k, v in model.init(args.clients, torch.Generator().manual_seed(0)).items()}
    loop = PerClientLoop(PaperCNN(1, 28, 10), device)
    steps = args.clients * args.cnn_epochs * sum(b for b in _batches(args.train, args.batch) if b >= 2)
    return Case({"batched": (batched_round(model), start), "per-client loop": (loop.round, start)},
                "per-client loop", x, y, orders, loop.round, start,
                flops=cnn_flops(28, 10, args.clients * args.train, steps))


def _batches(n: int, bs: int) -> list[int]:
    return [min(bs, n - lo) for lo in range(0, n, bs)]


def mlp_case(args: argparse.Namespace, device: torch.device) -> Case:
    x, y = data(args.clients, args.train, device)
    orders = client_permutations(range(args.clients), args.train, args.mlp_epochs).to(device)
    builtin = MLP(784, args.hidden, 10)
    module = TorchModel(lambda: mlp_module(784, args.hidden, 10), mlp_module(784, args.hidden, 10), (1, 28, 28), 10,
                        "the MLP as an nn.Module").to(device)
    start = {k: v.to(device) for k, v in builtin.init(args.clients, torch.Generator().manual_seed(0)).items()}
    loop = PerClientLoop(mlp_module(784, args.hidden, 10), device)
    return Case({"hand-written MLP": (batched_round(builtin), start),
                 "batched module": (batched_round(module), as_module(start)),
                 "per-client loop": (loop.round, as_module(start))},
                "hand-written MLP", x, y, orders, loop.round, as_module(start), named={"hand-written MLP": as_module})


CASES: dict[str, Callable[[argparse.Namespace, torch.device], Case]] = {"cnn": cnn_case, "mlp": mlp_case}


def run_case(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    case = CASES[name](args, device)
    timed = time_ways(case.ways, case.x, case.y, case.orders, args.batch, args.repeats, device)
    for way, convert in case.named.items():
        timed[way]["params"] = convert(timed[way]["params"])
    check = checks(case, args.batch)
    return summarise(name, timed, case.baseline, check, case.flops)


def own_peak_mib(name: str, way: str, args: argparse.Namespace) -> float:
    """The most the resident set of a process that runs only `way` of case `name` grew during one round, after its
    data and weights are made, in MiB: the high-water mark (VmHWM) is reset just before the round."""
    device = torch.device("cpu")
    case = CASES[name](args, device)
    run, start = case.ways[way]
    params = {k: v.clone() for k, v in start.items()}
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = rss_bytes()
    run(params, case.x, case.y, case.orders, args.batch)
    status = Path("/proc/self/status").read_text()
    peak = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
    return max(0.0, (peak - before) / (1 << 20))


def peaks_in_own_processes(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for row in rows:
        for way in row["ways"]:
            argv = [sys.executable, __file__, "--peak", f"{row['case']}:{way}", *sys.argv[1:]]
            done = subprocess.run(argv, capture_output=True, text=True, check=True)
            row["ways"][way]["peak_mib"] = float(done.stdout.strip().splitlines()[-1])


def checks(case: Case, bs: int) -> dict[str, float]:
    """The largest difference between the ways after one step of every client (must be rounding), and the spread the
    loop shows over the whole round when its start is perturbed by one part in 10^7."""
    x, y, orders = case.x, case.y, case.orders
    batch = orders[:, 0, :bs].to(x.device)  # every client's first batch, as its whole data for one step
    xb = torch.stack([x[b, batch[b]] for b in range(x.shape[0])])
    yb = torch.stack([y[b, batch[b]] for b in range(y.shape[0])])
    in_place = torch.arange(batch.shape[1], device=x.device).expand(x.shape[0], 1, -1).contiguous()
    ends = []
    for name, (run, start) in case.ways.items():
        params = {k: v.clone() for k, v in start.items()}
        run(params, xb, yb, in_place, bs)
        ends.append(case.named.get(name, lambda p: p)(params))
    step = max(max_difference(ends[0], other) for other in ends[1:])
    g = torch.Generator().manual_seed(7)
    a = {k: v.clone() for k, v in case.loop_start.items()}
    b = {k: v * (1 + 1e-7 * torch.randn(v.shape, generator=g).to(v.device)) for k, v in case.loop_start.items()}
    for params in (a, b):
        case.loop(params, x, y, orders, bs)
    return {"one_step": step, "loop_spread": max_difference(a, b)}


def summarise(case: str, timed: dict[str, dict[str, Any]], baseline: str, check: dict[str, float],
              flops: float | None = None) -> dict[str, Any]:
    if check["one_step"] > TOLERANCE:
        raise SystemExit(f"{case}: one step of every client ends {check['one_step']:.2e} apart (more than "
                         f"{TOLERANCE:g}): not the same models")
    names = list(timed)
    after = max(max_difference(timed[names[0]]["params"], timed[n]["params"]) for n in names[1:])
    row: dict[str, Any] = {"case": case, "max_difference_one_step": check["one_step"], "max_difference": after,
                           "loop_spread_1e-7": check["loop_spread"], "ways": {}}
    for name, t in timed.items():
        row["ways"][name] = {"seconds": t["seconds"], "seconds_all": t["seconds_all"], "peak_mib": t["peak_mib"],
                             "ratio_to_" + baseline.replace(" ", "_"): t["seconds"] / timed[baseline]["seconds"]}
        if flops is not None:
            row["ways"][name]["gflops"] = flops / t["seconds"] / 1e9
    return row


def print_table(rows: list[dict[str, Any]], matmul: float, device: torch.device, args: argparse.Namespace) -> None:
    print(f"\n{args.clients} clients x {args.train} samples, batch {args.batch}, device {device}, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; a plain matmul: {matmul:.1f} GFLOP/s")
    print("| case | way | s/round | × the baseline's time | peak MiB | GFLOP/s (share of matmul) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        for name, way in row["ways"].items():
            ratio = next(v for k, v in way.items() if k.startswith("ratio_to_"))
            rate = (f"{way['gflops']:.1f} ({way['gflops'] / matmul:.2f})" if "gflops" in way else "")
            print(f"| {row['case']} | {name} | {way['seconds']:.3f} | {ratio:.2f} | {way['peak_mib']:.0f} | {rate} |")
        print(f"| {row['case']} | max model difference: one step {row['max_difference_one_step']:.1e}, the round "
              f"{row['max_difference']:.1e} (the loop's own spread from a 1e-7 start: {row['loop_spread_1e-7']:.1e}) "
              "| | | | |")
    for row in rows:
        ways = row["ways"]
        if row["case"] == "cnn":
            speedup = ways["per-client loop"]["seconds"] / ways["batched"]["seconds"]
            print(f"cnn: batched is {speedup:.2f}x the per-client loop's speed (goal: 4x on 2 CPU cores, 20x on a GPU)")
        else:
            ratio = ways["batched module"]["seconds"] / ways["hand-written MLP"]["seconds"]
            print(f"mlp: the module takes {ratio:.2f}x the hand-written MLP's time (goal: within 2x); the loop "
                  f"{ways['per-client loop']['seconds'] / ways['batched module']['seconds']:.1f}x the module's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--train", type=int, default=80)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=200)
    parser.add_argument("--cnn-epochs", type=int, default=1)
    parser.add_argument("--mlp-epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="cnn,mlp")
    parser.add_argument("--out", type=Path, default=Path(RESULTS) / "torch_models_runs.jsonl")
    parser.add_argument("--peak", help=argparse.SUPPRESS)  # CASE:WAY: print that way's peak growth (own process)
    args = parser.parse_args()
    keep_freed_memory()  # the heap as a run keeps it (dfca.heap): rounds after the first reuse their memory
    if args.peak:
        name, way = args.peak.split(":", 1)
        print(own_peak_mib(name, way, args))
        return
    device = resolve_device(args.device)
    load_before = os.getloadavg()[0]
    rows = [run_case(name, args, device) for name in args.only.split(",")]
    if device.type == "cpu":
        peaks_in_own_processes(rows, args)
    matmul = matmul_gflops(device)
    print_table(rows, matmul, device, args)
    settings = {k: getattr(args, k) for k in ("clients", "train", "batch", "hidden", "cnn_epochs", "mlp_epochs",
                                              "repeats")}
    append_stamped(args.out, rows, load_before, device=str(device), threads=torch.get_num_threads(),
                   matmul_gflops=matmul, **settings,
                   gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    print(f"appended {len(rows)} lines to {args.out}")


if __name__ == "__main__":
    main()
