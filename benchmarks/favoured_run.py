"""A benchmark's process tree scheduled ahead of the rest of a shared machine, as on a machine to itself.

Linux groups processes by session for scheduling (autogroups, /proc/sys/kernel/sched_autogroup_enabled): every
session gets an equal share of the CPU whatever its processes' nice values, and the runtime's services each start a
session of their own. `favoured()` sets the autogroup of every process of this tree (this one, the services it
starts, a RabbitMQ node it starts) to nice -20 while it lasts, then this one's back to 0. Other sessions keep running,
at a small share. Needs CAP_SYS_NICE (root); without it nothing changes and `favoured` yields False.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

FAVOURED_NICE = -20
REFRESH_S = 0.5  # how often processes started since are favoured too


def descendants(root: int) -> list[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def set_autogroup_nice(pid: int, nice: int) -> bool:
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        return False
    return True


@contextlib.contextmanager
def favoured() -> Iterator[bool]:
    """This process tree's autogroups at FAVOURED_NICE until the block ends; yields whether that could be done."""
    if not set_autogroup_nice(os.getpid(), FAVOURED_NICE):
        yield False
        return
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(REFRESH_S):
            for pid in descendants(os.getpid()):
                set_autogroup_nice(pid, FAVOURED_NICE)

    thread = threading.Thread(target=refresh, name="favour", daemon=True)
    thread.start()
    try:
        yield True
    finally:
        stop.set()
        thread.join()
        set_autogroup_nice(os.getpid(), 0)
