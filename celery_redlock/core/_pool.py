"""One long-lived I/O thread pool per process (Redlock fan-out, renewal per node).

Recreated lazily after ``fork``: a child never uses its parent's threads.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_pid = 0
MAX_WORKERS = 32


def executor() -> ThreadPoolExecutor:
    """The process's shared pool for Redis calls made in parallel."""
    global _executor, _pid
    pid = os.getpid()
    if _executor is not None and _pid == pid:
        return _executor
    with _lock:
        if _executor is None or _pid != pid:
            _executor = ThreadPoolExecutor(
                max_workers=MAX_WORKERS, thread_name_prefix="celery-redlock-io"
            )
            _pid = pid
        return _executor


def _forget_after_fork() -> None:
    global _executor, _lock
    _executor = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
