"""A store that refuses writes from a holder whose lock has moved on: the fence, for real.

Every row carries the fence of the lock holder that wrote it last. A write names its
fence and is applied only if that fence is larger than the row's (one statement, so
two writers cannot both pass the check)::

    UPDATE prices SET price = :price, fence = :fence
     WHERE sku = :sku AND fence < :fence

A writer that was paused past its lease (a GC pause, SIGSTOP, a slow disk) wakes up
with an old fence; by then the next holder has written with a larger one, so the late
write changes nothing and :func:`write` returns False. The same statement works on
PostgreSQL (``fence BIGINT``): fences are large numbers, so use a 64-bit column.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing


def connect(path: str) -> sqlite3.Connection:
    """A connection to the store, creating its table on first use."""
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)  # autocommit
    conn.execute(
        "CREATE TABLE IF NOT EXISTS prices ("
        " sku TEXT PRIMARY KEY, price INTEGER NOT NULL, fence INTEGER NOT NULL)"
    )
    return conn


def write(path: str, sku: str, price: int, fence: int) -> bool:
    """Set *sku*'s price if *fence* is newer than the last writer's; True if applied."""
    with closing(connect(path)) as conn:
        conn.execute(
            "INSERT OR IGNORE INTO prices (sku, price, fence) VALUES (:sku, :price, -1)",
            {"sku": sku, "price": price},
        )
        cursor = conn.execute(
            "UPDATE prices SET price = :price, fence = :fence WHERE sku = :sku AND fence < :fence",
            {"sku": sku, "price": price, "fence": fence},
        )
        return cursor.rowcount == 1


def read(path: str, sku: str) -> tuple[int, int] | None:
    """(price, fence) of *sku*, or None."""
    with closing(connect(path)) as conn:
        row = conn.execute(
            "SELECT price, fence FROM prices WHERE sku = :sku", {"sku": sku}
        ).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))
