"""A Celery app for beat tests: one body-less task on a 1 s schedule.

Configured from the environment so each test points it at its own throwaway
servers: ``BEATAPP_BROKER`` (required), ``BEATAPP_LOCKS`` (lock store, default:
the broker; comma-separated URLs are Redlock masters), ``BEATAPP_BEAT_TTL`` (leader
lease, seconds), ``BEATAPP_SCHEDULER`` (``redlock_beat_scheduler``: the scheduler the
leader leads; default Celery's in-memory one), ``BEATAPP_REDBEAT`` (RedBeat's Redis,
``redbeat_redis_url``; nothing else about RedBeat is set: its defaults, its own lock
on). Each published message carries the
publishing beat's pid and the publish time as its arguments, evaluated by beat at
publish time, so a test reading the broker queue knows who sent what; except under
RedBeat, which stores each entry as JSON (a ``BeatLazyFunc`` is not): its messages
carry no arguments.
"""

from __future__ import annotations

import os
import time

from celery import Celery
from celery.beat import BeatLazyFunc

_locks = os.environ.get("BEATAPP_LOCKS", "")
_redbeat = os.environ.get("BEATAPP_REDBEAT")

app = Celery("beatapp", broker=os.environ["BEATAPP_BROKER"])
app.conf.update(
    redlock_url=(_locks.split(",") if "," in _locks else _locks) or None,
    redlock_beat_ttl=float(os.environ.get("BEATAPP_BEAT_TTL", "2")),
    redlock_beat_scheduler=os.environ.get("BEATAPP_SCHEDULER") or None,
    beat_max_loop_interval=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "heartbeat": {
            "task": "beatapp.heartbeat",
            "schedule": 1.0,
            "args": () if _redbeat else (BeatLazyFunc(os.getpid), BeatLazyFunc(time.time)),
        },
    },
)

if _redbeat:
    app.conf.redbeat_redis_url = _redbeat


@app.task(name="beatapp.heartbeat")
def heartbeat(pid: int = 0, at: float = 0.0) -> None:
    """Does nothing: the tests count the messages beat publishes, not runs."""
