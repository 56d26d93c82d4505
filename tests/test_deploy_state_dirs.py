"""No silent state loss: the topology and metrics services, run as the image's user (uid 10001) on a fresh
root-owned folder (what a new Docker named volume is), refuse to start with an error naming the folder, the
setting and the fix, before they touch the broker. A writable folder keeps the topology's experiments across a
restart (Compose's topology volume), and the image creates every folder Compose and Kubernetes mount."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dfca.identity.broker_setup import ensure_broker_topology
from dfca.runtime.control.coordinator import Coordinator
from dfca.runtime.service.state_dirs import StateDirUnwritable, require_writable, sqlite_folder
from dfca.transport.memory import InMemoryBroker, InMemoryTransport

IMAGE_UID = 10001


@pytest.fixture
def root_owned_folder() -> Iterator[Path]:
    """A folder in /tmp (which uid 10001 may traverse) that its user cannot write: root-owned mode 755 when the
    tests run as root (CI), else read-only for the running user."""
    parent = Path(tempfile.mkdtemp(prefix="dfca-state-"))
    parent.chmod(0o755)
    folder = parent / "state"
    folder.mkdir(mode=0o755)
    if os.getuid() != 0:
        folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)
    for path in sorted(parent.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    parent.rmdir()


def run_as_image_user(target: Callable[[], None]) -> tuple[int, str]:
    """Fork, drop to uid/gid 10001 when root, run `target` (a service's main); its exit code and SystemExit text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        message = ""
        try:
            os.close(read_end)
            if os.getuid() == 0:
                os.setgroups([])
                os.setgid(IMAGE_UID)
                os.setuid(IMAGE_UID)
            target()
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
            message = "" if isinstance(done.code, int) or done.code is None else str(done.code)
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            code, message = 99, f"{type(err).__name__}: {err}"
        os.write(write_end, message.encode())
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


def service_main(module: str, env: dict[str, str]) -> Callable[[], None]:
    main = __import__(module, fromlist=["main"]).main  # imported here: uid 10001 cannot read root's site-packages

    def run() -> None:
        os.environ.update(env)
        # an unreachable broker: the service must refuse before it gets that far
        os.environ["DFCA_BROKER_URL"] = "amqp://nobody:nothing@127.0.0.1:1/dfca"
        main()
    return run


def test_topology_as_uid_10001_refuses_a_root_owned_state_folder(root_owned_folder: Path) -> None:
    code, message = run_as_image_user(service_main("services.topology.main",
                                                   {"DFCA_CHECKPOINT_DIR": str(root_owned_folder)}))
    assert code != 0, message
    assert "DFCA_CHECKPOINT_DIR" in message and str(root_owned_folder / "_topology") in message, message
    assert "refusing to start" in message and "chown" in message, message
    assert not (root_owned_folder / "_topology").exists()


def test_metrics_as_uid_10001_refuses_a_root_owned_database_folder(root_owned_folder: Path) -> None:
    url = f"sqlite:///{root_owned_folder}/metrics.db"
    code, message = run_as_image_user(service_main("services.metrics.main", {"DFCA_METRICS_DB_URL": url}))
    assert code != 0, message
    assert "DFCA_METRICS_DB_URL" in message and str(root_owned_folder) in message, message
    assert "refusing to start" in message
    assert not (root_owned_folder / "metrics.db").exists()


def test_the_coordinator_refuses_a_state_folder_it_cannot_make(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StateDirUnwritable, match="DFCA_CHECKPOINT_DIR: cannot write the state folder"):
        Coordinator(InMemoryTransport(InMemoryBroker()), "dep", state_dir=tmp_path / "file" / "_topology")


def test_a_writable_state_folder_keeps_experiments_across_a_restart(tmp_path: Path) -> None:
    from dfca.config import parse_config

    broker = InMemoryBroker()
    ensure_broker_topology(InMemoryTransport(broker))
    state = tmp_path / "state" / "_topology"
    first = Coordinator(InMemoryTransport(broker), "dep", workers=1, state_dir=state)
    record = first.create(parse_config({"name": "kept", "algorithm": "dfca", "clusters": 2, "rounds": 2,
                                        "runtime": {"workers": 1}}))
    again = Coordinator(InMemoryTransport(broker), "dep", workers=1, state_dir=state)
    assert again.get(record.id).config.name == "kept"


def test_require_writable_makes_the_folder_and_sqlite_folder_reads_urls(tmp_path: Path) -> None:
    assert require_writable(tmp_path / "a" / "b", "X").is_dir()
    assert sqlite_folder("sqlite:////var/lib/dfca/metrics/metrics.db") == Path("/var/lib/dfca/metrics")
    assert sqlite_folder("sqlite:///:memory:") is None and sqlite_folder("postgresql://h/db") is None


def test_a_cuda_worker_without_a_gpu_refuses_to_start_naming_the_likely_cause(tmp_path: Path) -> None:
    """DFCA_DEVICE=cuda on a machine whose torch sees no GPU (this one): the worker exits at start, before the
    broker, saying why (here: a CPU build of torch, or no /dev/nvidia*)."""
    import torch

    if torch.cuda.is_available():  # a GPU machine: hide its GPUs from this process's torch
        pytest.fail("run this test with CUDA_VISIBLE_DEVICES='' on a machine with a GPU")
    code, message = run_as_image_user(service_main("services.worker.main", {
        "DFCA_DEVICE": "cuda", "DFCA_CHECKPOINT_DIR": str(tmp_path)}))
    assert code != 0, message
    assert message.startswith("dfca worker: DFCA_DEVICE: cuda, but this machine has no CUDA device"), message
    assert "CPU build" in message or "/dev/nvidia" in message or "libcuda" in message or "driver" in message
