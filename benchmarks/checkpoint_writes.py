"""What a worker's checkpoint costs a round: slots written in place against a fresh file renamed over the old one.

A worker checkpoints its hosted clients' state after every round (runtime.driver.checkpoints). This times, for the
state of a worker of the runtime benchmark's 24-client config (8 clients, k=2, MLP h=64: 3.3 MB while training,
6.5 MB while seeding, when the seed candidates and the clients' local models are kept too), one checkpoint after
another with a pause between them as rounds have (`--pause`, 50 ms), alternating the two ways:
- `slots` (dfca's): `CheckpointSlots.put` copies the state into a slot file mapped in memory, its data summed into
  its header, and `name` points the link at it;
- `fresh file` (the former writer, kept here as the baseline): a copy of the state, then a new file written from
  that copy and renamed over the checkpoint (on ext4 the rename makes the kernel write the new file back at once).
Reports each way's CPU a checkpoint (this process, user and system, as the scheduler counts it), the machine's busy
CPU over the same time (what the kernel's writeback adds, and other work on a shared machine; counted in clock
ticks, so only the mean of many checkpoints means anything), and the bytes the disk was sent (/proc/diskstats,
every disk, from the first checkpoint to one second after the last). Every checkpoint is read back and compared.
Appends one line per way and state to --out, with the commit and the machine's load.

    python benchmarks/checkpoint_writes.py [--checkpoints 60] [--pause 0.05] [--dir DIR] [--out FILE]

`--dir` should be on the disk the checkpoints go to (DFCA_CHECKPOINT_DIR); a tmpfs there has no writeback to save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from resumable_runs import RESULTS, append_stamped
from safetensors.torch import load_file

from dfca.runtime.driver.checkpoints import Checkpoint, CheckpointSlots
from dfca.wire.safetensors_layout import chunks

SECTOR = 512


def worker_state(seeding: bool, clients: int = 8, k: int = 2, hidden: int = 64) -> dict[str, torch.Tensor]:
    """A worker's state in the runtime benchmark's config: k cluster models per client, and while seeding a seed
    candidate and a local model per client besides."""
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (784, hidden), "b1": (hidden,), "w2": (hidden, 10), "b2": (10,)}
    state = {f"params.{n}": torch.randn(clients, k, *s, generator=g) for n, s in shapes.items()}
    state |= {"losses": torch.rand(clients, k, generator=g), "assigned": torch.zeros(clients, dtype=torch.int64)}
    if seeding:
        for kept in ("seed.candidate", "seed.local"):
            state |= {f"{kept}.{n}": torch.randn(clients, *s, generator=g) for n, s in shapes.items()}
    return state


def metadata(r: int) -> dict[str, str]:
    """A round's metadata as a driver's checkpoint holds it: the identities used in the round among them."""
    seen = ",".join(f'[{i % 8},{i % 24},{r},"models",0,0]' for i in range(100))
    return {"round": str(r), "experiment": "bench", "clients": "[0,3,6,9,12,15,18,21]", "seen": f"[{seen}]"}


def fresh_file(path: Path) -> Callable[[Checkpoint], None]:
    """The former writer: the state copied, then written to a new file renamed over the checkpoint."""

    def write(checkpoint: Checkpoint) -> None:
        copied = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in checkpoint.tensors.items()}
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb", buffering=0) as f:
            for chunk in chunks(copied, checkpoint.metadata):
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[f.write(view):]
        tmp.replace(path)

    return write


def slots_of(path: Path) -> tuple[Callable[[Checkpoint], None], CheckpointSlots]:
    slots = CheckpointSlots(path)
    return (lambda checkpoint: slots.name(slots.put(checkpoint))), slots


def machine_busy() -> float:
    """CPU seconds the machine's cores have been busy (user, nice, system, irq, softirq)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def disk_bytes_written() -> int:
    """Bytes sent to every whole disk (not its partitions) since boot."""
    total = 0
    for line in Path("/proc/diskstats").read_text().splitlines():
        parts = line.split()
        name = parts[2]
        if Path(f"/sys/block/{name}").exists() and not name.startswith(("loop", "ram")):
            total += int(parts[9]) * SECTOR
    return total


def run(write: Callable[[Checkpoint], None], path: Path, state: dict[str, torch.Tensor], checkpoints: int,
        pause: float) -> dict[str, float]:
    """`checkpoints` checkpoints of `state` (changed between them, as a round changes it), each read back."""
    own = busy = 0.0
    disk_before = disk_bytes_written()
    for r in range(checkpoints):
        for t in state.values():
            if t.is_floating_point():
                t.add_(1)
        began, machine = time.process_time(), machine_busy()
        write(Checkpoint(state, metadata(r)))
        own += time.process_time() - began
        busy += machine_busy() - machine
        if r % 10 == 0:
            back = load_file(str(path))
            assert all(torch.equal(back[n], t) for n, t in state.items()), "a checkpoint did not read back"
        time.sleep(pause)
    time.sleep(1.0)
    return {"cpu_ms": 1e3 * own / checkpoints, "machine_busy_ms": 1e3 * busy / checkpoints,
            "disk_mb": (disk_bytes_written() - disk_before) / 1e6 / checkpoints}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=60)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds between checkpoints, as between rounds")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the two ways")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=Path(RESULTS) / "checkpoint_writes_runs.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a worker's
    load_before = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for seeding in (False, True):
            state = worker_state(seeding)
            size = sum(t.numel() * t.element_size() for t in state.values())
            figures: dict[str, list[dict[str, float]]] = {"slots": [], "fresh file": []}
            for repeat in range(args.repeats):
                for way in ("slots", "fresh file") if repeat % 2 == 0 else ("fresh file", "slots"):
                    path = Path(tmp) / f"{way.replace(' ', '_')}_{seeding}.safetensors"
                    if way == "slots":
                        write, slots = slots_of(path)
                        figures[way].append(run(write, path, state, args.checkpoints, args.pause))
                        slots.close()
                    else:
                        figures[way].append(run(fresh_file(path), path, state, args.checkpoints, args.pause))
            for way, runs in figures.items():
                row = {"way": way, "state": "seeding" if seeding else "training", "state_mb": size / 1e6,
                       "checkpoints": args.checkpoints, "pause_s": args.pause, "repeats": args.repeats,
                       **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
                rows.append(row)
    print(f"{'state':9s} {'way':11s} {'MB':>5s} {'CPU ms':>7s} {'machine ms':>11s} {'disk MB':>8s}  (a checkpoint, "
          f"median of {args.repeats})")
    for row in rows:
        print(f"{row['state']:9s} {row['way']:11s} {row['state_mb']:5.1f} {row['cpu_ms']:7.2f} "
              f"{row['machine_busy_ms']:11.2f} {row['disk_mb']:8.2f}")
    stamp = append_stamped(args.out, rows, load_before, cores=os.cpu_count(), dir=str(args.dir or "tmp"))
    print(f"appended to {args.out} (commit {stamp['commit']}, load {load_before:.2f} -> {stamp['load_after']:.2f})")


if __name__ == "__main__":
    main()
