"""The `dfca` command without friction: `dfca up` logs to files and prints one status block, writes the state file
the other commands find it by, and `dfca down` stops it; `dfca status` fits 80 columns and prints JSON only with
--json; `dfca logs` prints a finished run's whole history with the product's round numbering; the commands that only
talk to a stack never import torch; a stop racing the run's end leaves it `completed`."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import networkx as nx
import pytest
from free_ports import free_port, free_port_block
from rabbitmq_node import RabbitMQNode
from runtime_fixtures import rotated_mnist
from typer.testing import CliRunner

import dfca.cli.remote_commands
import dfca.cli.runtime_client
from dfca.cli import stack_state
from dfca.cli.main import app
from dfca.cli.remote_commands import RecordSchedule, record_schedule
from dfca.cli.runtime_client import Endpoints, RuntimeClient
from dfca.runtime.protocol.messages import WorkerEvent

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- the state file -----------------------------------------------------------------------------------------------
def test_the_commands_find_a_running_stack_by_its_state_file_and_name_a_stale_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DFCA_TOPOLOGY_URL", "DFCA_METRICS_URL", "DFCA_API_TOKEN", "DFCA_READ_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    token_file = tmp_path / "tok"
    token_file.write_text("secret\n")
    stack_state.write(tmp_path / ".dfca", {"pid": os.getpid(), "topology_url": "http://127.0.0.1:9301",
                                            "metrics_url": "http://127.0.0.1:9302", "token_file": str(token_file)})
    assert (tmp_path / "home" / ".dfca" / "stack.json").exists()  # the copy other folders find
    found = Endpoints.resolve(None, None, None)
    assert (found.topology, found.metrics, found.token) == ("http://127.0.0.1:9301", "http://127.0.0.1:9302", "secret")
    assert ".dfca/stack.json" in found.source
    monkeypatch.setenv("DFCA_TOPOLOGY_URL", "http://127.0.0.1:9401")  # the environment beats the file ...
    assert Endpoints.resolve(None, None, None).topology == "http://127.0.0.1:9401"
    assert Endpoints.resolve("http://127.0.0.1:9501", None, "t").topology == "http://127.0.0.1:9501"  # ... options it
    monkeypatch.delenv("DFCA_TOPOLOGY_URL")

    free = f"http://127.0.0.1:{free_port()}"  # the default, where no one answers (8080 may be someone's stack)
    monkeypatch.setattr(dfca.cli.runtime_client, "DEFAULT_TOPOLOGY_URL", free)
    monkeypatch.setattr(dfca.cli.runtime_client, "DEFAULT_METRICS_URL", free)
    gone = dead_pid()  # a stack killed without cleaning up: its file must not send the commands to its ports
    for path in stack_state.candidates():
        path.write_text(json.dumps({"pid": gone, "topology_url": f"http://127.0.0.1:{free_port()}",
                                    "metrics_url": "http://127.0.0.1:9"}))
    stale = Endpoints.resolve(None, None, None)
    assert stale.topology == free and f"pid {gone}" in stale.source
    result = runner.invoke(app, ["status"], env={"COLUMNS": "200"})
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and ".dfca/stack.json was not used" in text and "is gone" in text
    down = runner.invoke(app, ["down"])
    assert down.exit_code == 1 and "no running stack" in down.output
    assert not any(p.exists() for p in stack_state.candidates())  # `dfca down` cleared the stale files


def test_a_file_from_a_live_stack_is_named_when_its_service_does_not_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DFCA_TOPOLOGY_URL", "DFCA_METRICS_URL", "DFCA_API_TOKEN", "DFCA_READ_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    url = f"http://127.0.0.1:{free_port()}"
    stack_state.write(tmp_path / ".dfca", {"pid": os.getpid(), "topology_url": url, "metrics_url": url},
                      also_home=False)
    result = runner.invoke(app, ["stop", "e1"], env={"COLUMNS": "300"})
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and url in text and "read from .dfca/stack.json" in text


# -- status, logs -------------------------------------------------------------------------------------------------
def stub(status: str = "completed", seeding: int = 2, rounds: int = 3) -> httpx.MockTransport:
    records = [{"id": f"run-{i:02d}-0123456789abcdef", "name": "a rather long experiment name " * 2,
                "algorithm": "fedcref-personalised", "status": status, "round": seeding + rounds,
                "rounds": seeding + rounds, "clients": 24, "workers": 3, "failed_clients": [],
                "started_at": 1.0e9, "finished_at": 1.0e9 + 60,
                "worker_states": {"0": {"state": "finished", "round": 5, "device": "cuda:0 (NVIDIA H100 80GB HBM3)",
                                        "seconds_since_seen": 3.2, "incarnations": 1}},
                "config": {"rounds": rounds}} for i in range(3)]
    history = [{"round": t, "workers_reported": 3, "seconds": 0.5,
                **({"test_accuracy": 0.9, "ari": 1.0} if t > seeding else {})} for t in range(1, seeding + rounds + 1)]

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/experiments":
            return httpx.Response(200, json=records)
        if path == "/deployment":
            return httpx.Response(200, json={"deployment": "d1", "workers": 3, "workers_present": [0, 1, 2]})
        if path.endswith("/summary"):
            return httpx.Response(200, json={"status": status, "test_accuracy": 0.91234, "cluster_ari": 1.0,
                                             "rounds_completed": seeding + rounds})
        if path.endswith("/metrics"):
            return httpx.Response(200, json={"history": history, "status": status, "worker_events": [
                {"worker": 0, "state": "finished", "round": seeding + rounds}]})
        if path.endswith("/events"):
            raise AssertionError("a finished run's history is read, not followed")
        if path.startswith("/experiments/"):
            return httpx.Response(200, json=records[0])
        return httpx.Response(404, json={"detail": "no"})

    return httpx.MockTransport(handle)


@pytest.fixture()
def use_stub(monkeypatch: pytest.MonkeyPatch) -> Any:
    def use(transport: httpx.MockTransport) -> None:
        monkeypatch.setattr(dfca.cli.remote_commands, "client_for", lambda topology, metrics, token: RuntimeClient(
            Endpoints("http://t", "http://m", "x"), transport=transport))

    return use


def test_status_fits_80_columns_and_prints_json_only_when_asked(use_stub: Any) -> None:
    use_stub(stub())
    listed = runner.invoke(app, ["status"], env={"COLUMNS": "80"})
    assert listed.exit_code == 0, listed.output
    print(listed.output)
    lines = listed.output.splitlines()
    assert all(len(line) <= 80 for line in lines)
    rows = [line for line in lines if "run-0" in line]
    assert len(rows) == 3 and all("completed" in row and "3/3" in row and "0.912" in row
                                  and row.rstrip().endswith("1.000") for row in rows)
    assert "run-00-0123456789abcdef" in rows[0]  # the id is never cut: users copy it
    assert not any("comple" in line and "completed" not in line for line in lines)
    one = runner.invoke(app, ["status", "run-00-0123456789abcdef"], env={"COLUMNS": "80"})
    assert one.exit_code == 0 and not one.output.lstrip().startswith("{"), one.output
    print(one.output)
    assert all(len(line) <= 80 for line in one.output.splitlines())
    assert "test_accuracy" in one.output and "cuda:0" in one.output and "completed" in one.output
    as_json = runner.invoke(app, ["status", "run-00-0123456789abcdef", "--json"])
    assert json.loads(as_json.output)["experiment"]["status"] == "completed"
    every = json.loads(runner.invoke(app, ["status", "--json"]).output)
    assert len(every["experiments"]) == 3 and every["deployment"]["deployment"] == "d1"


def test_logs_of_a_finished_run_prints_its_whole_history_counted_as_the_product_counts(use_stub: Any) -> None:
    use_stub(stub(seeding=2, rounds=3))
    result = runner.invoke(app, ["logs", "run-00-0123456789abcdef"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    labels = [line.split(":")[0] for line in lines if line.startswith(("seeding", "round"))]
    assert labels == ["seeding 1 of 2", "seeding 2 of 2", "round 1 of 3", "round 2 of 3", "round 3 of 3"]
    assert "worker 0: finished at round 3 of 3" in lines and "status: completed" in lines
    assert any(line.startswith("summary: accuracy 0.9123") for line in lines)


def test_the_record_schedule_numbers_rounds_as_schedule_of() -> None:
    from dfca.algorithms import schedule_of
    from dfca.config import ExperimentConfig

    cfg = ExperimentConfig.model_validate({**rotated_mnist(), "algorithm": "dfca", "rounds": 4})
    real = schedule_of(cfg)
    assert real.seeding_rounds > 0  # DFCA seeds first: the case worth checking
    ours = record_schedule({"rounds": real.total_rounds, "config": {"rounds": cfg.rounds}})
    assert isinstance(ours, RecordSchedule)
    assert [ours.label(t) for t in range(real.total_rounds)] == [real.label(t) for t in range(real.total_rounds)]


# -- no torch -----------------------------------------------------------------------------------------------------
NO_TORCH = """
import runpy, sys
sys.argv = ["dfca", *sys.argv[1:]]
try:
    runpy.run_module("dfca.cli", run_name="__main__")
except SystemExit:
    pass
loaded = sorted(m for m in ("torch", "numpy", "dfca.config", "dfca.algorithms") if m in sys.modules)
print("LOADED", loaded)
"""


@pytest.mark.parametrize("args", [
    ["--help"], ["--version"], ["status", "--help"], ["logs", "--help"], ["stop", "--help"], ["submit", "--help"],
    ["results", "--help"], ["down", "--help"], ["up", "--help"], ["status"], ["logs", "e1"], ["stop", "e1"],
    ["results", "e1", "--out", "OUT"], ["down"], ["submit", "CFG", "--set", "rounds=3"], ["data", "--help"],
    ["data", "inspect", "--help"], ["data", "export", "--help"],
])
def test_commands_that_talk_to_a_stack_never_import_torch(args: list[str], tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody answers: the commands fail after their imports
    env = {**os.environ, "HOME": str(tmp_path), "DFCA_TOPOLOGY_URL": url, "DFCA_METRICS_URL": url,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "cfg.yaml").write_text("algorithm: dfca\nrounds: 2\n")
    args = [str(tmp_path / "out") if a == "OUT" else str(tmp_path / "cfg.yaml") if a == "CFG" else a for a in args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"dfca {' '.join(args)}: {cpu:.2f} s of CPU")  # not asserted: the machine may be busy
    assert "LOADED []" in result.stdout, result.stdout + result.stderr
    if args == ["--version"]:
        assert re.match(r"dfca \S+ .*\(torch \S+, python", result.stdout), result.stdout


# -- a stop racing the end ----------------------------------------------------------------------------------------
def worker_event(w: int, state: str, round_: int, at: float) -> WorkerEvent:
    return WorkerEvent(deployment="d", experiment="e", worker=w, incarnation=f"i{w}", state=state,  # type: ignore[arg-type]
                       round=round_, at=at)


def started_record() -> Any:
    from dfca.config import ExperimentConfig
    from dfca.runtime.control.experiments import ExperimentRecord

    cfg = ExperimentConfig.model_validate({**rotated_mnist(), "data": {**rotated_mnist()["data"], "clients": 9}})
    record = ExperimentRecord.new("e", cfg, nx.complete_graph(9), workers=3)
    record.start(now=0.0)
    record.go = True
    return record


def test_a_stop_after_the_last_round_leaves_the_run_completed() -> None:
    from dfca.algorithms import schedule_of

    record = started_record()
    last = schedule_of(record.config).total_rounds
    for w in (0, 1, 2):
        record.observe(worker_event(w, "finished", last, 10.0), now=10.0)
    record.status, record.stop_requested_at = "stopping", 11.0  # the stop arrived before the settle
    assert record.settle(now=11.0) == "completed"

    racing = started_record()  # the stop reached the workers after their last round: they say `stopped` there
    racing.observe(worker_event(0, "finished", last, 10.0), now=10.0)
    racing.status, racing.stop_requested_at = "stopping", 10.5
    for w in (1, 2):
        racing.observe(worker_event(w, "stopped", last, 11.0), now=11.0)
    assert racing.settle(now=11.0) == "completed"

    early = started_record()  # a stop in the middle of the run stops it
    early.status, early.stop_requested_at = "stopping", 5.0
    early.observe(worker_event(0, "finished", last, 10.0), now=10.0)
    for w in (1, 2):
        early.observe(worker_event(w, "stopped", last - 1, 11.0), now=11.0)
    assert early.settle(now=11.0) == "stopped"
    waiting = started_record()  # one worker still on its last round: nothing is settled yet
    waiting.status, waiting.stop_requested_at = "stopping", 5.0
    waiting.observe(worker_event(0, "stopped", last, 6.0), now=6.0)
    assert waiting.settle(now=6.0) is None


# -- dfca up and dfca down ----------------------------------------------------------------------------------------
def test_dfca_up_logs_to_files_prints_where_everything_is_and_dfca_down_stops_it(
        private_rabbitmq: RabbitMQNode, tmp_path: Path) -> None:
    """`dfca up` with no broker-user or token option: it creates one broker user per principal (the broker lists
    them), makes both tokens, and a read without a token gets 401; the dfca commands find the stack and its token."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFCA_")}
    env.update({"HOME": str(home), "DFCA_BROKER_URL": f"amqp://127.0.0.1:{private_rabbitmq.port}/dfca",
                "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT), os.environ.get("PYTHONPATH", "")])})
    topology_port, metrics_port = free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "dfca.cli", "up", "--workers", "2", "--topology-port", str(topology_port),
         "--metrics-port", str(metrics_port), "--worker-port-base", str(free_port_block(2)),
         "--rabbitmqctl", private_rabbitmq.ctl_command()],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert up.stdout is not None
    printed: list[str] = []
    reader = threading.Thread(target=printed.extend, args=(iter(up.stdout.readline, ""),), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any(line.startswith("dfca up: ready:") for line in list(printed)):
            assert up.poll() is None and time.monotonic() < deadline, f"dfca up did not come up: {printed}"
            time.sleep(0.2)
        time.sleep(0.5)  # the status block follows the ready line
        output = "".join(printed)
        token = (tmp_path / ".dfca" / "api-token").read_text().strip()
        read_token = (tmp_path / ".dfca" / "read-token").read_text().strip()
        assert f"dashboard  http://127.0.0.1:{metrics_port}/ui#token={token}" in output
        assert f"logs       {(tmp_path / '.dfca' / 'logs').resolve()}" in output
        assert f"API token {token}" in output and f"read token {read_token}" in output and "dfca down" in output
        assert "one per principal (5 users)" in output
        listed = private_rabbitmq.ctl("list_users", "--formatter", "json", timeout=240)
        users = {u["user"] for u in json.loads(listed.stdout)}
        assert {u for u in users if u.startswith("dfca-")} == {
            "dfca-topology", "dfca-metrics", "dfca-aggregator", "dfca-worker-0", "dfca-worker-1"}, users
        for url in (f"http://127.0.0.1:{topology_port}", f"http://127.0.0.1:{metrics_port}"):
            assert httpx.get(f"{url}/experiments", timeout=10).status_code == 401
            assert httpx.get(f"{url}/experiments", timeout=10, headers={
                "Authorization": f"Bearer {read_token}"}).status_code == 200
        logs = "".join(p.read_text() for p in (tmp_path / ".dfca" / "logs").glob("*.log"))
        assert "shared user" not in logs  # every process is its own principal: no service warns
        assert not any(line.lstrip().startswith("{") for line in printed)  # no JSON log lines in the terminal
        assert (tmp_path / ".dfca" / "logs" / "topology.log").stat().st_size > 0
        state = stack_state.read(tmp_path / ".dfca" / "stack.json")
        assert state is not None and state.pid == up.pid and state.topology_url.endswith(f":{topology_port}")
        assert stack_state.read(home / ".dfca" / "stack.json") == stack_state.StackState(
            home / ".dfca" / "stack.json", *[getattr(state, f) for f in ("pid", "topology_url", "metrics_url",
                                                                          "state_dir", "logs", "token_file", "pids")])
        children = list(state.pids)
        assert len(children) == 4 and all(stack_state.alive(p) for p in children)

        clean = {k: v for k, v in env.items() if not k.startswith("DFCA_")}  # no exports: the state file says
        status = subprocess.run([sys.executable, "-m", "dfca.cli", "status"], cwd=tmp_path, env=clean,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "2 of 2 workers known" in status.stderr, status.stderr
        down = subprocess.run([sys.executable, "-m", "dfca.cli", "down"], cwd=home, env=clean,  # from elsewhere
                              capture_output=True, text=True, timeout=120)
        assert down.returncode == 0 and "every process exited" in down.stderr, down.stderr
        up.wait(10)
        assert up.returncode == 0
        assert not any(stack_state.alive(p) for p in children)
        assert not (tmp_path / ".dfca" / "stack.json").exists() and not (home / ".dfca" / "stack.json").exists()
        assert not (tmp_path / ".dfca" / "api-token").exists() and not (tmp_path / ".dfca" / "read-token").exists()
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(60)
        reader.join(10)


def test_status_counts_rounds_in_their_phase() -> None:
    """`dfca status` counts a run's rounds as the progress bar, plots and logs do: seeding first, then training."""
    from dfca.cli.remote_commands import round_progress

    record = {"rounds": 18, "config": {"rounds": 10}}
    assert round_progress({**record, "round": 0}) == "0/10"
    assert round_progress({**record, "round": 5}) == "seeding 5/8"
    assert round_progress({**record, "round": 8}) == "seeding 8/8"
    assert round_progress({**record, "round": 12}) == "4/10"
    assert round_progress({**record, "round": 18}) == "10/10"
    assert round_progress({"rounds": 18, "seeding_rounds": 8, "round": 12}) == "4/10"  # the list: no config
    assert round_progress({"rounds": 18, "round": 5}) == "5/18"  # a record that says neither
