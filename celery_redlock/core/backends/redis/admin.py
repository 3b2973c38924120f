"""The operator reads of :class:`~.backend.RedisBackend` (``celery locks``): what is
held on one Redis, found with ``SCAN``, never ``KEYS``.

Each function works on one client: a plain Redis, a Sentinel master client, or a
``RedisCluster`` (then every primary is scanned, and one name's keys are read on the node
that owns their slot). Locks are found with ``SCAN ... MATCH <prefix>{<pattern>}* TYPE
hash`` (and ``<prefix>{\\\\<pattern>}*`` for names starting with ``}`` or ``\\``, whose
tag has a backslash in front): each lock hash (state ``running`` for a task's run, else
``held``), each enqueue-time hold ``<lock key>:queued`` (state ``queued``) and each
semaphore's permits ``<lock key>:permits`` (one
:class:`~celery_redlock.core.backend.LockInfo` per live permit); a rate limiter's state
``<lock key>:rate`` the same way. Hashes that are none of these (no ``token`` or
``owner`` field, foreign data) are skipped.

Where the scripts keep an index of what is held (``lua/index.lua``: a plain Redis or a
Sentinel master), :func:`listing` answers a page from it: counts with ``ZLEXCOUNT``, the
page's keys with ``ZRANGEBYLEX``, then only those keys are read, so what a page costs
grows with the page, not with the keyspace. A Redis Cluster has no index (a script
reaches one hash slot only): there the listing walks every primary with ``SCAN``.

Also here: :func:`foreign_data_message`, the reads that explain why Redis refused a lock
script (which key holds what), and :func:`fence_of`.

Errors are raised as redis-py raises them; the backend's verbs report them (see
:func:`~.client.cannot_decide`).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from ...backend_types import (
    Control,
    Holder,
    LockInfo,
    RateInfo,
    Slot,
    lock_state,
    parse_holder,
    text,
)
from ...errors import ConfigError
from ...keys import LockKeys, lock_keys, name_of_key, normalize_name, rate_key
from ...listing import Entry, Listing, ListQuery, count, literal_head, matches_record, page
from .scripts import INDEX_PRUNE, run

#: Reads the permits of a slot on one plain node (the Redis backend's ``holders`` verb on
#: that node's client: passed in, since that backend uses this module).
Permits = Callable[[Any, Slot], list[Holder]]
#: Reads the controls at a control key (the Redis backend's, passed in as *permits* is).
Controls = Callable[[str, str], list[Control]]

__all__ = [
    "controls_under",
    "fence_of",
    "foreign_data_message",
    "index_keys",
    "listing",
    "node_of",
    "primaries",
    "read",
    "read_rate",
    "scan",
    "scan_rates",
]

#: Keys asked for per SCAN round trip, and hashes read per pipeline.
SCAN_COUNT = 500
READ_BATCH = 200
#: The sets of the index (index.lua), each with the entry its keys are: kind, state.
INDEX_SETS = {
    "held": ("mutex", "held"),
    "running": ("mutex", "running"),
    "parked": ("mutex", "queued"),
    "permits": ("semaphore", ""),
    "queued": ("queued", "queued"),
    "rate": ("rate", ""),
    "control": ("control", ""),
}
#: Expired members dropped per index_prune.lua call.
PRUNE_BATCH = 1000

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_QUEUED, _PERMITS, _RATE = "}:queued", "}:permits", "}:rate"
#: How a glob may start that matches a name starting with "}" or "\\" (whose tag has a
#: backslash in front: :func:`~..keys.lock_keys`).
_MAY_ESCAPE = ("}", "\\", "*", "?", "[")
#: The order of one name's rows: its lock, its permits, then its queued hold.
_RANK = {"lock": 0, "permit": 1}


def scan(
    client: Any, prefix: str, pattern: str, permits: Permits, limit: int | None = None
) -> list[LockInfo]:
    """Every held lock, live permit and queued hold whose name matches the glob *pattern*
    (``sync:*``: ``*``, ``?`` and ``[abc]``), sorted by name; one name's permits first
    to expire first. With *limit*, only the first *limit* names are read (a page)."""
    found: list[LockInfo] = []
    for node in primaries(client):
        keys = _named(node, prefix, pattern, "*")
        if limit is not None:
            name_of = {k: name_of_key(k, prefix) for k in keys}
            first = set(sorted(set(name_of.values()))[:limit])
            keys = [k for k in keys if name_of[k] in first]
        found += _locks(node, [k for k in keys if k.endswith("}")], prefix)
        found += _queued(node, [k for k in keys if k.endswith(_QUEUED)], prefix)
        for key in (k for k in keys if k.endswith(_PERMITS)):
            found += _permits(permits, node, key, name_of_key(key, prefix))
    found.sort(key=lambda i: (i.name, 2 if i.state == "queued" else _RANK[i.kind]))
    if limit is not None:  # a cluster's nodes each gave their first names
        names = sorted({i.name for i in found})[:limit]
        found = [i for i in found if i.name <= names[-1]] if names else []
    return found


def read(client: Any, prefix: str, name: str, permits: Permits) -> list[LockInfo]:
    """Lock *name*'s holder, queued hold and live permits (empty when none).

    Raises :class:`~celery_redlock.core.errors.ConfigError` for a name or prefix no lock
    can have, and when the lock key holds something that is not a lock (foreign data).
    """
    keys = lock_keys(name, prefix)
    node = node_of(client, keys.lock)
    # One MULTI: the hash, its lease and the key's type as of one instant, so a lock taken
    # or released between two reads (a quorum's late master) is never read as foreign data.
    pipe = node.pipeline(transaction=True)
    pipe.hmget(keys.lock, "token", "fence", "info")
    pipe.pttl(keys.lock)
    pipe.type(keys.lock)
    fields, ttl, kind = pipe.execute(raise_on_error=False)
    found = []
    if isinstance(fields, list) and fields[0]:
        found.append(_lock_info(keys.lock, fields, ttl if isinstance(ttl, int) else -2, prefix))
    else:
        kind = text(kind)
        if kind != "none":  # something is there, but not a lock celery-redlock wrote
            what = "a hash without a lock token" if kind == "hash" else f"a {kind}"
            raise ConfigError(
                f"{keys.lock!r} holds {what}, not a celery-redlock lock: something else "
                f"writes under the key prefix {prefix!r}; celery-redlock leaves it alone "
                "(delete it with redis-cli if it is stale)"
            )
    found += _queued(node, [keys.queued], prefix)
    return found + _permits(permits, node, f"{keys.lock}:permits", keys.name)


def scan_rates(client: Any, prefix: str, pattern: str = "*") -> list[RateInfo]:
    """The state of every rate limiter whose name matches *pattern*, sorted by name."""
    found: list[RateInfo] = []
    for node in primaries(client):
        for key in _named(node, prefix, pattern, ":rate"):
            if key.endswith(_RATE):
                info = _limiter(node, key, name_of_key(key, prefix))
                if info is not None:
                    found.append(info)
    return sorted(found, key=lambda info: info.name)


def read_rate(client: Any, prefix: str, name: str) -> RateInfo | None:
    """The state of rate limiter *name*, or None when it is idle (no state)."""
    key = rate_key(name, prefix)
    return _limiter(node_of(client, key), key, normalize_name(name))


def primaries(client: Any) -> list[Any]:
    """Plain clients to scan: the client itself, or one per primary of a cluster."""
    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(n) for n in client.get_primaries()]  # type: ignore[no-untyped-call]
    return [client]


def node_of(client: Any, key: str) -> Any:
    """A plain client of the node that serves *key*: the client itself, or a cluster's
    node of the key's slot."""
    if isinstance(client, RedisCluster):
        return client.get_redis_connection(client.get_node_from_key(key))  # type: ignore[no-untyped-call]
    return client


def _named(node: Any, prefix: str, pattern: str, tail: str) -> list[str]:
    """The keys ``<prefix>{<tag>}<tail>`` (*tail* a glob) on one plain node whose name
    matches *pattern*, sorted. A name starting with "}" or "\\" has a backslash in front
    in its tag: such names are looked for with that backslash, other names without."""
    head = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "{"
    found = {text(k) for k in _scan(node, head + pattern + "}" + tail)}
    found = {k for k in found if k.startswith(prefix + "{")}
    if pattern != "*":  # "*" matches every name, and so every tag, escaped or not
        found = {k for k in found if not _escaped(k, prefix)}
        if pattern.startswith(_MAY_ESCAPE):
            escaped = {text(k) for k in _scan(node, head + "\\\\" + pattern + "}" + tail)}
            found |= {k for k in escaped if k.startswith(prefix + "{") and _escaped(k, prefix)}
    return sorted(found)


def _escaped(key: str, prefix: str) -> bool:
    """True when the tag of *key* is a name with a backslash in front."""
    return key[len(prefix) + 1 : key.rindex("}")] != name_of_key(key, prefix)


def _scan(node: Any, match: str) -> Iterator[Any]:
    try:
        yield from node.scan_iter(match=match, count=SCAN_COUNT, _type="hash")
    except ResponseError as exc:
        if "syntax" not in str(exc).lower():  # Redis < 6 has no SCAN ... TYPE
            raise
        yield from node.scan_iter(match=match, count=SCAN_COUNT)


def foreign_data_message(client: Any, keys: LockKeys, exc: BaseException) -> str:
    """Say which of a lock's keys holds data celery-redlock did not write, and what to do.

    Called after Redis refused a lock command on the data (``WRONGTYPE``, a counter that
    is not an integer): looks at the keys (a few reads, on this error path only).
    """
    detail = ""
    prefix = keys.lock[: keys.lock.index("{")]
    try:
        kind = text(client.type(keys.lock))
        queued = text(client.type(keys.queued)) if keys.queued else "none"
        fence_kind = text(client.type(keys.fence))
        value = text(client.get(keys.fence)) if fence_kind == "string" else None
    except Exception:  # the refusal itself is reported below
        kind = queued = fence_kind = "none"
        value = None
    if kind not in ("hash", "none"):
        detail = f"{keys.lock!r} holds a {kind}, not a lock hash"
    elif queued not in ("hash", "none"):
        detail = f"its queued hold {keys.queued!r} holds a {queued}, not a hash"
    elif fence_kind not in ("string", "none"):
        detail = f"its fence counter {keys.fence!r} holds a {fence_kind}, not an integer"
    elif value is not None and not _is_int64(value):
        detail = f"its fence counter {keys.fence!r} holds {value[:40]!r}, not an integer"
    elif value is not None and int(value) >= 2**63 - 1:
        detail = f"its fence counter {keys.fence!r} is at the largest integer Redis keeps"
    if not detail:
        return f"lock {keys.name!r}: Redis refused the lock script on {keys.lock!r} ({exc})"
    return (
        f"lock {keys.name!r}: {detail}. Something other than celery-redlock writes under the "
        f"key prefix {prefix!r}: delete that key if it is stale, or give celery-redlock a "
        "prefix of its own (key_prefix=, or the redlock_key_prefix setting)"
    )


def _is_int64(value: str) -> bool:
    try:
        return -(2**63) <= int(value) < 2**63 and value.strip() == value
    except ValueError:
        return False


def _permits(permits: Permits, node: Any, key: str, name: str) -> list[LockInfo]:
    """The live permits at *key* on one plain node, first to expire first."""
    slot = Slot(LockKeys(name=name, lock=key, fence="", notify="", waiting=""), limit=2)
    try:
        holders = permits(node, slot)
    except ConfigError:
        return []  # not a permits hash: foreign data, left alone
    return [
        LockInfo(
            name,
            key,
            h.fence,
            -2 if h.ttl_ms is None else h.ttl_ms,
            dict(h.record),
            kind="permit",
            state=lock_state(h.record),
        )
        for h in holders
    ]


def _hashes(node: Any, keys: Sequence[str], *fields: str) -> Iterator[tuple[str, list[Any], int]]:
    """(key, fields, lease left) of each of *keys* that is a hash with its first field
    set, pipelined on one plain node (what is no such hash, or went away, is skipped)."""
    for start in range(0, len(keys), READ_BATCH):
        chunk = keys[start : start + READ_BATCH]
        pipe = node.pipeline(transaction=False)
        for key in chunk:
            pipe.hmget(key, *fields)
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)
        for i, key in enumerate(chunk):
            values, pttl = replies[2 * i], replies[2 * i + 1]
            if isinstance(values, list) and values[0]:
                yield key, values, pttl if isinstance(pttl, int) else -2


def _locks(node: Any, keys: Sequence[str], prefix: str) -> list[LockInfo]:
    return [
        _lock_info(key, fields, ttl, prefix)
        for key, fields, ttl in _hashes(node, keys, "token", "fence", "info")
    ]


def _lock_info(key: str, fields: list[Any], ttl: int, prefix: str) -> LockInfo:
    """The lock at *key* from its hash's token, fence and info fields and its lease left."""
    _, fence, info = fields
    record = parse_holder(info)
    name = name_of_key(key, prefix)
    return LockInfo(name, key, fence_of(fence), ttl, record, state=lock_state(record))


def _queued(node: Any, keys: Sequence[str], prefix: str) -> list[LockInfo]:
    found: list[LockInfo] = []
    for key, (owner, info), ttl in _hashes(node, keys, "owner", "info"):
        record = parse_holder(info)
        record.setdefault("task_id", text(owner))
        name = name_of_key(key, prefix)
        found.append(LockInfo(name, key, None, ttl, record, state="queued"))
    return found


def _limiter(node: Any, key: str, name: str) -> RateInfo | None:
    pipe = node.pipeline(transaction=False)
    pipe.hmget(key, "tat", "line", "interval", "burst")
    pipe.pttl(key)
    pipe.time()
    fields, pttl, (seconds, micros) = pipe.execute(raise_on_error=False)
    if not isinstance(fields, list):
        return None  # not a limiter's hash: foreign data, left alone
    tat, line, interval, burst = (fence_of(v) for v in fields)
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


def fence_of(value: Any) -> int | None:
    """A stored fence (or another counter) as an int; None when it is not one."""
    digits = text(value)
    return int(digits) if digits.isascii() and digits.isdigit() else None  # not "²"


# -- the index ----------------------------------------------------------------------------
def index_keys(prefix: str) -> list[str]:
    """The keys of the index of *prefix*: each of :data:`INDEX_SETS`, then the expiry
    sets of what holders release and of what expires by itself (index.lua)."""
    sets = [f"{prefix}index:{s}" for s in INDEX_SETS]
    return [*sets, f"{prefix}index:expiry", f"{prefix}index:timed"]


def prune(client: Any, prefix: str) -> None:
    """Drop from the index of *prefix* the keys whose expiry has passed (index_prune.lua,
    on each expiry set with the sets of its members)."""
    *sets, released, timed = index_keys(prefix)
    for keys in ([released, *sets[:4]], [timed, *sets[4:]]):
        while int(run(INDEX_PRUNE, client, None, keys, [PRUNE_BATCH])) >= PRUNE_BATCH:
            pass


def listing(
    client: Any, prefix: str, query: ListQuery, permits: Permits, controls: Controls
) -> Listing:
    """*query*'s page from the index of *prefix* on one plain Redis: expired members
    dropped first (index_prune.lua), then counts and the page's keys from the index, and
    only those keys read. A glob that is not a prefix, and the task id and worker filters,
    read the names (and the records) of every key under the glob's literal head."""
    prune(client, prefix)
    head, is_prefix = literal_head(query.pattern)
    low, high = _lex_range(prefix, head)
    sets = dict(zip(INDEX_SETS, index_keys(prefix), strict=False))
    if is_prefix and not query.needs_records:
        shown, total, counts = _from_counts(client, sets, (low, high), query, prefix)
    else:
        shown, total, counts = _from_names(client, sets, (low, high), query, prefix)
    out = Listing(entries=shown, total=total, counts=counts)
    by_kind: dict[str, list[str]] = {}
    for entry in shown:
        by_kind.setdefault(entry.kind, []).append(entry.key)
    out.locks += _locks(client, by_kind.get("mutex", []), prefix)
    out.locks += _queued(client, by_kind.get("queued", []), prefix)
    for key in by_kind.get("semaphore", []):
        out.locks += _permits(permits, client, key, name_of_key(key, prefix))
    for key in by_kind.get("rate", []):
        info = _limiter(client, key, name_of_key(key, prefix))
        out.rates += [] if info is None else [info]
    for key in by_kind.get("control", []):
        out.controls += controls(key, prefix)
    order = {entry.key: i for i, entry in enumerate(shown)}
    out.locks.sort(key=lambda i: (order.get(i.key, 0), i.ttl_ms))
    return out


def controls_under(client: Any, prefix: str, pattern: str) -> list[str]:
    """The control keys in the index of *prefix* whose name matches the glob *pattern*."""
    low, high = _lex_range(prefix, literal_head(pattern)[0])
    members = client.zrangebylex(f"{prefix}index:control", low, high)
    keys = [text(m) for m in members]
    return [k for k in keys if fnmatch.fnmatchcase(name_of_key(k, prefix), pattern)]


def _lex_range(prefix: str, head: str) -> tuple[bytes, bytes]:
    """The ``ZRANGEBYLEX`` bounds of the keys of names starting with *head*."""
    if not head:
        return b"-", b"+"
    tag = "\\" + head if head.startswith(("}", "\\")) else head
    low = f"{prefix}{{{tag}".encode("utf-8", "surrogatepass")
    return b"[" + low, b"(" + low + b"\xff"


def _entries(found: dict[str, list[Any]], prefix: str) -> list[Entry]:
    out = []
    for set_name, members in found.items():
        kind, state = INDEX_SETS[set_name]
        for member in members:
            key = text(member)
            out.append(Entry(key, name_of_key(key, prefix), kind, state))
    return out


def _from_counts(
    client: Any, sets: dict[str, str], bounds: tuple[bytes, bytes], query: ListQuery, prefix: str
) -> tuple[list[Entry], int, dict[str, int]]:
    """A page of a name prefix: counts by ZLEXCOUNT, the page by ZRANGEBYLEX (each chosen
    set's first offset + limit keys, merged)."""
    low, high = bounds
    pipe = client.pipeline(transaction=False)
    for key in sets.values():
        pipe.zlexcount(key, low, high)
    sizes = dict(zip(sets, (int(n) for n in pipe.execute()), strict=True))
    counts = dict.fromkeys(("mutex", "mutex:held", "mutex:running", "mutex:queued"), 0)
    total = 0
    for set_name, size in sizes.items():
        kind, state = INDEX_SETS[set_name]
        counts[kind] = counts.get(kind, 0) + size
        if kind == "mutex":
            counts[f"mutex:{state}"] += size
        if query.wants(kind, state):
            total += size
    chosen = [s for s in sets if sizes[s] and query.wants(*INDEX_SETS[s])]
    # One set: its page itself. Several: each one's first offset + limit, merged.
    start, num = (
        (query.offset, query.limit) if len(chosen) == 1 else (0, query.offset + query.limit)
    )
    pipe = client.pipeline(transaction=False)
    for set_name in chosen:
        if query.sort == "-name":
            pipe.zrevrangebylex(sets[set_name], high, low, start=start, num=num)
        else:
            pipe.zrangebylex(sets[set_name], low, high, start=start, num=num)
    found = dict(zip(chosen, pipe.execute(), strict=True))
    entries = _entries(found, prefix)
    if len(chosen) == 1:
        return entries, total, counts
    return page(entries, query), total, counts


def _from_names(
    client: Any, sets: dict[str, str], bounds: tuple[bytes, bytes], query: ListQuery, prefix: str
) -> tuple[list[Entry], int, dict[str, int]]:
    """A page of a glob, or of the task id and worker filters: every key under the glob's
    literal head, matched here (and their holders' records read, for those filters)."""
    low, high = bounds
    pipe = client.pipeline(transaction=False)
    for key in sets.values():
        pipe.zrangebylex(key, low, high)
    found = dict(zip(sets, pipe.execute(), strict=True))
    kept = [e for e in _entries(found, prefix) if fnmatch.fnmatchcase(e.name, query.pattern)]
    if query.needs_records:
        kept = _with_record(client, kept, query, prefix)
    chosen = [e for e in kept if query.wants(e.kind, e.state)]
    return page(chosen, query), len(chosen), count(kept)


def _with_record(client: Any, entries: list[Entry], query: ListQuery, prefix: str) -> list[Entry]:
    """The *entries* one of whose holders passes the task id and worker filters (a rate
    limiter and a control have no holder)."""
    keep: set[str] = set()
    mutexes = [e.key for e in entries if e.kind == "mutex"]
    keep |= {i.key for i in _locks(client, mutexes, prefix) if matches_record(i.record, query)}
    queued = [e.key for e in entries if e.kind == "queued"]
    keep |= {i.key for i in _queued(client, queued, prefix) if matches_record(i.record, query)}
    for entry in (e for e in entries if e.kind == "semaphore"):
        raw = client.hvals(entry.key)
        records = [parse_holder(text(v).split("|", 2)[-1]) for v in raw]
        if any(matches_record(r, query) for r in records):
            keep.add(entry.key)
    return [e for e in entries if e.key in keep]
