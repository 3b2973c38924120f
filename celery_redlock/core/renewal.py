"""The per-process renewal thread: one thread keeps every held lock alive.

Every round renews all the locks this process holds with one ``renew`` call per
backend (:meth:`~celery_redlock.core.backend.Backend.renew`: one batched script per
Redis node), the backends called in parallel on the process's thread pool. Rounds
come every ``min(ttl)/3``; each backend gets ``interval/2`` to answer before the
round moves on without it.

Why the local deadline rules (a timeline)::

    t=0    A acquires, ttl=1s; its deadline is 0 + 1 - drift = 0.988
    t=0.3  A's process is SIGSTOPped (or a GC pause) before the renewal round
    t=1.0  the key expires in Redis; B acquires and writes with fence 8
    t=5    A resumes. Its lock still says "held" in memory, but the deadline
           0.988 has passed: owned() is False, and the renewal thread marks it
           lost on its first wake-up, before any confirmed renewal could revive
           it. A's fence (7) is lower than B's (8) for storage that checks.

The manager holds the locks weakly: a ``Lock`` that nobody references any more (dropped
by a function that returned without releasing it) is no longer renewed, and its key
expires within its TTL, as python-redis-lock's renewal stops for a collected lock. A
lock in a ``with`` block, in a variable, or held by a running task is referenced, so
renewed.

The thread never dies on an error: each round catches, logs and goes on. After
``fork`` the child holds none of its parent's locks and starts its own thread
when it first registers one.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

from . import process, threads
from .backend import Backend
from .backend_types import Renewal, Slot, Status
from .errors import StoreUnavailable

__all__ = ["Renewable", "RenewalManager", "get_manager", "shutdown"]

log = logging.getLogger("celery_redlock.renew")

#: The shortest pause between rounds, so a tiny TTL cannot spin the thread.
MIN_INTERVAL = 0.02
#: How long an idle thread sleeps before looking again (it is also woken on register).
IDLE_WAIT = 5.0
_NEVER = float("inf")


class Renewable(Protocol):
    """What the manager needs from a held lock (a :class:`~celery_redlock.core.lock.Lock`)."""

    ttl: float
    name: str
    slot: Slot
    backend: Backend

    @property
    def valid_until(self) -> float: ...

    @property
    def token(self) -> str | None:
        """The token of the current acquisition (None once released or lost here)."""
        ...

    def renewal(self) -> tuple[str, int] | None:
        """(token, lease ms) to renew this round; None to skip it."""
        ...

    def renewed(
        self,
        started: float,
        token: str,
        outcome: Status | StoreUnavailable,
        *,
        logged: bool = False,
    ) -> None:
        """Take the outcome of the round for the acquisition *token* (*logged*: a failure
        already logged by the round, in one line for every lock it struck)."""
        ...

    def expire_if_past(self, now: float) -> None:
        """Mark the lock lost if *now* is past its local deadline."""
        ...


class RenewalManager:
    """Keeps registered locks alive from one daemon thread."""

    def __init__(self) -> None:
        # register/unregister (twice per locked task) take the plain lock under the
        # condition: the same mutual exclusion without Condition's Python-level enter/exit.
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        # Held weakly: a lock nobody references is not renewed, and its key expires within
        # its TTL (a lock in a ``with`` block or a running task is referenced there).
        self._locks: weakref.WeakValueDictionary[int, Renewable] = weakref.WeakValueDictionary()
        self._inflight: dict[Backend, cf.Future[list[Status | StoreUnavailable]]] = {}
        self._next_round = _NEVER
        self._wake_at = 0.0  # when the waiting thread wakes by itself; 0.0 while it runs
        self._stop = False
        self._thread: threading.Thread | None = None
        self.rounds = 0

    # -- registration -------------------------------------------------------------
    def register(self, lock: Renewable) -> None:
        """Start keeping *lock* alive while something else references it; its first
        renewal comes within ttl/3."""
        with self._mutex:
            self._locks[id(lock)] = lock
            interval = lock.ttl / 3  # _interval(), inlined
            first = time.monotonic() + (interval if interval > MIN_INTERVAL else MIN_INTERVAL)
            self._next_round = min(self._next_round, first)
            self._stop = False
            if self._thread is None:
                # The thread clears this slot itself, under the mutex, when it decides to
                # exit (see _loop; _run's finally covers an unexpected error): a stopping
                # thread that is still alive never takes a new lock in.
                self._thread = threading.Thread(
                    target=self._run, name="celery-redlock-renewal", daemon=True
                )
                self._thread.start()
            elif min(self._next_round, lock.valid_until) < self._wake_at:
                # Wake the thread only if it would sleep past this lock's first round: a
                # wake-up per acquire costs a thread switch on the acquire path. A thread
                # that is not waiting reads the new lock before it next waits.
                self._cond.notify()

    def unregister(self, lock: Renewable) -> None:
        """Stop keeping *lock* alive (released or lost); unknown locks are ignored."""
        with self._mutex:
            self._locks.pop(id(lock), None)
            if not self._locks:
                self._next_round = _NEVER

    def renew_soon(self) -> None:
        """Renew every held lock in a round that starts now, not at the next interval (the
        master of some of them moved: a lock missing there is reported lost at once)."""
        with self._cond:
            if self._locks:
                self._next_round = time.monotonic()
                self._cond.notify()

    def held(self) -> list[Renewable]:
        """The locks this process currently keeps alive."""
        with self._cond:
            return list(self._locks.values())

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (it restarts on the next register)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def thread(self) -> threading.Thread | None:
        """The renewal thread, when one was started in this process."""
        return self._thread

    # -- the loop -----------------------------------------------------------------
    def _run(self) -> None:
        log.debug("renewal thread started in pid %d", process.this.pid)
        try:
            self._loop()
        finally:
            with self._mutex:
                if self._thread is threading.current_thread():
                    self._thread = None  # a register() from now on starts a new thread
        log.debug("renewal thread stopped in pid %d", process.this.pid)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    # Decided under the mutex register() takes: a register() that got in
                    # first reset _stop (this thread goes on); one that comes after finds
                    # no thread and starts a new one, even while this one is still exiting.
                    self._thread = None
                    break
                wake = min(self._next_round, _soonest(self._locks.values()))
                delay = wake - time.monotonic()
                if delay > 0:
                    timeout = min(delay, IDLE_WAIT)
                    self._wake_at = time.monotonic() + timeout
                    self._cond.wait(timeout)
                    self._wake_at = 0.0
                    if self._stop:
                        self._thread = None
                        break
                locks = list(self._locks.values())
                if not locks:  # the last one may have been collected, not unregistered
                    self._next_round = _NEVER
                now = time.monotonic()
                interval = 0.0
                if locks and now >= self._next_round:
                    interval = max(MIN_INTERVAL, min(_interval(lk.ttl) for lk in locks))
                    self._next_round = now + interval
            # Callbacks (on_lost, hooks) run outside the condition: they may call back in.
            try:
                if interval:
                    self._round(locks, interval)
                    self.rounds += 1
                else:
                    _expire_past(locks, now)
            except Exception:  # the thread must outlive any error
                log.exception("renewal round failed; the next round will try again")
            # No lock is referenced while the thread waits: a released lock (and the
            # client it holds) goes when its owner drops it, not up to IDLE_WAIT later.
            locks = []

    def _finished(self, backend: Backend, _future: cf.Future[Any]) -> None:
        self._inflight.pop(backend, None)

    def _round(self, locks: list[Renewable], interval: float) -> None:
        started = time.monotonic()
        for lock in locks:  # a lease already past its deadline is not renewed, ever
            _safely(lock.expire_if_past, started)
        # One renew call per backend (equal backends share one) for every lock held there.
        batches: dict[Backend, list[tuple[Renewable, Renewal]]] = defaultdict(list)
        for lock in locks:
            renewal = _safely(lock.renewal)
            if renewal is not None:
                token, ms = renewal
                batches[lock.backend].append((lock, Renewal(lock.slot, token, ms)))
        futures: dict[cf.Future[list[Status | StoreUnavailable]], Backend] = {}
        for backend, batch in batches.items():
            if backend in self._inflight:  # the previous round's call has not returned
                log.warning("renewal: %s still busy with the previous round", backend.describe())
                continue
            future = threads.submit(backend.renew, [item for _, item in batch])
            self._inflight[backend] = future
            future.add_done_callback(partial(self._finished, backend))
            futures[future] = backend
        done, _ = cf.wait(futures, timeout=max(interval / 2, 0.01))
        for future in done:
            backend = futures[future]
            batch = batches[backend]
            try:
                outcomes: Sequence[Status | StoreUnavailable] = future.result()
            except StoreUnavailable as exc:
                outcomes = [exc] * len(batch)
            except Exception:  # a bug or a client-side error: said as it is, never "down"
                if any(lock.token == item.token for lock, item in batch):
                    log.exception("renewal: %s failed", backend.describe())
                else:  # all given back meanwhile (and the client perhaps closed after)
                    log.debug("renewal of locks released meanwhile failed", exc_info=True)
                continue
            told = _log_shared_failures(backend, batch, outcomes)
            for (lock, item), outcome in zip(batch, outcomes, strict=True):
                logged = id(outcome) in told
                _safely(partial(lock.renewed, logged=logged), started, item.token, outcome)


#: How many lock names a line about a failed round lists before "and N more".
_NAMES_SHOWN = 5


def _log_shared_failures(
    backend: Backend,
    batch: Sequence[tuple[Renewable, Renewal]],
    outcomes: Sequence[Status | StoreUnavailable],
) -> set[int]:
    """One line for each failure that struck several locks of the round (the same error
    for all: the server, or the cluster node, did not answer), naming the backend and
    the locks; the ids of those errors (each lock then logs its own at DEBUG only). A
    failure of one lock alone is that lock's own line."""
    struck: dict[int, list[str]] = defaultdict(list)
    errors: dict[int, StoreUnavailable] = {}
    for (lock, item), outcome in zip(batch, outcomes, strict=True):
        if isinstance(outcome, StoreUnavailable) and lock.token == item.token:
            struck[id(outcome)].append(lock.name)
            errors[id(outcome)] = outcome
    told = set()
    for key, names in struck.items():
        if len(names) < 2:
            continue
        told.add(key)
        shown = ", ".join(repr(n) for n in names[:_NAMES_SHOWN])
        more = len(names) - _NAMES_SHOWN
        log.warning(
            "renewal round on %s failed (%s): %d locks not renewed (%s%s); each lease runs "
            "out at its deadline unless a later round gets through",
            backend.describe(),
            errors[key].cause,
            len(names),
            shown,
            f" and {more} more" if more > 0 else "",
        )
    return told


def _soonest(locks: Any) -> float:
    """The earliest local deadline of *locks* (infinity for none)."""
    return min((lock.valid_until for lock in locks), default=_NEVER)


def _expire_past(locks: list[Renewable], now: float) -> None:
    for lock in locks:
        if lock.valid_until <= now:
            _safely(lock.expire_if_past, now)


def _interval(ttl: float) -> float:
    return max(MIN_INTERVAL, ttl / 3.0)


def _safely(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        log.exception("renewal: %r failed", fn)
        return None


_manager: RenewalManager | None = None
_manager_lock = threading.Lock()


def get_manager() -> RenewalManager:
    """The renewal manager of this process (a new one after fork)."""
    global _manager
    if _manager is None:
        with _manager_lock:
            if _manager is None:
                _manager = RenewalManager()
    return _manager


def shutdown(timeout: float = 5.0) -> None:
    """Stop this process's renewal thread, if one runs."""
    if _manager is not None:
        _manager.stop(timeout)


def _after_fork() -> None:
    global _manager, _manager_lock
    _manager = None  # the child holds none of the parent's locks, and has no thread
    _manager_lock = threading.Lock()


process.on_fork(_after_fork)
