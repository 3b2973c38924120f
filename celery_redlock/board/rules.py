"""Which of the app's task rules name a key: each ``LockedTask``'s own ``lock_key`` (with
its ``lock_limit``) and each of its ``lock_limits`` (``Limit``, ``Rate``), as the worker
resolves them (:meth:`~celery_redlock.state.AppState.options_for`).

A key template (``import:<account_id>``) matches the rendered names it can give: its
text as written, any text for each placeholder. A key made by a callable matches nothing
the board can tell.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..app.rules import Limit, Rate
from ..core.keys import KeyTemplate
from ..task.locked_task import LockedTask

__all__ = ["KeyRule", "matching", "task_rules"]

_PLACEHOLDER = re.compile(r"<[^<>]*>")


@dataclass(frozen=True)
class KeyRule:
    """One rule of one task, and the names it can give."""

    #: ``proj.import_rows: Limit('imports', 3)``
    text: str
    pattern: re.Pattern[str]
    #: The permits it allows (a semaphore's limit), or None.
    limit: int | None = None


def _pattern(template: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(template)
    return re.compile(".+".join(re.escape(p) for p in parts), re.DOTALL)


def _template(key: Any, task_name: str) -> str | None:
    if key is None:
        return task_name
    if isinstance(key, str):
        return key
    if isinstance(key, KeyTemplate):
        return key.template
    return None  # a callable: its names cannot be told


def task_rules(app: Any) -> list[KeyRule]:
    """The rules of every LockedTask of *app* (a task whose options do not resolve is
    left out: the worker reports it)."""
    found: list[KeyRule] = []
    for name, task in sorted(app.tasks.items()):
        if not isinstance(task, LockedTask):
            continue
        try:
            options = task.redlock_options
        except Exception:  # noqa: S112 - a bad option is the worker's to report
            continue
        own = _template(options.key, name)
        if own is not None:
            limit = options.limit if isinstance(options.limit, int) else None
            more = f", lock_limit={limit}" if limit and limit > 1 else ""
            found.append(KeyRule(f"{name}: lock_key={own!r}{more}", _pattern(own), limit))
        for rule in options.limits or ():
            if isinstance(rule, Limit):
                text = f"{name}: Limit({rule.key!r}, {rule.limit})"
                found.append(KeyRule(text, _pattern(rule.key), rule.limit))
            elif isinstance(rule, Rate):
                text = f"{name}: Rate({rule.key!r}, {rule.rate!r}, burst={rule.burst})"
                found.append(KeyRule(text, _pattern(rule.key)))
    return found


def matching(rules: list[KeyRule], name: str) -> list[KeyRule]:
    """The rules that can give *name*."""
    return [r for r in rules if r.pattern.fullmatch(name)]
