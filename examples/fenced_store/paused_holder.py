"""A holder paused past its lease writes late; the store refuses it: ``python paused_holder.py``.

1. Holder A takes ``price:sku-1`` (a 1 s lease, no renewal: as if its process froze).
2. A's lease runs out while it is "paused".
3. ``set_price("sku-1", 120)`` runs (here in this process, with the same lock
   semantics as on a worker): it takes the lock with a larger fence and writes.
4. A wakes up and writes 100 with its old fence: the store refuses it; the price
   stays 120. A also learns it lost the lock (``owned()`` is False).

Needs only a Redis (``REDIS_URL``, default ``redis://localhost:6379``; database 1 for
the lock) and the SQLite file ``PRICES_DB`` (see ``tasks.py``), no worker.
"""

from __future__ import annotations

import sys
import time

import store
from tasks import DB, REDIS_URL, set_price

from celery_redlock import Lock, connect


def main() -> int:
    holder = Lock(connect(f"{REDIS_URL}/1"), "price:sku-1", ttl=1.0, auto_renew=False)
    if not holder.acquire(timeout=5):
        print("price:sku-1 is held by someone else; try again")
        return 1
    print(f"A holds price:sku-1 with fence {holder.fence}, then pauses")
    deadline = time.monotonic() + 10
    while holder.locked() and time.monotonic() < deadline:  # the lease runs out
        time.sleep(0.05)
    applied = set_price.apply(args=("sku-1", 120)).get()
    print(f"set_price(sku-1, 120) took the lock after A's lease ran out: applied={applied}")
    assert holder.fence is not None
    late = store.write(DB, "sku-1", 100, holder.fence)
    print(f"A wakes up, still owns it? {holder.owned()}; its late write applied={late}")
    print(f"stored (price, fence): {store.read(DB, 'sku-1')}")
    return 0 if applied and not late else 1


if __name__ == "__main__":
    sys.exit(main())
