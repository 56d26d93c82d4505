"""The project speaks of itself, never of how it was made: no tracked text file names a work period of its makers
(by the word for one, or as a numbered session), a numbered tracker entry, or a session of development. An HTTP
or browser session (`requests.Session`, `sessionStorage`, `start_new_session`, a SQLAlchemy `Session`) is fine.
The raw measurements under docs/results/ are left as they were recorded. The patterns are built from pieces so
that this file does not match itself."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIT, ISS, SES = "sit" + "ting", "iss" + "ue", "ses" + "sion"
FORBIDDEN = [
    re.compile(rf"\b{SIT}\b", re.IGNORECASE),
    re.compile(rf"\b{ISS}s? #?\d+", re.IGNORECASE),
    re.compile(rf"\bdevelopment {SES}s?\b", re.IGNORECASE),
    re.compile(rf"\b{SES} [A-Z]\b"),
    re.compile(rf"\bth(?:is|at|e last) {SES}\b", re.IGNORECASE),
    re.compile(rf"\ba {SES}'s\b", re.IGNORECASE),
    re.compile(rf"\bGPU {SES}s?\b", re.IGNORECASE),
    re.compile(rf"\b{SES}s'", re.IGNORECASE),
    re.compile(rf"\b(?:in|during|from) (?:the|one|a|each) {SES}\b(?! cookie)", re.IGNORECASE),
]
SKIPPED = ("docs/results/",)  # raw measurements, as recorded


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in filter(None, names.decode().split("\0")):
        path = ROOT / name
        if name.startswith(SKIPPED) or not path.is_file():
            continue
        head = path.read_bytes()[:8192]
        if b"\0" in head:
            continue  # binary
        files.append(path)
    return files


def offending_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if any(p.search(line) for p in FORBIDDEN)]


def test_no_tracked_file_speaks_of_how_the_project_was_made() -> None:
    found = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}: {line[:120]}" for line in offending_lines(text)]
    assert not found, "history words in tracked files:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    f"in {SIT} M the ratio fell", f"({ISS.capitalize()} 17)", f"before {ISS} 16", f"see {ISS}s #4",
    f"four development {SES}s had a GPU", f"{SES} N measured it", f"in this {SES}", f"a {SES}'s lent GPU",
    f"a second GPU {SES}", f"two {SES}s' 15 minutes", f"in the {SES} that split the docs",
])
def test_the_patterns_catch_history(line: str) -> None:
    assert offending_lines(line)


@pytest.mark.parametrize("line", [
    "with requests.Session() as s:", "sessionStorage.setItem('token', t)", "start_new_session=True",
    "with Session(self.engine) as session, session.begin():", "kept for the browser session",
    "Children run in their own sessions", "an issue with the broker", "sitting_duck = 1",
])
def test_the_patterns_spare_other_sessions(line: str) -> None:
    assert not offending_lines(line)
