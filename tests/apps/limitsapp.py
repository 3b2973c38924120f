"""A Celery app with concurrency and rate limits per key, for prefork-worker tests.

Configured from the environment, as tests/apps/lockapp.py:

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    redlock_url (a comma makes it a list of Redlock masters)
REDLOCK_TEST_RECORD   a Redis URL where tasks record what they did
"""

from __future__ import annotations

import time
from typing import Any

from celery_redlock import LockedTask, LockLost
from tests.apps.factory import env_app, record

app = env_app("limitsapp", task_acks_late=False)


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="import:<customer>",
    lock_limit=3,
    lock_on_contended="wait",
    lock_wait_timeout=60,
)
def imports(self, customer: int, seconds: float) -> int:
    """Record the [start, end] interval of a run holding one of 3 permits of the customer."""
    start = time.time()
    time.sleep(seconds)
    record("interval", customer=customer, start=start, end=time.time(), fence=self.lock.fence)
    return customer


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="hold:<name>",
    lock_limit=2,
    lock_ttl=1.5,
    lock_on_contended="wait",
    lock_wait_timeout=20,
)
def hold(self, name: str, seconds: float) -> str:
    """Hold one of 2 permits of hold:<name> (1.5 s lease, renewed); record start, loss, end."""
    record("start", name=name, fence=self.lock.fence, task_id=self.request.id)
    try:
        time.sleep(seconds)
    except LockLost as exc:
        record("lost", name=name, fence=self.lock.fence, error=str(exc))
        raise
    record("end", name=name, fence=self.lock.fence)
    return name


def _record_call(request: Any, partner: str, n: int) -> int:
    """Record a "call" event: its partner, its number, its lock and task retries."""
    record(
        "call",
        partner=partner,
        n=n,
        lock_retries=int(
            (request.headers or {}).get("redlock_retries")
            or getattr(request, "redlock_retries", 0)
            or 0
        ),
        retries=request.retries,
    )
    return n


@app.task(base=LockedTask, bind=True, lock_key="api:<partner>", lock_limit=None, lock_rate="20/s")
def call_api(self, partner: str, n: int) -> int:
    """Record the start of a run of a partner limited to 20 starts a second (no other cap)."""
    return _record_call(self.request, partner, n)


@app.task(base=LockedTask, bind=True, lock_key="held:<partner>", lock_limit=None, lock_rate="5/s")
def call_held(self, partner: str, n: int) -> int:
    """Record the start of a run of a partner limited to 5 starts a second: a backlog that
    lasts long next to the time the workers take to fetch it."""
    return _record_call(self.request, partner, n)


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="keep:<name>",
    lock_limit=2,
    lock_ttl=30,
    lock_on_contended="raise",
)
def keep(self, name: str, seconds: float) -> str:
    """Hold one of 2 permits of keep:<name> (a 30 s lease) for a while; record the start."""
    record("start", name=name, fence=self.lock.fence, task_id=self.request.id)
    time.sleep(seconds)
    return name
