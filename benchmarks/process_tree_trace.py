"""What a set of process trees uses while a benchmark runs: CPU seconds, resident memory and TCP bytes, sampled.

Read from /proc (what psutil reads) and `ss -tin` (Linux), so the benchmark's own environment needs nothing more.

- CPU seconds of a tree: for every live process below (and including) a root, user + system time plus the time of
  the children it has already waited for (cutime + cstime). A short-lived child (a Flower ClientApp) counts while
  it runs through its own times and, once reaped, through its parent's cutime, so nothing is counted twice and
  nothing is lost unless a process dies before its parent and its orphans are reparented.
- Memory: the RSS of every live process of the trees summed (shared pages, e.g. torch's libraries, count once per
  process), its peak over the samples.
- Bytes: every established TCP connection whose local port is one of `ports` (the hub's: a RabbitMQ node's AMQP
  port, a SuperLink's ports): bytes received plus bytes acknowledged by the peer (tcp_info), per connection, its
  last value seen; a connection that closes between two samples loses what it moved since the last one.
"""

from __future__ import annotations

import bisect
import os
import re
import subprocess
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.1


def parents() -> dict[int, int]:
    """pid -> parent pid of every process on the machine."""
    found: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            found[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return found


def tree(roots: list[int], parent_of: dict[int, int]) -> set[int]:
    """`roots` and every process below them."""
    members = {r for r in roots if r in parent_of}
    frontier = set(members)
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier and pid not in members}
        members |= frontier
    return members


def cpu_and_rss(pid: int) -> tuple[float, int]:
    """(CPU seconds of `pid` and its reaped children, RSS bytes); (0, 0) once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0
    # fields[0] is the state (stat's third field): utime, stime, cutime, cstime are stat's 14th..17th, rss its 24th
    cpu = sum(int(v) for v in fields[11:15]) / TICK
    return cpu, int(fields[21]) * os.sysconf("SC_PAGE_SIZE")


TCP_LINE = re.compile(r"^\S+\s+\d+\s+\d+\s+\S+:(\d+)\s+(\S+)")


def tcp_bytes(ports: set[int]) -> dict[str, int]:
    """connection (local and peer address) -> bytes received + bytes acked, for established connections on `ports`."""
    if not ports:
        return {}
    try:
        out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True, timeout=10,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, int] = {}
    key: str | None = None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            parts = line.split()
            local = parts[-2] if len(parts) >= 2 else ""
            port = local.rsplit(":", 1)[-1]
            key = f"{local} {parts[-1]}" if port.isdigit() and int(port) in ports else None
            continue
        if key is not None:
            moved = sum(int(m) for m in re.findall(r"\bbytes_(?:acked|received):(\d+)", line))
            found[key] = moved
            key = None
    return found


class TreeTrace:
    """Samples the trees of `groups` (name -> root pids) every SAMPLE_S from `start` to `stop`; `between` gives
    what each group used between two moments (interpolated), `peak_rss` the largest summed RSS seen."""

    def __init__(self, groups: dict[str, list[int]], ports: set[int] | None = None) -> None:
        self.groups = groups
        self.ports = ports or set()
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.peak_rss: dict[str, int] = dict.fromkeys(groups, 0)
        self._connections: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TreeTrace:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def add_roots(self, group: str, pids: list[int]) -> None:
        self.groups[group] = [*self.groups.get(group, []), *pids]
        self.peak_rss.setdefault(group, 0)

    def _sample(self) -> None:
        parent_of = parents()
        values: dict[str, float] = {}
        rss_total = 0
        for name, roots in list(self.groups.items()):
            cpu, rss = 0.0, 0
            for pid in tree(roots, parent_of):
                c, r = cpu_and_rss(pid)
                cpu, rss = cpu + c, rss + r
            values[name] = cpu
            self.peak_rss[name] = max(self.peak_rss[name], rss)
            rss_total += rss
        self.peak_rss["all"] = max(self.peak_rss.get("all", 0), rss_total)
        self._connections.update(tcp_bytes(self.ports))
        values["tcp_bytes"] = float(sum(self._connections.values()))
        self.samples.append((time.time(), values))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(SAMPLE_S):
                self._sample()
                return

    def at(self, when: float) -> dict[str, float]:
        return interpolated(self.samples, when)

    def between(self, began: float, ended: float) -> dict[str, float]:
        first, last = self.at(began), self.at(ended)
        return {name: last[name] - first.get(name, 0.0) for name in last}


def interpolated(samples: list[tuple[float, dict[str, float]]], when: float) -> dict[str, float]:
    """Each counter at time `when`, interpolated between the two (time, counters) samples around it (a counter
    missing from the earlier sample counts from 0)."""
    times = [t for t, _ in samples]
    i = min(max(bisect.bisect_left(times, when), 1), len(times) - 1)
    (t0, a), (t1, b) = samples[i - 1], samples[i]
    w = 0.0 if t1 == t0 else min(max((when - t0) / (t1 - t0), 0.0), 1.0)
    return {name: a.get(name, 0.0) + w * (b.get(name, 0.0) - a.get(name, 0.0)) for name in b}
