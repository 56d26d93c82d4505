"""`dfca submit|status|stop|logs|results` against the runtime: errors a user can act on and the --wait loop (a
broken events stream, --timeout) against stub services, without a broker; and a whole run on a real local stack:
submitted, followed, listed, logged, its results (models and plots) downloaded; a longer one stopped while running."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from free_ports import free_port
from runtime_fixtures import TOKEN, rotated_mnist, running_stack
from safetensors.torch import load_file
from typer.testing import CliRunner

import dfca.cli.remote_commands
import dfca.cli.runtime_client
from dfca.cli.main import app
from dfca.cli.runtime_client import Endpoints, RuntimeClient
from dfca.runtime.control.coordinator import Coordinator
from dfca.transport import InMemoryBroker, InMemoryTransport
from services.topology.main import create_app

runner = CliRunner()


@pytest.fixture()
def topology_only() -> Iterator[str]:
    """A topology service (in-memory broker) on a free port, and no metrics service."""
    coordinator = Coordinator(InMemoryTransport(InMemoryBroker()), "dtest", workers=3)
    coordinator.open()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(coordinator, TOKEN, "memory://"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def write_config(tmp_path: Path, **overrides: Any) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(rotated_mnist(**overrides)))
    return path


def test_an_unreachable_service_names_its_url_and_how_to_start_it(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["submit", str(write_config(tmp_path)), "--topology", url, "--token", "x"])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert url in text and "dfca up" in text


def test_a_missing_token_and_a_bad_config_say_what_to_fix(tmp_path: Path, topology_only: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFCA_API_TOKEN", raising=False)
    cfg = write_config(tmp_path)
    no_token = runner.invoke(app, ["submit", str(cfg), "--topology", topology_only])
    assert no_token.exit_code == 1 and "DFCA_API_TOKEN" in no_token.output
    bad = runner.invoke(app, ["submit", str(cfg), "--topology", topology_only, "--token", TOKEN,
                              "--set", "train.lr=-1"])
    assert bad.exit_code == 2 and "train.lr" in bad.output  # refused by the service, naming the field
    monkeypatch.setenv("DFCA_TOPOLOGY_URL", topology_only)
    monkeypatch.setenv("DFCA_API_TOKEN", TOKEN)
    refused = runner.invoke(app, ["submit", str(cfg), "--set", "algorithm=ifca"])  # no aggregator there
    assert refused.exit_code == 1 and "aggregator" in " ".join(refused.output.split())
    created = runner.invoke(app, ["submit", str(cfg), "--no-start"])
    assert created.exit_code == 0
    experiment = created.output.split()[-1]
    unknown = runner.invoke(app, ["stop", "nope"])
    assert unknown.exit_code == 1 and "unknown experiment 'nope'" in unknown.output
    stopped = runner.invoke(app, ["stop", experiment])
    assert stopped.exit_code == 0 and "stopped" in stopped.output


class StubRuntime:
    """Both services as an `httpx.MockTransport`: creates one experiment `e1`, whose events streams are scripted
    per connection (a list of SSE lines, or an exception to raise after them: the stream breaks)."""

    def __init__(self, streams: list[tuple[list[str], Exception | None]], status: str = "running") -> None:
        self.streams = streams
        self.status = status
        self.posted: list[dict[str, Any]] = []
        self.connections = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/experiments":
            self.posted.append(json.loads(request.content))
            return httpx.Response(201, json={"id": "e1", "status": "created"})
        if path == "/experiments/e1:start":
            return httpx.Response(200, json={"id": "e1", "status": "running", "workers": 3})
        if path == "/experiments/e1":
            return httpx.Response(200, json={"id": "e1", "status": self.status, "rounds": 4})
        if path == "/experiments/e1/summary":
            return httpx.Response(200, json={"status": self.status, "test_accuracy": 0.875, "cluster_ari": 1.0})
        if path == "/experiments/e1/events":
            lines, error = self.streams[min(self.connections, len(self.streams) - 1)]
            self.connections += 1
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse_body(lines, error))
        return httpx.Response(404, json={"detail": f"no such path {path}"})


def sse_body(lines: list[str], error: Exception | None) -> Iterator[bytes]:
    for line in lines:
        if line == "<sleep>":
            time.sleep(0.05)
            continue
        yield (line + "\n").encode()
    if error is not None:
        raise error


def event(name: str, data: dict[str, Any]) -> list[str]:
    return [f"event: {name}", f"data: {json.dumps(data)}", ""]


@pytest.fixture()
def stub_client(monkeypatch: pytest.MonkeyPatch) -> Callable[[httpx.MockTransport], None]:
    """Route the commands' REST calls to a mock transport."""

    def use(transport: httpx.MockTransport) -> None:
        monkeypatch.setattr(dfca.cli.remote_commands, "client_for", lambda topology, metrics, token: RuntimeClient(
            Endpoints.resolve(topology, metrics, token or "t"), transport=transport))

    return use


def test_set_overrides_reach_the_posted_config(tmp_path: Path, stub_client: Callable[..., None]) -> None:
    stub = StubRuntime([])
    stub_client(httpx.MockTransport(stub.handle))
    result = runner.invoke(app, ["submit", str(write_config(tmp_path)), "--no-start", "--set", "train.lr=0.05",
                                 "--set", "data.rotations=[0, 90]", "--set", "name=over"])
    assert result.exit_code == 0, result.output
    assert result.output.split()[-1] == "e1"
    posted = stub.posted[0]
    assert posted["train"]["lr"] == 0.05 and posted["data"]["rotations"] == [0, 90] and posted["name"] == "over"
    assert posted["train"]["batch_size"] == 20  # the rest of the file is kept
    malformed = runner.invoke(app, ["submit", str(write_config(tmp_path)), "--set", "train.lr"])
    assert malformed.exit_code == 2 and "key=value" in malformed.output and len(stub.posted) == 1


def test_field_errors_of_a_refused_config_are_printed(tmp_path: Path, stub_client: Callable[..., None]) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"detail": [
            {"loc": ["body", "data", "clients"], "msg": "Input should be greater than 0", "type": "greater_than"}]})

    stub_client(httpx.MockTransport(refuse))
    result = runner.invoke(app, ["submit", str(write_config(tmp_path))])
    assert result.exit_code == 2  # a bad config, as a bad command line: the service named the field
    assert "config was refused: data.clients: Input should be greater than 0" in " ".join(result.output.split())


def test_wait_reconnects_after_a_broken_stream_and_exits_by_status(tmp_path: Path,
                                                                   stub_client: Callable[..., None]) -> None:
    broken = (event("progress", {"round": 1, "worker": 0, "seconds": 0.1, "status": "running"}),
              httpx.ReadError("connection reset"))
    ending = [*event("progress", {"round": 4, "worker": 0, "seconds": 0.1, "status": "running"}),
              *event("status", {"status": "completed", "failed_clients": []}),
              *event("summary", {"status": "completed", "test_accuracy": 0.875, "cluster_ari": 1.0})]
    stub = StubRuntime([broken, (ending, None)])
    stub_client(httpx.MockTransport(stub.handle))
    completed = runner.invoke(app, ["submit", str(write_config(tmp_path)), "--wait"])
    assert completed.exit_code == 0, completed.output
    assert stub.connections == 2 and "test_accuracy" in completed.output and "0.8750" in completed.output

    stopped_lines = [line.replace("completed", "stopped") for line in ending]
    stub = StubRuntime([(stopped_lines, None)], status="stopped")
    stub_client(httpx.MockTransport(stub.handle))
    stopped = runner.invoke(app, ["submit", str(write_config(tmp_path)), "--wait"])
    assert stopped.exit_code == 1 and "e1: stopped" in stopped.output


def test_wait_gives_up_after_timeout_and_says_the_run_goes_on(tmp_path: Path,
                                                              stub_client: Callable[..., None]) -> None:
    quiet = (event("progress", {"round": 1, "worker": 0, "seconds": 0.1, "status": "running"})
             + ["<sleep>", ": keepalive", ""] * 400, None)  # about 20 s of keepalives
    stub = StubRuntime([quiet], status="completed")  # were --timeout ignored, the test would end after ~20 s
    stub_client(httpx.MockTransport(stub.handle))
    began = time.monotonic()
    result = runner.invoke(app, ["submit", str(write_config(tmp_path)), "--wait", "--timeout", "0.5"])
    assert result.exit_code == 124 and "e1 keeps running" in " ".join(result.output.split())
    assert time.monotonic() - began < 5


def test_logs_gives_up_on_an_unreachable_metrics_service(stub_client: Callable[..., None],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    stub = StubRuntime([])

    def metrics_down(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            stub.connections += 1
            raise httpx.ConnectError("connection refused", request=request)
        return stub.handle(request)

    monkeypatch.setattr(dfca.cli.runtime_client, "METRICS_DOWN_LIMIT_S", 0.5)
    stub_client(httpx.MockTransport(metrics_down))
    result = runner.invoke(app, ["logs", "e1", "--metrics", "http://127.0.0.1:9"])
    assert result.exit_code == 1 and stub.connections >= 2  # retried before giving up
    text = " ".join(result.output.split())
    assert "cannot reach the metrics service at http://127.0.0.1:9" in text and "dfca up" in text


@pytest.mark.rabbitmq
def test_submit_wait_status_logs_and_results_on_a_real_stack(rabbitmq_url: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with running_stack(tmp_path / "state", rabbitmq_url) as stack:
        monkeypatch.setenv("DFCA_TOPOLOGY_URL", stack.options.topology_url)
        monkeypatch.setenv("DFCA_METRICS_URL", stack.options.metrics_url)
        monkeypatch.setenv("DFCA_API_TOKEN", TOKEN)
        cfg = write_config(tmp_path, name="cli", rounds=6, dfca={"variant": "paper"})  # one exchange a round
        submitted = runner.invoke(app, ["submit", str(cfg), "--wait", "--set", "runtime.workers=3"])
        assert submitted.exit_code == 0, submitted.output
        experiment = re.search(r"^(cli-[0-9a-f]+)$", submitted.output, re.MULTILINE).group(1)  # stdout: the id
        assert "test_accuracy" in submitted.output

        listed = runner.invoke(app, ["status"])
        assert listed.exit_code == 0 and experiment in listed.output and "completed" in listed.output
        assert "3 of 3 workers known (0, 1, 2), no aggregator" in " ".join(listed.output.split())
        one = json.loads(runner.invoke(app, ["status", experiment, "--json"]).output)
        assert one["experiment"]["status"] == "completed" and one["summary"]["test_accuracy"] > 0.6
        logged = runner.invoke(app, ["logs", experiment, "--no-follow"])
        assert logged.exit_code == 0 and "accuracy" in logged.output and "status: completed" in logged.output
        assert "round 6 of 6:" in logged.output  # every round, counted as the product counts them
        assert runner.invoke(app, ["logs", experiment]).output == logged.output  # a finished run: its whole history

        out = tmp_path / "results"
        fetched = runner.invoke(app, ["results", experiment, "--out", str(out)])
        assert fetched.exit_code == 0, fetched.output
        for name in ("summary.json", "config.json", "metrics.jsonl", "accuracy.png", "ari.png", "clusters.png",
                     "models/cluster_0.safetensors", "models/cluster_1.safetensors", "models/assignments.json"):
            assert (out / name).is_file(), name
        assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
        summary = json.loads((out / "summary.json").read_text())
        assignments = json.loads((out / "models" / "assignments.json").read_text())["assigned"]
        assert len(assignments) == 24 and summary["cluster_ari"] == pytest.approx(1.0)
        check_models_classify(out / "models", assignments, summary["test_accuracy"])
        again = runner.invoke(app, ["results", experiment, "--out", str(out)])
        assert again.exit_code == 1 and "--force" in " ".join(again.output.split())

        long = runner.invoke(app, ["submit", str(cfg), "--wait", "--timeout", "3", "--set", "rounds=500",
                                   "--set", "name=long"])
        assert long.exit_code == 124, long.output  # gave up waiting; the run goes on
        running = re.search(r"^(long-[0-9a-f]+)$", long.output, re.MULTILINE).group(1)
        assert json.loads(runner.invoke(app, ["status", running, "--json"]).output)["experiment"]["status"] == "running"
        stopped = runner.invoke(app, ["stop", running])
        assert stopped.exit_code == 0 and "stopped" in stopped.output
        followed = runner.invoke(app, ["logs", running])  # follows until the run ends: at once, it was stopped
        assert followed.exit_code == 0 and "status: stopped" in followed.output, followed.output
        record = json.loads(runner.invoke(app, ["status", running, "--json"]).output)["experiment"]
        assert record["status"] == "stopped" and record["round"] < 500


def check_models_classify(folder: Path, assignments: list[int], accuracy: float) -> None:
    """Each downloaded cluster model classifies the test images of the clients assigned to it about as well as the
    run's clients did (the cluster mean of models that agreed by consensus)."""
    from dfca.config import ExperimentConfig
    from dfca.data import build_federated_data
    from dfca.models.build import build_model

    cfg = ExperimentConfig.model_validate(rotated_mnist(name="cli", rounds=6, dfca={"variant": "paper"}))
    data = build_federated_data(cfg)
    model = build_model(cfg.model.kind, data.input_shape, cfg.model.hidden, data.num_classes, "cpu")
    correct = total = 0
    for j in set(assignments):
        params = {n: t.unsqueeze(0) for n, t in load_file(str(folder / f"cluster_{j}.safetensors")).items()}
        assert {n: tuple(t.shape[1:]) for n, t in params.items()} == dict(model.shapes())
        for c in (c for c, a in enumerate(assignments) if a == j):
            logits = model.logits(params, data.x_test[c].unsqueeze(0))
            correct += int((logits.argmax(-1) == data.y_test[c]).sum())
            total += data.y_test[c].numel()
    assert correct / total > accuracy - 0.05
