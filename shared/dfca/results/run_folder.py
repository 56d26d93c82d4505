"""The output folder of `dfca run` and `dfca results`: refused when it holds other files, cleared with --force.

A run never leaves files of an earlier run beside its own (a `models/cluster_3.safetensors` from a k=4 run
next to a k=2 run's models). The default folder, `runs/latest`, is replaced on every run, but only when it
looks like a dfca run folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

DEFAULT_OUT = Path("runs/latest")
RUN_MARKERS = ("summary.json", "config.json", "metrics.jsonl")


class OutFolderRefused(ValueError):
    """The folder cannot be used as given; the message says why and what to do."""


def looks_like_run(folder: Path) -> bool:
    return any((folder / name).exists() for name in RUN_MARKERS)


def prepare_out(out: Path | None, force: bool) -> Path:
    """The folder to write to, empty: `out` (refused if not empty unless `force`), or the default, replaced."""
    target = out if out is not None else DEFAULT_OUT
    if target.exists() and not target.is_dir():
        raise OutFolderRefused(f"--out {target} is a file, not a folder")
    if target.exists() and any(target.iterdir()):
        may_replace = force or (out is None and looks_like_run(target))
        if not may_replace:
            hint = "pass --force to clear it, or choose another --out"
            if out is None:
                raise OutFolderRefused(f"{target} is not empty and does not look like a dfca run folder; {hint}")
            raise OutFolderRefused(f"--out {target} is not empty; {hint}")
        clear_folder(target)
    target.mkdir(parents=True, exist_ok=True)
    return target


def clear_folder(folder: Path) -> None:
    """Delete what is inside `folder` (links are removed, never followed); refuse a folder that holds the
    current directory or is the home folder, where --force would delete far more than a run."""
    resolved = folder.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents or resolved == Path.home().resolve():
        raise OutFolderRefused(f"refusing to clear {folder}: it is the current folder, one of its parents, "
                               "or the home folder; choose a dedicated --out")
    for child in folder.iterdir():
        if child.is_symlink() or not child.is_dir():
            child.unlink()
        else:
            shutil.rmtree(child)


def written_files(folder: Path) -> list[str]:
    """Every file under `folder`, relative to it, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
