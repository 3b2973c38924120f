"""The Celery events celery-redlock sends: one list in the code
(``CELERY_EVENT_KINDS``), the same list in docs/observability.md, every kind sent
somewhere, and none in Celery's ``task`` group."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import celery_redlock
from celery_redlock.app.observability import (
    CELERY_EVENT_GROUP,
    CELERY_EVENT_KINDS,
    celery_event_type,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(celery_redlock.__file__).parent
SENDERS = {"send_task_event": 2, "send_publisher_event": 1}  # name -> the kind's position


def _sent_kinds() -> set[str]:
    """Every kind a call of a sender names in the package's source."""
    kinds: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name not in SENDERS:
                continue
            arg = node.args[SENDERS[name]]
            assert isinstance(arg, ast.Constant), f"{path}:{node.lineno}: kind not a literal"
            kinds.add(arg.value)
    return kinds


def test_the_docs_table_lists_the_kinds_of_the_code_in_its_order() -> None:
    """docs/observability.md's table of events is CELERY_EVENT_KINDS, row by row."""
    text = (ROOT / "docs" / "observability.md").read_text()
    rows = re.findall(r"^\| `(redlock-[a-z-]+)` \|", text, re.MULTILINE)
    assert rows == [celery_event_type(kind) for kind in CELERY_EVENT_KINDS]


def test_every_kind_listed_is_sent_and_every_kind_sent_is_listed() -> None:
    """The kinds the package's calls send are exactly CELERY_EVENT_KINDS."""
    assert _sent_kinds() == set(CELERY_EVENT_KINDS)


def test_the_events_are_not_in_celerys_task_group() -> None:
    """Not ``task-*`` (Celery's State takes those for the task's state and needs a uuid),
    and no page, example or module names the old ``task-lock-*`` types."""
    assert CELERY_EVENT_GROUP == "redlock"
    assert all(not celery_event_type(k).startswith("task-") for k in CELERY_EVENT_KINDS)
    places = [ROOT / "README.md", ROOT / "docker-compose.yml"]
    places += [*(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.py")]
    places += list(PACKAGE.rglob("*.py"))
    old = [
        str(p.relative_to(ROOT))
        for p in places
        if "task-lock-" in p.read_text() and p.name != "observability.md"
    ]
    assert old == []
