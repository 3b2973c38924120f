"""``LockLost`` inside a running task body, when its lock is lost (``lock_on_lost``).

The renewal thread learns of the loss (the key is gone, or the local deadline passed)
and calls the lock's ``on_lost`` callback, :func:`on_lost`. That finds the
:class:`Watch` of the body running under the lock and, with ``lock_on_lost="raise"``,
interrupts that body's thread:

* in the main thread, by a signal (``SIGUSR2``) whose handler raises: it also cuts
  a blocking call short (a long ``time.sleep``, a socket read);
* in any other thread (thread pools, in-process test workers), by an asynchronous
  exception (``PyThreadState_SetAsyncExc``), raised at the body's next bytecode.

Either way the body sees a :class:`LockLostInterrupt` (a :class:`LockLost`) that names
the lock and why it was lost. With
``"warn"`` the loss is only logged (the body can read ``self.lock.lost``). Each value
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
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any

from .core import LockLost
from .policies import LOST

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

    __slots__ = ("policy", "running", "sent", "task_name", "thread", "use_signal")

    def __init__(self, task_name: str, policy: LostPolicy) -> None:
        self.task_name = task_name
        #: ``lock_on_lost``: "raise" interrupts the body, "warn" only logs.
        self.policy = policy
        self.thread = thread = threading.get_ident()
        self.running = True
        #: True: interrupted by a signal (main thread); False: by an asynchronous exception.
        self.use_signal = thread == threading.main_thread().ident and _signal_usable()
        self.sent = False

    def stop(self, lock: Any) -> None:
        """The body has ended: no interrupt reaches its thread after this returns."""
        with _guard:
            self.running = False
            if _watches.get(id(lock)) is self:
                del _watches[id(lock)]
            if self.sent:
                if self.use_signal:
                    _pending_signals.pop(self.thread, None)
                else:
                    # Withdraw an interrupt not yet delivered (NULL clears the pending one).
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread), None)

    def lost(self, lock: Any) -> None:
        """Log the loss of *lock*; with policy "raise", interrupt the body if it still runs."""
        log.warning(
            "Task %s: lock %r lost while running (%s); lock_on_lost=%s",
            self.task_name,
            lock.name,
            lock.lost_reason,
            self.policy.name,
        )
        with _guard:
            if not self.policy.interrupts or not self.running or self.sent:
                return
            self.sent = True
            interrupt = _interrupt_for(lock)
            if self.use_signal and _INTERRUPT_SIGNAL is not None:
                _pending_signals[self.thread] = interrupt()
                signal.pthread_kill(self.thread, _INTERRUPT_SIGNAL)
            else:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self.thread), ctypes.py_object(interrupt)
                )


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
