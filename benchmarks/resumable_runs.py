"""What the sweep benchmarks share: a results file that every finished run is appended to (so a sweep resumes
where it stopped), a process pool with one BLAS thread per process, the commit a table names, and rows appended with
that commit and the machine's load."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from multiprocessing import Pool
from pathlib import Path
from typing import Any

RESULTS = "docs/results"  # raw benchmark lines, appended by runs: not what a run measures

Run = dict[str, Any]


def load_runs(results: Path) -> list[Run]:
    return [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []


def run_pending(todo: list[Run], one_run: Callable[[Run], Run], results: Path, processes: int,
                describe: Callable[[Run], str] | None = None) -> list[Run]:
    """Run every spec of `todo` on `processes` processes, appending each result to `results` as it finishes."""
    if not todo:
        return []
    print(f"{len(todo)} runs to do, {processes} processes, load {os.getloadavg()[0]:.2f}", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results.parent.mkdir(parents=True, exist_ok=True)
    finished = []
    with Pool(processes, initializer=one_thread) as pool, results.open("a") as log:
        for i, result in enumerate(pool.imap_unordered(one_run, todo), 1):
            log.write(json.dumps(result) + "\n")
            log.flush()
            finished.append(result)
            if describe is not None:
                print(f"  {i}/{len(todo)} {describe(result)}", flush=True)
            elif i % 50 == 0:
                print(f"  {i}/{len(todo)}", flush=True)
    return finished


def append_stamped(out: Path, rows: list[Run], load_before: float, **extra: Any) -> Run:
    """Append each row to `out` as a JSON line, stamped with the commit, the machine's load before the runs and now,
    and `extra`; returns the stamp."""
    stamp = {"commit": commit(), "load_before": load_before, "load_after": os.getloadavg()[0], **extra}
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for row in rows:
            f.write(json.dumps({**stamp, **row}) + "\n")
    return stamp


def one_thread() -> None:
    """A pool worker computes on one thread: forked after torch was imported, it would keep the parent's thread count
    (OMP_NUM_THREADS is read once), and two processes of two threads each on two cores ran 5-30x slower here."""
    import torch

    torch.set_num_threads(1)


def commit(checkout: Path | None = None) -> str:
    """HEAD's short hash, with "+changes" when tracked files differ from it (what was measured is not that commit;
    the raw results under docs/results/, which benchmarks append to, do not count);
    in a copy whose git history may be stale (a GPU machine's), DFCA_COMMIT names the commit it was copied from.
    `checkout`: another checkout's (a baseline's worktree) instead of this one's; DFCA_COMMIT names this one only."""
    here = checkout if checkout is not None else Path(__file__).resolve().parent
    if checkout is None and os.environ.get("DFCA_COMMIT"):
        return os.environ["DFCA_COMMIT"] + " (copy)"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/",
                                f":(top,exclude){RESULTS}"], cwd=here, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")
