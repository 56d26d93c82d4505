"""Where models, data shards and computation live: the config's `device`, or DFCA_DEVICE on a worker.

`cpu` and `cuda` mean what they say; `cuda` on a machine without a CUDA device is an error that names
the setting. `auto` takes the GPU when there is one and logs once when it falls back to the CPU.
Payloads cross the wire as CPU tensors whatever the device (dfca.wire.codec).

float32 means float32 on a GPU too: torch lets cuDNN run float32 convolutions in TF32 (a 10-bit mantissa) unless
told otherwise, which moves a convolution's result by about 1e-3 and depends on how many clients are batched
together, so the simulator and the message drivers (which batch different clients) would part after a step.
Resolving a cuda device turns that off (`full_float32_convolutions`); matrix products are already full float32
by torch's default. A user who wants TF32 speed sets `torch.backends.cudnn.conv.fp32_precision = "tf32"` in their
model factory, and gives up that agreement.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
DEVICES = ("cpu", "cuda", "auto")
_warned_auto = False


class DeviceUnavailable(ValueError):
    """The device a setting names is not on this machine; the message names the setting."""


def resolve_device(name: str, setting: str = "device") -> torch.device:
    global _warned_auto
    if name not in DEVICES:
        raise DeviceUnavailable(f"{setting}: {name!r} is not one of {', '.join(DEVICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            full_float32_convolutions()
            return torch.device("cuda")
        if not _warned_auto:
            log.info("%s: auto found no CUDA device; computing on the CPU", setting)
            _warned_auto = True
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(f"{setting}: cuda, but this machine has no CUDA device "
                                f"(torch.cuda.is_available() is False): {cuda_unavailable_cause()}; use cpu or auto")
    if name == "cuda":
        full_float32_convolutions()
    return torch.device(name)


def cuda_unavailable_cause() -> str:
    """The likeliest reason torch sees no GPU here, from the torch build, the device files and the driver library."""
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU build; install a CUDA build "
                "(the image: TORCH_VARIANT=cu126 or cu130)")
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return ("no NVIDIA device is visible to this process (no /dev/nvidia*): a container needs a GPU "
                "granted to it (Kubernetes: resources.limits nvidia.com/gpu; Docker: --gpus or the NVIDIA "
                "Container Toolkit)")
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return ("the NVIDIA driver library libcuda.so.1 is not found: put the folder the node mounts it in on "
                "LD_LIBRARY_PATH (GKE: /usr/local/nvidia/lib64)")
    return (f"the NVIDIA driver is probably older than this torch's CUDA {torch.version.cuda} needs "
            "(cu130 needs an R580 driver; cu126 runs on R525 and later)")


def full_float32_convolutions() -> None:
    """cuDNN's float32 convolutions in IEEE float32, not TF32 (see the module's docstring)."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        conv.fp32_precision = "ieee"
    else:  # torch before 2.9
        torch.backends.cudnn.allow_tf32 = False


def worker_device(config_device: str, env_device: str | None) -> torch.device:
    """A worker computes where DFCA_DEVICE says, else where the experiment's config says."""
    if env_device:
        return resolve_device(env_device, "DFCA_DEVICE")
    return resolve_device(config_device)


def device_name(device: torch.device) -> str:
    """What a worker reports it computes on: `cpu`, or `cuda:0 (NVIDIA H100 80GB HBM3)`."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
