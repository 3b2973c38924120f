"""A plain Celery app that never imports celery_redlock: locking comes from settings only.

``app.conf.redlock_tasks`` alone must lock its ``shared_task`` (the ``celery``
command loads celery_redlock through its ``celery.commands`` entry point).
Environment: REDLOCK_TEST_BROKER, REDLOCK_TEST_BACKEND, REDLOCK_TEST_LOCKS,
REDLOCK_TEST_RECORD (see ``configapp``).
"""

from __future__ import annotations

import time
from typing import Any

from celery import shared_task

from tests.apps.factory import env_app, record

app = env_app("configplain")
app.conf.redlock_tasks = {
    "tests.apps.configplain.plain_*": {"lock_key": "plain:<n>", "lock_on_contended": "skip"},
}


@shared_task(bind=True)
def plain_hold(self: Any, n: int, seconds: float) -> int:
    """Not a LockedTask; redlock_tasks locks it under plain:<n> with the skip policy."""
    lock = getattr(self, "lock", None)
    record("plain", n=n, locked=lock is not None, fence=lock.fence if lock else None)
    time.sleep(seconds)
    return n
