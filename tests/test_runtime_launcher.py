"""`dfca up`'s supervisor: restart policy, clean stop, the services' environment, a missing broker."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dfca.cli import launcher
from dfca.cli.launcher import ServiceProcess, Stack, StackOptions, service_env
from dfca.settings import ENV_VARS
from dfca.transport.rabbitmq import RabbitMQTransport


class SleeperStack(Stack):
    """The real supervisor with every service replaced by `sleep`."""

    def _spawn(self, proc: ServiceProcess) -> None:
        proc.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                        start_new_session=True)
        proc.started_at = time.monotonic()


def wait_for(condition: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_dead_processes_are_restarted_unless_told_otherwise(tmp_path: Path) -> None:
    stack = SleeperStack(StackOptions(workers=2, state_dir=tmp_path))
    assert list(stack.services) == ["topology", "metrics", "worker-0", "worker-1"]
    stack.start()
    try:
        first = stack.services["worker-0"].pid
        stack.kill("worker-0", signal.SIGKILL)

        def restarted() -> bool:
            stack.poll()
            return stack.services["worker-0"].running and stack.services["worker-0"].pid != first

        wait_for(restarted)
        assert stack.services["worker-0"].restarts == 1 and stack.services["worker-0"].exits == [-signal.SIGKILL]
        stack.kill("worker-1", signal.SIGKILL, restart=False)
        wait_for(lambda: (stack.poll(), stack.services["worker-1"].process is None)[1])
        down = stack.services["worker-1"]
        down.next_start = 0.0  # whatever backoff there was has passed: a restart would happen on this poll
        stack.poll()
        assert down.process is None and down.restarts == 0 and down.exits == [-signal.SIGKILL]
    finally:
        stack.stop(grace=5)
    assert not any(p.running for p in stack.services.values())


def test_services_get_only_documented_dfca_variables(tmp_path: Path) -> None:
    options = StackOptions(workers=4, state_dir=tmp_path, api_token="x")
    for service, ordinal in (("topology", None), ("metrics", None), ("worker", 3)):
        env = service_env(options, service, 9999, ordinal)
        assert {k for k in env if k.startswith("DFCA_")} <= set(ENV_VARS)
    worker = service_env(options, "worker", 9999, 3)
    assert worker["DFCA_WORKER_ORDINAL"] == "3" and worker["DFCA_WORKERS"] == "4"
    # only the REST services hold the API token: a compromised worker or aggregator cannot create, start or stop
    assert "DFCA_API_TOKEN" not in worker and "DFCA_API_TOKEN" not in service_env(options, "aggregator", 9999)
    assert service_env(options, "topology", 9999)["DFCA_API_TOKEN"] == "x"
    assert worker["DFCA_TOPOLOGY_URL"] == "http://127.0.0.1:8080" and int(worker["OMP_NUM_THREADS"]) >= 1


@pytest.mark.parametrize(("cores", "workers"), [(None, 1), (1, 1), (2, 2), (3, 3), (16, 3)])
def test_dfca_up_starts_no_more_workers_than_cores_by_default(cores: int | None, workers: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: cores)
    assert launcher.default_workers() == workers
    options = StackOptions()
    assert options.workers == workers
    # each worker computes on cores // workers threads: one apiece where they are as many as the cores
    assert service_env(options, "worker", 9999, 0)["OMP_NUM_THREADS"] == str(max(1, (cores or 1) // workers))


def test_dfca_up_refuses_to_start_without_a_broker(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dfca.cli", "up", "--broker", "amqp://dfca:dfca@127.0.0.1:1/dfca",
         "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1 and "no RabbitMQ answers" in result.stderr


def test_deleting_service_queues_gives_up_on_a_broker_it_cannot_reach(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The stack's teardown after its broker went away: a warning that the queues are left to expire, no error and
    no deletion attempted."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(launcher, "DELETE_QUEUE_TIMEOUT_S", 2.0)
    asked: list[str] = []
    monkeypatch.setattr(RabbitMQTransport, "delete_queue", lambda self, name: asked.append(name))
    stack = Stack(StackOptions(broker_url=f"amqp://u:p@127.0.0.1:{port}/dfca", state_dir=tmp_path))
    with caplog.at_level(logging.WARNING, logger="dfca.cli.launcher"):
        stack.delete_service_queues()
    assert asked == []
    assert "left to expire" in caplog.text
