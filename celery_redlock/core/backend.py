"""The seam between the lock primitives and where locks live: verbs and typed results.

A :class:`Backend` speaks lock semantics, not storage commands. The primitives
(:class:`~celery_redlock.core.lock.Lock`, ``Semaphore``, ``RateLimiter``, ``QueuedHold``,
``LockRecords``), the renewal thread and the operator reads call only the verbs below
and read only their results (:mod:`.backend_types`). Three backends implement them, one
module each:

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

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

from .backend_types import (
    MAX_RECORD,
    Claim,
    ForceRelease,
    Grant,
    Handover,
    Holder,
    LockInfo,
    Queued,
    RateGrant,
    RateInfo,
    Renewal,
    Slot,
    Status,
    newest_records,
    parse_holder,
    record_version,
    text,
)
from .errors import QuorumUnavailable

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
        self,
        name: str,
        key: str,
        interval_us: int,
        burst: int,
        *,
        mode: str,
        most_us: int = 0,
        grace_us: int = 0,
    ) -> RateGrant:
        """One GCRA decision of rate limiter *name* stored at *key* (see
        :mod:`~celery_redlock.core.ratelimit`). *mode*: ``"take"`` grants if possible now
        (a refusal writes nothing); ``"queue"`` as take, but refused while promised slots
        are due, and a refused caller is promised the next unpromised slot (no further
        than *most_us* away, 0: any); a grant possible for *grace_us* that no promised
        caller claimed lapses to a ``"queue"`` caller; ``"peek"`` writes nothing."""
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
