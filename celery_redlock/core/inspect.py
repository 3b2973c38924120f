"""Read and remove locks from the outside: what ``celery locks`` needs from Redis.

Each function works on one client: a plain Redis, a Sentinel master client, or a
``RedisCluster`` (then every primary is scanned, and one lock's keys are read on
the node that owns their slot). For Redlock, call it once per master.

Locks are found with ``SCAN ... MATCH <prefix>{<pattern>}* TYPE hash``, never
``KEYS``: each lock hash (state ``running`` for a task's run, else ``held``) and each
enqueue-time hold ``<lock key>:queued`` (state ``queued``); the ``:fence``,
``:notify`` and ``:waiting`` keys next to each lock, and hashes that are none of these
(no ``token`` or ``owner`` field), are skipped. A semaphore's permits
(``<prefix>{<name>}:permits``, one :class:`LockInfo` per live permit) and a rate
limiter's state (``<prefix>{<name>}:rate``, a :class:`RateInfo`) are found the same way.

Errors are not translated: a node that cannot be reached raises one of
:data:`REDIS_ERRORS`, so a caller that asks several masters can report each one
and go on with the others.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from redis.cluster import RedisCluster
from redis.exceptions import RedisError

from .errors import ConfigError
from .keys import lock_keys, permit_keys, rate_key
from .scripts import DEQUEUE, FORCE_RELEASE, PERMITS, Status
from .store import parse_holder, text
from .stores.redis import REDIS_ERRORS, RedisStore, permits_of

__all__ = [
    "REDIS_ERRORS",
    "ForceRelease",
    "LockInfo",
    "RateInfo",
    "force_dequeue",
    "force_release",
    "read_limiter",
    "read_lock",
    "read_permits",
    "read_queued",
    "scan_limiters",
    "scan_locks",
    "scan_permits",
]

#: Keys asked for per SCAN round trip, and lock hashes read per pipeline.
SCAN_COUNT = 500
READ_BATCH = 200

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


@dataclass(frozen=True)
class LockInfo:
    """One held lock as one node stores it."""

    #: The rendered lock name (``sync:42``), not the key.
    name: str
    #: The Redis key of the lock hash (``redlock:{sync:42}``).
    key: str
    #: The fencing token of the acquisition on this node (None if unreadable).
    fence: int | None
    #: Lease left in milliseconds (``PTTL``: -1 no expiry, -2 gone since it was found).
    ttl_ms: int
    #: The holder's record: ``hostname``, ``pid``, ``acquired_at`` and its ``owner_info``
    #: (``task_name``, ``task_id``, ``role``, ...).
    record: dict[str, Any] = field(default_factory=dict)
    #: ``"lock"``, or ``"permit"``: one permit of a semaphore (``key`` is its permits hash).
    kind: str = "lock"
    #: ``"running"`` (a task's run holds the lock), ``"held"`` (another holder: a
    #: ``Lock`` of user code, beat's leader), or ``"queued"`` (the enqueue-time hold of
    #: a message not started yet, ``key`` is then ``<lock key>:queued``).
    state: Literal["running", "held", "queued"] = "held"

    @property
    def acquired_at(self) -> float | None:
        """Wall-clock time of the acquisition, as the holder recorded it."""
        value = self.record.get("acquired_at")
        return float(value) if isinstance(value, (int, float)) else None


@dataclass(frozen=True)
class RateInfo:
    """A rate limiter's state as one node stores it (``rate.lua``)."""

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
    #: Lifetime left of the state (``PTTL``): when the limiter is idle again.
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
    """What :func:`force_release` did."""

    #: ``"released"``: removed; ``"gone"``: nobody held it; ``"refused"``: another
    #: acquisition than the confirmed fence holds it, left alone.
    outcome: Literal["released", "gone", "refused"]
    #: The record of the acquisition removed (released) or left alone (refused).
    record: dict[str, Any] = field(default_factory=dict)
    #: Its fence (None when gone).
    fence: int | None = None


def primaries(client: Any) -> list[Any]:
    """Plain clients to scan: the client itself, or one per primary of a cluster."""
    if isinstance(client, RedisCluster):
        return [
            client.get_redis_connection(node)
            for node in client.get_primaries()  # type: ignore[no-untyped-call]
        ]
    return [client]


def scan_locks(client: Any, prefix: str, pattern: str = "*") -> list[LockInfo]:
    """Every lock held on *client* whose name matches the glob *pattern*, sorted by name.

    *prefix* is the key prefix (``redlock_key_prefix``); *pattern* matches the
    rendered name (``sync:*``), with ``*``, ``?`` and ``[abc]``.
    """
    match = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "{" + pattern + "}*"
    found: list[LockInfo] = []
    for node in primaries(client):
        keys = {text(k) for k in _scan(node, match)}
        keys = {k for k in keys if k.startswith(prefix + "{")}
        found += _read(node, sorted(k for k in keys if k.endswith("}")), prefix)
        found += _read_queued(node, sorted(k for k in keys if k.endswith(QUEUED_SUFFIX)), prefix)
    return sorted(found, key=lambda info: (info.name, info.state == "queued"))


def scan_permits(client: Any, prefix: str, pattern: str = "*") -> list[LockInfo]:
    """Every live permit of the semaphores on *client* whose name matches *pattern*
    (one :class:`LockInfo` each, ``kind="permit"``), sorted by name, first to expire first."""
    match = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "{" + pattern + "}:permits"
    found: list[LockInfo] = []
    for node in primaries(client):
        for key in sorted({text(k) for k in _scan(node, match)}):
            if key.startswith(prefix + "{") and key.endswith("}:permits"):
                found += _permits(node, key, key[len(prefix) + 1 : -len("}:permits")])
    return sorted(found, key=lambda info: info.name)


def read_permits(client: Any, prefix: str, name: str) -> list[LockInfo]:
    """The live permits of semaphore *name* on *client*, first to expire first."""
    key = permit_keys(name, prefix).lock
    return _permits(_node_of(client, key), key, name)


def scan_limiters(client: Any, prefix: str, pattern: str = "*") -> list[RateInfo]:
    """The state of every rate limiter on *client* whose name matches *pattern*."""
    match = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "{" + pattern + "}:rate"
    found: list[RateInfo] = []
    for node in primaries(client):
        for key in sorted({text(k) for k in _scan(node, match)}):
            if key.startswith(prefix + "{") and key.endswith("}:rate"):
                info = _limiter(node, key, key[len(prefix) + 1 : -len("}:rate")])
                if info is not None:
                    found.append(info)
    return sorted(found, key=lambda info: info.name)


def read_limiter(client: Any, prefix: str, name: str) -> RateInfo | None:
    """The state of rate limiter *name* on *client*, or None when it is idle (no state)."""
    key = rate_key(name, prefix)
    return _limiter(_node_of(client, key), key, name)


def _node_of(client: Any, key: str) -> Any:
    if isinstance(client, RedisCluster):
        return client.get_redis_connection(
            client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        )
    return client


def _permits(node: Any, key: str, name: str) -> list[LockInfo]:
    try:
        reply = RedisStore.of(node).call(PERMITS([key], []))
    except RedisError as exc:
        if "WRONGTYPE" in str(exc):
            return []  # not a permits hash: foreign data, left alone
        raise
    return [
        LockInfo(
            name,
            key,
            p.fence,
            p.ttl_ms,
            dict(p.record),
            kind="permit",
            state="running" if p.record.get("task_name") else "held",
        )
        for p in permits_of(reply)
    ]


def _limiter(node: Any, key: str, name: str) -> RateInfo | None:
    pipe = node.pipeline(transaction=False)
    pipe.hmget(key, "tat", "line", "interval", "burst")
    pipe.pttl(key)
    pipe.time()
    fields, pttl, (seconds, micros) = pipe.execute(raise_on_error=False)
    if isinstance(fields, Exception) or not isinstance(fields, list):
        return None  # not a limiter's hash: foreign data, left alone
    tat, line, interval, burst = (_int(v) for v in fields)
    if not interval or not burst:
        return None
    now = int(seconds) * 1_000_000 + int(micros)
    next_at = max(tat or 0, now) - (burst - 1) * interval
    free = (now - next_at) // interval + 1 if next_at <= now else 0
    # Promised slots still due lie between the next possible grant and the line.
    start = max(now, next_at)
    queued = math.ceil(((line or 0) - start) / interval) if (line or 0) > start else 0
    return RateInfo(
        name=name,
        key=key,
        interval_us=interval,
        burst=burst,
        free=int(free),
        next_ms=max(0, next_at - now) // 1000,
        queued=queued,
        ttl_ms=int(pttl) if isinstance(pttl, int) else -2,
    )


def read_lock(client: Any, prefix: str, name: str) -> LockInfo | None:
    """Lock *name* (the rendered name) as *client* stores it, or None when not held.

    Raises :class:`~celery_redlock.core.errors.ConfigError` for a name or prefix no
    lock can have, and when the key holds something that is not a lock (foreign data).
    """
    key = lock_keys(name, prefix).lock
    if isinstance(client, RedisCluster):
        client = client.get_redis_connection(
            client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        )
    found = _read(client, [key], prefix)
    if found:
        return found[0]
    kind = text(client.type(key))
    if kind != "none":  # something is there, but not a lock celery-redlock wrote
        what = "a hash without a lock token" if kind == "hash" else f"a {kind}"
        raise ConfigError(
            f"{key!r} holds {what}, not a celery-redlock lock: something else writes under "
            f"the key prefix {prefix!r}; celery-redlock leaves it alone (delete it with "
            "redis-cli if it is stale)"
        )
    return None


def read_queued(client: Any, prefix: str, name: str) -> LockInfo | None:
    """The enqueue-time hold of lock *name* on *client* (state ``queued``), or None."""
    key = lock_keys(name, prefix).queued
    if isinstance(client, RedisCluster):
        client = client.get_redis_connection(
            client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        )
    found = _read_queued(client, [key], prefix)
    return found[0] if found else None


def force_dequeue(client: Any, prefix: str, name: str, task_id: str | None = None) -> ForceRelease:
    """Remove the enqueue-time hold of lock *name* on *client*: the one of *task_id* only
    (``"refused"`` when another task id holds it now), or whoever's with None.

    The message itself stays queued; when it starts, it takes the lock as usual.
    """
    found = read_queued(client, prefix, name)
    if found is None:
        return ForceRelease("gone")
    owner = str(found.record.get("task_id") or "")
    if task_id is not None and owner != task_id:
        return ForceRelease("refused", found.record)
    code = Status.of(RedisStore.of(client).call(DEQUEUE([found.key], [owner])))
    if code is Status.OK:
        return ForceRelease("released", found.record)
    return ForceRelease("gone" if code is Status.GONE else "refused", found.record)


def force_release(
    client: Any,
    prefix: str,
    name: str,
    fence: int | str | None = None,
    *,
    notice_ttl: float = 30.0,
) -> ForceRelease:
    """Remove lock *name* on *client* whoever holds it, and wake one waiter.

    With *fence*, only the acquisition with that fence is removed (the one an
    operator confirmed); another one is left alone (``"refused"``). The wake-up
    notice lives *notice_ttl* seconds if no waiter takes it. The holder is not
    told: its next renewal finds the lock gone.
    """
    keys = lock_keys(name, prefix)
    notice_ms = max(1, round(notice_ttl * 1000))
    expected = "" if fence is None else str(fence)
    reply = RedisStore.of(client).call(
        FORCE_RELEASE([keys.lock, keys.notify], [notice_ms, expected])
    )
    code = int(reply[0])
    if code == 0:
        return ForceRelease("gone")
    outcome: Literal["released", "refused"] = "released" if code == 1 else "refused"
    return ForceRelease(outcome, parse_holder(reply[1]), _int(reply[2]))


def _scan(node: Any, match: str) -> Iterator[Any]:
    try:
        yield from node.scan_iter(match=match, count=SCAN_COUNT, _type="hash")
    except RedisError as exc:
        if "syntax" not in str(exc).lower():  # Redis < 6 has no SCAN ... TYPE
            raise
        yield from node.scan_iter(match=match, count=SCAN_COUNT)


def _read(node: Any, keys: Sequence[str], prefix: str) -> list[LockInfo]:
    """Read the lock hashes *keys* on one plain node, pipelined; skip what is no lock."""
    found: list[LockInfo] = []
    for start in range(0, len(keys), READ_BATCH):
        chunk = keys[start : start + READ_BATCH]
        pipe = node.pipeline(transaction=False)
        for key in chunk:
            pipe.hmget(key, "token", "fence", "info")
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)
        for i, key in enumerate(chunk):
            fields, pttl = replies[2 * i], replies[2 * i + 1]
            if isinstance(fields, Exception) or not isinstance(fields, list) or not fields[0]:
                continue  # not a lock hash, or it went away between SCAN and read
            record = parse_holder(fields[2])
            found.append(
                LockInfo(
                    name=key[len(prefix) + 1 : -1],
                    key=key,
                    fence=_int(fields[1]),
                    ttl_ms=int(pttl) if isinstance(pttl, int) else -2,
                    record=record,
                    state="running" if record.get("task_name") else "held",
                )
            )
    return found


#: The end of an enqueue-time hold's key: ``<prefix>{<name>}:queued``.
QUEUED_SUFFIX = "}:queued"


def _read_queued(node: Any, keys: Sequence[str], prefix: str) -> list[LockInfo]:
    """Read the enqueue-time holds *keys* on one plain node (skip what is none)."""
    found: list[LockInfo] = []
    for start in range(0, len(keys), READ_BATCH):
        chunk = keys[start : start + READ_BATCH]
        pipe = node.pipeline(transaction=False)
        for key in chunk:
            pipe.hmget(key, "owner", "info")
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)
        for i, key in enumerate(chunk):
            fields, pttl = replies[2 * i], replies[2 * i + 1]
            if isinstance(fields, Exception) or not isinstance(fields, list) or not fields[0]:
                continue
            record = parse_holder(fields[1])
            record.setdefault("task_id", text(fields[0]))
            found.append(
                LockInfo(
                    name=key[len(prefix) + 1 : -len(QUEUED_SUFFIX)],
                    key=key,
                    fence=None,
                    ttl_ms=int(pttl) if isinstance(pttl, int) else -2,
                    record=record,
                    state="queued",
                )
            )
    return found


def _int(value: Any) -> int | None:
    digits = text(value)
    return int(digits) if digits.isascii() and digits.isdigit() else None  # not "²"
