"""``Semaphore``: up to *limit* holders of one name at once, each with a permit of its own.

A permit is an acquisition like a lock's: its own 160-bit token, owner-checked release
and extend, a lease kept alive by the per-process renewal thread, a local deadline that
decides, a fence from the name's counter (strictly increasing across every permit and
lock of the name). The state machine is :class:`~celery_redlock.core.lock.Lock`'s;
only the slot differs (one of *limit* permits instead of the mutex). ``limit=1`` is a
plain lock: the same slot as ``Lock``, so a ``Semaphore(limit=1)`` and a ``Lock`` of
one name exclude each other, and it works on a list of Redlock masters too.

How permits are stored on Redis (``permit_acquire.lua``; the memory backend keeps the
same): one hash per name, ``<prefix>{<name>}:permits``, one field per permit, ``token ->
"<expiry in server ms>|<fence>|<holder record>"``. A permit is granted only while the
hash has fewer than *limit* fields; when it is full, the expired ones are removed
first. So live permits <= fields <= limit at every moment, an expired permit takes
nobody's place (whoever finds the hash full removes it), and granting costs O(1) while
a permit is free, O(limit) when the hash is full. Expiry is judged by the server's
clock (``TIME`` in the scripts), the same clock that expires a lock's key; the key
itself expires with its longest permit, so nothing outlives its holders.

Why not on a list of Redlock masters (limit > 1): a permit held on a majority of
masters does not bound the holders. Three masters, limit 2: A holds permits on
masters 1 and 2, B on 2 and 3, C on 1 and 3. Each holds a majority, and no master
holds more than 2 permits, yet three run at once. A backend holds permits when it has
the :class:`~.backend.Permits` capability; a quorum has not.
"""

from __future__ import annotations

from typing import Any

from .backend import Permits, need
from .backend_types import Slot
from .errors import ConfigError
from .keys import permit_keys
from .lock import Lock

__all__ = ["Semaphore", "check_limit"]


def check_limit(limit: Any) -> int:
    """*limit* as a whole number >= 1, or a ConfigError naming it."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"limit must be a whole number >= 1, got {limit!r}")
    return limit


class Semaphore(Lock):
    """Up to *limit* holders of *name* at once; each ``acquire`` takes one permit.

    >>> imports = Semaphore(redis.Redis(), "imports:customer-7", limit=3, ttl=60)
    >>> with imports:                # LockContended when all 3 permits are held
    ...     run_import(fence=imports.fence)

    The interface is :class:`~celery_redlock.core.lock.Lock`'s (``acquire``,
    ``release``, ``extend``, ``owned``, ``locked``, ``fence``, ``valid_until``, ``with``,
    ``auto_renew``, ``max_hold``, ``reentrant``, ``owner_info``), per permit: one object
    holds at most one permit at a time (use one object per holder). ``locked()`` is
    True when every permit is held; a blocking ``acquire`` waits for a release notice,
    capped at the lease left on the permit that expires first. ``holder`` (after a
    refused attempt) is that permit's record.

    *target* is one Redis (a client, a Sentinel ``master_for()`` client, a
    ``RedisCluster``) or a backend; a list of Redlock masters is refused for
    ``limit > 1`` (a ConfigError: see the module docstring).
    """

    def __init__(
        self,
        target: Any,
        name: str,
        limit: int,
        ttl: float = 30.0,
        **options: Any,
    ) -> None:
        limit = check_limit(limit)
        super().__init__(target, name, ttl, **options)
        self.limit = limit
        if limit > 1:
            need(self.backend, Permits)
            self.keys = permit_keys(name, self.key_prefix)
            self.slot = Slot(self.keys, limit)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f" limit={self.limit}>"
