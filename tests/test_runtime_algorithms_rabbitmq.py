"""Every baseline on the distributed runtime against a real RabbitMQ, driven over REST (one shared stack:
topology, metrics, the aggregator and 3 workers, as `dfca up --aggregator` runs them).

- IFCA (the aggregator is its server): recovers the clusters and, synchronous, ends with the simulator's
  models; with a worker SIGKILLed for good the server closes its rounds by the deadline and the
  experiment completes;
- DFedAvgM: models from independent initialisations reach consensus, accuracy far above chance;
- FedSPD: completes on mixture data and reports every client's u_is;
- local: completes without sending a model.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from runtime_fixtures import Api, rotated_mnist, running_stack
from safetensors import safe_open
from safetensors.torch import load_file

from dfca.cli.launcher import Stack
from dfca.config import ExperimentConfig
from dfca.core import init_cluster_models
from dfca.identity.sharding import clients_of
from dfca.models.build import build_model
from dfca.results.evaluation import disagreement
from dfca.simulator import simulate

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

WORKERS = 3
ARI_BAR = 0.95


@pytest.fixture(scope="module")
def shared_stack(rabbitmq_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("algorithms"), rabbitmq_url, WORKERS, aggregator=True) as running:
        yield running


@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    """The shared stack, whole again: tests kill workers and the aggregator, which the supervisor restarts; each
    test starts once every process is ready, that is, known to the topology service (`dfca up`'s wait)."""
    shared_stack.wait_ready(timeout=120)
    known = Api.of(shared_stack).topology.get("/deployment").json()
    assert known["aggregator"] and known["workers_present"] == list(range(WORKERS)), known
    return shared_stack


def run(stack: Stack, cfg: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Create, start and wait: (id, the experiment's final record, the metrics service's summary)."""
    api = Api.of(stack)
    experiment = api.create_and_start(cfg)
    final = api.wait_finished(experiment)
    return experiment, final, api.summary(experiment)


def checkpointed_params(stack: Stack, experiment: str, clients: int) -> dict[str, torch.Tensor]:
    """Every client's params [N, k, ...], assembled from the workers' checkpoints."""
    rows: dict[int, dict[str, torch.Tensor]] = {}
    for ordinal in range(WORKERS):
        path = stack.options.state_dir / "checkpoints" / experiment / f"{ordinal}.safetensors"
        with safe_open(str(path), "pt") as f:
            hosted = json.loads(f.metadata()["clients"])
        tensors = load_file(str(path))
        names = [n.removeprefix("params.") for n in tensors if n.startswith("params.")]
        for r, client in enumerate(hosted):
            rows[client] = {n: tensors[f"params.{n}"][r] for n in names}
    assert sorted(rows) == list(range(clients))
    return {n: torch.stack([rows[c][n] for c in range(clients)]) for n in rows[0]}


def aggregator_roles(stack: Stack) -> dict[str, Any]:
    response = httpx.get(f"http://127.0.0.1:{stack.options.aggregator_port}/status", timeout=10.0)
    response.raise_for_status()
    return dict(response.json()["roles"])


def test_ifca_recovers_the_clusters_and_matches_the_simulator(stack: Stack) -> None:
    cfg = rotated_mnist(name="ifca", algorithm="ifca", rounds=6, runtime={"round_timeout": 60.0})
    experiment, final, summary = run(stack, cfg)
    assert final["status"] == "completed" and final["failed_clients"] == [], final
    assert summary["algorithm"] == "ifca" and summary["clients"] == 24 and summary["rounds_completed"] == 6
    assert summary["cluster_ari"] >= ARI_BAR, summary
    messages = summary["messages"]
    assert messages["published"] == 24 * 6 and messages["timeouts"] == 0  # one upload per client and round
    assert messages["applied"] == 24 * 6 * 2  # every client received the server's 2 models every round
    role = aggregator_roles(stack)[experiment]
    assert role["role"] == "ServerRole" and role["algorithm"] == "ifca" and not role["running"] and role["round"] == 6
    assert role["stats"]["applied"] == 24 * 6 and role["stats"].get("timeouts", 0) == 0
    sim = simulate(ExperimentConfig.model_validate(cfg))
    params = checkpointed_params(stack, experiment, 24)
    for name, server_model in sim.simulation.server.models.items():  # type: ignore[union-attr]
        torch.testing.assert_close(params[name], server_model.expand_as(params[name]), rtol=1e-4, atol=1e-5)
    assert summary["cluster_ari"] == pytest.approx(sim.summary["cluster_ari"])
    assert summary["test_accuracy"] == pytest.approx(sim.summary["test_accuracy"], abs=1e-6)


def test_ifca_completes_when_a_worker_dies(stack: Stack) -> None:
    cfg = rotated_mnist(name="ifca-kill", algorithm="ifca", rounds=8, runtime={"round_timeout": 3.0})
    api = Api.of(stack)
    experiment = api.create_and_start(cfg)
    api.wait_round(experiment, 2)
    stack.kill("worker-2", signal.SIGKILL, restart=False)
    try:
        final = api.wait_finished(experiment)
    finally:
        stack.services["worker-2"].restart = True  # the supervisor brings it back for later tests
    lost = clients_of(2, WORKERS, 24)
    assert final["status"] == "completed", final
    assert final["failed_clients"] == lost and final["worker_states"]["2"]["state"] == "dead"
    role = aggregator_roles(stack)[experiment]
    assert not role["running"] and role["round"] == cfg["rounds"], role  # the server did not hang
    assert role["stats"]["timeouts"] >= 1 and role["presumed_dead"] == lost, role
    summary = api.summary(experiment)
    assert summary["clients"] == 24 - len(lost) and summary["cluster_ari"] >= ARI_BAR, summary


def test_dfedavgm_reaches_consensus(stack: Stack) -> None:
    cfg = rotated_mnist(name="dfedavgm", algorithm="dfedavgm", init="local", rounds=6,
                        train={"lr": 0.05, "momentum": 0.9})
    experiment, final, summary = run(stack, cfg)
    assert final["status"] == "completed" and summary["clients"] == 24, final
    assert summary["test_accuracy"] >= 0.5, summary  # chance is 0.1
    assert summary["populated_clusters"] == 1 and summary["messages"]["published"] == 24 * 6
    initial = init_cluster_models(build_model("mlp", (1, 28, 28), 64, 10), list(range(24)), 1, cfg["seed"], "local")
    start, end = disagreement(initial)[0], disagreement(checkpointed_params(stack, experiment, 24))[0]
    assert end < 0.1 * start, (start, end)


def test_fedspd_reports_mixtures(stack: Stack) -> None:
    cfg = rotated_mnist(name="fedspd", algorithm="fedspd", rounds=5, data={"mixture": True, "rotations": [0, 90]},
                        fedspd={"final_epochs": 2})
    experiment, final, summary = run(stack, cfg)
    assert final["status"] == "completed" and summary["clients"] == 24, final
    mixture = summary["mixture"]
    assert sorted(int(c) for c in mixture) == list(range(24))
    assert all(len(u) == 2 and sum(u) == pytest.approx(1.0) for u in mixture.values())
    assert 0.0 <= summary["mixture_error"] <= 0.5
    assert summary["test_accuracy"] >= 0.3, summary  # chance is 0.1
    assert summary["messages"]["published"] == 24 * 5 and summary["messages"]["applied"] > 0


def test_local_sends_nothing(stack: Stack) -> None:
    cfg = rotated_mnist(name="local", algorithm="local", rounds=3)
    _, final, summary = run(stack, cfg)
    assert final["status"] == "completed" and summary["clients"] == 24, final
    assert summary["messages"]["published"] == 0 and summary["bytes_sent_per_client_per_round"] == 0
    assert summary["test_accuracy"] >= 0.5, summary


@pytest.mark.parametrize("algorithm", ["fedkmeans", "distkmeans"])
def test_k_means_over_rest_reports_gcd_and_cv_as_the_simulator_does(stack: Stack, algorithm: str) -> None:
    """Centroids travel over RabbitMQ like models; the metrics service computes eq. (12)'s GCD and CV from the
    workers' reports, as the simulator does, per round and in the summary."""
    cfg = {"name": algorithm, "algorithm": algorithm, "clusters": 3, "rounds": 12, "seed": 1,
           "data": {"dataset": "blobs", "clients": 12, "train_per_client": 80, "test_per_client": 20},
           "topology": {"kind": "erdos_renyi", "p": 0.5}, "runtime": {"round_timeout": 30.0}}
    experiment, final, summary = run(stack, cfg)
    assert final["status"] == "completed" and summary["clients"] == 12, final
    sim = simulate(ExperimentConfig.model_validate(cfg)).summary
    for key in ("gcd", "cv", "point_ari", "objective"):
        assert summary[key] == pytest.approx(sim[key], rel=1e-3, abs=1e-6), (key, summary[key], sim[key])
    assert summary["messages"]["timeouts"] == 0 and summary["messages"]["rejected_total"] == 0
    history = Api.of(stack).metrics.get(f"/experiments/{experiment}/metrics").json()["history"]
    assert len(history) == 12 and all("gcd" in h and "cv" in h for h in history)


def dirichlet_groups(**overrides: Any) -> dict[str, Any]:
    """3 Dirichlet label-skew groups of 8 clients: DPMM-CFL finds K = 3 in the simulator."""
    cfg: dict[str, Any] = {
        "name": "dpmm", "algorithm": "dpmm_cfl", "clusters": 3, "rounds": 8, "seed": 0,
        "data": {"partition": "dirichlet", "groups": 3, "clients": 24, "train_per_client": 50, "test_per_client": 20},
        "model": {"kind": "mlp", "hidden": 64},
        "train": {"lr": 0.05, "local_epochs": 1, "batch_size": 10, "momentum": 0.9},
        "runtime": {"round_timeout": 30.0},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


@pytest.mark.parametrize("algorithm", ["dpmm_cfl", "fesem"])
def test_server_clustering_over_rest_matches_the_simulator(stack: Stack, algorithm: str) -> None:
    """The aggregator samples (DPMM-CFL) or assigns (FeSEM) and averages; clients get their cluster and its model;
    clusters come and go under one binding. Lockstep without loss: the simulator's K, ARI, accuracy and F1."""
    cfg = dirichlet_groups(name=algorithm, algorithm=algorithm)
    experiment, final, summary = run(stack, cfg)
    assert final["status"] == "completed" and summary["clients"] == 24, final
    sim = simulate(ExperimentConfig.model_validate(cfg)).summary
    for key in ("inferred_clusters", "cluster_ari", "test_accuracy", "macro_f1", "test_accuracy_last3",
                "macro_f1_last3"):
        assert summary[key] == pytest.approx(sim[key], abs=1e-4), (key, summary[key], sim[key])
    assert summary["messages"]["timeouts"] == 0 and summary["messages"]["rejected_total"] == 0
    history = Api.of(stack).metrics.get(f"/experiments/{experiment}/metrics").json()["history"]
    assert len(history) == 8 and all("inferred_clusters" in h and "macro_f1" in h for h in history)
    if algorithm == "dpmm_cfl":
        assert summary["inferred_clusters"] == 3 and summary["cluster_ari"] >= 0.9, summary
        assert all("split_acceptance" in h for h in history)


def test_dpmm_cfl_survives_the_aggregator_and_a_worker_killed_mid_run(stack: Stack) -> None:
    """SIGKILL the aggregator at round 3 (it resumes the chain and the cluster models from its checkpoint; the uploads
    it had not checkpointed wait in its queue) and a worker at round 5 (it resumes from its own): the run completes
    with every client and recovers the groups as the unfaulted run does."""
    cfg = dirichlet_groups(name="dpmm-kill", rounds=10, runtime={"round_timeout": 5.0})
    api = Api.of(stack)
    experiment = api.create_and_start(cfg)
    api.wait_round(experiment, 3)
    stack.kill("aggregator", signal.SIGKILL)
    api.wait_round(experiment, 5)
    stack.kill("worker-1", signal.SIGKILL)
    final = api.wait_finished(experiment)
    assert final["status"] == "completed" and final["failed_clients"] == [], final
    role = aggregator_roles(stack)[experiment]
    assert role["resumed_from"] >= 1 and role["round"] == 10 and not role["running"], role
    summary = api.summary(experiment)
    assert summary["clients"] == 24 and summary["worker_restarts"].get("1", 0) >= 1, summary
    assert summary["inferred_clusters"] == 3 and summary["cluster_ari"] >= 0.9, summary
    unfaulted = simulate(ExperimentConfig.model_validate(cfg)).summary
    assert summary["test_accuracy"] >= unfaulted["test_accuracy"] - 0.03, (summary, unfaulted["test_accuracy"])


def test_fedcref_over_rest_reports_the_papers_metrics_as_the_simulator_does(stack: Stack) -> None:
    """Autoencoders, verdicts and FedAvg updates go all-to-all over RabbitMQ as safetensors; every worker builds the
    same association graph. The run stops by FedCRef's own rule, and the metrics service reports what the simulator
    reports: ACC before and after, communities against categories, wrong associations, isolated clusters."""
    cfg = {"name": "fedcref", "algorithm": "fedcref", "rounds": 6, "seed": 3,
           "data": {"clients": 9, "samples_per_category": 40},
           "fedcref": {"layers": [64, 32], "local_epochs": 15, "fedavg_rounds": 3, "stable_iterations": 2},
           "runtime": {"round_timeout": 60.0}}
    experiment, final, summary = run(stack, cfg)
    assert final["status"] == "completed" and summary["clients"] == 9, final
    sim = simulate(ExperimentConfig.model_validate(cfg))
    for key in ("initial_acc", "final_acc", "communities_found", "true_categories", "wrong_associations",
                "isolated_clusters", "iterations"):
        assert summary[key] == pytest.approx(sim.summary[key], abs=1e-4), (key, summary[key], sim.summary[key])
    assert summary["communities_found"] >= 3 and summary["final_acc"] > summary["initial_acc"] + 0.05, summary
    assert summary["messages"]["timeouts"] == 0 and summary["messages"]["rejected_total"] == 0
    history = Api.of(stack).metrics.get(f"/experiments/{experiment}/metrics").json()["history"]
    assert len(history) == len(sim.history) and all("communities_found" in h and "final_acc" in h for h in history)
