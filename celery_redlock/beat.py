"""``LeaderScheduler``: several ``celery beat`` processes, exactly one publishing.

Run the same command on two or more hosts::

    celery -A proj beat -S celery_redlock.beat:LeaderScheduler

Each process tries to hold the lock ``beat:leader:<app.main>`` (setting
``redlock_beat_lock_name``) with a lease of ``redlock_beat_ttl`` seconds, kept
alive by the per-process renewal thread. The lock is the app's usual one
(the app state's ``make_lock``): a ``Lock`` on one Redis, or a ``Redlock`` held by
a majority when ``redlock_url`` lists several masters. The holder (the leader)
publishes the schedule; the others (standbys) publish nothing and wait for the
lock, woken at once by a release notice and otherwise at the holder's remaining
lease, so a SIGKILLed leader is replaced within one TTL. A leader whose lock is
lost (renewal finds it gone, its lease ran out while it was paused, Redis went
away) steps down and stands by: it never crashes beat. A standby that cannot
reach Redis logs one line and keeps waiting.

No tick is published twice across a hand-over. Leadership alone cannot promise
that: a leader paused between "I am the leader" and "publish" may resume after
its successor started. So the schedule's state lives in Redis, next to the
lock (same hash tag: ``<prefix>{beat:leader:<app>}:ticks``), and every tick is
*claimed* before it is published (``celery_redlock.core.records``)::

    t=10.0  A (token ta, fence 7) claims "heartbeat" n=42: on every master, the write
            happens only while the lock there holds ta. Written on a majority (one
            Redis: on it) and confirmed within A's lease, so A publishes.
    t=10.4  A is SIGSTOPped (or SIGKILLed) before its next renewal.
    t=12.4  A's lease expires; B's wait ends, B acquires (fence 8) and loads the
            records from every master that answers (at least a majority), taking
            per entry the newest (highest fence, then n): "heartbeat" last ran at
            10.0 as n=42, so B goes on from there and fires the next tick, not the
            one A already sent.
    t=13.0  A resumes and claims n=43: the lock holds B's token on a majority, so
            the claim is refused; A publishes nothing, logs that it lost
            leadership and stands by.

Under Redlock the claim checks the token, not the fence: each master INCRs its own
counter, so one acquisition's per-master ``fence`` fields differ while its token is
the same everywhere. A claim on a minority only (the rest did not answer) is not
published. See ``celery_redlock/core/records.py`` for the full argument.

A claim is written before the message is sent, so a leader that dies between
the two loses that one tick: ticks are published at most once, never twice.

Any scheduler can be led. ``redlock_beat_scheduler`` names the one ``LeaderScheduler``
leads (an import path or a class; default: Celery's in-memory ``Scheduler``), and
``leader_of(cls)`` gives the same for a class in code: a class whose instances keep
the led scheduler's own schedule (django-celery-beat's ``DatabaseScheduler`` reading
the database, ``PersistentScheduler`` its file, RedBeat its entries in Redis) on
every beat, and publish only while leading. Standbys keep that schedule current
(they read it as the led scheduler does, and publish nothing). When an entry last
ran comes from where the led scheduler keeps it or from the tick records in Redis,
whichever is newer; a reload of the led schedule (the database changed) gets the
records applied again.

Every tick is claimed, however the led scheduler publishes it: Celery's ``tick``
calls ``apply_entry`` (claimed there), RedBeat's own ``tick`` calls ``apply_async``
directly (claimed there, unless it came through ``apply_entry``). RedBeat's own
beat lock is switched off for the scheduler led here: the leader lock decides.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from celery.beat import Scheduler
from celery.utils.imports import symbol_by_name
from celery.utils.time import maybe_make_aware

from .app.config import Settings, StartupConfigError
from .app.observability import BEAT_ROLE
from .app.state import AppState, state_for
from .core import STORE_ERRORS
from .core.connect import mask_url
from .core.errors import ConfigError, RedlockError, one_line
from .core.lock import Lock
from .core.records import LockRecords

__all__ = ["LeaderScheduler", "leader_of"]

log = logging.getLogger("celery_redlock.beat")

#: Suffix of the hash of tick records, next to the leader lock.
RECORDS_SUFFIX = "ticks"
#: What a lock backend that cannot answer raises (core errors), and the client-side Redis
#: errors it lets through as they are (a client whose pool is exhausted): beat stands by
#: on either instead of crashing.
_STORE_ERRORS: tuple[type[Exception], ...] = (RedlockError, *STORE_ERRORS)


def _beat_ttl(settings: Settings) -> float:
    """The leader lease: ``redlock_beat_ttl``, else ``redlock_ttl``."""
    ttl = settings.beat_ttl
    return float(settings.ttl if ttl is None else ttl)


def _beat_lock_name(settings: Settings, app: Any) -> str:
    """The leader lock's name: ``redlock_beat_lock_name``, else ``beat:leader:<app.main>``."""
    name = settings.beat_lock_name
    return str(name) if name else f"beat:leader:{app.main or 'celery'}"


class LeaderScheduler(Scheduler):  # type: ignore[misc]  # celery is untyped
    """A beat scheduler that publishes only while it holds the beat leader lock.

    ``LeaderScheduler`` itself leads the scheduler ``redlock_beat_scheduler`` names:
    made with that setting, it is an instance of ``leader_of(that class)``. Without the
    setting it leads Celery's in-memory ``Scheduler``: the state that must survive a
    restart or a hand-over (when each entry last ran) is kept in Redis, shared by every
    beat.
    """

    #: Standbys try again (and leaders re-check their lock) this often, as a
    #: fraction of the leader lease.
    retry_fraction = 1 / 3

    def __new__(cls, *args: Any, **kwargs: Any) -> LeaderScheduler:
        # Beat's entry point: the app's state is found here once, for the choice of the
        # led scheduler and for __init__ (which every scheduler made here runs next).
        app = kwargs.get("app", args[0] if args else None)
        state = state_for(app) if app is not None else None
        kind = cls
        if cls is LeaderScheduler:
            led = _led_scheduler(state)
            if led is not Scheduler:
                kind = leader_of(led)
        made: LeaderScheduler = super().__new__(kind)
        if state is not None:
            made._app_state = state
        return made

    #: The app's state (settings, backend), found by ``__new__`` from the same app.
    _app_state: AppState

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        state = self._app_state
        try:  # a bad setting: `celery beat` prints one line and exits 1
            settings = state.settings
            settings.check_single_process(
                "beat's leader election is between beat processes, which would each see "
                "only their own"
            )
        except ConfigError as exc:
            raise StartupConfigError(str(exc)) from None
        #: The leader lock's name and lease (seconds).
        self.lock_name = _beat_lock_name(settings, app)
        self.ttl = _beat_ttl(settings)
        url = settings.urls
        self._where = ", ".join(mask_url(u) for u in (url if isinstance(url, list) else [url]))
        self.retry_interval = max(0.05, self.ttl * self.retry_fraction)
        self._leader_lock: Lock | None = None
        self._tick_records: LockRecords | None = None
        #: The newest tick of each entry this beat knows of: (when, run count), from the
        #: records in Redis at take-over and from its own claims since.
        self._ticks: dict[str, tuple[float, int]] = {}
        #: The led scheduler's schedule as last seen (a reload gets the ticks again).
        self._seen: Any = None
        self._leading = False
        self._lost = threading.Event()
        self._unreachable = False
        self._standby_logged = False
        #: The standby problem logged last (foreign data, unreadable records): logged once.
        self._problem = ""
        #: True inside ``apply_entry``, which claimed the tick: ``apply_async`` then publishes
        #: without claiming it again.
        self._claimed = False
        #: Per entry, the tick of a predecessor last found not to be re-sent (logged once).
        self._skipped: dict[str, float] = {}
        super().__init__(app, *args, **kwargs)
        #: The line saying the led scheduler's own lock is off (the banner shows it), or "".
        self._own_lock_note = self._switch_off_own_lock(quiet=bool(kwargs.get("lazy")))

    # -- the led scheduler's own lock ---------------------------------------------------
    def _switch_off_own_lock(self, quiet: bool) -> str:
        """Switch off RedBeat's own beat lock: this leader decides who leads.

        RedBeat (``redbeat.RedBeatScheduler`` and its subclasses) takes a lock of its own
        (``redbeat::lock``, 25 min by default) in its ``beat_init`` handler, extends it
        in ``tick`` and releases it in ``close``, each only while the scheduler's
        ``lock_key`` is set: with it on, a standby blocks in that handler until RedBeat's
        lock expires. ``lock_key = None`` is RedBeat's own switch (what the setting
        ``redbeat_lock_key = None`` gives), so it is set here; a RedBeat without that
        attribute gets a WARNING naming the setting instead. Both lines are logged by the
        scheduler that runs, not by the lazy one beat's banner makes (*quiet*).
        """
        if not _is_redbeat(type(self)):
            return ""
        name = _public_name(_led_class(type(self)))
        if "lock_key" not in vars(self):  # not the RedBeat this is written for
            if quiet:
                return ""
            log.warning(
                "beat: cannot switch off the own lock of %s (it has no lock_key): its "
                "lock, not LeaderScheduler, may decide who leads and keep a standby "
                "waiting at start-up; set redbeat_lock_key = None",
                name,
            )
            return ""
        self.lock_key = None
        note = f"leading {name} with its own lock off: LeaderScheduler decides who leads"
        if not quiet:
            log.info("beat: %s", note)
        return note

    # -- leadership -------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True while this scheduler holds the leader lock and publishes."""
        return self._leading

    @property
    def leader_lock(self) -> Lock:
        """The leader lock, a ``Lock`` or a ``Redlock`` (created on first use, so a lazy
        scheduler never connects)."""
        if self._leader_lock is None:
            self._leader_lock = self._app_state.make_lock(
                self.lock_name,
                self.ttl,
                auto_renew=True,
                owner_info={"role": BEAT_ROLE, "app": self.app.main},
                on_lost=self._on_lost,
            )
        return self._leader_lock

    @property
    def tick_records(self) -> LockRecords:
        """The per-entry tick records next to the leader lock (``...:ticks``)."""
        if self._tick_records is None:
            self._tick_records = LockRecords(self.leader_lock, RECORDS_SUFFIX)
        return self._tick_records

    @property
    def records_key(self) -> str:
        """The hash of per-entry tick records (same hash tag as the leader lock)."""
        return self.tick_records.key

    def _on_lost(self, _lock: Any) -> None:
        # Runs on the renewal thread: only flag it; tick() steps down on the beat thread.
        self._lost.set()

    def _try_lead(self) -> bool:
        """One attempt at leadership; waits up to ``retry_interval`` for the holder to go."""
        lock = self.leader_lock
        try:
            won = lock.acquire(blocking=True, timeout=self.retry_interval)
        except ConfigError as exc:
            # Foreign data at the leader lock's keys: no beat leads until someone removes it.
            self._stand_by(f"beat: cannot take the leader lock: {one_line(exc)}", logging.ERROR)
            return False
        except _STORE_ERRORS as exc:
            if not self._unreachable:
                self._unreachable = True
                log.warning(
                    "beat: cannot reach the lock store at %s (%s); standing by, "
                    "trying again every %.1f s",
                    self._where,
                    one_line(exc),
                    self.retry_interval,
                )
            time.sleep(self.retry_interval)  # a refused connection fails at once: pace retries
            return False
        if self._unreachable:
            self._unreachable = False
            log.info("beat: the lock store at %s answers again", self._where)
        if not won:
            if not self._standby_logged:
                self._standby_logged = True
                log.info(
                    "beat: standing by; %r is held by %s",
                    self.lock_name,
                    _describe_leader(lock.holder),
                )
            return False
        self._lost.clear()
        try:
            self._load_records()
        except Exception as exc:  # whatever failed, never keep the lock without leading
            self._give_up_lock()
            if isinstance(exc, ConfigError):
                problem = f"beat: the schedule state in Redis is unreadable: {one_line(exc)}"
                self._stand_by(problem, logging.ERROR)
            elif isinstance(exc, _STORE_ERRORS):
                problem = (
                    "beat: took the leader lock but could not read the schedule state "
                    f"({one_line(exc)})"
                )
                self._stand_by(problem, logging.WARNING)
            else:
                log.exception("beat: reading the schedule state from %r failed", self.records_key)
                time.sleep(self.retry_interval)
            return False
        self._leading = True
        self._standby_logged = False
        self._problem = ""
        log.info(
            "beat: this beat (pid %d) is now the leader (%r, fence %s); publishing the schedule",
            os.getpid(),
            self.lock_name,
            lock.fence,
        )
        return True

    def _stand_by(self, problem: str, level: int) -> None:
        """Log *problem* (once until it changes: not a line per retry) and pace the retries."""
        if problem != self._problem:
            self._problem = problem
            log.log(level, "%s; standing by, retrying every %.1f s", problem, self.retry_interval)
        time.sleep(self.retry_interval)

    def _step_down(self, reason: str) -> None:
        if not self._leading:
            return
        self._leading = False
        self._give_up_lock()
        log.warning(
            "beat: lost leadership of %r (%s); this beat stands by and publishes nothing",
            self.lock_name,
            reason,
        )

    def _give_up_lock(self) -> None:
        lock = self._leader_lock
        if lock is None or lock.fence is None or lock.lost:
            return
        with contextlib.suppress(*_STORE_ERRORS):
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
        for name, value in self.tick_records.load().items():
            self._apply_record(name, value)
        self._heap = None  # recompute every entry's next run from the loaded state

    def _apply_record(self, name: str, value: str) -> None:
        if not value:
            return
        try:
            record = json.loads(value)
            at = float(record["at"])
            count = int(record.get("n") or 0)
            datetime.fromtimestamp(at, tz=timezone.utc)  # a time at all
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, OSError):
            # Not written by a LeaderScheduler (or by an incompatible one): start this entry
            # afresh rather than stop the whole schedule over it.
            log.warning(
                "beat: ignoring an unreadable record for %r in %r: %.200r",
                name,
                self.records_key,
                value,
            )
            return
        self._know_tick(name, at, count)
        self._apply_tick(self.schedule.get(name))

    def _know_tick(self, name: str, at: float, count: int) -> None:
        known = self._ticks.get(name)
        if known is None or (at, count) > known:
            self._ticks[name] = (at, count)

    def _apply_tick(self, entry: Any) -> bool:
        """Give the led schedule's *entry* the newest known tick, where the led
        scheduler's own (its database, its file, RedBeat's entry in Redis) is older; True
        when that moved the entry's last run on."""
        known = None if entry is None else self._ticks.get(entry.name)
        if known is None:
            return False
        at, count = known
        own = entry.last_run_at
        newer = own is None or maybe_make_aware(own).timestamp() < at
        if newer:
            when = datetime.fromtimestamp(at, tz=timezone.utc)
            entry.last_run_at = when.astimezone(self.app.timezone)
        entry.total_run_count = max(count, entry.total_run_count or 0)
        return newer

    def _led_schedule(self) -> Any:
        """The led scheduler's schedule, read as it reads it (a ``DatabaseScheduler``
        reloads it when the database changed, RedBeat reads it from Redis each time); a
        reload gets the known ticks again."""
        schedule = self.schedule
        if schedule is not self._seen:
            self._seen = schedule
            for name in self._ticks:
                self._apply_tick(schedule.get(name))
        return schedule

    def _sent_before(self, entry: Any) -> bool:
        """True when an earlier leader's claim (the tick records) is newer than *entry*'s
        own last run and, counted from it, *entry* is not due: that tick is not sent again.

        Celery's ``tick`` needs no such check (its heap is rebuilt from the records at
        take-over); a led scheduler that publishes through ``apply_async`` from its own
        ``tick`` (RedBeat, reading each entry from Redis) decides what is due from its own
        state, which a leader killed or paused between its claim and its publish left
        behind the records.
        """
        if not self._apply_tick(entry):
            return False
        due, _next = entry.is_due()
        if due:
            return False
        at = self._ticks[entry.name][0]
        if self._skipped.get(entry.name) != at:
            self._skipped[entry.name] = at
            log.info(
                "beat: %r was claimed at %s by an earlier leader and is not due again yet; "
                "not publishing it",
                entry.name,
                datetime.fromtimestamp(at, tz=timezone.utc).isoformat(),
            )
        return True

    def _claim(self, entry: Any) -> bool:
        """Record this tick of *entry* in Redis; True when this leader may publish it."""
        if not self._still_leading():
            return False
        # This tick: the run after the entry as it was due (Celery reserves the next entry
        # before it publishes this one), numbered above any tick this beat knows of.
        known = self._ticks.get(entry.name, (0.0, 0))
        count = max((entry.total_run_count or 0) + 1, known[1] + 1)
        at = time.time()
        record = {"at": round(at, 6), "pid": os.getpid(), "host": socket.gethostname()}
        claim = self.tick_records.claim(entry.name, record, count)
        if claim.outcome == "claimed":
            self._know_tick(entry.name, at, count)
            return True
        if claim.outcome == "lost":
            self._step_down(claim.detail)
            return False
        if claim.outcome == "unavailable":
            log.warning(
                "beat: could not record the tick of %r in %r (%s); not publishing it",
                entry.name,
                self.records_key,
                claim.detail,
            )
            return False
        log.warning(
            "beat: %r was already recorded past this tick (a newer record is stored); "
            "not publishing it again",
            entry.name,
        )
        self._apply_record(entry.name, claim.record)
        self._heap = None
        return False

    # -- Scheduler hooks ----------------------------------------------------------------
    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Publish what is due while leading; while standing by, try to lead and return."""
        try:
            if self._leading:
                self._still_leading()
            if not self._leading:
                self._led_schedule()  # a standby keeps the led schedule current
                if not self._try_lead():
                    return 0.01  # _try_lead already waited (for the holder, or an outage)
            self._led_schedule()
            interval = super().tick(*args, **kwargs)
            return float(min(interval, self.retry_interval)) if interval else 0.0
        except Exception:  # beat must outlive any error of ours
            log.exception("beat: scheduler tick failed; trying again")
            return self.retry_interval

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Publish *entry* only after this leader claimed its tick in Redis (Celery's
        ``tick`` publishes through here)."""
        if not self._claim(entry):
            return
        self._claimed = True
        try:
            super().apply_entry(entry, producer=producer)
        finally:
            self._claimed = False

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Publish *entry*; a tick that did not come through ``apply_entry`` (RedBeat's
        ``tick`` calls this directly) is claimed here first. None when it is not sent."""
        if not self._claimed and (self._sent_before(entry) or not self._claim(entry)):
            return None
        return super().apply_async(entry, producer=producer, advance=advance, **kwargs)

    def close(self) -> None:
        """Sync, then hand leadership over at once (a standby is woken by the release)."""
        try:
            super().close()
        finally:
            if self._leading:
                self._leading = False
                self._give_up_lock()
                log.info("beat: resigned leadership of %r", self.lock_name)

    @property
    def info(self) -> str:
        """Shown in beat's start-up banner."""
        lines = [f"    . leader lock -> {self.lock_name!r} at {self._where} (ttl {self.ttl:g}s)"]
        if self._own_lock_note:
            lines.append(f"    . {self._own_lock_note}")
        return "\n".join(lines)


_leaders: dict[type, type] = {}
_leaders_lock = threading.Lock()


def leader_of(scheduler: Any) -> type[LeaderScheduler]:
    """The class that leads *scheduler* (a ``celery.beat.Scheduler`` subclass, or its import
    path): it keeps *scheduler*'s schedule, and publishes only while it holds the beat
    leader lock, as :class:`LeaderScheduler` does. The same class for the same
    *scheduler*. A ConfigError gives the fix for a path that does not resolve, a class
    that is not a Scheduler, or a leader asked to lead a leader.

    >>> from django_celery_beat.schedulers import DatabaseScheduler
    >>> DatabaseLeader = leader_of(DatabaseScheduler)   # celery beat -S proj.beat:DatabaseLeader
    """
    led = _resolve_scheduler(scheduler, "leader_of()")
    if led is Scheduler:
        return LeaderScheduler
    with _leaders_lock:
        made = _leaders.get(led)
        if made is None:
            name = f"Leader{led.__name__}"
            doc = f"Leads {led.__module__}.{led.__qualname__}: see LeaderScheduler."
            attrs = {"__module__": __name__, "__qualname__": name, "__doc__": doc}
            made = _leaders[led] = type(name, (LeaderScheduler, led), attrs)
    return made


def _resolve_scheduler(value: Any, where: str) -> type:
    """The scheduler class *value* names, or a ConfigError (naming *where*) with the fix."""
    example = "'django_celery_beat.schedulers:DatabaseScheduler'"
    if isinstance(value, str):
        try:
            value = symbol_by_name(value)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(
                f"{where}: {value!r} does not resolve ({type(exc).__name__}: {exc}); give "
                f"the import path of a celery.beat.Scheduler subclass, such as {example}"
            ) from None
    if not (isinstance(value, type) and issubclass(value, Scheduler)):
        raise ConfigError(
            f"{where}: {value!r} is not a celery.beat.Scheduler subclass; give one, "
            f"such as {example}, or leave it unset for Celery's in-memory Scheduler"
        )
    led: type = value
    if issubclass(led, LeaderScheduler):
        raise ConfigError(
            f"{where}: {led.__name__} is a leader itself; name the scheduler it should "
            f"lead, such as {example} (beat's -S stays celery_redlock.beat:LeaderScheduler)"
        )
    return led


def _led_scheduler(state: AppState | None) -> type:
    """The scheduler ``redlock_beat_scheduler`` of *state*'s app names; at beat start a bad
    one stops beat with one line."""
    plain: type = Scheduler
    if state is None:
        return plain
    try:
        value = state.settings.beat_scheduler
        return plain if value is None else _resolve_scheduler(value, "redlock_beat_scheduler")
    except ConfigError as exc:
        raise StartupConfigError(str(exc)) from None


def _is_redbeat(kind: type) -> bool:
    """Whether *kind* leads a RedBeat scheduler (a class of the ``redbeat`` package in its
    MRO): found by module, so redbeat is never imported."""
    return any(base.__module__.partition(".")[0] == "redbeat" for base in kind.__mro__)


def _led_class(kind: type) -> type:
    """The scheduler class a leader class *kind* leads: the first in its MRO that is not a
    leader (``leader_of(cls)`` puts ``cls`` right after ``LeaderScheduler``)."""
    return next(base for base in kind.__mro__ if not issubclass(base, LeaderScheduler))


def _public_name(kind: type) -> str:
    """``package.Name`` when the top-level package exports *kind* under its name (as
    ``redbeat.RedBeatScheduler``), else ``module.Name``."""
    top = sys.modules.get(kind.__module__.partition(".")[0])
    if top is not None and getattr(top, kind.__qualname__, None) is kind:
        return f"{top.__name__}.{kind.__qualname__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def _describe_leader(holder: Mapping[str, Any]) -> str:
    if not holder.get("pid"):
        return "another beat"
    return f"the beat with pid {holder['pid']} on {holder.get('hostname') or '?'}"
