"""This project's simulator on the peers workload: `dfca.simulator.simulate` with IFCA (k=1) or DFedAvgM.

    python benchmarks/peers/run_dfca.py --data WORKLOAD.npz --algorithm ifca|dfedavgm

Run with the project's python (benchmarks/peers.py does). The clients' data come from the workload file, as
FederatedData, so every framework trains on the same tensors. Each round's seconds are those of
`Simulation.run_round` (local training and the exchange), timed by wrapping it for the run; simulate evaluates
only after the last round (eval_every = rounds), outside the timed rounds. Prints one JSON line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peer_common import Workload, peak_rss_mib, setup_torch, start, versions

from dfca.config import ExperimentConfig
from dfca.data import FederatedData
from dfca.simulator import Simulation, simulate


def config(w: Workload, algorithm: str) -> ExperimentConfig:
    m = w.meta
    return ExperimentConfig.model_validate({
        "name": "peers", "algorithm": algorithm, "clusters": 1, "rounds": w.rounds, "seed": m["seed"],
        "eval_every": w.rounds,
        "data": {"dataset": "mnist-bundled", "rotations": [0], "clients": w.clients,
                 "train_per_client": int(w.x_train.shape[1]), "test_per_client": int(w.x_test.shape[1])},
        "model": {"kind": "mlp", "hidden": m["hidden"]},
        "train": {"lr": m["lr"], "local_epochs": m["local_epochs"], "batch_size": m["batch_size"], "momentum": 0.0},
        "topology": {"kind": "complete"},
    })


def federated_data(w: Workload) -> FederatedData:
    def images(x: Any) -> torch.Tensor:
        return torch.from_numpy(x).reshape(x.shape[0], x.shape[1], 1, 28, 28)

    return FederatedData(x_train=images(w.x_train), y_train=torch.from_numpy(w.y_train), x_test=images(w.x_test),
                         y_test=torch.from_numpy(w.y_test), true_cluster=torch.zeros(w.clients, dtype=torch.long),
                         num_classes=10, rotations=(0,))


@contextmanager
def timed_rounds() -> Iterator[list[float]]:
    """Seconds of every Simulation.run_round call while the block runs."""
    seconds: list[float] = []
    original = Simulation.run_round

    def timed(self: Simulation, t: int) -> None:
        t0 = time.perf_counter()
        original(self, t)
        seconds.append(time.perf_counter() - t0)

    Simulation.run_round = timed  # type: ignore[method-assign]
    try:
        yield seconds
    finally:
        Simulation.run_round = original  # type: ignore[method-assign]


def main() -> None:
    out, w, args = start(__doc__, lambda p: p.add_argument("--algorithm", choices=["ifca", "dfedavgm"],
                                                          required=True))
    setup_torch(int(w.meta["threads"]))
    cfg, data = config(w, args.algorithm), federated_data(w)
    with timed_rounds() as seconds:
        result = simulate(cfg, data)
    notes = ["accuracy: mean over clients of each client's model on its own test samples"
             if args.algorithm == "dfedavgm" else "accuracy: the one cluster model on every client's test samples"]
    out.emit({"framework": "dfca", "versions": versions("dfca", "torch", "numpy"), "round_seconds": seconds,
              "test_accuracy": result.summary["test_accuracy"], "clients": w.clients, "rounds": len(seconds),
              "notes": notes, **peak_rss_mib()})


if __name__ == "__main__":
    main()
