"""A Celery app for worker-configuration tests; configured from the environment.

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL
REDLOCK_TEST_LOCKS    app.conf.redlock_url (worker flags may point elsewhere)
REDLOCK_TEST_RECORD   a Redis URL where tasks record what they did
REDLOCK_TEST_CONF     optional JSON object of extra app.conf settings (bad ones included)
"""

from __future__ import annotations

import json
import os
import time

from celery_redlock import LockedTask
from tests.apps.factory import env_app, record

app = env_app("configapp", redlock_ttl=30)
app.conf.update(json.loads(os.environ.get("REDLOCK_TEST_CONF") or "{}"))


@app.task(base=LockedTask, bind=True, lock_key="cfg:<name>", lock_on_contended="raise")
def held(self, name: str, seconds: float) -> str:
    """Hold cfg:<name> for a while, recording whether a lock was taken (and its fence)."""
    lock = self.lock
    record("start", name=name, locked=lock is not None, fence=lock.fence if lock else None)
    time.sleep(seconds)
    record("end", name=name)
    return name
