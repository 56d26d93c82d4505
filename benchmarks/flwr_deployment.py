"""Flower's Deployment Engine on this machine, for benchmarks/peers_runtime.py: a SuperLink, N SuperNodes and one
`flwr run` of the FedAvg app in benchmarks/peers/flwr_deployment_app/, all from the flwr venv, offline.

    flower-superlink --insecure --disable-runtime-dependency-installation --port P   (its HTTP APIs on one port)
    flower-supernode --insecure --superlink 127.0.0.1:P --port Q --node-config "partitions='0,3,...'"  (per node)
    flwr run APP_DIR benchmark --run-config "..."                  (federation `benchmark` in $FLWR_HOME/config.toml)

Every Flower process gets OMP_NUM_THREADS=MKL_NUM_THREADS=1 (the ClientApp and ServerApp also set one torch thread),
a private FLWR_HOME, and PYTHONPATH=benchmarks/peers (peer_common). `fast_polls`:
benchmarks/peers/flwr_fast_polls/sitecustomize.py (on PYTHONPATH, so in every Flower process; its docstring lists
what it shortens) sets Flower's 3-s polls to POLL_S, and FLWR_SUPEREXEC_TASK_POLL_INTERVAL SuperExec's poll if
SUPEREXEC_POLL_S is set; the venv itself is not modified.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from process_tree_trace import TreeTrace

HERE = Path(__file__).resolve().parent
APP = HERE / "peers" / "flwr_deployment_app"
FAST_POLLS = HERE / "peers" / "flwr_fast_polls"
POLL_S = 0.01
# SuperExec's task poll in the fast runs: stock (1 s); `--superexec-poll` sets FLWR_SUPEREXEC_TASK_POLL_INTERVAL.
# At load 20-80 on 2 cores, with this poll at 0.01 s and with stock polls alike, Flower's runtime API refused
# ClientApps' task tokens (401) and no run finished: flwr 1.42 puts a claimed task back to pending and drops its
# token when its process has not pulled its inputs within HEARTBEAT_DEFAULT_INTERVAL (30 s) of the claim
# (CoreState.claim_task / activate_task), and a ClientApp starting on an overloaded machine can take longer.
SUPEREXEC_POLL_S: float | None = None


@dataclass
class Deployment:
    venv: Path
    home: Path
    nodes: list[list[int]]  # the clients each SuperNode hosts
    fast_polls: bool
    ports: dict[str, int]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "PYTHON"))}
        paths = [str(HERE / "peers"), *([str(FAST_POLLS)] if self.fast_polls else [])]
        env.update(FLWR_HOME=str(self.home), PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1",
                   PATH=os.pathsep.join([str(self.venv / "bin"), env.get("PATH", "")]),
                   MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if self.fast_polls:
            env["DFCA_FLWR_POLL_S"] = str(POLL_S)
            if SUPEREXEC_POLL_S is not None:
                env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(SUPEREXEC_POLL_S)
        return env

    def spawn(self, name: str, command: list[str]) -> None:
        log = (self.home / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen(command, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, cwd=self.home, start_new_session=True)
        log.close()

    def start(self) -> None:
        p = self.ports
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "benchmark"\n\n[superlink.benchmark]\n'
            f'address = "127.0.0.1:{p["superlink"]}"\ninsecure = true\n')
        self.spawn("superlink", [self.bin("flower-superlink"), "--insecure",
                                 "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
                                 "--port", str(p["superlink"])])
        for i, clients in enumerate(self.nodes):
            self.spawn(f"supernode-{i}", [
                self.bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{p['superlink']}",
                "--host", "127.0.0.1", "--port", str(p["supernodes"] + i),
                "--node-config", f"partitions='{','.join(map(str, clients))}'"])

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until every SuperNode has connected to the SuperLink (its log names its node ID)."""
        deadline = time.monotonic() + timeout
        waiting = [f"supernode-{i}" for i in range(len(self.nodes))]
        while waiting := [n for n in waiting if "SuperNode ID" not in (self.home / f"{n}.log").read_text(
                errors="replace")]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(waiting)} SuperNodes did not connect\n{self.log_tails()}")
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited ({process.returncode})\n{self.log_tails()}")
            time.sleep(0.2)

    def groups(self) -> dict[str, list[int]]:
        return {"superlink": [self.processes["superlink"].pid],
                "supernodes": [p.pid for name, p in self.processes.items() if name.startswith("supernode")]}

    def run_app(self, data: Path, rounds: int, result: Path, timeout: float) -> dict[str, Any]:
        """`flwr run` the app and wait for the ServerApp's result file."""
        config = f'data="{data}" result="{result}" rounds={rounds} nodes={len(self.nodes)}'
        done = subprocess.run([self.bin("flwr"), "run", str(APP), "benchmark", "--run-config", config],
                              env=self.env(), cwd=self.home, capture_output=True, text=True, timeout=120,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"flwr run failed:\n{done.stdout}\n{done.stderr}\n{self.log_tails()}")
        deadline = time.monotonic() + timeout
        while not result.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Flower's run did not finish in {timeout:.0f} s\n{self.log_tails()}")
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited ({process.returncode})\n{self.log_tails()}")
            time.sleep(0.2)
        time.sleep(0.2)  # the file is written in one call; let it close
        return dict(json.loads(result.read_text()))

    def log_tails(self, lines: int = 20) -> str:
        out = []
        for path in sorted(self.home.glob("*.log")):
            out.append(f"--- {path.name}")
            out.extend(path.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(out)

    def stop(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


@contextlib.contextmanager
def running(venv: Path, home: Path, nodes: list[list[int]], fast_polls: bool, ports: dict[str, int]
            ) -> Iterator[Deployment]:
    deployment = Deployment(venv, home, nodes, fast_polls, ports)
    deployment.start()
    try:
        deployment.wait_ready()
        yield deployment
    finally:
        deployment.stop()


def measured_run(deployment: Deployment, data: Path, rounds: int, timeout: float) -> tuple[dict[str, Any], TreeTrace]:
    """One `flwr run` with its process trees traced (CPU, RSS, bytes on the SuperLink's port: its Fleet, ServerApp
    and Control APIs) from before the run is submitted to after its result is written."""
    trace = TreeTrace(deployment.groups(), {deployment.ports["superlink"]}).start()
    try:
        result = deployment.run_app(data, rounds, deployment.home / "result.json", timeout)
    finally:
        trace.stop()
    return result, trace
