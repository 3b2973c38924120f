"""celery-redlock: distributed locks for Celery tasks that stay correct under failure."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .app.controls import control
from .app.rules import BackOff, Limit, Rate
from .app.tracing import disable_tracing, enable_tracing
from .core import (
    AlreadyQueued,
    ConfigError,
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
    add_hook,
    connect,
    remove_hook,
)
from .install import install
from .task.locked_task import SKIPPED, LockedTask, is_skipped

try:
    __version__ = version("celery-redlock")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = [
    "SKIPPED",
    "AlreadyQueued",
    "BackOff",
    "ConfigError",
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
