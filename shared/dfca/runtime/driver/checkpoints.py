"""A worker's checkpoints: a copy of its state taken between rounds, written atomically, off the round loop.

A checkpoint is the hosted rows' state after a round (safetensors) with metadata; `write` puts it at its path
atomically (a temporary file, then a rename over the old one). The rename over an existing file makes ext4
start writing the new file's data back at once (`auto_da_alloc`), so a checkpoint costs a few milliseconds of
the round loop's time that no message is waiting for. `CheckpointWriter` writes each one on a thread of its own
while the next round runs, and only then does what must follow it: acknowledging the messages the checkpoint
holds (a worker killed before that gets them again from the broker and resumes from the checkpoint before).
They are written one at a time and land in order; the round loop waits only while `PENDING` of them are not done
(1 by default: a round's end waits for the write before it; with more, a round ends while a write still waits for
its round's publisher confirms, a broker's fsync, at the cost of another copy of the clients' state).
A message driver's checkpoint (`driver_checkpoint`, `read_driver_checkpoint`) also holds the round, the hosted ids
and the identities of the messages used in that round: a message folded before the checkpoint but not yet
acknowledged comes back after a crash, and must be a duplicate then, not a late message merged a second time.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dfca.runtime.driver.ledger import Identity
from dfca.wire.safetensors_layout import chunks

log = logging.getLogger(__name__)

PENDING = 1  # checkpoints submitted and not done before `submit` waits: the one being written


@dataclass(frozen=True)
class Checkpoint:
    """State tensors (CPU copies no one else changes) and string metadata, as one safetensors file holds them."""

    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str]

    def write(self, path: Path) -> None:
        """Atomically: a reader sees the previous checkpoint or this one, whole."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp, buffers = path.with_suffix(".tmp"), chunks(self.tensors, self.metadata)
        with tmp.open("wb", buffering=0) as f:
            for chunk in buffers:
                view = memoryview(chunk).cast("B")
                while view:  # a raw write may take less than it was given
                    view = view[f.write(view):]
        tmp.replace(path)


def driver_checkpoint(state: Mapping[str, torch.Tensor], t: int, experiment: str, clients: list[int],
                      seen: Iterable[Identity]) -> Checkpoint:
    """A driver's state after round t, copied (the next round may change it while it is written), with the
    identities used in that round."""
    tensors = {n: v.detach().to("cpu", copy=True).contiguous() for n, v in state.items()}
    meta = {"round": str(t), "experiment": experiment, "clients": json.dumps(clients), "seen": json.dumps(sorted(seen))}
    return Checkpoint(tensors, meta)


@dataclass(frozen=True)
class DriverCheckpoint:
    """What `read_driver_checkpoint` restores: the state, the last completed round and the identities it used."""

    tensors: dict[str, torch.Tensor]
    round: int
    seen: set[Identity]


def read_driver_checkpoint(path: Path, experiment: str, clients: list[int]) -> DriverCheckpoint:
    """A driver's checkpoint; ValueError if it belongs to another experiment or client set."""
    with safe_open(str(path), "pt") as f:
        meta: Mapping[str, str] = f.metadata()
    if meta.get("experiment") != experiment or json.loads(meta["clients"]) != clients:
        raise ValueError(f"checkpoint {path} belongs to another experiment or client set")
    seen = {(int(r), int(sd), int(t), str(x), int(st), int(pt)) for r, sd, t, x, st, pt in
            json.loads(meta.get("seen", "[]"))}
    return DriverCheckpoint(load_file(str(path)), int(meta["round"]), seen)


class Job(NamedTuple):
    """A submitted checkpoint: what precedes its write, it, and what follows; `epoch`: CheckpointWriter._epoch."""

    epoch: int
    first: Callable[[], object]
    checkpoint: Checkpoint
    then: Callable[[], object]


class CheckpointWriter:
    """Writes a runner's checkpoints to `path` on a thread of its own, in the order submitted; before a write, runs
    what must precede it (awaiting the confirms of the round's messages), after it, what was submitted with it (the
    acks of the messages it holds). `submit` returns at once unless `pending` checkpoints are not done yet (each
    holds a copy of the state). An error of a write, or of what follows it, is raised by the first `submit` or `wait`
    after it happened, and the checkpoints submitted after it and before that are dropped unwritten, their acks unsent
    (the broker redelivers those messages to the worker that resumes from the last checkpoint on disk). The thread
    lives until `close`: starting one per checkpoint made the round loop wait 2-5 ms a round for it to be scheduled
    on this busy 2-core machine."""

    def __init__(self, path: Path, pending: int = PENDING) -> None:
        if pending < 1:
            raise ValueError("pending must be at least 1")
        self.path = path
        self.pending = pending
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._unfinished = 0  # submitted and not done (written and followed, failed or dropped)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._epoch = 0  # how many errors were raised so far: a job submitted before one was raised is of its epoch
        self._failed_epoch = -1  # the epoch of the last job that failed: the later ones of its epoch are dropped

    def submit(self, checkpoint: Checkpoint, then: Callable[[], object],
               first: Callable[[], object] = lambda: None) -> None:
        """After those submitted before: call `first`, write `checkpoint`, then call `then`."""
        self._wait_below(self.pending)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"checkpoint-{self.path.name}", daemon=True)
            self._thread.start()
        with self._done:
            self._unfinished += 1
            epoch = self._epoch
        self._jobs.put(Job(epoch, first, checkpoint, then))

    def wait(self) -> None:
        """Until every checkpoint submitted (and what follows it) is done; raises the error of one, if one failed."""
        self._wait_below(1)

    def wait_quietly(self) -> None:
        """`wait`, logging an error instead of raising it (the runner is ending for another reason)."""
        try:
            self.wait()
        except Exception as err:
            log.warning("checkpoint %s or the acks after it failed: %s", self.path, err)

    def close(self) -> None:
        """Finish the writes submitted (quietly) and end the thread."""
        self.wait_quietly()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _wait_below(self, limit: int) -> None:
        """Until fewer than `limit` checkpoints are not done; then raises a failed one's error, once."""
        with self._done:
            self._done.wait_for(lambda: self._unfinished < limit)
            error, self._error = self._error, None
            if error is not None:
                self._epoch += 1
        if error is not None:
            raise error

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if job.epoch != self._failed_epoch:  # else submitted behind a failed one, before its error was raised
                    job.first()
                    job.checkpoint.write(self.path)
                    job.then()
            except BaseException as err:  # handed to the runner's thread
                with self._done:
                    self._error, self._failed_epoch = err, job.epoch
            finally:
                with self._done:
                    self._unfinished -= 1
                    self._done.notify_all()
