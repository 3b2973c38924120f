"""The seam between the lock primitives and where locks live, split by capability.

Every backend has the lock verbs (:class:`Backend`: acquire, release, extend, renew,
wait, holders, locked). Everything else is a capability of its own, a protocol a backend
implements or does not:

========================= =================================================================
:class:`Permits`          up to N holders of one name in one place (``Semaphore``, limit > 1)
:class:`QueuedHolds`      the enqueue-time hold of a queued message, its hand-over to the
                          run's lock, and a run's hold kept for its redelivered copy
                          (``park``) (``QueuedHold``, ``RunLock``, ``lock_on="enqueue"``)
:class:`DoneMarks`        a release that records which run finished (``RunLock``)
:class:`Rates`            GCRA rate decisions (``RateLimiter``, ``lock_rate``)
:class:`FlowControl`      several holds of a run taken in one step (``lock_limits``), and
                          operator controls read by that step (``celery locks pause/set``)
:class:`Records`          records only a lock's holder may write (``LockRecords``: beat)
:class:`Admin`            operator reads and forced removals (``celery locks``)
:class:`EventLog`         a capped log of lock events per key prefix (the board's events)
:class:`Sends`            a verb written now, its answer read later (a quorum's fan-out, a
                          publish's claim overlapping Celery's message building)
:class:`InProcess`        a store in this process that a test may empty
:class:`Probe`            a health probe of each server (the worker's start-up check)
========================= =================================================================

A primitive asks for the capability it needs once, when it is built: :func:`need` gives
the backend as that protocol, or raises the one :class:`~.errors.ConfigError` that names
the backend and what it lacks (with the backend's own reason, :meth:`why_not`). Three
backends implement the verbs, one folder each: :mod:`~.backends.redis` (one Redis: every
capability), :mod:`~.backends.memory` (the Redis backend on an in-process server) and
:mod:`~.backends.quorum` (Redlock over members: the lock verbs, done marks and records).

What every verb promises (the behaviour suite ``tests/integration/test_backends.py``
checks each backend):

- *Errors.* A verb raises :class:`~.errors.StoreUnavailable` when the backend cannot
  decide (a server down, not answering in time, loading, out of memory, read-only, or
  too few masters of a quorum), and :class:`~.errors.ConfigError` when the data at a
  lock's keys is not ours. Anything else (a client whose pool is exhausted, a wrong
  argument type, a bug) is raised as it is, with its traceback: it is never reported as
  unavailable.
- *Owner checks.* Every mutation of an acquisition names its token and changes nothing
  when another token holds it. A verb sent twice (a client re-sending after a lost
  reply) has the effect of sending it once: a re-sent acquire finds its own token and
  reports success with the same fence; a re-sent release finds the token it released
  (the backend remembers the most recent ones for ``notice_ms``) and reports
  :attr:`Status.OK`.
- *Time.* Leases are whole milliseconds and expire on the backend's clock.
- *Nothing held.* A verb takes what it needs (a connection from the client's pool) and
  gives it back before it returns, on every path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

from .backend_types import (
    Claim,
    Control,
    ForceRelease,
    Grant,
    Handover,
    Health,
    Holder,
    LockInfo,
    Queued,
    RateGrant,
    RateInfo,
    Renewal,
    Slot,
    Status,
)
from .errors import ConfigError, StoreUnavailable
from .listing import Listing, ListQuery

__all__ = [
    "Admin",
    "Backend",
    "DoneMarks",
    "EventLog",
    "FlowControl",
    "InProcess",
    "Permits",
    "Probe",
    "QueuedHolds",
    "Rates",
    "Records",
    "Sendable",
    "Sends",
    "Sent",
    "capability",
    "given",
    "has",
    "lacks",
    "need",
]

_P = TypeVar("_P")
_T = TypeVar("_T", bound=type)

#: Each capability in words, for the error that says a backend lacks it.
_WORDS: dict[type, str] = {}
#: (backend type, capability) -> whether that type implements it: a structural check once
#: per type, never per call.
_HAS: dict[tuple[type, type], bool] = {}
#: Each capability's members: the names a backend must have to implement it.
_MEMBERS: dict[type, tuple[str, ...]] = {}


def capability(words: str) -> Callable[[_T], _T]:
    """Make a protocol a capability: checkable at run time, and named in errors as
    *words* ("semaphores (a limit above 1)")."""

    def mark(cls: _T) -> _T:
        checked: _T = runtime_checkable(cls)
        _WORDS[checked] = words
        _MEMBERS[checked] = _members_of(checked)
        return checked

    return mark


def _members_of(protocol: type) -> tuple[str, ...]:
    """The public names a protocol and its protocol bases declare (methods and
    annotated attributes)."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass in (object, Protocol, Generic):
            continue
        names.update(n for n in vars(klass) if not n.startswith("_"))
        names.update(n for n in vars(klass).get("__annotations__", {}) if not n.startswith("_"))
    return tuple(sorted(names))


def _implements(backend: Any, what: type) -> bool:
    """True when *backend* has every member of capability *what*. Looked up as attribute
    access does (``hasattr``), so a proxy that forwards its verbs (``__getattr__``)
    implements what it forwards on every Python: ``isinstance`` against a runtime
    protocol looks members up statically from Python 3.12 on."""
    members = _MEMBERS.get(what)
    if members is None:
        return isinstance(backend, what)
    return all(hasattr(backend, name) for name in members)


def lacks(backend: Any, what: type) -> str:
    """Why *backend* cannot be used as capability *what*: the one message for every place
    that asks (a primitive being built, a task option at worker start)."""
    why = getattr(backend, "why_not", None)
    reason = why(what) if callable(why) else ""
    where = backend.describe() if hasattr(backend, "describe") else type(backend).__name__
    return f"{_WORDS.get(what, what.__name__)} are not available on {where}" + (
        f": {reason}" if reason else ""
    )


def has(backend: Any, what: type) -> bool:
    """True when *backend* implements capability *what* (checked once per type)."""
    key = (type(backend), what)
    found = _HAS.get(key)
    if found is None:
        found = _HAS[key] = _implements(backend, what)
    return found


def need(backend: Any, what: type[_P]) -> _P:
    """*backend* as capability *what*, or a ConfigError naming the backend and what it
    lacks (:func:`lacks`). A primitive calls it once, when it is built."""
    if not has(backend, what):
        raise ConfigError(lacks(backend, what))
    return backend  # type: ignore[no-any-return]


def given(backend: Any, what: type[_P]) -> _P | None:
    """*backend* as capability *what* when it has it, else None: for a capability a
    primitive uses when present and does without otherwise."""
    return backend if has(backend, what) else None


@runtime_checkable
class Backend(Protocol):
    """Where locks live: the lock verbs every backend has. See the module docstring for
    what every verb promises.

    Equal backends share one renewal batch: a Redis backend is equal to another of the
    same client object, a quorum to another of equal members.
    """

    #: How many independent masters decide (1 for one Redis or one memory store).
    masters: int

    def describe(self) -> str:
        """The password-free address(es), for log lines and errors."""
        ...

    def acquire(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int,
        deadline: float | None = None
    ) -> Grant:  # fmt: skip
        """One attempt to take *slot* for *token* for *ttl_ms*, storing *record* (JSON)
        as the holder record. Acquired: the fence, strictly greater than every earlier
        fence of the name (its counter lives *fence_ttl_ms* after its last use, 0:
        forever; a counter that is gone restarts above any value it could have
        reached). Refused: the holder's record and lease left. *wait*: the caller will
        block for a release notice (:meth:`wait`), so a release must send one.
        *deadline* (a ``time.monotonic()``): past it the caller waits for no more answers;
        a backend of several members ends its round there and reports what it knows
        (refused, never unavailable, for members it stopped waiting for); one server's
        call is bounded by its own timeouts."""
        ...

    def release(self, slot: Slot, token: str, notice_ms: int) -> Status:
        """Give back *token*'s acquisition and wake one waiter; remember *token* as
        released for *notice_ms* (the most recent tokens of a name, a bounded number).
        OK: released now, or already released by this token (a re-sent copy); GONE:
        expired or removed by someone else; TAKEN: another token holds it; FOREIGN: not
        a lock."""
        ...

    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        """Lengthen *token*'s lease by *ms* (set it to *ms* with *replace*): the new lease
        in ms, or why not (GONE, TAKEN, FOREIGN). Never recreates a missing key."""
        ...

    def renew(self, items: Sequence[Renewal]) -> list[Status | StoreUnavailable]:
        """Set each item's lease to its ``ms`` if its token still holds it: one outcome
        per item, in order, in one round trip per node (a script for every item held
        there). An item a quorum could not decide for is a ``StoreUnavailable`` in the
        list; when the backend cannot decide for any item (its one server is down), the
        verb raises :class:`~.errors.StoreUnavailable` instead."""
        ...

    def wait(self, slot: Slot, seconds: float, refused: Grant | None = None) -> None:
        """Block up to *seconds* for a release notice of *slot* (*refused*: the attempt
        that found it held). Returns early when a release (or a forced release) sends
        one; a notice sent while nobody waited is kept for the next waiter. O(1)
        commands per call, never a poll loop."""
        ...

    def holders(self, slot: Slot) -> list[Holder]:
        """Every current acquisition of *slot* (a mutex: at most one; a quorum: the one
        a majority holds), first to expire first."""
        ...

    def locked(self, slot: Slot) -> bool:
        """True when *slot* cannot be taken now (a mutex: anyone holds it, on a quorum a
        majority; permits: every one is held)."""
        ...


_MEMBERS[Backend] = _members_of(Backend)


@capability("semaphores (a limit above 1: Semaphore, lock_limit)")
class Permits(Protocol):
    """Up to ``slot.limit`` holders of one name in one place: the lock verbs take a
    permit slot (``Slot.limit > 1``; see :mod:`~celery_redlock.core.semaphore`)."""

    #: True: the lock verbs take permit slots.
    holds_permits: Literal[True]


@capability("enqueue-time holds (QueuedHold, lock_on='enqueue' or 'enqueue+run')")
class QueuedHolds(Protocol):
    """The enqueue-time hold of one queued message per name, and its hand-over to the
    run's lock in one step (see :mod:`~celery_redlock.core.queued`)."""

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

    def take_over(
        self,
        slot: Slot,
        token: str,
        ttl_ms: int,
        record: str,
        handover: Handover,
        *,
        wait: bool,
        fence_ttl_ms: int,
    ) -> Grant:
        """:meth:`Backend.acquire` of a mutex that takes over task ``handover.owner``'s
        enqueue-time hold in the same step. Refused with :class:`Superseded` when the
        hold belongs to another task id and ``handover.strict``; a refusal says the
        hold's owner (its ``queued_owner``, "" when there is none). A lock kept for
        ``handover.owner`` by :meth:`park` is taken over as if free."""
        ...

    def park(
        self, slot: Slot, token: str, owner: str, ttl_ms: int, *, record: str, notice_ms: int
    ) -> Status:
        """Keep *token*'s acquisition (a run whose process is gone, whose message comes
        back) for task *owner*'s redelivered copy: the name stays taken by *owner* for
        *ttl_ms*, shown with *record*, until a :meth:`take_over` of *owner* takes it; a
        waiter is woken. OK kept, GONE no such lock, TAKEN another token's, FOREIGN not a
        lock."""
        ...


@capability("done marks (acks_late runs that tell a redelivered copy it ran)")
class DoneMarks(Protocol):
    """A release that records which run finished, and the check of that record."""

    def release_done(
        self, slot: Slot, token: str, notice_ms: int, mark: str, mark_ms: int
    ) -> Status:
        """:meth:`Backend.release` that also adds *mark* to the name's done marks (the 16
        most recent are kept, for *mark_ms* after the last one), in the same step."""
        ...

    def was_done(self, slot: Slot, mark: str) -> bool:
        """True when a release added *mark* to the name's done marks."""
        ...


@capability("rate limits (RateLimiter, lock_rate)")
class Rates(Protocol):
    """GCRA decisions (see :mod:`~celery_redlock.core.ratelimit`)."""

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
        """One GCRA decision of rate limiter *name* stored at *key*. *mode*: ``"take"``
        grants if possible now (a refusal writes nothing); ``"queue"`` as take, but
        refused while promised slots are due, and a refused caller is promised the next
        unpromised slot (no further than *most_us* away, 0: any); a grant possible for
        *grace_us* that no promised caller claimed lapses to a ``"queue"`` caller;
        ``"peek"`` writes nothing."""
        ...


@capability("flow control (lock_limits, and pauses and limits set by an operator)")
class FlowControl(Protocol):
    """A slot with rules (:attr:`Slot.flow <celery_redlock.core.backend_types.Slot.flow>`)
    is taken in one step: the controls of its name and of each rule are read, every rule
    is checked, and only when all admit it are the slot and its rules taken (the lock
    verbs :meth:`Backend.acquire` and :meth:`QueuedHolds.take_over` do this for such a
    slot; its release, extend and renewal cover its Limit rules). A slot under operator
    control without rules (``controlled``: a task's run) is taken by its own acquire,
    which reads its name's controls in the same step. The controls live in one hash per
    name (:attr:`~.keys.LockKeys.control`), written by :meth:`set_control`."""

    def set_control(self, control_key: str, kind: str, value: str | None, ttl_ms: int) -> bool:
        """Set control *kind* (``"pause"``, ``"limit"`` or ``"rate"``) of the name whose
        control hash is *control_key* to *value* for *ttl_ms* (0: until lifted), or lift
        it (*value* None). True when something changed."""
        ...

    def controls(self, prefix: str, pattern: str = "*") -> list[Control]:
        """Every control in force under *prefix* whose name matches *pattern*."""
        ...


@capability("records beside a lock (LockRecords: beat's ticks)")
class Records(Protocol):
    """Records only the lock's holder may write (see :mod:`~celery_redlock.core.records`)."""

    def load_records(self, slot: Slot, suffix: str) -> dict[str, str]:
        """Every field of the records hash ``<lock key>:<suffix>``, the newest by
        :func:`~.backend_types.record_version` where masters differ."""
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
        :class:`~.errors.StoreUnavailable` when too few answered to know. *deadline*
        (``time.monotonic()``) bounds the wait for a quorum's answers."""
        ...


@capability("operator reads and removals (celery locks; on Redlock, per master)")
class Admin(Protocol):
    """What ``celery locks`` reads and removes on one store (see :mod:`~.admin`)."""

    def scan(self, prefix: str, pattern: str = "*", limit: int | None = None) -> list[LockInfo]:
        """Every held lock, live permit and queued hold under *prefix* whose name matches
        the glob *pattern*, sorted by name (``SCAN`` on Redis, never ``KEYS``); with
        *limit*, those of the first *limit* names only (a page: only they are read)."""
        ...

    def read(self, prefix: str, name: str) -> list[LockInfo]:
        """Lock *name*'s holder, queued hold and live permits (empty when none).
        :class:`~.errors.ConfigError` when its key holds data that is not ours."""
        ...

    def scan_rates(self, prefix: str, pattern: str = "*") -> list[RateInfo]:
        """The state of every rate limiter under *prefix* whose name matches *pattern*."""
        ...

    def listing(self, prefix: str, query: ListQuery) -> Listing:
        """One page of *query* under *prefix*, with the total and the counts by kind and
        state (:mod:`~.listing`); what it reads grows with the page where the store keeps
        an index of what it holds."""
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


@capability("a lock event log (the board's recent events)")
class EventLog(Protocol):
    """A capped log of lock events under one key (``<prefix>events``): workers append
    batches from a background thread, the board reads the newest."""

    def log_events(self, log_key: str, events: Sequence[str], maxlen: int, ttl_ms: int) -> None:
        """Append *events* (JSON texts, oldest first) to the log at *log_key* in one round
        trip, keeping about the newest *maxlen*; the log goes *ttl_ms* after its last write."""
        ...

    def read_events(self, log_key: str, count: int) -> list[str]:
        """The newest *count* events of the log at *log_key*, newest first (empty when
        there is none). :class:`~.errors.ConfigError` when the key holds something else."""
        ...


class Sent(Protocol):
    """A verb sent (:class:`Sends`), whose answer is read when it comes."""

    def ready(self, timeout: float) -> bool:
        """True once the answer is there to read (waits up to *timeout*)."""
        ...

    def result(self) -> Any:
        """The verb's answer (read now if it has not been), or what the verb would raise."""
        ...

    def finish(self, follow: Callable[[], object] | None = None) -> None:
        """Nobody waits for the answer: read it in the background, give the connection
        back, then run *follow* (a release that must come after the call)."""
        ...

    def poll(self) -> None:
        """Read the answer if it has come (no wait), giving the connection back."""
        ...


class Sendable(Enum):
    """The verbs a backend that :class:`Sends` may write now and answer later, each the
    seam method of the same name (:meth:`on`)."""

    ACQUIRE = "acquire"
    RELEASE = "release"
    RELEASE_DONE = "release_done"
    EXTEND = "extend"
    ENQUEUE = "enqueue"
    RAISE_FENCE = "raise_fence"

    def on(self, backend: Any) -> Callable[..., Any]:
        """This verb's method of *backend* (its value is the method's name), to call the
        usual way."""
        return getattr(backend, self.value)  # type: ignore[no-any-return]


@capability("calls sent now and answered later")
class Sends(Protocol):
    """A backend that writes a verb now and reads its answer later (:class:`Sent`): a
    quorum sends to every master before it reads any answer, and a publish sends its
    queued hold's claim before Celery builds the message."""

    def send(
        self,
        verb: Sendable,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        answered: Callable[[bool], object],
        behind: Any = None,
    ) -> Sent | None:
        """``verb(*args, **kwargs)`` sent now, ``answered(heard)`` called once its answer
        is read or it failed (*heard*: the server answered); None when this backend
        calls that verb the usual way. *behind*: a call this backend sent that nobody
        waits for any more: where it can, the verb goes on that call's connection after
        it (in order, with no new connection), and reads its answer first."""
        ...


@capability("an in-process store (memory://)")
class InProcess(Protocol):
    """A store that lives in this process (``connect("memory://...")``)."""

    def clear(self) -> None:
        """Forget every key (for tests)."""
        ...


@capability("a health probe (the worker's start-up check)")
class Probe(Protocol):
    """Ask each server whether it can take locks now, without taking any."""

    def check(self) -> list[Health]:
        """One :class:`~.backend_types.Health` per server (a quorum: per master, in the
        order of its members). Never raises for what a server answers or fails to
        answer: that is the result."""
        ...
