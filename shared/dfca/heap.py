"""The process heap: keep freed memory for the next allocation instead of handing it back to the kernel.

A simulator round allocates and frees the same large tensors every round (a cluster's models gathered for
training, the mixed models, activations). glibc returns a freed block above its mmap threshold (adjusted up to
32 MiB as it goes) to the kernel at once, and trims the top of the heap above 128 KiB, so the next round's
tensor of the same size is fresh memory again, and the first write of each of its 4 KiB pages is a page fault
with the page zeroed. On the simulator benchmark's config (100 clients, MLP h=200) that was 34,000-45,000 page
faults a round, ~0 with the heap kept once it stops growing (a scratch of 8 rounds; the benchmarks' rounds and
the scale curve in docs/performance.md). The process no longer hands memory back between rounds: its peak was
within 0.07 GiB of what it was from 300 clients on, 0.1-0.24 GiB more at 100.

glibc will not raise its mmap threshold above 32 MiB, so blocks larger than that come from mmap all the same: a
fresh 80 MiB tensor (32 clients' k=4 models of MLP h=200) took 41-54 ms to fill against 7-8 ms for a buffer
already written. With `large_blocks`, mmap is switched off (M_MMAP_MAX 0): every block comes from the heap and is
reused there (10.5 ms for the same fill). The price is the heap's fragments, which are never handed back: on 4
rounds of 240 clients, k=4, MLP h=512, screened (10.4 GB peak before), 12.2 GB peak, 11% faster. So the runs
switch it on only where their estimated tensors take at most half the memory available (`run_size.leaves_room`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to 32 MiB come from the heap, and are reused there
TRIM_THRESHOLD = (1 << 31) - 1  # the largest the int argument takes: ~2 GiB of free heap top before trimming
TOP_PAD = 256 << 20  # each time the heap grows, 256 MiB more (address space: a page is memory once written)
MMAP_MAX_DEFAULT = 65536  # glibc's own: blocks above the threshold are mapped, and handed back when freed

_kept = False


def keep_freed_memory(large_blocks: bool = False) -> bool:
    """Tell glibc's malloc to serve blocks up to 32 MiB from the heap, to grow it in large steps and not to trim it,
    and with `large_blocks` to serve the larger ones from the heap too (no mmap; without, they are mapped again);
    True once done.

    Process-wide; the heap settings are made once, `large_blocks` at every call. A no-op (False) where the C library
    is not glibc (macOS, musl, Windows)."""
    global _kept
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not _kept:
        _kept = all(mallopt(param, value) == 1 for param, value in
                    ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    return _kept and mallopt(M_MMAP_MAX, 0 if large_blocks else MMAP_MAX_DEFAULT) == 1


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
