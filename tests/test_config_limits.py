"""Validation matches what can run: extreme values are refused naming the field, or the run completes.

The property test draws configs around a tiny run with fields pushed to their edges (and past them) and holds
every one to: refused at validation with the field named, refused before allocating by the memory check, or a
completed 1-round run. Diverged training (NaN models) fails at once with the reason, on both drivers.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfca.algorithms.dfca
from dfca.algorithms.base import RunDiverged, all_finite
from dfca.config import ConfigError, parse_config
from dfca.graph import neighbours
from dfca.run_size import RunTooLarge
from dfca.sections import MAX_SEED
from dfca.simulator import prepare, simulate
from dfca.transport import InMemoryBroker, InMemoryTransport
from harness.lockstep import run_lockstep

TINY: dict[str, Any] = {
    "name": "tiny", "clusters": 2, "rounds": 1, "seed": 0,
    "data": {"rotations": [0, 180], "clients": 4, "train_per_client": 10, "test_per_client": 5},
    "model": {"hidden": 8}, "train": {"local_epochs": 1, "batch_size": 10},
    "topology": {"kind": "erdos_renyi", "p": 0.9},
    "dfca": {"variant": "paper"},
}
HUGE = [2**31, 2**63, 2**70, 10**30]
FLOATS = [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-300, 1e30]
# (field path, values to try): each field's edges, past them, and numbers no field can take
EXTREMES: list[tuple[str, list[Any]]] = [
    ("seed", [0, MAX_SEED, MAX_SEED + 1, -1, *HUGE]),
    ("train.lr", [*FLOATS, 10.0, 10.000001]),
    ("train.momentum", [*FLOATS, 0.999]),
    ("train.lr_decay", FLOATS),
    ("train.local_epochs", [0, -1, 10_001, *HUGE]),
    ("train.batch_size", [0, 1, 100_000, 100_001, *HUGE]),
    ("data.clients", [1, 2, 100_001, *HUGE]),
    ("data.train_per_client", [0, 1, 100_001, *HUGE]),
    ("data.test_per_client", [0, 1, 100_001, *HUGE]),
    ("data.test_fraction", FLOATS),
    ("model.hidden", [0, 1, 65_537, *HUGE]),
    ("clusters", [0, 1, 3, 65, *HUGE]),
    ("rounds", [0, 100_001, *HUGE]),
    ("eval_every", [0, *HUGE]),
    ("topology.p", [*FLOATS, 1.0]),
    ("network.message_loss", [*FLOATS, 0.99]),
    ("network.message_delay", FLOATS),
    ("runtime.round_timeout", [*FLOATS, 86_401.0]),
    ("dfca.gossip_steps", [-1, 0, 1_001, *HUGE]),
    ("dfca.warmup_gossip_steps", [0, 1_001, *HUGE]),
    ("dfca.seed_epochs", [-1, 10_001, *HUGE]),
    ("dfca.flood_rounds", [0, 100_001, *HUGE]),
    ("dfca.untrained_weight", FLOATS),
]


def with_value(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    node = out
    *sections, key = path.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[key] = value
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(EXTREMES).flatmap(lambda fv: st.tuples(st.just(fv[0]), st.sampled_from(fv[1]))),
                min_size=1, max_size=3, unique_by=lambda fv: fv[0]),
       st.sampled_from(["paper", "robust"]))
def test_every_accepted_config_runs_one_round_or_is_refused(changes: list[tuple[str, Any]], variant: str) -> None:
    data = with_value(TINY, "dfca.variant", variant)
    for path, value in changes:
        data = with_value(data, path, value)
    try:
        cfg = parse_config(data)
    except ConfigError as err:  # refused: the message names a field we changed
        assert any(path in str(err) or path.split(".")[0] in str(err) for path, _ in changes), str(err)
        return
    try:
        result = simulate(cfg.model_copy(update={"rounds": 1}))
    except RunTooLarge as err:  # refused before allocating, with what to change
        assert "fewer clients" in str(err)
        return
    except ValueError as err:  # no connected graph of this density: refused before training, saying so
        assert str(err).startswith("topology: no connected"), str(err)
        return
    assert result.simulation.rounds_run == result.simulation.schedule.total_rounds >= 1
    assert math.isfinite(result.summary["test_accuracy"])


@pytest.mark.parametrize("override,field", [({"seed": 2**70}, "seed"), ({"train": {"lr": math.inf}}, "train.lr"),
                                            ({"train": {"lr": 1e30}}, "train.lr"),
                                            ({"train": {"lr": math.nan}}, "train.lr"),
                                            ({"model": {"hidden": 10**7}}, "model.hidden"),
                                            ({"data": {"train_per_client": 10**9}}, "data.train_per_client"),
                                            ({"train": {"local_epochs": 10**6}}, "train.local_epochs")])
def test_the_reported_crashes_are_refused_naming_the_field(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config({**TINY, **{k: {**TINY.get(k, {}), **v} if isinstance(v, dict) else v
                                 for k, v in override.items()}})


def test_graphs_and_tensors_too_large_for_any_run_are_refused() -> None:
    with pytest.raises(ConfigError, match="edges"):
        parse_config({**TINY, "data": {**TINY["data"], "clients": 3000}, "topology": {"kind": "complete"}})
    with pytest.raises(ConfigError, match="GiB"):
        parse_config({**TINY, "data": {**TINY["data"], "clients": 100_000, "train_per_client": 100_000},
                      "topology": {"kind": "ring"}})


def nan_training(*args: Any, **kwargs: Any) -> None:
    params = args[1]
    for tensor in params.values():
        tensor.fill_(math.nan)


def test_a_diverged_run_fails_at_once_on_both_drivers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dfca.algorithms.dfca, "train_assigned", nan_training)
    cfg = parse_config({**TINY, "rounds": 5})
    with pytest.raises(RunDiverged, match=r"round 0: .*NaN.*lower train\.lr"):
        simulate(cfg)
    ctx = prepare(cfg)
    broker = InMemoryBroker()
    with pytest.raises(RunDiverged, match="round 0"):
        run_lockstep(cfg, ctx.data, neighbours(ctx.graph), lambda: InMemoryTransport(broker), 2)


def test_the_finiteness_check_is_exact_when_the_sum_overflows_or_infinities_cancel() -> None:
    assert all_finite(torch.tensor([3e38, 3e38]))  # finite values whose float32 sum is inf
    assert not all_finite(torch.tensor([1.0, math.inf]))
    assert not all_finite(torch.tensor([math.inf, -math.inf]))  # the sum is NaN
    assert not all_finite(torch.tensor([0.0, math.nan]))
