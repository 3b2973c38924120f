"""The Celery side's folders depend one way: core/ <- app/ <- task/ <- worker/, cli/ <- the
top-level modules (docs/architecture.md draws it); an import for typing only is exempt."""

from __future__ import annotations

import ast
from pathlib import Path

import celery_redlock

PACKAGE = Path(celery_redlock.__file__).parent

#: Each folder's floor: a module may import from its own floor and the ones below.
FLOORS = {"core": 0, "app": 1, "task": 2, "worker": 3, "cli": 3}
TOP = 4  # __init__, install, beat, testing


def _floor(parts: tuple[str, ...]) -> int:
    """The floor of the module at *parts* (its path inside celery_redlock/, a folder's
    ``__init__`` named by the folder alone)."""
    return FLOORS.get(parts[0], TOP) if (PACKAGE / parts[0]).is_dir() else TOP


def _typing_only(tree: ast.Module) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:``."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found.update(id(child) for child in ast.walk(node))
    return found


def _imports(path: Path) -> list[tuple[int, tuple[str, ...]]]:
    """(line, target's path parts inside celery_redlock/) of each run-time import of a
    module of the package in *path*."""
    tree = ast.parse(path.read_text())
    typing_only = _typing_only(tree)
    here = path.relative_to(PACKAGE).parts[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)]
            target = (*base, *(node.module.split(".") if node.module else ()))
            found.append((node.lineno, target if target else ("__init__",)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("celery_redlock."):
            found.append((node.lineno, tuple(node.module.split(".")[1:])))  # type: ignore[union-attr]
    return found


def test_no_folder_imports_from_a_folder_above_it() -> None:
    """app/ imports nothing from task/, worker/ or cli/ at run time; task/ nothing from
    worker/ or cli/; worker/ and cli/ nothing from each other; no folder anything from
    the top-level modules."""
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        own = _floor(parts)
        for line, target in _imports(path):
            if target[0] == parts[0] and len(parts) > 1:
                continue  # inside its own folder
            checked += 1
            floor = _floor(target)
            assert floor < own or floor == own == TOP, (
                f"{'/'.join(parts)}:{line} imports {'.'.join(target)}, a floor above it"
            )
    assert checked > 50
