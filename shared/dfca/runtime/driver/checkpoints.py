"""A worker's checkpoints: its state after each round, copied into a file mapped in memory, named atomically.

A checkpoint is the hosted rows' state after a round (safetensors) with metadata. At `path` is a symbolic link to
one of a few slot files (`<stem>.slot0<suffix>`, `<stem>.slot1<suffix>`, ...: `CheckpointSlots`), the one that
holds the last whole checkpoint; a reader of `path` reads it as one safetensors file. A checkpoint is copied into
another slot, mapped in memory and written in place, and only then is the link replaced to name it (a new link
renamed over the old one). So a process killed at any moment leaves `path` naming a whole checkpoint: the last one
named, or before the first, none.
- Writing in place allocates no page and starts no writeback: the kernel writes a slot's dirty pages back when it
  flushes, seconds later, not every round. The copy into the mapping is the only copy: the state is not copied
  first and then written. Against a fresh file renamed over the old one (which made ext4 write every checkpoint
  back at once, `auto_da_alloc`), a worker's 3.3 MB checkpoint took 2.0 ms of CPU in place of 3.1 ms
  (`benchmarks/checkpoint_writes.py`).
- What a machine that crashes loses is what it had not written back. A slot the crash left partly written is
  found out: each slot's header holds a sum of its data (`integrity`), checked on reading, and the reader falls
  back to the newest other slot that is whole (a round earlier, whose round's messages the broker gets back only if
  they were not acknowledged).
`CheckpointWriter` names each checkpoint on a thread of its own while the next round runs, after what must
precede it (awaiting the round's publisher confirms) and before what must follow it: acknowledging the messages
the checkpoint holds (a worker killed before that gets them again from the broker and resumes from the checkpoint
before). They are named one at a time and in order; the round loop waits only while `PENDING` of them are not
done (1 by default: a round's end waits for the one before it; with more, a round ends while a checkpoint still
waits for its round's publisher confirms, a broker's fsync, at the cost of another slot).
A message driver's checkpoint (`driver_checkpoint`, `read_driver_checkpoint`) also holds the round, the hosted ids
and the identities of the messages used in that round: a message folded before the checkpoint but not yet
acknowledged comes back after a crash, and must be a duplicate then, not a late message merged a second time.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load

from dfca.runtime.driver.ledger import Identity
from dfca.wire.safetensors_layout import dtype_name, layout

log = logging.getLogger(__name__)

PENDING = 1  # checkpoints submitted and not done before `submit` waits: the one being named
INTEGRITY = "integrity"  # the metadata key of a slot's data sum, 20 digits
_UNSUMMED = f'"{INTEGRITY}":"{"0" * 20}"'.encode()  # the header's field before the data is summed
HEADER_ROOM = 4096  # a slot's header is padded to a multiple of this, a quarter more than it needs: the next
# checkpoint's metadata (the identities used, which vary round to round) fits in it, and its tensors stay put


@dataclass(frozen=True)
class Checkpoint:
    """State tensors (any device and layout) and string metadata, as one safetensors file holds them. The tensors
    are read when the checkpoint is put into a slot (`CheckpointSlots.put`, `write`), and only then."""

    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str]

    def write(self, path: Path) -> None:
        """Put at `path` at once: a reader sees the previous checkpoint or this one, whole."""
        slots = CheckpointSlots(path)
        try:
            slots.name(slots.put(self))
        finally:
            slots.close()


class Slot(NamedTuple):
    """A slot file mapped in memory, for checkpoints of one set of tensors (`signature`: names, dtypes, shapes)."""

    memory: mmap.mmap
    header: int  # bytes before the data: the 8-byte length and the padded JSON
    signature: tuple[tuple[str, str, tuple[int, ...]], ...]


def data_sum(memory: mmap.mmap | bytes, start: int, end: int) -> int:
    """The sum of bytes start..end as little-endian 64-bit words, modulo 2^64 (the tail's bytes added alone): what
    a torn write, some pages of this checkpoint and some of the one before, changes. 0.11 ms for 3.3 MB here."""
    words = (end - start) // 8
    total = int(np.frombuffer(memory, dtype="<u8", count=words, offset=start).sum(dtype=np.uint64)) if words else 0
    return (total + sum(memory[start + 8 * words:end])) % 2**64


class CheckpointSlots:
    """The checkpoint at `path`: a link to the one of `count` slot files that holds the last whole checkpoint. `put`
    copies a checkpoint into a slot that neither the link nor a checkpoint put and not yet named holds; `name`
    replaces the link to name it. `put` is called on one thread, `name` and `release` may be on another."""

    def __init__(self, path: Path, count: int = 2) -> None:
        if count < 2:
            raise ValueError("a checkpoint needs two slots at least: the one named and the one written")
        self.path, self.count = path, count
        self._slots: dict[int, Slot] = {}
        self._lock = threading.Lock()
        self._filling: set[int] = set()  # put and not yet named or released

    def slot_path(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.slot{index}{self.path.suffix}")

    def put(self, checkpoint: Checkpoint) -> int:
        """Copy `checkpoint` into a free slot, its data sum in its header; returns the slot's index."""
        with self._lock:  # the link read now: a restore may have named another slot since this was made
            index = min(set(range(self.count)) - {slot_index(self.path)} - self._filling)
            self._filling.add(index)
        try:
            self._fill(index, checkpoint)
        except BaseException:
            self.release(index)
            raise
        return index

    def name(self, index: int) -> None:
        """Replace the link at `path` by one to slot `index`, atomically."""
        name_slot(self.path, self.slot_path(index))
        with self._lock:
            self._filling.discard(index)

    def release(self, index: int) -> None:
        """Slot `index` was put and will not be named (what had to precede it failed)."""
        with self._lock:
            self._filling.discard(index)

    def close(self) -> None:
        """Unmap the slots (their files stay)."""
        for slot in self._slots.values():
            slot.memory.close()
        self._slots.clear()

    def _fill(self, index: int, checkpoint: Checkpoint) -> None:
        tensors = checkpoint.tensors
        entries = {n: (dtype_name(n, t), tuple(t.shape)) for n, t in tensors.items()}
        metadata = {**checkpoint.metadata, INTEGRITY: "0" * 20}  # the sum's room, before it is known
        slot = self._slots.get(index)
        file = layout(entries, metadata, slot.header if slot else 0)
        signature = tuple((e.name, e.dtype, e.shape) for e in file.entries)
        if slot is None or slot.signature != signature or len(file.prefix) > slot.header:
            slot = self._map(index, len(file.prefix), file.size - len(file.prefix), signature)
            file = layout(entries, metadata, slot.header)
        for entry in file.entries:
            t = tensors[entry.name]
            if t.numel():
                torch.frombuffer(slot.memory, dtype=t.dtype, count=t.numel(), offset=entry.start).view(
                    t.shape).copy_(t.detach())
        summed = f'"{INTEGRITY}":"{data_sum(slot.memory, slot.header, file.size):020d}"'.encode()
        slot.memory[:slot.header] = file.prefix.replace(_UNSUMMED, summed, 1)

    def _map(self, index: int, header: int, data: int, signature: tuple[tuple[str, str, tuple[int, ...]], ...]
             ) -> Slot:
        """Slot `index`'s file sized for these tensors and a header of at least `header` bytes, mapped anew."""
        if (old := self._slots.pop(index, None)) is not None:
            old.memory.close()
        header = -(-(header + header // 4) // HEADER_ROOM) * HEADER_ROOM
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.slot_path(index), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, header + data)
            reserve(fd, header + data)
            memory = mmap.mmap(fd, header + data)
        finally:
            os.close(fd)
        self._slots[index] = slot = Slot(memory, header, signature)
        return slot


def reserve(fd: int, size: int) -> None:
    """The file's blocks allocated now, so that a full disk raises OSError here, not SIGBUS at a copy into its
    mapping; where the system or file system cannot (macOS, some network file systems), nothing."""
    if size and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise


def name_slot(path: Path, slot: Path) -> None:
    """Point the link at `path` to `slot` (a file beside it): a new link renamed over the old one."""
    link = path.with_name(f"{path.name}.link")
    link.unlink(missing_ok=True)  # one a crash left between its creation and its rename
    os.symlink(slot.name, link)
    os.replace(link, path)


def slot_index(path: Path) -> int | None:
    """The slot the link at `path` names, or None (no link, or a file of another kind)."""
    try:
        target = os.readlink(path)
    except OSError:
        return None
    stem, _, rest = Path(target).name.removeprefix(f"{path.stem}.slot").partition(".")
    return int(stem) if stem.isdigit() and f".{rest}" == path.suffix else None


def slot_files(path: Path) -> list[Path]:
    """The slot files beside the link at `path` (`CheckpointSlots.slot_path`'s names)."""
    return list(path.parent.glob(f"{path.stem}.slot*{path.suffix}"))


def remove_checkpoint(path: Path) -> None:
    """The link at `path` and every slot file beside it."""
    path.unlink(missing_ok=True)
    for slot in slot_files(path):
        slot.unlink(missing_ok=True)


def whole_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (copies: the file is written again in place) and metadata of the checkpoint at `path`: the
    slot it names where that is whole, else the newest whole slot beside it (a crash left the named one partly
    written back), which the link then names, so that the next checkpoint overwrites the torn one; ValueError where
    none is. A file without a data sum (written otherwise) is taken as it is."""
    named = Path(os.path.realpath(path))
    others = [p for p in slot_files(path) if p.resolve() != named]
    found: list[tuple[int, Path, dict[str, torch.Tensor], dict[str, str]]] = []
    for candidate in (named, *others):
        try:  # read once: the tensors safetensors loads from bytes are copies of their own
            raw = candidate.read_bytes()
            header = 8 + int.from_bytes(raw[:8], "little")
            meta: dict[str, str] = dict(json.loads(raw[8:header]).get("__metadata__") or {})
            if INTEGRITY in meta and f"{data_sum(raw, header, len(raw)):020d}" != meta[INTEGRITY]:
                raise ValueError("its data does not add up to its header's sum")
            tensors = load(raw)
        except (OSError, ValueError, SafetensorError) as err:
            log.warning("checkpoint %s is not whole (%s): passed over", candidate, err)
            continue
        if candidate == named:
            return tensors, meta
        found.append((int(meta.get("round", -1)), candidate, tensors, meta))
    if not found:
        raise ValueError(f"no whole checkpoint at {path}")
    _, whole, tensors, meta = max(found, key=lambda f: f[0])
    name_slot(path, whole)
    log.warning("checkpoint %s resumes from round %s, the newest whole one", path, meta.get("round"))
    return tensors, meta


def driver_checkpoint(state: Mapping[str, torch.Tensor], t: int, experiment: str, clients: list[int],
                      seen: Iterable[Identity]) -> Checkpoint:
    """A driver's state after round t, with the identities used in that round: the state itself, which the
    checkpoint's `put` (or `write`) copies before the next round may change it."""
    tensors = {n: v.detach() for n, v in state.items()}
    meta = {"round": str(t), "experiment": experiment, "clients": json.dumps(clients), "seen": json.dumps(sorted(seen))}
    return Checkpoint(tensors, meta)


@dataclass(frozen=True)
class DriverCheckpoint:
    """What `read_driver_checkpoint` restores: the state, the last completed round and the identities it used."""

    tensors: dict[str, torch.Tensor]
    round: int
    seen: set[Identity]


def read_driver_checkpoint(path: Path, experiment: str, clients: list[int]) -> DriverCheckpoint:
    """A driver's checkpoint (`whole_checkpoint`); ValueError if it belongs to another experiment or client set, or
    none is whole."""
    tensors, meta = whole_checkpoint(path)
    if meta.get("experiment") != experiment or json.loads(meta["clients"]) != clients:
        raise ValueError(f"checkpoint {path} belongs to another experiment or client set")
    seen = {(int(r), int(sd), int(t), str(x), int(st), int(pt)) for r, sd, t, x, st, pt in
            json.loads(meta.get("seen", "[]"))}
    return DriverCheckpoint(tensors, int(meta["round"]), seen)


class Job(NamedTuple):
    """A submitted checkpoint: what precedes its naming, its slot, and what follows; `epoch`:
    CheckpointWriter._epoch."""

    epoch: int
    first: Callable[[], object]
    slot: int
    then: Callable[[], object]


class CheckpointWriter:
    """A runner's checkpoints at `path`: `submit` copies one into a slot (`CheckpointSlots`) on the caller's thread,
    and a thread of its own names them in the order submitted; before naming one, it runs what must precede it
    (awaiting the confirms of the round's messages), after, what was submitted with it (the acks of the messages it
    holds). `submit` returns once its copy is made unless `pending` checkpoints are not done yet (each holds a slot).
    An error of a copy is raised by its `submit`; one of what precedes or follows a naming by the first `submit` or
    `wait` after it happened, and the checkpoints submitted after it and before that are dropped unnamed, their acks
    unsent (the broker redelivers those messages to the worker that resumes from the last checkpoint named). The thread
    lives until `close`: starting one per checkpoint made the round loop wait 2-5 ms a round for it to be scheduled
    on this busy 2-core machine."""

    def __init__(self, path: Path, pending: int = PENDING) -> None:
        if pending < 1:
            raise ValueError("pending must be at least 1")
        self.path = path
        self.pending = pending
        self.slots = CheckpointSlots(path, pending + 1)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._unfinished = 0  # submitted and not done (written and followed, failed or dropped)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._epoch = 0  # how many errors were raised so far: a job submitted before one was raised is of its epoch
        self._failed_epoch = -1  # the epoch of the last job that failed: the later ones of its epoch are dropped

    def submit(self, checkpoint: Checkpoint, then: Callable[[], object],
               first: Callable[[], object] = lambda: None) -> None:
        """Copy `checkpoint` into a slot now; after those submitted before, call `first`, name it, then call `then`."""
        self._wait_below(self.pending)
        slot = self.slots.put(checkpoint)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"checkpoint-{self.path.name}", daemon=True)
            self._thread.start()
        with self._done:
            self._unfinished += 1
            epoch = self._epoch
        self._jobs.put(Job(epoch, first, slot, then))

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
        """Finish the checkpoints submitted (quietly), end the thread and unmap the slots."""
        self.wait_quietly()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        self.slots.close()

    def remove(self) -> None:
        """`close`, then delete the checkpoint: its link and its slots."""
        self.close()
        remove_checkpoint(self.path)

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
            named = False
            try:
                if job.epoch != self._failed_epoch:  # else submitted behind a failed one, before its error was raised
                    job.first()
                    self.slots.name(job.slot)
                    named = True
                    job.then()
            except BaseException as err:  # handed to the runner's thread
                with self._done:
                    self._error, self._failed_epoch = err, job.epoch
            finally:
                if not named:
                    self.slots.release(job.slot)
                with self._done:
                    self._unfinished -= 1
                    self._done.notify_all()
