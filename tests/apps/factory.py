"""What the Celery apps here share: an app configured from the environment, and a recorder.

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    redlock_url (a comma makes it a list of Redlock masters)
REDLOCK_TEST_RECORD   a Redis URL where tasks record what they did

It never imports celery_redlock, so an app that must not (``configplain``) can use it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

_record: redis.Redis | None = None


def env_app(name: str, **conf: Any) -> Celery:
    """A Celery app named *name* on the environment's broker, backend and lock servers, one
    message prefetched a process, retrying the broker at start-up; *conf* adds or overrides
    settings."""
    app = Celery(
        name,
        broker=os.environ.get("REDLOCK_TEST_BROKER", "redis://127.0.0.1:1/0"),
        backend=os.environ.get("REDLOCK_TEST_BACKEND", "redis://127.0.0.1:1/2"),
    )
    locks = os.environ.get("REDLOCK_TEST_LOCKS", "redis://127.0.0.1:1/1")
    app.conf.update(
        redlock_url=locks.split(",") if "," in locks else locks,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )
    app.conf.update(conf)
    return app


def record(event: str, **fields: object) -> None:
    """Append one JSON event (with the pid and time) to the record list "events"."""
    global _record
    if _record is None:
        _record = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    fields.update(event=event, pid=os.getpid(), t=time.time())
    _record.rpush("events", json.dumps(fields))
