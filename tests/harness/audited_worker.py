"""A worker that writes down every file it opens and every folder it lists under one folder: the product's worker
service with an audit hook (sys.addaudithook), for the tests that show a worker reads only its own data folder.

    python tests/harness/audited_worker.py ROOT LOG

ROOT: the folder watched (every worker's data folders lie under it); LOG: where the paths go, one a line, with
`{ordinal}` replaced by the worker's DFCA_WORKER_ORDINAL. The rest is the worker's DFCA_* environment.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]  # the repository's root, for its `services`

from services.worker.main import main  # noqa: E402

WATCHED_EVENTS = ("open", "os.listdir", "os.scandir")


def audit(root: str, log_path: str) -> None:
    """Append to `log_path` the real path of every file opened and folder listed under `root`."""
    watched = os.path.realpath(root) + os.sep
    out = open(log_path, "a", buffering=1)  # noqa: SIM115 (open for the life of the process)
    busy = threading.local()

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event not in WATCHED_EVENTS or not args or getattr(busy, "on", False):
            return
        target = args[0]
        if not isinstance(target, str | bytes | os.PathLike):
            return
        busy.on = True
        try:
            path = os.path.realpath(os.fsdecode(target))
            if (path + os.sep).startswith(watched):
                out.write(f"{event} {path}\n")
        finally:
            busy.on = False

    sys.addaudithook(hook)


if __name__ == "__main__":
    audit(sys.argv[1], sys.argv[2].replace("{ordinal}", os.environ.get("DFCA_WORKER_ORDINAL", "0")))
    main()
