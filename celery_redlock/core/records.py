"""Records kept next to a lock that only its current holder may write.

A :class:`LockRecords` is a Redis hash beside a lock (same hash tag, so one
cluster slot): ``<lock key>:<suffix>``, one JSON record per field. Beat's
``LeaderScheduler`` keeps when each schedule entry last ran there, and *claims*
each tick before publishing it, so a tick goes out at most once even across a
leadership hand-over. It works the same for a :class:`Lock` (one Redis) and a
:class:`Redlock` (N masters, where a claim needs a majority).

A claim is one script per master (``claim_field.lua``) that writes the field
only while the lock there holds the caller's *token*. The token, not the fence:
under Redlock each master keeps its own fence counter, so the per-master
``fence`` fields of one acquisition differ, while its token is the same
everywhere. Each record carries a version, ``(fence, n)``: the holder's fence
(for Redlock the fence chosen for the quorum, which strictly increases from one
holder to the next) and a sequence number the caller increases per field (beat:
the entry's run count). A master never replaces a record by an older one of the
same acquisition (a late or re-sent copy), and a reader that finds different
records on different masters takes the newest.

Why a new holder never repeats what the old one claimed (three masters)::

    t=10.0  A holds the lock on m0, m1, m2 (token ta, chosen fence 7).
            A claims tick n=42: m0 and m1 say written, m2 does not answer in time.
            Two of three is a majority, and the replies came back before A's lease
            (its local deadline) ran out, so A publishes tick 42.
    t=10.4  A is SIGKILLed (or paused) before its next renewal.
    t=12.4  A's keys expire. B acquires m1, m2 (token tb, fence 8, written back so
            the next holder's fence is higher still) and loads the records from every
            master that answers, at least a majority. Any majority shares a master
            with {m0, m1}, where tick 42 was written before B could hold that master
            (A's token was there), so B sees n=42 and goes on with the next tick.
    t=12.6  m2 finally runs A's late claim: the lock there holds tb, not ta, so
            nothing is written. A paused A that wakes up and claims tick 43 finds
            tb on m1 and m2: refused on a majority, it publishes nothing.

A claim whose majority arrives after the local deadline does not count (the
lock may have changed hands meanwhile): it is reported as lost. A claim is written
before the tick is published, so a holder that dies in between loses that one
tick: at most once, never twice. A record written on a minority only (a claim
that failed) may be what the next holder loads; it then skips that tick, which
was never published either.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from .backend import Records, need
from .backend_types import Claim, record_version
from .errors import ConfigError, StoreUnavailable
from .lock import Lock

__all__ = ["Claim", "LockRecords", "record_version"]


class LockRecords:
    """A hash of JSON records beside *lock*, written only by the lock's current holder.

    >>> records = LockRecords(lock, "ticks")   # key: <prefix>{<name>}:ticks
    >>> records.load()                         # {field: newest record (JSON text)}
    >>> records.claim("heartbeat", {"at": 1718000000.0}, n=42).outcome
    'claimed'

    *lock* is a :class:`Lock` (on one Redis, a quorum of masters, or memory); claims
    need it held by this process.
    """

    def __init__(self, lock: Lock, suffix: str = "records") -> None:
        if not isinstance(lock, Lock):
            raise ConfigError(f"LockRecords needs a Lock or a Redlock, got {type(lock).__name__}")
        if not isinstance(suffix, str) or not suffix:
            raise ConfigError(f"records suffix must be a non-empty string, got {suffix!r}")
        if "}" in suffix:  # <prefix>{a}:x} is the lock key of the name "a}:x"
            raise ConfigError(f"records suffix {suffix!r} must not contain '}}'")
        self.lock = lock
        self.backend: Records = need(lock.backend, Records)
        self.suffix = suffix
        #: The key of the hash (same hash tag as the lock).
        self.key = f"{lock.keys.lock}:{suffix}"

    def load(self) -> dict[str, str]:
        """Every field's newest record (by ``(fence, n)``) on the masters that answer.

        Raises :class:`StoreUnavailable` when fewer than a majority answer: records
        read from a minority could miss what the last holder claimed; :class:`ConfigError`
        when the key holds something that is not a hash (foreign data).
        """
        return self.backend.load_records(self.lock.slot, self.suffix)

    def claim(self, name: str, record: Mapping[str, Any], n: int) -> Claim:
        """Write *record* as field *name* if this process still holds the lock.

        ``fence`` (the lock's) and *n* (a number the caller increases per field, e.g.
        a run count) are added to the record: they are its version. Succeeds only
        when a majority of masters wrote it and their answers came back before the
        lease's local deadline. Never raises for Redis errors: see :class:`Claim`.
        """
        lock = self.lock
        fence, token = lock.fence, lock.token
        if fence is None or token is None or lock.lost:
            return Claim("lost", detail="this process does not hold the lock")
        deadline = lock.valid_until
        if time.monotonic() >= deadline:
            return Claim("lost", detail="the lease ran out before a confirmed renewal")
        value = json.dumps({**record, "fence": fence, "n": n}, separators=(",", ":"), default=str)
        try:
            found = self.backend.claim(
                lock.slot, self.suffix, token, name, value, (fence, n), deadline
            )
        except StoreUnavailable as exc:
            return Claim("unavailable", detail=str(exc))
        if found.outcome == "claimed" and time.monotonic() >= deadline:
            return Claim("lost", detail="the lease ran out before the claim was confirmed")
        return found

    def __repr__(self) -> str:
        return f"<LockRecords {self.key!r} on {self.lock.backend.describe()}>"
