"""This process: its id, the one after-fork reset for everything kept per process, and
the locks and tables kept per process (:class:`ForkLock`, :func:`made_once`).

Whatever the package keeps per process (the renewal thread, the thread pool, memory
stores, a quorum's calls in flight, an app's Redis clients) registers a reset with
:func:`on_fork`. One ``os.register_at_fork`` hook runs them all in a forked child,
before ``os.fork()`` returns there, so a child never uses its parent's threads, sockets
or locks.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, MutableMapping
from types import MethodType
from typing import Any, TypeVar

__all__ = ["ForkLock", "This", "made_once", "on_fork", "this"]

_K = TypeVar("_K")
_V = TypeVar("_V")

log = logging.getLogger("celery_redlock")


class This:
    """This process: ``this.pid`` is its id, kept current across ``fork`` (an attribute,
    read without a call or a system call on hot paths)."""

    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()


#: This process (see :class:`This`).
this = This()
_resets: list[Callable[[], Callable[[], None] | None]] = []
_resets_lock = threading.Lock()
#: Dead references (methods of collected objects) are dropped when the list reaches this
#: length, which then doubles the live count: registering stays O(1) amortised, and a
#: process that makes and drops objects in a loop keeps a list as long as the live ones.
_prune_at = 64


def on_fork(reset: Callable[[], None]) -> Callable[[], None]:
    """Run *reset* in every child forked from now on; returns it (usable as a decorator).

    A bound method is held weakly: registering an object's method does not keep the
    object alive, and a method of a collected object is dropped.
    """
    global _prune_at
    ref: Callable[[], Callable[[], None] | None] = (
        weakref.WeakMethod(reset) if isinstance(reset, MethodType) else lambda: reset
    )
    with _resets_lock:
        if len(_resets) >= _prune_at:
            _resets[:] = [r for r in _resets if r() is not None]
            _prune_at = max(64, 2 * len(_resets))
        _resets.append(ref)
    return reset


def _after_fork_in_child() -> None:
    global _resets_lock
    this.pid = os.getpid()
    _resets_lock = threading.Lock()  # the parent may have held it while forking
    alive = []
    for ref in _resets:
        reset = ref()
        if reset is None:
            continue
        alive.append(ref)
        try:
            reset()
        except Exception:  # a reset must never break the child
            log.exception("celery-redlock: after-fork reset %r failed", reset)
    _resets[:] = alive


os.register_at_fork(after_in_child=_after_fork_in_child)


class ForkLock:
    """A lock of this process (``threading.Lock``, or what *make* makes): a forked child
    gets a new one, since a thread of the parent may have held it while forking."""

    __slots__ = ("__weakref__", "_lock", "_make")

    def __init__(self, make: Callable[[], Any] = threading.Lock) -> None:
        self._make = make
        self._lock = make()
        on_fork(self._renew)

    def _renew(self) -> None:
        self._lock = self._make()

    def __enter__(self) -> bool:
        return bool(self._lock.__enter__())

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)


def made_once(table: MutableMapping[_K, _V], key: _K, make: Callable[[], _V], lock: ForkLock) -> _V:
    """``table[key]``, made by ``make()`` the first time, under *lock* (taken only when it
    is missing: the common path takes no lock), so that two threads make one."""
    found = table.get(key)
    if found is None:
        with lock:
            found = table.get(key)
            if found is None:
                found = table[key] = make()
    return found
