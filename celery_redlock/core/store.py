"""The seam between lock logic and Redis I/O.

:class:`~celery_redlock.core.lock.Lock` keeps the state of an acquisition
(token, fence, local deadline, reentrancy, events); a :class:`Store` does the I/O
for it and answers in the typed results below. Two stores exist:

- :class:`~celery_redlock.core.stores.redis.RedisStore`: one Redis (a plain
  server, a Sentinel master, or a Cluster);
- :class:`~celery_redlock.core.stores.quorum.QuorumStore`: a majority of N
  independent masters (Redlock), each a ``RedisStore``.

The renewal thread, :mod:`~celery_redlock.core.records` and the CLI talk to the
same seam: a store's ``members`` are the single-node stores it is made of (a
``RedisStore`` is its own only member), and ``settle`` turns one outcome per
member into the store's outcome.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .keys import LockKeys
from .scripts import Status

if TYPE_CHECKING:
    from .errors import QuorumUnavailable
    from .stores.redis import RedisStore

__all__ = [
    "MIN_NODE_TIMEOUT",
    "Grant",
    "Handover",
    "Holder",
    "Permit",
    "Queued",
    "RateGrant",
    "Store",
    "node_timeout",
    "parse_holder",
    "text",
]

#: The shortest per-node timeout, whatever the TTL: below this, a first connection's
#: handshake or a busy host's scheduling alone makes healthy masters look unreachable.
MIN_NODE_TIMEOUT = 0.05


def node_timeout(ttl: float) -> float:
    """The default per-node timeout for a lease of *ttl* seconds: 5% of it, >= 50 ms."""
    return max(MIN_NODE_TIMEOUT, 0.05 * ttl)


@dataclass(frozen=True, slots=True)
class Grant:
    """What one acquire attempt found."""

    acquired: bool
    #: The fence of this acquisition (acquired).
    fence: int | None = None
    #: The other owner's record (not acquired).
    holder: Mapping[str, Any] = field(default_factory=dict)
    #: The other owner's lease left, in ms (not acquired; None when unknown).
    holder_ttl_ms: int | None = None
    #: How long a blocking caller may wait for a release notice before trying again (ms).
    wait_ms: int | None = None
    #: Which member to wait on for that notice (quorum stores: one the holder has).
    wait_on: int = 0
    #: What each master answered, by address (quorum stores; shown in errors).
    masters: Mapping[str, str] = field(default_factory=dict)
    #: A hand-over refused because the enqueue-time hold belongs to another task id
    #: (``queued_owner``); ``holder`` and ``holder_ttl_ms`` are then that hold's.
    superseded: bool = False
    #: A hand-over's view of the enqueue-time hold: its owner's task id ("" when there is
    #: none; None when the attempt was no hand-over, or it was acquired).
    queued_owner: str | None = None


@dataclass(frozen=True, slots=True)
class Handover:
    """What a :class:`~celery_redlock.core.lock.Lock` takes over when it is acquired: the
    enqueue-time hold of task *owner* (see :meth:`Store.handover`)."""

    #: The task id whose queued hold becomes this lock.
    owner: str
    #: Refuse (superseded) when the queued hold belongs to another task id.
    strict: bool = True


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
class Holder:
    """Who holds a lock now: the acquisition's token and its holder record."""

    token: str
    record: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Permit(Holder):
    """One live permit of a semaphore: its token and record, fence and lease left."""

    fence: int | None = None
    #: Lease left in ms (server time) when it was read.
    ttl_ms: int = 0


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


class Store(Protocol):
    """Where locks live: one Redis, or a quorum of masters."""

    #: How many members must agree (1 for one Redis).
    quorum: int

    @property
    def members(self) -> Sequence[RedisStore]:
        """The single-node stores this store is made of, in a fixed order."""
        ...

    def describe(self) -> str:
        """The password-free address(es), for log lines."""
        ...

    def timeout(self, ttl_ms: int | None) -> float:
        """How long to wait for each member's answer, for a lease of *ttl_ms*."""
        ...

    def acquire(
        self, keys: LockKeys, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int
    ) -> Grant:
        """One attempt to take *keys* for *token*; :class:`QuorumUnavailable` when Redis
        cannot decide. *wait*: a refused caller will block for a release notice."""
        ...

    def release(
        self, keys: LockKeys, token: str, notice_ms: int, done: tuple[str, int] | None = None
    ) -> Status:
        """Give back *token*'s acquisition and wake one waiter; with *done* (value, ms),
        add that done mark to the lock's in the same step (see :meth:`was_done`)."""
        ...

    def was_done(self, keys: LockKeys, mark: str) -> bool:
        """True when a release added *mark* to the lock's done marks (the 16 most recent
        are kept while releases keep adding them)."""
        ...

    def handover(
        self,
        keys: LockKeys,
        token: str,
        ttl_ms: int,
        record: str,
        *,
        owner: str,
        strict: bool,
        wait: bool,
        fence_ttl_ms: int,
    ) -> Grant:
        """:meth:`acquire`, taking over the enqueue-time hold of task *owner* in the same
        step. *strict*: refused (``Grant.superseded``) when that hold belongs to another
        task id. :class:`ConfigError` where the store cannot do it atomically."""
        ...

    def enqueue(
        self,
        keys: LockKeys,
        owner: str,
        ttl_ms: int,
        record: str,
        *,
        replace: bool,
        running_blocks: bool,
    ) -> Queued:
        """Take the enqueue-time hold of *keys* for task *owner* (see enqueue.lua)."""
        ...

    def dequeue(self, keys: LockKeys, owner: str) -> Status:
        """Give up task *owner*'s enqueue-time hold (owner-checked)."""
        ...

    def abandon(self, keys: LockKeys, token: str, notice_ms: int) -> None:
        """Best-effort :meth:`release` after a failed or unclear attempt (never raises
        for Redis errors: the lease then expires by itself)."""
        ...

    def extend(self, keys: LockKeys, token: str, ms: int, *, replace: bool) -> int | Status:
        """Lengthen *token*'s lease: the new lease in ms, or why not (GONE / TAKEN)."""
        ...

    def holder(self, keys: LockKeys) -> Holder | None:
        """Who holds *keys* now (a majority's view for a quorum), or None when free."""
        ...

    def locked(self, keys: LockKeys) -> bool:
        """True when anyone holds *keys*."""
        ...

    def wait(self, keys: LockKeys, seconds: float, refused: Grant | None = None) -> None:
        """Block up to *seconds* for a release notice of *keys* (*refused*: the attempt
        that found it held)."""
        ...

    def settle(
        self, name: str, outcomes: Sequence[Status | BaseException]
    ) -> Status | QuorumUnavailable:
        """One renewal outcome from one outcome per member (in ``members`` order)."""
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
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    if not text:
        return {}
    if len(text) > MAX_RECORD:
        return {"raw": f"{text[:_RAW_HEAD]}... ({len(text)} characters)"}
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"raw": text}


def text(value: Any) -> str:
    """A reply as text: bytes decoded (invalid bytes replaced), None as ``""``."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
