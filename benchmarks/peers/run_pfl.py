"""Apple's pfl-research simulator on the peers workload: FederatedAveraging over every user every iteration.

    python benchmarks/peers/run_pfl.py --data WORKLOAD.npz    (with the pfl venv's python)

One process (pfl's SimulatedBackend without its multi-worker mode): a FederatedDataset with one user per client
(MinimizeReuseUserSampler: a cohort of all users is every user once), central settings: FederatedAveraging,
cohort = all users, central optimizer SGD lr 1.0 (the model moves by the averaged update, as FedAvg), no
validation cohort; local settings: torch.optim.SGD (no momentum) with the workload's lr, epochs and batch size.
pfl iterates a user's data in its stored order every epoch (it does not reshuffle), and evaluates every user before
and after local training in central iteration 0 (its evaluation_frequency counts from 0), which lands in round 1.

Round r's seconds are from the end of iteration r - 1 (or the start of training) to the end of iteration r, by a
TrainingProcessCallback. The final model is measured on every client's test samples afterwards. Prints one JSON
line.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from peer_common import Workload, accuracy, mlp, peak_rss_mib, setup_torch, start, versions
from pfl.aggregate.simulate import SimulatedBackend
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNTrainHyperParams
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel
from torch import nn


class Net(nn.Module):
    """The shared MLP with the `loss` and `metrics` methods PyTorchModel asks for."""

    def __init__(self, net: nn.Sequential) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:  # noqa: A002
        self.train(not eval)
        return nn.functional.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict[str, Any]:  # noqa: A002
        self.train(not eval)
        logits = self(x)
        n = int(y.shape[0])
        return {"loss": Weighted(float(nn.functional.cross_entropy(logits, y, reduction="sum")), n),
                "accuracy": Weighted(float((logits.argmax(1) == y).sum()), n)}


class RoundClock(TrainingProcessCallback):
    """perf_counter at the start of training and after every central iteration."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_begin(self, *, model: Any) -> Metrics:
        self.marks.append(time.perf_counter())
        return Metrics()

    def after_central_iteration(self, aggregate_metrics: Metrics, model: Any, *,
                                central_iteration: int) -> tuple[bool, Metrics]:
        self.marks.append(time.perf_counter())
        return False, Metrics()


def federated_data(w: Workload) -> FederatedDataset:
    def user(client: int) -> Dataset:
        return Dataset(raw_data=list(w.train_of(client)), user_id=client)

    return FederatedDataset(user, get_user_sampler("minimize_reuse", list(range(w.clients))))


def main() -> None:
    out, w, _ = start(__doc__)
    m = w.meta
    setup_torch(int(m["threads"]))
    net = Net(mlp(int(m["seed"]), int(m["hidden"])))
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    data = federated_data(w)
    backend = SimulatedBackend(training_data=data, val_data=data)
    clock = RoundClock()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=w.rounds, evaluation_frequency=w.rounds + 1,
                                           train_cohort_size=w.clients, val_cohort_size=None),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=float(m["lr"]),
                                              local_num_epochs=int(m["local_epochs"]),
                                              local_batch_size=int(m["batch_size"])),
        callbacks=[clock])
    seconds = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    out.emit({"framework": "pfl", "versions": versions("pfl", "torch", "numpy"), "round_seconds": seconds,
              "test_accuracy": accuracy(net.net, *w.test_set()), "clients": w.clients, "rounds": len(seconds),
              "notes": ["no reshuffle between local epochs (pfl iterates a user's data in order)",
                        "round 1 also evaluates every user before and after local training (pfl, iteration 0)"],
              **peak_rss_mib()})


if __name__ == "__main__":
    main()
