"""``Lock`` and ``Redlock``: one acquisition at a time, over a backend that does the I/O.

``acquire``, ``release``, ``extend`` and ``owned`` check and change the local
state of an acquisition (token, fence, local deadline, reentrancy count, lost:
:class:`~celery_redlock.core.lease.Lease`); the backend
(:mod:`celery_redlock.core.backend`) keeps the lock. A ``Lock`` on one client uses a
Redis backend; on a list of clients, or as ``Redlock``, a quorum of independent masters;
on ``connect("memory://")``, the in-process memory backend.

How long a lease is valid here, and why the local deadline decides: :mod:`.lease`.

Why ``release()`` asks the backend, not the clock, whether the lock was lost (a
timeline)::

    t=0    A acquires 'report' (token ta), lease 30 s
    t=5    Redis restarts without persistence (or fails over, or an operator runs
           `celery locks release report --force`): the key is gone
    t=6    B acquires 'report' (token tb) and writes
    t=7    A's release finds tb: TAKEN, whatever A's local deadline (still 23 s away)
           says. A learns that its work may have overlapped B's: LockLost.

    A release whose reply is lost is re-sent by the client (redis-py re-sends on a
    broken connection): the first copy released ta and woke B, the second finds tb.
    The backend remembers ta as released for one lease, so the second copy answers
    OK: the holder's own release never reads as a loss.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

from . import process
from .backend import Backend, FlowControl, has, need
from .backend_types import Acquired, Grant, Refused, Rule, Slot, Status, Superseded
from .backends import open_backend
from .errors import ConfigError, LockContended, LockLost, NotOwned, RedlockError, StoreUnavailable
from .keys import LockKeys, lock_keys
from .lease import DEFAULT_FENCE_TTL, MIN_TTL, Lease, check_timeout, drift, ttl_to_ms
from .renewal import get_manager

__all__ = ["Lock", "Redlock"]

log_acquire = logging.getLogger("celery_redlock.acquire")
log_release = logging.getLogger("celery_redlock.release")

TOKEN_BYTES = 20  # 160 random bits per acquisition
#: How long an attempt after a wait may outlast the caller's timeout: the last look,
#: when the wait ended at the timeout (s).
LAST_TRY = 0.005
#: How often a blocking acquire refused by a rule with no known wait tries again (s).
_RULE_POLL = 0.2
_HOSTNAME = socket.gethostname()
#: The fields of a holder record that the lock writes itself (owner_info may override).
_RECORD_OWN = frozenset(("hostname", "pid", "acquired_at"))
#: (pid, the start of a holder record up to the time) of this process.
_head: tuple[int, str] = (0, "")


def _record_head() -> str:
    """``{"hostname":...,"pid":...,"acquired_at":`` for this process (made once per pid)."""
    global _head
    pid = process.this.pid
    if _head[0] != pid:
        host = json.dumps({"hostname": _HOSTNAME, "pid": pid}, separators=(",", ":"))
        _head = (pid, f'{host[:-1]},"acquired_at":')
    return _head[1]


_L = TypeVar("_L", bound="Lock")


class Lock(Lease):
    """A lease on Redis, kept alive by the per-process renewal thread.

    >>> lock = Lock(redis.Redis(), "report:2024-06", ttl=30)
    >>> with lock:                # raises LockContended if someone else holds it
    ...     write(fence=lock.fence)

    *target* is a ``redis.Redis`` (or a Sentinel ``master_for()`` client, or a
    ``RedisCluster``), a list of clients of independent masters (a Redlock
    quorum), a backend from :func:`~celery_redlock.core.connect.connect` (such as
    ``connect("memory://")``), or any :class:`~celery_redlock.core.backend.Backend`.
    Every mutation is one owner-checked step on the backend; a fresh 160-bit token per
    acquisition means nobody releases or extends what they do not own: not another
    thread, not a forked child, not a retried duplicate.
    """

    def __init__(
        self,
        target: Any,
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
        on_lost: Callable[[Lock], object] | None = None,
        fence_ttl: float | None = DEFAULT_FENCE_TTL,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"lock name must be a non-empty string, got {name!r}")
        self.ttl_ms = ttl_to_ms(ttl)
        if self.ttl_ms < MIN_TTL * 1000:
            raise ConfigError(
                f"ttl must be at least {MIN_TTL} seconds (a shorter lease ends within its "
                f"clock-drift allowance, 1% + 2 ms, and a round trip), got {ttl!r}"
            )
        self.ttl = self.ttl_ms / 1000.0
        #: Idle time after which the fence counter may expire (0: never); see acquire.lua.
        self.fence_ttl_ms = 0 if fence_ttl is None else ttl_to_ms(fence_ttl, "fence_ttl")
        if max_hold is not None:
            ttl_to_ms(max_hold, "max_hold")
        check_timeout(timeout, bool(blocking))
        if owner_info is not None and not isinstance(owner_info, Mapping):
            raise ConfigError(f"owner_info must be a mapping, got {type(owner_info).__name__}")
        if owner_info:
            try:  # once here, not on each acquire: values show as their str(), keys cannot
                json.dumps(dict(owner_info), default=str)
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"owner_info must be a dict with str keys that JSON can write: {exc}"
                ) from None
        #: Where the lock lives (see :mod:`celery_redlock.core.backend`).
        self.backend: Backend = open_backend(target)
        self.name = name
        self.keys: LockKeys = lock_keys(name, key_prefix)
        #: What an acquisition holds: the mutex of the name (a Semaphore: a permit).
        self.slot = Slot(self.keys)
        self.key_prefix = key_prefix
        self.auto_renew = bool(auto_renew)
        self.reentrant = bool(reentrant)
        self.max_hold = max_hold
        self.owner_info: dict[str, Any] = dict(owner_info or {})
        self.blocking = blocking
        self.timeout = timeout
        self.on_lost = on_lost
        #: The other owner's record, from the last contended attempt.
        self.holder: dict[str, Any] = {}
        #: The other owner's remaining lease (ms) at the last contended attempt.
        self.holder_ttl_ms: int | None = None
        #: What each master answered in the last attempt (a quorum).
        self.masters: dict[str, str] = {}
        #: The last attempt was refused by an operator control or a rule, not by the
        #: holder of this name: that name ("" otherwise), and why ("paused", "limit",
        #: "rate"); ``holder_ttl_ms`` is then the longest known wait.
        self.refused_by = ""
        self.refusal = ""
        super().__init__()

    def hold_with(self, rules: Sequence[Rule] = (), *, controlled: bool = True) -> None:
        """Take *rules* (a task's ``lock_limits``) with this lock from now on, all or
        nothing, and (*controlled*) obey the operator controls of every name involved
        (``celery locks pause`` / ``set``): see
        :class:`~celery_redlock.core.backend.FlowControl`. A backend without it takes
        no rules (ConfigError) and reads no controls."""
        if rules:
            need(self.backend, FlowControl)
        controlled = controlled and has(self.backend, FlowControl)
        if rules or controlled:
            slot = self.slot
            self.slot = Slot(slot.keys, slot.limit, tuple(rules), controlled)

    @property
    def fences(self) -> dict[str, int]:
        """Name -> fence of every hold of the current acquisition: this lock's name, and
        each Limit rule's (empty when not held here)."""
        fence = self.fence
        if fence is None:
            return {}
        found = {self.name: fence}
        for rule, value in zip(self.slot.rules, self._rule_fences, strict=False):
            if not rule.is_rate:
                found[rule.name] = value
        return found

    def _holder_record(self) -> str:
        """The JSON holder record stored with the lock: host, pid, when, and owner_info.

        Written as ``json.dumps`` of the whole record would write it: the host and pid part
        is made once per process; owner_info is written each time (it may be edited in
        place between acquisitions).
        """
        at = round(time.time(), 3)
        info = self.owner_info
        if not info:
            return f"{_record_head()}{at!r}}}"
        if not _RECORD_OWN.intersection(info):
            tail = json.dumps(info, separators=(",", ":"), default=str)
            return f"{_record_head()}{at!r},{tail[1:]}"
        record: dict[str, Any] = {"hostname": _HOSTNAME, "pid": process.this.pid, "acquired_at": at}
        record.update(info)  # owner_info overrides what the lock writes
        return json.dumps(record, separators=(",", ":"), default=str)

    # -- public API -----------------------------------------------------------------
    def acquire(self, blocking: bool | None = None, timeout: float | None = None) -> bool:
        """Take the lock; ``False`` when another owner holds it (non-blocking, or timed out).

        Blocking waits are woken by the holder's release notice and capped at the
        holder's remaining lease, since expiry sends no notice. Raises
        :class:`StoreUnavailable` promptly when Redis cannot answer, also when
        blocking: waiting is for contention, not for outages. *timeout* is None (no
        limit) or seconds >= 0, and only with blocking: a negative or NaN timeout, or one
        with ``blocking=False``, is a :class:`ConfigError` (a ``ValueError``).

        An acquisition whose lease ran out (past its local deadline, or reported lost)
        is never taken again from this object's memory: it is reported lost (once), and
        the lock is asked for again, as by any other owner. Taking it again while still
        held: ``reentrant=True`` counts the thread that holds it (release as often);
        without it, a :class:`RedlockError`. Another thread on a reentrant object is
        another owner: it waits (within *timeout*) until this object's acquisition ends,
        then asks for the lock, or returns False at once with ``blocking=False``.
        """
        blocking = self.blocking if blocking is None else blocking
        if timeout is None and blocking:
            timeout = self.timeout  # the Lock's own timeout is for blocking calls
        timeout = check_timeout(timeout, bool(blocking))
        begin = time.monotonic()
        deadline = None if timeout is None else begin + timeout
        here = self._wait_for_this_object(bool(blocking), begin, deadline)
        if here != "free":
            return here == "again"
        record = self._holder_record()
        answer_by = None  # the first attempt has its members' whole timeout
        while True:
            token = os.urandom(TOKEN_BYTES).hex()  # 160 fresh CSPRNG bits per attempt
            will_wait = blocking and (deadline is None or time.monotonic() < deadline)
            started = time.monotonic()
            try:
                grant = self._attempt(token, record, will_wait, answer_by)
            except StoreUnavailable as exc:
                self._event("unavailable", waited=time.monotonic() - begin, error=str(exc))
                raise
            self.masters = dict(grant.masters)
            refused = isinstance(grant, Refused)
            self.refused_by, self.refusal = "", ""
            if isinstance(grant, Refused):
                self.refused_by, self.refusal = grant.by, grant.reason
            if isinstance(grant, Acquired):
                valid_until = started + self.ttl - drift(self.ttl)
                if time.monotonic() < valid_until:
                    self._take(token, grant, started, valid_until)
                    waited = time.monotonic() - begin
                    self._event("acquired", waited=waited)
                    log_acquire.debug(
                        "acquired %r fence=%s after %.1f ms", self.name, grant.fence, waited * 1000
                    )
                    return True
                # The answer came back after the lease was already spent (a long
                # pause): it cannot be trusted to exclude anyone. Give it back.
                self._abandon(token)
                log_acquire.warning("acquire of %r answered too late to be valid", self.name)
                wait_ms = None
            else:
                self.holder = dict(grant.holder)
                self.holder_ttl_ms = grant.holder_ttl_ms
                if isinstance(grant, Superseded):  # nothing to wait for: another message
                    self._event("superseded", holder=self.holder, waited=time.monotonic() - begin)
                    return False
                wait_ms = grant.wait_ms
                if grant.holder_ttl_ms == -1:  # our locks always expire: not written by us
                    log_acquire.warning(
                        "lock %r is held with NO expiry (%r has no TTL): it is never freed by "
                        "itself; if its holder is gone, remove it with `celery locks release %s`",
                        self.name,
                        self.keys.lock,
                        self.name,
                    )
            now = time.monotonic()
            left = None if deadline is None else deadline - now
            if not blocking or (left is not None and left <= 0):
                self._event(
                    "contended",
                    holder=self.holder,
                    waited=now - begin,
                    refused_by=self.refused_by,
                    refusal=self.refusal,
                )
                return False
            wait = self.ttl if not wait_ms or wait_ms < 0 else wait_ms / 1000
            if refused and wait_ms is None:
                # A rule's permit frees when its holder ends, with no notice to this name's
                # waiters: look again a few times a second.
                wait = min(wait, _RULE_POLL)
            if left is not None:
                wait = min(wait, left)
            self.backend.wait(self.slot, max(wait, 0.001), grant)
            if deadline is not None:  # a later attempt ends with the caller's timeout
                answer_by = max(deadline, time.monotonic() + LAST_TRY)

    def _wait_for_this_object(
        self, blocking: bool, begin: float, deadline: float | None
    ) -> Literal["free", "again", "refused"]:
        """What this object's own state says before the backend is asked: ``"free"``
        once it holds no acquisition (or a lost one); ``"again"`` when the calling
        thread holds it and took it once more (reentrant: counted); ``"refused"`` when
        another thread holds this reentrant object past *deadline* (at once without
        *blocking*)."""
        me = threading.get_ident()
        while True:
            # A lease past its deadline is lost (reported once; outside _state, since
            # on_lost runs here) and never taken again from memory.
            self.expire_if_past(time.monotonic())
            with self._state:
                if not self._held_here() or self._lost:
                    return "free"
                if not self.reentrant:
                    raise RedlockError(
                        f"lock {self.name!r} is already held by this Lock object; "
                        "pass reentrant=True to take it again"
                    )
                if self._owner == me:
                    self._count += 1
                    return "again"
                # Another thread holds this reentrant object: wait for it to end here.
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if blocking and (left is None or left > 0):
                    wait = max(self._valid_until - now, 0.001)  # it has run out by then
                    self._freed.wait(wait if left is None else min(wait, left))
                    continue
                self.holder = dict(self.owner_info, hostname=_HOSTNAME, pid=process.this.pid)
                self.holder_ttl_ms = max(0, round((self._valid_until - now) * 1000))
            self._event("contended", holder=self.holder, waited=now - begin)
            return "refused"

    def _attempt(self, token: str, record: str, wait: bool, deadline: float | None) -> Grant:
        """One attempt at the backend, its answers awaited until *deadline* at the latest
        (a subclass may take something over with it)."""
        if deadline is None:
            return self.backend.acquire(
                self.slot, token, self.ttl_ms, record, wait=wait, fence_ttl_ms=self.fence_ttl_ms
            )
        return self.backend.acquire(
            self.slot,
            token,
            self.ttl_ms,
            record,
            wait=wait,
            fence_ttl_ms=self.fence_ttl_ms,
            deadline=deadline,
        )

    def _give_back(self, token: str) -> Status:
        """The backend's owner-checked release of *token* (a subclass may record more)."""
        return self.backend.release(self.slot, token, self._notice_ms)

    @property
    def _notice_ms(self) -> int:
        """How long a release's wake-up notice and its released-token record live: one
        lease (a re-sent copy of the release comes within it), but never longer than the
        name's fence counter, so that a name used once costs memory for at most
        ``fence_ttl`` after its release."""
        return min(self.ttl_ms, self.fence_ttl_ms) if self.fence_ttl_ms else self.ttl_ms

    def _abandon(self, token: str) -> None:
        """Best-effort release of an acquisition that cannot be used (it answered too
        late to be valid): where it does not get through, the lease expires by itself."""
        try:
            self.backend.release(self.slot, token, self._notice_ms)
        except StoreUnavailable:
            log_acquire.debug("give-back of a late acquire of %r did not get through", self.name)

    def release(self) -> None:
        """Give the lock back (owner-checked) and wake one waiter.

        Raises :class:`NotOwned` if this object does not hold it, and
        :class:`LockLost` if the backend says the acquisition was no longer there:
        expired, removed (a Redis restart, a failover, ``celery locks release --force``)
        or taken by another owner, whatever the local clock says. A re-sent copy of this
        release (after a lost reply) finds its own token remembered as released and
        counts as released (see the module docstring).

        A release the backend did not answer (:class:`StoreUnavailable`, or any other
        error) leaves the acquisition as it was, no longer renewed: call ``release()``
        again to free the key, or it expires within its TTL. A reentrant object is
        released by the thread that acquired it; any thread may release a plain one.
        """
        me = threading.get_ident()
        with self._state:
            if not self._held_here():
                raise NotOwned(self.name, self._not_held_reason())
            if self.reentrant and self._owner != me:
                lost_by, self._lost_by = self._lost_by, None
                if lost_by is not None and lost_by[0] == me:
                    raise LockLost(self.name, lost_by[1])
                raise NotOwned(
                    self.name,
                    "held by another thread of this reentrant Lock object; it is released "
                    "by the thread that acquired it",
                )
            if self._releasing:
                raise NotOwned(self.name, "another thread is releasing it now")
            if self._count > 1:
                self._count -= 1
                return
            token = self._token
            assert token is not None
            reported = self._lost  # _mark_lost already emitted "lost" for this acquisition
            lost_reason = self._lost_reason if reported else ""
            held = time.monotonic() - self._acquired_at
            fence = self._fence
            # Until the backend answers, the acquisition is being given back: a renewal
            # round already in flight must not answer "key gone" after our own release and
            # mark it lost, nor move the deadline of a lease given back (see renewed()).
            # The token stays until then, so that a release the backend did not answer
            # can be sent again.
            self._releasing = True
        get_manager().unregister(self)
        try:
            status = self._give_back(token)
        except BaseException:
            with self._state:
                if self._token == token:
                    self._releasing = False  # still held as far as we know: retry-able
            raise
        with self._state:
            if self._token == token:  # (another thread of a lost object may have taken it)
                self._token = None
                self._count = 0
                self._valid_until = 0.0
                self._releasing = False
                self._freed.notify_all()
        if status is Status.OK:
            log_release.debug("released %r fence=%s after %.3f s", self.name, fence, held)
            self._event("released", held=held, fence=fence)
            return
        reason = lost_reason or status.describe()
        if reported:  # its one line was written when the loss was found
            log_release.debug("release of %r found it lost, as reported: %s", self.name, reason)
        else:
            self._log_loss(
                log_release,
                reason,
                held,
                fence,
                "; found at its release: the work it guarded may have overlapped with "
                "another holder's",
            )
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
            if self._releasing:
                raise NotOwned(self.name, "it is being released")
            token = self._token
            assert token is not None
        started = time.monotonic()
        self.expire_if_past(started)
        if self._lost:
            raise LockLost(self.name, self._lost_reason)
        outcome = self.backend.extend(self.slot, token, ms, replace=replace)
        if isinstance(outcome, Status):
            self._mark_lost(outcome.describe())
            raise LockLost(self.name, outcome.describe())
        lease = outcome / 1000
        with self._state:
            if self._token == token:
                self._valid_until = started + lease - drift(lease)

    def owned(self) -> bool:
        """True while this owner still holds the lock.

        False at once past the local deadline; otherwise Redis is asked. If Redis
        cannot answer, the local deadline decides (still valid, so still owned).
        """
        with self._state:
            if not self._held_here() or self._lost:
                return False
            token = self._token
        now = time.monotonic()
        if now >= self._valid_until:
            self.expire_if_past(now)
            return False
        try:
            holders = self.backend.holders(self.slot)
        except StoreUnavailable:
            return time.monotonic() < self._valid_until
        except ConfigError:  # the key holds foreign data: this owner's lock is gone
            holders = []
        mine = any(holder.token == token for holder in holders)
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
        for holder in self.backend.holders(self.slot):
            if all(holder.record.get(k) == v for k, v in match.items()):
                return self.backend.release(self.slot, holder.token, self._notice_ms) is Status.OK
        return False

    def read_holder(self) -> dict[str, Any] | None:
        """The current holder's record (``task_name``, ``task_id``, ``hostname``, ``pid``,
        ``acquired_at``), or None when the lock is free (a semaphore: the permit that
        expires first)."""
        holders = self.backend.holders(self.slot)
        return dict(holders[0].record) if holders else None

    def read_holders(self) -> list[dict[str, Any]]:
        """Every current holder's record (a lock has at most one; a semaphore one per
        permit held)."""
        return [dict(holder.record) for holder in self.backend.holders(self.slot)]

    def locked(self) -> bool:
        """True when the lock cannot be taken now (a mutex: anyone holds it; a semaphore:
        every permit is held)."""
        return self.backend.locked(self.slot)

    # -- context manager ----------------------------------------------------------------
    def __enter__(self: _L) -> _L:
        if not self.acquire():
            raise LockContended(self.name, self.holder, self.holder_ttl_ms, masters=self.masters)
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
        # The body raised: its exception propagates, never replaced by the release's (a
        # LockLost, or a release the backend did not answer). That one rides along as a
        # note on the body's exception (Python 3.11+), or as a log line (3.10).
        try:
            self.release()
        except RedlockError as release_error:
            note = (
                f"celery-redlock: releasing lock {self.name!r} after this error raised "
                f"{type(release_error).__name__}: {release_error}"
            )
            add_note = getattr(exc, "add_note", None)
            if add_note is not None:
                add_note(note)
            else:
                log_release.warning("%s", note)

    def __repr__(self) -> str:
        state = "held" if self._held_here() else "free"
        if self._lost:
            state = "lost"
        masters = self.backend.masters
        extra = f" quorum={masters // 2 + 1}/{masters}" if masters > 1 else ""
        return (
            f"<{type(self).__name__} {self.name!r} ttl={self.ttl}s {state} "
            f"fence={self.fence}{extra}>"
        )


class Redlock(Lock):
    """One lock over N independent Redis masters, held by a majority.

    Same interface as :class:`Lock`; see :mod:`celery_redlock.core.backends.quorum`
    for how an attempt goes. ``per_node_timeout`` bounds the wait for each master
    (default: 5% of the TTL, at least 50 ms).
    """

    def __init__(
        self,
        clients: Sequence[Any],
        name: str,
        ttl: float = 30.0,
        *,
        per_node_timeout: float | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(clients, (list, tuple)):
            raise ConfigError(
                f"Redlock takes a list of Redis clients (one per master), got "
                f"{type(clients).__name__}; use Lock for one Redis"
            )
        super().__init__(
            open_backend(clients, per_node_timeout=per_node_timeout), name, ttl, **options
        )
        self._clients = list(clients)
        self._per_node_timeout = per_node_timeout

    @property
    def quorum(self) -> int:
        """How many masters must agree."""
        return self.backend.masters // 2 + 1

    @property
    def clients(self) -> list[Any]:
        """The masters' clients, in the order given."""
        return list(self._clients)

    @property
    def per_node_timeout(self) -> float:
        """How long each master is waited for (seconds)."""
        if self._per_node_timeout is not None:
            return self._per_node_timeout
        return max(0.05, 0.05 * self.ttl)
