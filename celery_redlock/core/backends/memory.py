"""The lock semantics of the Redis backend, kept in this process: ``connect("memory://")``.

For tests and single-process tools. One store per URL per process (``memory://`` and
``memory://name`` are two stores; the same URL is one store, as Celery's ``memory://``
broker). Each verb does what its Lua script does on Redis, on the same key names
(:class:`~celery_redlock.core.keys.LockKeys`), atomically under the store's one lock, and
the clock stands still while it runs, as in a script. A key holds an entry of one kind
(``string``, ``hash``, ``zset``, ``list``) and an optional expiry on ``time.monotonic()``;
an expired entry is dropped when it is met, and all of them now and then (after as many
writes as the last sweep left keys), so names used once do not pile up. Nothing can be
down: no verb raises ``QuorumUnavailable``. An entry of another kind than a verb expects
(a records suffix such as ``"fence"`` names another key of the lock) is foreign data:
``Status.FOREIGN`` or ``ConfigError``, where the Redis backend answers those.

What a forked child sees: an empty store for every URL, with a new lock. The child does
not see its parent's locks, permits, holds or notices, and the parent never sees the
child's: a prefork worker or a beat on ``memory://`` shares nothing with its siblings.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

from ..backend import (
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
    parse_holder,
    record_version,
)
from ..errors import ConfigError, QuorumUnavailable
from ..keys import LockKeys, lock_keys, rate_key
from ..process import on_fork

__all__ = ["MemoryBackend"]

_DONE_KEPT = 16
_MAX_NOTICES = 1_000_000
_SWEEP_AFTER = 1000  # writes at least: a sweep is one pass over the keys
_KINDS = {"string": "a string", "hash": "a hash", "zset": "a sorted set", "list": "a list"}
_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Foreign(ConfigError):
    """A key holds something other than what celery-redlock keeps there."""

    def __init__(self, key: str, what: str) -> None:
        super().__init__(
            f"{key!r} holds {what}, not what celery-redlock keeps there: something else "
            "writes under the lock key prefix; celery-redlock leaves it alone"
        )


@dataclass(slots=True)
class _Entry:
    """One key: its kind, its value and when it expires (monotonic ms; None: never)."""

    kind: str
    value: Any
    expires: float | None


def _atomic(
    verb: Callable[Concatenate[MemoryBackend, _P], _R],
) -> Callable[Concatenate[MemoryBackend, _P], _R]:
    """Run *verb* as Redis runs a script: alone, with the clock stopped at its start."""

    @functools.wraps(verb)
    def run(self: MemoryBackend, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            self._now = time.monotonic() * 1000.0
            return verb(self, *args, **kwargs)

    return run


_registry: dict[str, MemoryBackend] = {}
_registry_lock = threading.Lock()


@on_fork
def _new_registry_lock() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()  # the parent may have held it while forking


class MemoryBackend:
    """A :class:`~celery_redlock.core.backend.Backend` whose locks live in this process.

    :meth:`for_url` gives the one store of a URL; ``MemoryBackend(url)`` makes a store of
    its own. Thread-safe: every verb runs alone under the store's lock.
    """

    masters: int = 1

    def __init__(self, url: str = "memory://") -> None:
        if not isinstance(url, str) or not url.startswith("memory://"):
            raise ConfigError(f"a memory backend needs a memory:// URL, got {url!r}")
        self.url = url
        self._reset()
        on_fork(self._reset)

    @classmethod
    def for_url(cls, url: str) -> MemoryBackend:
        """The one store of *url* in this process (made on first use)."""
        with _registry_lock:
            if url not in _registry:
                _registry[url] = cls(url)
            return _registry[url]

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._notified = threading.Condition(self._lock)  # a release notice was pushed
        self._entries: dict[str, _Entry] = {}
        self._writes, self._sweep_after = 0, _SWEEP_AFTER
        self._now = 0.0

    def clear(self) -> None:
        """Forget every key (for tests); threads blocked in :meth:`wait` keep waiting."""
        with self._lock:
            self._entries.clear()

    def size(self) -> int:
        """How many keys the store holds, expired ones not yet dropped included (for tests)."""
        with self._lock:
            return len(self._entries)

    def describe(self) -> str:
        """The URL."""
        return self.url

    def identity(self) -> Hashable:
        """``("memory", url)``."""
        return ("memory", self.url)

    def __repr__(self) -> str:
        return f"<MemoryBackend {self.url}>"

    # -- keys as Redis keeps them ---------------------------------------------------------
    def _live(self, key: str) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires is not None and entry.expires <= self._now:
            del self._entries[key]
            return None
        return entry

    def _get(self, key: str, kind: str) -> Any:
        """The value at *key* if it is a *kind*; None when there is none."""
        entry = self._live(key)
        if entry is not None and entry.kind != kind:
            raise _Foreign(key, _KINDS[entry.kind])
        return None if entry is None else entry.value

    def _put(self, key: str, kind: str, value: Any, ms: float | None = None) -> None:
        self._entries[key] = _Entry(kind, value, None if ms is None else self._now + ms)
        self._writes += 1
        if self._writes >= self._sweep_after:  # as many writes as keys were left: O(1) a write
            now, self._writes = self._now, 0
            self._entries = {
                k: e for k, e in self._entries.items() if e.expires is None or e.expires > now
            }
            self._sweep_after = max(_SWEEP_AFTER, len(self._entries))

    def _hash(self, key: str) -> dict[str, str]:
        """The hash at *key* to write to: the one there, or a new one without expiry."""
        if self._get(key, "hash") is None:
            self._put(key, "hash", {})
        value: dict[str, str] = self._entries[key].value
        return value

    def _pttl(self, key: str) -> int:
        entry = self._live(key)
        if entry is None:
            return -2
        return -1 if entry.expires is None else math.ceil(entry.expires - self._now)

    def _expire(self, key: str, ms: float, *, longer_only: bool = False) -> None:
        if not longer_only or self._pttl(key) < ms:
            self._entries[key].expires = self._now + ms

    def _drop_if_empty(self, key: str, value: dict[str, str]) -> None:
        if not value:
            del self._entries[key]  # Redis removes an empty hash

    def _counter(self, key: str) -> int | None:
        value: str | None = self._get(key, "string")
        if value is not None and _int(value) is None:
            raise _Foreign(key, "a string that is not a fence counter")
        return None if value is None else int(value)

    def _next_fence(self, key: str, fence_ttl_ms: int) -> int:
        """``INCR`` of the fence counter; a missing one restarts from the wall clock in
        microseconds (with an idle lifetime), above anything it could have counted to."""
        current = self._counter(key)
        if current is None:
            current = time.time_ns() // 1000 if fence_ttl_ms > 0 else 0
            self._put(key, "string", "")
        self._entries[key].value = str(current + 1)  # INCR keeps an expiry
        if fence_ttl_ms > 0:
            self._expire(key, fence_ttl_ms)
        return current + 1

    def _permits(self, key: str) -> list[tuple[int, str, int | None, str]]:
        """The live permits at *key*: (ms left, token, fence, record), first to expire first."""
        found = []
        for token, value in (self._get(key, "hash") or {}).items():
            expires, fence, record = _permit(value)
            if expires > self._now:
                found.append((math.ceil(expires - self._now), token, fence, record))
        return sorted(found)

    def _mark_waiting(self, key: str, ms: int) -> None:
        """Keep the waiter mark at least *ms* (a release sends a notice only while it is set)."""
        if self._pttl(key) < ms:
            self._put(key, "string", "1", ms)

    def _notice(self, keys: LockKeys, most: int, notice_ms: int, *, always: bool = False) -> None:
        """Push a release notice (a mutex keeps one, permits up to *most*) and wake the
        waiters: only while the waiter mark is set, unless *always*."""
        if not always and self._live(keys.waiting) is None:
            return
        entry = self._live(keys.notify)
        count = entry.value if entry is not None and entry.kind == "list" and most > 1 else 0
        self._put(keys.notify, "list", min(count + 1, most, _MAX_NOTICES), notice_ms)
        self._notified.notify_all()

    def _take_notice(self, key: str) -> bool:
        count: int | None = self._get(key, "list")
        if count and count > 1:
            self._entries[key].value = count - 1
        elif count:
            del self._entries[key]
        return bool(count)

    def _remember(self, key: str, token: str, ms: int) -> None:
        """Keep *token* as released for *ms*; foreign data there: not kept (release.lua)."""
        entry = self._live(key)
        if entry is not None and entry.kind != "zset":
            return
        if entry is None:
            self._put(key, "zset", OrderedDict())  # in the order kept: the oldest first
        tokens: OrderedDict[str, float] = self._entries[key].value
        tokens[token] = self._now + ms
        tokens.move_to_end(token)
        while tokens[next(iter(tokens))] <= self._now:  # ends at *token* at the latest
            tokens.popitem(last=False)
        self._expire(key, ms, longer_only=True)

    def _remembered(self, key: str, token: str) -> bool:
        entry = self._live(key)
        return entry is not None and entry.kind == "zset" and entry.value.get(token, 0) > self._now

    # -- an acquisition's life ------------------------------------------------------------
    @_atomic
    def acquire(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool,
        fence_ttl_ms: int, handover: Handover | None = None
    ) -> Grant:  # fmt: skip
        """Take *slot* for *token* (acquire.lua; permit_acquire.lua for permits)."""
        keys = slot.keys
        if slot.permits:
            if handover is not None:
                _mutex(slot)
            return self._acquire_permit(slot, token, ttl_ms, record, wait=wait, fence=fence_ttl_ms)
        held: dict[str, str] = self._get(keys.lock, "hash") or {}
        if held.get("token") == token:  # a re-sent acquire
            self._expire(keys.lock, ttl_ms)
            return Grant(True, fence=int(held["fence"]))
        queued: dict[str, str] = {}
        if handover is not None:
            queued = self._get(keys.queued, "hash") or {}
        owner = queued.get("owner")
        if "token" in held:
            left = self._pttl(keys.lock)
            if wait:
                self._mark_waiting(keys.waiting, (left if left > 0 else ttl_ms) + 1000)
            seen = None if handover is None else owner or ""
            info = parse_holder(held.get("info"))
            return Grant(False, holder=info, holder_ttl_ms=left, wait_ms=left, queued_owner=seen)
        if handover and handover.strict and owner not in (None, handover.owner):
            info, left = parse_holder(queued.get("info")), self._pttl(keys.queued)
            return Grant(
                False, holder=info, holder_ttl_ms=left, superseded=True, queued_owner=owner
            )
        fence = self._next_fence(keys.fence, fence_ttl_ms)
        lock = self._hash(keys.lock)
        lock.update(token=token, fence=str(fence), info=record)
        self._expire(keys.lock, ttl_ms)
        if handover is not None:
            lock["owner"] = handover.owner
            if owner == handover.owner:
                del self._entries[keys.queued]
        return Grant(True, fence=fence)

    def _acquire_permit(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence: int
    ) -> Grant:
        key, now = slot.keys.lock, int(self._now)
        permits: dict[str, str] = self._get(key, "hash") or {}
        mine = permits.pop(token, None)
        if mine is not None:
            expires, held_fence, rest = _permit(mine)
            if expires > now:  # a re-sent acquire
                permits[token] = f"{now + ttl_ms}|{held_fence}|{rest}"
                self._expire(key, ttl_ms, longer_only=True)
                return Grant(True, fence=held_fence)
            self._drop_if_empty(key, permits)
        if permits and len(permits) >= slot.limit:  # full: drop the expired ones
            for other in [t for t, v in permits.items() if _permit(v)[0] <= now]:
                del permits[other]
            self._drop_if_empty(key, permits)
            live = self._permits(key)
            if len(live) >= slot.limit:
                left, first = live[0][0], parse_holder(live[0][3])
                if wait:
                    self._mark_waiting(slot.keys.waiting, left + 1000)
                return Grant(False, holder=first, holder_ttl_ms=left, wait_ms=left)
        new_fence = self._next_fence(slot.keys.fence, fence)
        self._hash(key)[token] = f"{now + ttl_ms}|{new_fence}|{record}"
        self._expire(key, ttl_ms, longer_only=True)
        return Grant(True, fence=new_fence)

    @_atomic
    def release(
        self, slot: Slot, token: str, notice_ms: int, done: tuple[str, int] | None = None
    ) -> Status:
        """Give back *token*'s acquisition, remember the token for *notice_ms* and wake a
        waiter (release.lua; permit_release.lua for permits)."""
        keys = slot.keys
        try:
            held: dict[str, str] = self._get(keys.lock, "hash") or {}
        except _Foreign:
            return Status.FOREIGN
        if slot.permits:
            value = held.pop(token, None)
            if value is None:
                return Status.OK if self._remembered(keys.released, token) else Status.GONE
            self._drop_if_empty(keys.lock, held)
            status = Status.OK if _permit(value)[0] > self._now else Status.GONE
            if status is Status.OK:
                self._remember(keys.released, token, notice_ms)
            self._notice(keys, slot.limit, notice_ms)
            return status
        if held.get("token") != token:
            if self._remembered(keys.released, token):
                return Status.OK  # a re-sent copy of this token's own release
            return Status.GONE if "token" not in held else Status.TAKEN
        marks: dict[str, float] = {}
        if done is not None:  # foreign data at the done marks raises here, before any change
            marks = self._get(keys.done, "zset") or {}
        del self._entries[keys.lock]
        self._remember(keys.released, token, notice_ms)
        if done is not None:
            self._put(keys.done, "zset", marks, done[1])
            marks.pop(done[0], None)
            marks[done[0]] = self._now
            for old in list(marks)[:-_DONE_KEPT]:
                del marks[old]
        self._notice(keys, 1, notice_ms)
        return Status.OK

    @_atomic
    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        """Lengthen *token*'s lease by *ms*, or set it to *ms* with *replace* (extend.lua,
        permit_extend.lua): the new lease in ms, or GONE, TAKEN, FOREIGN."""
        return self._extend(slot, token, ms, replace)

    def _extend(  # noqa: PLR0911 - one return per outcome, as extend.lua
        self, slot: Slot, token: str, ms: int, replace: bool
    ) -> int | Status:
        key = slot.keys.lock
        try:
            held: dict[str, str] = self._get(key, "hash") or {}
        except _Foreign:
            return Status.FOREIGN
        if not slot.permits:
            if "token" not in held:
                return Status.GONE
            if held["token"] != token:
                return Status.TAKEN
            left = self._pttl(key)
            ms += 0 if replace or left <= 0 else left
            self._expire(key, ms)
            return ms
        if token not in held:
            return Status.GONE
        now = int(self._now)
        expires, fence, rest = _permit(held[token])
        if expires <= now:
            del held[token]
            self._drop_if_empty(key, held)
            return Status.GONE
        ms += 0 if replace else expires - now
        held[token] = f"{now + ms}|{fence}|{rest}"
        self._expire(key, ms, longer_only=True)
        return ms

    @_atomic
    def renew(self, items: Sequence[Renewal]) -> list[Status | QuorumUnavailable]:
        """Set each item's lease to its ``ms`` if its token still holds it (extend_items.lua):
        one status per item."""
        results = [self._extend(item.slot, item.token, item.ms, True) for item in items]
        return [r if isinstance(r, Status) else Status.OK for r in results]

    @_atomic
    def wait(self, slot: Slot, seconds: float, refused: Grant | None = None) -> None:
        """Block up to *seconds* until a release notice of *slot* is there, and take it."""
        deadline = time.monotonic() + max(seconds, 0.001)
        while not self._take_notice(slot.keys.notify):
            left = deadline - time.monotonic()
            # A notice for another name, or one another waiter took, goes round again.
            if left <= 0 or not self._notified.wait(left):
                return
            self._now = time.monotonic() * 1000.0

    @_atomic
    def raise_fence(self, slot: Slot, fence: int, fence_ttl_ms: int) -> int:
        """Lift the name's fence counter to at least *fence* (raise_fence.lua)."""
        current = self._counter(slot.keys.fence) or 0
        if current >= fence:
            return current
        self._put(slot.keys.fence, "string", str(fence), fence_ttl_ms if fence_ttl_ms > 0 else None)
        return fence

    # -- reads ----------------------------------------------------------------------------
    @_atomic
    def holders(self, slot: Slot) -> list[Holder]:
        """Every current acquisition of *slot*, first to expire first."""
        if slot.permits:
            return [
                Holder(token, parse_holder(record), fence, left)
                for left, token, fence, record in self._permits(slot.keys.lock)
            ]
        held: dict[str, str] = self._get(slot.keys.lock, "hash") or {}
        if "token" not in held:
            return []
        record, fence = parse_holder(held.get("info")), _int(held.get("fence"))
        return [Holder(held["token"], record, fence, self._pttl(slot.keys.lock))]

    @_atomic
    def locked(self, slot: Slot) -> bool:
        """True when *slot* cannot be taken now."""
        if slot.permits:
            return len(self._permits(slot.keys.lock)) >= slot.limit
        return self._live(slot.keys.lock) is not None

    @_atomic
    def was_done(self, slot: Slot, mark: str) -> bool:
        """True when a release added *mark* to the name's done marks."""
        return mark in (self._get(slot.keys.done, "zset") or {})

    # -- enqueue-time holds -----------------------------------------------------------------
    @_atomic
    def enqueue(
        self, slot: Slot, owner: str, ttl_ms: int, record: str, *, replace: bool,
        running_blocks: bool
    ) -> Queued:  # fmt: skip
        """Take the enqueue-time hold of *slot* for task *owner*, or say whose it is
        (enqueue.lua)."""
        keys = _mutex(slot)
        queued: dict[str, str] = self._get(keys.queued, "hash") or {}
        other = queued.get("owner")
        if other is not None and other != owner and not replace:
            holder, left = parse_holder(queued.get("info")), self._pttl(keys.queued)
            return Queued("duplicate", other, holder, left, "queued")
        if other is None and running_blocks:
            run: dict[str, str] = self._get(keys.lock, "hash") or {}
            if "token" in run and run.get("owner") != owner:
                holder, left = parse_holder(run.get("info")), self._pttl(keys.lock)
                runner = run.get("owner") or str(holder.get("task_id") or "")
                return Queued("duplicate", runner, holder, left, "running")
        self._hash(keys.queued).update(owner=owner, info=record)
        self._expire(keys.queued, ttl_ms)
        if other is not None and other != owner:
            return Queued("replaced", other, parse_holder(queued.get("info")))
        return Queued("queued")

    @_atomic
    def dequeue(self, slot: Slot, owner: str) -> Status:
        """Give up task *owner*'s enqueue-time hold (dequeue.lua)."""
        key = _mutex(slot).queued
        try:
            queued: dict[str, str] = self._get(key, "hash") or {}
        except _Foreign:
            return Status.FOREIGN
        if queued.get("owner") is None:
            return Status.GONE
        if queued["owner"] != owner:
            return Status.TAKEN
        del self._entries[key]
        return Status.OK

    # -- rate grants ------------------------------------------------------------------------
    @_atomic
    def rate(
        self, name: str, key: str, interval_us: int, burst: int, *, mode: str, most_us: int = 0
    ) -> RateGrant:
        """One GCRA decision (rate.lua): *mode* ``take``, ``queue`` or ``peek``."""
        if mode not in ("take", "queue", "peek"):
            raise ValueError(f"rate limiter {name!r}: unknown mode {mode!r}")
        now, step = round(self._now * 1000), interval_us  # microseconds
        state: dict[str, str] = self._get(key, "hash") or {}
        tat, line = max(_int(state.get("tat")) or 0, now), _int(state.get("line")) or 0
        tolerance = (burst - 1) * step
        next_at = tat - tolerance
        if next_at <= now and not (mode == "queue" and line > now):
            if mode == "peek":
                return RateGrant(True, 0.0, (now - next_at) // step + 1)
            tat += step
            self._rate_state(key, {"tat": tat, "interval": step, "burst": burst}, max(tat, line))
            after = tat - tolerance
            if after <= now:
                return RateGrant(True, 0.0, (now - after) // step + 1)
            return RateGrant(True, (after - now) / 1e6, 0)
        if mode != "queue":
            return RateGrant(False, (next_at - now) / 1e6, 0)
        slot_at = max(line, next_at)
        if most_us <= 0 or slot_at - now <= most_us:
            line = slot_at + step
            self._rate_state(key, {"line": line, "interval": step, "burst": burst}, max(tat, line))
        return RateGrant(False, (slot_at - now) / 1e6, 0)

    def _rate_state(self, key: str, fields: dict[str, int], until_us: int) -> None:
        """Write *fields*; the state lives until the limiter is idle again (*until_us*)."""
        self._hash(key).update({name: str(value) for name, value in fields.items()})
        self._expire(key, math.ceil((until_us - round(self._now * 1000)) / 1000) + 1)

    # -- records beside a lock ------------------------------------------------------------
    @_atomic
    def load_records(self, slot: Slot, suffix: str) -> dict[str, str]:
        """Every field of the records hash ``<lock key>:<suffix>``."""
        return dict(self._get(f"{slot.keys.lock}:{suffix}", "hash") or {})

    @_atomic
    def claim(  # noqa: PLR0917 - the verb's signature
        self, slot: Slot, suffix: str, token: str, name: str, value: str,
        version: tuple[int, int], deadline: float | None = None
    ) -> Claim:  # fmt: skip
        """Write field *name* only while *token* holds the lock, never over a newer
        version of the same fence (claim_field.lua). One store answers at once: *deadline*
        (a quorum's bound) is not needed here."""
        key = f"{slot.keys.lock}:{suffix}"
        if (self._get(slot.keys.lock, "hash") or {}).get("token") != token:
            return Claim("lost", detail="the lock is gone or held by another acquisition")
        current = (self._get(key, "hash") or {}).get(name)
        if current is not None and current != value:
            fence, n = record_version(current)
            if fence == version[0] and n >= version[1] and n >= 0:
                return Claim("stale", current)
        self._hash(key)[name] = value
        return Claim("claimed", value)

    # -- operator reads and forced release --------------------------------------------------
    @_atomic
    def scan(self, prefix: str, pattern: str = "*") -> list[LockInfo]:
        """Every held lock, live permit and queued hold under *prefix* whose name matches
        the glob *pattern*, sorted by name."""
        head, found = prefix + "{", list[LockInfo]()
        for key in [k for k in self._entries if k.startswith(head)]:
            for end in ("}", "}:queued", "}:permits"):
                name = key[len(head) : -len(end)]
                if key.endswith(end) and fnmatch.fnmatchcase(name, pattern):
                    found += self._infos(key, name, end)
        return sorted(found, key=_order)

    @_atomic
    def read(self, prefix: str, name: str) -> list[LockInfo]:
        """Lock *name*'s holder, queued hold and live permits; ConfigError when its key
        holds data that is not a lock."""
        keys = lock_keys(name, prefix)
        stored = keys.lock[len(prefix) + 1 : -1]
        found = self._infos(keys.lock, stored, "}")
        if not found and self._get(keys.lock, "hash") is not None:
            raise _Foreign(keys.lock, "a hash without a lock token")
        found += self._infos(keys.queued, stored, "}:queued")
        return found + self._infos(keys.lock + ":permits", keys.name, "}:permits")

    def _infos(self, key: str, name: str, end: str) -> list[LockInfo]:
        """What *key* holds for the operator (nothing for foreign data)."""
        entry = self._live(key)
        if entry is None or entry.kind != "hash":
            return []
        found, held = list[LockInfo](), entry.value
        if end == "}:permits":
            for left, _, fence, raw in self._permits(key):
                rec = parse_holder(raw)
                found.append(LockInfo(name, key, fence, left, rec, "permit", _state(rec)))
        elif end == "}" and "token" in held:
            rec, fence = parse_holder(held.get("info")), _int(held.get("fence"))
            found.append(LockInfo(name, key, fence, self._pttl(key), rec, state=_state(rec)))
        elif end == "}:queued" and "owner" in held:
            rec = parse_holder(held.get("info"))
            rec.setdefault("task_id", held["owner"])
            found.append(LockInfo(name, key, None, self._pttl(key), rec, state="queued"))
        return found

    @_atomic
    def scan_rates(self, prefix: str, pattern: str = "*") -> list[RateInfo]:
        """The state of every rate limiter under *prefix* whose name matches *pattern*."""
        head, end, found = prefix + "{", "}:rate", list[RateInfo]()
        for key in [k for k in self._entries if k.startswith(head) and k.endswith(end)]:
            name = key[len(head) : -len(end)]
            info = self._rate_info(key, name) if fnmatch.fnmatchcase(name, pattern) else None
            found += [] if info is None else [info]
        return sorted(found, key=lambda info: info.name)

    @_atomic
    def read_rate(self, prefix: str, name: str) -> RateInfo | None:
        """The state of rate limiter *name*, or None when it is idle."""
        return self._rate_info(rate_key(name, prefix), name)

    def _rate_info(self, key: str, name: str) -> RateInfo | None:
        entry = self._live(key)
        state: dict[str, str] = entry.value if entry is not None and entry.kind == "hash" else {}
        interval, burst = _int(state.get("interval")), _int(state.get("burst"))
        if not interval or not burst:
            return None  # idle, or foreign data
        now = round(self._now * 1000)
        tat, line = _int(state.get("tat")) or 0, _int(state.get("line")) or 0
        next_at = max(tat, now) - (burst - 1) * interval
        free = (now - next_at) // interval + 1 if next_at <= now else 0
        start = max(now, next_at)  # promised slots still due lie between here and the line
        queued = math.ceil((line - start) / interval) if line > start else 0
        next_ms = max(0, next_at - now) // 1000
        return RateInfo(name, key, interval, burst, free, next_ms, queued, self._pttl(key))

    @_atomic
    def force_release(self, slot: Slot, fence: int | None, notice_ms: int) -> ForceRelease:
        """Remove the lock whoever holds it (only the acquisition with *fence*, when
        given) and wake a waiter (force_release.lua); the token is not remembered as
        released."""
        if slot.permits:
            raise ConfigError(f"lock {slot.name!r}: a permit is not released by force")
        keys = slot.keys
        held: dict[str, str] = self._get(keys.lock, "hash") or {}
        if "token" not in held:
            return ForceRelease("gone")
        record, current = parse_holder(held.get("info")), _int(held.get("fence"))
        if fence is not None and str(fence) != held.get("fence"):
            return ForceRelease("refused", record, current)
        del self._entries[keys.lock]
        self._notice(keys, 1, notice_ms, always=True)
        return ForceRelease("released", record, current)

    @_atomic
    def force_dequeue(self, slot: Slot, owner: str | None) -> ForceRelease:
        """Remove the enqueue-time hold (only task *owner*'s, when given)."""
        key = _mutex(slot).queued
        found = self._infos(key, slot.name, "}:queued")  # foreign data: none, left alone
        if not found:
            return ForceRelease("gone")
        if owner is not None and self._entries[key].value["owner"] != owner:
            return ForceRelease("refused", found[0].record)
        del self._entries[key]
        return ForceRelease("released", found[0].record)


def _mutex(slot: Slot) -> LockKeys:
    """The keys of *slot*, which must be a mutex: permits have no enqueue-time hold."""
    if slot.permits or not slot.keys.queued:
        raise ConfigError(f"lock {slot.name!r}: enqueue-time holds take a mutex, not permits")
    return slot.keys


def _int(value: str | None) -> int | None:
    """A stored decimal integer, or None (missing, or not one: ``"²"`` is no digit here)."""
    return int(value) if value and value.isascii() and value.isdigit() else None


def _permit(value: str) -> tuple[int, int | None, str]:
    """A permit's ``"<expiry ms>|<fence>|<record>"``: an unreadable one has expired (0)."""
    expires, _, rest = value.partition("|")
    fence, _, record = rest.partition("|")
    if _int(expires) is None or _int(fence) is None:
        return 0, None, value
    return int(expires), int(fence), record


def _state(record: dict[str, Any]) -> Literal["running", "held"]:
    """A task's run holds it, or another holder (a Lock of user code, beat's leader)."""
    return "running" if record.get("task_name") else "held"


def _order(info: LockInfo) -> tuple[str, str, int]:
    """By name; a lock, then its permits (first to expire first), then its queued hold."""
    return info.name, info.key, info.ttl_ms
