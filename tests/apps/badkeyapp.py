"""A Celery app whose one LockedTask names an argument it does not take in its lock_key
(``<usr_id>``): a worker or a beat of it must stop at start with one line. Configured
from the environment: BADKEY_BROKER (a throwaway Redis), BADKEY_LOCKS (redlock_url)."""

from __future__ import annotations

import os

from celery import Celery

from celery_redlock import LockedTask

app = Celery("badkeyapp", broker=os.environ.get("BADKEY_BROKER", "redis://127.0.0.1:1/0"))
app.conf.redlock_url = os.environ.get("BADKEY_LOCKS", "redis://127.0.0.1:1/1")
app.conf.broker_connection_retry_on_startup = True


@app.task(base=LockedTask, lock_key="sync:<usr_id>", shared=False)
def sync_user(user_id: int) -> None:
    """Never runs: its lock_key names <usr_id>."""
