"""A Celery app whose locked runs record what they held, for the Sentinel failover tests.

REDLOCK_TEST_BROKER   broker URL (RabbitMQ, or a throwaway Redis)
REDLOCK_TEST_LOCKS    redlock_url: the sentinels (sentinel://...;sentinel://...?master=...)
REDLOCK_TEST_RECORD   a Redis URL (not the sentinels' master) where each run records itself
REDLOCK_TEST_TTL      the lock's lease (seconds)
"""

from __future__ import annotations

import json
import os
import socket
import time

import redis
from celery import Celery

from celery_redlock import LockedTask, LockLost

app = Celery("failoverapp", broker=os.environ.get("REDLOCK_TEST_BROKER", "redis://127.0.0.1:1/0"))
app.conf.redlock_url = os.environ.get("REDLOCK_TEST_LOCKS", "redis://127.0.0.1:1/1")
app.conf.redlock_ttl = float(os.environ.get("REDLOCK_TEST_TTL", "3"))
app.conf.worker_prefetch_multiplier = 1
app.conf.task_acks_late = False
app.conf.task_ignore_result = True
app.conf.broker_connection_retry_on_startup = True

_record: redis.Redis | None = None


def record(**fields: object) -> None:
    """Append one JSON record of a run to the list "runs"."""
    global _record
    if _record is None:
        _record = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    fields.update(pid=os.getpid(), host=socket.gethostname())
    _record.rpush("runs", json.dumps(fields))


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="key:<n>",
    lock_on_contended="skip",
    lock_on_lost="raise",
)
def hold(self, n: int, seconds: float) -> None:
    """Hold key:<n> for *seconds*, then record the run: when it started and ended, its
    fence, and when it was told that its lock was lost (None if never)."""
    start, fence, told = time.time(), self.lock.fence, None
    try:
        while time.time() - start < seconds:
            time.sleep(0.02)
    except LockLost:
        told = time.time()
        raise
    finally:
        record(key=n, fence=fence, start=start, end=time.time(), told=told)
