"""A worker's checkpoints: the file format, slots written in place and named atomically, a torn slot found out,
and the writer that acks after each checkpoint is named."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from dfca.runtime.driver.checkpoints import (
    INTEGRITY,
    Checkpoint,
    CheckpointSlots,
    CheckpointWriter,
    driver_checkpoint,
    read_driver_checkpoint,
    remove_checkpoint,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here"))]

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


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_is_the_safetensors_file_of_its_state(tmp_path: Path, device: str) -> None:
    """Every dtype and shape a state holds (0-d, empty, bfloat16, a transposed view, on the device) loads back
    exactly, with the metadata and the data's sum, through safetensors itself; the same tensors as safetensors' own
    writer gives."""
    path = tmp_path / "exp" / "0.safetensors"
    state = {**STATE, "transposed": torch.randn(4, 3).t()}
    Checkpoint({n: t.to(device) for n, t in state.items()}, META).write(path)
    back, reference = load_file(str(path)), save({n: t.contiguous() for n, t in state.items()}, metadata=META)
    assert set(back) == set(state)
    for name, value in state.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name
    with safe_open(str(path), "pt") as f:
        assert {n: v for n, v in f.metadata().items() if n != INTEGRITY} == META
    (tmp_path / "ref.safetensors").write_bytes(reference)
    assert all(torch.equal(load_file(str(tmp_path / "ref.safetensors"))[n], back[n]) for n in state)
    assert path.is_symlink() and os.readlink(path) == "0.slot0.safetensors"
    assert sorted(p.name for p in path.parent.iterdir()) == ["0.safetensors", "0.slot0.safetensors"]
    with pytest.raises(ValueError, match="dtype"):
        Checkpoint({"t": torch.zeros(2, dtype=torch.complex64)}, META).write(tmp_path / "other.safetensors")
    assert not (tmp_path / "other.safetensors").exists()


def test_checkpoints_alternate_between_two_slots_written_in_place(tmp_path: Path) -> None:
    """Each checkpoint goes to the slot the link does not name, into the same file (the same inode: written in
    place), and the link then names it; the state's layout changing (seeding's tensors, then training's) or its
    metadata outgrowing the header's room maps the slot anew, and every checkpoint still reads back whole."""
    path = tmp_path / "0.safetensors"
    slots = CheckpointSlots(path)
    inodes: dict[str, int] = {}
    for r in range(6):
        tensors = {"w": torch.full((1000,), float(r))} | ({"seed": torch.full((10,), float(r))} if r < 2 else {})
        seen = "[" + ",".join(["[1,2,3]"] * (10 if r < 4 else 5000)) + "]"  # r = 4 outgrows the header's room
        slots.name(slots.put(Checkpoint(tensors, {"round": str(r), "seen": seen})))
        assert os.readlink(path) == f"0.slot{r % 2}.safetensors"
        target = path.parent / os.readlink(path)
        if r in (3, 5):  # the same layout as two checkpoints before: the same file, written in place
            assert target.stat().st_ino == inodes[target.name]
        inodes[target.name] = target.stat().st_ino
        back = load_file(str(path))
        assert set(back) == set(tensors) and torch.equal(back["w"], tensors["w"])
        with safe_open(str(path), "pt") as f:
            assert f.metadata()["round"] == str(r) and f.metadata()["seen"] == seen
    slots.close()
    remove_checkpoint(path)
    assert list(tmp_path.iterdir()) == []


def test_a_restored_state_is_a_copy_the_next_checkpoints_leave_alone(tmp_path: Path) -> None:
    """safetensors maps the file it loads; a slot is written again in place two checkpoints later, so what a
    restart loads must be copies."""
    path = tmp_path / "0.safetensors"
    writer = CheckpointWriter(path)
    writer.submit(driver_checkpoint({"w": torch.zeros(100)}, 0, "exp", [0, 1], []), lambda: None)
    writer.wait()
    restored = read_driver_checkpoint(path, "exp", [0, 1])
    for r in (1, 2, 3):
        writer.submit(driver_checkpoint({"w": torch.full((100,), float(r))}, r, "exp", [0, 1], []), lambda: None)
    writer.close()
    assert restored.round == 0 and torch.equal(restored.tensors["w"], torch.zeros(100))
    assert read_driver_checkpoint(path, "exp", [0, 1]).round == 3


def test_a_slot_a_crash_left_partly_written_is_passed_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A machine that crashes loses the pages it had not written back: the slot the link names may then hold some
    of its checkpoint and some of the one two rounds before. Its data does not add up to its header's sum, so the
    reader takes the newest whole slot, and says so; with no whole slot it refuses."""
    path = tmp_path / "0.safetensors"
    writer = CheckpointWriter(path)
    for r in range(3):
        writer.submit(driver_checkpoint({"w": torch.full((4096,), float(r))}, r, "exp", [0], []), lambda: None)
    writer.close()
    named = path.parent / os.readlink(path)
    raw = bytearray(named.read_bytes())
    raw[-4096:] = torch.full((1024,), 0.0).numpy().tobytes()  # its last page as round 0 left it
    named.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="dfca.runtime.driver.checkpoints"):
        restored = read_driver_checkpoint(path, "exp", [0])
    assert restored.round == 1 and torch.equal(restored.tensors["w"], torch.full((4096,), 1.0))
    assert "not whole" in caplog.text and "resumes from round 1" in caplog.text
    assert os.readlink(path) == "0.slot1.safetensors"  # named again: the next checkpoint overwrites the torn one
    writer = CheckpointWriter(path)
    writer.submit(driver_checkpoint({"w": torch.full((4096,), 2.0)}, 2, "exp", [0], []), lambda: None)
    writer.close()
    assert os.readlink(path) == named.name and read_driver_checkpoint(path, "exp", [0]).round == 2
    for slot in tmp_path.glob("0.slot*.safetensors"):
        slot.write_bytes(slot.read_bytes()[:-8] + bytes(8))
    with pytest.raises(ValueError, match="no whole checkpoint"):
        read_driver_checkpoint(path, "exp", [0])


KILLED_WRITER = """
import sys, torch
from pathlib import Path
from dfca.runtime.driver.checkpoints import CheckpointWriter, driver_checkpoint
torch.set_num_threads(1)
writer = CheckpointWriter(Path(sys.argv[1]))
state = {"w": torch.zeros(8, 2, 784, 64), "b": torch.zeros(8, 2, 64)}  # a worker's 3.2 MB
r = 0
while True:
    for t in state.values():
        t.fill_(float(r))
    writer.submit(driver_checkpoint(state, r, "exp", [0], []), lambda: None)
    if r == 0:
        writer.wait()
        print("first", flush=True)
    r += 1
"""


@pytest.mark.parametrize("after", [0.05, 0.2, 0.45])
def test_a_writer_killed_at_any_moment_leaves_a_whole_checkpoint(tmp_path: Path, after: float) -> None:
    """SIGKILL a process writing checkpoints as fast as it can, at three moments: the checkpoint at the path is
    whole (every value its round's), and its round is one the process reached."""
    path = tmp_path / "0.safetensors"
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "first"
        time.sleep(after)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    restored = read_driver_checkpoint(path, "exp", [0])
    assert restored.round >= 0
    for name, t in restored.tensors.items():
        assert torch.equal(t, torch.full_like(t, float(restored.round))), name


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
    """A checkpoint that cannot be written is raised by its submit, and nothing after it ran; an ack that fails, by
    the next submit (or wait); `wait_quietly` logs it instead."""
    (tmp_path / "blocked").write_text("a file where the checkpoint's folder should be")
    writer = CheckpointWriter(tmp_path / "blocked" / "0.safetensors", pending=1)
    acked: list[int] = []
    with pytest.raises(OSError):
        writer.submit(Checkpoint({"w": torch.zeros(3)}, {}), lambda: acked.append(1))
    writer.wait()
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
    """`first` (the runner's: awaiting the round's publisher confirms) runs before the checkpoint is named; if it
    fails (a confirm did not come), that checkpoint is not named, its acks are not sent, and the error is raised
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
        assert f.metadata()["round"] == "0"  # round 1's checkpoint was not named: a restart redoes round 1


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


def test_a_full_disk_is_raised_by_the_submit_and_names_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot's blocks are allocated before it is mapped: a disk that is full raises OSError from `submit` (a copy
    into a mapping of blocks that cannot be allocated would kill the process with SIGBUS instead), nothing is
    named, and the next checkpoint, once there is room, is written."""
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    path = tmp_path / "0.safetensors"
    writer = CheckpointWriter(path)
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        writer.submit(Checkpoint({"w": torch.zeros(3)}, {"round": "0"}), lambda: None)
    assert not path.exists()
    monkeypatch.undo()
    writer.submit(Checkpoint({"w": torch.ones(3)}, {"round": "1"}), lambda: None)
    writer.close()
    assert torch.equal(load_file(str(path))["w"], torch.ones(3))
