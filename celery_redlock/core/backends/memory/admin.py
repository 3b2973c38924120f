"""The operator reads of :class:`~.backend.MemoryBackend` (``celery locks``) and its
forced removals: what a store holds under a prefix, read as the Redis backend reads it
on Redis. Each function runs inside one of the backend's verbs (under the store's lock,
the clock stopped: :func:`~.store.atomic`).
"""

from __future__ import annotations

import fnmatch
import math

from ...backend_types import (
    ForceRelease,
    LockInfo,
    RateInfo,
    Slot,
    lock_state,
    mutex_keys,
    parse_holder,
)
from ...errors import ConfigError
from ...keys import lock_keys, name_of_key, normalize_name, rate_key
from .store import ForeignData, MemoryStore, stored_int

__all__ = ["force_dequeue", "force_release", "read", "read_rate", "scan", "scan_rates"]


def scan(
    store: MemoryStore, prefix: str, pattern: str = "*", limit: int | None = None
) -> list[LockInfo]:
    """Every held lock, live permit and queued hold under *prefix* whose name matches
    the glob *pattern*, sorted by name (the first *limit* names, when given)."""
    head, found = prefix + "{", list[LockInfo]()
    for key in [k for k in store.entries if k.startswith(head)]:
        for end in ("}", "}:queued", "}:permits"):
            name = name_of_key(key, prefix) if key.endswith(end) else None
            if name is not None and fnmatch.fnmatchcase(name, pattern):
                found += _infos(store, key, name, end)
    found.sort(key=_order)
    if limit is not None:
        names = sorted({i.name for i in found})[:limit]
        found = [i for i in found if i.name <= names[-1]] if names else []
    return found


def read(store: MemoryStore, prefix: str, name: str) -> list[LockInfo]:
    """Lock *name*'s holder, queued hold and live permits; ConfigError when its key
    holds data that is not a lock."""
    keys = lock_keys(name, prefix)
    found = _infos(store, keys.lock, keys.name, "}")
    if not found and store.get(keys.lock, "hash") is not None:
        raise ForeignData(keys.lock, "a hash without a lock token")
    found += _infos(store, keys.queued, keys.name, "}:queued")
    return found + _infos(store, keys.lock + ":permits", keys.name, "}:permits")


def _infos(store: MemoryStore, key: str, name: str, end: str) -> list[LockInfo]:
    """What *key* holds for the operator (nothing for foreign data)."""
    entry = store.live(key)
    if entry is None or entry.kind != "hash":
        return []
    found, held = list[LockInfo](), entry.value
    if end == "}:permits":
        for left, _, fence, raw in store.live_permits(key):
            rec = parse_holder(raw)
            found.append(LockInfo(name, key, fence, left, rec, "permit", lock_state(rec)))
    elif end == "}" and "token" in held:
        rec, fence = parse_holder(held.get("info")), stored_int(held.get("fence"))
        found.append(LockInfo(name, key, fence, store.pttl(key), rec, state=lock_state(rec)))
    elif end == "}:queued" and "owner" in held:
        rec = parse_holder(held.get("info"))
        rec.setdefault("task_id", held["owner"])
        found.append(LockInfo(name, key, None, store.pttl(key), rec, state="queued"))
    return found


def scan_rates(store: MemoryStore, prefix: str, pattern: str = "*") -> list[RateInfo]:
    """The state of every rate limiter under *prefix* whose name matches *pattern*."""
    head, end, found = prefix + "{", "}:rate", list[RateInfo]()
    for key in [k for k in store.entries if k.startswith(head) and k.endswith(end)]:
        name = name_of_key(key, prefix)
        info = _rate_info(store, key, name) if fnmatch.fnmatchcase(name, pattern) else None
        found += [] if info is None else [info]
    return sorted(found, key=lambda info: info.name)


def read_rate(store: MemoryStore, prefix: str, name: str) -> RateInfo | None:
    """The state of rate limiter *name*, or None when it is idle."""
    return _rate_info(store, rate_key(name, prefix), normalize_name(name))


def _rate_info(store: MemoryStore, key: str, name: str) -> RateInfo | None:
    entry = store.live(key)
    state: dict[str, str] = entry.value if entry is not None and entry.kind == "hash" else {}
    interval, burst = stored_int(state.get("interval")), stored_int(state.get("burst"))
    if not interval or not burst:
        return None  # idle, or foreign data
    now = round(store.now * 1000)
    tat, line = stored_int(state.get("tat")) or 0, stored_int(state.get("line")) or 0
    next_at = max(tat, now) - (burst - 1) * interval
    free = (now - next_at) // interval + 1 if next_at <= now else 0
    start = max(now, next_at)  # promised slots still due lie between here and the line
    queued = math.ceil((line - start) / interval) if line > start else 0
    next_ms = max(0, next_at - now) // 1000
    return RateInfo(name, key, interval, burst, free, next_ms, queued, store.pttl(key))


def force_release(
    store: MemoryStore, slot: Slot, fence: int | None, notice_ms: int
) -> ForceRelease:
    """Remove the lock whoever holds it (only the acquisition with *fence*, when
    given) and wake a waiter (force_release.lua); the token is not remembered as
    released."""
    if slot.permits:
        raise ConfigError(f"lock {slot.name!r}: a permit is not released by force")
    keys = slot.keys
    held: dict[str, str] = store.get(keys.lock, "hash") or {}
    if "token" not in held:
        return ForceRelease("gone")
    record, current = parse_holder(held.get("info")), stored_int(held.get("fence"))
    if fence is not None and str(fence) != held.get("fence"):
        return ForceRelease("refused", record, current)
    del store.entries[keys.lock]
    store.notice(keys, 1, notice_ms, always=True)
    return ForceRelease("released", record, current)


def force_dequeue(store: MemoryStore, slot: Slot, owner: str | None) -> ForceRelease:
    """Remove the enqueue-time hold (only task *owner*'s, when given)."""
    key = mutex_keys(slot).queued
    found = _infos(store, key, slot.name, "}:queued")  # foreign data: none, left alone
    if not found:
        return ForceRelease("gone")
    if owner is not None and store.entries[key].value["owner"] != owner:
        return ForceRelease("refused", found[0].record)
    del store.entries[key]
    return ForceRelease("released", found[0].record)


def _order(info: LockInfo) -> tuple[str, str, int]:
    """By name; a lock, then its permits (first to expire first), then its queued hold."""
    return info.name, info.key, info.ttl_ms
