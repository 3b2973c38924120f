"""The worker's main process learns at once that a pool child died.

Celery notices a dead pool child through the child's sentinel, and reaps it then; when
the sentinel wakes it a moment before the child can be reaped, it finds nothing and
notices only at its next pool maintenance, up to five seconds later. A locked run's key
would wait that long. So the main process watches the children running locked tasks
itself: one thread per process, blocked on a ``pidfd`` per child (readable once the
child has exited; Linux 5.3 and later), or polling ``/proc`` five times a second where
there is none. It keeps one entry per child (the latest run it accepted), and calls that
entry's callback once, in the thread, when the child is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

__all__ = ["alive", "unwatch", "watch"]

log = logging.getLogger("celery_redlock.release")

#: How often the /proc fallback looks, in milliseconds.
_POLL_MS = 200

_lock = threading.Lock()
#: pid -> (its pidfd or None, what to call when it is gone).
_watched: dict[int, tuple[int | None, Callable[[], object]]] = {}
_thread: threading.Thread | None = None
_wake: tuple[int, int] | None = None


def alive(pid: int) -> bool:
    """True while *pid* runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(pid: int, on_gone: Callable[[], object]) -> None:
    """Call *on_gone* (once, in the watcher thread) when child *pid* has exited; a later
    call for the same pid replaces the callback (the child's newer run)."""
    global _thread, _wake
    with _lock:
        entry = _watched.get(pid)
        if entry is not None:
            _watched[pid] = (entry[0], on_gone)
            return
        _watched[pid] = (_pidfd(pid), on_gone)
        if _thread is None or not _thread.is_alive():
            _wake = os.pipe()
            _thread = threading.Thread(target=_run, name="celery-redlock-children", daemon=True)
            _thread.start()
        wake = _wake
        assert wake is not None
    with contextlib.suppress(OSError):
        os.write(wake[1], b"x")


def unwatch(pid: int) -> None:
    """Stop watching *pid* (its callback is not called)."""
    with _lock:
        entry = _watched.pop(pid, None)
    if entry is not None and entry[0] is not None:
        _close(entry[0])


def _pidfd(pid: int) -> int | None:
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
    except (OSError, OverflowError, ValueError):
        # Gone already, a kernel without pidfds, or not a pid at all: /proc instead (which
        # finds no such process, so the callback runs at once and finds nothing running).
        return None
    return fd


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _run() -> None:
    while True:
        with _lock:
            entries = dict(_watched)
            wake = _wake
        if wake is None:
            return
        poller = select.poll()
        poller.register(wake[0], select.POLLIN)
        by_fd = {}
        for pid, (fd, _) in entries.items():
            if fd is not None:
                poller.register(fd, select.POLLIN)
                by_fd[fd] = pid
        polled = any(fd is None for fd, _ in entries.values())
        ready = poller.poll(_POLL_MS if polled else None)
        gone = {by_fd[fd] for fd, _ in ready if fd in by_fd}
        if any(fd == wake[0] for fd, _ in ready):
            with contextlib.suppress(OSError):
                os.read(wake[0], 4096)
        gone |= {pid for pid, (fd, _) in entries.items() if fd is None and not alive(pid)}
        for pid in gone:
            with _lock:
                entry = _watched.pop(pid, None)
            if entry is None:
                continue
            if entry[0] is not None:
                _close(entry[0])
            try:
                entry[1]()
            except Exception:
                log.exception("the callback for pool child %s that exited failed", pid)
