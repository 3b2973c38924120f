"""docs/troubleshooting.md has a section for every line the package logs at WARNING or above."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_redlock"
PAGE = ROOT / "docs" / "troubleshooting.md"
#: Logger methods that log at WARNING or above (``exception`` logs at ERROR).
LOUD = {"warning", "error", "critical", "exception", "fatal", "warn"}
LEVELS = {"WARNING", "WARN", "ERROR", "CRITICAL", "FATAL"}


def _is_logger(node: ast.expr) -> bool:
    """``log``, ``log_<concern>``, ``logger``: the names the package gives its loggers."""
    return isinstance(node, ast.Name) and (
        node.id in ("log", "logger") or node.id.startswith("log_")
    )


def _loud_messages() -> list[tuple[str, int, str]]:
    """(file, line, format string) of every WARNING+ log call with a literal message;
    a ``.log(level, ...)`` call counts unless its level is a literal below WARNING."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if not _is_logger(node.func.value):
                continue
            method, args = node.func.attr, list(node.args)
            if method == "log" and args:
                level = args.pop(0)
                if isinstance(level, ast.Attribute) and level.attr not in LEVELS:
                    continue
            elif method not in LOUD:
                continue
            if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                found.append((str(path.relative_to(ROOT)), node.lineno, args[0].value))
    return found


def test_the_scan_finds_the_known_loud_lines() -> None:
    """The scan itself works: it finds lines we know are logged at WARNING and ERROR."""
    messages = {m for *_, m in _loud_messages()}
    assert (
        "Task %s[%s] not started, lock %r unavailable: %s (lock retry %d/%d in %.2fs)" in messages
    )
    assert "Task %s[%s] gave up after %d lock retries (lock_max_retries=%d): %s" in messages
    assert len(messages) >= 30


def test_every_loud_log_line_has_a_troubleshooting_section() -> None:
    """Each WARNING/ERROR/CRITICAL message appears verbatim in docs/troubleshooting.md,
    so a person seeing it at 3 a.m. finds what it means and what to do."""
    page = PAGE.read_text()
    missing = [f"{file}:{line}: {msg}" for file, line, msg in _loud_messages() if msg not in page]
    assert not missing, "add a section to docs/troubleshooting.md for:\n" + "\n".join(missing)
