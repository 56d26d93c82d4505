"""Workers that hold their own data: what the topology service accepts, refuses and places (pure functions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dfca.runtime.control.placement import PlacementError, place, registration_refusal
from dfca.runtime.control.registry import DataRegistry
from dfca.runtime.protocol.holdings import ClientFacts, DataHoldings


def holdings(folder: str, *clients: str, shape: tuple[int, ...] = (1, 28, 28), classes: int = 10,
             clusters: dict[str, int] | None = None) -> DataHoldings:
    clusters = clusters or {}
    return DataHoldings(folder=folder, input_shape=list(shape), num_classes=classes,
                        clients=[ClientFacts(id=c, train=20 + 10 * i, test=5, cluster=clusters.get(c))
                                 for i, c in enumerate(clients)])


A = holdings("/data/a", "site-b", "site-d", clusters={"site-b": 0, "site-d": 1})
B = holdings("/data/b", "site-a", "site-c", "site-e", clusters={"site-a": 1, "site-c": 0, "site-e": 1})


def test_clients_are_indexed_by_id_on_the_worker_that_holds_them() -> None:
    placement = place({0: A, 1: B})
    assert placement.client_ids == ["site-a", "site-b", "site-c", "site-d", "site-e"]
    assert placement.hosts == [1, 0, 1, 0, 1]
    assert placement.clients_of(0) == [1, 3] and placement.clients_of(1) == [0, 2, 4]
    assert placement.ids_of(1) == ["site-a", "site-c", "site-e"]
    assert placement.true_clusters == [1, 0, 0, 1, 1]
    assert placement.train_counts == [20, 20, 30, 30, 40]
    assert placement.input_shape == [1, 28, 28] and placement.num_classes == 10


def test_true_clusters_only_when_every_client_has_one() -> None:
    partly = holdings("/data/c", "site-f")  # no clusters.json
    assert place({0: A, 2: partly}).true_clusters is None


def test_classes_are_the_most_any_worker_has() -> None:
    few = holdings("/data/c", "site-f", classes=4)
    assert place({0: A, 1: few}).num_classes == 10


def test_nothing_to_place_and_shapes_that_differ_are_refused() -> None:
    with pytest.raises(PlacementError, match="no worker holding data has registered"):
        place({})
    odd = holdings("/data/c", "site-f", shape=(3, 32, 32))
    with pytest.raises(PlacementError, match=r"worker 1 \(/data/c\) holds samples of shape \(3, 32, 32\)"):
        place({0: A, 1: odd})


def test_a_client_held_by_two_workers_is_refused_naming_both() -> None:
    twin = holdings("/data/b", "site-a", "site-d")
    reason = registration_refusal(1, twin, {0: A}, {})
    assert reason is not None
    assert "worker 1 (/data/b) holds client 'site-d', which worker 0 (/data/a) holds too" in reason


def test_a_client_listed_twice_is_refused() -> None:
    reason = registration_refusal(0, holdings("/d", "x", "x"), {}, {})
    assert reason == "worker 0 lists client 'x' twice"


def test_a_restarted_worker_with_the_same_clients_is_accepted_and_with_others_refused() -> None:
    placement = place({0: A, 1: B})
    placed = {0: ("exp-1", placement), 1: ("exp-1", placement)}
    assert registration_refusal(0, A, {1: B}, placed) is None
    other = holdings("/data/a2", "site-b", "site-z")
    reason = registration_refusal(0, other, {1: B}, placed)
    assert reason is not None
    assert "worker 0 was restarted with other clients than experiment exp-1 placed on it" in reason
    assert "new 'site-z'" in reason and "missing 'site-d'" in reason
    assert registration_refusal(0, other, {1: B}, {}) is None  # no experiment uses it: the new folder is taken


def test_a_restarted_worker_whose_data_no_longer_fits_the_model_is_refused() -> None:
    placement = place({0: A, 1: B})
    wider = holdings("/data/a", "site-b", "site-d", classes=12)
    reason = registration_refusal(0, wider, {1: B}, {0: ("exp-1", placement)})
    assert reason is not None and "labels up to 11, the experiment's model has 10 classes (experiment exp-1)" in reason
    reshaped = holdings("/data/a", "site-b", "site-d", shape=(28, 28))
    reason = registration_refusal(0, reshaped, {1: B}, {0: ("exp-1", placement)})
    assert reason is not None and "shape (28, 28), the experiment's model takes (1, 28, 28)" in reason


def test_the_register_keeps_the_first_holder_and_blocks_placement_while_a_worker_is_refused() -> None:
    registry = DataRegistry()
    assert registry.register(0, A, {}, present={0}) is None
    twin = holdings("/data/b", "site-a", "site-b")
    assert registry.register(1, twin, {}, present={0, 1}) is not None
    assert set(registry.holdings) == {0}
    with pytest.raises(PlacementError, match="worker 1 is refused: worker 1 .* holds client 'site-b'"):
        registry.placement_for({0, 1})
    assert registry.view()["data_refused"]["1"].startswith("worker 1 (/data/b) holds client 'site-b'")
    assert registry.register(1, B, {}, present={0, 1}) is None  # its folder fixed: accepted
    assert registry.placement_for({0, 1}).num_clients == 5
    assert registry.view()["data_refused"] == {}


def test_a_worker_gone_for_good_does_not_hold_its_clients_against_a_newcomer() -> None:
    registry = DataRegistry()
    registry.register(0, A, {}, present={0})
    assert registry.register(1, A.model_copy(update={"folder": "/moved"}), {}, present={1}) is None


def test_starting_needs_every_placing_worker_up_with_the_same_clients() -> None:
    registry = DataRegistry()
    registry.register(0, A, {}, present={0, 1})
    registry.register(1, B, {}, present={0, 1})
    placement = registry.placement_for({0, 1})
    registry.check_placement_holds("exp-1", placement, {0, 1}, workers=2)
    with pytest.raises(PlacementError, match="worker 1, which holds 3 of experiment exp-1's clients, is not up"):
        registry.check_placement_holds("exp-1", placement, {0}, workers=2)
    with pytest.raises(PlacementError, match="places clients on worker 1, but the deployment runs 1 workers"):
        registry.check_placement_holds("exp-1", placement, {0, 1}, workers=1)
    registry.register(1, holdings("/data/b", "site-a"), {}, present={0, 1})  # its folder changed, nothing placed yet
    with pytest.raises(PlacementError, match="worker 1 now holds other clients"):
        registry.check_placement_holds("exp-1", placement, {0, 1}, workers=2)


def test_a_placed_worker_that_comes_back_without_data_is_refused() -> None:
    registry = DataRegistry()
    registry.register(0, A, {}, present={0})
    placement = registry.placement_for({0})
    reason = registry.register(0, None, {0: ("exp-1", placement)}, present={0})
    assert reason is not None and "came back without a data folder" in reason and "exp-1" in reason


def test_an_unfilled_data_volume_holds_no_clients_and_anything_else_must_be_a_federation(tmp_path: Path) -> None:
    """Compose and Kubernetes mount a data folder on every worker: a fresh, empty volume (lost+found, hidden
    entries) means the worker holds no clients of its own; a folder with anything else in it is read, and refused
    when it is not a federation."""
    from dfca.data import FolderDataError
    from dfca.runtime.worker.data_silo import read_silo

    volume = tmp_path / "volume"
    (volume / "lost+found").mkdir(parents=True)
    (volume / ".snapshot").mkdir()
    assert read_silo(str(volume), 0) is None
    assert read_silo(None, 0) is None
    (volume / "site-a").mkdir()
    with pytest.raises(FolderDataError, match="site-a"):
        read_silo(str(volume), 0)
