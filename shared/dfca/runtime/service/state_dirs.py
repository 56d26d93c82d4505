"""A service's state folder must be writable before it starts: a folder it cannot write (a fresh root-owned
volume mounted for a non-root service) would otherwise lose every record at the next restart.

`require_writable(path, setting)` creates the folder if it can, writes and removes a probe file in it, and
raises StateDirUnwritable naming the folder, the setting that chose it, the uid that tried and the usual fix.
"""

from __future__ import annotations

import os
from pathlib import Path


class StateDirUnwritable(RuntimeError):
    """The folder a service keeps its state in cannot be written by this process."""


def require_writable(path: Path, setting: str) -> Path:
    """`path`, created if missing, once a probe file was written there; else StateDirUnwritable."""
    probe = path / f".dfca-write-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise StateDirUnwritable(
            f"{setting}: cannot write the state folder {path} as uid {os.getuid()} ({err.strerror or err}); "
            f"refusing to start rather than keep state in memory only. Give the folder to this user "
            f"(e.g. `chown -R {os.getuid()}:{os.getgid()} {path}`, or fsGroup {os.getgid()} on Kubernetes) "
            f"or point {setting} at a writable folder") from err
    return path


def sqlite_folder(url: str) -> Path | None:
    """The folder of a file-backed SQLite URL (sqlite:///rel.db, sqlite:////abs.db); None for other stores."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url[len(prefix):] in ("", ":memory:"):
        return None
    return Path(url[len(prefix):].split("?", 1)[0]).parent
