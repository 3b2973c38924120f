"""A periodic job that never overlaps itself, with two beats for high availability.

Needs one Redis: ``redis://localhost:6379`` (databases 0 broker, 1 locks, 2 results,
3 the rollups list); ``REDIS_URL=redis://host:port`` points it elsewhere. Run it::

    cd examples/beat_singleton
    celery -A tasks worker -P prefork -c 2 -l info
    celery -A tasks beat -S celery_redlock.beat:LeaderScheduler -l info   # two of these,
    celery -A tasks beat -S celery_redlock.beat:LeaderScheduler -l info   # on two hosts

One beat leads and publishes ``tasks.rollup`` every second; the other stands by and
takes over within ``redlock_beat_ttl`` seconds if the leader dies. A rollup takes
1.5 s, so every other tick finds the last one still running: that tick is skipped
(``lock_on_contended="skip"``), visibly, and never runs twice at once. Each run appends
one line to the Redis list ``rollups`` (start, end, fence, publishing beat's schedule).
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_redlock import LockedTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")

app = Celery("tasks", broker=f"{REDIS_URL}/0", backend=f"{REDIS_URL}/2")
app.conf.update(
    redlock_url=f"{REDIS_URL}/1",
    redlock_beat_ttl=float(os.environ.get("BEAT_TTL", "5")),  # a standby takes over within this
    beat_max_loop_interval=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={"rollup": {"task": "tasks.rollup", "schedule": 1.0}},
)

_output: redis.Redis | None = None


@app.task(base=LockedTask, bind=True, lock_on_contended="skip", lock_ttl=10)
def rollup(self: LockedTask) -> dict[str, float | int | None]:
    """Roll up the last period's numbers (here: 1.5 s of work); the key is the task name."""
    global _output
    started = time.time()
    time.sleep(1.5)
    run = {"started": started, "finished": time.time(), "fence": self.lock.fence}
    if _output is None:
        _output = redis.Redis.from_url(f"{REDIS_URL}/3")
    _output.rpush("rollups", json.dumps(run))
    return run
