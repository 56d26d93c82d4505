"""The final models of a runtime experiment: each worker's share, on the wire and merged.

When its clients finish the last round, a worker sends `Algorithm.final_model_sums()` of its clients: per model
name, the sum of its clients' contributions and how many clients that is. The metrics service keeps every worker's
latest share and divides the totals by the counts, which gives what `dfca run` saves for the same run (DFCA: cluster
j is the mean over the clients assigned to j, or over all clients when nobody is; see `cluster_means`). A share is
safetensors (the project's one payload format) in base64 inside the JSON event, with its sha256; never pickle.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dfca.models.batched import Params

Sums = Mapping[str, tuple[Params, int]]  # model name -> (sum of client models, how many clients)
COUNT = "#count"
FALLBACK = "@all"  # `cluster_j@all`: what cluster j's model is when no client is assigned to it


class FinalModelsInvalid(ValueError):
    """A share that does not decode, fails its checksum, or does not fit the others."""


def encode_sums(sums: Sums) -> tuple[str, str]:
    """A worker's share as (base64 safetensors, sha256 of the raw bytes)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, (params, count) in sums.items():
        for param, tensor in params.items():
            tensors[f"{name}/{param}"] = tensor.detach().to("cpu", torch.float32).contiguous()
        tensors[f"{name}/{COUNT}"] = torch.tensor([count], dtype=torch.int64)
    raw = st_save(tensors)
    return base64.b64encode(raw).decode("ascii"), hashlib.sha256(raw).hexdigest()


def decode_sums(encoded: str, sha256: str) -> dict[str, tuple[Params, int]]:
    try:
        raw = base64.b64decode(encoded, validate=True)
    except ValueError as err:
        raise FinalModelsInvalid(f"not base64: {err}") from err
    if hashlib.sha256(raw).hexdigest() != sha256:
        raise FinalModelsInvalid("sha256 of the share does not match")
    try:
        tensors = st_load(raw)
    except Exception as err:  # safetensors raises several types on garbage
        raise FinalModelsInvalid(f"not safetensors: {err}") from err
    out: dict[str, tuple[dict[str, torch.Tensor], int]] = {}
    for key, tensor in tensors.items():
        name, _, param = key.rpartition("/")
        params, count = out.setdefault(name, ({}, 0))
        if param == COUNT:
            out[name] = (params, int(tensor.item()))
        else:
            params[param] = tensor
    return out


def merge_sums(shares: Iterable[Mapping[str, tuple[Params, int]]]) -> dict[str, Params]:
    """The run's final models: per name, the total of the shares' sums over the total count. A name that no
    client counts for (a cluster nobody is assigned to) takes its `@all` fallback; fallbacks are not saved."""
    totals: dict[str, tuple[dict[str, torch.Tensor], int]] = {}
    for share in shares:
        for name, (params, count) in share.items():
            if name not in totals:
                totals[name] = ({p: t.clone().double() for p, t in params.items()}, count)
                continue
            summed, seen = totals[name]
            if summed.keys() != params.keys():
                raise FinalModelsInvalid(f"model {name!r}: the workers' shares hold different tensors")
            for p, t in params.items():
                if summed[p].shape != t.shape:
                    raise FinalModelsInvalid(f"model {name!r}: {p} has shape {tuple(t.shape)} and "
                                             f"{tuple(summed[p].shape)} in two shares")
                summed[p] += t.double()
            totals[name] = (summed, seen + count)
    out: dict[str, Params] = {}
    for name, (summed, count) in totals.items():
        if name.endswith(FALLBACK):
            continue
        if count == 0 and name + FALLBACK in totals:
            summed, count = totals[name + FALLBACK]
        if count > 0:
            out[name] = {p: (t / count).float() for p, t in summed.items()}
    return out
