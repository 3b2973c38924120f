"""The lock state machine shared by :class:`Lock` and :class:`Redlock`.

Public methods (``acquire``, ``release``, ``extend``, ``owned``) check and
change local state; subclasses do the I/O in small ``_do_*`` methods.

Why the local deadline is authoritative: validity is
``ttl - elapsed - drift`` (drift = 1% of the TTL + 2 ms) counted with
``time.monotonic()`` from *before* the first request was sent. Redis may keep
the key a little longer, never shorter, so while ``monotonic() < valid_until``
no one else can hold the lock. Past it, without a confirmed renewal, the lock
counts as lost, whatever the process still believes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str
from types import TracebackType
from typing import Any, TypeVar

from . import _pid, events
from .errors import ConfigError, LockContended, LockLost, NotOwned, RedlockError
from .keys import LockKeys, lock_keys
from .renewal import get_manager
from .scripts import describe_code

__all__ = ["Attempt", "BaseLock", "drift", "ttl_to_ms"]

log_acquire = logging.getLogger("celery_redlock.acquire")
log_release = logging.getLogger("celery_redlock.release")
log_renew = logging.getLogger("celery_redlock.renew")

TOKEN_BYTES = 20  # 160 random bits per acquisition
_HOSTNAME = socket.gethostname()
_RESERVED = frozenset(("hostname", "pid", "acquired_at"))
_head: tuple[int, str] = (0, "")
#: Holder records: compact JSON, anything unusual in owner_info shown as its str().
_RECORD_ENCODER = json.JSONEncoder(default=str, separators=(",", ":"))

_L = TypeVar("_L", bound="BaseLock")


def ttl_to_ms(ttl: float, what: str = "ttl") -> int:
    """Seconds (float) to whole milliseconds, refusing what Redis cannot store."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl):
        raise ConfigError(f"{what} must be a finite number of seconds, got {ttl!r}")
    ms = round(ttl * 1000)
    if not ms >= 1:
        raise ConfigError(f"{what} must be at least 0.001 seconds, got {ttl!r}")
    return int(ms)


def _record_head() -> str:
    """``{"hostname":...,"pid":...,"acquired_at":`` for this process (rebuilt after fork)."""
    global _head
    pid = _pid.current
    if _head[0] != pid:
        _head = (pid, f'{{"hostname":{json.dumps(_HOSTNAME)},"pid":{pid},"acquired_at":')
    return _head[1]


#: The immutable part of _init_state(): what _spawn resets a copied lock to (a test keeps
#: the two the same).
_FRESH_STATE: dict[str, Any] = {
    "holder_ttl_ms": None,
    "_token": None,
    "_pid": 0,
    "_fence": None,
    "_valid_until": 0.0,
    "_acquired_at": 0.0,
    "_count": 0,
    "_lost": False,
    "_lost_reason": "",
    "_max_hold_logged": False,
}


def _owner_json(info: Mapping[str, Any]) -> str:
    """``owner_info`` as the members of a JSON object (no braces), as _RECORD_ENCODER writes
    them. Flat str/int/None values (what the Celery adapter stores) are written here, a few
    C calls per member; anything else goes through the encoder."""
    parts = []
    for key, value in info.items():
        kind = type(value)
        if type(key) is not str:
            break
        if kind is str:
            parts.append(f"{_json_str(key)}:{_json_str(value)}")
        elif kind is int:
            parts.append(f"{_json_str(key)}:{value!r}")
        elif value is None:
            parts.append(f"{_json_str(key)}:null")
        else:
            break
    else:
        return ",".join(parts)
    return _RECORD_ENCODER.encode(info)[1:-1]


def drift(ttl: float) -> float:
    """Clock drift allowance for a lease of *ttl* seconds: 1% + 2 ms."""
    return 0.01 * ttl + 0.002


@dataclass
class Attempt:
    """What one acquire attempt found."""

    acquired: bool
    started: float
    fence: int | None = None
    holder: dict[str, Any] = field(default_factory=dict)
    ttl_ms: int | None = None
    masters: dict[str, str] = field(default_factory=dict)


class BaseLock:
    """Local state, waiting, renewal plumbing, reentrancy, events and ``with``."""

    def __init__(
        self,
        name: str,
        ttl: float = 30.0,
        *,
        key_prefix: str = "redlock:",
        auto_renew: bool = True,
        reentrant: bool = False,
        max_hold: float | None = None,
        owner_info: Mapping[str, Any] | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        on_lost: Callable[[Any], object] | None = None,
        fence_ttl: float | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"lock name must be a non-empty string, got {name!r}")
        self.ttl_ms = ttl_to_ms(ttl)
        self.ttl = self.ttl_ms / 1000.0
        #: Idle time after which the fence counter may expire (0: never); see acquire.lua.
        self.fence_ttl_ms = 0 if fence_ttl is None else ttl_to_ms(fence_ttl, "fence_ttl")
        if max_hold is not None:
            ttl_to_ms(max_hold, "max_hold")
        if timeout is not None and (isinstance(timeout, bool) or not timeout >= 0):
            raise ConfigError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
        if owner_info is not None and not isinstance(owner_info, Mapping):
            raise ConfigError(f"owner_info must be a mapping, got {type(owner_info).__name__}")
        self.name = name
        self.keys: LockKeys = lock_keys(name, key_prefix)
        self.key_prefix = key_prefix
        self.auto_renew = bool(auto_renew)
        self.reentrant = bool(reentrant)
        self.max_hold = max_hold
        self.owner_info: dict[str, Any] = dict(owner_info or {})
        self.blocking = blocking
        self.timeout = timeout
        self.on_lost = on_lost
        self._init_state()

    def _init_state(self) -> None:
        """The state of a lock nobody has taken yet (every field the public methods change)."""
        #: The other owner's record, from the last contended attempt.
        self.holder: dict[str, Any] = {}
        #: The other owner's remaining lease (ms) at the last contended attempt.
        self.holder_ttl_ms: int | None = None
        self._state = threading.RLock()
        self._token: str | None = None
        self._pid = 0
        self._fence: int | None = None
        self._valid_until = 0.0
        self._acquired_at = 0.0
        self._count = 0
        self._lost = False
        self._lost_reason = ""
        self._max_hold_logged = False

    def _spawn(self: _L, name: str, owner_info: dict[str, Any]) -> _L:
        """A new, untaken lock with this one's options under another *name* and *owner_info*.

        For a caller that builds one lock per run with the same options (the Celery
        adapter): the options were checked when this lock was built. Its fields are copied
        as they are and the state is reset, so what this one went through is not carried.
        """
        new = object.__new__(type(self))
        # What __init__ + _init_state() would give, in three C-level steps instead of a
        # dozen attribute stores per run: the options copied, the state reset from
        # _FRESH_STATE (immutable values), and the two mutable state fields made afresh.
        fields = self.__dict__.copy()
        fields.update(_FRESH_STATE)
        fields["name"] = name
        fields["keys"] = lock_keys(name, self.key_prefix)
        fields["owner_info"] = owner_info
        fields["holder"] = {}
        fields["_state"] = threading.RLock()
        new.__dict__ = fields
        return new

    # -- I/O, per subclass ------------------------------------------------------------
    def _do_acquire(self, token: str, info: str, wait: bool) -> Attempt:
        """One attempt; *wait*: on contention the caller will block for a release notice."""
        raise NotImplementedError

    def _do_release(self, token: str) -> int:
        raise NotImplementedError

    def _do_extend(self, token: str, ms: int, replace: bool) -> int:
        raise NotImplementedError

    def _do_owned(self, token: str) -> bool:
        raise NotImplementedError

    def _do_locked(self) -> bool:
        raise NotImplementedError

    def _do_wait(self, seconds: float) -> None:
        raise NotImplementedError

    def _do_abandon(self, token: str) -> None:
        """Best-effort owner-checked delete after a failed or unclear attempt."""
        raise NotImplementedError

    def _do_release_matching(self, match: Mapping[str, Any]) -> bool:
        raise NotImplementedError

    def _do_read_holder(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def _targets(self, token: str) -> Sequence[tuple[Any, str, str, int]]:
        raise NotImplementedError

    def _combine_renewal(self, outcomes: Sequence[int | BaseException]) -> int | BaseException:
        """Reduce per-node renewal outcomes to one (Redlock: a quorum)."""
        raise NotImplementedError

    # -- state ------------------------------------------------------------------------
    def _held_here(self) -> bool:
        return self._token is not None and self._pid == _pid.current

    @property
    def fence(self) -> int | None:
        """The fencing token of the current acquisition (strictly increasing per key)."""
        return self._fence if self._held_here() else None

    @property
    def valid_until(self) -> float:
        """``time.monotonic()`` deadline of the lease (0.0 when not held)."""
        return self._valid_until if self._held_here() else 0.0

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

    def _holder_record(self) -> str:
        """The JSON holder record stored with the lock (host, pid, acquired_at, owner_info).

        This runs on every acquire: the host/pid head is built once per process and
        only ``owner_info`` (usually task name, id and worker) is serialised each
        time, so editing ``owner_info`` in place is always seen.
        """
        head = _record_head()
        at = "%.3f" % time.time()  # noqa: UP031 - the fastest way to a millisecond stamp
        info = self.owner_info
        if not info:
            return f"{head}{at}}}"
        if _RESERVED.isdisjoint(info):
            return f"{head}{at},{_owner_json(info)}}}"
        # owner_info overrides a standard field: keep the dict-update semantics
        record: dict[str, Any] = {
            "hostname": _HOSTNAME,
            "pid": os.getpid(),
            "acquired_at": round(time.time(), 3),
        }
        record.update(info)
        return _RECORD_ENCODER.encode(record)

    # -- public API -----------------------------------------------------------------
    def acquire(self, blocking: bool | None = None, timeout: float | None = None) -> bool:
        """Take the lock; ``False`` when another owner holds it (non-blocking, or timed out).

        Blocking waits are woken by the holder's release notice and capped at the
        holder's remaining lease, since expiry sends no notice. Raises
        :class:`QuorumUnavailable` promptly when Redis cannot answer, also when
        blocking: waiting is for contention, not for outages.
        """
        blocking = self.blocking if blocking is None else blocking
        timeout = self.timeout if timeout is None else timeout
        # A lock not held (every lock the Celery adapter builds) skips the guard: it only
        # makes this check atomic, and an acquire racing in another thread on the same
        # object is decided by Redis either way (one token wins the key).
        if self._token is not None:
            with self._state:
                if self._token is not None and self._pid == _pid.current and not self._lost:
                    if self.reentrant:  # held here (_held_here(), inlined: runs per acquire)
                        self._count += 1
                        return True
                    raise RedlockError(
                        f"lock {self.name!r} is already held by this Lock object; "
                        "pass reentrant=True to take it again"
                    )
        begin = time.monotonic()
        deadline = None if timeout is None else begin + timeout
        info = self._holder_record()
        while True:
            token = os.urandom(TOKEN_BYTES).hex()  # 160 fresh CSPRNG bits per attempt
            will_wait = blocking and (deadline is None or time.monotonic() < deadline)
            attempt = self._do_acquire(token, info, will_wait)  # raises QuorumUnavailable
            if attempt.acquired:
                ttl = self.ttl
                valid_until = attempt.started + ttl - (0.01 * ttl + 0.002)  # drift(), inlined
                if time.monotonic() < valid_until:
                    self._take(token, attempt, valid_until)
                    self._event("acquired", waited=time.monotonic() - begin)
                    if log_acquire.isEnabledFor(logging.DEBUG):
                        log_acquire.debug(
                            "acquired %r fence=%s after %.1f ms",
                            self.name,
                            attempt.fence,
                            (time.monotonic() - begin) * 1000,
                        )
                    return True
                # The answer came back after the lease was already spent (a long
                # pause): it cannot be trusted to exclude anyone. Give it back.
                self._do_abandon(token)
                log_acquire.warning("acquire of %r answered too late to be valid", self.name)
            else:
                self.holder = attempt.holder
                self.holder_ttl_ms = attempt.ttl_ms
            now = time.monotonic()
            left = None if deadline is None else deadline - now
            if not blocking or (left is not None and left <= 0):
                self._event("contended", holder=attempt.holder, waited=now - begin)
                return False
            wait = self.ttl if not attempt.ttl_ms or attempt.ttl_ms < 0 else attempt.ttl_ms / 1000
            if left is not None:
                wait = min(wait, left)
            self._do_wait(max(wait, 0.001))

    def _take(self, token: str, attempt: Attempt, valid_until: float) -> None:
        with self._state:
            self._token = token
            self._pid = _pid.current
            self._fence = attempt.fence
            self._valid_until = valid_until
            self._acquired_at = attempt.started
            self._count = 1
            self._lost = False
            self._lost_reason = ""
            self._max_hold_logged = False
        if self.auto_renew:
            get_manager().register(self)

    def release(self) -> None:
        """Give the lock back (owner-checked) and wake one waiter.

        Raises :class:`NotOwned` if this object does not hold it, and
        :class:`LockLost` if it was held but another owner has it now or its lease
        ran out first. A key that is simply gone while the lease was still valid
        (removed by ``celery locks release --force``, or a re-sent release whose
        first copy already deleted it) counts as released.
        """
        with self._state:
            if self._token is None or self._pid != _pid.current:  # not _held_here(), inlined
                raise NotOwned(self.name, self._not_held_reason())
            if self._count > 1:
                self._count -= 1
                return
            token = self._token
            assert token is not None
            was_valid = not self._lost and time.monotonic() < self._valid_until
            reported = self._lost  # _mark_lost already emitted "lost" for this acquisition
            held = time.monotonic() - self._acquired_at
            fence = self._fence
            # From here on the acquisition is being given back, whatever the script answers:
            # a renewal round already in flight must not answer "key gone" after our own
            # RELEASE and mark it lost, nor move the deadline of a lease given back.
            self._token = None
            self._count = 0
            self._valid_until = 0.0
        get_manager().unregister(self)
        code = self._do_release(token)
        if code == 1 or (code == 0 and was_valid):
            if code == 0:
                log_release.info("lock %r was already gone at release (removed)", self.name)
            elif log_release.isEnabledFor(logging.DEBUG):
                log_release.debug("released %r fence=%s after %.3f s", self.name, fence, held)
            self._event("released", held=held, fence=fence)
            return
        reason = self._lost_reason or _code_reason(code)
        log_release.warning(
            "lock %r was lost before release (%s) after %.3f s: the work it guarded may "
            "have overlapped with another holder",
            self.name,
            reason,
            held,
        )
        if not reported:
            self._event("lost", held=held, fence=fence, error=reason)
        raise LockLost(self.name, reason)

    def extend(self, ttl: float | None = None, *, replace: bool = False) -> None:
        """Add *ttl* seconds (default: the lock's TTL) to the lease, or set it with replace.

        Never recreates a missing key: that means the lock is lost (:class:`LockLost`).
        """
        ms = self.ttl_ms if ttl is None else ttl_to_ms(ttl)
        with self._state:
            if not self._held_here():
                raise NotOwned(self.name, self._not_held_reason())
            token = self._token
            assert token is not None
        started = time.monotonic()
        self._expire_locally(started)
        if self._lost:
            raise LockLost(self.name, self._lost_reason)
        code = self._do_extend(token, ms, replace)
        if code > 0:
            lease = code / 1000
            with self._state:
                if self._token == token:
                    self._valid_until = started + lease - drift(lease)
            return
        self._mark_lost(_code_reason(code))
        raise LockLost(self.name, _code_reason(code))

    def owned(self) -> bool:
        """True while this owner still holds the lock.

        False at once past the local deadline; otherwise Redis is asked. If Redis
        cannot answer, the local deadline decides (still valid, so still owned).
        """
        with self._state:
            if not self._held_here() or self._lost:
                return False
            token = self._token
            assert token is not None
        now = time.monotonic()
        if now >= self._valid_until:
            self._expire_locally(now)
            return False
        try:
            mine = self._do_owned(token)
        except RedlockError:
            return time.monotonic() < self._valid_until
        if not mine:
            self._mark_lost("another owner holds it now, or it is gone")
        return mine

    def release_matching(self, **match: Any) -> bool:
        """Release whatever acquisition of this name has a holder record matching *match*.

        For a process that did not take the lock but knows its holder is gone: the
        worker's main process after a hard time limit or a lost child releases the
        acquisition whose record says ``task_id=<that task>``. The record is read,
        compared, and the acquisition released by its own token (owner-checked), so
        a newer holder is never touched. Returns True if something was released.
        """
        if not match:
            raise ConfigError("release_matching() needs at least one field to match")
        return self._do_release_matching(match)

    def read_holder(self) -> dict[str, Any] | None:
        """The current holder's record (``task_name``, ``task_id``, ``hostname``, ``pid``,
        ``acquired_at``), or None when the lock is free."""
        return self._do_read_holder()

    def locked(self) -> bool:
        """True when anyone holds the lock."""
        return self._do_locked()

    # -- renewal (called from the renewal thread) ---------------------------------------
    def _renewal_targets(self) -> Sequence[tuple[Any, str, str, int]]:
        with self._state:
            if not self._held_here() or self._lost:
                return ()
            if self.max_hold is not None and self.held_for >= self.max_hold:
                if not self._max_hold_logged:
                    self._max_hold_logged = True
                    log_renew.warning(
                        "lock %r reached max_hold=%ss: no longer renewed, expires within %ss",
                        self.name,
                        self.max_hold,
                        self.ttl,
                    )
                return ()
            return self._targets(self._token or "")

    def _renewal_result(
        self,
        started: float,
        targets: Sequence[tuple[Any, str, str, int]],
        outcomes: Sequence[int | BaseException],
    ) -> None:
        if not targets or targets[0][2] != self._token:
            return  # released (or re-acquired) while the round was in flight
        outcome = self._combine_renewal(outcomes)
        if isinstance(outcome, BaseException):
            left = self._valid_until - time.monotonic()
            log_renew.warning(
                "renewal of %r failed (%s); the lease runs out in %.2f s unless a "
                "later round gets through",
                self.name,
                outcome,
                left,
            )
            self._event("renew_failed", error=str(outcome))
            return
        if outcome == 1:
            with self._state:
                if self._token == targets[0][2] and not self._lost:
                    self._valid_until = max(self._valid_until, started + self.ttl - drift(self.ttl))
            return
        self._mark_lost(_code_reason(outcome))

    def _expire_locally(self, now: float) -> None:
        if self._held_here() and not self._lost and now >= self._valid_until:
            self._mark_lost("the lease ran out before a confirmed renewal")

    def _mark_lost(self, reason: str) -> None:
        with self._state:
            if not self._held_here() or self._lost:
                return
            self._lost = True
            self._lost_reason = reason
            held = self.held_for
        get_manager().unregister(self)
        log_renew.warning(
            "lock %r LOST after %.3f s (fence %s): %s", self.name, held, self._fence, reason
        )
        self._event("lost", held=held, error=reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                log_renew.exception("on_lost callback for %r failed", self.name)

    def _not_held_reason(self) -> str:
        if self._token is not None and self._pid != _pid.current:
            return f"acquired in process {self._pid}; a forked child holds none of its locks"
        return "not acquired by this lock object"

    def _event(self, kind: events.EventKind, **fields: Any) -> None:
        if events._filters is None:  # no filters: any hook takes every event
            if not events._hooks:
                return
        elif not events.wanted(kind):  # every hook filters, and none takes this kind
            return
        fields.setdefault("fence", self._fence)
        fields.setdefault("holder", self.owner_info)
        events.emit(
            events.LockEvent(kind=kind, name=self.name, key=self.keys.lock, ttl=self.ttl, **fields)
        )

    # -- context manager ----------------------------------------------------------------
    def __enter__(self: _L) -> _L:
        if not self.acquire():
            raise LockContended(self.name, self.holder, self.holder_ttl_ms)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.release()
            return
        try:
            self.release()
        except RedlockError as release_error:  # never mask the body's own exception
            log_release.warning("release of %r after an error failed: %s", self.name, release_error)

    def __repr__(self) -> str:
        state = "held" if self._held_here() else "free"
        if self._lost:
            state = "lost"
        return f"<{type(self).__name__} {self.name!r} ttl={self.ttl}s {state} fence={self.fence}>"


def _code_reason(code: int) -> str:
    return describe_code(code)
