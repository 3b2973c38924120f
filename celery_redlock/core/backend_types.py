"""The values of the backend seam (:class:`~celery_redlock.core.backend.Backend`): what its
verbs take (:class:`Slot`, :class:`Handover`, :class:`Renewal`) and their typed results
(:class:`Status`, :data:`Grant` (:class:`Acquired`, :class:`Held`, :class:`Superseded`,
:class:`Refused`), :class:`Holder`, :class:`Queued`, :class:`RateGrant`,
:class:`Claim`, :class:`LockInfo`, :class:`RateInfo`, :class:`ForceRelease`), and how a
backend reads a stored value into them (:func:`parse_holder`, :func:`text`,
:func:`record_version`, :func:`newest_records`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar, Literal

from .errors import ConfigError, describe_holder
from .keys import LockKeys

__all__ = [
    "MAX_RECORD",
    "PARKED",
    "RECENT_BYTES",
    "Acquired",
    "Claim",
    "Control",
    "ForceRelease",
    "Grant",
    "Handover",
    "Health",
    "Held",
    "Holder",
    "LockInfo",
    "Queued",
    "RateGrant",
    "RateInfo",
    "Refused",
    "Renewal",
    "Rule",
    "Slot",
    "Status",
    "Superseded",
    "lock_state",
    "mutex_keys",
    "newest_records",
    "parse_holder",
    "record_version",
    "text",
]


#: The most bytes of recently released tokens one name keeps (``' t1 t2 ... '``: about 17
#: of ours, 40 hex characters and a space each), whatever the release rate. A re-sent copy
#: of a release comes within moments of the first, before that many others of the name.
RECENT_BYTES = 700

#: The token of a lock kept for a task id's redelivered copy (``park``): this, then the
#: task id (``park.lua`` and ``acquire.lua`` spell it too).
PARKED = "parked:"


def lock_state(record: Mapping[str, Any]) -> Literal["running", "held", "queued"]:
    """How an operator sees a lock (or permit) with holder *record*: a task's run holds it
    ("running"), a run kept for its message's redelivered copy ("queued": the message is
    on its way back), or another holder (a Lock of user code, beat's leader: "held")."""
    if record.get("kept_for"):
        return "queued"
    return "running" if record.get("task_name") else "held"


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

    @classmethod
    def first_failure(cls, codes: Sequence[Status]) -> Status:
        """The first of *codes* that is not OK, else OK: several holds given back or
        renewed as one (a slot and its rules)."""
        return next((c for c in codes if c is not cls.OK), cls.OK)


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
class Rule:
    """One more hold that an acquisition takes with its slot, in the same step, all or
    nothing (a task's ``lock_limits``): a permit of ``limit`` (a ``Limit``: renewed and
    released with the slot, fenced by its name's counter; a Limit of one is the mutex of
    its name) or ``cost`` units of a GCRA rate (a ``Rate``: taken, never given back).
    Each rule's operator controls are read with it (see
    :class:`~celery_redlock.core.backend.FlowControl`)."""

    #: The keys of its name: a Limit's from :func:`~.keys.permit_keys` (a Limit of one:
    #: :func:`~.keys.lock_keys`, the mutex of its name), a Rate's from ``lock_keys`` (its
    #: state at ``rate``, where a ``RateLimiter`` of the name keeps it).
    keys: LockKeys
    #: A Limit's permits (0 for a Rate).
    limit: int = 0
    #: A Rate's emission interval in microseconds, and its burst.
    interval_us: int = 0
    burst: int = 1
    #: A Rate's units taken by this acquisition.
    cost: int = 1

    @property
    def is_rate(self) -> bool:
        """True for a Rate, False for a Limit."""
        return self.limit == 0

    @property
    def is_mutex(self) -> bool:
        """True for a Limit of one: the mutex of its name (as ``Semaphore(limit=1)`` is),
        held where a ``lock_key`` of that name holds it."""
        return self.limit == 1

    @property
    def name(self) -> str:
        """The rule's rendered name (``partner:acme``)."""
        return self.keys.name

    @property
    def key(self) -> str:
        """What the rule takes: a Limit's permits hash (or lock hash), a Rate's state."""
        return self.keys.rate if self.is_rate else self.keys.lock


@dataclass(frozen=True, slots=True)
class Slot:
    """What an acquisition holds: the mutex of a name (``limit == 1``, ``keys`` from
    :func:`~.keys.lock_keys`) or one of ``limit`` permits of it (``limit > 1``, ``keys``
    from :func:`~.keys.permit_keys`). A ``Semaphore(limit=1)`` is the mutex.

    With ``controlled`` (a task's run) its acquire reads the name's operator controls (a
    pause, a limit) in the same step; with ``rules`` (a task's ``lock_limits``) it is
    taken through :class:`~celery_redlock.core.backend.FlowControl`: the controls of its
    name and of each rule are read, and every rule is taken with it, all or nothing; a
    release, an extend and a renewal of the slot cover its rules."""

    keys: LockKeys
    limit: int = 1
    rules: tuple[Rule, ...] = ()
    controlled: bool = False

    @property
    def flow(self) -> bool:
        """True when an acquire of this slot takes rules with it, in one step (on Redis,
        ``hold_all.lua``); a slot without rules pays for its own acquire alone."""
        return bool(self.rules)

    @property
    def held_rules(self) -> tuple[Rule, ...]:
        """The rules held with the slot (its Limits), renewed and released with it."""
        return tuple(r for r in self.rules if not r.is_rate)

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
    (see :meth:`~celery_redlock.core.backend.QueuedHolds.enqueue`)."""

    #: The task id whose queued hold becomes this lock.
    owner: str
    #: Refuse (:class:`Superseded`) when the queued hold belongs to another task id.
    strict: bool = True


@dataclass(frozen=True, slots=True)
class Acquired:
    """An acquire attempt took the slot: it is held for the caller."""

    acquired: ClassVar[bool] = True
    #: The fence of this acquisition (None: a backend without fences).
    fence: int | None = None
    #: Taken with rules (:class:`Rule`): each rule's fence, in the slot's order (0 for a
    #: Rate).
    fences: tuple[int, ...] = ()
    #: What each master answered, by address (a quorum; shown in errors).
    masters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Held:
    """An acquire attempt found the slot held by another acquisition."""

    acquired: ClassVar[bool] = False
    #: The other owner's record (empty: nobody answered with one before the caller's
    #: deadline, as a quorum whose members were not all heard from).
    holder: Mapping[str, Any] = field(default_factory=dict)
    #: The other owner's lease left, in ms (None when unknown, -1 when the key has no
    #: expiry: not written by celery-redlock).
    holder_ttl_ms: int | None = None
    #: How long a blocking caller may wait for a release notice before trying again (ms).
    wait_ms: int | None = None
    #: Which member to wait on for that notice (a quorum: one the holder has).
    wait_on: int = 0
    #: A hand-over's view of the enqueue-time hold: its owner's task id ("" when there is
    #: none; None when the attempt was no hand-over).
    queued_owner: str | None = None
    masters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Superseded:
    """A hand-over refused: the enqueue-time hold belongs to another task id
    (``queued_owner``), so this message has no place to take; ``holder`` and
    ``holder_ttl_ms`` are that hold's."""

    acquired: ClassVar[bool] = False
    queued_owner: str
    holder: Mapping[str, Any] = field(default_factory=dict)
    holder_ttl_ms: int | None = None
    masters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Refused:
    """An acquire attempt refused by an operator control or a rule, not by the slot's
    holder."""

    acquired: ClassVar[bool] = False
    #: The name whose control or rule refused (the slot's own, or a rule's).
    by: str
    #: Why: ``"paused"`` (``holder`` has the pause's ``reason``), ``"limit"`` (``holder``:
    #: the record of its permit that expires first) or ``"rate"``.
    reason: str
    holder: Mapping[str, Any] = field(default_factory=dict)
    #: The longest known wait of every refusal, in ms (None: unknown, such as a pause
    #: with no end).
    wait_ms: int | None = None
    masters: Mapping[str, str] = field(default_factory=dict)

    @property
    def holder_ttl_ms(self) -> int | None:
        """What is known of the refusal's end: its wait."""
        return self.wait_ms


#: What one acquire attempt found: match on the type.
Grant = Acquired | Held | Superseded | Refused


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
    """What a claim of a record beside a lock found
    (:meth:`~celery_redlock.core.backend.Records.claim`)."""

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
class Control:
    """An operator's control of one name (``celery locks pause`` / ``set``), as stored."""

    #: The rendered name.
    name: str
    #: ``"pause"`` (``value``: the reason), ``"limit"`` (``value``: the permits) or
    #: ``"rate"`` (``value``: ``"<interval_us>|<burst>"``).
    kind: str
    value: str
    #: Milliseconds left until it lapses by itself (None: until it is lifted).
    ttl_ms: int | None


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

    def said(self, name: str, where: str = "") -> str:
        """What an operator is told of it (``celery locks release``, the board): lock
        *name*, on master *where* when a deployment has several."""
        on = f" on {where}" if where else ""
        holder = describe_holder(self.record)
        if self.outcome == "released":
            return f"released {name!r}{on}: was held by {holder}, fence {self.fence}"
        if self.outcome == "gone":
            return f"{name!r}{on} was already gone (expired or released)"
        return (
            f"{name!r}{on} is now held by {holder} (fence {self.fence}), not by the "
            "acquisition shown; left alone"
        )


#: Holder records longer than this (ours are a few hundred bytes) are not decoded: they are
#: foreign data, and would otherwise travel whole into errors, logs and task results.
MAX_RECORD = 65536
_RAW_HEAD = 200


@dataclass(frozen=True, slots=True)
class Health:
    """What a health probe (:meth:`~celery_redlock.core.backend.Probe.check`) found on one
    server: ``ok``; ``credentials`` (it refused the user name or password); ``loading``
    (it is loading its data set: transient); ``replica`` (a read-only replica: no lock can
    be taken there); ``unreachable`` (no answer, or an error: *detail* says which);
    ``unknown`` (a quorum's member with no probe of its own)."""

    #: The server, password-free (its backend's ``describe()``).
    where: str
    state: Literal["ok", "credentials", "loading", "replica", "unreachable", "unknown"]
    #: The error met, in words ("" when there was none).
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True when the server answered and can take locks."""
        return self.state == "ok"


def mutex_keys(slot: Slot) -> LockKeys:
    """The keys of *slot*, which must be a mutex: permits have no enqueue-time hold or
    done marks."""
    if slot.permits or not slot.keys.queued:
        raise ConfigError(f"lock {slot.name!r}: enqueue-time holds take a mutex, not permits")
    return slot.keys


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
