"""celery-redlock: distributed locks for Celery tasks that stay correct under failure."""

from __future__ import annotations

from .app.controls import control
from .app.rules import BackOff, Limit, Rate
from .app.tracing import disable_tracing, enable_tracing
from .core import (
    AlreadyQueued,
    ConfigError,
    ForeignData,
    HeldBack,
    KeyTemplate,
    Lock,
    LockContended,
    LockEvent,
    LockLost,
    NotOwned,
    QueuedHold,
    QuorumUnavailable,
    RateLimited,
    RateLimiter,
    Redlock,
    RedlockError,
    Semaphore,
    StoreUnavailable,
    add_hook,
    connect,
    remove_hook,
)
from .install import install
from .task.locked_task import SKIPPED, LockedTask, is_skipped

#: The one place the version is written: pyproject.toml reads it from here when a wheel
#: or an sdist is built, and the CHANGELOG has a dated heading for it.
__version__ = "0.1.0"

__all__ = [
    "SKIPPED",
    "AlreadyQueued",
    "BackOff",
    "ConfigError",
    "ForeignData",
    "HeldBack",
    "KeyTemplate",
    "Limit",
    "Lock",
    "LockContended",
    "LockEvent",
    "LockLost",
    "LockedTask",
    "NotOwned",
    "QueuedHold",
    "QuorumUnavailable",
    "Rate",
    "RateLimited",
    "RateLimiter",
    "Redlock",
    "RedlockError",
    "Semaphore",
    "StoreUnavailable",
    "__version__",
    "add_hook",
    "connect",
    "control",
    "disable_tracing",
    "enable_tracing",
    "install",
    "is_skipped",
    "remove_hook",
]
