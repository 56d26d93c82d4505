"""dfca.heap.keep_freed_memory: tensors allocated round after round reuse the memory freed by the last round instead
of fresh pages (each a page fault on its first write). Run in fresh interpreters: the setting is per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, resource, sys
import torch
from dfca.heap import keep_freed_memory

torch.set_num_threads(1)
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []  # per round, per tensor: the page faults of its first write
for _ in range(8):  # rounds of a few large tensors of several sizes, two alive at a time, as a simulator round has
    alive, counts = [], []
    for mib in SIZES:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        alive.append(torch.empty(mib << 18).fill_(1.0))
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        alive = alive[-2:]
    del alive
    faults.append(counts)
print(json.dumps({"kept": kept, "again": keep_freed_memory() if kept else None, "faults": faults}))
"""
SIZES = (24, 8, 60, 16, 3, 40)  # MiB: four below the 32 MiB mmap threshold (glibc reuses those anyway), two above
PAGES = [mib * 256 for mib in SIZES]  # 4 KiB pages each


def faults_by_round(mode: str) -> dict:
    script = SCRIPT.replace("SIZES", repr(SIZES))
    run = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only (elsewhere a no-op)")
def test_rounds_of_large_tensors_reuse_freed_memory_once_the_heap_is_kept() -> None:
    default, kept = faults_by_round("default"), faults_by_round("keep")
    assert kept["kept"] is True and kept["again"] is True  # applied, and idempotent
    last = slice(-4, None)
    # by default glibc hands the blocks above its mmap threshold back every round: they fault afresh each time
    assert min(sum(r) for r in default["faults"][last]) > 0.5 * sum(PAGES[i] for i, mib in enumerate(SIZES) if mib > 32)
    # kept, the heap grows for a few rounds and is then reused, the large blocks too where a freed block is large
    # enough (now and then glibc still maps one afresh: a round with the 60 MiB block's 15,360 faults)
    assert sum(map(sum, kept["faults"][last])) < 0.5 * sum(map(sum, default["faults"][last])), (kept, default)
