"""Robust DFCA (ratio consensus over gossip steps) on the distributed runtime against a real RabbitMQ, over REST.

`traffic: full` in float32: every round gossips, and every gossip step waits for all neighbours, so the run is
synchronous: the workers' checkpoints must hold the simulator's models, and the clusters are recovered. The
default (`traffic: lean`: gossip every 5th round, one-hop merges between, 8-bit payloads) recovers them too, and
the bytes the runtime counts (its summary and its Prometheus counter) are the simulator's. Both run on each device
this machine has (the config's `device`: the workers and the simulator compute there, payloads cross as CPU
tensors; on a GPU the lean run decodes 8-bit payloads onto it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from runtime_fixtures import Api, rotated_mnist, running_stack
from safetensors import safe_open
from safetensors.torch import load_file
from test_driver_equivalence import DEVICES

from dfca.algorithms import schedule_of
from dfca.cli.launcher import Stack
from dfca.config import ExperimentConfig
from dfca.simulator import simulate

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

WORKERS = 2


@pytest.fixture(scope="module")
def stack(rabbitmq_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("robust"), rabbitmq_url, WORKERS) as running:
        yield running


def recovered_run(api: Api, cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Run `cfg` to its end: (experiment, summary), once it completed with all 24 clients and ARI 1, every worker
    having computed on the config's device."""
    experiment = api.create_and_start(cfg)
    final = api.wait_finished(experiment)
    summary = api.summary(experiment)
    assert final["status"] == "completed" and summary["clients"] == 24, final
    assert summary["cluster_ari"] == pytest.approx(1.0), summary
    devices = summary["devices"]
    assert sorted(devices) == [str(w) for w in range(WORKERS)] and all(
        d.split(":")[0] == cfg["device"] for d in devices.values()), devices
    return experiment, summary


@pytest.mark.parametrize("device", DEVICES)
def test_robust_dfca_recovers_the_clusters_and_matches_the_simulator(stack: Stack, device: str) -> None:
    cfg = rotated_mnist(name=f"robust-{device}", rounds=5, device=device,
                        runtime={"round_timeout": 30.0, "payload_dtype": "float32"},
                        dfca={"variant": "robust", "traffic": "full", "warmup_rounds": 2, "warmup_gossip_steps": 3,
                              "gossip_steps": 2})
    api = Api.of(stack)
    experiment, summary = recovered_run(api, cfg)
    sim = simulate(ExperimentConfig.model_validate(cfg))
    rows: dict[int, dict[str, torch.Tensor]] = {}
    for ordinal in range(WORKERS):
        path = stack.options.state_dir / "checkpoints" / experiment / f"{ordinal}.safetensors"
        with safe_open(str(path), "pt") as f:
            hosted = json.loads(f.metadata()["clients"])
        tensors = load_file(str(path))
        for r, client in enumerate(hosted):
            rows[client] = {n.removeprefix("params."): v[r] for n, v in tensors.items() if n.startswith("params.")}
    assert sorted(rows) == list(range(24))
    for name, expected in sim.algorithm.params.items():
        assert expected.device.type == device
        got = torch.stack([rows[c][name] for c in range(24)])
        torch.testing.assert_close(got, expected.cpu(), rtol=1e-3, atol=1e-4)


def prometheus_bytes(api: Api, experiment: str) -> float:
    text = api.metrics.get("/metrics").text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "dfca_client_bytes_sent_total" and s.labels == {"experiment": experiment})


@pytest.mark.parametrize("device", DEVICES)
def test_the_lean_default_recovers_the_clusters_and_counts_the_simulators_bytes(stack: Stack, device: str) -> None:
    """8-bit payloads on the wire, gossip in rounds 1 and 6 of 6, one-hop merges between: ARI 1, the simulator's
    accuracy within 3 points, and bytes per client per round within 2% of the simulator's, in the summary and in
    Prometheus."""
    cfg = rotated_mnist(name=f"lean-{device}", rounds=6, aggregation="batch", device=device,
                        runtime={"round_timeout": 30.0})
    validated = ExperimentConfig.model_validate(cfg)
    assert validated.runtime.payload_dtype == "int8" and validated.dfca.traffic == "lean"
    api = Api.of(stack)
    experiment, summary = recovered_run(api, cfg)
    assert summary["messages"]["timeouts"] == 0 and not summary["messages"]["rejected"], summary["messages"]
    sim = simulate(validated).summary
    assert summary["test_accuracy"] == pytest.approx(sim["test_accuracy"], abs=0.03)
    per_round = summary["bytes_sent_per_client_per_round"]
    assert per_round == pytest.approx(sim["bytes_sent_per_client_per_round"], rel=0.02)
    rounds = schedule_of(validated).total_rounds
    assert prometheus_bytes(api, experiment) == pytest.approx(per_round * 24 * rounds, rel=1e-6)
