"""The state file of a running `dfca up`: how the other commands find it, and how `dfca down` stops it.

`dfca up` writes `<state dir>/stack.json` (the state dir defaults to `.dfca` in the current folder) and a copy in
`~/.dfca/stack.json`, with its pid, the topology and metrics URLs, the state dir, the logs folder and the file that
holds the API token (when `dfca up` made one). It removes both when it stops. `dfca submit|status|stop|logs|results`
read the first of `./.dfca/stack.json` and `~/.dfca/stack.json` whose `dfca up` is still alive, after their options
and the DFCA_* environment variables; a file whose process is gone (a stack killed with SIGKILL) is never used, and
the commands say it was left behind.

Only the standard library: the commands that read it must start fast.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_NAME = "stack.json"


def local_file() -> Path:
    """The state file in the default state dir of the current folder."""
    return Path(".dfca") / FILE_NAME


def home_file() -> Path:
    return Path.home() / ".dfca" / FILE_NAME


def candidates() -> list[Path]:
    """Where the commands look, in order (each path once)."""
    seen: list[Path] = []
    for path in (local_file(), home_file()):
        if path.absolute() not in [p.absolute() for p in seen]:
            seen.append(path)
    return seen


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:  # Linux: a zombie (exited, not yet reaped) is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


@dataclass(frozen=True)
class StackState:
    path: Path  # the file it was read from
    pid: int
    topology_url: str
    metrics_url: str
    state_dir: str = ""
    logs: str = ""  # the logs folder; empty when the services log to the terminal
    token_file: str = ""  # the file holding the API token `dfca up` made; empty when it came from DFCA_API_TOKEN
    pids: tuple[int, ...] = ()  # the service processes when the file was written (restarts change them)

    @property
    def running(self) -> bool:
        return alive(self.pid)

    def token(self) -> str:
        if not self.token_file:
            return ""
        try:
            return Path(self.token_file).read_text().strip()
        except OSError:
            return ""


def read(path: Path) -> StackState | None:
    """The state in `path`, or None when it is missing or unreadable."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return StackState(path=path, pid=int(data["pid"]), topology_url=str(data["topology_url"]),
                          metrics_url=str(data["metrics_url"]), state_dir=str(data.get("state_dir", "")),
                          logs=str(data.get("logs", "")), token_file=str(data.get("token_file", "")),
                          pids=tuple(int(p) for p in data.get("pids", [])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find() -> tuple[StackState | None, list[StackState]]:
    """The first state file of a running `dfca up`, and the stale ones read before it (their stack is gone)."""
    stale: list[StackState] = []
    for path in candidates():
        state = read(path)
        if state is None:
            continue
        if state.running:
            return state, stale
        stale.append(state)
    return None, stale


def write(state_dir: Path, data: dict[str, Any], also_home: bool = True) -> list[Path]:
    """Write the state file into `state_dir` (and `~/.dfca/`); returns the files written."""
    body = json.dumps(data, indent=2) + "\n"
    written = []
    targets = [state_dir / FILE_NAME]
    if also_home and home_file().absolute() != targets[0].absolute():
        targets.append(home_file())
    for path in targets:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(body)
            tmp.replace(path)
            written.append(path)
        except OSError:
            continue
    return written


def remove(paths: list[Path], pid: int) -> None:
    """Remove the state files that still name `pid` (another `dfca up` may have replaced the home copy)."""
    for path in paths:
        state = read(path)
        if state is not None and state.pid == pid:
            path.unlink(missing_ok=True)


def stop(state: StackState, timeout: float = 60.0) -> bool:
    """SIGTERM the `dfca up` of `state`, wait until it and its recorded processes are gone; SIGKILL what is left at
    the deadline. True when everything exited before the deadline."""
    try:
        os.kill(state.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    watched = [state.pid, *state.pids]
    while time.monotonic() < deadline:
        if not any(alive(p) for p in watched):
            return True
        time.sleep(0.2)
    for pid in watched:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return False
