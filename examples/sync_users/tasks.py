"""Per-argument locks with retry: one sync per user at a time, any number of users at once.

Run it (a Redis on localhost, or set the URLs below)::

    cd examples/sync_users
    celery -A tasks worker -P prefork -c 4 -E -l info     # -E: redlock-* events for Flower
    celery -A tasks beat -S celery_redlock.beat:LeaderScheduler -l info
    python send.py                                         # nine syncs for three users

Settings come from the environment, so ``docker-compose.yml`` (at the repository root)
runs this same module: ``CELERY_BROKER_URL`` (default ``redis://localhost:6379/0``),
``CELERY_RESULT_BACKEND`` (``redis://localhost:6379/2``), ``REDLOCK_URL``
(``redis://localhost:6379/1``).
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_redlock import LockedTask

app = Celery(
    "tasks",
    broker=os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0"),
    backend=os.environ.get("CELERY_RESULT_BACKEND", "redis://localhost:6379/2"),
)
app.conf.redlock_url = os.environ.get("REDLOCK_URL", "redis://localhost:6379/1")
app.conf.broker_connection_retry_on_startup = True
app.conf.beat_schedule = {
    # Every 30 s a full sync of user 1; if the last one still runs, this one is re-queued.
    "sync-user-1": {
        "task": "tasks.sync_user",
        "schedule": 30.0,
        "args": (1,),
        "kwargs": {"full": True},
    },
}


@app.task(base=LockedTask, bind=True, lock_key="sync:<user_id>", lock_on_contended="retry")
def sync_user(self: LockedTask, user_id: int, full: bool = False) -> dict[str, object]:
    """Sync one user; never two syncs of the same user at once."""
    started = time.time()
    time.sleep(2.0 if full else 0.5)  # the work: call the user's provider, write rows, ...
    return {
        "user_id": user_id,
        "fence": self.lock.fence if self.lock else None,  # hand this to the storage you write
        "started": started,
        "finished": time.time(),
        "worker": self.request.hostname,
    }
