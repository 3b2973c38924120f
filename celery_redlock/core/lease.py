"""A lease as this process counts it: the arithmetic of its length and validity, and
:class:`Lease`, the local state of one acquisition (token, fence, local deadline,
reentrancy count, lost), which :class:`~celery_redlock.core.lock.Lock` extends with the
calls to its backend.

Why the local deadline is authoritative: validity is ``ttl - elapsed - drift``
(drift = 1% of the TTL + 2 ms) counted with ``time.monotonic()`` from *before*
the first request was sent. Redis may keep the key a little longer, never
shorter, so while ``monotonic() < valid_until`` no one else can hold the lock.
Past it, without a confirmed renewal, the lock counts as lost, whatever the
process still believes.

The renewal thread (:mod:`~celery_redlock.core.renewal`) moves the local deadline on
through :meth:`Lease.renewal` and :meth:`Lease.renewed`, and marks a lease lost once it
is past (:meth:`Lease.expire_if_past`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from . import events, process
from .backend import Backend
from .backend_types import Acquired, Slot, Status
from .errors import ConfigError, StoreUnavailable
from .keys import LockKeys
from .renewal import get_manager

__all__ = [
    "DEFAULT_FENCE_TTL",
    "MAX_TTL_MS",
    "MIN_TTL",
    "Lease",
    "check_timeout",
    "drift",
    "ttl_to_ms",
]

log_renew = logging.getLogger("celery_redlock.renew")

#: How long an unused fence counter lives, in seconds (see docs/redlock.md, "Fences"):
#: long enough to ride out any backward step of the server's clock seen in practice,
#: short enough that a name used once does not cost memory for more than an hour.
DEFAULT_FENCE_TTL: float | None = 3600.0

#: The shortest lease (seconds): one that ends within its drift allowance (1% + 2 ms) plus
#: a round trip could never be confirmed valid: every acquire would answer "too late".
MIN_TTL = 0.01
#: The longest lease in milliseconds (about 142,000 years): the scripts add leases as Lua
#: numbers (doubles, exact to 2**53), and Redis refuses an expiry past 2**63 ms.
MAX_TTL_MS = 2**52


def ttl_to_ms(ttl: float, what: str = "ttl") -> int:
    """Seconds (float) to whole milliseconds, refusing what Redis cannot store."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
        raise ConfigError(f"{what} must be a finite number of seconds, got {ttl!r}")
    if ttl > MAX_TTL_MS / 1000:  # before the product, which a huge float makes infinite
        raise ConfigError(f"{what} must be at most {MAX_TTL_MS // 1000} seconds, got {ttl!r}")
    ms = round(ttl * 1000)
    if not ms >= 1:
        raise ConfigError(f"{what} must be at least 0.001 seconds, got {ttl!r}")
    if ms > MAX_TTL_MS:
        raise ConfigError(f"{what} must be at most {MAX_TTL_MS // 1000} seconds, got {ttl!r}")
    return int(ms)


def check_timeout(timeout: Any, blocking: bool, what: str = "timeout") -> float | None:
    """*timeout* (seconds to wait, or None: no limit) as given, or a ConfigError naming it:
    not a number, negative, NaN, or given together with ``blocking=False`` (as
    ``threading.Lock.acquire`` refuses; ConfigError is a ValueError too)."""
    if timeout is None:
        return None
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)):
        raise ConfigError(f"{what} must be None or a number of seconds, got {timeout!r}")
    if not timeout >= 0:  # negative, or NaN (which compares false with everything)
        raise ConfigError(
            f"{what} must be None (no limit) or >= 0 seconds, got {timeout!r}; "
            "pass blocking=False for a single try"
        )
    if not blocking:
        raise ConfigError(
            f"{what}={timeout!r} with blocking=False: a non-blocking acquire tries once and "
            "never waits; drop the timeout, or pass blocking=True to wait up to it"
        )
    return timeout


def drift(ttl: float) -> float:
    """Clock drift allowance for a lease of *ttl* seconds: 1% + 2 ms."""
    return 0.01 * ttl + 0.002


class Lease:
    """The local state of one acquisition and its validity; what
    :class:`~celery_redlock.core.lock.Lock` adds is the backend's part. Reads and
    changes of the state hold ``_state``; ``_freed`` (on the same lock) is notified when
    the acquisition ends here (released or lost), for a thread that waits for the object.

    The token is the object's, not a thread's: the renewal thread renews it and any
    thread may read it. Only the reentrancy count belongs to a thread (``_owner``, the
    thread that acquired): see :meth:`Lock.acquire <celery_redlock.core.lock.Lock.acquire>`.
    """

    name: str
    keys: LockKeys
    slot: Slot
    backend: Backend
    ttl: float
    ttl_ms: int
    max_hold: float | None
    auto_renew: bool
    owner_info: dict[str, Any]
    on_lost: Callable[[Any], object] | None  # called with the Lock itself

    def __init__(self) -> None:
        self._state = threading.RLock()
        self._freed = threading.Condition(self._state)
        self._token: str | None = None
        self._pid = 0
        #: The thread that took the current acquisition (threading.get_ident()).
        self._owner = 0
        #: A release of the current token is under way: renewal leaves it alone, and a
        #: round that answers meanwhile ("key gone", after our own release) is ignored.
        #: Cleared when the release fails, so that it can be retried.
        self._releasing = False
        #: (thread, why) of a reentrant acquisition that was lost and then replaced by
        #: another thread's: that thread's release() learns the loss (LockLost).
        self._lost_by: tuple[int, str] | None = None
        self._fence: int | None = None
        #: Each rule's fence, in the slot's order (an acquisition with rules).
        self._rule_fences: tuple[int, ...] = ()
        self._valid_until = 0.0
        self._acquired_at = 0.0
        self._count = 0
        self._lost = False
        self._lost_reason = ""
        #: Why the last renewal round did not get through ("" after a confirmed one): the
        #: cause, when the lease then runs out (the store was lost).
        self._renew_error = ""
        self._max_hold_logged = False

    # -- state ------------------------------------------------------------------------
    def _held_here(self) -> bool:
        return self._token is not None and self._pid == process.this.pid

    @property
    def fence(self) -> int | None:
        """The fencing token of the current acquisition (strictly increasing per key)."""
        return self._fence if self._held_here() else None

    @property
    def token(self) -> str | None:
        """The random token of the current acquisition (None when not held here)."""
        return self._token if self._held_here() else None

    @property
    def valid_until(self) -> float:
        """``time.monotonic()`` deadline of the lease (0.0 when not held, or while its
        release is under way)."""
        return self._valid_until if self._held_here() and not self._releasing else 0.0

    @property
    def lost(self) -> bool:
        """True once the current acquisition was lost (expired, taken, or past deadline)."""
        return self._lost

    @property
    def lost_reason(self) -> str:
        """Why the current acquisition was lost ("" while it is not)."""
        return self._lost_reason if self._lost else ""

    @property
    def held_for(self) -> float:
        """Seconds since the current acquisition (0.0 when not held)."""
        return time.monotonic() - self._acquired_at if self._held_here() else 0.0

    def _take(self, token: str, grant: Acquired, started: float, valid_until: float) -> None:
        me = threading.get_ident()
        with self._state:
            if self._lost and self._held_here() and self._owner != me:
                self._lost_by = (self._owner, self._lost_reason)
            self._token = token
            self._pid = process.this.pid
            self._owner = me
            self._releasing = False
            self._fence = grant.fence
            self._rule_fences = grant.fences
            self._valid_until = valid_until
            self._acquired_at = started
            self._count = 1
            self._lost = False
            self._lost_reason = ""
            self._renew_error = ""
            self._max_hold_logged = False
        if self.auto_renew:
            get_manager().register(self)

    # -- renewal (the renewal thread calls these) -----------------------------------------
    def renewal(self) -> tuple[str, int] | None:
        """(token, lease ms) to renew this round, or None to skip (not held, lost, or
        past ``max_hold``)."""
        with self._state:
            if not self._held_here() or self._lost or self._releasing or self._token is None:
                return None
            if self.max_hold is not None and self.held_for >= self.max_hold:
                if not self._max_hold_logged:
                    self._max_hold_logged = True
                    log_renew.warning(
                        "lock %r reached max_hold=%ss: no longer renewed, expires within %ss",
                        self.name,
                        self.max_hold,
                        self.ttl,
                    )
                return None
            return self._token, self.ttl_ms

    def renewed(
        self,
        started: float,
        token: str,
        outcome: Status | StoreUnavailable,
        *,
        logged: bool = False,
    ) -> None:
        """Take the outcome of a renewal round for the acquisition *token*; *logged*: a
        failure the renewal thread has logged already, in one line for the several locks
        it struck (a server that failed the round)."""
        if token != self._token or self._releasing:
            return  # released (or re-acquired) while the round was in flight
        if isinstance(outcome, StoreUnavailable):
            cause = self._renew_error = outcome.cause  # the error may name another lock
            left = self._valid_until - time.monotonic()
            log_renew.log(
                logging.DEBUG if logged else logging.WARNING,
                "renewal of lock %r%s failed (%s); its lease runs out in %.2f s unless a "
                "later round gets through",
                self.name,
                self._whose(),
                cause,
                left,
            )
            self._event("renew_failed", error=cause)
            return
        if outcome is Status.OK:
            with self._state:
                if self._token == token and not self._lost:
                    self._valid_until = max(self._valid_until, started + self.ttl - drift(self.ttl))
                    self._renew_error = ""
            return
        self._mark_lost(outcome.describe())

    def expire_if_past(self, now: float) -> None:
        """Mark the lock lost if *now* is past its local deadline."""
        if self._held_here() and not self._lost and now >= self._valid_until:
            failed = self._renew_error
            why = f" (the last round failed: {failed})" if failed else ""
            self._mark_lost(f"the lease ran out before a confirmed renewal{why}")

    def _whose(self) -> str:
        """`` of task <name>[<id>]`` when the owner record names a task (a Celery run's
        lock), for the lines about this lock; "" otherwise."""
        info = self.owner_info
        task = info.get("task_name")
        if not task:
            return ""
        task_id = info.get("task_id")
        return f" of task {task}[{task_id}]" if task_id else f" of task {task}"

    def _log_loss(
        self, logger: logging.Logger, reason: str, held: float, fence: int | None, tail: str = ""
    ) -> None:
        """The one WARNING line of a loss: the lock, its task (when a run holds it), how
        long it was held, its fence and why."""
        logger.warning(
            "lock %r%s LOST after %.3f s (fence %s): %s%s",
            self.name,
            self._whose(),
            held,
            fence,
            reason,
            tail,
        )

    def _mark_lost(self, reason: str) -> None:
        """Mark the acquisition lost (once): its one line, its ``lost`` event, ``on_lost``."""
        with self._state:
            if not self._held_here() or self._lost or self._releasing:
                return  # a release under way learns the outcome from the backend itself
            self._lost = True
            self._lost_reason = reason
            held = self.held_for
            self._freed.notify_all()
        get_manager().unregister(self)
        self._log_loss(log_renew, reason, held, self._fence)
        self._event("lost", held=held, error=reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                log_renew.exception("on_lost callback for %r failed", self.name)

    def _not_held_reason(self) -> str:
        if self._token is not None and self._pid != process.this.pid:
            return f"acquired in process {self._pid}; a forked child holds none of its locks"
        return "not acquired by this lock object"

    def _rule_holds(self) -> tuple[dict[str, Any], ...]:
        """The ``lock_limits`` holds of the current acquisition, for its ``acquired`` event."""
        holds = []
        for index, rule in enumerate(self.slot.rules):
            fence = self._rule_fences[index] if index < len(self._rule_fences) else None
            holds.append(
                {
                    "name": rule.name,
                    "kind": "rate" if rule.is_rate else "limit",
                    "limit": rule.limit,
                    "fence": None if rule.is_rate else fence,
                }
            )
        return tuple(holds)

    def _event(self, kind: events.EventKind, **fields: Any) -> None:
        if not events.wanted(kind):
            return
        fields.setdefault("fence", self._fence)
        fields.setdefault("holder", self.owner_info)
        fields.setdefault("owner", self.owner_info)
        slot = self.slot
        fields.setdefault("limit", slot.limit)
        if kind == "acquired" and slot.rules:
            fields["rules"] = self._rule_holds()
        events.emit(
            events.LockEvent(kind=kind, name=self.name, key=self.keys.lock, ttl=self.ttl, **fields)
        )
