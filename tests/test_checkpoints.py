"""A worker's checkpoints: the file format, atomic replacement, and the writer that acks after each write."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from dfca.runtime.driver.checkpoints import Checkpoint, CheckpointWriter

STATE = {
    "params.w1": torch.randn(3, 2, 5, 4, generator=torch.Generator().manual_seed(0)),
    "weight": torch.rand(3, 2, dtype=torch.float64),
    "assigned": torch.arange(3),
    "scalar": torch.tensor(2.5),
    "mask": torch.tensor([True, False, True]),
    "half": torch.randn(4).bfloat16(),
    "codes": torch.tensor([-127, 0, 127], dtype=torch.int8),
    "empty": torch.zeros(0, 4),
}
META = {"round": "7", "experiment": "exp", "seen": "[[1, 2, 3]]"}


def test_a_checkpoint_is_the_safetensors_file_of_its_state(tmp_path: Path) -> None:
    """Every dtype and shape a state holds (0-d, empty, bfloat16) loads back exactly, with the metadata, through
    safetensors itself; the same tensors as safetensors' own writer gives."""
    path = tmp_path / "exp" / "0.safetensors"
    Checkpoint(STATE, META).write(path)
    back, reference = load_file(str(path)), save(STATE, metadata=META)
    assert set(back) == set(STATE)
    for name, value in STATE.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == META
    (tmp_path / "ref.safetensors").write_bytes(reference)
    assert all(torch.equal(load_file(str(tmp_path / "ref.safetensors"))[n], back[n]) for n in STATE)
    assert not path.with_suffix(".tmp").exists()
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        Checkpoint({"t": torch.randn(4, 3).t()}, META).write(tmp_path / "other.safetensors")
    assert not (tmp_path / "other.tmp").exists()


def test_the_writer_acks_each_round_after_its_checkpoint_is_on_disk_in_order(tmp_path: Path) -> None:
    """What follows a checkpoint (the runner's acks) runs only once that checkpoint is the file on disk, and the
    writes land in the order submitted: every `then` finds its own round in the file."""
    path = tmp_path / "0.safetensors"
    writer = CheckpointWriter(path)
    seen: list[tuple[int, str]] = []

    def round_on_disk() -> str:
        with safe_open(str(path), "pt") as f:
            return str(f.metadata()["round"])

    for round_ in range(5):
        writer.submit(Checkpoint({"w": torch.full((1000,), float(round_))}, {"round": str(round_)}),
                      lambda r=round_: seen.append((r, round_on_disk())))
    writer.wait()
    assert seen == [(r, str(r)) for r in range(5)]
    assert torch.equal(load_file(str(path))["w"], torch.full((1000,), 4.0))


def test_the_writer_runs_off_the_callers_thread(tmp_path: Path) -> None:
    """submit returns while what follows the write is held up (on another thread, the same for every write); wait
    returns once it is done; close ends the thread."""
    started, release, threads = threading.Event(), threading.Event(), []

    def then() -> None:
        threads.append(threading.current_thread())
        started.set()
        release.wait(5)

    writer = CheckpointWriter(tmp_path / "0.safetensors")
    writer.submit(Checkpoint({"w": torch.zeros(3)}, {}), then)
    assert started.wait(5) and (tmp_path / "0.safetensors").exists()  # written, its `then` blocked, we are here
    release.set()
    writer.wait()
    writer.submit(Checkpoint({"w": torch.ones(3)}, {}), lambda: threads.append(threading.current_thread()))
    writer.close()  # waits for that write and ends the one thread both ran on
    assert threads[0] is threads[1] is not threading.current_thread() and not threads[0].is_alive()
    assert torch.equal(load_file(str(tmp_path / "0.safetensors"))["w"], torch.ones(3))


def test_a_failed_write_or_ack_is_raised_by_the_next_call(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint that cannot be written is raised by the next submit (or wait), and nothing after it ran;
    `wait_quietly` logs it instead."""
    (tmp_path / "blocked").write_text("a file where the checkpoint's folder should be")
    writer = CheckpointWriter(tmp_path / "blocked" / "0.safetensors", pending=1)
    acked: list[int] = []
    writer.submit(Checkpoint({"w": torch.zeros(3)}, {}), lambda: acked.append(1))
    with pytest.raises(OSError):
        writer.submit(Checkpoint({"w": torch.zeros(3)}, {}), lambda: acked.append(2))
    assert acked == []

    def failing_ack() -> None:
        raise ConnectionError("the broker went away")

    writer = CheckpointWriter(tmp_path / "ok.safetensors")
    writer.submit(Checkpoint({"w": torch.zeros(3)}, {}), failing_ack)
    with pytest.raises(ConnectionError):
        writer.wait()
    writer.wait()  # raised once
    writer.submit(Checkpoint({"w": torch.zeros(3)}, {}), failing_ack)
    with caplog.at_level(logging.WARNING, logger="dfca.runtime.driver.checkpoints"):
        writer.wait_quietly()
    assert "the broker went away" in caplog.text


def test_what_must_precede_a_checkpoint_runs_first_and_a_failure_stops_it(tmp_path: Path) -> None:
    """`first` (the runner's: awaiting the round's publisher confirms) runs before the checkpoint is written; if it
    fails (a confirm did not come), that checkpoint is not written, its acks are not sent, and the error is raised
    by the next call."""
    path = tmp_path / "0.safetensors"
    writer = CheckpointWriter(path)
    order: list[str] = []
    writer.submit(Checkpoint({"w": torch.zeros(3)}, {"round": "0"}), lambda: order.append("acks 0"),
                  first=lambda: order.append(f"confirms 0, on disk: {path.exists()}"))
    writer.wait()
    assert order == ["confirms 0, on disk: False", "acks 0"]

    def unconfirmed() -> None:
        raise TimeoutError("publish not confirmed within 60 s")

    writer.submit(Checkpoint({"w": torch.ones(3)}, {"round": "1"}), lambda: order.append("acks 1"), first=unconfirmed)
    with pytest.raises(TimeoutError):
        writer.wait()
    assert order == ["confirms 0, on disk: False", "acks 0"]
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["round"] == "0"  # round 1's checkpoint was not written: a restart redoes round 1


def test_the_writer_holds_up_the_round_loop_only_past_its_pending_checkpoints(tmp_path: Path) -> None:
    """With two pending, a submit returns while the write before it is held up (its confirms awaited), and the next
    waits until one of the two is done; they still land in order."""
    release, order = threading.Event(), []
    writer = CheckpointWriter(tmp_path / "0.safetensors", pending=2)
    writer.submit(Checkpoint({"w": torch.zeros(3)}, {}), lambda: order.append(0), first=lambda: release.wait(5))
    writer.submit(Checkpoint({"w": torch.ones(3)}, {}), lambda: order.append(1))  # returns: one is pending
    third = threading.Thread(target=lambda: writer.submit(Checkpoint({"w": torch.full((3,), 2.0)}, {}),
                                                          lambda: order.append(2)))
    third.start()
    third.join(0.3)
    assert third.is_alive() and order == []  # two pending: the third submit waits
    release.set()
    third.join(5)
    writer.wait()
    assert order == [0, 1, 2]
    assert torch.equal(load_file(str(tmp_path / "0.safetensors"))["w"], torch.full((3,), 2.0))


def test_checkpoints_submitted_behind_a_failed_one_are_dropped_until_its_error_is_raised(tmp_path: Path) -> None:
    """A checkpoint submitted before the error of the one before it was raised is not written and its acks are not
    sent (its messages come back to the worker that resumes from the checkpoint on disk); one submitted after the
    error was raised is written."""
    release, acked = threading.Event(), []

    def failing_confirms() -> None:
        release.wait(5)
        raise ConnectionError("the broker went away")

    path = tmp_path / "0.safetensors"
    writer = CheckpointWriter(path, pending=2)
    writer.submit(Checkpoint({"w": torch.zeros(3)}, {}), lambda: acked.append(0), first=failing_confirms)
    writer.submit(Checkpoint({"w": torch.ones(3)}, {}), lambda: acked.append(1))
    release.set()
    with pytest.raises(ConnectionError):
        writer.wait()
    assert acked == [] and not path.exists()
    writer.submit(Checkpoint({"w": torch.full((3,), 2.0)}, {}), lambda: acked.append(2))
    writer.wait()
    assert acked == [2] and torch.equal(load_file(str(path))["w"], torch.full((3,), 2.0))
