"""The process's thread pool for calls that run beside the caller.

Two users: a quorum backend asks its masters at once (latency ~ the slowest of a
majority, not the sum), and the renewal thread renews each backend's batch at once.
The pool belongs to the process: its threads are made on demand up to
:data:`MAX_WORKERS` and then reused, so their number stays flat however many locks
are made and dropped. A forked child gets a new, empty pool (the parent's threads do
not exist there).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from . import process

__all__ = ["MAX_WORKERS", "executor", "submit"]

#: The most threads the pool runs at once.
MAX_WORKERS = 32

_T = TypeVar("_T")
_executor: cf.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def executor() -> cf.ThreadPoolExecutor:
    """The process's pool (made on first use)."""
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = cf.ThreadPoolExecutor(
                    max_workers=MAX_WORKERS, thread_name_prefix="celery-redlock-io"
                )
    return _executor


def submit(fn: Callable[..., _T], *args: Any) -> cf.Future[_T]:
    """Run ``fn(*args)`` in the pool; at interpreter exit (the pool refuses new work),
    run it here instead."""
    try:
        return executor().submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        future: cf.Future[_T] = cf.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever reads the future
            future.set_exception(exc)
        return future


def _after_fork() -> None:
    global _executor, _executor_lock
    _executor = None
    _executor_lock = threading.Lock()


process.on_fork(_after_fork)
