"""How much memory a run's tensors take, estimated from its config before anything is allocated.

The estimate counts every client's k model copies three times over (the copies themselves; the round's working
set: the trained models gathered, a consensus's numerators or a block of them, seeding's candidates, momentum)
and each client's images as float32. It is an upper guide, not a measurement: the config refuses runs above
`MAX_RUN_BYTES`, and the simulator and each worker refuse a run whose share exceeds the memory this machine has
available. Measured peaks above the data, in copies of the k models (k=4, N=40, MLP h=2048, 5 training rounds,
commit 8cda06e): robust DFCA 2.52 (default) and 2.32 (`traffic: full`), the paper's rule 2.02, IFCA 1.73,
DFedAvgM with momentum 0.96 (it keeps one model, not k), FedSPD 2.82; screened gossip 7.03 (SCREEN_COPIES more).
"""

from __future__ import annotations

import math
from pathlib import Path

# Input size and classes of each dataset: (values per sample, classes).
DATASET_SHAPES: dict[str, tuple[int, int]] = {
    "mnist-bundled": (784, 10), "mnist": (784, 10), "emnist": (784, 62), "femnist": (784, 62),
    "cifar10": (3072, 10), "digits": (64, 10),
}
CNN_PARAMS = 1_700_000  # the paper's CNN on 28x28 or 32x32 inputs, rounded up
MODEL_COPIES = 3
SCREEN_COPIES = 5  # screened gossip besides: last round's models, and a step's arrivals held and compared


def model_params(kind: str, inputs: int, hidden: int, classes: int) -> int:
    """Values per model copy; a user's module (`torch`) is not known before its factory runs: none here, and its
    real count (`model_values`) once it is built."""
    if kind == "cnn":
        return CNN_PARAMS
    if kind == "torch":
        return 0
    return inputs * hidden + hidden + hidden * classes + classes


def estimated_run_bytes(*, dataset: str, features: str, feature_dim: int, kind: str, hidden: int, clients: int,
                        clusters: int, train_per_client: int, test_per_client: int, samples: int | None = None,
                        extra_copies: int = 0, model_values: int | None = None) -> int:
    """Bytes of the tensors of `clients` clients (a worker's share, or all of them); `extra_copies`: model copies
    beyond MODEL_COPIES (screened gossip keeps last round's models); `model_values`: a built model's own count."""
    inputs, classes = DATASET_SHAPES.get(dataset, (feature_dim, clusters))
    if features == "projection" or dataset == "blobs":
        inputs = feature_dim
    per_client_samples = samples if samples is not None else train_per_client + test_per_client
    copies = MODEL_COPIES + extra_copies
    values = model_values if model_values is not None else model_params(kind, inputs, hidden, classes)
    models = clients * max(clusters, 1) * values * 4 * copies
    data = clients * per_client_samples * (inputs + 1) * 4
    return models + data


def available_bytes(device: str = "cpu") -> int | None:
    """Free memory where a run's tensors will live: the GPU's free memory for a `cuda` device, else MemAvailable of
    /proc/meminfo (None where there is none)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{math.ceil(n / (1 << 20))} MiB"


def leaves_room(needed: int) -> bool:
    """Whether `needed` bytes of tensors take at most half of this machine's available memory (the heap may then keep
    every block it frees: dfca.heap)."""
    free = available_bytes("cpu")
    return free is not None and 2 * needed <= free


class RunTooLarge(MemoryError):
    """A run whose estimated tensors do not fit this machine's available memory."""


def check_fits_memory(needed: int, what: str, device: str = "cpu") -> None:
    """Refuse before allocating when `needed` bytes exceed the memory available on `device` (the GPU's own memory
    for `cuda`)."""
    free = available_bytes(device)
    if free is not None and needed > free:
        place = "this machine" if device == "cpu" else f"the {device} device"
        raise RunTooLarge(f"{what} needs about {gib(needed)} of tensors (model copies and data), but {place} "
                          f"has {gib(free)} available: fewer clients, a smaller model.hidden or fewer samples per "
                          "client (or more workers) would fit")
