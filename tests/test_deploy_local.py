"""The Kubernetes manifests start the real services: launch topology, metrics, the aggregator and 2
workers locally with exactly the command and env of their pods (CPU variant, k8s/cpu), Service
hostnames mapped to 127.0.0.1, against a private RabbitMQ node configured like the broker pod (its
init container run here), each process connected as its own broker user from its own Secret, and
run a tiny experiment over REST.

The chaos twin of scripts/chaos_k8s.sh: kill random worker processes on an interval while an
experiment runs and restart them like the StatefulSet would (same ordinal, same checkpoint
folder); the experiment completes and its accuracy stays within 2 points of the unfaulted run.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from deploy_manifest import (
    CPU_OVERLAY_DIR,
    LaunchSpec,
    LocalEndpoints,
    Manifest,
    launch_spec,
    render_kustomization,
    service_ports,
    start_k8s_broker,
    with_cluster_secrets,
    worker_statefulsets,
)
from rabbitmq_node import RabbitMQNodeError

from dfca.config import parse_config

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

READY_TIMEOUT_S = 180.0
EXPERIMENT_TIMEOUT_S = 900.0
KILL_INTERVAL_S = 3.0
MAX_KILLS = 3
ACCURACY_TOLERANCE_POINTS = 2.0
DEPLOYMENTS = ("topology", "metrics", "aggregator")


def tiny_experiment(name: str, workers: int) -> dict[str, Any]:
    """Rotated MNIST (bundled), 2 clusters, 8 clients: the simulator reaches ~0.8 accuracy, ARI 1."""
    config = {
        "name": name, "algorithm": "dfca", "init": "global", "clusters": 2, "rounds": 12, "seed": 0,
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": 8,
                 "train_per_client": 150, "test_per_client": 100},
        "model": {"kind": "mlp", "hidden": 64},
        "train": {"lr": 0.1, "local_epochs": 3, "batch_size": 50},
        "topology": {"kind": "complete"},
        "runtime": {"workers": workers, "round_timeout": 10.0},
    }
    parse_config(config)  # the body must be a valid ExperimentConfig
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalCluster:
    """The pods of the manifests as local processes."""

    manifests: list[Manifest]
    endpoints: LocalEndpoints
    logs: Path
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
    import shutil

    return shutil.which(program, path=env.get("PATH")) is not None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    manifests = with_cluster_secrets(render_kustomization(CPU_OVERLAY_DIR))  # no GPU here: the CPU variant
    root = tmp_path_factory.mktemp("deploy-local")
    try:
        broker = start_k8s_broker(manifests, root / "broker")
    except (RuntimeError, RabbitMQNodeError) as err:
        pytest.fail(str(err))
    ports = {name: free_port() for name in service_ports(manifests)}
    endpoints = LocalEndpoints(broker_url="", service_ports=ports, state_dir=root / "volumes", broker_port=broker.port)
    logs = root / "logs"
    logs.mkdir()
    local = LocalCluster(manifests, endpoints, logs)
    try:
        for name in DEPLOYMENTS:
            local.start(launch_spec(manifests, name, endpoints, local_port=ports[name]))
        workers = worker_statefulsets(manifests)
        assert len(workers) == 2, "the launch test runs the manifests' 2 workers"
        for worker in workers:
            local.start(launch_spec(manifests, worker["metadata"]["name"], endpoints, local_port=free_port()))
        for name in list(local.specs):
            local.wait_ready(name)
        yield local
    finally:
        local.stop_all()
        broker.stop()


def api_headers(cluster: LocalCluster) -> dict[str, str]:
    return {"Authorization": f"Bearer {cluster.api_token}"}


def create_and_start(cluster: LocalCluster, config: dict[str, Any]) -> str:
    created = httpx.post(f"{cluster.url('topology')}/experiments", json=config, headers=api_headers(cluster),
                         timeout=30)
    assert created.is_success, created.text
    experiment = created.json()["id"]
    started = httpx.post(f"{cluster.url('topology')}/experiments/{experiment}:start", headers=api_headers(cluster),
                         timeout=30)
    assert started.is_success, started.text
    return experiment


def experiment_view(cluster: LocalCluster, experiment: str) -> dict[str, Any]:
    """The topology service's view of the experiment: its status, and `round`, what every live worker finished."""
    response = httpx.get(f"{cluster.url('topology')}/experiments/{experiment}", headers=api_headers(cluster),
                         timeout=10)
    assert response.is_success, response.text
    return dict(response.json())


def wait_completed(cluster: LocalCluster, experiment: str, on_poll: Any = None) -> None:
    deadline = time.monotonic() + EXPERIMENT_TIMEOUT_S
    while time.monotonic() < deadline:
        view = experiment_view(cluster, experiment)
        status = view["status"]
        if status == "completed":
            return
        assert status not in ("failed", "stopped", "error"), (
            f"experiment {experiment} {status}:\n" + "\n".join(cluster.log_tail(n) for n in cluster.specs))
        if on_poll is not None:
            on_poll(view)
        time.sleep(0.5)
    pytest.fail(f"experiment {experiment} did not complete in {EXPERIMENT_TIMEOUT_S:.0f}s")


def summary(cluster: LocalCluster, experiment: str) -> dict[str, Any]:
    response = httpx.get(f"{cluster.url('metrics')}/experiments/{experiment}/summary",
                         headers=api_headers(cluster), timeout=30)
    assert response.is_success, response.text
    return response.json()


def accuracy_points(value: float) -> float:
    """Accuracy in percentage points, whether the API reports a fraction or a percentage."""
    return value * 100.0 if value <= 1.0 else value


@pytest.fixture(scope="module")
def unfaulted_summary(cluster: LocalCluster) -> dict[str, Any]:
    workers = len(cluster.workers())
    experiment = create_and_start(cluster, tiny_experiment("deploy-local-clean", workers))
    wait_completed(cluster, experiment)
    return summary(cluster, experiment)


def test_manifest_commands_run_an_experiment_to_completion_over_rest(unfaulted_summary: dict[str, Any]) -> None:
    assert accuracy_points(unfaulted_summary["test_accuracy"]) >= 60.0, unfaulted_summary
    assert "cluster_ari" in unfaulted_summary


def test_experiment_survives_workers_killed_on_an_interval(cluster: LocalCluster,
                                                           unfaulted_summary: dict[str, Any]) -> None:
    """A worker is killed (and restarted) as soon as every worker finished a round, then every KILL_INTERVAL_S, at
    most MAX_KILLS times: the run completes, and within ACCURACY_TOLERANCE_POINTS of the unfaulted one. (Kills by
    the clock from the start missed a run that had become faster than the first interval.)"""
    rng = random.Random(0)
    kills: list[str] = []
    next_kill = 0.0
    workers = cluster.workers()
    experiment = create_and_start(cluster, tiny_experiment("deploy-local-chaos", len(workers)))

    def inject(view: dict[str, Any]) -> None:
        nonlocal next_kill
        if len(kills) >= MAX_KILLS or int(view["round"]) < 1 or time.monotonic() < next_kill:
            return
        victim = rng.choice(workers)
        cluster.kill(victim)
        kills.append(victim)
        cluster.restart(victim)
        next_kill = time.monotonic() + KILL_INTERVAL_S

    wait_completed(cluster, experiment, on_poll=inject)
    assert kills, "the experiment completed before any worker was killed: make it longer"
    faulted = summary(cluster, experiment)
    clean_points = accuracy_points(unfaulted_summary["test_accuracy"])
    faulted_points = accuracy_points(faulted["test_accuracy"])
    assert abs(faulted_points - clean_points) <= ACCURACY_TOLERANCE_POINTS, (kills, unfaulted_summary, faulted)
    for name in workers:  # the restarted workers are healthy again
        cluster.wait_ready(name)
