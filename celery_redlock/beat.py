"""``LeaderScheduler``: several ``celery beat`` processes, exactly one publishing.

Run the same command on two or more hosts::

    celery -A proj beat -S celery_redlock.beat:LeaderScheduler

Each process tries to hold the lock ``beat:leader:<app.main>`` (setting
``redlock_beat_lock_name``) with a lease of ``redlock_beat_ttl`` seconds, kept
alive by the per-process renewal thread. The holder (the leader) publishes the
schedule; the others (standbys) publish nothing and wait for the lock, woken at
once by a release notice and otherwise at the holder's remaining lease, so a
SIGKILLed leader is replaced within one TTL. A leader whose lock is lost
(renewal finds it gone, its lease ran out while it was paused, Redis went
away) steps down and stands by: it never crashes beat. A standby that cannot
reach Redis logs one line and keeps waiting.

No tick is published twice across a hand-over. Leadership alone cannot promise
that: a leader paused between "I am the leader" and "publish" may resume after
its successor started. So the schedule's state lives in Redis, next to the
lock (same hash tag), and every tick is *claimed* before it is published::

    t=10.0  A (fence 7) claims tick "heartbeat @10.0": fenced_hset checks that the
            lock still holds fence 7 and that the stored record is the one A saw,
            writes the new record, then A publishes.
    t=10.4  A is SIGSTOPped (or SIGKILLed) before its next renewal.
    t=12.4  A's lease expires; B's wait ends, B acquires (fence 8) and loads every
            stored record: "heartbeat" last ran at 10.0, so B's schedule goes on
            from there and fires the next tick (not the one A already sent).
    t=13.0  A resumes and tries to claim "heartbeat @13.0": the lock holds fence
            8, so the claim is refused; A publishes nothing, logs that it lost
            leadership and stands by.

A claim is written before the message is sent, so a leader that dies between
the two loses that one tick: ticks are published at most once, never twice.

The local ``--schedule`` file of ``PersistentScheduler`` is not used: Redis holds
the schedule state all beats share (several beats on one host would otherwise
fight over one shelve file), so this class builds on the in-memory ``Scheduler``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from celery.beat import Scheduler
from celery.utils.time import maybe_make_aware
from redis.exceptions import RedisError

from .core.connect import connect, mask_url
from .core.errors import ConfigError, RedlockError
from .core.lock import Lock
from .core.scripts import FENCED_HSET

__all__ = ["LeaderScheduler", "LockStore", "lock_store"]

log = logging.getLogger("celery_redlock.beat")

_REDIS_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class LockStore:
    """Where an app's locks live and the lock settings beat and ``celery locks`` need."""

    url: str | list[str]
    key_prefix: str = "redlock:"
    ttl: float = 30.0
    beat_ttl: float = 30.0
    beat_lock_name: str = "beat:leader"
    client_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_redlock(self) -> bool:
        """True when the locks live on several independent masters (a list of URLs)."""
        return isinstance(self.url, list)

    @property
    def urls(self) -> list[str]:
        """The URL(s), always as a list."""
        return list(self.url) if isinstance(self.url, list) else [self.url]

    def describe(self) -> str:
        """The URL(s) with passwords masked."""
        return ", ".join(mask_url(u) for u in self.urls)

    def clients(self) -> list[tuple[str, Any]]:
        """``(masked url, client)`` per master: one for a single Redis, N for Redlock."""
        return [(mask_url(u), connect(u, **dict(self.client_options))) for u in self.urls]


def lock_store(app: Any) -> LockStore:
    """Read the lock store settings from ``app.conf`` (``redlock_*``).

    ``redlock_url`` is a URL or a list of URLs; without it the broker URL is used
    when the broker is Redis, anything else is a :class:`ConfigError` saying what
    to set.
    """
    conf = app.conf
    url = conf.get("redlock_url")
    if isinstance(url, (list, tuple)):
        if not url or not all(isinstance(u, str) and u for u in url):
            raise ConfigError(f"redlock_url must be a URL or a list of URLs, got {url!r}")
        url = list(url) if len(url) > 1 else url[0]
    elif url is None or url == "":
        broker = conf.get("broker_write_url") or conf.get("broker_url")
        if isinstance(broker, (list, tuple)):
            broker = broker[0] if broker else None
        first = broker.split(";", 1)[0].strip() if isinstance(broker, str) else ""
        if first.split("://", 1)[0].lower() not in _REDIS_SCHEMES:
            shown = mask_url(first) if first else "not set"
            raise ConfigError(
                f"redlock_url is not set and the broker ({shown}) is not Redis: set "
                "app.conf.redlock_url = 'redis://host:6379/1'"
            )
        url = first
    elif not isinstance(url, str):
        raise ConfigError(f"redlock_url must be a URL or a list of URLs, got {type(url).__name__}")
    prefix = conf.get("redlock_key_prefix")
    prefix = "redlock:" if prefix is None else prefix
    if not isinstance(prefix, str):
        raise ConfigError(f"redlock_key_prefix must be a string, got {prefix!r}")
    ttl = _seconds(conf.get("redlock_ttl"), 30.0, "redlock_ttl")
    beat_ttl = _seconds(conf.get("redlock_beat_ttl"), ttl, "redlock_beat_ttl")
    name = conf.get("redlock_beat_lock_name") or f"beat:leader:{app.main or 'celery'}"
    if not isinstance(name, str):
        raise ConfigError(f"redlock_beat_lock_name must be a string, got {name!r}")
    options = conf.get("redlock_client_options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"redlock_client_options must be a dict, got {options!r}")
    return LockStore(url, prefix, ttl, beat_ttl, name, dict(options))


def _seconds(value: Any, default: float, what: str) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{what} must be a number of seconds > 0, got {value!r}")
    return float(value)


class LeaderScheduler(Scheduler):  # type: ignore[misc]  # celery is untyped
    """A beat scheduler that publishes only while it holds the beat leader lock.

    Builds on ``celery.beat.Scheduler`` (in memory) rather than
    ``PersistentScheduler``: the state that must survive a restart or a
    hand-over (when each entry last ran) is kept in Redis, shared by every beat.
    """

    #: Standbys try again (and leaders re-check their lock) this often, as a
    #: fraction of the leader lease.
    retry_fraction = 1 / 3

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self.store = lock_store(app)
        if self.store.is_redlock:
            raise ConfigError(
                "LeaderScheduler needs one Redis (a redis://, rediss://, unix://, "
                f"sentinel:// or cluster URL); redlock_url lists {len(self.store.urls)} "
                "independent masters"
            )
        self.retry_interval = max(0.05, self.store.beat_ttl * self.retry_fraction)
        self._client: Any = None
        self._leader_lock: Lock | None = None
        self._leading = False
        self._lost = threading.Event()
        self._unreachable = False
        self._standby_logged = False
        #: entry name -> the record this leader last saw in Redis ('' = none)
        self._records: dict[str, str] = {}
        super().__init__(app, *args, **kwargs)

    # -- leadership -------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True while this scheduler holds the leader lock and publishes."""
        return self._leading

    @property
    def leader_lock(self) -> Lock:
        """The leader lock (created on first use, so a lazy scheduler never connects)."""
        if self._leader_lock is None:
            self._client = connect(self.store.urls[0], **dict(self.store.client_options))
            self._leader_lock = Lock(
                self._client,
                self.store.beat_lock_name,
                self.store.beat_ttl,
                key_prefix=self.store.key_prefix,
                auto_renew=True,
                owner_info={"role": "beat-leader", "app": self.app.main},
                on_lost=self._on_lost,
            )
        return self._leader_lock

    @property
    def records_key(self) -> str:
        """The hash of per-entry tick records (same hash tag as the leader lock)."""
        return f"{self.leader_lock.keys.lock}:ticks"

    def _on_lost(self, _lock: Any) -> None:
        # Runs on the renewal thread: only flag it; tick() steps down on the beat thread.
        self._lost.set()

    def _try_lead(self) -> bool:
        """One attempt at leadership; waits up to ``retry_interval`` for the holder to go."""
        lock = self.leader_lock
        try:
            won = lock.acquire(blocking=True, timeout=self.retry_interval)
        except (RedlockError, RedisError) as exc:
            if not self._unreachable:
                self._unreachable = True
                log.warning(
                    "beat: cannot reach the lock store at %s (%s); standing by, "
                    "trying again every %.1f s",
                    self.store.describe(),
                    _one_line(exc),
                    self.retry_interval,
                )
            time.sleep(self.retry_interval)  # a refused connection fails at once: pace retries
            return False
        if self._unreachable:
            self._unreachable = False
            log.info("beat: the lock store at %s answers again", self.store.describe())
        if not won:
            if not self._standby_logged:
                self._standby_logged = True
                log.info(
                    "beat: standing by; %r is held by %s",
                    self.store.beat_lock_name,
                    _describe_leader(lock.holder),
                )
            return False
        self._lost.clear()
        try:
            self._load_records()
        except RedisError as exc:
            log.warning(
                "beat: took the leader lock but could not read the schedule state (%s)", exc
            )
            self._give_up_lock()
            return False
        self._leading = True
        self._standby_logged = False
        log.info(
            "beat: this beat (pid %d) is now the leader (%r, fence %s); publishing the schedule",
            os.getpid(),
            self.store.beat_lock_name,
            lock.fence,
        )
        return True

    def _step_down(self, reason: str) -> None:
        if not self._leading:
            return
        self._leading = False
        self._give_up_lock()
        log.warning(
            "beat: lost leadership of %r (%s); this beat stands by and publishes nothing",
            self.store.beat_lock_name,
            reason,
        )

    def _give_up_lock(self) -> None:
        lock = self._leader_lock
        if lock is None or lock.fence is None or lock.lost:
            return
        with contextlib.suppress(RedlockError, RedisError):
            lock.release()

    def _still_leading(self) -> bool:
        lock = self._leader_lock
        if lock is None or not self._leading:
            return False
        if self._lost.is_set() or lock.lost:
            self._step_down("the lock was lost: removed, expired or taken over")
            return False
        if time.monotonic() >= lock.valid_until:
            self._step_down("the lease ran out before a confirmed renewal")
            return False
        return True

    # -- schedule state in Redis --------------------------------------------------------
    def _load_records(self) -> None:
        """Continue the schedule from what earlier leaders published (called on takeover)."""
        raw = self._client.hgetall(self.records_key)
        self._records = {}
        for name_raw, value_raw in raw.items():
            name, value = _text(name_raw), _text(value_raw)
            self._records[name] = value
            self._apply_record(name, value)
        self._heap = None  # recompute every entry's next run from the loaded state

    def _apply_record(self, name: str, value: str) -> None:
        entry = self.schedule.get(name)
        if entry is None or not value:
            return
        try:
            record = json.loads(value)
            at = datetime.fromtimestamp(float(record["at"]), tz=timezone.utc)
        except (ValueError, KeyError, TypeError):
            log.warning("beat: ignoring an unreadable record for %r: %r", name, value)
            return
        entry.last_run_at = at.astimezone(self.app.timezone)
        entry.total_run_count = max(int(record.get("n") or 0), entry.total_run_count or 0)

    def _claim(self, entry: Any) -> bool:
        """Record this tick of *entry* in Redis; True when this leader may publish it."""
        if not self._still_leading():
            return False
        lock = self.leader_lock
        current = self.schedule.get(entry.name, entry)
        at = maybe_make_aware(current.last_run_at).timestamp()
        record = json.dumps(
            {
                "at": round(at, 6),
                "n": current.total_run_count,
                "fence": lock.fence,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            },
            separators=(",", ":"),
        )
        seen = self._records.get(entry.name, "")
        try:
            reply = FENCED_HSET(
                self._client,
                [lock.keys.lock, self.records_key],
                [str(lock.fence), entry.name, seen, record],
            )
        except RedisError as exc:
            log.warning(
                "beat: could not record the tick of %r (%s); not publishing it", entry.name, exc
            )
            return False
        code = int(reply[0])
        if code == 1:
            self._records[entry.name] = record
            return True
        if code == 0:
            self._step_down("the lock is gone or held by another beat")
            return False
        stored = _text(reply[1])
        log.warning(
            "beat: %r was published by another beat since this one read the schedule; "
            "not publishing it again",
            entry.name,
        )
        self._records[entry.name] = stored
        self._apply_record(entry.name, stored)
        self._heap = None
        return False

    # -- Scheduler hooks ----------------------------------------------------------------
    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Publish what is due while leading; while standing by, try to lead and return."""
        try:
            if self._leading:
                self._still_leading()
            if not self._leading and not self._try_lead():
                return 0.01  # _try_lead already waited (for the holder, or out an outage)
            interval = super().tick(*args, **kwargs)
            return float(min(interval, self.retry_interval)) if interval else 0.0
        except Exception:  # beat must outlive any error of ours
            log.exception("beat: scheduler tick failed; trying again")
            return self.retry_interval

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Publish *entry* only after this leader claimed its tick in Redis."""
        if self._claim(entry):
            super().apply_entry(entry, producer=producer)

    def close(self) -> None:
        """Sync, then hand leadership over at once (a standby is woken by the release)."""
        try:
            super().close()
        finally:
            if self._leading:
                self._leading = False
                self._give_up_lock()
                log.info("beat: resigned leadership of %r", self.store.beat_lock_name)

    @property
    def info(self) -> str:
        """Shown in beat's start-up banner."""
        return (
            f"    . leader lock -> {self.store.beat_lock_name!r} at {self.store.describe()} "
            f"(ttl {self.store.beat_ttl:g}s)"
        )


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _describe_leader(holder: Mapping[str, Any]) -> str:
    if not holder.get("pid"):
        return "another beat"
    return f"the beat with pid {holder['pid']} on {holder.get('hostname') or '?'}"


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
