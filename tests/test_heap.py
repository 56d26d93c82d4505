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
faults = []
for _ in range(8):  # rounds of a few large tensors of several sizes, two alive at a time, as a simulator round has
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    alive = []
    for mib in (24, 8, 60, 16, 3, 40):
        alive.append(torch.empty(mib << 18).fill_(1.0))
        alive = alive[-2:]
    del alive
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "again": keep_freed_memory() if kept else None, "faults": faults}))
"""
PAGES_A_ROUND = (24 + 8 + 60 + 16 + 3 + 40) * 256  # 4 KiB pages written each round


def faults_by_round(mode: str) -> dict:
    run = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only (elsewhere a no-op)")
def test_rounds_of_large_tensors_reuse_freed_memory_once_the_heap_is_kept() -> None:
    default, kept = faults_by_round("default"), faults_by_round("keep")
    assert kept["kept"] is True and kept["again"] is True  # applied, and idempotent
    assert min(default["faults"][-3:]) > 0.5 * PAGES_A_ROUND, default  # glibc hands the memory back every round
    assert max(kept["faults"][-3:]) < 0.02 * PAGES_A_ROUND, kept  # the heap grows for a few rounds, then is reused
