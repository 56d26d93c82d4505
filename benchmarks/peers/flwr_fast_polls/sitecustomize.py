"""Flower's fixed poll sleeps shortened to $DFCA_FLWR_POLL_S seconds, in every Flower process of a benchmark run.

benchmarks/flwr_deployment.py puts this folder on PYTHONPATH for the `-fast` runs of benchmarks/peers_runtime.py,
so Python imports it at start-up in the SuperLink, the SuperNodes, SuperExec and every ServerApp and ClientApp
process; nothing in the flwr venv is changed. In flwr 1.42 the polls are `time.sleep(<literal>)` calls, so the
modules that hold them get a `time` whose `sleep(3)` waits POLL_S instead (every other call is the real one):

- flwr.superlink.grid.http_grid: HttpGrid.send_and_receive, the ServerApp's wait for replies (3 s);
- flwr.supernode.start_client_internal: the SuperNode's wait for a message from the SuperLink (3 s).

Left as they are: the SuperNode's 0.5-s waits for its ClientApp's reply (start_client_internal._push_messages) and
SuperExec's 1-s task poll (configurable: FLWR_SUPEREXEC_TASK_POLL_INTERVAL; flwr_deployment.SUPEREXEC_POLL_S says
why the benchmark keeps it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
import types
from collections.abc import Sequence
from typing import Any

POLL_S = float(os.environ.get("DFCA_FLWR_POLL_S", "0.01"))
# module -> the sleeps (seconds) of it that are polls; DFCA_FLWR_FAST_POLLS picks which modules are patched
POLLS = {"flwr.superlink.grid.http_grid": frozenset({3.0}), "flwr.supernode.start_client_internal": frozenset({3.0})}
POLLING_MODULES = frozenset(m for m in os.environ.get("DFCA_FLWR_FAST_POLLS", ",".join(POLLS)).split(",") if m)


class ShortSleeps(types.ModuleType):
    """The `time` module with the sleeps of `polls` seconds shortened to POLL_S."""

    def __init__(self, polls: frozenset[float]) -> None:
        super().__init__("time")
        self.polls = polls

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(POLL_S if seconds in self.polls else seconds)


class PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        module.time = ShortSleeps(POLLS[module.__name__])  # type: ignore[attr-defined]


class PollingModules(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in POLLING_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = PatchingLoader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, PollingModules())
