"""A task that hands its fence to the database it writes (see ``store.py``).

Needs one Redis: ``redis://localhost:6379`` (databases 0 broker, 1 locks, 2 results);
``REDIS_URL=redis://host:port`` points it elsewhere. The store is the SQLite file
``PRICES_DB`` (default: ``celery-redlock-prices.sqlite3`` in the system's temporary
directory, outside the source tree). Run it::

    cd examples/fenced_store
    celery -A tasks worker -P prefork -c 2 -l info
    python paused_holder.py        # no worker needed: a paused holder's late write is refused

``lock_on_lost="warn"`` lets a run whose lock was lost go on to its write, to show
the store refusing it; with the default ``"raise"``, ``LockLost`` stops the body
first (within one renewal interval), and the fence guards the writes already under
way when the lock was lost.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
from contextlib import closing

import store
from celery import Celery

from celery_redlock import LockedTask

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
DB = os.environ.get(
    "PRICES_DB", os.path.join(tempfile.gettempdir(), "celery-redlock-prices.sqlite3")
)

app = Celery("tasks", broker=f"{REDIS_URL}/0", backend=f"{REDIS_URL}/2")
app.conf.redlock_url = f"{REDIS_URL}/1"
app.conf.broker_connection_retry_on_startup = True


def journal(what: str, sku: str, price: int, fence: int | None) -> None:
    """Append to the journal table: who tried to write what, and whether it applied."""
    with closing(sqlite3.connect(DB, timeout=10, isolation_level=None)) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS journal"
            " (at REAL, pid INTEGER, what TEXT, sku TEXT, price INTEGER, fence INTEGER)"
        )
        conn.execute(
            "INSERT INTO journal VALUES (?, ?, ?, ?, ?, ?)",
            (time.time(), os.getpid(), what, sku, price, fence),
        )


@app.task(
    base=LockedTask,
    bind=True,
    lock_key="price:<sku>",
    lock_ttl=float(os.environ.get("PRICE_LOCK_TTL", "30")),
    lock_on_lost="warn",
)
def set_price(self: LockedTask, sku: str, price: int, work: float = 0.0) -> bool:
    """Compute the price (*work* seconds), then write it with this run's fence."""
    fence = self.lock.fence
    journal("start", sku, price, fence)
    time.sleep(work)
    applied = store.write(DB, sku, price, fence)
    journal("applied" if applied else "refused", sku, price, fence)
    return applied
