"""A Celery app for worker-configuration tests; configured from the environment.

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    app.conf.redlock_url (worker flags may point elsewhere)
REDLOCK_TEST_RECORD   a Redis URL where tasks record what they did
REDLOCK_TEST_CONF     optional JSON object of extra app.conf settings (bad ones included)
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_redlock import LockedTask

app = Celery(
    "configapp",
    broker=os.environ.get("REDLOCK_TEST_BROKER", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("REDLOCK_TEST_BACKEND", "redis://127.0.0.1:1/2"),
)
app.conf.redlock_url = os.environ.get("REDLOCK_TEST_LOCKS", "redis://127.0.0.1:1/1")
app.conf.redlock_ttl = 30
app.conf.worker_prefetch_multiplier = 1
app.conf.broker_connection_retry_on_startup = True
app.conf.update(json.loads(os.environ.get("REDLOCK_TEST_CONF") or "{}"))

_record: redis.Redis | None = None


def record(event: str, **fields: object) -> None:
    """Append one JSON event to the record list (read by the test)."""
    global _record
    if _record is None:
        _record = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    fields.update(event=event, pid=os.getpid(), t=time.time())
    _record.rpush("events", json.dumps(fields))


@app.task(base=LockedTask, bind=True, lock_key="cfg:<name>", lock_on_contended="raise")
def held(self, name: str, seconds: float) -> str:
    """Hold cfg:<name> for a while, recording whether a lock was taken (and its fence)."""
    lock = self.lock
    record("start", name=name, locked=lock is not None, fence=lock.fence if lock else None)
    time.sleep(seconds)
    record("end", name=name)
    return name
