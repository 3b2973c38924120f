"""The Celery app the chaos workers run: locked read-modify-writes of a fenced counter.

Configured from the environment so each scenario points it at its own servers:

CHAOS_BROKER   broker URL (a throwaway Redis)
CHAOS_BACKEND  result backend URL
CHAOS_LOCKS    redlock_url: one URL, or comma-separated URLs (Redlock masters)
CHAOS_STORE    the fenced store's Redis URL (never faulted), also where runs are recorded
CHAOS_TTL      redlock_ttl in seconds
CHAOS_CONF     optional JSON object of extra app.conf settings

Each body run records, in the store's ``chaos:events`` list, its start, its fenced
read, its fenced write and its end; every record carries what the run's lock said at
that moment (``lock.fence``, ``lock.valid_until``, ``lock.lost``), measured with
``time.monotonic()``, which is one clock for every process on the machine. The main
process records every message it receives, so redeliveries can be counted, and every
process records each ``lost`` event its locks report (``add_hook``).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import redis
from celery import Celery, Task
from celery.signals import task_received, task_retry

from celery_redlock import LockedTask, LockEvent, add_hook
from tests.integration.chaos.fenced_store import FencedStore

_locks = os.environ.get("CHAOS_LOCKS", "redis://127.0.0.1:1/0")

app = Celery(
    "chaosapp",
    broker=os.environ.get("CHAOS_BROKER", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("CHAOS_BACKEND", "redis://127.0.0.1:1/1"),
)
app.conf.update(
    redlock_url=_locks.split(",") if "," in _locks else _locks,
    redlock_ttl=float(os.environ.get("CHAOS_TTL", "2")),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_acks_late=False,
)
app.conf.update(json.loads(os.environ.get("CHAOS_CONF") or "{}"))

_clients: dict[int, tuple[redis.Redis, FencedStore]] = {}


def _store() -> tuple[redis.Redis, FencedStore]:
    """This process's client to the store (one per pid: a fork must not share sockets)."""
    pid = os.getpid()
    if pid not in _clients:
        client = redis.Redis.from_url(os.environ["CHAOS_STORE"], socket_timeout=10)
        _clients[pid] = (client, FencedStore(client))
    return _clients[pid]


def record(event: str, **fields: Any) -> None:
    """Append one JSON record to ``chaos:events``."""
    fields.update(event=event, pid=os.getpid())
    _store()[0].rpush("chaos:events", json.dumps(fields))


def check(lock: Any) -> dict[str, Any]:
    """What the lock says now: lost, its deadline, and whether it is valid at this instant."""
    lost = bool(lock.lost)
    valid_until = float(lock.valid_until)
    now = time.monotonic()
    return {"t": now, "vu": valid_until, "lost": lost, "valid": not lost and now < valid_until}


def _on_lock_event(event: LockEvent) -> None:
    """Every process: record each loss the lock reports (through the public hook API)."""
    if event.kind == "lost":
        record("lock-lost", name=event.name, fence=event.fence, held=event.held,
               error=event.error, t=time.monotonic())  # fmt: skip


add_hook(_on_lock_event)


@task_received.connect
def _received(request: Any = None, **_: Any) -> None:
    """Main process: count every delivery of every task id (redeliveries included)."""
    task_id = getattr(request, "id", None)
    if task_id is not None:
        delivery = getattr(request, "delivery_info", None) or {}
        redelivered = bool(delivery.get("redelivered"))
        record("received", task_id=task_id, t=time.monotonic(), redelivered=redelivered)


@task_retry.connect
def _retried(request: Any = None, **_: Any) -> None:
    """The process that ran the attempt: Celery stored its RETRY; the task's retry message
    is published from this same signal (by celery_redlock, before or after this record)."""
    task_id = getattr(request, "id", None)
    if task_id is not None:
        record("retried", task_id=task_id, t=time.monotonic())


def _body(task: Task, key: str, work: float) -> str:
    lock = task.lock
    run = uuid.uuid4().hex
    fence = lock.fence
    delivery = getattr(task.request, "delivery_info", None) or {}
    record(
        "start",
        run=run,
        key=key,
        task=task.name,
        task_id=task.request.id,
        fence=fence,
        redelivered=bool(delivery.get("redelivered")),
        **check(lock),
    )
    outcome = "?"
    store = _store()[1]
    try:
        value = store.read(key, fence)
        record("read", run=run, accepted=value is not None, **check(lock))
        if value is None:
            outcome = "read-refused"
            return outcome
        time.sleep(work)  # the work; the window in which chaos strikes
        before = check(lock)
        accepted = store.write(key, fence, value + 1)
        after = check(lock)
        record("write", run=run, accepted=accepted, fence=fence, before=before, after=after)
        outcome = "written" if accepted else "write-refused"
        return outcome
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        record("end", run=run, outcome=outcome, **check(lock))


_COMMON: dict[str, Any] = {
    "base": LockedTask,
    "bind": True,
    "lock_key": "chaos:<key>",
    "lock_retry_backoff": 0.05,
    "lock_retry_backoff_max": 0.5,
    "lock_max_retries": 1000,
}


@app.task(name="chaos.rmw", lock_on_contended="retry", lock_on_lost="raise", **_COMMON)
def rmw(self: Task, key: str, work: float) -> str:
    """Fenced read-modify-write of counter *key*; contention re-queues; loss raises LockLost."""
    return _body(self, key, work)


@app.task(
    name="chaos.rmw_warn",
    lock_on_contended="wait",
    lock_wait_timeout=20,
    lock_on_lost="warn",
    **_COMMON,
)
def rmw_warn(self: Task, key: str, work: float) -> str:
    """The same, but waiting for the lock, and carrying on (to write) after losing it."""
    return _body(self, key, work)


@app.task(name="chaos.rmw_skip", lock_on_contended="skip", lock_on_lost="raise", **_COMMON)
def rmw_skip(self: Task, key: str, work: float) -> str:
    """The same, skipped (visibly) when the key is held."""
    return _body(self, key, work)
