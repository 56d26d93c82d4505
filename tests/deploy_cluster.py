"""The pods of the Kubernetes manifests as local processes: a private RabbitMQ node configured like the broker pod
(its init container run here, one broker user per principal from the stand-in Secrets), and topology, metrics, the
aggregator and the workers started with exactly their containers' command and environment (Service hostnames
mapped to 127.0.0.1). Used by tests/test_deploy_local.py and the chaos twin in tests/test_deploy_chaos_script.py.

Each running pod is also written to `pods/<pod>/` (its process group id and component), which the chaos twin's
stand-in kubectl reads to kill, stop and resume real processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from deploy_manifest import (
    CPU_PRESET_DIR,
    LaunchSpec,
    LocalEndpoints,
    Manifest,
    launch_spec,
    render_overlay,
    service_ports,
    start_k8s_broker,
    with_cluster_secrets,
    worker_statefulsets,
)
from free_ports import free_port
from rabbitmq_node import RabbitMQNodeError

from dfca.config import parse_config

READY_TIMEOUT_S = 180.0
DEPLOYMENTS = ("topology", "metrics", "aggregator")


def tiny_experiment(name: str, workers: int, rounds: int = 12) -> dict[str, Any]:
    """Rotated MNIST (bundled), 2 clusters, 8 clients: the simulator reaches ~0.8 accuracy, ARI 1."""
    config = {
        "name": name, "algorithm": "dfca", "init": "global", "clusters": 2, "rounds": rounds, "seed": 0,
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": 8,
                 "train_per_client": 150, "test_per_client": 100},
        "model": {"kind": "mlp", "hidden": 64},
        "train": {"lr": 0.1, "local_epochs": 3, "batch_size": 50},
        "topology": {"kind": "complete"},
        "runtime": {"workers": workers, "round_timeout": 10.0},
    }
    parse_config(config)  # the body must be a valid ExperimentConfig
    return config


@dataclass
class LocalCluster:
    """The pods of the manifests as local processes."""

    manifests: list[Manifest]
    endpoints: LocalEndpoints
    logs: Path
    pods: Path | None = None  # where each pod's process group and component are written
    specs: dict[str, LaunchSpec] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def api_token(self) -> str:
        return self.specs["topology"].env["DFCA_API_TOKEN"]

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.specs[name].port}"

    def workers(self) -> list[str]:
        return sorted(name for name in self.specs if name.startswith("worker-"))

    def start(self, spec: LaunchSpec) -> None:
        self.specs[spec.name] = spec
        argv = list(spec.argv)
        if argv[0] == "dfca" and not _on_path("dfca", spec.env):
            argv[:1] = [sys.executable, "-m", "dfca.cli"]
        with (self.logs / f"{spec.name}.log").open("ab") as log:
            self.processes[spec.name] = subprocess.Popen(
                argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        if self.pods is not None:
            pod = self.pods / spec.name
            pod.mkdir(parents=True, exist_ok=True)
            (pod / "component").write_text(spec.name.split("-")[0] if spec.name.startswith("worker-") else spec.name)
            (pod / "pgid").write_text(str(self.processes[spec.name].pid))

    def wait_ready(self, name: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.processes[name].poll() is not None:
                pytest.fail(f"{name} exited with {self.processes[name].returncode}:\n{self.log_tail(name)}")
            try:
                if httpx.get(f"{self.url(name)}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"{name} was not ready after {READY_TIMEOUT_S:.0f}s:\n{self.log_tail(name)}")

    def kill(self, name: str) -> None:
        """SIGKILL, like a node loss or `kubectl delete pod --grace-period=0`."""
        process = self.processes[name]
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def restart(self, name: str) -> None:
        """What the StatefulSet controller does: the same pod (ordinal, volume) comes back."""
        self.start(self.specs[name])

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for name, process in self.processes.items():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill(name)

    def log_tail(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


def _on_path(program: str, env: dict[str, str]) -> bool:
    return shutil.which(program, path=env.get("PATH")) is not None


@contextmanager
def local_cluster(root: Path, *, pods: bool = False) -> Iterator[LocalCluster]:
    """The CPU preset's pods running here until the block ends (the broker stopped last)."""
    manifests = with_cluster_secrets(render_overlay(CPU_PRESET_DIR))  # no GPU here: the CPU variant
    try:
        broker = start_k8s_broker(manifests, root / "broker")
    except (RuntimeError, RabbitMQNodeError) as err:
        pytest.fail(str(err))
    ports = {name: free_port() for name in service_ports(manifests)}
    endpoints = LocalEndpoints(broker_url="", service_ports=ports, state_dir=root / "volumes", broker_port=broker.port)
    logs = root / "logs"
    logs.mkdir()
    local = LocalCluster(manifests, endpoints, logs, pods=root / "pods" if pods else None)
    try:
        for name in DEPLOYMENTS:
            local.start(launch_spec(manifests, name, endpoints, local_port=ports[name]))
        workers = worker_statefulsets(manifests)
        assert len(workers) == 2, "the local cluster runs the manifests' 2 workers"
        for worker in workers:
            local.start(launch_spec(manifests, worker["metadata"]["name"], endpoints, local_port=free_port()))
        for name in list(local.specs):
            local.wait_ready(name)
        yield local
    finally:
        local.stop_all()
        broker.stop()
