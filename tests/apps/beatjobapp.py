"""A Celery app with one beat-scheduled LockedTask that outlasts its schedule.

``beatjob.slow`` runs every second (beat) but takes 2.5 s; it uses
``lock_on_contended="skip"``, so runs that find the previous one still going are
skipped. Environment: ``BEATJOB_REDIS`` (a throwaway Redis URL base such as
``redis://127.0.0.1:PORT``): db 0 is the broker, db 1 the lock store, db 3 where
runs record their [start, end] interval.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_redlock import LockedTask

_BASE = os.environ.get("BEATJOB_REDIS", "redis://127.0.0.1:1")

app = Celery("beatjob", broker=f"{_BASE}/0")
app.conf.update(
    redlock_url=f"{_BASE}/1",
    redlock_ttl=10.0,
    redlock_beat_ttl=3.0,
    beat_max_loop_interval=1,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={"slow-job": {"task": "beatjob.slow", "schedule": 1.0}},
)

_record: redis.Redis | None = None


@app.task(base=LockedTask, bind=True, name="beatjob.slow", lock_on_contended="skip")
def slow(self: LockedTask) -> None:
    """Take 2.5 s, then record the run's interval, task id and fence."""
    global _record
    start = time.time()
    time.sleep(2.5)
    if _record is None:
        _record = redis.Redis.from_url(f"{_BASE}/3")
    run = {"id": self.request.id, "start": start, "end": time.time(), "fence": self.lock.fence}
    _record.rpush("runs", json.dumps(run))
