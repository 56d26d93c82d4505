"""scripts/test.sh on machines it must not break: as a user with sudo (apt-get through sudo), as a user without
(a clear error), and without an NVIDIA GPU (torch from the CPU index, never the CUDA build); a torch already
installed is kept. Run against stand-ins for python, pip, sudo and apt-get that record what they were asked."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_script(tmp_path: Path, uid: int = 1000, sudo: bool = True, gpu: bool = False,
               torch: bool = False) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    for name in ("install_rabbitmq.sh", "start_rabbitmq.sh"):  # the broker is not what this test is about
        (repo / "scripts" / name).write_text("echo \"$0\" >> \"$CALLS\"\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for real in ("dirname", "env", "bash"):
        (bin_ / real).symlink_to(shutil.which(real) or f"/usr/bin/{real}")
    calls = tmp_path / "calls"
    tool(bin_, "python3", f'echo "python3 $*" >> "$CALLS"\nif [ "$1" = -c ]; then\n'
                          f'  case "$2" in *"import torch"*) exit {0 if torch else 1};; esac\n  exit 1\nfi\nexit 0')
    tool(bin_, "id", f'echo {uid}')
    tool(bin_, "timeout", 'echo "timeout $*" >> "$CALLS"')
    tool(bin_, "apt-get", 'echo "apt-get $*" >> "$CALLS"')
    if sudo:
        tool(bin_, "sudo", 'echo "sudo $*" >> "$CALLS"')
    if gpu:
        tool(bin_, "nvidia-smi", "exit 0")
    env = {"PATH": str(bin_), "CALLS": str(calls), "HOME": str(tmp_path)}
    result = subprocess.run([str(bin_ / "bash"), str(repo / "scripts" / "test.sh")], env=env, capture_output=True,
                            text=True, timeout=60)
    return result, calls.read_text().splitlines() if calls.exists() else []


def torch_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if "pip install" in c and "torch==" in c]


def test_a_user_with_sudo_on_a_cpu_machine_gets_apt_through_sudo_and_torch_from_the_cpu_index(
        tmp_path: Path) -> None:
    result, calls = run_script(tmp_path)
    assert result.returncode == 0, result.stderr
    installs = torch_installs(calls)
    assert installs and all(f"--index-url {CPU_INDEX}" in c for c in installs), installs
    project = [c for c in calls if "pip install" in c and "-e .[test]" in c]
    assert project and f"--extra-index-url {CPU_INDEX}" in project[0]
    assert any(c.startswith("sudo ") and "apt-get install" in c and "chromium" in c for c in calls), calls
    assert not any(c.startswith(("apt-get", "timeout")) for c in calls)  # never without sudo as a user
    assert calls[-2:] == ["python3 -m ruff check shared services tests benchmarks scripts examples",
                          "python3 -m pytest -q -p no:cacheprovider --durations=15"]  # and on to the tests


def test_a_user_without_sudo_is_told_what_to_do(tmp_path: Path) -> None:
    result, calls = run_script(tmp_path, sudo=False)
    assert result.returncode == 1
    assert "needs root: run as root or install sudo" in result.stderr and "chromium" in result.stderr
    assert not any("apt-get" in c for c in calls)


def test_root_needs_no_sudo_a_gpu_machine_gets_the_default_build_and_an_installed_torch_stays(
        tmp_path: Path) -> None:
    root, calls = run_script(tmp_path / "root", uid=0, sudo=False)
    assert root.returncode == 0 and any(c.startswith("timeout 900 apt-get install") for c in calls), calls
    gpu, calls = run_script(tmp_path / "gpu", gpu=True)
    assert gpu.returncode == 0 and torch_installs(calls) and not any(CPU_INDEX in c for c in torch_installs(calls))
    kept, calls = run_script(tmp_path / "kept", torch=True)
    assert kept.returncode == 0 and torch_installs(calls) == []

