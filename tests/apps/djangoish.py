"""A Django-style Celery app (``proj/celery.py``): every setting comes from a settings
module under the ``CELERY_`` namespace (:mod:`tests.apps.djangoish_settings`), as
``app.config_from_object("django.conf:settings", namespace="CELERY")`` does."""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery, Task

from celery_redlock import LockedTask

app = Celery("djangoish")
app.config_from_object("tests.apps.djangoish_settings", namespace="CELERY")


@app.task(name="ns.hold", base=LockedTask, bind=True, lock_key="ns:<name>", shared=False)
def hold(self: Task, name: str, seconds: float) -> str:
    """Record the lock's lease, then hold ns:<name> for *seconds*."""
    lock = self.lock
    record = redis.Redis.from_url(os.environ["NS_RECORD"])
    event = {"event": "start", "name": name, "ttl": lock.ttl if lock else None}
    record.rpush("events", json.dumps(event))
    time.sleep(seconds)
    record.close()
    return name
