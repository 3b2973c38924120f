"""``LeaderScheduler`` with real ``celery beat`` subprocesses on a throwaway Redis.

Redis is both the broker and the lock store. Nobody consumes the queue, so every
message beat publishes stays in the broker's list; each carries the publishing
beat's pid and the publish time (see ``tests/apps/beatapp.py``).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from servers import RedisServer, wait_for

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).parent / "celery")
TTL = 2.0  # redlock_beat_ttl of the beats under test
LEADER_KEY = "redlock:{beat:leader:beatapp}"
RECORDS_KEY = f"{LEADER_KEY}:ticks"


@dataclass(frozen=True)
class Published:
    """One message beat put on the broker."""

    pid: int
    at: float
    task_id: str


class Beat:
    """A running ``celery beat`` subprocess and its log file."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGCONT + SIGTERM, then SIGKILL if it does not exit within 5 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGCONT)
                self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


BeatFactory = Callable[..., Beat]


@pytest.fixture
def start_beat(tmp_path: Path) -> Iterator[BeatFactory]:
    """Factory starting ``celery beat -S LeaderScheduler`` subprocesses; all stopped by pid."""
    beats: list[Beat] = []

    def start(broker: str, name: str, locks: str | None = None) -> Beat:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["BEATAPP_BROKER"] = broker
        env["BEATAPP_BEAT_TTL"] = str(TTL)
        if locks:
            env["BEATAPP_LOCKS"] = locks
        log_path = tmp_path / f"{name}.log"
        with open(log_path, "wb") as log:
            argv = [CELERY, "-A", "tests.apps.beatapp", "beat", "-l", "info", "--pidfile="]
            argv += ["-S", "celery_redlock.beat:LeaderScheduler"]
            argv += [f"--schedule={tmp_path / name}-schedule"]
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env=env,
            )
        beat = Beat(proc, log_path)
        beats.append(beat)
        return beat

    try:
        yield start
    finally:
        for beat in beats:
            beat.stop()


def published(client: redis.Redis) -> list[Published]:
    """Every message on the ``celery`` queue, oldest first."""
    out = []
    for raw in client.lrange("celery", 0, -1):
        message = json.loads(raw)
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        out.append(Published(int(args[0]), float(args[1]), message["headers"]["id"]))
    return sorted(out, key=lambda m: m.at)


def assert_each_tick_once(messages: list[Published], leaders: list[int]) -> None:
    """One message per 1 s tick: never two for one tick, none skipped while a leader lived,
    and leaders in the given order, never interleaved."""
    assert messages
    gaps = [b.at - a.at for a, b in itertools.pairwise(messages)]
    assert all(g > 0.5 for g in gaps), f"a tick was published twice: gaps {gaps}"
    order = [m.pid for m in messages]
    runs = [pid for i, pid in enumerate(order) if i == 0 or order[i - 1] != pid]
    assert runs == leaders, f"publishers in order {runs}, expected {leaders}"
    for a, b in itertools.pairwise(messages):
        if a.pid == b.pid:
            assert b.at - a.at < 1.6, f"a tick was skipped by pid {a.pid}: gaps {gaps}"


def stored_run_count(client: redis.Redis) -> int:
    """How many ticks the leaders claimed, from the schedule state in Redis."""
    raw = client.hget(RECORDS_KEY, "heartbeat")
    assert raw is not None
    return int(json.loads(raw)["n"])


def leader_and_standby(server: RedisServer, start_beat: BeatFactory) -> tuple[Beat, Beat]:
    """Start beat A, wait until it leads, then beat B, and wait until B stands by."""
    a = start_beat(server.url, "a")
    wait_for(lambda: "is now the leader" in a.log(), 30, "beat A to lead")
    b = start_beat(server.url, "b")
    wait_for(lambda: "standing by" in b.log(), 30, "beat B to stand by")
    return a, b


def just_after_a_tick(client: redis.Redis, pid: int) -> None:
    """Wait for a fresh message from *pid*, then 0.3 s, so a signal lands between ticks."""
    count = sum(m.pid == pid for m in published(client))
    wait_for(lambda: sum(m.pid == pid for m in published(client)) > count, 5, f"a tick from {pid}")
    time.sleep(0.3)


def sigkill_leader_and_see_standby_take_over(
    client: redis.Redis, a: Beat, b: Beat, then: float
) -> list[Published]:
    """SIGKILL leader *a* just after one of its ticks; once standby *b* publishes, let it
    run *then* seconds more. *b*'s first tick comes within one TTL of the kill, and every
    tick is published once, by *a* then by *b*; the messages published."""
    just_after_a_tick(client, a.pid)
    a.proc.send_signal(signal.SIGKILL)
    killed_at = time.time()
    wait_for(lambda: any(m.pid == b.pid for m in published(client)), 10, "B to publish")
    time.sleep(then)
    messages = published(client)
    first_b = min(m.at for m in messages if m.pid == b.pid)
    assert first_b - killed_at < TTL + 0.5, "the standby took longer than one TTL"
    assert_each_tick_once(messages, [a.pid, b.pid])
    return messages


@pytest.mark.slow
def test_sigkilled_leader_is_replaced_within_one_ttl_and_no_tick_is_sent_twice(
    redis_server: RedisServer, start_beat: BeatFactory
) -> None:
    """Two beats: only the leader publishes, once per tick; after SIGKILL the other takes over
    within one TTL and goes on from the last published tick."""
    client = redis_server.client()
    a, b = leader_and_standby(redis_server, start_beat)
    time.sleep(4)
    before = published(client)
    assert len(before) >= 4
    assert {m.pid for m in before} == {a.pid}, "the standby published"

    sigkill_leader_and_see_standby_take_over(client, a, b, then=3)
    # A tick is claimed (its run count stored) just before it is published: the two agree
    # between ticks, and a claimed tick that never went out would keep the count ahead.
    wait_for(
        lambda: stored_run_count(client) == len(published(client)),
        2,
        "every claimed tick published once",
    )
    assert "lost leadership" not in b.log()


def newest_record(clients: list[redis.Redis]) -> dict[str, Any]:
    """The newest "heartbeat" record (highest fence, then n) on the masters that answer."""
    found = []
    for client in clients:
        with contextlib.suppress(redis.RedisError):
            raw = client.hget(RECORDS_KEY, "heartbeat")
            if raw is not None:
                found.append(json.loads(raw))
    assert found, "no master holds a tick record"
    return max(found, key=lambda r: (r["fence"], r["n"]))


@pytest.mark.slow
def test_redlock_leader_sigkilled_with_a_master_down_is_replaced_within_one_ttl(
    redis_servers: Callable[[int], list[RedisServer]], start_beat: BeatFactory
) -> None:
    """Beat over 3 independent masters (Redlock): the leader holds a majority and keeps
    publishing with one master down; after SIGKILL the standby takes over within one TTL
    and every tick is published exactly once."""
    broker, *masters = redis_servers(4)
    locks = ",".join(m.url for m in masters)
    client = broker.client()
    lock_clients = [m.client() for m in masters]
    a = start_beat(broker.url, "a", locks=locks)
    wait_for(lambda: "is now the leader" in a.log(), 30, "beat A to lead")
    b = start_beat(broker.url, "b", locks=locks)
    wait_for(lambda: "standing by" in b.log(), 30, "beat B to stand by")
    tokens = {c.hget(LEADER_KEY, "token") for c in lock_clients}
    assert len(tokens) == 1 and None not in tokens, "A does not hold the lock on every master"

    masters[2].kill()  # a minority down: A keeps leading, B can still take over
    just_after_a_tick(client, a.pid)
    messages = sigkill_leader_and_see_standby_take_over(client, a, b, then=2.5)
    assert sum(m.pid == a.pid for m in messages) >= 3
    assert newest_record(lock_clients)["n"] == len(messages), "a claimed tick was not sent once"
    holders = {c.hget(LEADER_KEY, "token") for c in lock_clients[:2]}
    assert len(holders) == 1 and None not in holders, "B does not hold the live majority"
    assert holders != tokens
    assert "lost leadership" not in b.log()
    assert "Traceback" not in b.log()


@pytest.mark.slow
def test_paused_leader_steps_down_and_later_takes_over_without_repeating_a_tick(
    redis_server: RedisServer, start_beat: BeatFactory
) -> None:
    """A leader SIGSTOPped past its lease is replaced; resumed, it logs that it lost leadership,
    publishes nothing more and stands by; when the new leader stops, it takes over at once
    without re-sending the tick just published."""
    client = redis_server.client()
    a, b = leader_and_standby(redis_server, start_beat)
    just_after_a_tick(client, a.pid)
    os.kill(a.pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        wait_for(lambda: any(m.pid == b.pid for m in published(client)), 10, "B to publish")
        time.sleep(1)
    finally:
        os.kill(a.pid, signal.SIGCONT)
    wait_for(lambda: "lost leadership" in a.log(), 5, "A to step down")
    time.sleep(2)
    assert a.proc.poll() is None, "the deposed leader crashed:\n" + a.log()
    assert not [m for m in published(client) if m.pid == a.pid and m.at > stopped_at]

    # The deposed leader really is a standby: when B shuts down (releasing the lock, which
    # wakes A at once), A takes over and goes on from B's last tick instead of repeating it.
    just_after_a_tick(client, b.pid)
    b.stop()
    wait_for(
        lambda: any(m.pid == a.pid and m.at > stopped_at for m in published(client)),
        TTL + 3,
        "A to lead again",
    )
    time.sleep(1.5)
    messages = published(client)
    assert_each_tick_once(messages, [a.pid, b.pid, a.pid])
    last_b = max(m.at for m in messages if m.pid == b.pid)
    first_a = min(m.at for m in messages if m.pid == a.pid and m.at > stopped_at)
    assert first_a - last_b > 0.8, "the new leader re-sent the tick the old one had just sent"
    assert first_a - last_b < 1.6, "the hand-over was not prompt"
    assert "resigned leadership" in b.log()
    wait_for(
        lambda: stored_run_count(client) == len(published(client)),
        2,
        "every claimed tick published once",
    )
    assert "Traceback" not in a.log()


@pytest.mark.slow
def test_standby_that_cannot_reach_the_lock_store_logs_once_and_keeps_waiting(
    redis_servers: Callable[[int], list[RedisServer]], start_beat: BeatFactory
) -> None:
    """With the lock store down, beat publishes nothing, logs one line and stays up; when the
    store comes back it leads and publishes."""
    broker, store = redis_servers(2)
    store.kill()
    beat = start_beat(broker.url, "a", locks=store.url)
    wait_for(lambda: "cannot reach the lock store" in beat.log(), 30, "the outage line")
    time.sleep(2.5)  # several retry rounds (every TTL/3)
    assert beat.proc.poll() is None, beat.log()
    assert beat.log().count("cannot reach the lock store") == 1
    client = broker.client()
    assert published(client) == []

    store.restart()
    wait_for(lambda: bool(published(client)), 10, "beat to publish after the outage")
    assert "answers again" in beat.log()
    assert {m.pid for m in published(client)} == {beat.pid}


def start_celery(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``celery ARGV`` in its own process group, output to *log_path*."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    full_env.update(env)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [CELERY, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env=full_env,
            start_new_session=True,
        )


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (warm shutdown), then SIGKILL the whole process group."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(10)


@pytest.mark.slow
def test_beat_job_longer_than_its_period_never_overlaps_and_logs_each_skip(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A 1 s beat job taking 2.5 s (LockedTask, skip): runs never overlap; every other
    delivery is skipped and logged once, naming the holder."""
    env = {"BEATJOB_REDIS": f"redis://127.0.0.1:{redis_server.port}"}
    app = ["-A", "tests.apps.beatjobapp"]
    worker_log, beat_log = tmp_path / "worker.log", tmp_path / "beat.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        worker_argv = [*app, "worker", "-P", "prefork", "-c", "3", "-l", "info"]
        worker_argv += ["-n", "beatjob@%h", "--without-heartbeat", "--without-gossip"]
        procs.append(start_celery([*worker_argv, "--without-mingle"], env, worker_log))
        wait_for(lambda: "ready." in worker_log.read_text(errors="replace"), 40, "the worker")
        beat_argv = [*app, "beat", "-l", "info", "--pidfile=", f"--schedule={tmp_path}/s"]
        procs.append(
            start_celery([*beat_argv, "-S", "celery_redlock.beat:LeaderScheduler"], env, beat_log)
        )
        wait_for(lambda: "Sending due task" in beat_log.read_text(), 30, "beat to publish")
        records = redis_server.client(db=3)

        def skip_lines() -> list[str]:
            text = worker_log.read_text(errors="replace")
            return [line for line in text.splitlines() if "skipped: lock 'beatjob.slow'" in line]

        wait_for(
            lambda: records.llen("runs") >= 2 and len(skip_lines()) >= 3,
            30,
            "two runs to end and three deliveries to be skipped",
            interval=0.05,
        )
        # Stop beat just after a send, not during one: beat logs "Sending due task" before
        # it publishes, and a SIGTERM in between loses that message (Celery's beat, not
        # ours), which the count of logged sends below would miss.
        ticks = beat_log.read_text().count("Sending due task slow-job")
        wait_for(
            lambda: beat_log.read_text().count("Sending due task slow-job") > ticks,
            3,
            "the next beat tick",
        )
        time.sleep(0.3)  # that tick's message is out; the next tick is 0.7 s away
        stop_group(procs[1])  # beat: no more deliveries
        sent = beat_log.read_text().count("Sending due task slow-job")
        wait_for(lambda: records.llen("runs") + len(skip_lines()) >= sent, 10, "the worker")
    finally:
        for proc in reversed(procs):
            stop_group(proc)

    runs = sorted((json.loads(r) for r in records.lrange("runs", 0, -1)), key=lambda r: r["start"])
    skips = skip_lines()
    assert len(runs) >= 2 and len(skips) >= 3, (runs, skips)
    for before, after in itertools.pairwise(runs):
        assert after["start"] >= before["end"], f"runs overlapped: {before} {after}"
        assert after["fence"] > before["fence"]
    assert len(runs) + len(skips) == sent, "a delivery was neither run nor logged as skipped"
    skipped_ids = [line.split("beatjob.slow[", 1)[1].split("]", 1)[0] for line in skips]
    assert len(set(skipped_ids)) == len(skips), "a skip was logged more than once"
    assert all("is held by task beatjob.slow[" in line for line in skips)
