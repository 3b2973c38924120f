"""A Celery app for the board's tests: runs that hold a mutex, a semaphore's permits, or
stay queued holding their key, until the test lets them go.

Configured from the environment, as tests/apps/limitsapp.py:

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    redlock_url
REDLOCK_TEST_RECORD   a Redis URL where the test sets ``go:<name>`` to end a run
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_redlock import LockedTask

app = Celery(
    "boardapp",
    broker=os.environ.get("REDLOCK_TEST_BROKER", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("REDLOCK_TEST_BACKEND", "redis://127.0.0.1:1/2"),
)
app.conf.redlock_url = os.environ.get("REDLOCK_TEST_LOCKS", "redis://127.0.0.1:1/1")
app.conf.worker_prefetch_multiplier = 1
#: A run holds its message until it ends: a worker whose processes are all busy takes no
#: more (the board tests need each run started at once, on whichever worker is free).
app.conf.task_acks_late = True
app.conf.broker_connection_retry_on_startup = True
#: The longest a run waits for the test to let it go.
HOLD_AT_MOST = 60.0


def _wait_for_go(name: str) -> None:
    """Block until the test sets ``go:<name>`` (at most HOLD_AT_MOST seconds)."""
    record = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    try:
        deadline = time.monotonic() + HOLD_AT_MOST
        while time.monotonic() < deadline and not record.exists(f"go:{name}"):
            time.sleep(0.05)
    finally:
        record.close()


@app.task(
    base=LockedTask, shared=False, lock_key="mutex:<name>", lock_on_contended="skip", lock_ttl=30
)
def hold(name: str) -> str:
    """Hold mutex ``mutex:<name>`` until the test says go."""
    _wait_for_go(name)
    return name


@app.task(
    base=LockedTask, shared=False, lock_key="sem:<name>", lock_limit=2, lock_on_contended="skip"
)
def permit(name: str) -> str:
    """Hold one of 2 permits of ``sem:<name>`` until the test says go."""
    _wait_for_go(name)
    return name


@app.task(base=LockedTask, shared=False, lock_key="queued:<name>", lock_on="enqueue")
def queued(name: str) -> str:
    """Published to a queue no worker reads: its key stays held by the queued message."""
    return name
