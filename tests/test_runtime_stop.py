"""Stop means stop: an experiment stopped in its first round ends on every worker within a round, the workers
report it stopped, go idle (their CPU, measured from /proc, falls to what an idle worker uses) and release the
experiment's queues."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pika
import pytest
from runtime_fixtures import Api, rotated_mnist, running_stack

from dfca import topics

pytestmark = pytest.mark.rabbitmq


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks of 1/100 s


def queues_of(url: str, experiment: str) -> list[str]:
    """The experiment's client queues that still exist (a passive declare of each hosted client's queue)."""
    left = []
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        for client in range(24):
            channel = connection.channel()
            try:
                channel.queue_declare(topics.client_queue(experiment, client), passive=True)
                left.append(str(client))
                channel.close()
            except pika.exceptions.ChannelClosedByBroker:
                pass
    finally:
        connection.close()
    return left


def test_a_stop_in_the_first_round_stops_the_work(rabbitmq_url: str, tmp_path: Path) -> None:
    with running_stack(tmp_path, rabbitmq_url) as stack:
        api = Api.of(stack)
        # a first round of seconds: seeding trains each client's local model for 60 epochs of 400 images
        cfg = rotated_mnist(name="stop", rounds=50, model={"kind": "mlp", "hidden": 512},
                            data={"train_per_client": 400}, dfca={"seed_epochs": 60})
        experiment = api.create_and_start(cfg)
        workers = [stack.services[f"worker-{i}"] for i in range(3)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the workers are computing: stop now, inside round 0
            if all(w.pid and cpu_seconds(w.pid) > 0 for w in workers) and api.experiment(experiment)["status"] == \
                    "running":
                break
            time.sleep(0.2)
        time.sleep(1.0)
        assert api.experiment(experiment)["round"] == 0
        assert api.topology.post(f"/experiments/{experiment}:stop").status_code == 200
        api.wait_until(experiment, lambda s: s["status"] == "stopped", 30, "stopped")
        for i in range(len(workers)):
            status = api_status(stack.options.worker_port_base + i)
            assert status["experiments"][experiment]["state"] == "stopped", status
        time.sleep(1.0)
        before = {w.name: cpu_seconds(w.pid) for w in workers if w.pid}
        time.sleep(5.0)
        burnt = {name: cpu_seconds(w.pid) - before[name] for name, w in zip(before, workers, strict=True)}
        assert all(seconds < 0.5 for seconds in burnt.values()), f"CPU seconds in 5 s after the stop: {burnt}"
        assert queues_of(rabbitmq_url, experiment) == []


def api_status(port: int) -> dict:
    return dict(httpx.get(f"http://127.0.0.1:{port}/status", timeout=10).json())
