"""The lock core: locks, semaphores, rate limits and queued holds, with no knowledge of
Celery.

Dependency points one way: this package never imports celery. The primitives
(:mod:`.lock`, :mod:`.semaphore`, :mod:`.ratelimit`, :mod:`.queued`, :mod:`.records`)
and the renewal thread (:mod:`.renewal`) talk to where locks live only through the
verbs of a backend (:mod:`.backend`): one Redis, a quorum of masters (Redlock), or this
process's memory (:mod:`.backends`). The operator side (beat, the board, ``celery
locks``) reaches backends through this package: :func:`open_backend`, and for a failed
call :data:`STORE_ERRORS` and :func:`access_denied`.
"""

from __future__ import annotations

from .backend import Backend, need
from .backend_types import Grant, Handover, Holder, Queued, RateGrant, Slot, Status
from .backends import STORE_ERRORS, access_denied, open_backend
from .connect import connect, mask_url
from .errors import (
    AlreadyQueued,
    ConfigError,
    ForeignData,
    HeldBack,
    LockContended,
    LockLost,
    NotOwned,
    QuorumUnavailable,
    RateLimited,
    RedlockError,
    StoreUnavailable,
)
from .events import LockEvent, add_hook, remove_hook
from .keys import KeyTemplate, lock_keys, render_value
from .lock import Lock, Redlock
from .queued import QueuedHold, RunLock
from .ratelimit import RateLimiter
from .records import LockRecords
from .renewal import get_manager
from .semaphore import Semaphore

__all__ = [
    "STORE_ERRORS",
    "AlreadyQueued",
    "Backend",
    "ConfigError",
    "ForeignData",
    "Grant",
    "Handover",
    "HeldBack",
    "Holder",
    "KeyTemplate",
    "Lock",
    "LockContended",
    "LockEvent",
    "LockLost",
    "LockRecords",
    "NotOwned",
    "Queued",
    "QueuedHold",
    "QuorumUnavailable",
    "RateGrant",
    "RateLimited",
    "RateLimiter",
    "Redlock",
    "RedlockError",
    "RunLock",
    "Semaphore",
    "Slot",
    "Status",
    "StoreUnavailable",
    "access_denied",
    "add_hook",
    "connect",
    "get_manager",
    "lock_keys",
    "mask_url",
    "need",
    "open_backend",
    "remove_hook",
    "render_value",
]
