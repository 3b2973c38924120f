"""tests/README.md maps every module of the package to its tests: a newcomer finds the
tests of a module from its path. This keeps the map true as files come and go."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_redlock"
TESTS = ROOT / "tests"


def _rows() -> list[tuple[list[str], list[str]]]:
    """(package paths, test files) of every row of tests/README.md's tables; the left
    column holds package paths in the first table only (the second says what in words)."""
    rows = []
    text = (TESTS / "README.md").read_text()
    first, _, second = text.partition("\n## Tests of the whole")
    for table, paths in ((first, True), (second, False)):
        for line in table.splitlines():
            cells = line.split("|")
            if len(cells) >= 4 and not cells[1].strip().startswith(("package path", "what")):
                left = re.findall(r"`([^`]+)`", cells[1]) if paths else []
                rows.append((left, re.findall(r"`([^`]+)`", cells[2])))
    return rows


def _covered(path: str, named: set[str]) -> bool:
    """True when *path* (under the package) is named, or a folder above it is."""
    parts = path.split("/")
    return path in named or any("/".join(parts[:i]) + "/" in named for i in range(1, len(parts)))


def test_every_module_of_the_package_is_in_the_map() -> None:
    """Each .py file under celery_redlock/ is named in the left column (or its folder is)."""
    named = {p for left, _ in _rows() for p in left}
    modules = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
    missing = [m for m in modules if not _covered(m, named)]
    assert not missing, f"add these modules to tests/README.md: {missing}"


def test_every_path_the_map_names_exists() -> None:
    """No row names a module or a test file that is gone."""
    gone = []
    for left, right in _rows():
        gone += [p for p in left if p.endswith((".py", "/")) and not (PACKAGE / p).exists()]
        gone += [p for p in right if not (TESTS / p).exists()]
    assert not gone, f"tests/README.md names paths that do not exist: {gone}"


def test_every_test_file_is_in_the_map() -> None:
    """Each test_*.py under tests/ is named in some row, so none is found only by luck."""
    named = {p for _, right in _rows() for p in right}
    files = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py"))
    missing = [f for f in files if f not in named]
    assert not missing, f"add these test files to tests/README.md: {missing}"
