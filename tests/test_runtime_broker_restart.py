"""The runtime survives a broker restart mid-run (a private RabbitMQ node; the shared one is never stopped)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rabbitmq_node import RabbitMQNode
from runtime_fixtures import Api, rotated_mnist, running_stack, total_rounds

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


def test_broker_restart_midway(private_rabbitmq: RabbitMQNode, tmp_path: Path) -> None:
    with running_stack(tmp_path, private_rabbitmq.url) as stack:
        api = Api.of(stack)
        cfg = rotated_mnist(name="broker", rounds=8)
        experiment = api.create_and_start(cfg)
        api.wait_round(experiment, 3)
        private_rabbitmq.stop()
        during = api.experiment(experiment)  # REST works without the broker
        assert during["status"] == "running" and during["round"] < total_rounds(cfg), "the outage must fall in the run"
        time.sleep(3)  # a real outage: reconnect attempts fail for a while
        private_rabbitmq.start()
        final = api.wait_finished(experiment, timeout=300)
        assert final["status"] == "completed" and final["failed_clients"] == [], final
        summary = api.summary(experiment)
        assert summary["clients"] == 24 and summary["rounds_completed"] == total_rounds(cfg)
        assert summary["cluster_ari"] >= 0.95
        assert min(int(w["incarnations"]) for w in final["worker_states"].values()) == 1  # no process restarted
