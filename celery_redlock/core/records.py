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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigError, QuorumUnavailable
from .fanout import FanOut, answered
from .lock import Lock
from .scripts import CLAIM_FIELD
from .send import Command, Plain
from .store import text
from .stores.redis import REDIS_ERRORS, is_foreign

__all__ = ["MIN_WAIT", "Claim", "LockRecords", "record_version"]

#: The shortest wait for a master's answer (Redlock), whatever the TTL: records are
#: read and written rarely (once per tick), so there is no need to cut it as fine
#: as an acquire does.
MIN_WAIT = 0.25


@dataclass(frozen=True)
class Claim:
    """What :meth:`LockRecords.claim` found."""

    #: ``"claimed"``: written on a majority within the lease: go ahead.
    #: ``"lost"``: the lock is gone, held by another acquisition on too many masters,
    #: or the lease ran out first: stop acting as the holder.
    #: ``"stale"``: a newer record of this acquisition is stored (see ``stored``).
    #: ``"unavailable"``: too few masters answered; nothing is known to be written.
    outcome: Literal["claimed", "lost", "stale", "unavailable"]
    #: The record written (claimed), or the newest stored one (stale), as JSON text.
    record: str = ""
    #: Why, for a log line (lost, unavailable): per master when there are several.
    detail: str = ""


def record_version(text: str) -> tuple[int, int]:
    """The ``(fence, n)`` of a stored record; ``(-1, -1)`` for one that cannot be read."""
    try:
        value = json.loads(text)
        return int(value["fence"]), int(value["n"])
    except (ValueError, TypeError, KeyError):
        return -1, -1


class LockRecords:
    """A hash of JSON records beside *lock*, written only by the lock's current holder.

    >>> records = LockRecords(lock, "ticks")   # key: <prefix>{<name>}:ticks
    >>> records.load()                         # {field: newest record (JSON text)}
    >>> records.claim("heartbeat", {"at": 1718000000.0}, n=42).outcome
    'claimed'

    *lock* is a :class:`Lock` (on one Redis or a quorum of masters); claims need it
    held by this process. *timeout* bounds the wait for each master of a quorum
    (default: the lock's per-node timeout, at least :data:`MIN_WAIT`); a single
    Redis answers within its client's socket timeout.
    """

    def __init__(self, lock: Lock, suffix: str = "records", *, timeout: float | None = None):
        if not isinstance(lock, Lock):
            raise ConfigError(f"LockRecords needs a Lock or a Redlock, got {type(lock).__name__}")
        if not isinstance(suffix, str) or not suffix:
            raise ConfigError(f"records suffix must be a non-empty string, got {suffix!r}")
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.lock = lock
        self.members = lock.store.members
        self.quorum = lock.store.quorum
        #: The Redis key of the hash (same hash tag as the lock).
        self.key = f"{lock.keys.lock}:{suffix}"
        default = max(MIN_WAIT, lock.store.timeout(lock.ttl_ms))
        self.timeout = default if timeout is None else float(timeout)
        self.addresses = [m.address for m in self.members]

    # -- reading ----------------------------------------------------------------------
    def load(self) -> dict[str, str]:
        """Every field's newest record (by ``(fence, n)``) on the masters that answer.

        Raises :class:`QuorumUnavailable` when fewer than a majority answer: records
        read from a minority could miss what the last holder claimed; :class:`ConfigError`
        when the key holds something that is not a hash (foreign data).
        """
        results = self._call_all(Plain("HGETALL", self.key), lambda _: False)
        foreign = [r for r in results if is_foreign(r)]
        if foreign:  # e.g. WRONGTYPE: not a Redis outage, and no retry will mend it
            raise ConfigError(
                f"{self.key!r} holds data that is not a hash of records ({foreign[0]}): "
                "something other than celery-redlock writes under the lock key prefix; "
                "delete that key if it is stale"
            )
        answers = [_as_dict(r) for r in results if answered(r)]
        if len(answers) < self.quorum:
            raise QuorumUnavailable(
                self.lock.name,
                self._errors(results),
                needed=self.quorum,
                total=len(self.members),
            )
        newest: dict[str, tuple[tuple[int, int], str]] = {}
        for answer in answers:
            for raw_field, raw_value in answer.items():
                name, value = text(raw_field), text(raw_value)
                version = record_version(value)
                if name not in newest or version > newest[name][0]:
                    newest[name] = (version, value)
        return {name: value for name, (_, value) in newest.items()}

    # -- writing ----------------------------------------------------------------------
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
        if time.monotonic() >= lock.valid_until:
            return Claim("lost", detail="the lease ran out before a confirmed renewal")
        value = json.dumps({**record, "fence": fence, "n": n}, separators=(",", ":"), default=str)
        command = CLAIM_FIELD([lock.keys.lock, self.key], [token, name, value, fence, n])

        def enough(results: Sequence[Any]) -> bool:
            return sum(1 for r in results if _code(r) == 1) >= self.quorum

        return self._verdict(value, self._call_all(command, enough, lock.valid_until))

    def _verdict(self, value: str, results: Sequence[Any]) -> Claim:
        """Reduce the per-master answers of a claim to one :class:`Claim`."""
        codes = [_code(r) for r in results]
        if codes.count(1) >= self.quorum:
            if time.monotonic() < self.lock.valid_until:
                return Claim("claimed", value)
            return Claim("lost", detail="the lease ran out before the claim was confirmed")
        if codes.count(0) > len(self.members) - self.quorum:
            return Claim("lost", detail="the lock is gone or held by another acquisition")
        stored = [text(r[1]) for r, c in zip(results, codes, strict=True) if c == -1]
        if stored:
            return Claim("stale", max(stored, key=record_version))
        return Claim("unavailable", detail=_describe(self._errors(results)))

    # -- fan-out ------------------------------------------------------------------------
    def _call_all(self, command: Command, enough: Any, deadline: float | None = None) -> list[Any]:
        """*command* on every master: its reply, or the error (Redis error, no answer).

        One master: called on this thread (its client's socket timeout applies).
        Several: at once, until *enough* says the outcome is decided, all answered,
        or the timeout (cut at *deadline*, a ``monotonic()`` time, when given).
        """
        if len(self.members) == 1:
            try:
                return [self.members[0].call(command)]
            except REDIS_ERRORS as exc:
                return [exc]
        timeout = self.timeout
        if deadline is not None:
            timeout = min(timeout, max(deadline - time.monotonic(), 0.0))
        fan = FanOut(self.members, command, timeout)
        results = fan.wait(lambda r: enough(r) or all(answered(v) for v in r))
        fan.finish()
        return results

    def _errors(self, results: Sequence[Any]) -> dict[str, str]:
        return {
            address: f"{type(r).__name__}: {r}"
            for address, r in zip(self.addresses, results, strict=True)
            if isinstance(r, BaseException)
        }

    def __repr__(self) -> str:
        return f"<LockRecords {self.key!r} on {len(self.members)} master(s)>"


def _as_dict(reply: Any) -> dict[Any, Any]:
    """An ``HGETALL`` reply as a dict (RESP2 sends a flat list of field, value)."""
    if isinstance(reply, dict):
        return reply
    items = list(reply or [])
    return dict(zip(items[::2], items[1::2], strict=True))


def _code(reply: Any) -> int | None:
    if isinstance(reply, (list, tuple)) and reply:
        return int(reply[0])
    return None


def _describe(errors: Mapping[str, str]) -> str:
    return "; ".join(f"{address}: {error}" for address, error in errors.items()) or "no answer"
