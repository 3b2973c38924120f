"""A Celery app whose LockedTasks render lock names, for the key property tests.

Imported by the test process and by a subprocess with another hash seed, so both sides
render the same calls with the same code (``tests/test_bad_input_properties.py``). The
enums live here so that pickled arguments load on both sides. Nothing here connects.
"""

from __future__ import annotations

import enum
from typing import Any

from celery import Celery

from celery_redlock import LockedTask

app = Celery("keysapp", broker="memory://", set_as_current=False)
app.conf.redlock_url = "redis://127.0.0.1:1/1"  # never used: no lock is taken here


class Color(str, enum.Enum):
    """A text enum: renders as its value, like the string a worker receives."""

    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    """An integer enum: renders as its number."""

    LOW = 1
    HIGH = 2


@app.task(base=LockedTask, name="keysapp.sync", lock_key="sync:<user_id>", shared=False)
def sync(user_id: Any, full: bool = False) -> None:
    """One lock per user_id."""


@app.task(
    base=LockedTask, name="keysapp.pair", lock_key="pair:<org>:<user_id>:<full>", shared=False
)
def pair(org: Any, user_id: Any, full: Any = None) -> None:
    """One lock per (org, user_id, full); full's default takes part in the name."""


@app.task(base=LockedTask, name="keysapp.nested", lock_key="acct:<account.org>", shared=False)
def nested(account: Any) -> None:
    """A key read from inside an argument (a dict key or an attribute)."""
