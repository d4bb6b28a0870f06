"""docs/architecture.md says what is: every file its "where to change what" table names exists, and every name it
cites there is defined by one of the files of its row (or is a dotted name of the project that imports)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _rows() -> list[tuple[str, list[str], list[str]]]:
    """``(what, files, names)`` of each row of the "Where to change what" table."""
    text = DOC.read_text(encoding="utf-8").split("## Where to change what", 1)[1]
    rows = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| to change") or line.startswith("| ---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        ticks = re.findall(r"`([^`]+)`", " | ".join(cells[1:]))
        files = [t for t in ticks if t.endswith(".py")]
        names = [t for t in ticks if not t.endswith(".py")]
        rows.append((cells[0], files, names))
    return rows


def _module(path: str):
    return importlib.import_module(path.removesuffix(".py").replace("/", "."))


def _resolves(name: str, modules: list) -> bool:
    """Whether ``name`` (``a.b``, ``f(...)``, ``f(arg=)``) is an attribute chain of one of ``modules`` or a dotted
    project name."""
    name = re.sub(r"\(.*\)$", "", name)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name):
        return False
    parts = name.split(".")
    if parts[0] in ("fp8", "megatron"):
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for part in parts[cut:]:
                    obj = getattr(obj, part)
                return True
            except AttributeError:
                return False
        return False
    for module in modules:
        obj = module
        try:
            for part in parts:
                obj = getattr(obj, part)
            return True
        except AttributeError:
            continue
    return False


ROWS = _rows()


def test_the_table_is_read():
    assert len(ROWS) >= 20 and all(files for _, files, _ in ROWS), ROWS


@pytest.mark.parametrize("what,files,names", ROWS, ids=[r[0][:40] for r in ROWS])
def test_every_cited_file_and_name_exists(what, files, names):
    for path in files:
        assert (ROOT / path).is_file(), f"{what}: {path} does not exist"
    modules = [_module(path) for path in files]
    missing = [name for name in names if not _resolves(name, modules)]
    assert missing == [], f"{what}: not defined in {files}: {missing}"
