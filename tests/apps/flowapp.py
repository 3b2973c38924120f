"""A Celery app with flow control (``lock_limits``, controls, ``BackOff``), for prefork-worker
tests (tests/integration/test_flow_workers.py).

Configured from the environment, as tests/apps/limitsapp.py:

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    redlock_url
REDLOCK_TEST_RECORD   a Redis URL where tasks record what they did

Every body records its start (and most their end) with ``time.monotonic()``: the workers
and the test run on one machine, so CLOCK_MONOTONIC is one clock for all of them.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_redlock import BackOff, Limit, LockedTask, Rate

app = Celery(
    "flowapp",
    broker=os.environ.get("REDLOCK_TEST_BROKER", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("REDLOCK_TEST_BACKEND", "redis://127.0.0.1:1/2"),
)
app.conf.redlock_url = os.environ.get("REDLOCK_TEST_LOCKS", "redis://127.0.0.1:1/1")
app.conf.worker_prefetch_multiplier = 1
app.conf.task_acks_late = False
app.conf.broker_connection_retry_on_startup = True

#: The retry options of every task here: many cheap lock retries, short backoffs.
RETRY: dict[str, Any] = {
    "lock_max_retries": 100_000,
    "lock_retry_backoff": 0.01,
    "lock_retry_backoff_max": 0.05,
}

_record: redis.Redis | None = None


def lock_retries(task: Any) -> int:
    """How many times this run was re-queued by its lock (refused, or backed off)."""
    headers = task.request.headers or {}
    return int(headers.get("redlock_retries") or getattr(task.request, "redlock_retries", 0) or 0)


def record(event: str, task: Any, **fields: Any) -> None:
    """Append one JSON event to the record list (read by the test)."""
    global _record
    if _record is None:
        _record = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    fields.update(
        event=event,
        pid=os.getpid(),
        worker=task.request.hostname,
        task_id=task.request.id,
        lock_retries=lock_retries(task),
    )
    fields.setdefault("t", time.monotonic())
    _record.rpush("events", json.dumps(fields))


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="m:<n>",
    lock_limits=[Limit("all", 2), Rate("p:<p>", "5/s")],
    **RETRY,
)
def mixed(self: Any, n: int, p: str, seconds: float) -> int:
    """A run holding mutex m:<n>, one of 2 permits of "all" and a 5/s start of p:<p>."""
    start = time.monotonic()
    time.sleep(seconds)
    record("mixed", self, n=n, p=p, start=start, end=time.monotonic(), fences=self.lock.fences)
    return n


# Two tasks taking the same two semaphores, each its own first: ab's own key is
# semaphore "a" and its rule semaphore "b"; ba's the other way round. 2 permits each.
@app.task(
    base=LockedTask, bind=True, lock_key="a", lock_limit=2, lock_limits=[Limit("b", 2)], **RETRY
)
def ab(self: Any, i: int) -> int:
    """Hold a permit of "a" (its own key) and of "b" (a rule) for a moment."""
    start = time.monotonic()
    time.sleep(0.005)
    record("ab", self, i=i, start=start, end=time.monotonic(), fences=self.lock.fences)
    return i


@app.task(
    base=LockedTask, bind=True, lock_key="b", lock_limit=2, lock_limits=[Limit("a", 2)], **RETRY
)
def ba(self: Any, i: int) -> int:
    """Hold a permit of "b" (its own key) and of "a" (a rule) for a moment."""
    start = time.monotonic()
    time.sleep(0.005)
    record("ba", self, i=i, start=start, end=time.monotonic(), fences=self.lock.fences)
    return i


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="wc:<i>",
    lock_limits=[Rate("wc", "50/s", burst=10, cost="<cost>")],
    **RETRY,
)
def weighed(self: Any, i: int, cost: int) -> int:
    """A run taking *cost* units of a 50/s rate (burst 10)."""
    record("weighed", self, i=i, cost=cost)
    return cost


@app.task(base=LockedTask, bind=True, lock_key="bt:<i>", lock_limits=[Limit("batch", 2)], **RETRY)
def batch(self: Any, i: int, seconds: float) -> int:
    """Hold one of 2 permits of "batch" for *seconds*; record the start and the end."""
    record("start", self, i=i)
    time.sleep(seconds)
    record("end", self, i=i)
    return i


@app.task(
    base=LockedTask, bind=True, lock_key="tk:<i>", lock_limits=[Rate("tick", "10/s")], **RETRY
)
def tick(self: Any, i: int) -> int:
    """A run taking one start of rate "tick" (10/s unless an operator changes it)."""
    record("tick", self, i=i)
    return i


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="bo:<i>",
    lock_limits=[Rate("up:<k>", "100/s", burst=5)],
    **RETRY,
)
def upstream(self: Any, k: str, i: int, back_off: float) -> int:
    """A call to an upstream that, on its first attempt with *back_off* > 0, answers
    "not now": the body raises ``BackOff(back_off)`` (on its Rate key, up:<k>)."""
    record("call", self, k=k, i=i)
    if back_off and not lock_retries(self):
        record("backoff", self, k=k, i=i)
        raise BackOff(back_off)
    return i
