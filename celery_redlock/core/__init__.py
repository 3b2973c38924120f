"""The lock core: Redis locks with no knowledge of Celery.

Dependency points one way: this package never imports celery. The lock logic
(:mod:`.lock`) talks to Redis only through a store (:mod:`.store`): one Redis
(:mod:`.stores.redis`) or a quorum of masters (:mod:`.stores.quorum`), which send
through one path (:mod:`.send`, :mod:`.fanout`).
"""

from __future__ import annotations

from .connect import connect, mask_url
from .errors import (
    AlreadyQueued,
    ConfigError,
    LockContended,
    LockLost,
    NotOwned,
    QuorumUnavailable,
    RateLimited,
    RedlockError,
)
from .events import LockEvent, add_hook, remove_hook
from .keys import KeyTemplate, lock_keys, render_value
from .lock import Lock, Redlock, open_store
from .queued import QueuedHold
from .ratelimit import RateLimiter
from .renewal import get_manager
from .semaphore import Semaphore
from .store import Handover, Queued, RateGrant, Store

__all__ = [
    "AlreadyQueued",
    "ConfigError",
    "Handover",
    "KeyTemplate",
    "Lock",
    "LockContended",
    "LockEvent",
    "LockLost",
    "NotOwned",
    "Queued",
    "QueuedHold",
    "QuorumUnavailable",
    "RateGrant",
    "RateLimited",
    "RateLimiter",
    "Redlock",
    "RedlockError",
    "Semaphore",
    "Store",
    "add_hook",
    "connect",
    "get_manager",
    "lock_keys",
    "mask_url",
    "open_store",
    "remove_hook",
    "render_value",
]
