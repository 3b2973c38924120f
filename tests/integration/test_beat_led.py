"""``LeaderScheduler`` leading other schedulers, on real processes and a throwaway Redis:
django-celery-beat's ``DatabaseScheduler`` (two beats sharing one SQLite file),
``PersistentScheduler`` (a schedule file each), RedBeat's ``RedBeatScheduler`` (with
RedBeat's defaults, its own lock on), and beat embedded in two workers
(``worker -B --scheduler``).

What each beat published is read from its own log: Celery's beat (and RedBeat) logs one
``Sending due task <entry> (<task>)`` line per message, with the time; the RedBeat
tests also count the messages on the broker (nobody consumes them).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from redbeat import RedBeatScheduler
from redbeat.schedulers import RedBeatSchedulerEntry
from servers import RedisServer, wait_for
from test_beat import RECORDS_KEY
from workers import stop_group

from celery_redlock.beat import LeaderScheduler

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TTL = 2.0  # the leader lease of every beat here
_SENT = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/[^\]]*\] Scheduler: Sending due task (\S+) "
)


class Proc:
    """A `celery` subprocess in its own process group, logging to a file."""

    def __init__(
        self, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path = ROOT
    ) -> None:
        self.log_path = log_path
        env = {
            **env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        }
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", *argv], cwd=cwd, env={**os.environ, **env},
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sent(self, entry: str | None = None) -> list[float]:
        """When this process published (entry *entry*, or any), from its log."""
        found = []
        for line in self.text().splitlines():
            match = _SENT.match(line)
            if match and (entry is None or match.group(2) == entry):
                stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
                found.append(stamp.timestamp())
        return found

    def kill(self) -> float:
        """SIGKILL the whole group (a beat, or a worker with its pool and embedded beat)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        killed = time.time()
        self.proc.wait(10)
        return killed

    def stop(self) -> bool:
        """SIGTERM, then SIGKILL after 15 s; False when it took the SIGKILL."""
        return stop_group(self.proc)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in started:
            if not proc.stop():  # said in the warnings summary, with what it was doing
                warnings.warn(
                    f"{proc.log_path.name} did not exit within 15 s of SIGTERM; its log "
                    f"ends: {proc.text()[-2000:]}",
                    stacklevel=1,
                )


def _leader_and_standby(
    argv_of: Callable[[str], list[str]], env: dict[str, str], tmp_path: Path, procs: list[Proc]
) -> tuple[Proc, Proc]:
    """Start "a" (``argv_of("a")``) and wait until it leads, then "b" until it stands by."""
    a = Proc(argv_of("a"), env, tmp_path / "a.log")
    procs.append(a)
    wait_for(lambda: "is now the leader" in a.text(), 40, "the first beat to lead")
    b = Proc(argv_of("b"), env, tmp_path / "b.log")
    procs.append(b)
    _leader_then_standby(a, b)
    return a, b


def _leader_then_standby(first: Proc, second: Proc) -> None:
    wait_for(lambda: "is now the leader" in first.text(), 40, "the first beat to lead")
    wait_for(lambda: "standing by" in second.text(), 40, "the second beat to stand by")


def _only_the_leader_publishes(leader: Proc, standby: Proc, entry: str) -> None:
    """Two more ticks of *leader* (about 2 s) while *standby* stands by, which publishes none."""
    count = len(leader.sent(entry))
    wait_for(
        lambda: len(leader.sent(entry)) >= count + 2, 10, "two ticks of the leader", interval=0.05
    )
    assert len(leader.sent(entry)) >= 2 and standby.sent() == [], "only the leader publishes"


def _kill_just_after_a_tick(leader: Proc, entry: str) -> float:
    """Wait for a fresh tick of *entry* by *leader*, then 0.3 s, and SIGKILL it."""
    count = len(leader.sent(entry))
    wait_for(lambda: len(leader.sent(entry)) > count, 10, "a tick of the leader")
    time.sleep(0.3)
    return leader.kill()


def _assert_handover(old: Proc, new: Proc, entry: str, killed: float) -> None:
    """The new leader published within TTL + 2 s of the kill; across both, no tick of
    *entry* twice (consecutive sends at least 0.5 s apart) and no burst (at most 2 in the
    first 1.5 s of the new leader)."""
    wait_for(lambda: new.sent(entry), TTL + 10, "the new leader to publish")
    first = new.sent(entry)[0]
    assert first - killed < TTL + 2, f"took over {first - killed:.2f} s after the kill"
    # The ticks until one past the burst window (1 s apart: about 2 s after the first).
    wait_for(
        lambda: new.sent(entry)[-1] > first + 1.5, 10, "the new leader's later ticks", interval=0.05
    )
    times = sorted(old.sent(entry) + new.sent(entry))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g > 0.5 for g in gaps), f"a tick was published twice: gaps {gaps}"
    assert sum(1 for t in new.sent(entry) if t < first + 1.5) <= 2, "a burst after take-over"


# -- django-celery-beat's DatabaseScheduler ------------------------------------------------------
def _django_env(server: RedisServer, db: Path) -> dict[str, str]:
    return {
        "DJANGO_SETTINGS_MODULE": "tests.apps.djbeat.settings",
        "DJBEAT_DB": str(db),
        "DJBEAT_REDIS": f"redis://127.0.0.1:{server.port}",
        "DJBEAT_TTL": str(TTL),
    }


def _periodic(env: dict[str, str], *args: str) -> None:
    """Edit the schedule in the database (as the admin would), in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.apps.djbeat.periodic", *args], cwd=ROOT,
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_two_beats_lead_django_celery_beats_database_scheduler(
    server: RedisServer, tmp_path: Path, procs: list[Proc]
) -> None:
    """Two beats on one SQLite schedule, each `-S celery_redlock.beat:LeaderScheduler` with
    redlock_beat_scheduler = DatabaseScheduler: one publishes a PeriodicTask every 1 s; the
    other takes over within TTL + 2 s of a SIGKILL, with no tick twice and no burst, and
    then publishes a PeriodicTask added in the database, and stops one disabled there."""
    env = _django_env(server, tmp_path / "schedule.sqlite3")
    migrate = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "-v", "0"], cwd=ROOT,
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert migrate.returncode == 0, migrate.stderr
    _periodic(env, "add", "every-second", "1")
    argv = ["-A", "tests.apps.djbeat", "beat", "-l", "info", "--pidfile="]
    argv += ["-S", "celery_redlock.beat:LeaderScheduler"]
    a, b = _leader_and_standby(lambda _name: argv, env, tmp_path, procs)
    _only_the_leader_publishes(a, b, "every-second")
    assert "scheduler -> celery_redlock.beat.LeaderDatabaseScheduler" in a.text()

    killed = _kill_just_after_a_tick(a, "every-second")
    _assert_handover(a, b, "every-second", killed)

    _periodic(env, "add", "added-later", "1")
    wait_for(lambda: b.sent("added-later"), 15, "the added PeriodicTask to be published")
    _periodic(env, "disable", "every-second")
    wait_for(
        lambda: time.time() - b.sent("every-second")[-1] > 2.5,
        15,
        "the disabled PeriodicTask to stop",
    )
    still = len(b.sent("added-later"))
    wait_for(lambda: len(b.sent("added-later")) > still, 5, "the enabled one to go on")
    assert b.proc.poll() is None and "Traceback" not in b.text(), b.text()[-3000:]


# -- PersistentScheduler, and beat embedded in workers ---------------------------------------------
def _beatapp_env(server: RedisServer, **extra: str) -> dict[str, str]:
    return {
        "BEATAPP_BROKER": f"redis://127.0.0.1:{server.port}/0",
        "BEATAPP_LOCKS": f"redis://127.0.0.1:{server.port}/1",
        "BEATAPP_BEAT_TTL": str(TTL),
        **extra,
    }


def test_two_beats_lead_persistent_schedulers_with_a_file_each(
    server: RedisServer, tmp_path: Path, procs: list[Proc]
) -> None:
    """redlock_beat_scheduler = celery.beat:PersistentScheduler, each beat with its own
    schedule file: one publishes, and a SIGKILLed leader's successor goes on with no
    tick twice and no burst."""
    env = _beatapp_env(server, BEATAPP_SCHEDULER="celery.beat:PersistentScheduler")

    def beat(name: str) -> list[str]:
        argv = ["-A", "tests.apps.beatapp", "beat", "-l", "info", "--pidfile="]
        return [*argv, "-S", "celery_redlock.beat:LeaderScheduler", f"--schedule={tmp_path / name}"]

    a, b = _leader_and_standby(beat, env, tmp_path, procs)
    _only_the_leader_publishes(a, b, "heartbeat")
    assert "scheduler -> celery_redlock.beat.LeaderPersistentScheduler" in a.text()
    assert list(tmp_path.glob("a*")) and list(tmp_path.glob("b*")), "a schedule file each"
    killed = _kill_just_after_a_tick(a, "heartbeat")
    _assert_handover(a, b, "heartbeat", killed)


# -- RedBeat ---------------------------------------------------------------------------------------
REDBEAT_NOTE = (
    "leading redbeat.RedBeatScheduler with its own lock off: LeaderScheduler decides who leads"
)


def _redbeat_env(server: RedisServer) -> dict[str, str]:
    """beatapp led RedBeat: broker db 0, lock store db 1, RedBeat's Redis db 2, all emptied
    (the module's server is shared with the tests above). Nothing else about RedBeat is
    set: its own lock is on by default."""
    for db in (0, 1, 2):
        server.client(db=db).flushdb()
    return _beatapp_env(
        server,
        BEATAPP_SCHEDULER="redbeat.RedBeatScheduler",
        BEATAPP_REDBEAT=f"redis://127.0.0.1:{server.port}/2",
    )


def _redbeat_beat(tmp_path: Path) -> Callable[[str], list[str]]:
    def beat(name: str) -> list[str]:
        argv = ["-A", "tests.apps.beatapp", "beat", "-l", "info", "--pidfile="]
        return [*argv, "-S", "celery_redlock.beat:LeaderScheduler", f"--schedule={tmp_path / name}"]

    return beat


def test_two_beats_lead_redbeat_with_its_own_lock_off(
    server: RedisServer, tmp_path: Path, procs: list[Proc]
) -> None:
    """redlock_beat_scheduler = redbeat.RedBeatScheduler with RedBeat's defaults: each beat
    says RedBeat's own lock is off, the second says it stands by, a SIGKILLed leader's
    successor publishes within TTL + 2 s, no tick is published twice, and the broker
    holds one message per logged send."""
    env = _redbeat_env(server)
    a, b = _leader_and_standby(_redbeat_beat(tmp_path), env, tmp_path, procs)
    for beat in (a, b):
        text = beat.text()
        assert f"    . {REDBEAT_NOTE}" in text, text[-3000:]  # the banner
        assert f"beat: {REDBEAT_NOTE}" in text  # the log, once
        assert text.count(REDBEAT_NOTE) == 2
        assert "scheduler -> celery_redlock.beat.LeaderRedBeatScheduler" in text
        assert "Acquired lock" not in text, "RedBeat took its own lock"
    killed = _kill_just_after_a_tick(a, "heartbeat")
    _assert_handover(a, b, "heartbeat", killed)

    # Beat logs a send before it publishes it: the broker catches up with what was
    # logged, and never holds more than what is logged by then.
    broker = server.client(db=0)
    logged = len(a.sent("heartbeat")) + len(b.sent("heartbeat"))
    wait_for(lambda: broker.llen("celery") >= logged, 5, "a message for every logged send")
    assert broker.llen("celery") <= len(a.sent("heartbeat")) + len(b.sent("heartbeat")), (
        "a message no beat logged"
    )
    assert b.proc.poll() is None and "Traceback" not in b.text(), b.text()[-3000:]


def test_redbeats_ticks_are_claimed_before_they_are_published(
    server: RedisServer, tmp_path: Path, procs: list[Proc]
) -> None:
    """RedBeat's tick publishes through apply_async, not apply_entry: each of its ticks is
    still claimed in the tick records first (the record's run count is the number of
    messages on the broker, its pid the beat's)."""
    env = _redbeat_env(server)
    beat = Proc(_redbeat_beat(tmp_path)("a"), env, tmp_path / "a.log")
    procs.append(beat)
    broker = server.client(db=0)
    wait_for(lambda: broker.llen("celery") >= 3, 40, "three ticks")
    _kill_just_after_a_tick(beat, "heartbeat")  # nothing more is claimed or published
    raw = server.client(db=1).hget(RECORDS_KEY, "heartbeat")
    assert raw is not None, "RedBeat's ticks were not claimed"
    record = json.loads(raw)
    assert record["n"] == broker.llen("celery") and record["pid"] == beat.proc.pid


def _redbeat_app(server: RedisServer, scheduler: type) -> Celery:
    """An in-process app whose LeaderScheduler leads *scheduler*, with a 30 s "heartbeat":
    lock store and RedBeat's Redis db 3 (emptied), broker memory://."""
    server.client(db=3).flushdb()
    url = f"redis://127.0.0.1:{server.port}/3"
    app = Celery("redbeatinproc", broker="memory://", set_as_current=False)
    app.conf.update(
        redlock_url=url,
        redlock_beat_ttl=TTL,
        redlock_beat_scheduler=scheduler,
        redbeat_redis_url=url,
        beat_schedule={"heartbeat": {"task": "redbeatinproc.heartbeat", "schedule": 30.0}},
    )
    return app


class RenamedLockRedBeat(RedBeatScheduler):  # type: ignore[misc]  # redbeat is untyped
    """A RedBeat whose lock switch is not called ``lock_key`` (as a later RedBeat might)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.beat_lock_key = self.__dict__.pop("lock_key")


def test_redbeats_own_lock_is_switched_off_or_a_warning_names_the_setting(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """RedBeat's own lock is switched off where RedBeat has its `lock_key` (one INFO line,
    and a banner line; none from the banner's lazy scheduler); a RedBeat without it keeps
    its lock and beat logs one WARNING naming redbeat_lock_key = None."""
    caplog.set_level(logging.INFO, logger="celery_redlock.beat")
    app = _redbeat_app(server, RedBeatScheduler)
    lazy = LeaderScheduler(app=app, lazy=True)
    assert lazy.lock_key is None and caplog.messages == []
    scheduler = LeaderScheduler(app=app)
    assert scheduler.lock_key is None
    assert caplog.messages == [f"beat: {REDBEAT_NOTE}"]
    assert f"    . {REDBEAT_NOTE}" in scheduler.info.splitlines()
    scheduler.close()

    caplog.clear()
    scheduler = LeaderScheduler(app=_redbeat_app(server, RenamedLockRedBeat))
    assert scheduler.beat_lock_key == "redbeat::lock", "RedBeat's lock was changed"
    name = f"{__name__}.RenamedLockRedBeat"
    assert caplog.messages == [
        f"beat: cannot switch off the own lock of {name} (it has no lock_key): its lock, not "
        "LeaderScheduler, may decide who leads and keep a standby waiting at start-up; set "
        "redbeat_lock_key = None"
    ]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "own lock off" not in scheduler.info
    scheduler.close()


def test_a_redbeat_tick_an_earlier_leader_claimed_is_not_published_again(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """RedBeat decides what is due from its own entry in Redis: a tick an earlier leader
    claimed (the tick records) but whose RedBeat entry it never advanced (killed between
    the two) is not published again by the next leader until due from that claim."""
    caplog.set_level(logging.INFO, logger="celery_redlock.beat")
    app = _redbeat_app(server, RedBeatScheduler)
    records = server.client(db=3)
    key = "redlock:{beat:leader:redbeatinproc}:ticks"
    claimed = {"at": time.time() - 1, "pid": 1, "host": "gone", "fence": 0, "n": 5}
    records.hset(key, "heartbeat", json.dumps(claimed))
    scheduler = LeaderScheduler(app=app)
    # RedBeat's own entry says it last ran 40 s ago: due (every 30 s), but not from the claim.
    entry = RedBeatSchedulerEntry.from_key(f"{app.redbeat_conf.key_prefix}heartbeat", app=app)
    entry.reschedule(datetime.now(timezone.utc) - timedelta(seconds=40))
    try:
        scheduler.tick()  # takes the lead, loads the records, runs RedBeat's tick
        assert scheduler.is_leader
        assert any("is now the leader" in m for m in caplog.messages)
        assert json.loads(records.hget(key, "heartbeat") or "{}")["n"] == 5, "published again"
        skipped = [m for m in caplog.messages if "by an earlier leader" in m]
        assert len(skipped) == 1 and skipped[0].startswith("beat: 'heartbeat' was claimed at ")
        scheduler.tick()
        assert len([m for m in caplog.messages if "by an earlier leader" in m]) == 1
    finally:
        scheduler.close()


def _worker_with_beat(name: str, tmp_path: Path, pool: str, flag: str) -> list[str]:
    """`celery worker -B FLAG celery_redlock.beat:LeaderScheduler` for beatapp."""
    argv = ["-A", "tests.apps.beatapp", "worker", "-P", pool, "-c", "1", "-l", "info"]
    argv += ["-n", f"{name}{os.getpid()}@%h", "--without-gossip", "--without-mingle"]
    argv += ["-B", flag, "celery_redlock.beat:LeaderScheduler"]
    return [*argv, f"--schedule-filename={tmp_path / name}-schedule"]


def test_two_workers_with_embedded_leader_beats_publish_once(
    server: RedisServer, tmp_path: Path, procs: list[Proc]
) -> None:
    """`celery worker -B --scheduler celery_redlock.beat:LeaderScheduler` twice: exactly one
    worker's beat publishes; SIGKILL that whole worker and the other's beat takes over
    within TTL + 2 s, with no tick twice and no burst."""
    env = _beatapp_env(server)
    a, b = _leader_and_standby(
        lambda name: _worker_with_beat(name, tmp_path, "prefork", "--scheduler"),
        env,
        tmp_path,
        procs,
    )
    _only_the_leader_publishes(a, b, "heartbeat")
    killed = _kill_just_after_a_tick(a, "heartbeat")
    _assert_handover(a, b, "heartbeat", killed)


def test_a_workers_statedb_naming_leader_scheduler_is_warned_about(
    server: RedisServer, tmp_path: Path, procs: list[Proc]
) -> None:
    """`celery worker -B -S celery_redlock.beat:LeaderScheduler`: -S is the worker's state
    file; the worker says so and names the flag that was meant."""
    argv = _worker_with_beat("s", tmp_path, "solo", "-S")
    # The state files it makes are named after -S: in the test's directory, not the tree.
    worker = Proc(argv, _beatapp_env(server), tmp_path / "w.log", cwd=tmp_path)
    procs.append(worker)
    wait_for(lambda: "ready." in worker.text(), 40, "the worker")
    text = worker.text()
    assert "-S/--statedb is 'celery_redlock.beat:LeaderScheduler'" in text, text[-3000:]
    assert "--scheduler celery_redlock.beat:LeaderScheduler" in text
    assert list(tmp_path.glob("celery_redlock.beat:LeaderScheduler*")), "-S was the state file"
