"""Redis stays below the seam: no module of the package outside ``celery_redlock.core``
imports redis (redis-py), at module level, inside a function or under ``TYPE_CHECKING``;
what they need of a server (its health, what its errors mean) the core gives them."""

from __future__ import annotations

import ast
from pathlib import Path

import celery_redlock
from celery_redlock.core import connect, open_backend
from celery_redlock.core.backend import Probe, has
from celery_redlock.core.backends import QuorumBackend, RedisBackend

PACKAGE = Path(celery_redlock.__file__).resolve().parent


def _redis_imports(path: Path) -> list[str]:
    """Every ``import redis...`` / ``from redis... import`` in *path*, as ``line: text``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{node.lineno}: {n}" for n in names if n == "redis" or n.startswith("redis.")]
    return found


def test_no_module_outside_the_core_imports_redis() -> None:
    """Walks every module of the package above ``core/`` and finds no redis import."""
    modules = [p for p in PACKAGE.rglob("*.py") if "core" not in p.relative_to(PACKAGE).parts]
    assert len(modules) > 10  # the walk found the package's modules
    offenders = {
        str(p.relative_to(PACKAGE)): _redis_imports(p) for p in modules if _redis_imports(p)
    }
    assert offenders == {}


def _backends_imports(path: Path) -> list[str]:
    """Every import of ``core.backends`` (or a module in it) in *path*, as ``line: module``
    (a relative import resolved from *path*'s folder)."""
    here = path.relative_to(PACKAGE).parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = (node.module or "").split(".") if node.module else []
        if node.level:
            target = [*here[: len(here) - (node.level - 1)], *module]
        elif module[:1] == ["celery_redlock"]:
            target = module[1:]
        else:
            continue
        if target[:2] == ["core", "backends"]:
            found.append(f"{node.lineno}: {'.'.join(target)}")
    return found


def test_the_operator_side_reaches_backends_through_the_core() -> None:
    """No module above ``core/`` imports ``core.backends``: ``open_backend``,
    ``STORE_ERRORS`` and ``access_denied`` come from ``celery_redlock.core``."""
    modules = [p for p in PACKAGE.rglob("*.py") if "core" not in p.relative_to(PACKAGE).parts]
    offenders = {
        str(p.relative_to(PACKAGE)): _backends_imports(p) for p in modules if _backends_imports(p)
    }
    assert offenders == {}
    assert _backends_imports(PACKAGE / "core" / "__init__.py")  # the walk is not blind


def test_the_walk_finds_the_core_s_own_redis_imports() -> None:
    """The same walk sees the Redis backend's imports: the check above is not blind."""
    client = PACKAGE / "core" / "backends" / "redis" / "client.py"
    assert any(line.endswith(": redis") for line in _redis_imports(client))


def test_every_backend_of_the_package_answers_the_health_probe() -> None:
    """The worker's start-up probe is a verb behind the seam that each backend has."""
    for backend in (RedisBackend, QuorumBackend):
        assert hasattr(backend, "check"), backend
    memory = open_backend(connect("memory://probe-test"))
    assert has(memory, Probe)
    [health] = memory.check()  # type: ignore[attr-defined]
    assert health.ok and health.where == "memory://probe-test"
    quorum = open_backend([connect(f"memory://probe-{i}") for i in range(3)])
    assert isinstance(quorum, QuorumBackend)
    assert [h.where for h in quorum.check()] == [f"memory://probe-{i}" for i in range(3)]
