"""A Celery app for prefork-worker tests; configured from the environment.

REDLOCK_TEST_BROKER   broker URL (a throwaway Redis, or RabbitMQ)
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    redlock_url
REDLOCK_TEST_RECORD   a Redis URL where tasks record what they did
REDLOCK_TEST_TTL      redlock_ttl (seconds)
"""

from __future__ import annotations

import os
import time

from celery_redlock import LockedTask, LockLost
from tests.apps.factory import env_app, record

app = env_app(
    "lockapp", redlock_ttl=float(os.environ.get("REDLOCK_TEST_TTL", "30")), task_acks_late=False
)


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="user:<user_id>",
    lock_on_contended="wait",
    lock_wait_timeout=120,
)
def interval(self, user_id: int, seconds: float) -> int:
    """Record the [start, end] interval of a run holding user:<user_id>."""
    start = time.time()
    time.sleep(seconds)
    record("interval", user=user_id, start=start, end=time.time(), fence=self.lock.fence)
    return user_id


@app.task(base=LockedTask, bind=True, lock_key="hold:<name>", lock_on_contended="raise")
def hold(self, name: str, seconds: float) -> str:
    """Hold hold:<name> for a while, recording the start (pid and fence)."""
    record("start", name=name, fence=self.lock.fence, task_id=self.request.id)
    time.sleep(seconds)
    record("end", name=name)
    return name


@app.task(
    base=LockedTask, bind=True, lock_key="limited:<name>", lock_on_contended="raise", time_limit=1.5
)
def limited(self, name: str, seconds: float) -> str:
    """Hold limited:<name> past its 1.5 s hard time limit."""
    record("start", name=name, fence=self.lock.fence, task_id=self.request.id)
    time.sleep(seconds)
    return name


@app.task(base=LockedTask, bind=True, lock_key="soft:<name>", soft_time_limit=0.5)
def soft(self, name: str, seconds: float) -> str:
    """Sleep past a 0.5 s soft time limit (SoftTimeLimitExceeded ends the body)."""
    record("start", name=name, fence=self.lock.fence)
    time.sleep(seconds)
    return name


@app.task(base=LockedTask, bind=True, lock_key="steal:<name>", lock_ttl=1.5, lock_on_lost="raise")
def stealable(self, name: str, seconds: float) -> str:
    """Sleep while holding a 1.5 s lease; record when LockLost arrives inside the body."""
    record("start", name=name, fence=self.lock.fence)
    try:
        time.sleep(seconds)
    except LockLost as exc:
        record("lost", name=name, error=str(exc))
        raise
    record("end", name=name)
    return name


@app.task(base=LockedTask, lock_key="metrics:<n>")
def metrics_state(n: int) -> dict[str, object]:
    """A locked run that reports whether this pool child counts into Prometheus."""
    from celery_redlock.app import observability  # noqa: PLC0415 - only this task needs it
    from celery_redlock.core import events  # noqa: PLC0415

    return {
        "hook": observability.prometheus_hook in events._hooks,
        "registries": len(observability._metrics),
        "pid": os.getpid(),
    }
