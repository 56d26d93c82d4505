"""An algorithm is one file plus one registry line: the drivers, the schedule and the CLI name none of them, and a
toy algorithm registered by a test (examples/mean_of_neighbours.py) runs the same on both drivers and learns."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from dfca.algorithms import CLIENTS, register, schedule_of, unregister
from dfca.config import ExperimentConfig, compose_config
from dfca.graph import neighbours
from dfca.simulator import prepare, simulate
from dfca.transport import InMemoryBroker, InMemoryTransport
from harness.lockstep import run_lockstep

REPO = Path(__file__).resolve().parents[1]
DFCA = REPO / "shared" / "dfca"
NAME_FREE = [DFCA / "simulator.py", DFCA / "schedule.py", *sorted((DFCA / "cli").glob("*.py")),
             *sorted((DFCA / "runtime").rglob("*.py"))]


def named_algorithms(path: Path, names: set[str], sections: set[str]) -> Iterator[str]:
    """Where `path` names an algorithm: a registered name compared with, used as a key, or a section read
    (`cfg.dfca`)."""
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                for item in items:
                    if isinstance(item, ast.Constant) and item.value in names:
                        yield f"{where}: compares with {item.value!r}"
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in names:
            yield f"{where}: [{node.slice.value!r}]"
        elif isinstance(node, ast.Dict):
            yield from (f"{where}: key {k.value!r}" for k in node.keys
                        if isinstance(k, ast.Constant) and k.value in names)
        elif isinstance(node, ast.Attribute) and node.attr in sections and _reads_config(node.value):
            yield f"{where}: reads the section .{node.attr}"


def _reads_config(value: ast.expr) -> bool:
    """cfg.<section>, self.cfg.<section>, ctx.cfg.<section>, config.<section>: not `dfca.<module>`."""
    name = value.attr if isinstance(value, ast.Attribute) else value.id if isinstance(value, ast.Name) else ""
    return name in ("cfg", "config")


def test_the_drivers_the_schedule_and_the_cli_name_no_algorithm() -> None:
    """Special cases belong on the algorithm's class (dfca.algorithms.base: `infers_clusters`, `variant`,
    `rounds_note`, `graph_warning`, `Schedule` ...), never in a driver."""
    names = set(CLIENTS)
    sections = {c.section for c in CLIENTS.values() if c.section is not None}
    found = [hit for path in NAME_FREE for hit in named_algorithms(path, names | sections, sections)]
    assert not found, "an algorithm named outside its own file:\n" + "\n".join(found)


def test_the_guard_sees_a_special_case() -> None:
    source = "if cfg.algorithm == 'fedcref':\n    x = cfg.dfca.variant\ny = {'ifca': 1}\n"
    path = REPO / "tests" / "_guard_probe.py"
    try:
        path.write_text(source)
        hits = list(named_algorithms(path, {"fedcref", "ifca", "dfca"}, {"dfca"}))
    finally:
        path.unlink()
    assert len(hits) == 3


# -- a toy algorithm, registered by the test ---------------------------------------------------------------------
def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def toy() -> Iterator[type[Any]]:
    """`mean_of_neighbours`, registered for the test (one call), forgotten after it."""
    algorithm = load_example("mean_of_neighbours").MeanOfNeighbours
    register("mean_of_neighbours", algorithm)
    try:
        yield algorithm
    finally:
        unregister("mean_of_neighbours")


def toy_config(schema: type[Any], **section: Any) -> Any:
    return schema.model_validate({
        "name": "toy", "algorithm": "mean_of_neighbours", "clusters": 1, "rounds": 8, "seed": 3,
        "aggregation": "batch",
        "data": {"dataset": "digits", "rotations": [0], "clients": 10, "train_per_client": 40, "test_per_client": 20},
        "model": {"kind": "mlp", "hidden": 32},
        "train": {"lr": 0.3, "local_epochs": 3, "batch_size": 10},
        "topology": {"kind": "erdos_renyi", "p": 0.4},
        "runtime": {"payload_dtype": "float32"},
        "mean_of_neighbours": section,
    })


def test_the_product_schema_does_not_know_the_toy() -> None:
    assert "mean_of_neighbours" not in CLIENTS and "mean_of_neighbours" not in ExperimentConfig.model_fields


def test_the_toy_section_joins_the_composed_schema(toy: type[Any]) -> None:
    schema = compose_config(CLIENTS)
    assert schema.model_fields["mean_of_neighbours"].annotation is toy.Section
    assert toy_config(schema).mean_of_neighbours.own_weight == 1.0
    with pytest.raises(ValueError, match="mean_of_neighbours.own_weight"):
        toy_config(schema, own_weight=-1)


def test_the_toy_runs_the_same_on_both_drivers_and_learns(toy: type[Any]) -> None:
    cfg = toy_config(compose_config(CLIENTS), own_weight=2.0)
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    broker = InMemoryBroker()
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), lambda: InMemoryTransport(broker), 3)
    for d in run.drivers:
        assert d.stats.applied > 0 and not d.stats.rejected and d.stats.timeouts == 0
        for name, tensor in d.algorithm.state().items():
            torch.testing.assert_close(tensor, sim.algorithm.state()[name][d.ids], rtol=1e-4, atol=1e-5)
    # every client applied one model per neighbour per round
    assert sum(d.stats.applied for d in run.drivers) == cfg.rounds * int(ctx.adjacency.sum())
    accuracy = sim.summary["test_accuracy"]
    assert accuracy > 0.8, accuracy  # ten digit classes: chance is 0.1


def test_a_round_is_named_in_its_phase() -> None:
    """One numbering everywhere: robust DFCA's seeding rounds count 1..S as seeding, then training rounds 1..R."""
    cfg = ExperimentConfig.model_validate({"rounds": 10, "clusters": 2, "data": {"clients": 20, "rotations": [0, 180]},
                                           "dfca": {"variant": "robust"}})
    schedule = schedule_of(cfg)
    seeding = schedule.seeding_rounds
    assert seeding > 0 and schedule.total_rounds == seeding + 10
    assert schedule.label(0) == f"seeding 1 of {seeding}" and schedule.phase_round(seeding - 1)[1] == seeding
    assert schedule.label(seeding) == "round 1 of 10" and schedule.label(seeding + 9) == "round 10 of 10"
    assert schedule_of(cfg.model_copy(update={"algorithm": "ifca"})).label(0) == "round 1 of 10"
