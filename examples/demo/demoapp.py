"""The Celery app the demo's workers and beat run (``celery -A demoapp ...``).

Configured from the environment, so the demo can point it at the throwaway Redis it
started: ``DEMO_REDIS`` is that server's base URL (``redis://127.0.0.1:PORT``). The
broker is database 0, the locks database 1, results database 2; database 3 holds the
list ``demo:events`` where every process (workers' pool children, their main
processes, beat, the demo itself) appends what happened, as one JSON object each:

* every :class:`~celery_redlock.LockEvent` (a hook registered below): ``acquired``,
  ``contended``, ``released``, ``lost``, ...;
* ``start`` and ``end`` of every task body, with the fence of the lock it holds.

The demo reads that list to draw the live view, the timeline and the summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Any

import redis
from celery import Celery, current_task

from celery_redlock import LockedTask, LockEvent, add_hook

BASE = os.environ.get("DEMO_REDIS", "redis://127.0.0.1:6399")
#: The list every process appends its events to (database 3 of the demo's Redis).
EVENTS_KEY = "demo:events"
#: Lease of every task lock in the demo (seconds): short, so a crash costs little.
TTL = 3.0
#: How long the task bodies take, as a factor of their defaults (``DEMO_PACE``, 1 unless
#: set): the test suite plays the demo at 0.5, the same scenes and checks in less time.
#: Two keep their length: the nightly report its 1.5 s, so that beat's ticks (every
#: second) find it running, and the partner calls their 0.1 s, paced by their rate.
PACE = float(os.environ.get("DEMO_PACE", "1"))

app = Celery("demoapp", broker=f"{BASE}/0", backend=f"{BASE}/2")
app.conf.update(
    redlock_url=f"{BASE}/1",
    redlock_ttl=TTL,
    redlock_beat_ttl=3.0,
    worker_prefetch_multiplier=1,
    task_acks_late=False,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    beat_max_loop_interval=0.5,
    beat_schedule={
        # Every second, and each run takes 1.5 s: every other tick finds the last run
        # still holding the lock, and is skipped.
        "nightly-report": {"task": "demoapp.nightly_report", "schedule": 1.0},
    },
)

_clients: dict[int, redis.Redis] = {}


def _events_client() -> redis.Redis:
    """One client per process (a forked pool child makes its own)."""
    client = _clients.get(os.getpid())
    if client is None:
        client = _clients[os.getpid()] = redis.Redis.from_url(f"{BASE}/3", socket_timeout=2)
    return client


def record(kind: str, **fields: Any) -> None:
    """Append one event to ``demo:events``; the demo must never break a task."""
    fields.update(kind=kind, t=time.time(), pid=os.getpid())
    with contextlib.suppress(redis.RedisError):
        _events_client().rpush(EVENTS_KEY, json.dumps(fields, default=str))


def record_lock_event(event: LockEvent) -> None:
    """The hook: every lock event of this process, with the task it concerns.

    For ``contended``, ``event.holder`` is the *other* owner; the task that was refused
    is the one this process is running (``current_task``).
    """
    holder = dict(event.holder)
    if event.kind == "contended":
        request = current_task.request if current_task else None
        task_id = getattr(request, "id", None)
        task_name = getattr(current_task, "name", None)
    else:
        task_id = holder.get("task_id")
        task_name = holder.get("task_name") or holder.get("role")
    record(
        event.kind,
        key=event.name,
        task_id=task_id,
        task=task_name,
        fence=event.fence,
        waited=event.waited,
        held=event.held,
        holder=holder,
        error=event.error,
        retry_after=getattr(event, "retry_after", None),
    )


add_hook(record_lock_event)


def _body(task: Any, key: str, seconds: float) -> int | None:
    """What every demo task does: record its start, work (*seconds*, times PACE), record
    its end."""
    fence = task.lock.fence if task.lock else None
    who = {"task_id": task.request.id, "task": task.name, "worker": task.request.hostname}
    record("start", key=key, fence=fence, **who)
    time.sleep(seconds if key in ("nightly-report", "partner-api") else seconds * PACE)
    record("end", key=key, fence=fence, **who)
    return fence


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="sync:<user_id>",
    lock_on_contended="retry",
    lock_retry_backoff=0.2,
    lock_retry_backoff_max=0.8,
)
def sync_user(self: LockedTask, user_id: int, seconds: float = 0.6) -> int | None:
    """One sync per user at a time; a contended one is re-queued with backoff."""
    return _body(self, f"sync:{user_id}", seconds)


@app.task(base=LockedTask, bind=True, lock_key="nightly-report", lock_on_contended="skip")
def nightly_report(self: LockedTask, seconds: float = 1.5) -> int | None:
    """The beat singleton: a tick that finds the last run still going is skipped."""
    return _body(self, "nightly-report", seconds)


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="export:<job>",
    lock_on_contended="wait",
    lock_wait_timeout=30,
)
def export(self: LockedTask, job: str, seconds: float) -> int | None:
    """A long export; a second one for the same job waits for the release notice."""
    return _body(self, f"export:{job}", seconds)


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="render",
    lock_limit=2,
    lock_on_contended="wait",
    lock_wait_timeout=30,
)
def render(self: LockedTask, page: int, seconds: float = 0.8) -> int | None:
    """A semaphore: at most two renders at once; the others wait for a permit."""
    return _body(self, "render", seconds)


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="partner-api",
    lock_limit=None,
    lock_rate="4/s",
    lock_on_contended="retry",
)
def call_partner(self: LockedTask, n: int, seconds: float = 0.1) -> int | None:
    """A rate limit alone: at most 4 calls a second start, across every worker; a call
    over it is re-queued for exactly its slot."""
    return _body(self, "partner-api", seconds)


@app.task(base=LockedTask, bind=True, lock_key="reindex:<index>", lock_on="enqueue")
def reindex(self: LockedTask, index: str, seconds: float = 1.0) -> int | None:
    """De-duplicated at publish: one reindex of an index queued at a time; a call made
    while one is queued gets that one's result (nothing is sent)."""
    return _body(self, f"reindex:{index}", seconds)


def hostname() -> str:
    """The host part of worker names (``demo1@<host>``)."""
    return socket.gethostname()
