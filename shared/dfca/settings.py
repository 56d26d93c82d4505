"""Environment variables the services read: the one list, used by the code, compose and k8s.

Tests parse `docker-compose.yml` and `k8s/` and check that every env var they set is one of these.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENV_VARS: dict[str, str] = {
    "DFCA_BROKER_URL": "AMQP URL of RabbitMQ with this process's own user, e.g. amqp://dfca-worker-0:PASSWORD@127.0.0.1:5672/dfca",
    "DFCA_API_TOKEN": "bearer token that mutating REST calls must carry (it is good for reads too); only the topology "
                      "and metrics services hold it",
    "DFCA_READ_TOKEN": "bearer token that reads of the REST APIs may carry instead of the API token; with neither "
                       "set, reads are open",
    "DFCA_BROKER_USERS": "JSON file of each principal's AMQP URL (python -m dfca.identity.broker_users) for `dfca up`",
    "DFCA_TOPOLOGY_URL": "base URL of the topology service, for workers and the aggregator",
    "DFCA_METRICS_URL": "base URL of the metrics service",
    "DFCA_METRICS_DB_URL": "SQLAlchemy URL of the metrics store (SQLite by default, PostgreSQL by URL)",
    "DFCA_HOST": "address a service's HTTP server binds to",
    "DFCA_PORT": "port a service's HTTP server binds to",
    "DFCA_WORKER_ORDINAL": "this worker's index (a StatefulSet pod index in Kubernetes)",
    "DFCA_WORKERS": "how many workers share the clients",
    "DFCA_CHECKPOINT_DIR": "folder where a worker checkpoints its clients after each round",
    "DFCA_DATA_ROOT": "folder with local dataset files (MNIST/EMNIST IDX, CIFAR-10 binary, FEMNIST JSON)",
    "DFCA_DATA_DIR": "a worker's own data folder (DIR/<client-id>/train.npz ...): it hosts exactly those clients in "
                     "experiments with data.source: workers; in containers /var/lib/dfca/data",
    "DFCA_DEVICE": "cpu, cuda or auto: where a worker (or the aggregator) computes; unset: the config's `device`",
    "DFCA_LOG_LEVEL": "DEBUG, INFO, WARNING or ERROR",
    "DFCA_TLS_CERT": "PEM certificate (chain) a service's HTTP server presents: it answers HTTPS only",
    "DFCA_TLS_KEY": "PEM private key of DFCA_TLS_CERT",
    "DFCA_MODEL_FACTORIES": "comma-separated module prefixes and folders whose model factories (model.kind: torch) "
                            "the runtime may import; unset: none (dfca.models.factory)",
}

DEFAULT_BROKER_URL = "amqp://dfca:dfca@127.0.0.1:5672/dfca"


def broker_admin_file() -> Path:
    """Where scripts/start_rabbitmq.sh writes the local node's administrator URL (DFCA_BROKER_ADMIN_FILE)."""
    return Path(os.environ.get("DFCA_BROKER_ADMIN_FILE") or Path.home() / ".dfca" / "broker-admin-url")


def broker_admin_url() -> str | None:
    """The local node's administrator URL that scripts/start_rabbitmq.sh wrote, if it did."""
    try:
        return broker_admin_file().read_text().strip() or None
    except OSError:
        return None


def benchmark_broker_url() -> str:
    """The broker a benchmark uses by default: DFCA_BROKER_URL, else the local node's administrator, else the
    development user of a node set up before the administrator's file."""
    return os.environ.get("DFCA_BROKER_URL") or broker_admin_url() or DEFAULT_BROKER_URL
DEFAULT_PORTS = {"topology": 8080, "metrics": 8081, "worker": 8082, "aggregator": 8083}


def service_auth() -> dict[str, str]:
    """The header a service (worker, aggregator) sends on its own REST calls to the topology service: they only read,
    with DFCA_READ_TOKEN (deployments give them no API token); DFCA_API_TOKEN where a deployment still gives one."""
    token = env("DFCA_READ_TOKEN") or env("DFCA_API_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def env(name: str, default: str | None = None) -> str | None:
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not a documented dfca environment variable (see dfca.settings)")
    return os.environ.get(name, default)


@dataclass(frozen=True)
class ServiceSettings:
    broker_url: str
    api_token: str | None
    read_token: str | None
    topology_url: str
    metrics_url: str
    metrics_db_url: str
    host: str
    port: int
    worker_ordinal: int
    workers: int
    checkpoint_dir: str
    data_root: str | None
    data_dir: str | None
    device: str | None
    log_level: str

    @classmethod
    def from_env(cls, service: str) -> ServiceSettings:
        return cls(
            broker_url=env("DFCA_BROKER_URL", DEFAULT_BROKER_URL) or DEFAULT_BROKER_URL,
            api_token=env("DFCA_API_TOKEN"),
            read_token=env("DFCA_READ_TOKEN") or None,
            topology_url=env("DFCA_TOPOLOGY_URL", "http://127.0.0.1:8080") or "",
            metrics_url=env("DFCA_METRICS_URL", "http://127.0.0.1:8081") or "",
            metrics_db_url=env("DFCA_METRICS_DB_URL", "sqlite:///dfca-metrics.db") or "",
            host=env("DFCA_HOST", "127.0.0.1") or "127.0.0.1",
            port=int(env("DFCA_PORT", str(DEFAULT_PORTS.get(service, 8080))) or 8080),
            worker_ordinal=int(env("DFCA_WORKER_ORDINAL", "0") or 0),
            workers=int(env("DFCA_WORKERS", "1") or 1),
            checkpoint_dir=env("DFCA_CHECKPOINT_DIR", "checkpoints") or "checkpoints",
            data_root=env("DFCA_DATA_ROOT"),
            data_dir=env("DFCA_DATA_DIR") or None,
            device=env("DFCA_DEVICE") or None,
            log_level=env("DFCA_LOG_LEVEL", "INFO") or "INFO",
        )
