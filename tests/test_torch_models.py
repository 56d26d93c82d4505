"""`model.kind: torch`: any nn.Module, every client's copy trained at once (dfca.models.torch_model), in both drivers.

- the step is exactly a per-client torch loop (torch.optim.SGD, momentum, shuffles, sample masks, BatchNorm
  statistics per client), and the built-in MLP written as a module ends a round where the built-in MLP does, in
  the simulator and on the message drivers;
- BatchNorm and dropout models train in both drivers; dropout masks differ between clients;
- a module vmap cannot batch falls back to a per-client loop, after a warning that names vmap's reason;
- every algorithm that trains a classifier runs a module on both drivers alike;
- bad factories are refused, naming `model.factory`, by `dfca validate`, `dfca run` and REST, and the runtime
  imports only what DFCA_MODEL_FACTORIES allows;
- `dfca run` with a module of the user's own recovers rotated MNIST's clusters.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from fastapi.testclient import TestClient
from test_driver_equivalence import DEVICES, assert_rows_match, config_for, small_config, transport_factory
from test_runtime_control_plane import AUTH, TOKEN
from test_runtime_start_checks import coordinator
from torch import nn
from torch_factories import DataDependent, batch_norm_cnn, dropout_mlp
from typer.testing import CliRunner

from dfca.cli.main import app
from dfca.config import ExperimentConfig
from dfca.data import build_federated_data
from dfca.data.shapes import sample_shape
from dfca.graph import neighbours
from dfca.identity import topics
from dfca.models.batched import Params, client_permutations
from dfca.models.build import build_model
from dfca.models.factory import ModelFactoryError, allowed_factories, check_config_model
from dfca.models.torch_model import TorchModel
from dfca.run_size import RunTooLarge
from dfca.simulator import Simulation, prepare, simulate
from dfca.wire.codec import CHECKSUM, Envelope, PayloadRejected, checksum, decode_message, encode_message, serialize
from harness.lockstep import LockstepRun, client_driver, lockstep_round, run_lockstep
from services.topology.main import create_app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def torch_model(factory: str, input_shape: tuple[int, ...] = (1, 8, 8), **options: Any) -> TorchModel:
    model = build_model("torch", input_shape, 0, 10, factory=f"torch_factories:{factory}", options=options)
    assert isinstance(model, TorchModel)
    return model


def per_client_torch_loop(make: Any, params: Params, x: torch.Tensor, y: torch.Tensor, lr: float, orders: torch.Tensor,
                          bs: int, momentum: float = 0.0, mask: torch.Tensor | None = None) -> Params:
    """What a framework that trains one client at a time does: load the client's state into a module, step
    torch.optim.SGD over its batches (of two samples or more where the module holds batch norm), store it back."""
    out = {k: v.clone() for k, v in params.items()}
    module = make()
    least = 2 if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()) else 1
    for b in range(x.shape[0]):
        with torch.no_grad():
            for k, v in module.state_dict().items():
                if k in out:
                    v.copy_(out[k][b])
        module.train()
        opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
        for epoch in range(orders.shape[1]):
            order = orders[b, epoch] if mask is None else orders[b, epoch][mask[b, orders[b, epoch]]]
            for lo in range(0, order.numel(), bs):
                idx = order[lo : lo + bs]
                if idx.numel() < least:
                    continue
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(module(x[b, idx]), y[b, idx]).backward()
                opt.step()
        with torch.no_grad():
            for k, v in module.state_dict().items():
                if k in out:
                    out[k][b].copy_(v)
    return out


@pytest.mark.parametrize("momentum,masked", [(0.0, False), (0.9, False), (0.0, True), (0.9, True)])
def test_the_batched_step_is_a_per_client_torch_optim_loop(momentum: float, masked: bool) -> None:
    """BatchNorm CNN, 5 clients, each with its own shuffle, momentum and (FedSPD's) sample mask: the vmapped step
    ends where torch.optim.SGD client by client ends, running statistics included; and so does evaluation."""
    model = torch_model("batch_norm_cnn")
    assert model.vmappable and "0.weight" in model.shapes() and "1.running_mean" in model.shapes()
    params = model.init(5, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 23, 1, 8, 8, generator=g), torch.randint(0, 10, (5, 23), generator=g)
    orders = client_permutations([11, 12, 13, 14, 15], 23, 2)
    mask = torch.rand(5, 23, generator=g) > 0.4 if masked else None
    expected = per_client_torch_loop(lambda: batch_norm_cnn((1, 8, 8), 10), params, x, y, 0.05, orders, 6,
                                     momentum, mask)
    model.sgd(params, x, y, 0.05, orders, 6, momentum, sample_mask=mask)
    for name, tensor in params.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-5, msg=name)
    assert not torch.equal(params["1.running_mean"][0], params["1.running_mean"][1])  # each client's own
    reference = batch_norm_cnn((1, 8, 8), 10).eval()
    reference.load_state_dict({k: v[2] for k, v in params.items()}, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(params, x)[2], reference(x[2]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_first_linear_layer_in_sample_space_is_the_per_client_loop(momentum: float) -> None:
    """A Sequential that starts with Linear on the flattened sample trains that layer in sample space where that is
    fewer multiply-adds (here: 30 samples of 64 values, 4 epochs), and ends where torch.optim.SGD client by client
    ends; with fewer epochs over more samples it takes the textbook step."""
    model = torch_model("dropout_mlp", hidden=32, p=0.0)  # Flatten, Linear, LayerNorm, ReLU, Dropout, Linear
    assert model.first == "1" and model.first_layer_form(30, 4) == "samples"
    assert model.first_layer_form(400, 1) == "weights" and torch_model("batch_norm_cnn").first is None
    params = model.init(4, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 30, 1, 8, 8, generator=g), torch.randint(0, 10, (4, 30), generator=g)
    orders = client_permutations([7, 8, 9, 10], 30, 4)
    expected = per_client_torch_loop(lambda: dropout_mlp((1, 8, 8), 10, hidden=32, p=0.0), params, x, y, 0.05,
                                     orders, 8, momentum)
    model.sgd(params, x, y, 0.05, orders, 8, momentum)
    for name, tensor in params.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-5, msg=name)


def mlp_weights_as_module(params: Params) -> Params:
    """The built-in MLP's tensors under the module's names (nn.Linear keeps its weight as [out, in])."""
    return {"1.weight": params["w1"].transpose(-1, -2).contiguous(), "1.bias": params["b1"].clone(),
            "3.weight": params["w2"].transpose(-1, -2).contiguous(), "3.bias": params["b2"].clone()}


def assert_same_mlp(builtin: Params, module: Params) -> None:
    for name, tensor in mlp_weights_as_module(builtin).items():
        torch.testing.assert_close(module[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def module_state(state: dict[str, torch.Tensor], rows: list[int] | None = None) -> dict[str, torch.Tensor]:
    """A DFCA state (checkpoint tensors) of the built-in MLP as the module's, for `rows` (default: all)."""
    pick = (lambda v: v) if rows is None else (lambda v: v[rows])
    params = {n.removeprefix("params."): pick(v) for n, v in state.items() if n.startswith("params.")}
    return {**{f"params.{n}": v for n, v in mlp_weights_as_module(params).items()}, "losses": pick(state["losses"])}


@pytest.mark.parametrize("device", DEVICES)
def test_the_mlp_as_a_module_ends_a_round_where_the_builtin_mlp_does(device: str) -> None:
    """DFCA's paper rule (local SGD, least-loss assignment, averaging), one round, the same initial weights: the
    built-in MLP and the same MLP as an nn.Module end at the same models in the simulator and on two message
    drivers."""
    builtin = small_config(dfca={"variant": "paper"}, init="local", rounds=1, device=device)
    module = small_config(dfca={"variant": "paper"}, init="local", rounds=1, device=device,
                          model={"kind": "torch", "factory": "torch_factories:mlp", "options": {"hidden": 16}})
    ctx = prepare(builtin)
    sims = Simulation(ctx), Simulation(prepare(module, ctx.data))
    start = {n: v.clone() for n, v in sims[0].algorithm.state().items()}  # state() holds the live tensors
    sims[1].algorithm.load_state(module_state(start))  # the built-in MLP's initial weights (and so its losses)
    for sim in sims:
        sim.run_round(0)
    assert_same_mlp(sims[0].algorithm.params, sims[1].algorithm.params)

    groups = [list(range(h, ctx.n, 2)) for h in range(2)]
    broker = transport_factory()
    run = LockstepRun([client_driver(module, "mlp", g, ctx.data.subset(g), neighbours(ctx.graph), broker(), device,
                                     workers=2) for g in groups], None)
    for d in run.drivers:
        d.algorithm.load_state(module_state(start, d.ids))
    lockstep_round(run, 0)
    for d in run.drivers:
        assert_same_mlp({k: v[d.ids] for k, v in sims[0].algorithm.params.items()}, d.algorithm.params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factory", ["batch_norm_cnn", "dropout_mlp"])
def test_batch_norm_and_dropout_models_train_in_both_drivers(factory: str, device: str) -> None:
    """Both learn in the simulator (chance is 0.1) and run on three message drivers; the batch-norm one ends where
    the simulator ends (dropout draws other masks for another grouping of clients, so that one is held to learning
    on the drivers too)."""
    cfg = small_config(dfca={"variant": "paper"}, rounds=4, device=device, train={"lr": 0.1},
                       model={"kind": "torch", "factory": f"torch_factories:{factory}"})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    assert sim.history[-1]["test_accuracy"] > 0.3, sim.history[-1]
    short = cfg.model_copy(update={"rounds": 1 if factory == "batch_norm_cnn" else 4})
    run = run_lockstep(short, ctx.data, neighbours(ctx.graph), transport_factory(), 3, device=device)
    if factory == "batch_norm_cnn":
        one = simulate(short, data=ctx.data)
        for d in run.drivers:
            assert_rows_match(d.algorithm.params, one.algorithm.params, d.ids)
        return
    accuracy = torch.cat([d.algorithm.evaluate().test_accuracy for d in run.drivers])
    assert float(accuracy.mean()) > 0.3


def test_each_client_draws_its_own_dropout_masks_and_a_run_repeats() -> None:
    """Two clients with the same weights and data: with dropout they end apart (masks of their own), without they
    end equal; the same call twice gives the same models."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 20, 1, 8, 8, generator=g).expand(2, -1, -1, -1, -1)
    y = torch.randint(0, 10, (1, 20), generator=g).expand(2, -1)
    orders = client_permutations([5], 20, 2).expand(2, -1, -1)
    ends = {}
    for factory in ("dropout_mlp", "mlp"):
        model = torch_model(factory)
        start = {k: v[:1].expand(2, *v.shape[1:]).clone() for k, v in model.init(1, torch.Generator()).items()}
        runs = []
        for _ in range(2):
            params = {k: v.clone() for k, v in start.items()}
            model.sgd(params, x, y, 0.1, orders, 5)
            runs.append(params)
        for name in start:
            torch.testing.assert_close(runs[0][name], runs[1][name])  # repeatable
        ends[factory] = max(float((runs[0][n][0] - runs[0][n][1]).abs().max()) for n in start)
    assert ends["dropout_mlp"] > 1e-3 and ends["mlp"] == 0.0


def test_a_module_vmap_cannot_batch_trains_client_by_client_after_a_warning() -> None:
    with pytest.warns(RuntimeWarning, match=r"vmap cannot batch this module .*one client at a time"):
        model = torch_model("data_dependent")
    assert not model.vmappable
    params = model.init(3, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(3, 12, 1, 8, 8, generator=g), torch.randint(0, 10, (3, 12), generator=g)
    orders = client_permutations([1, 2, 3], 12, 2)
    expected = per_client_torch_loop(lambda: DataDependent(64, 10), params, x, y, 0.1, orders, 4, 0.5)
    model.sgd(params, x, y, 0.1, orders, 4, 0.5)
    for name, tensor in params.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-5)
    assert model.logits(params, x).shape == (3, 12, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a module vmap can batch warns of nothing
        torch_model("mlp")


CLASSIFIERS = ["dfca", "ifca", "dfedavgm", "fedspd", "local", "dpmm_cfl", "fesem"]


@pytest.mark.parametrize("algorithm", CLASSIFIERS)
def test_every_classifier_algorithm_runs_a_module_alike_on_both_drivers(algorithm: str) -> None:
    """The equivalence suite's runs with a LayerNorm MLP of the user's in place of the built-in MLP (DPMM-CFL and
    FeSEM cluster its last layer with parameters): the message drivers end where the simulator ends."""
    cfg = config_for(algorithm)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={
        "kind": "torch", "factory": "torch_factories:dropout_mlp", "options": {"hidden": 16, "p": 0.0}})})
    ctx = prepare(cfg)
    assert ctx.model.last_layer() == ["5.weight", "5.bias"]
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), 3)
    for d in run.drivers:
        assert not d.stats.rejected and d.stats.timeouts == 0
        for name, tensor in d.algorithm.state().items():
            if name.startswith("params."):
                torch.testing.assert_close(tensor, sim.algorithm.state()[name][d.ids], rtol=1e-3, atol=1e-4)


def test_a_module_can_name_its_last_layer() -> None:
    model = torch_model("batch_norm_cnn")
    assert model.last_layer() == ["5.weight", "5.bias"]  # the last submodule with parameters of its own
    model.module.dfca_last_layer = "0"  # type: ignore[assignment]
    assert model.last_layer() == ["0.weight", "0.bias"]
    model.module.dfca_last_layer = "nope"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="dfca_last_layer 'nope'"):
        model.last_layer()


# -- bad input ---------------------------------------------------------------------------------------------------
def torch_config(factory: str, **options: Any) -> dict[str, Any]:
    return {"name": "mine", "clusters": 2, "rounds": 2,
            "data": {"dataset": "digits", "clients": 6, "train_per_client": 10, "test_per_client": 5},
            "model": {"kind": "torch", "factory": factory, "options": options},
            "topology": {"kind": "complete"}}


BAD_FACTORIES = [
    ("no_such_package.models:make", "cannot import 'no_such_package.models'"),
    ("torch_factories:missing", "has no function 'missing'"),
    ("torch_factories:raises", "raised RuntimeError: this factory always fails"),
    ("torch_factories:not_a_module", "returned dict, not a torch.nn.Module"),
    ("torch_factories:too_many_classes", "not [2, 10]"),
    ("torch_factories:not_finite", "initial '1.weight' is not finite"),
    ("examples/nowhere.py:make", "no file 'examples/nowhere.py'"),
]


@pytest.mark.parametrize("factory,message", BAD_FACTORIES)
def test_dfca_validate_and_run_refuse_a_bad_factory_naming_model_factory(tmp_path: Path, factory: str,
                                                                         message: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(torch_config(factory)))
    for argv in (["validate", str(path)], ["run", str(path), "--out", str(tmp_path / "out")]):
        result = runner.invoke(app, argv)
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and "model.factory" in text and message in text, (argv, result.output)
    assert not (tmp_path / "out").exists()  # refused before anything ran


@pytest.mark.parametrize("factory,message", [*BAD_FACTORIES[1:6], ("os:getcwd", "is not allowed here")])
def test_rest_refuses_a_bad_or_unlisted_factory_with_422_naming_model_factory(
        monkeypatch: pytest.MonkeyPatch, factory: str, message: str) -> None:
    """The topology service imports only what DFCA_MODEL_FACTORIES lists (here: the tests' factories module), and
    checks the module against the data before any worker trains."""
    monkeypatch.setenv("DFCA_MODEL_FACTORIES", "torch_factories, /nonexistent/models")
    with TestClient(create_app(coordinator(workers=1), TOKEN, "memory://")) as client:
        refused = client.post("/experiments", json=torch_config(factory), headers=AUTH)
        assert refused.status_code == 422, refused.text
        [error] = refused.json()["detail"]
        assert error["loc"] == ["body", "model.factory"] and message in error["msg"], error
        good = client.post("/experiments", json=torch_config("torch_factories:batch_norm_cnn"), headers=AUTH)
        assert good.status_code == 201, good.text


def test_the_runtime_imports_no_factory_unless_the_operator_allows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    by_module = ExperimentConfig.model_validate(torch_config("torch_factories:mlp"))
    by_file = ExperimentConfig.model_validate(torch_config(f"{REPO / 'tests' / 'torch_factories.py'}:mlp"))
    monkeypatch.delenv("DFCA_MODEL_FACTORIES", raising=False)
    assert allowed_factories() == []
    for cfg in (by_module, by_file):
        with pytest.raises(ModelFactoryError, match=r"model.factory: .* not allowed here: .*DFCA_MODEL_FACTORIES"):
            check_config_model(cfg, allowed_factories())
        check_config_model(cfg)  # `dfca run`: the user's own process imports what its config names
    check_config_model(by_module, allowed_factories("torch_factories"))
    check_config_model(by_file, allowed_factories(f"mylab.models, {REPO / 'tests'}"))
    for cfg, listed in ((by_module, "torch_factories_evil"), (by_module, "torch"),
                        (by_file, str(REPO / "examples")), (by_file, "torch_factories")):
        with pytest.raises(ModelFactoryError, match="not allowed here"):
            check_config_model(cfg, allowed_factories(listed))


def test_config_errors_name_the_model_fields() -> None:
    for model, field in (({"kind": "torch"}, "model.factory"), ({"kind": "mlp", "factory": "a:b"}, "model.factory"),
                         ({"kind": "torch", "factory": "a.b:not-a-name"}, "model.factory"),
                         ({"kind": "torch", "factory": "a:b", "options": {"1x": 1}}, "model.options")):
        with pytest.raises(ValueError, match=field):
            ExperimentConfig.model_validate({"model": model})


@pytest.mark.parametrize("data", [{"dataset": "mnist-bundled"}, {"dataset": "digits"},
                                  {"dataset": "digits", "features": "projection", "feature_dim": 12}])
def test_the_sample_shape_from_the_config_is_the_loaders(data: dict[str, Any]) -> None:
    cfg = ExperimentConfig.model_validate({"data": {**data, "clients": 4, "train_per_client": 5,
                                                    "test_per_client": 2}})
    built = build_federated_data(cfg)
    assert sample_shape(cfg.data) == (tuple(built.input_shape), built.num_classes)


# -- a user's module end to end --------------------------------------------------------------------------------
@pytest.mark.slow
def test_dfca_run_with_a_module_of_the_users_recovers_rotated_mnist_clusters(tmp_path: Path) -> None:
    """The tabular example (LayerNorm, dropout) on rotated bundled MNIST, k=2, through `dfca run`."""
    cfg = yaml.safe_load((REPO / "examples" / "tabular_mlp" / "config.yaml").read_text())
    cfg["model"]["factory"] = str(REPO / "examples" / "tabular_mlp" / "model.py") + ":make"
    cfg["data"] = {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": 20, "train_per_client": 80,
                   "test_per_client": 20}
    cfg["rounds"] = 8
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cluster_ari"] >= 0.95 and summary["test_accuracy"] >= 0.7, summary
    from safetensors.torch import load_file

    saved = load_file(str(out / "models" / "cluster_0.safetensors"))
    assert {"1.weight", "2.weight", "2.bias", "9.weight"} <= set(saved)  # the module's state_dict names


def test_the_wire_names_a_modules_tensors_by_its_state_dict_and_checks_them() -> None:
    """A module's payload: its state_dict names (parameters and BatchNorm statistics); the decoder refuses a wrong
    shape, a missing tensor, a wrong dtype and a non-finite value, as for the built-in models."""
    cfg = small_config(dfca={"variant": "paper"}, model={"kind": "torch", "factory": "torch_factories:batch_norm_cnn"})
    algorithm = Simulation(prepare(cfg)).algorithm
    exchange = algorithm.exchanges(0)[0]
    spec = algorithm.payload(exchange)
    module = batch_norm_cnn((1, 8, 8), 10)
    carried = [n for n, t in module.state_dict().items() if t.is_floating_point()]
    assert list(spec) == carried and all(spec[n].shape == tuple(module.state_dict()[n].shape) for n in carried)
    tensors = {n: t.clone() for n, t in module.state_dict().items() if n in spec}
    key = topics.model_key("exp1", "worker-0", 3, 0)

    def decoded(tensors: dict[str, torch.Tensor]) -> Envelope:
        body, headers = encode_message(Envelope("exp1", 3, 0, exchange.name, 0, 0, tensors), spec)
        return decode_message(key, body, headers, "exp1", lambda _head: spec)

    assert set(decoded(tensors).tensors) == set(spec)
    bad = {"shape": {**tensors, "0.weight": torch.zeros(1, 1, 3, 3)},
           "non_finite": {**tensors, "1.running_var": torch.full_like(tensors["1.running_var"], float("nan"))}}
    for reason, damaged in bad.items():
        with pytest.raises(PayloadRejected) as err:
            decoded(damaged)
        assert err.value.reason == reason
    missing = {n: t for n, t in tensors.items() if n != "5.bias"}
    body = serialize(missing)
    headers = {**encode_message(Envelope("exp1", 3, 0, exchange.name, 0, 0, tensors), spec)[1],
               CHECKSUM: checksum(body)}
    with pytest.raises(PayloadRejected) as err:
        decode_message(key, body, headers, "exp1", lambda _head: spec)
    assert err.value.reason == "shape"


@pytest.mark.parametrize("example", ["resnet_cifar", "tabular_mlp"])
def test_the_examples_validate_and_learn(example: str, tmp_path: Path) -> None:
    """Each example's config passes `dfca validate` as shipped (the residual CNN's CIFAR-10 files are read only by a
    run), and its module learns: a few local steps on one client's data lower its loss."""
    config = REPO / "examples" / example / "config.yaml"
    result = runner.invoke(app, ["validate", str(config)])
    assert result.exit_code == 0 and "ok" in result.output, result.output
    cfg = ExperimentConfig.model_validate(yaml.safe_load(config.read_text()))
    shape, classes = sample_shape(cfg.data)
    model = build_model("torch", shape, 0, classes, factory=str(REPO / cfg.model.factory), options=cfg.model.options)
    assert isinstance(model, TorchModel) and model.vmappable
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 16, *shape, generator=g), torch.randint(0, classes, (2, 16), generator=g)
    params = model.init(2, torch.Generator().manual_seed(1))

    def loss() -> float:
        return float(F.cross_entropy(model.logits(params, x).flatten(0, 1), y.flatten()))

    before = loss()
    model.sgd(params, x, y, 0.05, client_permutations([1, 2], 16, 10), 8, momentum=0.9)
    assert loss() < 0.5 * before


def test_a_modules_copies_count_in_the_memory_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module's size is known once it is built: a run whose data fit but whose module copies do not is refused
    before the copies are allocated."""
    cfg = ExperimentConfig.model_validate({**torch_config("torch_factories:mlp", hidden=4096), "clusters": 4})
    data_only = cfg.estimated_bytes()
    with_module = cfg.estimated_bytes(model_values=torch_model("mlp", hidden=4096).num_params())
    assert with_module > data_only + 6 * 4 * 3 * (64 * 4096) * 4  # 6 clients, k=4, 3 copies of 64x4096 weights
    monkeypatch.setattr("dfca.run_size.available_bytes", lambda device="cpu": data_only + 1)
    with pytest.raises(RunTooLarge, match="this run of 6 clients"):
        prepare(cfg)
