"""A plain Celery app that never imports celery_redlock: locking comes from settings only.

``app.conf.redlock_tasks`` alone must lock its ``shared_task`` (the ``celery``
command loads celery_redlock through its ``celery.commands`` entry point).
Environment: REDLOCK_TEST_BROKER, REDLOCK_TEST_BACKEND, REDLOCK_TEST_LOCKS,
REDLOCK_TEST_RECORD (see ``configapp``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, shared_task

app = Celery(
    "configplain",
    broker=os.environ.get("REDLOCK_TEST_BROKER", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("REDLOCK_TEST_BACKEND", "redis://127.0.0.1:1/2"),
)
app.conf.redlock_url = os.environ.get("REDLOCK_TEST_LOCKS", "redis://127.0.0.1:1/1")
app.conf.redlock_tasks = {
    "tests.apps.configplain.plain_*": {"lock_key": "plain:<n>", "lock_on_contended": "skip"},
}
app.conf.worker_prefetch_multiplier = 1
app.conf.broker_connection_retry_on_startup = True

_record: redis.Redis | None = None


def record(event: str, **fields: object) -> None:
    """Append one JSON event to the record list (read by the test)."""
    global _record
    if _record is None:
        _record = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    fields.update(event=event, pid=os.getpid(), t=time.time())
    _record.rpush("events", json.dumps(fields))


@shared_task(bind=True)
def plain_hold(self: Any, n: int, seconds: float) -> int:
    """Not a LockedTask; redlock_tasks locks it under plain:<n> with the skip policy."""
    lock = getattr(self, "lock", None)
    record("plain", n=n, locked=lock is not None, fence=lock.fence if lock else None)
    time.sleep(seconds)
    return n
