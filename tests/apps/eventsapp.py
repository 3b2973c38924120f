"""A Celery app whose tasks make every kind of ``redlock-*`` Celery event, for a
`celery worker -E` subprocess and a publisher that imports this module.

Configured from the environment (tests/workers.py ``worker_env``):

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    redlock_url
REDLOCK_TEST_RECORD   a Redis URL where tasks record what they did
"""

from __future__ import annotations

import time
from typing import Any

from celery import Task

from celery_redlock import LockedTask
from tests.apps.factory import env_app, record

app = env_app("eventsapp")

#: The tests import this module to publish: its tasks must not join every app made later.
_LOCKED: dict[str, Any] = {"base": LockedTask, "bind": True, "shared": False}


@app.task(name="ev.hold", lock_key="ev:<name>", lock_on_contended="skip", **_LOCKED)
def hold(self: Task, name: str, seconds: float) -> str:
    """Hold ev:<name> for *seconds* (acquired, released; a second call is contended and
    skipped)."""
    record("start", name=name, task_id=self.request.id)
    time.sleep(seconds)
    return name


@app.task(name="ev.lossy", lock_key="evl:<name>", lock_ttl=0.9, lock_on_lost="warn", **_LOCKED)
def lossy(self: Task, name: str) -> bool:
    """Run until the lease is found gone (the test deletes the key): lost at release."""
    record("start", name=name, task_id=self.request.id)
    deadline = time.monotonic() + 10
    while not self.lock.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(self.lock.lost)


@app.task(
    name="ev.paced",
    lock_key="evr:<name>",
    lock_limit=None,
    lock_rate="1/m",
    lock_on_contended="skip",
    **_LOCKED,
)
def paced(self: Task, name: str) -> str:
    """One start a minute per name: a second call is rate-limited and skipped."""
    return name


@app.task(name="ev.once", lock_key="evo:<name>", lock_on="enqueue+run", **_LOCKED)
def once(self: Task, name: str, seconds: float) -> str:
    """One queued or running per name (a duplicate at publish, or at the worker for a
    call sent by name where the class is unknown)."""
    record("start", name=name, task_id=self.request.id)
    time.sleep(seconds)
    return name


@app.task(
    name="ev.newest",
    lock_key="evn:<name>",
    lock_on="enqueue",
    lock_on_duplicate="replace",
    lock_debounce=2.0,  # wide enough that the newer call comes while the older waits
    **_LOCKED,
)
def newest(self: Task, name: str, n: int) -> int:
    """The newest call wins: an older queued one is superseded at its worker."""
    return n
