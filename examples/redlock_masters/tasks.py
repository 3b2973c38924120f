"""Locks held by a majority of three independent Redis masters (Redlock).

Needs three Redis servers that know nothing of each other (not replicas, not a
cluster) for the locks, ``REDLOCK_URLS`` comma-separated (default
``redis://localhost:6380/1``, ``:6381/1``, ``:6382/1``), and a broker,
``CELERY_BROKER_URL`` (default ``redis://localhost:6379/0``). Run it::

    cd examples/redlock_masters
    export REDLOCK_URLS=redis://10.0.0.1:6379/1,redis://10.0.0.2:6379/1,redis://10.0.0.3:6379/1
    celery -A tasks worker -P prefork -c 2 -l info
    python check.py           # take the lock, show each master's view, try a second owner

A lock is held when a majority (2 of 3) granted it within its validity; one master
down changes nothing, two down make ``acquire`` raise ``QuorumUnavailable`` within
about two per-node timeouts (a task is retried later, never run unlocked). Read
``docs/redlock.md`` before running this in production: clocks, restarts and fsync.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_redlock import LockedTask

URLS = os.environ.get(
    "REDLOCK_URLS", "redis://localhost:6380/1,redis://localhost:6381/1,redis://localhost:6382/1"
).split(",")
BROKER = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0")

app = Celery("tasks", broker=BROKER, backend=os.environ.get("CELERY_RESULT_BACKEND"))
app.conf.redlock_url = URLS  # a list: Redlock over these masters
app.conf.broker_connection_retry_on_startup = True


@app.task(base=LockedTask, bind=True, lock_key="index:<name>", lock_on_contended="wait")
def rebuild_index(self: LockedTask, name: str) -> dict[str, object]:
    """Rebuild one search index; a second rebuild of it waits for this one."""
    started = time.time()
    time.sleep(0.5)
    return {"name": name, "fence": self.lock.fence, "started": started, "finished": time.time()}
