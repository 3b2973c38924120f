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

import concurrent.futures as cf
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import ResponseError

from . import _pool
from .base import BaseLock
from .errors import ConfigError, QuorumUnavailable
from .inspect import REDIS_ERRORS
from .lock import Lock, address_of, server_refused
from .redlock import Redlock
from .scripts import CLAIM_FIELD

__all__ = ["MIN_WAIT", "Claim", "LockRecords", "record_version"]

#: The shortest wait for a master's answer (Redlock), whatever the TTL: records are
#: read and written rarely (once per tick), so there is no need to cut it as fine
#: as an acquire does.
MIN_WAIT = 0.25


class _NoAnswer(Exception):
    """A master did not answer in time, or was not asked (an earlier call still runs)."""


_PENDING: Any = object()


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

    *lock* is a :class:`Lock` or a :class:`Redlock`; claims need it held by this
    process. *timeout* bounds the wait for each master under Redlock (default: the
    lock's ``per_node_timeout``, at least :data:`MIN_WAIT`); a single Redis answers
    within its client's socket timeout.
    """

    def __init__(self, lock: BaseLock, suffix: str = "records", *, timeout: float | None = None):
        if isinstance(lock, Redlock):
            self._clients: list[Any] = list(lock.clients)
            self.quorum = lock.quorum
            default = max(MIN_WAIT, lock.per_node_timeout)
        elif isinstance(lock, Lock):
            self._clients = [lock.client]
            self.quorum = 1
            default = MIN_WAIT
        else:
            raise ConfigError(f"LockRecords needs a Lock or a Redlock, got {type(lock).__name__}")
        if not isinstance(suffix, str) or not suffix:
            raise ConfigError(f"records suffix must be a non-empty string, got {suffix!r}")
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.lock = lock
        #: The Redis key of the hash (same hash tag as the lock).
        self.key = f"{lock.keys.lock}:{suffix}"
        self.timeout = default if timeout is None else float(timeout)
        self.addresses = [address_of(c) for c in self._clients]
        # Per master, the last call sent from the pool: a master still busy with it is
        # not sent another (one stuck pool thread per master at most, and the calls
        # to one master are never re-ordered).
        self._busy: dict[int, cf.Future[Any]] = {}

    # -- reading ----------------------------------------------------------------------
    def load(self) -> dict[str, str]:
        """Every field's newest record (by ``(fence, n)``) on the masters that answer.

        Raises :class:`QuorumUnavailable` when fewer than a majority answer: records
        read from a minority could miss what the last holder claimed; :class:`ConfigError`
        when the key holds something that is not a hash (foreign data).
        """

        def read(client: Any) -> Any:
            return client.hgetall(self.key)

        results = self._call_all(read, lambda _: False, time.monotonic() + self.timeout)
        answers = [r for r in results if isinstance(r, dict)]
        if len(answers) < self.quorum:
            foreign = [r for r in results if isinstance(r, ResponseError) and not server_refused(r)]
            if foreign:  # e.g. WRONGTYPE: not a Redis outage, and no retry will mend it
                raise ConfigError(
                    f"{self.key!r} holds data that is not a hash of records ({foreign[0]}): "
                    "something other than celery-redlock writes under the lock key prefix; "
                    "delete that key if it is stale"
                )
            raise QuorumUnavailable(
                self.lock.name,
                self._errors(results),
                needed=self.quorum,
                total=len(self._clients),
            )
        newest: dict[str, tuple[tuple[int, int], str]] = {}
        for answer in answers:
            for raw_field, raw_value in answer.items():
                name, text = _text(raw_field), _text(raw_value)
                version = record_version(text)
                if name not in newest or version > newest[name][0]:
                    newest[name] = (version, text)
        return {name: text for name, (_, text) in newest.items()}

    # -- writing ----------------------------------------------------------------------
    def claim(self, name: str, record: Mapping[str, Any], n: int) -> Claim:
        """Write *record* as field *name* if this process still holds the lock.

        ``fence`` (the lock's) and *n* (a number the caller increases per field, e.g.
        a run count) are added to the record: they are its version. Succeeds only
        when a majority of masters wrote it and their answers came back before the
        lease's local deadline. Never raises for Redis errors: see :class:`Claim`.
        """
        lock = self.lock
        fence = lock.fence
        token = lock._token  # core-internal: the current acquisition's token
        if fence is None or token is None or lock.lost:
            return Claim("lost", detail="this process does not hold the lock")
        if time.monotonic() >= lock.valid_until:
            return Claim("lost", detail="the lease ran out before a confirmed renewal")
        value = json.dumps({**record, "fence": fence, "n": n}, separators=(",", ":"), default=str)
        keys = [lock.keys.lock, self.key]
        args = [token, name, value, fence, n]

        def write(client: Any) -> Any:
            return CLAIM_FIELD(client, keys, args)

        def enough(results: Sequence[Any]) -> bool:
            return sum(1 for r in results if _code(r) == 1) >= self.quorum

        deadline = min(time.monotonic() + self.timeout, lock.valid_until)
        return self._verdict(value, self._call_all(write, enough, deadline))

    def _verdict(self, value: str, results: Sequence[Any]) -> Claim:
        """Reduce the per-master answers of a claim to one :class:`Claim`."""
        codes = [_code(r) for r in results]
        if codes.count(1) >= self.quorum:
            if time.monotonic() < self.lock.valid_until:
                return Claim("claimed", value)
            return Claim("lost", detail="the lease ran out before the claim was confirmed")
        if codes.count(0) > len(self._clients) - self.quorum:
            return Claim("lost", detail="the lock is gone or held by another acquisition")
        stored = [_text(r[1]) for r, c in zip(results, codes, strict=True) if c == -1]
        if stored:
            return Claim("stale", max(stored, key=record_version))
        return Claim("unavailable", detail=_describe(self._errors(results)))

    # -- fan-out ------------------------------------------------------------------------
    def _call_all(
        self,
        call: Callable[[Any], Any],
        enough: Callable[[Sequence[Any]], bool],
        deadline: float,
    ) -> list[Any]:
        """*call* on every master: its reply, or the exception (Redis error, no answer).

        One master: called on this thread. Several: in parallel on the shared I/O
        pool, until *enough* says the outcome is decided, all answered, or *deadline*.
        """
        if len(self._clients) == 1:
            try:
                return [call(self._clients[0])]
            except REDIS_ERRORS as exc:
                return [exc]
        results: list[Any] = [_PENDING] * len(self._clients)
        futures: dict[cf.Future[Any], int] = {}
        pool = _pool.executor()
        for i, client in enumerate(self._clients):
            previous = self._busy.get(i)
            if previous is not None and not previous.done():
                results[i] = _NoAnswer("not asked: an earlier call is still waiting for it")
                continue
            future = pool.submit(call, client)
            self._busy[i] = future
            futures[future] = i
        pending = set(futures)
        while pending and not enough(results):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done, pending = cf.wait(pending, timeout=left, return_when=cf.FIRST_COMPLETED)
            for future in done:
                results[futures[future]] = _outcome(future)
        for future in pending:
            if future.done():
                results[futures[future]] = _outcome(future)
            else:
                ms = max(0.0, self.timeout) * 1000
                results[futures[future]] = _NoAnswer(f"no answer within {ms:.0f} ms")
        return results

    def _errors(self, results: Sequence[Any]) -> dict[str, str]:
        return {
            address: f"{type(r).__name__}: {r}"
            for address, r in zip(self.addresses, results, strict=True)
            if isinstance(r, BaseException)
        }

    def __repr__(self) -> str:
        return f"<LockRecords {self.key!r} on {len(self._clients)} master(s)>"


def _outcome(future: cf.Future[Any]) -> Any:
    """The reply, or the Redis error; any other error is a bug and is raised."""
    try:
        return future.result()
    except REDIS_ERRORS as exc:
        return exc


def _code(reply: Any) -> int | None:
    if isinstance(reply, (list, tuple)) and reply:
        return int(reply[0])
    return None


def _describe(errors: Mapping[str, str]) -> str:
    return "; ".join(f"{address}: {error}" for address, error in errors.items()) or "no answer"


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
