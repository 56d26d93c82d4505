"""`dfca up --data DIR ...` and `dfca worker --data DIR`: each local worker gets its own data folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dfca.cli.launcher import StackOptions, service_env


def test_each_worker_gets_its_own_folder_and_no_other_service_one(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    options = StackOptions(workers=2, state_dir=tmp_path, data_dirs=[str(a), str(b)])
    assert service_env(options, "worker", 9999, 0)["DFCA_DATA_DIR"] == str(a.resolve())
    assert service_env(options, "worker", 9999, 1)["DFCA_DATA_DIR"] == str(b.resolve())
    for service in ("topology", "metrics", "aggregator"):
        assert "DFCA_DATA_DIR" not in service_env(options, service, 9999)
    assert "DFCA_DATA_DIR" not in service_env(StackOptions(workers=2, state_dir=tmp_path), "worker", 9999, 0)


def test_dfca_up_wants_one_folder_per_worker(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dfca.cli", "up", "--workers", "2", "--data", str(tmp_path / "a"),
         "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "--data names 1 folders for 2 workers" in result.stderr


def test_dfca_up_starts_a_worker_per_folder_where_no_count_is_given(tmp_path: Path) -> None:
    """Two folders and no --workers: two workers, whatever the machine's cores (the run then stops at the
    unreachable broker, past the folder count)."""
    folders = [arg for name in "ab" for arg in ("--data", str(tmp_path / name))]
    result = subprocess.run(
        [sys.executable, "-m", "dfca.cli", "up", *folders, "--broker", "amqp://dfca:dfca@127.0.0.1:1/dfca",
         "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1 and "no RabbitMQ answers" in result.stderr
    assert "--data names" not in result.stderr


def test_dfca_up_says_when_more_workers_than_cores_take_turns(tmp_path: Path) -> None:
    cores = os.cpu_count() or 1
    result = subprocess.run(
        [sys.executable, "-m", "dfca.cli", "up", "--workers", str(cores + 1), "--broker",
         "amqp://dfca:dfca@127.0.0.1:1/dfca", "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert f"{cores + 1} workers on {cores} cores take turns" in result.stderr and f"--workers {cores}" in result.stderr
    assert result.returncode == 1  # then stopped at the unreachable broker
