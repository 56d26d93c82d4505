"""Folder federations read from files: arrays, image folders and tables; clusters.json; every bad input refused
with the file and the client named, by the reader, by `dfca data inspect` and by `dfca validate`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from typer.testing import CliRunner

from dfca.cli.main import app
from dfca.config import ConfigError, load_config, parse_config
from dfca.data import FolderDataError, inspect_folder, list_client_ids, read_folder_federation

runner = CliRunner()


def arrays(folder: Path, client: str, x: np.ndarray, y: np.ndarray, split: str = "train") -> Path:
    (folder / client).mkdir(parents=True, exist_ok=True)
    np.savez(folder / client / f"{split}.npz", x=x, y=y)
    return folder / client / f"{split}.npz"


def rng_images(n: int, seed: int, shape: tuple[int, ...] = (4, 4)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


def labels(n: int, classes: int = 3) -> np.ndarray:
    return np.arange(n, dtype=np.int64) % classes


def three_clients(root: Path) -> Path:
    """a: 10 uint8 4x4 images, no test set; b: 30 train and 5 test; c: 4 float samples."""
    arrays(root, "a", rng_images(10, 0), labels(10))
    arrays(root, "b", rng_images(30, 1), labels(30))
    arrays(root, "b", rng_images(5, 2), labels(5), "test")
    arrays(root, "c", np.random.default_rng(3).random((4, 4, 4)).astype(np.float64), labels(4))
    return root


def test_arrays_are_read_scaled_counted_and_held_out_by_seed(tmp_path: Path) -> None:
    root = three_clients(tmp_path / "fed")
    data = read_folder_federation(root, seed=5, test_fraction=0.2)
    assert data.client_names == ("a", "b", "c") and list_client_ids(root) == ["a", "b", "c"]
    assert data.input_shape == (1, 4, 4)  # a per-sample (H, W) is one channel
    assert data.num_classes == 3  # the largest label + 1
    assert data.train_sizes.tolist() == [8, 30, 3] and data.test_sizes.tolist() == [2, 5, 1]
    (xa, _), (ta, _) = data.client_shards(0)  # the clients' own samples (sizes 8, 30, 3 are bucketed)
    (xb, _), (_, yb_test) = data.client_shards(1)
    assert xb.dtype == torch.float32 and max(float(data.client_shards(i)[0][0].max()) for i in range(3)) <= 1.0
    b = np.load(root / "b" / "train.npz")
    torch.testing.assert_close(xb[:, 0], torch.from_numpy(b["x"]).float() / 255)
    assert yb_test.tolist() == labels(5).tolist()  # b's own test.npz
    # a's held-out samples: disjoint from its train samples, together all 10, the same for the same seed
    a = torch.from_numpy(np.load(root / "a" / "train.npz")["x"]).float() / 255
    together = torch.cat([xa[:, 0], ta[:, 0]])
    assert sorted(map(tuple, together.flatten(1).tolist())) == sorted(map(tuple, a.flatten(1).tolist()))
    again = read_folder_federation(root, seed=5, test_fraction=0.2)
    other = read_folder_federation(root, seed=6, test_fraction=0.2)
    assert all(torch.equal(again.client_shards(i)[1][0], data.client_shards(i)[1][0]) for i in range(3))
    assert not torch.equal(other.client_shards(0)[1][0], ta)
    assert not data.has_true_clusters and data.true_cluster.tolist() == [-1, -1, -1]


def test_named_clients_are_read_alone_in_their_order_and_hold_out_alike(tmp_path: Path) -> None:
    root = three_clients(tmp_path / "fed")
    (root / "broken").mkdir()
    (root / "broken" / "train.npz").write_bytes(b"not an npz")  # never opened when not named
    data = read_folder_federation(root, seed=5, test_fraction=0.2, clients=["c", "a"], classes=3)
    assert data.client_names == ("c", "a")
    whole = read_folder_federation(root, seed=5, test_fraction=0.2, clients=["a", "b", "c"])
    # a's held-out split: seed and id alone
    torch.testing.assert_close(data.client_shards(1)[1][0], whole.client_shards(0)[1][0])


def test_clusters_json_gives_the_true_clusters(tmp_path: Path) -> None:
    root = three_clients(tmp_path / "fed")
    (root / "clusters.json").write_text(json.dumps({"a": 1, "b": 0, "c": 1}))
    data = read_folder_federation(root, seed=0, test_fraction=0.2)
    assert data.has_true_clusters and data.true_cluster.tolist() == [1, 0, 1]
    report = inspect_folder(root)
    assert report.ok and report.true_clusters == {"a": 1, "b": 0, "c": 1}
    assert report.samples() == {"min": 4, "median": 10.0, "max": 35}
    assert [c.label_counts for c in report.clients][0] == [4, 3, 3]


def write_png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def test_image_folders_are_read_by_label_folder_greyscale_and_rgb(tmp_path: Path) -> None:
    root = tmp_path / "images"
    grey = rng_images(6, 4, (5, 5))
    for i, label in enumerate([0, 0, 1, 1, 2, 2]):
        write_png(root / "site-a" / "train" / str(label) / f"{i}.png", grey[i])
    write_png(root / "site-a" / "test" / "1" / "t.png", grey[0])
    colour = np.random.default_rng(5).integers(0, 256, (3, 5, 5, 3), dtype=np.uint8)
    for i in range(3):
        write_png(root / "site-b" / "train" / str(i) / f"{i}.png", colour[i])
    site_a = read_folder_federation(root, seed=0, test_fraction=0.3, clients=["site-a"])
    assert site_a.input_shape == (1, 5, 5) and site_a.num_classes == 3
    assert site_a.y_train[0].tolist() == [0, 0, 1, 1, 2, 2] and site_a.y_test[0].tolist() == [1]
    torch.testing.assert_close(site_a.x_train[0, 2, 0], torch.from_numpy(grey[2]).float() / 255)
    site_b = read_folder_federation(root, seed=0, test_fraction=0.3, clients=["site-b"])
    assert site_b.input_shape == (3, 5, 5)
    for image, label in zip(site_b.x_train[0, :2], site_b.y_train[0, :2].tolist(), strict=True):
        torch.testing.assert_close(image.permute(1, 2, 0), torch.from_numpy(colour[label]).float() / 255)
    problems = inspect_folder(root).problems  # greyscale and colour clients together: shapes differ
    assert len(problems) == 1 and problems[0].client == "site-b" and "(3, 5, 5)" in problems[0].text


def test_a_csv_table_is_a_natural_partition_with_an_optional_split(tmp_path: Path) -> None:
    rows = [{"client": c, "label": i % 2, "f0": float(i), "f1": float(-i), "split": "test" if i % 5 == 4 else "train"}
            for c, n in (("hospital-1", 10), ("hospital-2", 5)) for i in range(n)]
    table = tmp_path / "records.csv"
    import pandas as pd

    pd.DataFrame(rows).to_csv(table, index=False)
    (tmp_path / "clusters.json").write_text(json.dumps({"hospital-1": 0, "hospital-2": 1}))
    assert list_client_ids(table) == ["hospital-1", "hospital-2"]
    data = read_folder_federation(table, seed=0, test_fraction=0.2)
    assert data.input_shape == (2,) and data.num_classes == 2 and data.true_cluster.tolist() == [0, 1]
    assert data.train_sizes.tolist() == [8, 4] and data.test_sizes.tolist() == [2, 1]
    assert data.x_test[0, :2, 0].tolist() == [4.0, 9.0]
    pd.DataFrame(rows).drop(columns="split").to_csv(table, index=False)
    held = read_folder_federation(table, seed=0, test_fraction=0.2)
    assert held.train_sizes.tolist() == [8, 4] and held.test_sizes.tolist() == [2, 1]


def test_a_parquet_table_reads_like_the_csv(tmp_path: Path) -> None:
    import pandas as pd

    frame = pd.DataFrame({"client": ["x"] * 4 + ["y"] * 3, "label": [0, 1, 0, 1, 1, 0, 1],
                          "v": np.arange(7, dtype=np.float32)})
    frame.to_csv(tmp_path / "t.csv", index=False)
    frame.to_parquet(tmp_path / "t.parquet")
    csv = read_folder_federation(tmp_path / "t.csv", seed=1, test_fraction=0.25)
    parquet = read_folder_federation(tmp_path / "t.parquet", seed=1, test_fraction=0.25)
    assert parquet.client_names == csv.client_names == ("x", "y")
    assert torch.equal(parquet.x_train, csv.x_train) and torch.equal(parquet.y_test, csv.y_test)


# -- bad input: (what to break, the file named, the client named, words of the message) -----------------------------
def missing_client(root: Path) -> None:
    (root / "clusters.json").write_text(json.dumps({"a": 0, "b": 0, "c": 1, "ghost": 1}))


def empty_folder(root: Path) -> None:
    (root / "d").mkdir()


def no_samples(root: Path) -> None:
    arrays(root, "d", np.zeros((0, 4, 4), np.uint8), np.zeros(0, np.int64))


def one_sample(root: Path) -> None:
    arrays(root, "d", rng_images(1, 9), np.zeros(1, np.int64))


def other_shape(root: Path) -> None:
    arrays(root, "d", rng_images(5, 9, (5, 4)), labels(5))


def float_labels(root: Path) -> None:
    arrays(root, "d", rng_images(5, 9), labels(5).astype(np.float32))


def label_too_large(root: Path) -> None:
    arrays(root, "d", rng_images(5, 9), np.array([0, 1, 2, 3, 0]))


def negative_label(root: Path) -> None:
    arrays(root, "d", rng_images(5, 9), np.array([0, 1, -1, 0, 0]))


def nan_feature(root: Path) -> None:
    x = np.zeros((5, 4, 4), np.float32)
    x[3, 1, 1] = np.nan
    arrays(root, "d", x, labels(5))


def inf_in_test(root: Path) -> None:
    x = np.zeros((5, 4, 4), np.float32)
    arrays(root, "d", x, labels(5))
    x[0, 0, 0] = np.inf
    arrays(root, "d", x, labels(5), "test")


def no_y(root: Path) -> None:
    (root / "d").mkdir()
    np.savez(root / "d" / "train.npz", x=rng_images(5, 9))


def integer_features(root: Path) -> None:
    arrays(root, "d", np.ones((5, 4, 4), np.int64), labels(5))


def cluster_missing(root: Path) -> None:
    (root / "clusters.json").write_text(json.dumps({"a": 0, "b": 1}))


BAD: dict[str, tuple[Callable[[Path], None], str, str | None, str]] = {
    "clusters.json names an unknown client": (missing_client, "clusters.json", "ghost", "no data"),
    "clusters.json leaves a client out": (cluster_missing, "clusters.json", "c", "has no cluster"),
    "empty client folder": (empty_folder, "d", "d", "neither train.npz"),
    "0 samples": (no_samples, "d/train.npz", "d", "0 sample(s)"),
    "1 sample": (one_sample, "d/train.npz", "d", "1 sample(s)"),
    "sample shapes differ": (other_shape, "d/train.npz", "d", "one shape"),
    "labels not integers": (float_labels, "d/train.npz", "d", "must be integers"),
    "label outside 0..C-1": (label_too_large, "d/train.npz", "d", "outside 0..2"),
    "negative label": (negative_label, "d/train.npz", "d", "negative label -1"),
    "NaN features": (nan_feature, "d/train.npz", "d", "NaN or infinite values in 1 sample(s), the first at index 3"),
    "infinite test features": (inf_in_test, "d/test.npz", "d", "NaN or infinite"),
    "no labels in the file": (no_y, "d/train.npz", "d", "has no array y"),
    "integer features": (integer_features, "d/train.npz", "d", "float or uint8"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_naming_file_and_client_everywhere(case: str, tmp_path: Path) -> None:
    damage, file, client, words = BAD[case]
    root = three_clients(tmp_path / "fed")
    damage(root)
    with pytest.raises(FolderDataError) as raised:
        read_folder_federation(root, seed=0, test_fraction=0.2, classes=3)
    message = str(raised.value)
    assert str(root / file) in message and words in message
    if client is not None:
        assert f"(client {client})" in message
    problems = inspect_folder(root, classes=3).problems
    assert [(str(p.file), p.client) for p in problems] == [(str(root / file), client)]
    shown = runner.invoke(app, ["data", "inspect", str(root), "--classes", "3"])
    assert shown.exit_code == 1 and "1 problem(s)" in shown.output and f"client {client}" in shown.output
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"clusters": 2, "data": {"source": "folder", "path": str(root), "classes": 3},
                                   "model": {"hidden": 8}}))
    checked = runner.invoke(app, ["validate", str(cfg)])
    assert checked.exit_code == 2 and "invalid data" in checked.output and words in checked.output.replace("\n", "")


def test_a_named_client_without_a_folder_and_a_folder_of_no_clients_are_refused(tmp_path: Path) -> None:
    root = three_clients(tmp_path / "fed")
    with pytest.raises(FolderDataError, match=r"fed/z \(client z\): no such client folder"):
        read_folder_federation(root, seed=0, test_fraction=0.2, clients=["a", "z"])
    (tmp_path / "none").mkdir()
    with pytest.raises(FolderDataError, match="holds no clients"):
        list_client_ids(tmp_path / "none")
    report = inspect_folder(tmp_path / "absent")
    assert not report.ok and "no such folder" in report.problems[0].text


def test_every_problem_is_listed_not_only_the_first(tmp_path: Path) -> None:
    root = three_clients(tmp_path / "fed")
    one_sample(root)
    arrays(root, "e", rng_images(5, 9), labels(5).astype(np.float64))
    with pytest.raises(FolderDataError) as raised:
        read_folder_federation(root, seed=0, test_fraction=0.2)
    assert len(raised.value.problems) == 2 and str(raised.value).startswith("2 problems:")


def test_an_image_label_folder_must_be_a_class_index(tmp_path: Path) -> None:
    write_png(tmp_path / "fed" / "a" / "train" / "cat" / "0.png", rng_images(1, 0)[0])
    with pytest.raises(FolderDataError, match=r"a/train/cat \(client a\): label folder 'cat' is not an integer"):
        read_folder_federation(tmp_path / "fed", seed=0, test_fraction=0.2)


def test_a_table_without_its_label_column_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("client,f0\na,1.0\na,2.0\n")
    with pytest.raises(FolderDataError, match=r"t.csv: has no column 'label'"):
        read_folder_federation(tmp_path / "t.csv", seed=0, test_fraction=0.2)


# -- config ---------------------------------------------------------------------------------------------------------
def config_file(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"clusters": 2, "data": data}))
    return path


def test_the_config_takes_the_client_count_from_the_folder(tmp_path: Path) -> None:
    root = three_clients(tmp_path / "fed")
    cfg = load_config(config_file(tmp_path, {"source": "folder", "path": str(root)}))
    assert cfg.data.clients == 3 and cfg.data.source == "folder"
    assert parse_config(cfg.model_dump()).data == cfg.data  # a worker's re-parse agrees
    with pytest.raises(ConfigError, match=r"data.clients: 5, but .*fed holds 3 clients"):
        load_config(config_file(tmp_path, {"source": "folder", "path": str(root), "clients": 5}))
    with pytest.raises(ConfigError, match=r"data.path: .*absent: no such folder"):
        load_config(config_file(tmp_path, {"source": "folder", "path": str(tmp_path / "absent")}))


@pytest.mark.parametrize("data,field", [
    ({"source": "folder"}, "data.path"),
    ({"path": "somewhere"}, "data.path"),
    ({"classes": 10}, "data.classes"),
    ({"source": "workers", "path": "somewhere"}, "data.path"),
    ({"source": "folder", "path": "x", "rotations": [0, 90]}, "data.rotations"),
    ({"source": "workers", "dataset": "digits"}, "data.dataset"),
    ({"source": "bucket"}, "data.source"),
])
def test_data_source_rules_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config({"clusters": 2, "data": data})


def test_data_source_workers_needs_no_path() -> None:
    assert parse_config({"clusters": 2, "data": {"source": "workers"}}).data.path is None


# -- export ---------------------------------------------------------------------------------------------------------
BUILTIN = {
    "rotations with mixtures": {"clusters": 2, "algorithm": "fedspd", "data": {
        "dataset": "digits", "clients": 6, "rotations": [0, 90], "mixture": True, "train_per_client": 20,
        "test_per_client": 5}},
    "dirichlet": {"clusters": 2, "algorithm": "dpmm_cfl", "data": {
        "dataset": "digits", "clients": 6, "partition": "dirichlet", "groups": 2, "train_per_client": 20,
        "test_per_client": 5}},
    "class_split": {"clusters": 2, "algorithm": "fesem", "data": {
        "dataset": "digits", "clients": 6, "partition": "class_split", "groups": 2, "train_per_client": 20,
        "test_per_client": 5}},
    "categories": {"algorithm": "fedcref", "data": {"dataset": "digits", "clients": 6, "samples_per_category": 20}},
    "blobs": {"algorithm": "fedkmeans", "clusters": 3, "data": {
        "dataset": "blobs", "clients": 6, "train_per_client": 20, "test_per_client": 5}},
}


@pytest.mark.parametrize("name", list(BUILTIN))
def test_every_builtin_federation_exports_and_reads_back(name: str, tmp_path: Path) -> None:
    from dfca.data import build_federated_data

    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(BUILTIN[name]))
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "export", str(config), str(out)])
    assert result.exit_code == 0, result.output
    built = build_federated_data(load_config(config))
    read = read_folder_federation(out, seed=0, test_fraction=0.2, classes=built.num_classes)
    assert read.client_names == tuple(f"client-{i:03d}" for i in range(6))
    assert read.true_cluster.tolist() == built.true_cluster.tolist() and read.input_shape == built.input_shape
    for i in range(6):  # every client's real samples (FedCRef's padding rows, labelled -1, are not written)
        real = built.y_train[i] >= 0
        assert torch.equal(read.x_train[i, : read.train_sizes[i]], built.x_train[i][real])
        assert torch.equal(read.y_test[i, : read.test_sizes[i]], built.y_test[i][built.y_test[i] >= 0])
    runs = (out / "experiment.yaml").exists()
    assert runs == (name != "categories")  # FedCRef needs its own built-in split: said, and no experiment.yaml
    if runs:
        assert load_config(out / "experiment.yaml").data.clients == 6
    else:
        assert "fedcref does not run from a folder" in result.output
