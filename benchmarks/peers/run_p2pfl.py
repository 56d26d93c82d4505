"""p2pfl on the peers workload: one node per client in one process, in-memory protocol, FedAvg, all connected.

    python benchmarks/peers/run_p2pfl.py --data WORKLOAD.npz    (with the p2pfl venv's python)

Every client is a p2pfl Node (MemoryCommunicationProtocol, the default FedAvg aggregator, a LightningModel of the
shared MLP trained by plain SGD) holding its training samples and its test samples as a P2PFLDataset (batch size
of the workload). The nodes are connected pairwise (a complete graph), node 0 starts learning with
trainset_size = all nodes, so every node trains in every round and aggregates every node's model. p2pfl's
standalone settings (p2pfl.utils.utils.set_standalone_settings) are used, with Ray disabled so that the nodes'
learners run in this process (Settings.general.DISABLE_RAY; p2pfl otherwise trains in a Ray actor pool), and with
the vote and aggregation timeouts raised to a day, so that no round aggregates fewer than all models (the run
reports the fewest it saw). p2pfl's Lightning learner sets torch to one thread on import; it is set back to the
workload's threads after. Two workarounds, explained where they are: torchvision is stubbed (stub_torchvision),
and Lightning shows progress without rich (plain_progress_output). p2pfl's framework behaviour is kept: each node
evaluates on its test samples before training in every round, Lightning's DataLoader does not reshuffle between
epochs, and a Trainer is built for every fit.

Round r ends when the last node enters RoundFinishedStage for round r (the stage's execute is wrapped to note the
time); round 1 starts at set_start_learning, so it includes p2pfl's start-up stage (initial model gossip and its
waits). The final accuracy is the mean over nodes of each node's final model on its own test samples. Prints one
JSON line.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import statistics
import sys
import threading
import time
import types
from typing import Any

import lightning as L  # noqa: N812
import lightning.pytorch.loops.evaluation_loop as evaluation_loop
import lightning.pytorch.trainer.connectors.callback_connector as callback_connector
import torch
from datasets import Dataset, DatasetDict
from peer_common import Workload, accuracy, mlp, peak_rss_mib, setup_torch, start, versions
from torch import nn


def stub_torchvision() -> bool:
    """Stand in for torchvision when it is not installed; True if it did.

    p2pfl's PyTorch learner imports torchvision.datasets at import time, for its MNIST download helper only (not
    used here). torchvision's PyPI wheels link CUDA's libc10_cuda.so, so with the CPU-only torch wheel they fail to
    import; the venv goes without torchvision and this empty module takes its place. It is registered after
    lightning, torchmetrics and datasets were imported, so none of them takes it for a real torchvision.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return False
    for name in ("torchvision", "torchvision.datasets"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        sys.modules[name] = module
    sys.modules["torchvision"].datasets = sys.modules["torchvision.datasets"]  # type: ignore[attr-defined]
    return True


STUBBED = stub_torchvision()

from p2pfl.settings import Settings  # noqa: E402, I001  (before p2pfl's logger, which starts Ray on import)

DAY = 24 * 3600
Settings.general.DISABLE_RAY = True
Settings.general.LOG_LEVEL = "WARNING"
Settings.training.AGGREGATION_TIMEOUT = DAY  # read at import, as a default argument, by p2pfl's Aggregator

from p2pfl.communication.protocols.protobuff.memory import MemoryCommunicationProtocol  # noqa: E402
from p2pfl.learning.dataset.p2pfl_dataset import P2PFLDataset  # noqa: E402
from p2pfl.learning.frameworks.pytorch.lightning_model import LightningModel  # noqa: E402
from p2pfl.management.logger import logger  # noqa: E402
from p2pfl.node import Node  # noqa: E402
from p2pfl.stages.base_node.round_finished_stage import RoundFinishedStage  # noqa: E402
from p2pfl.utils.utils import set_standalone_settings, wait_convergence, wait_to_finish  # noqa: E402


class LitMLP(L.LightningModule):
    """The shared MLP, trained by plain SGD on the mean cross-entropy; `test_acc` for p2pfl's evaluation."""

    def __init__(self, net: nn.Sequential, lr: float) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch["image"]), batch["label"])

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("test_acc", (self(batch["image"]).argmax(1) == batch["label"]).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.0)


def dataset(w: Workload, client: int) -> P2PFLDataset:
    splits = {"train": Dataset.from_dict({"image": w.x_train[client], "label": w.y_train[client]}),
              "test": Dataset.from_dict({"image": w.x_test[client], "label": w.y_test[client]})}
    data = P2PFLDataset(DatasetDict(splits), dataset_name="mnist-bundled")
    data.set_batch_size(int(w.meta["batch_size"]))
    return data


def plain_progress_output() -> None:
    """Lightning shows progress with rich when rich is installed (typer, a p2pfl dependency, brings it), and rich's
    live display is process-global and not thread-safe: p2pfl's nodes, threads of this process, then crash in
    Trainer teardown (IndexError: pop from empty list) and the run hangs. Lightning's tqdm progress bar and plain
    result tables, its choice without rich, are used instead."""
    callback_connector._RICH_AVAILABLE = False
    evaluation_loop._RICH_AVAILABLE = False


class RoundClock:
    """Wraps RoundFinishedStage.execute: when the last node entered it for each round, and the fewest models
    (contributors) in a node's aggregated model there, over all nodes and rounds."""

    def __init__(self) -> None:
        self.ends: dict[int, float] = {}
        self.fewest_contributors: int | None = None
        self.lock = threading.Lock()
        original = RoundFinishedStage.execute

        def execute(**kwargs: Any) -> Any:
            now, done = time.perf_counter(), kwargs["state"].round + 1
            contributors = len(set(kwargs["learner"].get_model().get_contributors()))
            with self.lock:
                self.ends[done] = max(self.ends.get(done, now), now)
                self.fewest_contributors = min(self.fewest_contributors or contributors, contributors)
            return original(**kwargs)

        RoundFinishedStage.execute = staticmethod(execute)  # type: ignore[method-assign]


def start_nodes(w: Workload) -> list[Node]:
    m = w.meta
    nodes = []
    for i in range(w.clients):
        model = LightningModel(LitMLP(mlp(int(m["seed"]), int(m["hidden"])), float(m["lr"])))
        node = Node(model, dataset(w, i), protocol=MemoryCommunicationProtocol(), addr=f"node-{i}")
        node.start()
        nodes.append(node)
    for i, node in enumerate(nodes):
        for other in nodes[i + 1:]:
            node.connect(other.addr)
    wait_convergence(nodes, w.clients - 1, only_direct=True, wait=600)
    return nodes


def main() -> None:
    out, w, _ = start(__doc__)
    set_standalone_settings()
    logger.set_level("WARNING")
    # every node's model in every aggregation, however long it takes (the standalone settings give up after 60 s
    # and aggregate what arrived); benchmarks/peers.py --timeout stops a run that hangs
    Settings.training.AGGREGATION_TIMEOUT = Settings.training.VOTE_TIMEOUT = DAY
    plain_progress_output()
    nodes = start_nodes(w)
    setup_torch(int(w.meta["threads"]))  # after p2pfl's lightning learner set one thread on import
    clock = RoundClock()
    try:
        t0 = time.perf_counter()
        nodes[0].set_start_learning(rounds=w.rounds, epochs=int(w.meta["local_epochs"]), trainset_size=w.clients)
        wait_to_finish(nodes, timeout=DAY)
    finally:
        for node in nodes:
            node.stop()
    marks = [t0] + [clock.ends[r] for r in range(1, w.rounds + 1)]
    accuracies = [accuracy(node.learner.get_model().get_model().net, *w.test_of(i)) for i, node in enumerate(nodes)]
    out.emit({"framework": "p2pfl", "versions": versions("p2pfl", "lightning", "torch", "numpy"),
              "round_seconds": [b - a for a, b in zip(marks, marks[1:], strict=False)],
              "test_accuracy": statistics.mean(accuracies), "clients": w.clients, "rounds": w.rounds,
              "notes": ["accuracy: mean over nodes of each node's model on its own test samples",
                        f"fewest models in an aggregation: {clock.fewest_contributors} of {w.clients}",
                        "one process, Ray disabled; each node evaluates before training in every round",
                        "Lightning's tqdm progress bar instead of rich's (not thread-safe; see run_p2pfl.py)",
                        *(["torchvision stubbed (p2pfl imports it, unused; see run_p2pfl.py)"] if STUBBED else [])],
              **peak_rss_mib()})


if __name__ == "__main__":
    main()
