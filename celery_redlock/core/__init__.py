"""The lock core: Redis locks with no knowledge of Celery.

Dependency points one way: this package never imports celery.
"""

from __future__ import annotations

from .base import BaseLock
from .connect import connect, mask_url
from .errors import (
    ConfigError,
    LockContended,
    LockLost,
    NotOwned,
    QuorumUnavailable,
    RedlockError,
)
from .events import LockEvent, add_hook, remove_hook
from .keys import KeyTemplate, lock_keys, render_value
from .lock import Lock
from .redlock import Redlock
from .renewal import get_manager

__all__ = [
    "BaseLock",
    "ConfigError",
    "KeyTemplate",
    "Lock",
    "LockContended",
    "LockEvent",
    "LockLost",
    "NotOwned",
    "QuorumUnavailable",
    "Redlock",
    "RedlockError",
    "add_hook",
    "connect",
    "get_manager",
    "lock_keys",
    "mask_url",
    "remove_hook",
    "render_value",
]
