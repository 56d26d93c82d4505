"""A user's own model: `model: {kind: torch, factory: "package.module:function", options: {...}}`.

The factory is a function `make(input_shape, num_classes, **options) -> torch.nn.Module`, named as
`package.module:function` (imported) or `path/to/file.py:function` (loaded from that file). Every process that
trains or checks a run calls it by that name; a config carries the name and the options, never code.

Who may import what:
- `dfca run` and `dfca validate` run in the user's own process and import whatever their config names.
- The runtime's processes (topology service, workers, aggregator) take configs over REST, so they import only what
  the operator allows in DFCA_MODEL_FACTORIES: a comma-separated list of module prefixes (`mylab.models` allows
  `mylab.models:make` and `mylab.models.resnet:make`) and folders (`/models/`: any `.py` file below it). Unset or
  empty: no factory at all, and a `kind: torch` config is refused (422 naming `model.factory`).

`build_module` refuses, naming `model.factory`, a factory that cannot be imported or is not allowed, one that raises
or does not return an `nn.Module`, a module whose initial parameters and buffers are not all finite, and one whose
output on a batch of the data's samples is not [batch, num_classes] (`check_module`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dfca.data.shapes import sample_shape
from dfca.sections import ExperimentBase
from dfca.settings import env

FIELD = "model.factory"
ALLOW_ENV = "DFCA_MODEL_FACTORIES"
Factory = Callable[..., nn.Module]


class ModelFactoryError(ValueError):
    """A factory or the module it makes cannot be used; the message starts with `model.factory`."""

    field = FIELD

    def __init__(self, message: str) -> None:
        super().__init__(f"{FIELD}: {message}")


def allowed_factories(value: str | None = None) -> list[str]:
    """The operator's allow-list (DFCA_MODEL_FACTORIES, or `value`): module prefixes and folders."""
    raw = (env(ALLOW_ENV) or "") if value is None else value
    return [entry.strip() for entry in raw.split(",") if entry.strip()]


def split_factory(spec: str) -> tuple[str, str]:
    """`module:function` or `path/to/file.py:function` -> (where, function)."""
    where, sep, function = spec.rpartition(":")
    if not sep or not where or not function.isidentifier():
        raise ModelFactoryError(f"{spec!r} is not `package.module:function` or `path/to/file.py:function`")
    return where, function


def is_file(where: str) -> bool:
    return where.endswith(".py")


def check_allowed(spec: str, allowed: Sequence[str]) -> None:
    """Refuse `spec` unless an entry of `allowed` covers it (a module prefix, or a folder holding the file)."""
    where, _ = split_factory(spec)
    folders = [Path(entry).resolve() for entry in allowed if entry.startswith(("/", "."))]
    prefixes = [entry for entry in allowed if not entry.startswith(("/", "."))]
    if is_file(where):
        ok = any(Path(where).resolve().is_relative_to(folder) for folder in folders)
    else:
        ok = any(where == prefix or where.startswith(prefix + ".") for prefix in prefixes)
    if not ok:
        listed = ", ".join(allowed) if allowed else "nothing: it is unset"
        raise ModelFactoryError(
            f"{spec!r} is not allowed here: the runtime imports only the module prefixes and folders its operator "
            f"lists in {ALLOW_ENV} (now {listed}); add the factory's package or folder there on every service")


def resolve_factory(spec: str, allowed: Sequence[str] | None = None) -> Factory:
    """The factory function `spec` names; `allowed`: the runtime's allow-list (None: anything, as `dfca run`)."""
    where, function = split_factory(spec)
    if allowed is not None:
        check_allowed(spec, allowed)
    try:
        module = _load_file(where) if is_file(where) else importlib.import_module(where)
    except ModelFactoryError:
        raise
    except Exception as err:  # an import error, or whatever the user's module raises while it loads
        raise ModelFactoryError(f"cannot import {where!r} ({type(err).__name__}: {err})") from err
    make = getattr(module, function, None)
    if not callable(make):
        raise ModelFactoryError(f"{where!r} has no function {function!r}")
    return make  # type: ignore[no-any-return]


def _load_file(where: str) -> Any:
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise ModelFactoryError(f"no file {where!r} (from {Path.cwd()})")
    name = f"dfca_user_model_{abs(hash(str(path))):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFactoryError(f"cannot load {where!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def make_module(make: Factory, spec: str, input_shape: tuple[int, ...], num_classes: int,
                options: dict[str, Any]) -> nn.Module:
    """Call the factory; anything it raises or returns that is not an nn.Module is the factory's error."""
    try:
        module = make(tuple(input_shape), num_classes, **options)
    except Exception as err:
        raise ModelFactoryError(f"{spec}({tuple(input_shape)}, {num_classes}, **{options}) raised "
                                f"{type(err).__name__}: {err}") from err
    if not isinstance(module, nn.Module):
        raise ModelFactoryError(f"{spec} returned {type(module).__name__}, not a torch.nn.Module")
    return module


def check_module(module: nn.Module, spec: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    """Finite initial state, at least one parameter, and [batch, num_classes] logits on a batch of two samples."""
    state = module.state_dict()
    if not any(p.requires_grad for p in module.parameters()):
        raise ModelFactoryError(f"{spec} made a module with no trainable parameters")
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelFactoryError(f"{spec} made a module whose initial {name!r} is not finite")
    module.eval()
    with torch.no_grad():
        try:
            out = module(torch.zeros(2, *input_shape))
        except Exception as err:
            raise ModelFactoryError(f"{spec}'s module fails on a batch of the data's samples "
                                    f"[2, {', '.join(map(str, input_shape))}]: {type(err).__name__}: {err}") from err
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelFactoryError(f"{spec}'s module maps [2, {', '.join(map(str, input_shape))}] to {shape}, not "
                                f"[2, {num_classes}]: its output must be one logit per class of the data "
                                f"({num_classes} classes)")


def build_module(spec: str, options: dict[str, Any], input_shape: tuple[int, ...], num_classes: int,
                 allowed: Sequence[str] | None = None) -> tuple[Factory, nn.Module]:
    """Resolve, call and check: (the factory, a first module made by it, in float32 on the CPU)."""
    make = resolve_factory(spec, allowed)
    module = make_module(make, spec, input_shape, num_classes, options).float()
    check_module(module, spec, input_shape, num_classes)
    return make, module


def count_values(module: nn.Module) -> int:
    """Floats a client keeps per model: parameters and floating-point buffers (BatchNorm's running statistics)."""
    return sum(math.prod(t.shape) for t in module.state_dict().values() if t.is_floating_point())


def check_config_model(cfg: ExperimentBase, allowed: Sequence[str] | None = None,
                       read: tuple[tuple[int, ...], int] | None = None) -> None:
    """Refuse (ModelFactoryError) a `kind: torch` config whose factory cannot make a module that fits its data, before
    any data is read: `dfca validate` and `dfca run` with `allowed` None, the topology service with its allow-list;
    `read`: (input shape, classes) of data read already (a folder federation's)."""
    if cfg.model.kind != "torch" or not cfg.algorithm_class.trains_classifier:  # k-means, autoencoders
        return
    assert cfg.model.factory is not None  # the schema requires it with kind torch
    shape, classes = read if read is not None else sample_shape(cfg.data)
    build_module(cfg.model.factory, dict(cfg.model.options), shape, classes, allowed)
