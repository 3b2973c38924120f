"""A Celery app for the worker tests on every pool (`celery -A tests.apps.poolapp worker -P
<pool>`); configured from the environment:

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    redlock_url
REDLOCK_TEST_RECORD   a Redis URL where task bodies record what they did

The bodies only sleep and wait on sockets, so that they run as they would under every pool
(under gevent and eventlet ``time.sleep`` and the Redis client's socket are patched: both
yield to the other green threads, the renewal among them).
"""

from __future__ import annotations

import json
import os
import threading
import time

import redis

from celery_redlock import LockedTask, LockLost
from tests.apps.factory import env_app

app = env_app("poolapp", redlock_ttl=30.0, task_acks_late=False)

_record: redis.Redis | None = None


def record(event: str, **fields: object) -> None:
    """Append one JSON event to the record list (read by the test)."""
    global _record
    if _record is None:
        _record = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    fields.update(event=event, pid=os.getpid(), thread=threading.get_ident(), t=time.time())
    _record.rpush("events", json.dumps(fields))


def _wait(seconds: float, io: bool) -> None:
    """Sleep *seconds*: half in ``time.sleep``, half (with *io*) blocked on a socket read."""
    if not io:
        time.sleep(seconds)
        return
    time.sleep(seconds / 2)
    assert _record is not None
    _record.blpop(["poolapp:nothing"], timeout=seconds / 2)  # nobody pushes: a timed read


@app.task(
    base=LockedTask,
    bind=True,
    shared=False,  # imported by the test process too: never added to its other apps
    lock_key="turn:<key>",
    lock_ttl=1.2,
    lock_retry_backoff=0.05,
    lock_retry_backoff_max=0.2,
    lock_max_retries=200,
)
def turn(self: LockedTask, key: str, seconds: float, io: bool = False) -> int:
    """Hold turn:<key> for *seconds* (a 1.2 s lease: a longer body lives on renewal);
    record the interval, the fence and whether the lock was still held at the end."""
    start = time.time()
    record("turn-start", key=key, fence=self.lock.fence)
    _wait(seconds, io)
    record(
        "turn",
        key=key,
        start=start,
        end=time.time(),
        fence=self.lock.fence,
        owned=self.lock.owned(),
        lost=self.lock.lost,
    )
    fence: int = self.lock.fence
    return fence


@app.task(
    base=LockedTask,
    bind=True,
    shared=False,
    lock_key="steal:<name>",
    lock_ttl=0.9,
    lock_on_lost="raise",
)
def stealable(self: LockedTask, name: str, seconds: float, step: float) -> str:
    """Sleep *seconds* in steps of *step* under a 0.9 s lease; record when LockLost arrives
    inside the body."""
    record("steal-start", name=name, fence=self.lock.fence)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(min(step, max(0.0, deadline - time.monotonic())))
    except LockLost as exc:
        record("lost", name=name, error=str(exc), type=type(exc).__name__)
        raise
    record("steal-end", name=name)
    return name


@app.task(
    base=LockedTask, bind=True, shared=False, lock_key="hold:<name>", lock_on_contended="raise"
)
def hold(self: LockedTask, name: str, seconds: float) -> str:
    """Hold hold:<name> (the 30 s default lease) for a while, recording the start."""
    record("hold-start", name=name, fence=self.lock.fence)
    time.sleep(seconds)
    return name


@app.task(base=LockedTask, shared=False, lock_key="queued:<name>", lock_on="enqueue+run")
def queued(name: str) -> str:
    """Taken at publish, held until the run ends (one queued-or-running per key)."""
    return name


@app.task(base=LockedTask, shared=False, lock_key="waiting:<name>", lock_on_contended="wait")
def waiting(name: str) -> str:
    """Waits for its key: on a solo worker that blocks the whole worker (warned at start)."""
    return name


@app.task(base=LockedTask, shared=False, lock_key="metrics:<n>")
def metrics_state(n: int) -> dict[str, object]:
    """A locked run that reports whether its process counts into Prometheus."""
    from celery_redlock.app import observability  # noqa: PLC0415 - only this task needs it
    from celery_redlock.core import events  # noqa: PLC0415

    return {"hook": observability.prometheus_hook in events._hooks, "pid": os.getpid()}
