"""A worker's checkpoints: a copy of its state taken between rounds, written atomically, off the round loop.

A checkpoint is the hosted rows' state after a round (safetensors) with metadata; `write` puts it at its path
atomically (a temporary file, then a rename over the old one). The rename over an existing file makes ext4
start writing the new file's data back at once (`auto_da_alloc`), so a checkpoint costs a few milliseconds of
the round loop's time that no message is waiting for. `CheckpointWriter` writes each one on a thread of its own
while the next round runs, and only then does what must follow it: acknowledging the messages the checkpoint
holds (a worker killed before that gets them again from the broker and resumes from the checkpoint before).
One write is in flight at a time and they land in order: the next `submit` waits for the one before.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dfca.safetensors_layout import chunks

log = logging.getLogger(__name__)


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


class CheckpointWriter:
    """Writes a runner's checkpoints to `path` on a thread of its own, one at a time and in order; before a write,
    runs what must precede it (awaiting the confirms of the round's messages), after it, what was submitted with it
    (the acks of the messages it holds). An error of a write, or of what follows
    it, is raised by the next `submit` or `wait`. The thread lives until `close`: starting one per checkpoint made
    the round loop wait 2-5 ms a round for it to be scheduled on this busy 2-core machine."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Checkpoint, Callable[[], object]] | None] = \
            queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, checkpoint: Checkpoint, then: Callable[[], object],
               first: Callable[[], object] = lambda: None) -> None:
        """After the one in flight: call `first`, write `checkpoint`, then call `then`."""
        self.wait()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"checkpoint-{self.path.name}", daemon=True)
            self._thread.start()
        self._idle.clear()
        self._jobs.put((first, checkpoint, then))

    def wait(self) -> None:
        """Until the write in flight (and what follows it) is done; raises its error, if it had one."""
        self._idle.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_quietly(self) -> None:
        """`wait`, logging an error instead of raising it (the runner is ending for another reason)."""
        try:
            self.wait()
        except Exception as err:
            log.warning("checkpoint %s or the acks after it failed: %s", self.path, err)

    def close(self) -> None:
        """Finish the write in flight (quietly) and end the thread."""
        self.wait_quietly()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            first, checkpoint, then = job
            try:
                first()
                checkpoint.write(self.path)
                then()
            except BaseException as err:  # handed to the runner's thread
                self._error = err
            finally:
                self._idle.set()
