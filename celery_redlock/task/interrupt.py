"""``LockLost`` inside a running task body, when its lock is lost (``lock_on_lost``).

The renewal thread learns of the loss (the key is gone, or the local deadline passed)
and calls the lock's ``on_lost`` callback, :func:`on_lost`. That finds the
:class:`Watch` of the body running under the lock and, with ``lock_on_lost="raise"``,
interrupts that body's thread:

* in the main thread, by a signal (``SIGUSR2``) whose handler raises: it also cuts
  a blocking call short (a long ``time.sleep``, a socket read);
* in any other thread (thread pools, in-process test workers), by an asynchronous
  exception (``PyThreadState_SetAsyncExc``), raised at the body's next bytecode;
* in a green thread (``-P gevent`` or ``-P eventlet``, which monkey-patch ``threading``:
  the renewal thread is a green thread too), by a callback on the event loop that throws
  the exception into the body's green thread (``greenlet.throw``), so it ends the body's
  blocking call (``time.sleep``, a socket read), where the body yields. A body that never
  yields starves the renewal as well (see :mod:`celery_redlock.worker.pools`).

Either way the body sees a :class:`LockLostInterrupt` (a :class:`LockLost`) that names
the lock and why it was lost. With
``"warn"`` the loss is only logged (the body can read ``self.lock.lost``). Either way the
loss is one WARNING line, the lock's own (:mod:`celery_redlock.core.lease`), which names
the task from the lock's holder record; ``LockLost`` is in the task's ``throws``, so
Celery logs a run it ended at INFO, without a traceback. Each value
is a :class:`LostPolicy` registered in ``policies.LOST``; a task's is resolved once, with
its options (``options.lost``).

Timeline this guards against: the renewal thread decides to interrupt while the body
is returning. The decision (:meth:`Watch.lost`) and the body's end (:meth:`Watch.stop`)
take one guard, so an interrupt is either sent while the body runs or never; ``stop``
withdraws one that was sent and not yet delivered, so nothing lands in the caller's
code after the body returned.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..app.policies import LOST
from ..core import LockLost

__all__ = ["LockLostInterrupt", "LostPolicy", "Watch", "on_lost", "watch", "watch_of"]

log = logging.getLogger("celery_redlock.task")

_INTERRUPT_SIGNAL = getattr(signal, "SIGUSR2", None)


class LockLostInterrupt(LockLost):
    """Raised into a running body when its lock is lost (``lock_on_lost="raise"``).

    ``name`` is the lock's rendered name (``sync:42``), ``reason`` why it was lost.
    """

    def __init__(self, name: str = "", reason: str = "lost while the task ran") -> None:
        super().__init__(name, reason)

    def __reduce__(self) -> tuple[Any, ...]:
        # The class raised into a thread is a subclass made for one lock (_interrupt_for);
        # a copy (a result backend, a pool's pipe) is the public class.
        return (LockLostInterrupt, (self.name, self.reason))


def _interrupt_for(lock: Any) -> type[LockLostInterrupt]:
    """A :class:`LockLostInterrupt` whose construction without arguments names *lock*.

    ``PyThreadState_SetAsyncExc`` takes an exception class, not an instance, and raises
    it by calling it with no arguments; this subclass carries the lock's name and the
    reason as its defaults, and shows as ``LockLostInterrupt`` in tracebacks.
    """
    name = str(lock.name)
    reason = f"lost while the task ran ({lock.lost_reason or 'the lease ran out'})"

    class Interrupt(LockLostInterrupt):
        def __init__(self, name: str = name, reason: str = reason) -> None:
            super().__init__(name, reason)

    Interrupt.__name__ = Interrupt.__qualname__ = "LockLostInterrupt"
    Interrupt.__module__ = __name__
    return Interrupt


@dataclass(frozen=True)
class LostPolicy:
    """One ``lock_on_lost`` value."""

    #: Its name, the option's value.
    name: str
    #: The body still running is interrupted with :class:`LockLostInterrupt`; else the
    #: loss is only logged.
    interrupts: bool


# The ``lock_on_lost`` policies, in the order error messages list them.
LOST.register(LostPolicy("raise", interrupts=True))
LOST.register(LostPolicy("warn", interrupts=False))


#: Threads (idents) a signal was sent to and not yet delivered, with what it raises there.
_pending_signals: dict[int, LockLostInterrupt] = {}
_handler_installed = False
_previous_handler: Any = None


def _signal_handler(signum: int, frame: Any) -> None:
    ident = threading.get_ident()
    pending = _pending_signals.pop(ident, None)
    if pending is not None:
        raise pending
    if callable(_previous_handler):
        _previous_handler(signum, frame)


def _signal_usable() -> bool:
    """True when this (the main) thread can be interrupted by the signal; installs its
    handler on first use (a handler can only be installed from the main thread)."""
    global _handler_installed, _previous_handler
    if _handler_installed:
        return True
    if _INTERRUPT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return False
    _previous_handler = signal.signal(_INTERRUPT_SIGNAL, _signal_handler)
    _handler_installed = True
    return True


#: (the current green thread, a function that runs a callback on its event loop) when
#: green threads run bodies (gevent or eventlet patched ``threading``); found on first
#: use. A worker's pool monkey-patches before the app and its tasks are imported.
_GreenNow = Callable[[], tuple[Any, Callable[[Callable[[], object]], object]]]
_green_now: _GreenNow | None = None
_green_known = False


def _gevent_now() -> tuple[Any, Callable[[Callable[[], object]], object]]:
    import gevent  # noqa: PLC0415 - only where gevent patched threading

    return gevent.getcurrent(), gevent.get_hub().loop.run_callback


def _eventlet_now() -> tuple[Any, Callable[[Callable[[], object]], object]]:
    from eventlet import greenthread, hubs  # noqa: PLC0415 - only under eventlet's patch

    return greenthread.getcurrent(), functools.partial(hubs.get_hub().schedule_call_global, 0)


def _find_green() -> _GreenNow | None:
    """How to reach a body's green thread, when gevent or eventlet patched ``threading``
    (each asked through its public API); None with real threads."""
    monkey = sys.modules.get("gevent.monkey")
    patched = getattr(monkey, "is_module_patched", None)
    if callable(patched) and patched("threading"):
        return _gevent_now
    patcher = sys.modules.get("eventlet.patcher")
    patched = getattr(patcher, "is_monkey_patched", None)
    if callable(patched) and patched("thread"):
        return _eventlet_now
    return None


def _green() -> _GreenNow | None:
    global _green_now, _green_known
    if not _green_known:
        _green_now = _find_green()
        _green_known = True
    return _green_now


#: Held by lost() and stop() while they decide (see the module doc), and by watch() and
#: stop() to add and remove a watch. One for all watches: each holds it for a few
#: dictionary and attribute operations, and a lost lock is rare.
_guard = threading.Lock()
#: id(lock) -> the watch of the body running under that lock. A registry here, not an
#: attribute on the lock, so neither refers to the other and both are freed by reference
#: counting when a run ends.
_watches: dict[int, Watch] = {}


class Watch:
    """The body running under one lock: its thread, and what a loss does to it."""

    __slots__ = ("green", "policy", "running", "sent", "task_name", "thread", "use_signal")

    def __init__(self, task_name: str, policy: LostPolicy) -> None:
        self.task_name = task_name
        #: ``lock_on_lost``: "raise" interrupts the body, "warn" lets it run on.
        self.policy = policy
        self.running = True
        self.sent = False
        green = _green_now if _green_known else _green()
        #: (the body's green thread, its event loop's run-callback) under gevent/eventlet.
        self.green = green() if green is not None else None
        if self.green is not None:
            self.thread = 0
            self.use_signal = False
            return
        self.thread = thread = threading.get_ident()
        #: True: interrupted by a signal (main thread); False: by an asynchronous exception.
        self.use_signal = thread == threading.main_thread().ident and (
            _handler_installed or _signal_usable()
        )

    def stop(self, lock: Any) -> None:
        """The body has ended: no interrupt reaches its thread after this returns."""
        with _guard:
            self.running = False
            if _watches.get(id(lock)) is self:
                del _watches[id(lock)]
            if self.sent and self.green is None:
                if self.use_signal:
                    _pending_signals.pop(self.thread, None)
                else:
                    # Withdraw an interrupt not yet delivered (NULL clears the pending one).
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread), None)
            # A green interrupt not yet delivered finds running False and does nothing.

    def lost(self, lock: Any) -> None:
        """With policy "raise", interrupt the body if it still runs. The loss itself is
        the lock's one WARNING line (it names the task: the holder record's), so this
        says only what the policy does with it, at DEBUG."""
        log.debug(
            "Task %s: lock %r lost while running; lock_on_lost=%s: %s",
            self.task_name,
            lock.name,
            self.policy.name,
            "the body is interrupted" if self.policy.interrupts else "the body runs on",
        )
        with _guard:
            if not self.policy.interrupts or not self.running or self.sent:
                return
            self.sent = True
            interrupt = _interrupt_for(lock)
            if self.green is not None:
                body, run_callback = self.green
                run_callback(functools.partial(self._throw, body, interrupt))
            elif self.use_signal and _INTERRUPT_SIGNAL is not None:
                _pending_signals[self.thread] = interrupt()
                signal.pthread_kill(self.thread, _INTERRUPT_SIGNAL)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread), ctypes.py_object(interrupt)
                )

    def _throw(self, body: Any, interrupt: type[LockLostInterrupt]) -> None:
        """On the green event loop: raise the interrupt in the body's green thread, where
        it waits (a switch), unless the body has ended meanwhile. No ``_guard`` here: green
        threads switch only where they block, and nothing blocks while holding it, so no
        other green thread is inside it now (and the loop must not block on it)."""
        if self.running and not body.dead:
            body.throw(interrupt())


def watch(lock: Any, task_name: str, policy: LostPolicy) -> Watch:
    """Start watching *lock* for the body about to run in this thread (stop it after)."""
    started = Watch(task_name, policy)
    with _guard:
        _watches[id(lock)] = started
    if lock.lost:  # lost between the acquire and the start of the body
        started.lost(lock)
    return started


def watch_of(lock: Any) -> Watch | None:
    """The watch of the body running under *lock*, if one runs."""
    return _watches.get(id(lock))


def on_lost(lock: Any) -> None:
    """The ``on_lost`` callback of a task's lock (called by the renewal thread)."""
    found = _watches.get(id(lock))
    if found is not None:
        found.lost(lock)
