"""A Celery app whose runs lose their lock, for the test of what a prefork worker logs
about one loss (tests/integration/test_lost_log.py).

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    redlock_url
REDLOCK_TEST_RECORD   a Redis URL where tasks record what they did
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_redlock import LockedTask

app = Celery(
    "lostapp",
    broker=os.environ.get("REDLOCK_TEST_BROKER", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("REDLOCK_TEST_BACKEND", "redis://127.0.0.1:1/2"),
)
app.conf.redlock_url = os.environ.get("REDLOCK_TEST_LOCKS", "redis://127.0.0.1:1/1")
app.conf.worker_prefetch_multiplier = 1
app.conf.broker_connection_retry_on_startup = True

_record: redis.Redis | None = None


def record(key: str) -> None:
    """Mark *key* in the record database (read by the test)."""
    global _record
    if _record is None:
        _record = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    _record.set(key, 1)


def _sleep_until_lost(task: LockedTask, name: str) -> bool:
    """Record the start, then sleep (in steps) until the lock is found lost, at most 10 s."""
    record(f"started:{name}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not task.lock.lost:  # type: ignore[union-attr]
        time.sleep(0.05)
    return bool(task.lock.lost)  # type: ignore[union-attr]


@app.task(base=LockedTask, bind=True, lock_key="lost:<name>", lock_ttl=1.5, lock_on_lost="raise")
def interrupted(self: LockedTask, name: str) -> bool:
    """Hold lost:<name> until LockLost interrupts the body."""
    return _sleep_until_lost(self, name)


@app.task(base=LockedTask, bind=True, lock_key="lost:<name>", lock_ttl=1.5, lock_on_lost="warn")
def warned(self: LockedTask, name: str) -> bool:
    """Hold lost:<name> until the body sees ``self.lock.lost``, then return."""
    return _sleep_until_lost(self, name)
