"""A worker's own data: the folder it was started on (`dfca worker --data DIR`, DFCA_DATA_DIR), and nothing else.

The worker reads the folder when it starts (a folder federation: DIR/<client-id>/train.npz, optional test.npz and
DIR/clusters.json; dfca.data reads it and refuses a bad one with FolderDataError, naming the file and the client),
logs what it read, and registers the facts (`DataHoldings`: client ids, sample counts, input shape, classes, true
clusters where clusters.json gives them) with the topology service; the samples never leave the process. For each
experiment over the workers' data (`data.source: workers`) it reads the folder again with the experiment's seed and
hosts the clients the experiment's `Placement` puts on it, which must be exactly the clients of its folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dfca.config import ExperimentConfig
from dfca.data import FederatedData, FolderDataError, read_folder_federation
from dfca.runtime.control.placement import listed
from dfca.runtime.protocol.holdings import ClientFacts, DataHoldings, Placement

log = logging.getLogger(__name__)

REGISTRATION_SEED = 0  # the split a worker registers its counts with (test.npz missing: a seeded share held out)
REGISTRATION_TEST_FRACTION = 0.2  # data.test_fraction's default
LOGGED_CLIENTS = 50  # the start's log line names this many clients with their counts, then sums the rest up


class SiloMismatch(ValueError):
    """An experiment places other clients on this worker than its folder holds."""


class DataSilo:
    """The clients of one data folder, read once at the worker's start (FolderDataError on a bad folder)."""

    def __init__(self, folder: Path, ordinal: int) -> None:
        self.folder = folder.resolve()
        self.ordinal = ordinal
        if not self.folder.is_dir():
            raise FolderDataError.one(self.folder, None, f"worker {ordinal}'s data folder does not exist")
        data = read_folder_federation(self.folder, REGISTRATION_SEED, REGISTRATION_TEST_FRACTION)
        self.ids = list(data.client_names) or [str(i) for i in range(data.num_clients)]
        self._holdings = holdings_of(data, self.ids, str(self.folder))  # the samples are read again per experiment
        log.info("%s", self.describe(), extra={"worker": ordinal})

    def holdings(self) -> DataHoldings:
        return self._holdings

    def describe(self) -> str:
        """What the worker read, for its log: the folder, each client's sample counts, the shape and classes."""
        h = self._holdings
        counts = ", ".join(f"{c.id} ({c.train} train, {c.test} test)" for c in h.clients[:LOGGED_CLIENTS])
        if len(h.clients) > LOGGED_CLIENTS:
            train = sorted(c.train for c in h.clients)
            counts += (f" and {len(h.clients) - LOGGED_CLIENTS} more (train samples min {train[0]}, median "
                       f"{train[len(train) // 2]}, max {train[-1]})")
        known = sum(c.cluster is not None for c in h.clients)
        clusters = f"true clusters of {known} of {len(h.clients)} clients from clusters.json" if known else \
            "no true clusters (no clusters.json)"
        return (f"worker {self.ordinal} read data folder {h.folder}: {len(h.clients)} clients: {counts}; input shape "
                f"{tuple(h.input_shape)}, {h.num_classes} classes; {clusters}")

    def for_experiment(self, cfg: ExperimentConfig, placement: Placement) -> FederatedData:
        """This worker's clients for an experiment, read again with its seed, in the order of their global indices
        (`placement.clients_of`); SiloMismatch unless the placement puts exactly this folder's clients here."""
        placed = placement.ids_of(self.ordinal)
        if sorted(placed) != sorted(self.ids):
            gained, lost = sorted(set(self.ids) - set(placed)), sorted(set(placed) - set(self.ids))
            raise SiloMismatch(f"worker {self.ordinal} holds other clients ({self.folder}) than the experiment "
                               f"placed on it: not placed here {listed(gained)}; not in this folder {listed(lost)}")
        data = read_folder_federation(self.folder, cfg.seed, cfg.data.test_fraction, clients=placed,
                                      classes=placement.num_classes, counted=True)  # as every other worker's
        log.info("worker %d hosts clients %s as %s", self.ordinal, placed, placement.clients_of(self.ordinal))
        return data


def holdings_of(data: FederatedData, ids: list[str], folder: str) -> DataHoldings:
    """The facts a worker registers about its clients (never their samples)."""
    train, test = data.train_sizes.tolist(), data.test_sizes.tolist()
    clusters = data.true_cluster.tolist()
    return DataHoldings(
        folder=folder, input_shape=list(data.input_shape), num_classes=int(data.num_classes),
        clients=[ClientFacts(id=ids[i], train=int(train[i]), test=int(test[i]),
                             cluster=int(clusters[i]) if clusters[i] >= 0 else None) for i in range(len(ids))],
    )


# What a fresh volume holds before anyone fills it (ext4's lost+found, Kubernetes' and Docker's hidden entries).
UNFILLED_VOLUME_ENTRIES = {"lost+found"}


def read_silo(folder: str | None, ordinal: int) -> DataSilo | None:
    """The worker's data folder, read; None when it was started without one, or when its folder is a volume nobody
    filled yet (Compose and Kubernetes always mount one): the worker then hosts built-in datasets' clients only, and
    says so. A folder with anything in it must be a valid federation (FolderDataError)."""
    if not folder:
        return None
    path = Path(folder)
    if path.is_dir() and not [e for e in path.iterdir() if not e.name.startswith(".")
                              and e.name not in UNFILLED_VOLUME_ENTRIES]:
        log.warning("worker %d: its data folder %s is empty; it holds no clients of its own (experiments with "
                    "data.source: workers will not place any here)", ordinal, path)
        return None
    return DataSilo(path, ordinal)


def empty_data(placement: Placement) -> FederatedData:
    """No clients: what a worker that holds none of an experiment's clients hosts."""
    shape = tuple(placement.input_shape)
    return FederatedData(x_train=torch.zeros((0, 1, *shape)), y_train=torch.zeros((0, 1), dtype=torch.long),
                         x_test=torch.zeros((0, 1, *shape)), y_test=torch.zeros((0, 1), dtype=torch.long),
                         true_cluster=torch.zeros(0, dtype=torch.long), num_classes=placement.num_classes)
