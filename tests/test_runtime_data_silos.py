"""Workers that hold their own data, on RabbitMQ: two workers started on different folders of one federation (clients
of 20 to 400 samples) run an experiment over their clients (`data.source: workers`), each reading only its own folder;
the refusals.

One stack (`dfca up --workers 2 --data A --data B`, each worker audited: harness.audited_worker writes down every
file it opens under the data root) serves the run and then a worker restarted on another folder; a second stack
holds a client twice. A worker on a bad folder needs no broker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_fixtures import Api, audited_worker, rotated_mnist, running_stack

from dfca.cli.launcher import Stack
from dfca.config import ExperimentConfig
from dfca.data import FederatedData, build_federated_data

pytestmark = pytest.mark.rabbitmq

CLIENTS = 24


def client_id(i: int) -> str:
    return f"site-{i:02d}"


def federation() -> FederatedData:
    """Rotated MNIST, k=2, 24 clients of 400 train samples: the federation the folders are cut from."""
    return build_federated_data(ExperimentConfig.model_validate(rotated_mnist(data={"train_per_client": 400})))


SIZES = np.random.default_rng(0).permutation(np.linspace(20, 400, CLIENTS).astype(int))  # client i's train samples


def write_folder(folder: Path, data: FederatedData, rows: list[int], clusters: bool = True) -> Path:
    """A folder federation of `rows`: DIR/<client-id>/train.npz (client i's first SIZES[i] samples) and test.npz,
    and clusters.json."""
    for i in rows:
        client = folder / client_id(i)
        client.mkdir(parents=True)
        train = int(SIZES[i])
        test = int(data.test_sizes[i])
        np.savez(client / "train.npz", x=data.x_train[i, :train].numpy(), y=data.y_train[i, :train].numpy())
        np.savez(client / "test.npz", x=data.x_test[i, :test].numpy(), y=data.y_test[i, :test].numpy())
    if clusters:
        (folder / "clusters.json").write_text(json.dumps({client_id(i): int(data.true_cluster[i]) for i in rows}))
    return folder


def silo_config(**overrides: Any) -> dict[str, Any]:
    cfg = rotated_mnist(name="silos", **overrides)
    cfg["data"] = {"source": "workers"}
    return cfg


FOLDER_A = [i for i in range(CLIENTS) if i % 3 == 0]  # 8 clients
FOLDER_B = [i for i in range(CLIENTS) if i % 3 != 0]  # 16 clients


@pytest.fixture(scope="module")
def silos(rabbitmq_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path, Path]]:
    """A stack of two audited workers, worker 0 on folder A, worker 1 on folder B (and folder C beside them)."""
    root = tmp_path_factory.mktemp("silos")
    data = federation()
    folders = root / "data"
    a = write_folder(folders / "a", data, FOLDER_A)
    b = write_folder(folders / "b", data, FOLDER_B)
    write_folder(folders / "c", data, FOLDER_B[:5])
    audit = root / "opens-{ordinal}.txt"
    programs = {w: audited_worker(folders, audit) for w in (0, 1)}
    with running_stack(root / "stack", rabbitmq_url, workers=2, data_dirs=[a, b], worker_programs=programs) as stack:
        yield stack, folders, root


def opened(root: Path, ordinal: int) -> list[Path]:
    text = (root / f"opens-{ordinal}.txt").read_text() if (root / f"opens-{ordinal}.txt").exists() else ""
    return [Path(line.split(" ", 1)[1]) for line in text.splitlines() if line]


def worker_log(stack: Stack, ordinal: int) -> str:
    return (stack.options.state_dir / "logs" / f"worker-{ordinal}.log").read_text(errors="replace")


def test_two_workers_on_their_own_folders_recover_the_clusters_reading_only_their_own(
        silos: tuple[Stack, Path, Path]) -> None:
    stack, folders, root = silos
    api = Api.of(stack)
    deployment = api.topology.get("/deployment").json()
    assert deployment["data"] == {"0": {"folder": str(folders / "a"), "clients": len(FOLDER_A)},
                                  "1": {"folder": str(folders / "b"), "clients": len(FOLDER_B)}}
    assert deployment["data_refused"] == {}

    experiment = api.create_and_start(silo_config())
    topology = api.topology.get(f"/experiments/{experiment}/topology").json()
    assert topology["clients"] == CLIENTS
    assert topology["placement"]["client_ids"] == [client_id(i) for i in range(CLIENTS)]
    assert topology["worker_clients"] == {"0": FOLDER_A, "1": FOLDER_B}
    state = api.wait_finished(experiment, timeout=400)
    assert state["status"] == "completed", state
    summary = api.summary(experiment)
    assert summary["cluster_ari"] >= 0.95, summary
    assert summary["clients_total"] == CLIENTS and summary["failed_clients"] == []
    assert summary["clients"] == CLIENTS  # every client evaluated
    print(f"ARI {summary['cluster_ari']:.3f}, accuracy {summary['test_accuracy']:.3f}, {summary['clients']} clients, "
          f"train sizes {min(SIZES)}..{max(SIZES)}")
    clients = api.metrics.get(f"/experiments/{experiment}/clients").json()
    assert sorted(clients["clients"]) == list(range(CLIENTS))  # the run used every client

    for ordinal, mine, rows in ((0, folders / "a", FOLDER_A), (1, folders / "b", FOLDER_B)):
        paths = opened(root, ordinal)
        assert paths, f"worker {ordinal} opened nothing under {folders}"
        strays = [p for p in paths if mine not in (p, *p.parents)]
        assert strays == [], f"worker {ordinal} read outside its folder {mine}: {strays[:5]}"
        read = {p.parent.name for p in paths if p.name == "train.npz"}
        assert read == {client_id(i) for i in rows}
        log = worker_log(stack, ordinal)
        assert f"worker {ordinal} read data folder {mine}: {len(rows)} clients: {client_id(rows[0])} " \
               f"({SIZES[rows[0]]} train, 25 test)" in log
        assert "input shape (1, 28, 28), 10 classes; true clusters of" in log
    print(next(line for line in worker_log(stack, 0).splitlines() if "read data folder" in line))


def test_a_worker_restarted_with_other_clients_is_refused(silos: tuple[Stack, Path, Path]) -> None:
    stack, folders, _ = silos
    api = Api.of(stack)
    experiment = api.create_and_start(silo_config(rounds=200))
    api.wait_round(experiment, 2)
    worker = stack.services["worker-1"]
    worker.env["DFCA_DATA_DIR"] = str(folders / "c")  # its next start reads another folder
    try:
        assert worker.process is not None
        worker.process.kill()
        deadline = time.monotonic() + 120
        refusal = None
        while refusal is None and time.monotonic() < deadline:
            refusal = api.topology.get("/deployment").json()["data_refused"].get("1")
            time.sleep(0.5)
        assert refusal is not None, "the restarted worker's other clients were not refused"
        assert f"worker 1 was restarted with other clients than experiment {experiment} placed on it" in refusal
        assert "missing 'site-" in refusal
        state = api.wait_until(experiment, lambda s: s["worker_states"]["1"]["state"] == "failed", 120,
                               "worker 1's runner refusing its placement")
        assert "holds other clients" in state["worker_states"]["1"]["detail"]
        created = api.topology.post("/experiments", json=silo_config())
        assert created.status_code == 422 and "worker 1 is refused" in created.text

        worker.env["DFCA_DATA_DIR"] = str(folders / "b")  # restarted on its own folder: the same clients are fine
        worker.process.kill()
        state = api.wait_until(experiment, lambda s: s["worker_states"]["1"]["state"] == "running"
                               and s["worker_states"]["1"]["incarnations"] >= 3, 180, "worker 1 back in the run")
        assert state["worker_states"]["1"]["resumed_from"] is not None  # from its checkpoint
        assert api.topology.get("/deployment").json()["data_refused"] == {}
        before = state["worker_states"]["1"]["round"]
        api.wait_until(experiment, lambda s: s["worker_states"]["1"]["round"] >= before + 2, 120,
                       "worker 1 running rounds again")
    finally:
        api.topology.post(f"/experiments/{experiment}:stop")
        worker.env["DFCA_DATA_DIR"] = str(folders / "b")


def test_a_client_held_by_two_workers_is_refused(rabbitmq_url: str, tmp_path: Path) -> None:
    data = federation()
    a = write_folder(tmp_path / "a", data, [0, 1, 2, 3])
    b = write_folder(tmp_path / "b", data, [3, 4, 5, 6])
    with running_stack(tmp_path / "stack", rabbitmq_url, workers=2, data_dirs=[a, b],
                       ready=["topology", "metrics"]) as stack:  # the refused worker never is
        api = Api.of(stack)
        deadline = time.monotonic() + 120
        view = api.topology.get("/deployment").json()
        while len(view["data"]) + len(view["data_refused"]) < 2:
            assert time.monotonic() < deadline, f"the workers did not both register: {view}"
            time.sleep(0.5)
            view = api.topology.get("/deployment").json()
        refused = view["data_refused"]
        assert len(refused) == 1, refused
        ordinal, reason = next(iter(refused.items()))
        other = 1 - int(ordinal)
        assert f"holds client 'site-03', which worker {other}" in reason
        created = api.topology.post("/experiments", json=silo_config())
        assert created.status_code == 422
        assert f"worker {ordinal} is refused" in created.text and "site-03" in created.text
        assert not stack.ready(f"worker-{ordinal}")  # its /readyz fails
        assert "refused this worker's data" in worker_log(stack, int(ordinal))


def test_a_worker_on_a_bad_folder_stops_naming_the_client(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    (bad / "site-00").mkdir(parents=True)  # a client folder without train.npz
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFCA_")}
    env.update(DFCA_TOPOLOGY_URL="http://127.0.0.1:9", DFCA_BROKER_URL="amqp://nobody:x@127.0.0.1:9/none")
    done = subprocess.run([sys.executable, "-m", "dfca.cli", "worker", "--data", str(bad)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "site-00" in done.stderr and "cannot use its data folder" in done.stderr
