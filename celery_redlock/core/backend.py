"""The seam between the lock primitives and where locks live: verbs and typed results.

A :class:`Backend` speaks lock semantics, not storage commands. The primitives
(:class:`~celery_redlock.core.lock.Lock`, ``Semaphore``, ``RateLimiter``, ``QueuedHold``,
``LockRecords``), the renewal thread and the operator reads call only the verbs below
and read only the results below. Three backends implement them, one module each:

- :mod:`~celery_redlock.core.backends.redis_backend`: one Redis (a plain server, a
  Sentinel master, or a Cluster); every mutation is one owner-checked Lua script;
- :mod:`~celery_redlock.core.backends.quorum`: a majority of independent backends
  (Redlock over Redis backends; over memory backends in tests);
- :mod:`~celery_redlock.core.backends.memory`: the same semantics in this process, for
  tests and single-process tools (``connect("memory://")``).

What every verb promises (the behaviour suite in ``tests/backends`` checks each backend):

- *Errors.* A verb raises :class:`~.errors.QuorumUnavailable` when the backend cannot
  decide (a server down, not answering in time, loading, out of memory, read-only, or
  too few masters of a quorum), and :class:`~.errors.ConfigError` when the data at a
  lock's keys is not ours or the backend cannot do what was asked (a queued hold on a
  quorum). Anything else (a client whose pool is exhausted, a wrong argument type, a
  bug) is raised as it is, with its traceback: it is never reported as unavailable.
- *Owner checks.* Every mutation of an acquisition names its token and changes nothing
  when another token holds it. A verb sent twice (a client re-sending after a lost
  reply) has the effect of sending it once: a re-sent acquire finds its own token and
  reports success with the same fence; a re-sent release finds the token it released
  (the backend remembers it for ``notice_ms``) and reports :attr:`Status.OK`.
- *Time.* Leases are whole milliseconds and expire on the backend's clock.
- *Nothing held.* A verb takes what it needs (a connection from the client's pool) and
  gives it back before it returns, on every path.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal, Protocol, runtime_checkable

from .errors import QuorumUnavailable
from .keys import LockKeys

__all__ = [
    "MAX_RECORD",
    "Backend",
    "Claim",
    "ForceRelease",
    "Grant",
    "Handover",
    "Holder",
    "LockInfo",
    "Queued",
    "RateGrant",
    "RateInfo",
    "Renewal",
    "Slot",
    "Status",
    "newest_records",
    "parse_holder",
    "record_version",
    "text",
]


class Status(IntEnum):
    """What a release, extend, dequeue or renewal found for one acquisition."""

    OK = 1
    #: No such acquisition: it expired or was removed (and this token did not release it).
    GONE = 0
    #: Another acquisition holds the key now.
    TAKEN = -1
    #: The key holds something that is not a lock (foreign data under our prefix).
    FOREIGN = -2

    @classmethod
    def of(cls, code: Any) -> Status:
        """The status a backend returned; a code no backend returns is an error, not a
        guess."""
        value = int(code)
        if value > 0:
            return cls.OK  # an extend returns the new lease in ms
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unexpected status code {code!r} from a celery-redlock backend"
            ) from None

    def describe(self) -> str:
        """The status in words, for log lines and errors."""
        return _WORDS[self]


_WORDS = {
    Status.OK: "ok",
    Status.GONE: "the key is gone (expired or removed)",
    Status.TAKEN: "another owner holds it now",
    Status.FOREIGN: (
        "the key now holds data that is not a celery-redlock lock: something else "
        "writes under the lock key prefix"
    ),
}


@dataclass(frozen=True, slots=True)
class Slot:
    """What an acquisition holds: the mutex of a name (``limit == 1``, ``keys`` from
    :func:`~.keys.lock_keys`) or one of ``limit`` permits of it (``limit > 1``, ``keys``
    from :func:`~.keys.permit_keys`). A ``Semaphore(limit=1)`` is the mutex."""

    keys: LockKeys
    limit: int = 1

    @property
    def name(self) -> str:
        """The lock name as stored (normalised)."""
        return self.keys.name

    @property
    def permits(self) -> bool:
        """True for one of several permits, False for the mutex."""
        return self.limit > 1


@dataclass(frozen=True, slots=True)
class Handover:
    """What an acquire takes over in the same step: the enqueue-time hold of task *owner*
    (see :meth:`Backend.enqueue`)."""

    #: The task id whose queued hold becomes this lock.
    owner: str
    #: Refuse (``Grant.superseded``) when the queued hold belongs to another task id.
    strict: bool = True


@dataclass(frozen=True, slots=True)
class Grant:
    """What one acquire attempt found."""

    acquired: bool
    #: The fence of this acquisition (acquired).
    fence: int | None = None
    #: The other owner's record (not acquired).
    holder: Mapping[str, Any] = field(default_factory=dict)
    #: The other owner's lease left, in ms (not acquired; None when unknown, -1 when the
    #: key has no expiry: not written by celery-redlock).
    holder_ttl_ms: int | None = None
    #: How long a blocking caller may wait for a release notice before trying again (ms).
    wait_ms: int | None = None
    #: Which member to wait on for that notice (a quorum: one the holder has).
    wait_on: int = 0
    #: What each master answered, by address (a quorum; shown in errors).
    masters: Mapping[str, str] = field(default_factory=dict)
    #: A hand-over refused because the enqueue-time hold belongs to another task id
    #: (``queued_owner``); ``holder`` and ``holder_ttl_ms`` are then that hold's.
    superseded: bool = False
    #: A hand-over's view of the enqueue-time hold: its owner's task id ("" when there is
    #: none; None when the attempt was no hand-over, or it was acquired).
    queued_owner: str | None = None


@dataclass(frozen=True, slots=True)
class Holder:
    """One current acquisition of a slot: its token, holder record, fence and lease left."""

    token: str
    record: Mapping[str, Any]
    fence: int | None = None
    #: Lease left in ms when it was read (None when not read).
    ttl_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Renewal:
    """One acquisition to renew: set its lease to ``ms`` if ``token`` still holds it."""

    slot: Slot
    token: str
    ms: int


@dataclass(frozen=True, slots=True)
class Queued:
    """What an attempt to take the enqueue-time hold found."""

    #: ``"queued"``: held for the caller now (new, or its own hold renewed);
    #: ``"replaced"``: held for the caller, in place of ``owner``'s hold;
    #: ``"duplicate"``: ``owner``'s message is queued, or its run holds the lock (``state``).
    outcome: Literal["queued", "replaced", "duplicate"]
    #: The other task id: the one replaced, or the one this call duplicates.
    owner: str = ""
    #: That task's holder record.
    holder: Mapping[str, Any] = field(default_factory=dict)
    #: Its hold's lease left in ms (duplicate; None when unknown).
    ttl_ms: int | None = None
    #: ``"queued"`` or ``"running"`` (duplicate).
    state: str = ""


@dataclass(frozen=True, slots=True)
class RateGrant:
    """What a rate limiter answered: granted or not, and when the next grant can be.

    True in a boolean context when granted (``if limiter.acquire(): ...``).
    """

    granted: bool
    #: Seconds until a grant is possible: refused, until the next free slot (for a caller
    #: that joined the line, until its own slot); granted, until the next one after this.
    retry_after: float
    #: Grants still possible right now (0 when refused).
    remaining: int = 0

    def __bool__(self) -> bool:
        return self.granted


@dataclass(frozen=True)
class Claim:
    """What a claim of a record beside a lock found (:meth:`Backend.claim`)."""

    #: ``"claimed"``: written (on a majority of a quorum).
    #: ``"lost"``: the lock is gone or held by another acquisition (on too many masters),
    #: or the lease ran out first: stop acting as the holder.
    #: ``"stale"``: a newer record of this acquisition is stored (see ``record``).
    #: ``"unavailable"``: too few masters answered; nothing is known to be written.
    outcome: Literal["claimed", "lost", "stale", "unavailable"]
    #: The record written (claimed), or the newest stored one (stale), as JSON text.
    record: str = ""
    #: Why, for a log line (lost, unavailable): per master when there are several.
    detail: str = ""


@dataclass(frozen=True)
class LockInfo:
    """One held lock, permit or queued hold as one backend stores it (operator reads)."""

    #: The rendered lock name (``sync:42``), not the key.
    name: str
    #: The key of the lock (``redlock:{sync:42}``), of the permits (``...:permits``) or of
    #: the queued hold (``...:queued``).
    key: str
    #: The fencing token of the acquisition (None if unreadable, or a queued hold).
    fence: int | None
    #: Lease left in milliseconds (-1 no expiry, -2 gone since it was found).
    ttl_ms: int
    #: The holder's record: ``hostname``, ``pid``, ``acquired_at`` (``queued_at`` for a
    #: queued hold) and its ``owner_info`` (``task_name``, ``task_id``, ``role``, ...).
    record: dict[str, Any] = field(default_factory=dict)
    #: ``"lock"``, or ``"permit"``: one permit of a semaphore.
    kind: str = "lock"
    #: ``"running"`` (a task's run holds it), ``"held"`` (another holder: a ``Lock`` of
    #: user code, beat's leader), or ``"queued"`` (the enqueue-time hold of a message not
    #: started yet).
    state: Literal["running", "held", "queued"] = "held"

    @property
    def acquired_at(self) -> float | None:
        """Wall-clock time of the acquisition, as the holder recorded it."""
        value = self.record.get("acquired_at")
        return float(value) if isinstance(value, (int, float)) else None


@dataclass(frozen=True)
class RateInfo:
    """A rate limiter's state as one backend stores it (operator reads)."""

    name: str
    key: str
    #: Microseconds between grants at the steady rate, and the burst (as last used).
    interval_us: int
    burst: int
    #: Grants possible right now.
    free: int
    #: Milliseconds until the next grant is possible (0 when one is possible now).
    next_ms: int
    #: Runs promised a slot that is still due (re-queued, coming back).
    queued: int
    #: Lifetime left of the state: when the limiter is idle again.
    ttl_ms: int

    @property
    def rate(self) -> str:
        """The steady rate in words, per second or per minute, hour or day."""
        if self.interval_us <= 0:
            return "-"
        for suffix, seconds in (("s", 1), ("m", 60), ("h", 3600), ("d", 86400)):
            grants = seconds * 1e6 / self.interval_us
            if grants >= 1 or suffix == "d":
                return f"{grants:.4g}/{suffix}"
        return "-"  # pragma: no cover - the loop returns at "d"


@dataclass(frozen=True)
class ForceRelease:
    """What a forced release (an operator's) did."""

    #: ``"released"``: removed; ``"gone"``: nobody held it; ``"refused"``: another
    #: acquisition than the confirmed fence (or task id) holds it, left alone.
    outcome: Literal["released", "gone", "refused"]
    #: The record of the acquisition removed (released) or left alone (refused).
    record: dict[str, Any] = field(default_factory=dict)
    #: Its fence (None when gone, or a queued hold).
    fence: int | None = None


@runtime_checkable
class Backend(Protocol):
    """Where locks live. See the module docstring for what every verb promises.

    Equal backends share one renewal batch: a Redis backend is equal to another of the
    same client object, a quorum to another of equal members.
    """

    #: How many independent masters decide (1 for one Redis or one memory store).
    masters: int

    def describe(self) -> str:
        """The password-free address(es), for log lines and errors."""
        ...

    def identity(self) -> Hashable:
        """What makes two backends the same server (a quorum refuses a master listed
        twice): finer than :meth:`describe`."""
        ...

    # -- an acquisition's life --------------------------------------------------------
    def acquire(
        self,
        slot: Slot,
        token: str,
        ttl_ms: int,
        record: str,
        *,
        wait: bool,
        fence_ttl_ms: int,
        handover: Handover | None = None,
    ) -> Grant:
        """One attempt to take *slot* for *token* for *ttl_ms*, storing *record* (JSON)
        as the holder record. Acquired: the fence, strictly greater than every earlier
        fence of the name (its counter lives *fence_ttl_ms* after its last use, 0:
        forever; a counter that is gone restarts above any value it could have
        reached). Refused: the holder's record and lease left. *wait*: the caller will
        block for a release notice (:meth:`wait`), so a release must send one.
        *handover*: take over that task id's enqueue-time hold in the same step."""
        ...

    def release(
        self, slot: Slot, token: str, notice_ms: int, done: tuple[str, int] | None = None
    ) -> Status:
        """Give back *token*'s acquisition and wake one waiter; remember *token* as
        released for *notice_ms*. OK: released now, or already released by this token
        (a re-sent copy); GONE: expired or removed by someone else; TAKEN: another token
        holds it; FOREIGN: not a lock. With *done* (mark, ms): add that mark to the
        name's done marks in the same step (see :meth:`was_done`)."""
        ...

    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        """Lengthen *token*'s lease by *ms* (set it to *ms* with *replace*): the new lease
        in ms, or why not (GONE, TAKEN, FOREIGN). Never recreates a missing key."""
        ...

    def renew(self, items: Sequence[Renewal]) -> list[Status | QuorumUnavailable]:
        """Set each item's lease to its ``ms`` if its token still holds it: one outcome
        per item, in order, in one round trip per node (a script for every item held
        there). An item a quorum could not decide for is a ``QuorumUnavailable`` in the
        list; when the backend cannot decide for any item (its one server is down), the
        verb raises :class:`~.errors.QuorumUnavailable` instead."""
        ...

    def wait(self, slot: Slot, seconds: float, refused: Grant | None = None) -> None:
        """Block up to *seconds* for a release notice of *slot* (*refused*: the attempt
        that found it held). Returns early when a release (or a forced release) sends
        one; a notice sent while nobody waited is kept for the next waiter. O(1)
        commands per call, never a poll loop."""
        ...

    def raise_fence(self, slot: Slot, fence: int, fence_ttl_ms: int) -> int:
        """Lift the name's fence counter to at least *fence*; returns the counter after
        the call (a quorum writes its chosen fence back to a majority with this)."""
        ...

    # -- reads ------------------------------------------------------------------------
    def holders(self, slot: Slot) -> list[Holder]:
        """Every current acquisition of *slot* (a mutex: at most one; a quorum: the one
        a majority holds), first to expire first."""
        ...

    def locked(self, slot: Slot) -> bool:
        """True when *slot* cannot be taken now (a mutex: anyone holds it, on a quorum a
        majority; permits: every one is held)."""
        ...

    def was_done(self, slot: Slot, mark: str) -> bool:
        """True when a release added *mark* to the name's done marks (the 16 most recent
        are kept, for the *done* ms of the last one)."""
        ...

    # -- enqueue-time holds -------------------------------------------------------------
    def enqueue(
        self,
        slot: Slot,
        owner: str,
        ttl_ms: int,
        record: str,
        *,
        replace: bool,
        running_blocks: bool,
    ) -> Queued:
        """Take the enqueue-time hold of *slot* for task *owner* for *ttl_ms*, or say
        whose it is. *replace*: another id's hold is taken over. *running_blocks*: while
        the lock is held by another task id's run, this is a duplicate of that run."""
        ...

    def dequeue(self, slot: Slot, owner: str) -> Status:
        """Give up task *owner*'s enqueue-time hold: OK removed, GONE none, TAKEN another
        id's, FOREIGN not a hold."""
        ...

    # -- rate grants --------------------------------------------------------------------
    def rate(
        self, name: str, key: str, interval_us: int, burst: int, *, mode: str, most_us: int = 0
    ) -> RateGrant:
        """One GCRA decision of rate limiter *name* stored at *key* (see
        :mod:`~celery_redlock.core.ratelimit`). *mode*: ``"take"`` grants if possible now
        (a refusal writes nothing); ``"queue"`` as take, but refused while promised slots
        are due, and a refused caller is promised the next unpromised slot (no further
        than *most_us* away, 0: any); ``"peek"`` writes nothing."""
        ...

    # -- records beside a lock, written only by its holder ------------------------------
    def load_records(self, slot: Slot, suffix: str) -> dict[str, str]:
        """Every field of the records hash ``<lock key>:<suffix>``, the newest by
        :func:`record_version` where masters differ."""
        ...

    def claim(  # noqa: PLR0917 - a record claim names slot, token, field, value and version
        self,
        slot: Slot,
        suffix: str,
        token: str,
        name: str,
        value: str,
        version: tuple[int, int],
        deadline: float | None = None,
    ) -> Claim:
        """Write field *name* = *value* (a JSON record whose version, ``(fence, n)``, is
        *version*) of the records hash, only while *token* holds the lock, and never over
        a newer version of the same fence: ``claimed`` (also when the field already holds
        *value*: a re-sent copy), ``lost`` or ``stale``. Raises
        :class:`~.errors.QuorumUnavailable` when too few answered to know. *deadline*
        (``time.monotonic()``) bounds the wait for a quorum's answers."""
        ...

    # -- operator reads and forced release ----------------------------------------------
    def scan(self, prefix: str, pattern: str = "*") -> list[LockInfo]:
        """Every held lock, live permit and queued hold under *prefix* whose name matches
        the glob *pattern*, sorted by name (``SCAN`` on Redis, never ``KEYS``)."""
        ...

    def read(self, prefix: str, name: str) -> list[LockInfo]:
        """Lock *name*'s holder, queued hold and live permits (empty when none).
        :class:`~.errors.ConfigError` when its key holds data that is not ours."""
        ...

    def scan_rates(self, prefix: str, pattern: str = "*") -> list[RateInfo]:
        """The state of every rate limiter under *prefix* whose name matches *pattern*."""
        ...

    def read_rate(self, prefix: str, name: str) -> RateInfo | None:
        """The state of rate limiter *name*, or None when it is idle (no state)."""
        ...

    def force_release(self, slot: Slot, fence: int | None, notice_ms: int) -> ForceRelease:
        """Remove the lock whoever holds it (only the acquisition with *fence*, when
        given) and wake one waiter. The holder is not told and its token is not
        remembered as released: its own release then raises ``LockLost``."""
        ...

    def force_dequeue(self, slot: Slot, owner: str | None) -> ForceRelease:
        """Remove the enqueue-time hold (only task *owner*'s, when given)."""
        ...


#: Holder records longer than this (ours are a few hundred bytes) are not decoded: they are
#: foreign data, and would otherwise travel whole into errors, logs and task results.
MAX_RECORD = 65536
_RAW_HEAD = 200


def parse_holder(raw: Any) -> dict[str, Any]:
    """Decode a holder record as stored with a lock; an unreadable one becomes
    ``{"raw": <its text>}`` (its first 200 characters when over :data:`MAX_RECORD`), an
    empty or missing one ``{}``."""
    if raw is None:
        return {}
    value_text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    if not value_text:
        return {}
    if len(value_text) > MAX_RECORD:
        return {"raw": f"{value_text[:_RAW_HEAD]}... ({len(value_text)} characters)"}
    try:
        value = json.loads(value_text)
    except ValueError:
        return {"raw": value_text}
    return value if isinstance(value, dict) else {"raw": value_text}


def text(value: Any) -> str:
    """A stored value as text: bytes decoded (invalid bytes replaced), None as ``""``."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def record_version(value: str) -> tuple[int, int]:
    """The ``(fence, n)`` of a stored record; ``(-1, -1)`` for one that cannot be read."""
    try:
        decoded = json.loads(value)
        return int(decoded["fence"]), int(decoded["n"])
    except (ValueError, TypeError, KeyError):
        return -1, -1


def newest_records(answers: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """Each field's newest record (by :func:`record_version`) across *answers*."""
    newest: dict[str, tuple[tuple[int, int], str]] = {}
    for answer in answers:
        for name, value in answer.items():
            version = record_version(value)
            if name not in newest or version > newest[name][0]:
                newest[name] = (version, value)
    return {name: value for name, (_, value) in newest.items()}
