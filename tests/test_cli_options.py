"""`dfca --version`, `--set` overrides on `run` and `validate`, the output folder rules, the closing file list, and
the plots' axes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dfca.cli.main import app
from dfca.config import ConfigError, load_config
from dfca.results.outputs import count_ceiling
from dfca.results.run_folder import OutFolderRefused, prepare_out

runner = CliRunner()
TINY = {"name": "tiny", "clusters": 2, "rounds": 1, "seed": 0,
        "data": {"dataset": "digits", "rotations": [0, 180], "clients": 6, "train_per_client": 20,
                 "test_per_client": 5},
        "model": {"kind": "mlp", "hidden": 8}, "train": {"lr": 0.1, "local_epochs": 1, "batch_size": 10},
        "topology": {"kind": "complete"}, "dfca": {"variant": "paper"}}


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def test_version_names_the_package_and_torch() -> None:
    for flag in ("--version", "-V"):
        result = runner.invoke(app, [flag])
        assert result.exit_code == 0
        assert result.output.startswith("dfca 0.") and "torch 2." in result.output


def test_set_overrides_a_field_by_its_dotted_path(tiny: Path) -> None:
    cfg = load_config(tiny, ["train.lr=0.05", "data.rotations=[0, 90]", "topology.kind=ring", "dfca.seeding=none"])
    assert (cfg.train.lr, cfg.data.rotations, cfg.topology.kind) == (0.05, [0, 90], "ring")


@pytest.mark.parametrize("override, field", [
    ("train.lr=abc", "train.lr"), ("train.lrr=0.1", "train.lrr"), ("rounds.x=1", "rounds"),
    ("train.lr=[1", "train.lr"), ("nonsense", "key=value"),
])
def test_a_bad_override_is_refused_naming_the_field(tiny: Path, override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(tiny, [override])
    result = runner.invoke(app, ["validate", str(tiny), "--set", override])
    assert result.exit_code == 2 and field in result.output


def test_run_applies_set_and_lists_every_file_it_wrote(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(tiny), "--out", str(out), "--set", "rounds=2", "--set", "seed=3"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rounds"], summary["seed"]) == (2, 3)
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert "models/cluster_1.safetensors" in written and "clusters.png" in written
    closing = " ".join(result.output.split())  # rich may wrap the line
    for name in written:
        assert name in closing


def test_a_non_empty_out_is_refused_without_force_and_cleared_with_it(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "models").mkdir(parents=True)
    stale = out / "models" / "cluster_3.safetensors"  # from an earlier k=4 run
    stale.write_bytes(b"old")
    refused = runner.invoke(app, ["run", str(tiny), "--out", str(out)])
    assert refused.exit_code == 2 and "--force" in refused.output and stale.exists()
    forced = runner.invoke(app, ["run", str(tiny), "--out", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert not stale.exists() and (out / "models" / "cluster_1.safetensors").exists()


def test_the_default_folder_is_replaced_only_when_it_holds_a_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    latest = tmp_path / "runs" / "latest"
    (latest / "models").mkdir(parents=True)
    (latest / "summary.json").write_text("{}")
    (latest / "models" / "cluster_3.safetensors").write_bytes(b"old")
    assert prepare_out(None, force=False) == Path("runs/latest")
    assert list(latest.iterdir()) == []
    (latest / "notes.txt").write_text("mine")  # not a run folder: refused
    with pytest.raises(OutFolderRefused, match="does not look like a dfca run"):
        prepare_out(None, force=False)
    assert (latest / "notes.txt").exists()


def test_force_never_clears_the_current_folder_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "precious.txt").write_text("keep")
    with pytest.raises(OutFolderRefused, match="refusing to clear"):
        prepare_out(Path("."), force=True)
    with pytest.raises(OutFolderRefused, match="is a file"):
        prepare_out(Path("precious.txt"), force=True)
    assert (tmp_path / "precious.txt").read_text() == "keep"


def test_a_constant_cluster_count_is_drawn_on_an_axis_up_to_k() -> None:
    history = [{"round": r, "populated_clusters": 2, "assignment_counts": [3, 3, 0, 0]} for r in range(1, 4)]
    assert count_ceiling(history, "populated_clusters") == 4.0
    assert count_ceiling([{"round": 1, "communities_found": 7, "true_categories": 10}], "communities_found") == 10.0
