"""The keys of a memory backend (:class:`~.backend.MemoryBackend`), kept as Redis keeps
them: :class:`MemoryStore`, which the backend's verbs run on as the Redis backend's scripts
run on a server.

A key holds an entry of one kind (``string``, ``hash``, ``zset``, ``list``) and an
optional expiry on ``time.monotonic()``; an expired entry is dropped when it is met, and
all of them now and then (after as many writes as the last sweep left keys), so names
used once do not pile up. A verb runs as a script runs on Redis (:func:`atomic`): alone
under the store's one lock, with the clock stopped at its start. An entry of another
kind than a verb expects is foreign data (:class:`ForeignData`).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from ...backend_types import RECENT_BYTES
from ...errors import ConfigError
from ...keys import LockKeys
from ...process import on_fork

__all__ = [
    "Entry",
    "ForeignData",
    "MemoryStore",
    "atomic",
    "parse_permit",
    "stored_int",
]

_MAX_NOTICES = 1_000_000
_SWEEP_AFTER = 1000  # writes at least: a sweep is one pass over the keys
_KINDS = {
    "string": "a string",
    "hash": "a hash",
    "zset": "a sorted set",
    "list": "a list",
    "stream": "a stream",
}
_S = TypeVar("_S", bound="_OnStore")
_P = ParamSpec("_P")
_R = TypeVar("_R")


class ForeignData(ConfigError):
    """A key holds something other than what celery-redlock keeps there."""

    def __init__(self, key: str, what: str) -> None:
        super().__init__(
            f"{key!r} holds {what}, not what celery-redlock keeps there: something else "
            "writes under the lock key prefix; celery-redlock leaves it alone"
        )


@dataclass(slots=True)
class Entry:
    """One key: its kind, its value and when it expires (monotonic ms; None: never)."""

    kind: str
    value: Any
    expires: float | None


class _OnStore(Protocol):
    """What :func:`atomic` wraps a verb of: an object with a :class:`MemoryStore`."""

    store: MemoryStore


def atomic(
    verb: Callable[Concatenate[_S, _P], _R],
) -> Callable[Concatenate[_S, _P], _R]:
    """Run *verb* (of an object with a ``store``) as Redis runs a script: alone, with the
    store's clock stopped at its start."""

    @functools.wraps(verb)
    def run(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        store = self.store
        with store.lock:
            store.now = time.monotonic() * 1000.0
            return verb(self, *args, **kwargs)

    return run


class MemoryStore:
    """The keys of one store, and the steps a verb is made of, each as the Redis command
    or script step it stands for. The steps run inside a verb (:func:`atomic`: under the
    store's :attr:`lock`, at the verb's clock :attr:`now`). A forked child starts with an
    empty store and a new lock."""

    def __init__(self) -> None:
        self._reset()
        on_fork(self._reset)

    def _reset(self) -> None:
        self.lock = threading.Lock()
        #: Signalled when a release notice is pushed (on the store's lock).
        self.notified = threading.Condition(self.lock)
        #: Every key's entry, expired ones not yet dropped included.
        self.entries: dict[str, Entry] = {}
        self._writes, self._sweep_after = 0, _SWEEP_AFTER
        #: The running verb's clock: monotonic ms, stopped while it runs.
        self.now = 0.0

    def clear(self) -> None:
        """Forget every key (for tests); threads blocked in a verb's wait keep waiting."""
        with self.lock:
            self.entries.clear()

    def size(self) -> int:
        """How many keys the store holds, expired ones not yet dropped included (for tests)."""
        with self.lock:
            return len(self.entries)

    def live(self, key: str) -> Entry | None:
        """The entry at *key*, of any kind; None when there is none (an expired one dropped)."""
        entry = self.entries.get(key)
        if entry is not None and entry.expires is not None and entry.expires <= self.now:
            del self.entries[key]
            return None
        return entry

    def get(self, key: str, kind: str) -> Any:
        """The value at *key* if it is a *kind*; None when there is none."""
        entry = self.live(key)
        if entry is not None and entry.kind != kind:
            raise ForeignData(key, _KINDS[entry.kind])
        return None if entry is None else entry.value

    def put(self, key: str, kind: str, value: Any, ms: float | None = None) -> None:
        """Set *key* to a *kind* entry, expiring in *ms* (None: never)."""
        self.entries[key] = Entry(kind, value, None if ms is None else self.now + ms)
        self._writes += 1
        if self._writes >= self._sweep_after:  # as many writes as keys were left: O(1) a write
            now, self._writes = self.now, 0
            self.entries = {
                k: e for k, e in self.entries.items() if e.expires is None or e.expires > now
            }
            self._sweep_after = max(_SWEEP_AFTER, len(self.entries))

    def writable_hash(self, key: str) -> dict[str, str]:
        """The hash at *key* to write to: the one there, or a new one without expiry."""
        if self.get(key, "hash") is None:
            self.put(key, "hash", {})
        value: dict[str, str] = self.entries[key].value
        return value

    def pttl(self, key: str) -> int:
        """``PTTL``: ms left; -1 without expiry, -2 when there is no entry."""
        entry = self.live(key)
        if entry is None:
            return -2
        return -1 if entry.expires is None else math.ceil(entry.expires - self.now)

    def expire(self, key: str, ms: float, *, longer_only: bool = False) -> None:
        """``PEXPIRE`` of an entry that is there (with *longer_only*: when less is left)."""
        if not longer_only or self.pttl(key) < ms:
            self.entries[key].expires = self.now + ms

    def drop_if_empty(self, key: str, value: dict[str, str]) -> None:
        """Remove the hash at *key* once *value*, its fields, is empty."""
        if not value:
            del self.entries[key]  # Redis removes an empty hash

    def counter(self, key: str) -> int | None:
        """The fence counter at *key*, or None; ForeignData for a string of other text."""
        value: str | None = self.get(key, "string")
        if value is not None and stored_int(value) is None:
            raise ForeignData(key, "a string that is not a fence counter")
        return None if value is None else int(value)

    def next_fence(self, key: str, fence_ttl_ms: int, step_ms: int = 0) -> int:
        """``INCR`` of the fence counter; a missing one (with an idle lifetime) restarts
        from the wall clock in microseconds, above anything it could have counted to,
        rounded up to the next step of min(*step_ms*, that lifetime) when one is given
        (acquire.lua says why)."""
        current = self.counter(key)
        if current is None:
            if fence_ttl_ms > 0:
                step = max(1, min(step_ms, fence_ttl_ms) * 1000)
                current = (time.time_ns() // 1000 // step + 1) * step - 1
            else:
                current = 0
            self.put(key, "string", "")
        self.entries[key].value = str(current + 1)  # INCR keeps an expiry
        if fence_ttl_ms > 0:
            self.expire(key, fence_ttl_ms)
        return current + 1

    def live_permits(self, key: str) -> list[tuple[int, str, int | None, str]]:
        """The live permits at *key*: (ms left, token, fence, record), first to expire first."""
        found = []
        for token, value in (self.get(key, "hash") or {}).items():
            expires, fence, record = parse_permit(value)
            if expires > self.now:
                found.append((math.ceil(expires - self.now), token, fence, record))
        return sorted(found)

    def mark_waiting(self, key: str, ms: int) -> None:
        """Keep the waiter mark at least *ms* (a release sends a notice only while it is set)."""
        if self.pttl(key) < ms:
            self.put(key, "string", "1", ms)

    def notice(self, keys: LockKeys, most: int, notice_ms: int, *, always: bool = False) -> None:
        """Push a release notice (a mutex keeps one, permits up to *most*) and wake the
        waiters: only while the waiter mark is set, unless *always*."""
        if not always and self.live(keys.waiting) is None:
            return
        entry = self.live(keys.notify)
        count = entry.value if entry is not None and entry.kind == "list" and most > 1 else 0
        self.put(keys.notify, "list", min(count + 1, most, _MAX_NOTICES), notice_ms)
        self.notified.notify_all()

    def take_notice(self, key: str) -> bool:
        """Take one release notice at *key*: False when there is none."""
        count: int | None = self.get(key, "list")
        if count and count > 1:
            self.entries[key].value = count - 1
        elif count:
            del self.entries[key]
        return bool(count)

    def remember(self, key: str, token: str, ms: int) -> None:
        """Keep *token* first among the recently released tokens at *key* (at most
        :data:`RECENT_BYTES`, the oldest dropped), for *ms* after this release; foreign
        data there: not kept (release.lua)."""
        entry = self.live(key)
        if entry is not None and entry.kind != "string":
            return
        recent = f" {token}{' ' if entry is None else entry.value}"
        if len(recent) > RECENT_BYTES:  # drop the oldest, whole tokens only
            recent = recent[: recent.rindex(" ", 0, RECENT_BYTES) + 1]
        self.put(key, "string", recent, ms)

    def remembered(self, key: str, token: str) -> bool:
        """True while *token* is among the recently released tokens at *key*."""
        entry = self.live(key)
        return entry is not None and entry.kind == "string" and f" {token} " in entry.value


def stored_int(value: str | None) -> int | None:
    """A stored decimal integer, or None (missing, or not one: ``"²"`` is no digit here)."""
    return int(value) if value and value.isascii() and value.isdigit() else None


def parse_permit(value: str) -> tuple[int, int | None, str]:
    """A permit's ``"<expiry ms>|<fence>|<record>"``: an unreadable one has expired (0)."""
    expires, _, rest = value.partition("|")
    fence, _, record = rest.partition("|")
    if stored_int(expires) is None or stored_int(fence) is None:
        return 0, None, value
    return int(expires), int(fence), record
