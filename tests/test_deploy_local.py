"""The Kubernetes manifests start the real services: launch topology, metrics, the aggregator and 2
workers locally with exactly the command and env of their pods (the CPU preset, k8s-config/presets/cpu), Service
hostnames mapped to 127.0.0.1, against a private RabbitMQ node configured like the broker pod (its
init container run here), each process connected as its own broker user from its own Secret, and
run a tiny experiment over REST.

Kill random worker processes on an interval while an experiment runs and restart them like the StatefulSet
would (same ordinal, same checkpoint folder); the experiment completes and its accuracy stays within 2 points
of the unfaulted run. (tests/test_deploy_chaos_script.py drives scripts/chaos_k8s.sh itself against such a
cluster.)
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from deploy_cluster import LocalCluster, local_cluster, tiny_experiment

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

EXPERIMENT_TIMEOUT_S = 900.0
KILL_INTERVAL_S = 3.0
MAX_KILLS = 3
ACCURACY_TOLERANCE_POINTS = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("deploy-local")) as local:
        yield local


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
