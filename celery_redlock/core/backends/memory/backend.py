"""The lock semantics of the Redis backend, kept in this process: ``connect("memory://")``.

For tests and single-process tools. One store per URL per process (``memory://`` and
``memory://name`` are two stores; the same URL is one store, as Celery's ``memory://``
broker). Each verb does what its Lua script does on Redis, on the same key names
(:class:`~celery_redlock.core.keys.LockKeys`), atomically under the store's one lock, and
the clock stands still while it runs, as in a script: the keys and the steps a verb is
made of are :mod:`.store` (the backend's "server"), flow control's steps :mod:`.flow`,
the operator reads and forced removals :mod:`.admin`. Nothing can be down: no verb raises
``QuorumUnavailable``. An entry of another kind than a verb expects (a records suffix
such as ``"fence"`` names another key of the lock) is foreign data: ``Status.FOREIGN`` or
``ConfigError``, where the Redis backend answers those.

What a forked child sees: an empty store for every URL, with a new lock. The child does
not see its parent's locks, permits, holds or notices, and the parent never sees the
child's: a prefork worker or a beat on ``memory://`` shares nothing with its siblings.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import itertools
import math
import time
from collections.abc import Callable, Hashable, Sequence

from ...backend_types import (
    PARKED,
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
    Rule,
    Slot,
    Status,
    mutex_keys,
    parse_holder,
    record_version,
)
from ...errors import ConfigError, QuorumUnavailable
from ...listing import Listing, ListQuery, select
from ...process import ForkLock, made_once
from . import admin, flow
from .store import (
    ForeignData,
    MemoryStore,
    atomic,
    parse_permit,
    stored_int,
)

__all__ = ["MemoryBackend"]

_DONE_KEPT = 16


_registry: dict[str, MemoryBackend] = {}
_registry_lock = ForkLock()


class MemoryBackend:
    """A :class:`~celery_redlock.core.backend.Backend` whose locks live in this process.

    :meth:`for_url` gives the one store of a URL; ``MemoryBackend(url)`` makes a store of
    its own. Thread-safe: every verb runs alone under the store's lock.
    """

    masters: int = 1
    holds_permits = True

    def __init__(self, url: str = "memory://") -> None:
        if not isinstance(url, str) or not url.startswith("memory://"):
            raise ConfigError(f"a memory backend needs a memory:// URL, got {url!r}")
        self.url = url
        #: The keys, as a server keeps them; every verb runs on it alone (:func:`atomic`).
        self.store = MemoryStore()

    @classmethod
    def for_url(cls, url: str) -> MemoryBackend:
        """The one store of *url* in this process (made on first use)."""
        return made_once(_registry, url, lambda: cls(url), _registry_lock)

    def describe(self) -> str:
        """The URL."""
        return self.url

    def identity(self) -> Hashable:
        """``("memory", url)``."""
        return ("memory", self.url)

    def __repr__(self) -> str:
        return f"<MemoryBackend {self.url}>"

    def check(self) -> list[Health]:
        """Always ok: nothing to reach."""
        return [Health(self.url, "ok")]

    def clear(self) -> None:
        """Forget every key (for tests); threads blocked in a verb's wait keep waiting."""
        self.store.clear()

    def size(self) -> int:
        """How many keys the store holds, expired ones not yet dropped included (for tests)."""
        return self.store.size()

    # -- an acquisition's life ------------------------------------------------------------
    @atomic
    def acquire(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int,
        deadline: float | None = None, fence_step_ms: int = 0
    ) -> Grant:  # fmt: skip
        """Take *slot* for *token* (acquire.lua; permit_acquire.lua for permits; with its
        controls and rules, hold_all.lua). *fence_step_ms*: a mutex's counter restart
        rounds up to that step (a quorum's member: see acquire.lua's ARGV[6])."""

        def take(limit: int | None = None) -> Grant:
            if slot.permits:
                permits = slot if limit is None else dataclasses.replace(slot, limit=limit)
                return self._acquire_permit(
                    permits, token, ttl_ms, record, wait=wait, fence=fence_ttl_ms
                )
            return self._acquire(
                slot, token, ttl_ms, record, wait, fence_ttl_ms, None, fence_step_ms
            )

        return self._flow(slot, take, token, ttl_ms, record, fence_ttl_ms) if slot.flow else take()

    @atomic
    def take_over(
        self, slot: Slot, token: str, ttl_ms: int, record: str, handover: Handover, *,
        wait: bool, fence_ttl_ms: int
    ) -> Grant:  # fmt: skip
        """Take the mutex of *slot* and task ``handover.owner``'s queued hold with it
        (acquire.lua with the hold's key)."""
        mutex_keys(slot)

        def take(_limit: int | None = None) -> Grant:  # a mutex: no limit to change
            return self._acquire(slot, token, ttl_ms, record, wait, fence_ttl_ms, handover)

        return self._flow(slot, take, token, ttl_ms, record, fence_ttl_ms) if slot.flow else take()

    def _flow(  # noqa: PLR0917 - the acquire's own step, and what a rule's permit takes
        self, slot: Slot, take: Callable[[int | None], Grant], token: str, ttl_ms: int, record: str,
        fence_ttl_ms: int
    ) -> Grant:  # fmt: skip
        def rule_take(rule: Rule, limit: int) -> int:
            if rule.is_mutex:
                grant = self._acquire(
                    Slot(rule.keys), token, ttl_ms, record, False, fence_ttl_ms, None
                )
            else:
                grant = self._acquire_permit(
                    Slot(rule.keys, limit), token, ttl_ms, record, wait=False,
                    fence=fence_ttl_ms,
                )  # fmt: skip
            return grant.fence or 0

        return flow.flow_acquire(self.store, slot, token, take, rule_take)

    def _acquire(  # noqa: PLR0917 - acquire's arguments and the hand-over
        self,
        slot: Slot,
        token: str,
        ttl_ms: int,
        record: str,
        wait: bool,
        fence_ttl_ms: int,
        handover: Handover | None,
        step_ms: int = 0,
    ) -> Grant:
        keys = slot.keys
        held: dict[str, str] = self.store.get(keys.lock, "hash") or {}
        if held.get("token") == token:  # a re-sent acquire
            self.store.expire(keys.lock, ttl_ms)
            return Grant(True, fence=int(held["fence"]))
        queued: dict[str, str] = {}
        if handover is not None:
            queued = self.store.get(keys.queued, "hash") or {}
        owner = queued.get("owner")
        parked = handover is not None and held.get("token") == PARKED + handover.owner
        if "token" in held and not parked:
            left = self.store.pttl(keys.lock)
            if wait:
                self.store.mark_waiting(keys.waiting, (left if left > 0 else ttl_ms) + 1000)
            seen = None if handover is None else owner or ""
            info = parse_holder(held.get("info"))
            return Grant(False, holder=info, holder_ttl_ms=left, wait_ms=left, queued_owner=seen)
        if handover and handover.strict and not parked and owner not in (None, handover.owner):
            info, left = parse_holder(queued.get("info")), self.store.pttl(keys.queued)
            return Grant(
                False, holder=info, holder_ttl_ms=left, superseded=True, queued_owner=owner
            )
        fence = self.store.next_fence(keys.fence, fence_ttl_ms, step_ms)
        lock = self.store.writable_hash(keys.lock)
        lock.update(token=token, fence=str(fence), info=record)
        self.store.expire(keys.lock, ttl_ms)
        if handover is not None:
            lock["owner"] = handover.owner
            if owner == handover.owner:
                del self.store.entries[keys.queued]
        return Grant(True, fence=fence)

    def _acquire_permit(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence: int
    ) -> Grant:
        key, now = slot.keys.lock, int(self.store.now)
        permits: dict[str, str] = self.store.get(key, "hash") or {}
        mine = permits.pop(token, None)
        if mine is not None:
            expires, held_fence, rest = parse_permit(mine)
            if expires > now:  # a re-sent acquire
                permits[token] = f"{now + ttl_ms}|{held_fence}|{rest}"
                self.store.expire(key, ttl_ms, longer_only=True)
                return Grant(True, fence=held_fence)
            self.store.drop_if_empty(key, permits)
        if permits and len(permits) >= slot.limit:  # full: drop the expired ones
            for other in [t for t, v in permits.items() if parse_permit(v)[0] <= now]:
                del permits[other]
            self.store.drop_if_empty(key, permits)
            live = self.store.live_permits(key)
            if len(live) >= slot.limit:
                left, first = live[0][0], parse_holder(live[0][3])
                if wait:
                    self.store.mark_waiting(slot.keys.waiting, left + 1000)
                return Grant(False, holder=first, holder_ttl_ms=left, wait_ms=left)
        new_fence = self.store.next_fence(slot.keys.fence, fence)
        self.store.writable_hash(key)[token] = f"{now + ttl_ms}|{new_fence}|{record}"
        self.store.expire(key, ttl_ms, longer_only=True)
        return Grant(True, fence=new_fence)

    @atomic
    def release(self, slot: Slot, token: str, notice_ms: int) -> Status:
        """Give back *token*'s acquisition, remember the token for *notice_ms* and wake a
        waiter (release.lua; permit_release.lua for permits; with rules, release_all.lua)."""
        return self._release_with_rules(slot, token, notice_ms, None)

    @atomic
    def release_done(
        self, slot: Slot, token: str, notice_ms: int, mark: str, mark_ms: int
    ) -> Status:
        """:meth:`release` of a mutex that also adds *mark* to its done marks (release.lua
        with the marks' key)."""
        mutex_keys(slot)
        return self._release_with_rules(slot, token, notice_ms, (mark, mark_ms))

    def _release_with_rules(
        self, slot: Slot, token: str, notice_ms: int, done: tuple[str, int] | None
    ) -> Status:
        """release_all.lua: the slot's own release, then each Limit held by *token* given
        back as its own release does."""
        status = self._release(slot, token, notice_ms, done)
        if not slot.held_rules:
            return status
        rules = [
            self._release(Slot(rule.keys, rule.limit), token, notice_ms, None)
            for rule in slot.held_rules
        ]
        return Status.first_failure([status, *rules])

    def _release(
        self, slot: Slot, token: str, notice_ms: int, done: tuple[str, int] | None
    ) -> Status:
        keys = slot.keys
        try:
            held: dict[str, str] = self.store.get(keys.lock, "hash") or {}
        except ForeignData:
            return Status.FOREIGN
        if slot.permits:
            value = held.pop(token, None)
            if value is None:
                return Status.OK if self.store.remembered(keys.released, token) else Status.GONE
            self.store.drop_if_empty(keys.lock, held)
            status = Status.OK if parse_permit(value)[0] > self.store.now else Status.GONE
            if status is Status.OK:
                self.store.remember(keys.released, token, notice_ms)
            self.store.notice(keys, slot.limit, notice_ms)
            return status
        if held.get("token") != token:
            if self.store.remembered(keys.released, token):
                return Status.OK  # a re-sent copy of this token's own release
            return Status.GONE if "token" not in held else Status.TAKEN
        marks: dict[str, float] = {}
        if done is not None:  # foreign data at the done marks raises here, before any change
            marks = self.store.get(keys.done, "zset") or {}
        del self.store.entries[keys.lock]
        self.store.remember(keys.released, token, notice_ms)
        if done is not None:
            self.store.put(keys.done, "zset", marks, done[1])
            marks.pop(done[0], None)
            marks[done[0]] = self.store.now
            for old in list(marks)[:-_DONE_KEPT]:
                del marks[old]
        self.store.notice(keys, 1, notice_ms)
        return Status.OK

    @atomic
    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        """Lengthen *token*'s lease by *ms*, or set it to *ms* with *replace* (extend.lua,
        permit_extend.lua; its Limits' permits to the new lease): the new lease in ms, or
        GONE, TAKEN, FOREIGN."""
        return self._extend_with_rules(slot, token, ms, replace)

    def _extend_with_rules(self, slot: Slot, token: str, ms: int, replace: bool) -> int | Status:
        """The slot's own extend, then each Limit held by *token* set to the new lease
        (extend_items.lua)."""
        found = self._extend(slot, token, ms, replace)
        if isinstance(found, Status) or not slot.held_rules:
            return found
        rules = []
        for rule in slot.held_rules:
            lease = self._extend(Slot(rule.keys, rule.limit), token, found, True)
            rules.append(lease if isinstance(lease, Status) else Status.OK)
        failed = Status.first_failure(rules)
        return found if failed is Status.OK else failed

    def _extend(  # noqa: PLR0911 - one return per outcome, as extend.lua
        self, slot: Slot, token: str, ms: int, replace: bool
    ) -> int | Status:
        key = slot.keys.lock
        try:
            held: dict[str, str] = self.store.get(key, "hash") or {}
        except ForeignData:
            return Status.FOREIGN
        if not slot.permits:
            if "token" not in held:
                return Status.GONE
            if held["token"] != token:
                return Status.TAKEN
            left = self.store.pttl(key)
            ms += 0 if replace or left <= 0 else left
            self.store.expire(key, ms)
            return ms
        if token not in held:
            return Status.GONE
        now = int(self.store.now)
        expires, fence, rest = parse_permit(held[token])
        if expires <= now:
            del held[token]
            self.store.drop_if_empty(key, held)
            return Status.GONE
        ms += 0 if replace else expires - now
        held[token] = f"{now + ms}|{fence}|{rest}"
        self.store.expire(key, ms, longer_only=True)
        return ms

    @atomic
    def renew(self, items: Sequence[Renewal]) -> list[Status | QuorumUnavailable]:
        """Set each item's lease to its ``ms`` if its token still holds it (extend_items.lua):
        one status per item."""
        results = [self._extend_with_rules(item.slot, item.token, item.ms, True) for item in items]
        return [r if isinstance(r, Status) else Status.OK for r in results]

    @atomic
    def wait(self, slot: Slot, seconds: float, refused: Grant | None = None) -> None:
        """Block up to *seconds* until a release notice of *slot* is there, and take it."""
        deadline = time.monotonic() + max(seconds, 0.001)
        while not self.store.take_notice(slot.keys.notify):
            left = deadline - time.monotonic()
            # A notice for another name, or one another waiter took, goes round again.
            if left <= 0 or not self.store.notified.wait(left):
                return
            self.store.now = time.monotonic() * 1000.0

    @atomic
    def raise_fence(self, slot: Slot, fence: int, fence_ttl_ms: int) -> int:
        """Lift the name's fence counter to at least *fence* (raise_fence.lua)."""
        current = self.store.counter(slot.keys.fence) or 0
        if current >= fence:
            return current
        self.store.put(
            slot.keys.fence, "string", str(fence), fence_ttl_ms if fence_ttl_ms > 0 else None
        )
        return fence

    # -- operator controls ----------------------------------------------------------------
    @atomic
    def set_control(self, control_key: str, kind: str, value: str | None, ttl_ms: int) -> bool:
        """Set or lift one control of a name (control.lua)."""
        return flow.set_control(self.store, control_key, kind, value, ttl_ms)

    @atomic
    def controls(self, prefix: str, pattern: str = "*") -> list[Control]:
        """Every control in force under *prefix* whose name matches *pattern*."""
        return flow.controls_under(
            self.store, prefix, lambda name: fnmatch.fnmatchcase(name, pattern)
        )

    # -- reads ----------------------------------------------------------------------------
    @atomic
    def holders(self, slot: Slot) -> list[Holder]:
        """Every current acquisition of *slot*, first to expire first."""
        if slot.permits:
            return [
                Holder(token, parse_holder(record), fence, left)
                for left, token, fence, record in self.store.live_permits(slot.keys.lock)
            ]
        held: dict[str, str] = self.store.get(slot.keys.lock, "hash") or {}
        if "token" not in held:
            return []
        record, fence = parse_holder(held.get("info")), stored_int(held.get("fence"))
        return [Holder(held["token"], record, fence, self.store.pttl(slot.keys.lock))]

    @atomic
    def locked(self, slot: Slot) -> bool:
        """True when *slot* cannot be taken now."""
        if slot.permits:
            return len(self.store.live_permits(slot.keys.lock)) >= slot.limit
        return self.store.live(slot.keys.lock) is not None

    @atomic
    def was_done(self, slot: Slot, mark: str) -> bool:
        """True when a release added *mark* to the name's done marks."""
        return mark in (self.store.get(slot.keys.done, "zset") or {})

    # -- enqueue-time holds -----------------------------------------------------------------
    @atomic
    def enqueue(
        self, slot: Slot, owner: str, ttl_ms: int, record: str, *, replace: bool,
        running_blocks: bool
    ) -> Queued:  # fmt: skip
        """Take the enqueue-time hold of *slot* for task *owner*, or say whose it is
        (enqueue.lua)."""
        keys = mutex_keys(slot)
        queued: dict[str, str] = self.store.get(keys.queued, "hash") or {}
        other = queued.get("owner")
        if other is not None and other != owner and not replace:
            holder, left = parse_holder(queued.get("info")), self.store.pttl(keys.queued)
            return Queued("duplicate", other, holder, left, "queued")
        if other is None and running_blocks:
            run: dict[str, str] = self.store.get(keys.lock, "hash") or {}
            if "token" in run and run.get("owner") != owner:
                holder, left = parse_holder(run.get("info")), self.store.pttl(keys.lock)
                runner = run.get("owner") or str(holder.get("task_id") or "")
                state = "queued" if run["token"].startswith(PARKED) else "running"
                return Queued("duplicate", runner, holder, left, state)
        self.store.writable_hash(keys.queued).update(owner=owner, info=record)
        self.store.expire(keys.queued, ttl_ms)
        if other is not None and other != owner:
            return Queued("replaced", other, parse_holder(queued.get("info")))
        return Queued("queued")

    @atomic
    def dequeue(self, slot: Slot, owner: str) -> Status:
        """Give up task *owner*'s enqueue-time hold (dequeue.lua)."""
        key = mutex_keys(slot).queued
        try:
            queued: dict[str, str] = self.store.get(key, "hash") or {}
        except ForeignData:
            return Status.FOREIGN
        if queued.get("owner") is None:
            return Status.GONE
        if queued["owner"] != owner:
            return Status.TAKEN
        del self.store.entries[key]
        return Status.OK

    @atomic
    def park(
        self, slot: Slot, token: str, owner: str, ttl_ms: int, *, record: str, notice_ms: int
    ) -> Status:
        """Keep *token*'s acquisition for task *owner*'s redelivered copy (park.lua)."""
        keys = mutex_keys(slot)
        try:
            held: dict[str, str] = self.store.get(keys.lock, "hash") or {}
        except ForeignData:
            return Status.FOREIGN
        if "token" not in held:
            return Status.GONE
        if held["token"] != token:
            return Status.TAKEN
        self.store.writable_hash(keys.lock).update(token=PARKED + owner, owner=owner, info=record)
        self.store.expire(keys.lock, ttl_ms)
        self.store.notice(keys, 1, notice_ms)
        return Status.OK

    # -- rate grants ------------------------------------------------------------------------
    @atomic
    def rate(
        self, name: str, key: str, interval_us: int, burst: int, *, mode: str,
        most_us: int = 0, grace_us: int = 0
    ) -> RateGrant:  # fmt: skip
        """One GCRA decision (rate.lua): *mode* ``take``, ``queue`` or ``peek``."""
        if mode not in ("take", "queue", "peek"):
            raise ValueError(f"rate limiter {name!r}: unknown mode {mode!r}")
        now, step = round(self.store.now * 1000), interval_us  # microseconds
        state: dict[str, str] = self.store.get(key, "hash") or {}
        tat, line = stored_int(state.get("tat")) or 0, stored_int(state.get("line")) or 0
        tolerance = (burst - 1) * step
        due = mode == "queue" and line > now and tat - tolerance > now - grace_us
        tat = max(tat, now)
        next_at = tat - tolerance
        if next_at <= now and not due:
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
        self.store.writable_hash(key).update({name: str(value) for name, value in fields.items()})
        self.store.expire(key, math.ceil((until_us - round(self.store.now * 1000)) / 1000) + 1)

    # -- records beside a lock ------------------------------------------------------------
    @atomic
    def load_records(self, slot: Slot, suffix: str) -> dict[str, str]:
        """Every field of the records hash ``<lock key>:<suffix>``."""
        return dict(self.store.get(f"{slot.keys.lock}:{suffix}", "hash") or {})

    @atomic
    def claim(  # noqa: PLR0917 - the Records protocol's signature
        self, slot: Slot, suffix: str, token: str, name: str, value: str,
        version: tuple[int, int], deadline: float | None = None
    ) -> Claim:  # fmt: skip
        """Write field *name* only while *token* holds the lock, never over a newer
        version of the same fence (claim_field.lua). One store answers at once: *deadline*
        (a quorum's bound) is not needed here."""
        key = f"{slot.keys.lock}:{suffix}"
        if (self.store.get(slot.keys.lock, "hash") or {}).get("token") != token:
            return Claim("lost", detail="the lock is gone or held by another acquisition")
        current = (self.store.get(key, "hash") or {}).get(name)
        if current is not None and current != value:
            fence, n = record_version(current)
            if fence == version[0] and n >= version[1] and n >= 0:
                return Claim("stale", current)
        self.store.writable_hash(key)[name] = value
        return Claim("claimed", value)

    # -- operator reads and forced release (see admin) -------------------------------
    @atomic
    def scan(self, prefix: str, pattern: str = "*", limit: int | None = None) -> list[LockInfo]:
        return admin.scan(self.store, prefix, pattern, limit)

    @atomic
    def read(self, prefix: str, name: str) -> list[LockInfo]:
        return admin.read(self.store, prefix, name)

    def listing(self, prefix: str, query: ListQuery) -> Listing:
        """*query*'s page, from everything the store holds under the pattern (an
        in-process store needs no index)."""
        locks = self.scan(prefix, query.pattern)
        rates = self.scan_rates(prefix, query.pattern)
        return select(prefix, locks, rates, self.controls(prefix, query.pattern), query)

    @atomic
    def scan_rates(self, prefix: str, pattern: str = "*") -> list[RateInfo]:
        return admin.scan_rates(self.store, prefix, pattern)

    @atomic
    def read_rate(self, prefix: str, name: str) -> RateInfo | None:
        return admin.read_rate(self.store, prefix, name)

    @atomic
    def force_release(self, slot: Slot, fence: int | None, notice_ms: int) -> ForceRelease:
        return admin.force_release(self.store, slot, fence, notice_ms)

    @atomic
    def force_dequeue(self, slot: Slot, owner: str | None) -> ForceRelease:
        return admin.force_dequeue(self.store, slot, owner)

    # -- the lock event log -----------------------------------------------------------------
    @atomic
    def log_events(self, log_key: str, events: Sequence[str], maxlen: int, ttl_ms: int) -> None:
        """Append *events* to the capped log at *log_key* (a stream, as XADD MAXLEN), which
        goes *ttl_ms* after this write."""
        log = self.store.get(log_key, "stream")
        if log is None or log.maxlen != maxlen:
            log = collections.deque(log or (), maxlen=maxlen)
        log.extend(events)
        self.store.put(log_key, "stream", log, ttl_ms)

    @atomic
    def read_events(self, log_key: str, count: int) -> list[str]:
        """The newest *count* events of the log at *log_key*, newest first."""
        log = self.store.get(log_key, "stream")
        return [] if log is None else list(itertools.islice(reversed(log), count))
