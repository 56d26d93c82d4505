"""dfca.heap.keep_freed_memory: tensors allocated round after round reuse the memory freed by the last round instead
of fresh pages (each a page fault on its first write). Run in fresh interpreters: the setting is per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dfca.run_size import available_bytes, leaves_room

SCRIPT = """
import json, resource, sys
import torch
from dfca.heap import keep_freed_memory

torch.set_num_threads(1)
kept = keep_freed_memory(large_blocks=sys.argv[1] == "large") if sys.argv[1] != "default" else None
faults = []  # per round, per tensor: the page faults of its first write
for _ in range(12):  # rounds of a few large tensors of several sizes, two alive at a time, as a simulator round has
    alive, counts = [], []
    for mib in SIZES:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        alive.append(torch.empty(mib << 18).fill_(1.0))
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        alive = alive[-2:]
    del alive
    faults.append(counts)
again = keep_freed_memory(large_blocks=sys.argv[1] == "large") if kept else None
print(json.dumps({"kept": kept, "again": again, "faults": faults}))
"""
SIZES = (24, 8, 60, 16, 3, 200)  # MiB: four below the 32 MiB mmap threshold, two above (glibc would map those)
PAGES = [mib * 256 for mib in SIZES]  # 4 KiB pages each


def faults_by_round(mode: str) -> dict:
    script = SCRIPT.replace("SIZES", repr(SIZES))
    run = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="glibc's malloc: Linux only (elsewhere a no-op)")
LAST = slice(-4, None)  # the rounds after the heap has grown to fit


def large_pages(faults: list[list[int]]) -> int:
    return sum(r[i] for r in faults for i, mib in enumerate(SIZES) if mib > 32)


@LINUX
def test_rounds_of_large_tensors_reuse_freed_memory_once_the_heap_is_kept() -> None:
    default, kept = faults_by_round("default"), faults_by_round("keep")
    assert kept["kept"] is True and kept["again"] is True  # applied, and idempotent
    # by default glibc hands the blocks above its mmap threshold back every round: they fault afresh each time
    large = sum(PAGES[i] for i, mib in enumerate(SIZES) if mib > 32)
    assert min(sum(r) for r in default["faults"][LAST]) > 0.5 * large
    # kept, the heap grows for a few rounds and is then reused for the blocks below the threshold; the larger ones
    # are still mapped afresh
    assert sum(map(sum, kept["faults"][LAST])) - large_pages(kept["faults"][LAST]) < 0.02 * 4 * sum(PAGES), kept
    assert large_pages(kept["faults"][LAST]) > 0.5 * 4 * large, kept


@LINUX
def test_with_large_blocks_the_blocks_above_the_mmap_threshold_are_reused_too() -> None:
    kept = faults_by_round("large")
    assert kept["kept"] is True and kept["again"] is True
    assert sum(map(sum, kept["faults"][LAST])) < 0.02 * 4 * sum(PAGES), kept


def test_a_run_keeps_large_blocks_only_where_its_tensors_leave_half_the_memory_free() -> None:
    free = available_bytes("cpu")
    assert free is not None  # /proc/meminfo: the machines this runs on have one
    assert leaves_room(free // 4)  # (the memory available moves a little between the calls)
    assert not leaves_room(free) and not leaves_room(3 * free // 4)
