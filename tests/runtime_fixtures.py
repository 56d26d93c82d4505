"""Helpers for the runtime tests: a local stack on free ports, a small REST client, the test config."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from free_ports import free_port, free_port_block

from dfca.algorithms import schedule_of
from dfca.cli.launcher import Stack, StackOptions, prepare_credentials
from dfca.config import ExperimentConfig

TOKEN = "test-token"


def rotated_mnist(**overrides: Any) -> dict[str, Any]:
    """Rotated MNIST, k=2, 24 clients on ER(p=0.5): the simulator reaches ARI 1.0 and accuracy ~0.87."""
    cfg: dict[str, Any] = {
        "name": "rt", "algorithm": "dfca", "init": "global", "aggregation": "sequential", "clusters": 2,
        "rounds": 10, "seed": 0,
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": 24, "train_per_client": 80,
                 "test_per_client": 25},
        "model": {"kind": "mlp", "hidden": 64},
        "train": {"lr": 0.25, "local_epochs": 3, "batch_size": 20},
        "topology": {"kind": "erdos_renyi", "p": 0.5},
        "runtime": {"round_timeout": 5.0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg.get(key, {}), **value}
        else:
            cfg[key] = value
    return cfg


def total_rounds(cfg: dict[str, Any]) -> int:
    """Rounds a run reports: `rounds` training rounds plus robust DFCA's seeding rounds before them."""
    return schedule_of(ExperimentConfig.model_validate(cfg)).total_rounds


def log_tails(state_dir: Path, lines: int = 15) -> str:
    out = []
    for path in sorted((state_dir / "logs").glob("*.log")):
        out.append(f"--- {path.name}")
        out.extend(path.read_text(errors="replace").splitlines()[-lines:])
    return "\n".join(out)


def audited_worker(root: Path, log: Path) -> list[str]:
    """A worker that writes down each file it opens under `root` (harness.audited_worker), to `log` with `{ordinal}`
    replaced by its ordinal."""
    return [sys.executable, str(Path(__file__).resolve().parent / "harness" / "audited_worker.py"), str(root), str(log)]


def forging_worker(attack: str) -> list[str]:
    """The program that runs a compromised worker: the product's worker, its clients' messages forged."""
    return [sys.executable, str(Path(__file__).resolve().parent / "harness" / "forging_worker.py"), attack]


@contextmanager
def running_stack(state_dir: Path, broker_url: str, workers: int = 3, aggregator: bool = False,
                  broker_users: dict[str, str] | None = None, read_token: str = "",
                  forge: dict[int, str] | None = None, model_factories: str = "",
                  data_dirs: list[Path] | None = None, worker_programs: dict[int, list[str]] | None = None,
                  ready: list[str] | None = None) -> Iterator[Stack]:
    """A supervised stack (same code as `dfca up`, with `--aggregator` if asked) on free ports, stopped on exit;
    `broker_users`: each process connects as its own principal (`dfca up --broker-users`); `read_token`:
    DFCA_READ_TOKEN; `forge`: worker ordinal -> what it forges (harness.forging_worker); `model_factories`:
    DFCA_MODEL_FACTORIES (the model factories its services may import); `data_dirs`: worker i's own data folder
    (`dfca up --data`); `worker_programs`: worker ordinal -> the program that runs it (harness.audited_worker);
    `ready`: the services waited for (default: all)."""
    options = StackOptions(
        workers=workers, broker_url=broker_url, topology_port=free_port(), metrics_port=free_port(),
        aggregator_port=free_port() if aggregator else None, worker_port_base=free_port_block(workers),
        api_token=TOKEN, read_token=read_token, state_dir=state_dir, log_to_files=True, broker_users=broker_users,
        worker_programs={**(worker_programs or {}),
                         **{w: forging_worker(attack) for w, attack in (forge or {}).items()}},
        model_factories=model_factories, data_dirs=[str(d) for d in data_dirs or []],
    )
    with supervised(options, ready) as stack:
        yield stack


@contextmanager
def default_stack(state_dir: Path, broker_url: str, rabbitmqctl: str, workers: int = 3,
                  forge: dict[int, str] | None = None) -> Iterator[Stack]:
    """A stack as `dfca up` makes it with no broker-user or token option (dfca.cli.launcher.prepare_credentials: a
    broker user per principal made through `rabbitmqctl`, both tokens generated), on free ports; `broker_url` names
    the broker without credentials. `forge` as in `running_stack`."""
    options = StackOptions(
        workers=workers, broker_url=broker_url, topology_port=free_port(), metrics_port=free_port(),
        worker_port_base=free_port_block(workers), state_dir=state_dir, log_to_files=True, rabbitmqctl=rabbitmqctl,
        worker_programs={w: forging_worker(attack) for w, attack in (forge or {}).items()},
    )
    _, refusal = prepare_credentials(options)
    assert refusal is None, refusal
    with supervised(options) as stack:
        yield stack


@contextmanager
def supervised(options: StackOptions, ready: list[str] | None = None) -> Iterator[Stack]:
    """The stack of `options`, started, ready (the services in `ready`, default all) and supervised; stopped and its
    service queues deleted on exit."""
    state_dir = options.state_dir
    stack = Stack(options)
    stop = threading.Event()
    stack.start()
    try:
        stack.wait_ready(timeout=120, names=ready)
        stack.supervise(stop)
        yield stack
    except BaseException:
        print(log_tails(state_dir))
        raise
    finally:
        stop.set()
        stack.stop()
        if "@" in options.broker_url:  # a URL with credentials (default_stack's has none: its node is the test's)
            stack.delete_service_queues()  # a new deployment each time (free ports): its queues would stay 6 hours


class Api:
    """The topology and metrics REST APIs of one stack."""

    def __init__(self, topology_url: str, metrics_url: str, token: str = TOKEN) -> None:
        auth = {"Authorization": f"Bearer {token}"}  # the API token: good for reads under DFCA_READ_TOKEN too
        self.topology = httpx.Client(base_url=topology_url, timeout=10.0, headers=auth)
        self.metrics = httpx.Client(base_url=metrics_url, timeout=30.0, headers=auth)

    @classmethod
    def of(cls, stack: Stack) -> Api:
        return cls(stack.options.topology_url, stack.options.metrics_url, stack.options.api_token)

    def create_and_start(self, cfg: dict[str, Any]) -> str:
        created = self.topology.post("/experiments", json=cfg)
        assert created.status_code == 201, created.text
        experiment = str(created.json()["id"])
        started = self.topology.post(f"/experiments/{experiment}:start")
        assert started.status_code == 200, started.text
        return experiment

    def experiment(self, experiment: str) -> dict[str, Any]:
        response = self.topology.get(f"/experiments/{experiment}")
        response.raise_for_status()
        return dict(response.json())

    def wait_until(self, experiment: str, done: Any, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.experiment(experiment)
            if done(state):
                return state
            time.sleep(0.25)
        raise AssertionError(f"{what} not reached within {timeout:.0f} s: {self.experiment(experiment)}")

    def wait_round(self, experiment: str, round_: int, timeout: float = 120.0) -> dict[str, Any]:
        return self.wait_until(experiment, lambda s: s["round"] >= round_ or s["status"] != "running", timeout,
                               f"round {round_}")

    def wait_finished(self, experiment: str, timeout: float = 240.0) -> dict[str, Any]:
        return self.wait_until(experiment, lambda s: s["status"] not in ("created", "running", "stopping"),
                               timeout, "the end of the run")

    def summary(self, experiment: str) -> dict[str, Any]:
        """The metrics service's summary once it has seen the experiment's end."""
        deadline = time.monotonic() + 30
        while True:
            response = self.metrics.get(f"/experiments/{experiment}/summary")
            if response.status_code == 200 and response.json()["status"] in ("completed", "failed", "stopped"):
                return dict(response.json())
            if time.monotonic() > deadline:
                raise AssertionError(f"no final summary: {response.status_code} {response.text[:500]}")
            time.sleep(0.5)
