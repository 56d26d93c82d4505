"""What every peer script of benchmarks/peers.py shares: the workload file, the model, local SGD, the result line.

Only numpy, torch and the standard library: this module is imported by the scripts run in each peer's own
virtual environment (and by Ray's worker processes there, which find it on the driver's sys.path).

The workload file (written by benchmarks/peers.py) is one .npz:
    x_train [N, n, 784] float32 in [0, 1], y_train [N, n] int64  (client i's training set is row i)
    x_test [N, t, 784] float32, y_test [N, t] int64               (client i's test samples; all of them: the test set)
    meta: a JSON string with rounds, local_epochs, batch_size, lr, seed, threads, hidden.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class Workload:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    meta: dict[str, Any]

    @property
    def clients(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def rounds(self) -> int:
        return int(self.meta["rounds"])

    def train_of(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.x_train[client]), torch.from_numpy(self.y_train[client])

    def test_of(self, client: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.x_test[client]), torch.from_numpy(self.y_test[client])

    def test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every client's test samples together (the same samples in every framework)."""
        return (torch.from_numpy(self.x_test.reshape(-1, self.x_test.shape[-1])),
                torch.from_numpy(self.y_test.reshape(-1)))


@functools.lru_cache(maxsize=2)
def load(path: str) -> Workload:
    """The workload file, read once per process."""
    with np.load(path) as f:
        return Workload(f["x_train"], f["y_train"], f["x_test"], f["y_test"], json.loads(str(f["meta"])))


def setup_torch(threads: int) -> None:
    """The same torch settings in every framework: `threads` intra-op threads, denormals flushed (dfca's
    simulate flushes them too: they made some rounds several times slower)."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def mlp(seed: int, hidden: int = 200, inputs: int = 784, classes: int = 10) -> nn.Sequential:
    """784-200-10 with ReLU, torch.nn.Linear's default initialisation, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def local_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, meta: dict[str, Any], seed: int) -> None:
    """`local_epochs` epochs of plain SGD (no momentum), mean cross-entropy, a fresh shuffle every epoch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=float(meta["lr"]), momentum=0.0)
    generator = torch.Generator().manual_seed(seed)
    batch = int(meta["batch_size"])
    model.train()
    for _ in range(int(meta["local_epochs"])):
        order = torch.randperm(x.shape[0], generator=generator)
        for lo in range(0, x.shape[0], batch):
            idx = order[lo:lo + batch]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()


def client_seed(seed: int, round_: int, client: int) -> int:
    return (seed * 1_000_003 + round_ * 10_007 + client) % (2**63 - 1)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def versions(*packages: str) -> dict[str, str]:
    return {p: importlib.metadata.version(p) for p in packages}


def peak_rss_mib() -> dict[str, float]:
    """This process's peak RSS, VmHWM of /proc/self/status (Linux). Not ru_maxrss: Linux carries the parent's
    RSS at fork over exec into it, so a child of a big process reports at least the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return {"peak_rss_self_mib": int(line.split()[1]) / 1024}
    raise RuntimeError("/proc/self/status has no VmHWM line")


class ResultLine:
    """Keeps stdout for the one JSON result line: everything else the process (or a framework) prints to
    stdout goes to stderr from here on."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self.fd = os.dup(1)
        os.dup2(2, 1)

    def emit(self, result: dict[str, Any]) -> None:
        sys.stdout.flush()
        os.write(self.fd, (json.dumps(result) + "\n").encode())


def start(description: str | None,
          more: Callable[[argparse.ArgumentParser], None] | None = None) -> tuple[ResultLine, Workload, Any]:
    """A run script's start: `--data` (and what `more` adds) parsed, stdout kept for the result line, the
    workload loaded. Returns (result line, workload, parsed arguments)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", required=True)
    if more is not None:
        more(parser)
    args = parser.parse_args()
    out = ResultLine()
    return out, load(args.data), args
