"""`dfca submit|status|stop|logs|results` against the runtime: errors a user can act on, without a broker, and a
whole run on a real local stack: submitted, followed, listed, logged, its results (models and plots) downloaded."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import yaml
from runtime_fixtures import TOKEN, free_port, rotated_mnist, running_stack
from safetensors.torch import load_file
from typer.testing import CliRunner

from dfca.cli import app
from dfca.runtime.coordinator import Coordinator
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
    assert bad.exit_code == 2 and "train.lr" in bad.output  # refused locally, before any call
    monkeypatch.setenv("DFCA_TOPOLOGY_URL", topology_only)
    monkeypatch.setenv("DFCA_API_TOKEN", TOKEN)
    refused = runner.invoke(app, ["submit", str(cfg), "--set", "algorithm=ifca"])  # no aggregator there
    assert refused.exit_code == 1 and "aggregator" in " ".join(refused.output.split())
    created = runner.invoke(app, ["submit", str(cfg), "--no-start"])
    assert created.exit_code == 0
    experiment = created.output.split()[-1]
    unknown = runner.invoke(app, ["stop", "nope"])
    assert unknown.exit_code == 1 and "404" in unknown.output
    stopped = runner.invoke(app, ["stop", experiment])
    assert stopped.exit_code == 0 and "stopped" in stopped.output


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
        one = json.loads(runner.invoke(app, ["status", experiment]).output)
        assert one["experiment"]["status"] == "completed" and one["summary"]["test_accuracy"] > 0.6
        logged = runner.invoke(app, ["logs", experiment, "--no-follow"])
        assert logged.exit_code == 0 and "accuracy" in logged.output and "status: completed" in logged.output

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


def check_models_classify(folder: Path, assignments: list[int], accuracy: float) -> None:
    """Each downloaded cluster model classifies the test images of the clients assigned to it about as well as the
    run's clients did (the cluster mean of models that agreed by consensus)."""
    from dfca.config import ExperimentConfig
    from dfca.data import build_federated_data
    from dfca.models import build_model

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
