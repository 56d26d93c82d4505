"""Devices are real: `device` (and DFCA_DEVICE on a worker) place models, data and computation; a device the machine
lacks is a clear error naming the setting. Parametrised over the devices this machine has (CI: the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_driver_equivalence import (
    DEVICES,
    SCHEMA_ALGORITHMS,
    assert_rows_match,
    config_for,
    small_config,
    transport_factory,
)
from typer.testing import CliRunner

from dfca import devices
from dfca.cli.main import app
from dfca.devices import DeviceUnavailable, device_name, resolve_device, worker_device
from dfca.graph import build_graph, neighbours
from dfca.run_size import RunTooLarge, available_bytes, check_fits_memory
from dfca.runtime.protocol.messages import RoundReport, WorkerEvent
from dfca.runtime.worker.client_runner import ClientRunner, RunSpec
from dfca.simulator import prepare, simulate
from dfca.transport import InMemoryBroker, InMemoryTransport
from harness.lockstep import run_lockstep


def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cuda_without_a_gpu_names_the_setting_and_auto_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    no_gpu(monkeypatch)
    assert resolve_device("cpu") == resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceUnavailable, match="device: cuda, but this machine has no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(DeviceUnavailable, match="DFCA_DEVICE: 'tpu' is not one of"):
        worker_device("cpu", "tpu")
    assert worker_device("cuda", "cpu") == torch.device("cpu")  # DFCA_DEVICE wins over the config
    with pytest.raises(DeviceUnavailable, match="DFCA_DEVICE: cuda"):
        worker_device("cpu", "cuda")
    with pytest.raises(DeviceUnavailable, match="^device: cuda"):
        worker_device("cuda", None)  # unset: the config decides
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda")


def test_auto_falls_back_with_one_log_line(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    no_gpu(monkeypatch)
    monkeypatch.setattr(devices, "_warned_auto", False)
    with caplog.at_level("INFO", logger="dfca.devices"):
        for _ in range(3):
            resolve_device("auto")
    assert [r.getMessage() for r in caplog.records] == ["device: auto found no CUDA device; computing on the CPU"]


def test_dfca_validate_and_run_refuse_cuda_on_a_machine_without_one(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    no_gpu(monkeypatch)
    path = tmp_path / "cuda.yaml"
    path.write_text(yaml.safe_dump(small_config(device="cuda").model_dump()))
    runner = CliRunner()
    for args in (["validate", str(path)], ["run", str(path), "--out", str(tmp_path / "out")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "device: cuda, but this machine has no CUDA device" in result.output
    assert not (tmp_path / "out").exists()
    path.write_text(yaml.safe_dump(small_config(device="auto").model_dump()))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0 and "device cpu" in result.output


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", SCHEMA_ALGORITHMS)
def test_the_simulator_keeps_every_algorithm_on_its_device(algorithm: str, device: str) -> None:
    cfg = config_for(algorithm).model_copy(update={"device": device})
    result = simulate(cfg)
    want = torch.device(device).type
    assert result.summary["device"].startswith(want)
    params = {name: t for name, t in result.algorithm.state().items() if name.startswith("params.")}
    assert params and all(t.device.type == want for t in params.values())  # bookkeeping may stay on the CPU
    assert result.history[-1]["test_accuracy"] > 0.1  # it trained there (chance is 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_the_cnn_trains_on_its_device_and_both_drivers_agree(device: str) -> None:
    """model.kind: cnn (the paper's CNN, every client at once through torch.func) on 8x8 digits: it learns (chance is
    0.1), its parameters and batch-norm statistics stay on the device, and the message drivers end where the
    simulator ends. Batched convolutions round differently for other numbers of clients, and this net amplifies
    that over rounds. On the CPU a step differs by a unit in the last place of its gradient (4e-7 after one round,
    3e-6 after two, 5e-3 after four), so the drivers are compared after two rounds. On a GPU cuDNN picks other
    convolution algorithms for other batch sizes and does not repeat itself (measured on an H200, float32 in IEEE
    precision: the simulator against itself 1.7e-5 after one round, the drivers against it 5.9e-4 after one round
    and 1.9e-2 after two), so there they are compared after one round, within 5e-3."""
    cfg = small_config(model={"kind": "cnn"}, rounds=4, dfca={"variant": "paper"}, device=device)
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    assert sim.history[-1]["test_accuracy"] > 0.3
    assert {t.device.type for t in sim.algorithm.params.values()} == {torch.device(device).type}
    assert "bn1.running_mean" in sim.algorithm.params
    on_gpu = torch.device(device).type == "cuda"
    short = cfg.model_copy(update={"rounds": 1 if on_gpu else 2})
    sim = simulate(short, data=ctx.data)
    run = run_lockstep(short, ctx.data, neighbours(ctx.graph), transport_factory(), 2, device=device)
    for d in run.drivers:
        assert d.stats.applied > 0 and not d.stats.rejected
        if on_gpu:
            for name, tensor in d.algorithm.params.items():
                torch.testing.assert_close(tensor.cpu(), sim.algorithm.params[name][d.ids].cpu(), rtol=0, atol=5e-3)
        else:
            assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)


def run_worker(cfg_device: str, env_device: str | None, tmp_path: Path) -> tuple[ClientRunner, list[Any]]:
    cfg = small_config(device=cfg_device, rounds=2, dfca={"variant": "paper"}, runtime={"round_timeout": 5.0})
    graph = neighbours(build_graph(cfg.topology, cfg.data.clients, cfg.seed))
    events: list[RoundReport | WorkerEvent] = []
    spec = RunSpec("d", "dev", cfg, workers=1, ordinal=0, neighbours=graph, go=True, device=env_device)
    broker = InMemoryBroker()
    runner = ClientRunner(spec, lambda _prefetch: InMemoryTransport(broker), events.append, tmp_path)
    runner.start()
    runner.join(120)
    assert runner.finished
    return runner, events


def test_dfca_device_places_a_workers_clients(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_gpu(monkeypatch)
    runner, events = run_worker("cuda", "cpu", tmp_path / "a")  # DFCA_DEVICE=cpu overrides the config
    assert runner.status.state == "finished" and runner.driver is not None
    assert runner.device == runner.driver.algorithm.ctx.device == torch.device("cpu")
    assert all(t.device.type == "cpu" for t in runner.driver.algorithm.state().values())
    failed, events = run_worker("cpu", "cuda", tmp_path / "b")  # a GPU worker image on a machine without one
    assert failed.status.state == "failed" and "DFCA_DEVICE: cuda" in failed.status.detail
    assert events[-1].state == "failed" and "no CUDA device" in events[-1].detail  # type: ignore[union-attr]


@pytest.mark.parametrize("device", DEVICES)
def test_a_worker_trains_its_clients_on_the_device_dfca_device_names(device: str, tmp_path: Path) -> None:
    runner, events = run_worker("cpu", device, tmp_path)  # the config says cpu; DFCA_DEVICE decides
    assert runner.status.state == "finished" and runner.driver is not None, runner.status.detail
    assert runner.device.type == runner.driver.algorithm.ctx.device.type == device
    assert all(t.device.type == device for t in runner.driver.algorithm.state().values())
    placed = {e.device for e in events if isinstance(e, WorkerEvent) and e.state != "preparing"}
    assert placed == {device_name(runner.device)} and placed.pop().startswith(device)  # what it reports
    accuracy = [sum(r.evaluation["test_accuracy"]) / len(r.evaluation["test_accuracy"])
                for r in events if isinstance(r, RoundReport) and r.evaluation]
    assert accuracy and accuracy[-1] > 0.1  # it trained there (chance is 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_larger_than_the_devices_free_memory_is_refused_naming_the_device(device: str) -> None:
    free = available_bytes(device)
    assert free is not None and free > 0
    check_fits_memory(free // 2, "half of it", device)
    with pytest.raises(RunTooLarge, match="this machine" if device == "cpu" else "the cuda device"):
        check_fits_memory(free + (1 << 30), "this run", device)


def test_payloads_cross_the_wire_as_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_message moves every tensor to the CPU before safetensors sees it (a CUDA tensor would not save)."""
    from dfca.wire.codec import Envelope, TensorSpec, encode_message

    moved: list[str] = []
    original = torch.Tensor.to

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and args[0] == "cpu":
            moved.append("cpu")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    encode_message(Envelope("e", 0, 0, "models", 0, 0, {"w": torch.ones(2)}), {"w": TensorSpec((2,))})
    assert moved == ["cpu"]
