"""The one config schema: defaults, and errors that name the bad field."""

from __future__ import annotations

from pathlib import Path

import pytest

from dfca.algorithms import schedule_of
from dfca.config import ConfigError, ExperimentConfig, load_config, parse_config


def test_defaults_are_valid() -> None:
    cfg = ExperimentConfig()
    assert cfg.algorithm == "dfca" and cfg.clusters == 4 and cfg.data.dataset == "mnist-bundled"


@pytest.mark.parametrize(
    "data,field",
    [
        ({"algorithm": "fedprox"}, "algorithm"),
        ({"clusters": 0}, "clusters"),
        ({"train": {"lr": -1}}, "train.lr"),
        ({"topology": {"kind": "star"}}, "topology.kind"),
        ({"data": {"clients": 1}}, "data.clients"),
        ({"model": {"kind": "mlp", "hiden": 3}}, "model.hiden"),
        ({"network": {"message_loss": 1.5}}, "network.message_loss"),
    ],
)
def test_bad_values_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert field in str(err.value)


def test_yaml_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


def test_bundled_configs_are_valid() -> None:
    root = Path(__file__).resolve().parents[1]
    files = list((root / "configs").glob("*.yaml")) + list((root / "shared/dfca/configs").glob("*.yaml"))
    assert files
    for f in files:
        load_config(f)


def test_robust_default_seeds_before_its_training_rounds() -> None:
    """The default DFCA (robust) seeds its k models first, on top of `rounds`; the paper's rules do not."""
    cfg = parse_config({"clusters": 4, "rounds": 10, "data": {"clients": 32},
                        "topology": {"kind": "erdos_renyi", "p": 0.2}})
    assert cfg.dfca.variant == "robust" and cfg.dfca.seeding_rule == "farthest"
    assert schedule_of(cfg).seeding_rounds == 4 * 5  # k x the diameter bound of ER N=32 p=0.2
    assert schedule_of(cfg).total_rounds == 10 + 20
    flood = parse_config({**cfg.model_dump(), "dfca": {"flood_rounds": 2}})
    assert schedule_of(flood).seeding_rounds == 8 and schedule_of(flood).total_rounds == 18
    for other in ({"dfca": {"variant": "paper"}}, {"dfca": {"seeding": "none"}}, {"algorithm": "ifca"}):
        plain = parse_config({**cfg.model_dump(), **other})
        assert schedule_of(plain).seeding_rounds == 0 and schedule_of(plain).total_rounds == 10, other
    seeded_paper = parse_config({**cfg.model_dump(), "dfca": {"variant": "paper", "seeding": "farthest"}})
    assert schedule_of(seeded_paper).seeding_rounds == 20
