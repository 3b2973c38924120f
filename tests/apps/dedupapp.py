"""A Celery app for de-duplication tests on prefork workers and beat; configured from the
environment:

REDLOCK_TEST_BROKER   broker URL (a throwaway Redis, or RabbitMQ)
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    redlock_url
REDLOCK_TEST_RECORD   a Redis URL where task bodies record what they did
DEDUP_TTL             redlock_ttl (seconds)
DEDUP_ROLE            "beat": the process does not define ``dd.blind_tick``, so beat
                      publishes it by name (``send_task``) while it publishes ``dd.tick``
                      through the task's ``apply_async``
DEDUP_CONF            optional JSON object of extra app.conf settings
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Task

from celery_redlock import LockedTask
from tests.apps.factory import env_app

app = env_app(
    "dedupapp",
    redlock_ttl=float(os.environ.get("DEDUP_TTL", "30")),
    task_acks_late=False,
    beat_max_loop_interval=0.25,
    beat_schedule={
        "tick": {"task": "dd.tick", "schedule": 0.5},
        "blind": {"task": "dd.blind_tick", "schedule": 0.5},
    },
)
app.conf.update(json.loads(os.environ.get("DEDUP_CONF") or "{}"))

_record: dict[int, redis.Redis] = {}


def record(event: str, **fields: Any) -> None:
    """Append one JSON event to the record list (read by the test)."""
    pid = os.getpid()
    if pid not in _record:
        _record[pid] = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    fields.update(event=event, pid=pid, t=time.time())
    _record[pid].rpush("events", json.dumps(fields))


_ENQUEUE_RUN: dict[str, Any] = {
    "base": LockedTask,
    "bind": True,
    "lock_on": "enqueue+run",
    # the tests import this module to publish: its tasks must not join every app made later
    "shared": False,
}


@app.task(name="dd.hold", lock_key="hold:<key>", **_ENQUEUE_RUN)
def hold(self: Task, key: str, seconds: float) -> str:
    """Record the start (with this pid), then hold the key for *seconds*."""
    record("start", key=key, task_id=self.request.id)
    time.sleep(seconds)
    record("end", key=key, task_id=self.request.id)
    return key


@app.task(name="dd.limited", lock_key="limited:<key>", time_limit=1.5, **_ENQUEUE_RUN)
def limited(self: Task, key: str) -> None:
    """Runs past its hard time limit."""
    record("start", key=key, task_id=self.request.id)
    time.sleep(30)


@app.task(name="dd.tick", lock_key="tick", lock_on_contended="skip", **_ENQUEUE_RUN)
def tick(self: Task) -> None:
    """A 2 s run on a 0.5 s schedule, published by beat through apply_async."""
    record("run", name="tick", start=time.time())
    time.sleep(2)
    record("run-end", name="tick", end=time.time())


@app.task(name="dd.pre", shared=False)
def pre(seconds: float) -> int:
    """A plain (unlocked) first chain step: sleeps *seconds*, returns 7."""
    time.sleep(seconds)
    return 7


@app.task(name="dd.fin", lock_key="fin:<tag>", **_ENQUEUE_RUN)
def fin(self: Task, value: int, seconds: float = 0.0, tag: str = "fin") -> int:
    """A locked last chain step (or a plain call) that holds its key for *seconds*."""
    record("start", key=tag, task_id=self.request.id)
    time.sleep(seconds)
    return value


@app.task(name="dd.estep", lock_key="estep:<tag>", lock_on_contended="wait", **_ENQUEUE_RUN)
def estep(self: Task, a: int, b: int, tag: str = "estep") -> int:
    """A chain step of one key for every call: waits for the key (woken by the release)."""
    record("start", key=tag, task_id=self.request.id)
    time.sleep(0.3)
    return a + b


@app.task(
    name="dd.rpart",
    lock_key="rpart:<tag>:<n>",
    lock_on_duplicate="raise",
    **_ENQUEUE_RUN,
)
def rpart(self: Task, tag: str, n: int) -> int:
    """A chord member whose duplicates would raise AlreadyQueued as plain calls."""
    record("start", key=f"{tag}:{n}", task_id=self.request.id)
    time.sleep(0.5)
    return n


@app.task(name="dd.rtotal", shared=False)
def rtotal(results: list[Any]) -> dict[str, int]:
    """A chord callback: the sum of the members that ran, and how many were skipped."""
    skipped = [r for r in results if isinstance(r, dict) and r.get("celery_redlock.skipped")]
    return {"sum": sum(r for r in results if isinstance(r, int)), "skipped": len(skipped)}


if os.environ.get("DEDUP_ROLE") != "beat":

    @app.task(name="dd.blind_tick", lock_key="blind", lock_on_contended="skip", **_ENQUEUE_RUN)
    def blind_tick(self: Task) -> None:
        """The same, published by beat by name: beat's process does not know this task."""
        record("run", name="blind", start=time.time())
        time.sleep(2)
        record("run-end", name="blind", end=time.time())
