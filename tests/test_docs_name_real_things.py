"""The manual names only what exists: every repository path and every `dfca.` module or attribute that README.md and
docs/*.md name is there in the code (docs/architecture.md above all: a map that names missing rooms misleads)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from dfca.config import ExperimentConfig
from dfca.identity import topics

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = "shared|services|tests|benchmarks|k8s|scripts|docs|examples|configs|broker|\\.ci"
PATH = re.compile(rf"(?<![\w/.-])((?:{FOLDERS})/[\w./*<>{{}}-]*[\w/*>}}])")
DOTTED = re.compile(r"(?<![\w./-])(dfca(?:\.\w+)+)(?![\w/])")  # not a label: dfca.dev/broker-users
# names on the broker and in files that look like modules: exchanges, a config file's name
# and the config's `dfca:` section's fields (`dfca.screen`)
NOT_MODULES = {v for v in vars(topics).values() if isinstance(v, str) and v.startswith("dfca.")}
NOT_MODULES |= {"dfca.yaml", "dfca.py"}
MADE_BY_COMMANDS = {"benchmarks/.peers"}  # the peers' virtual environments (benchmarks/peers.py --setup)
SECTION_FIELDS = set(ExperimentConfig.model_fields["dfca"].annotation.model_fields)  # type: ignore[union-attr]


def paths_named(text: str) -> set[str]:
    return {p.rstrip("/.") for p in PATH.findall(text) if not any(c in p for c in "*<>{}")}


def resolves(dotted: str) -> bool:
    """`dfca.a.b.c`: the longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj = importlib.import_module(name)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_document_names_exists(doc: Path) -> None:
    missing = sorted(p for p in paths_named(doc.read_text()) - MADE_BY_COMMANDS if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_module_a_document_names_imports(doc: Path) -> None:
    names = {n for n in set(DOTTED.findall(doc.read_text())) - NOT_MODULES if n.split(".")[1] not in SECTION_FIELDS}
    missing = sorted(n for n in names if not resolves(n))
    assert not missing, f"{doc.relative_to(ROOT)} names modules or attributes that do not exist: {missing}"


def tree_block(text: str) -> list[str]:
    """The first fenced block of docs/architecture.md: the tree, an entry a line (names, then a description after
    two spaces or more), deeper folders indented by two, descriptions continued on lines indented further."""
    return [line for line in text.split("```")[1].splitlines() if line.strip()]


def tree_entries(lines: list[str]) -> list[tuple[Path, list[str], str]]:
    """(folder, names of the entry, its description) for every entry of the tree, folders resolved from indents."""
    entries: list[tuple[Path, list[str], str]] = []
    parents: list[tuple[int, Path]] = []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        names, _, description = line.strip().partition("  ")
        if indent >= 20:  # a description continued
            folder, names_of, text = entries[-1]
            entries[-1] = (folder, names_of, text + " " + line.strip())
            continue
        while parents and parents[-1][0] >= indent:
            parents.pop()
        folder = parents[-1][1] if parents else ROOT
        split = [n.strip() for n in names.split(",")]
        entries.append((folder, split, description.strip()))
        if len(split) == 1 and split[0].endswith("/"):
            parents.append((indent, folder / split[0]))
    return entries


def test_the_architecture_tree_names_the_files_that_are_there() -> None:
    """Every name in docs/architecture.md's tree is where the tree puts it, and every file a folder's description
    names is in that folder."""
    wrong = []
    for folder, names, description in tree_entries(tree_block((ROOT / "docs" / "architecture.md").read_text())):
        wrong += [str(folder / n) for n in names if not (folder / n).exists()]
        for n in names:
            if n.endswith("/"):
                inside = {p.name for p in (folder / n).rglob("*")}
                wrong += [str(folder / n / m) for m in re.findall(r"\b\w+\.py\b", description) if m not in inside]
    assert len(tree_entries(tree_block((ROOT / "docs" / "architecture.md").read_text()))) > 20
    assert not wrong, f"docs/architecture.md's tree names what is not there: {wrong}"


def test_the_architecture_tree_has_every_folder_of_the_library() -> None:
    """A folder of shared/dfca/ (the runtime's: a process's room) that the tree leaves out is a room no one finds."""
    tree = {folder / n for folder, names, _ in tree_entries(tree_block((ROOT / "docs" / "architecture.md").read_text()))
            for n in names if n.endswith("/")}
    library = ROOT / "shared" / "dfca"
    folders = {p.parent for p in library.rglob("__init__.py")} - {library}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if f not in tree)
    assert not missing, f"docs/architecture.md's tree leaves out {missing}"
