"""Every example under examples/ runs as its README says, on real workers and beats."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from servers import RedisServer, wait_for
from workers import Worker, stop_group, stop_workers

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _run(example: str, script: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    """Run one of an example's scripts from its directory, as its README says."""
    done = subprocess.run(
        [sys.executable, script],
        cwd=EXAMPLES / example,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


@contextlib.contextmanager
def _workers(
    example: str, env: dict[str, str], tmp_path: Path, count: int = 1, concurrency: int = 2
) -> Iterator[list[Worker]]:
    """`celery -A tasks worker` (prefork) for *example*, stopped by pid afterwards."""
    env = {**env, "PYTHONPATH": str(EXAMPLES / example)}
    started = []
    try:
        for n in range(count):
            worker = Worker("tasks", env, tmp_path / f"worker{n}.log", concurrency=concurrency)
            started.append(worker)
        for worker in started:
            worker.wait_ready()
        yield started
    finally:
        stop_workers(started)


class _Beat:
    """`celery -A tasks beat -S celery_redlock.beat:LeaderScheduler` for an example."""

    def __init__(self, example: str, env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "beat",
             "-S", "celery_redlock.beat:LeaderScheduler", "-l", "info"],
            cwd=EXAMPLES / example,
            env={**os.environ, **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def leads(self) -> bool:
        return "is now the leader" in self.text()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_group(self.proc, sig)
        self.log.close()


# -- sync_users ---------------------------------------------------------------------------
def test_sync_users_runs_one_sync_per_user_at_a_time(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """send.py's nine syncs for three users on two prefork workers: a user's runs never
    overlap, their fences increase, and different users run side by side."""
    base = f"redis://127.0.0.1:{redis_server.port}"
    env = {
        "CELERY_BROKER_URL": f"{base}/0",
        "CELERY_RESULT_BACKEND": f"{base}/2",
        "REDLOCK_URL": f"{base}/1",
    }
    with _workers("sync_users", env, tmp_path, count=2):
        code, out = _run("sync_users", "send.py", env, timeout=120)
    assert code == 0, out
    runs = defaultdict(list)
    pattern = r"user (\d): +([\d.]+)s -> +([\d.]+)s  fence (\d+)"
    for user, start, end, fence in re.findall(pattern, out):
        runs[user].append((float(start), float(end), int(fence)))
    assert sorted(runs) == ["1", "2", "3"] and all(len(r) == 3 for r in runs.values()), out
    for user_runs in runs.values():
        user_runs.sort()
        for (_, end, fence), (start, _, next_fence) in itertools.pairwise(user_runs):
            assert start >= end - 0.011, out  # printed to 1/100 s
            assert next_fence > fence
    firsts = sorted(r[0][0] for r in runs.values())
    assert firsts[-1] < min(r[0][1] for r in runs.values()), "users ran side by side"


# -- beat_singleton -------------------------------------------------------------------------
def test_beat_singleton_two_beats_one_leader_runs_never_overlap(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two LeaderScheduler beats: one publishes; rollups never overlap (ticks that find one
    running are skipped); SIGKILL the leader and the other takes over within its lease."""
    base = f"redis://127.0.0.1:{redis_server.port}"
    env = {"REDIS_URL": base, "BEAT_TTL": "2"}
    output = redis_server.client(db=3)

    def rollups() -> list[dict[str, Any]]:
        return [json.loads(r) for r in output.lrange("rollups", 0, -1)]

    with _workers("beat_singleton", env, tmp_path):
        beats = [_Beat("beat_singleton", env, tmp_path / f"beat{n}.log") for n in range(2)]
        try:
            wait_for(lambda: any(b.leads() for b in beats), 30, "a leader")
            # A rollup takes 1.5 s, ticked every 1 s: two in a row are a tick skipped.
            wait_for(lambda: len(rollups()) >= 2, 30, "two rollups")
            leaders = [b for b in beats if b.leads()]
            assert len(leaders) == 1, [b.text()[-2000:] for b in beats]
            leader, standby = leaders[0], next(b for b in beats if b is not leaders[0])
            killed_at = time.monotonic()
            leader.stop(signal.SIGKILL)
            wait_for(standby.leads, 15, "the standby to lead")
            took_over = time.monotonic() - killed_at
            before = len(rollups())
            wait_for(lambda: len(rollups()) >= before + 2, 20, "two more rollups")
        finally:
            for beat in beats:
                beat.stop()
    assert took_over < 2 + 3, f"standby took {took_over:.1f} s (lease 2 s)"
    runs = sorted(rollups(), key=lambda r: r["started"])
    for earlier, later in itertools.pairwise(runs):
        assert later["started"] >= earlier["finished"], "two rollups overlapped"
        assert later["fence"] > earlier["fence"]


# -- fenced_store ---------------------------------------------------------------------------
def test_fenced_store_script_refuses_the_paused_holders_late_write(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """paused_holder.py: the holder whose lease ran out writes late and the store keeps
    the newer holder's price."""
    db = tmp_path / "prices.sqlite3"
    env = {"REDIS_URL": f"redis://127.0.0.1:{redis_server.port}", "PRICES_DB": str(db)}
    code, out = _run("fenced_store", "paused_holder.py", env)
    assert code == 0, out
    assert "applied=True" in out and "its late write applied=False" in out
    assert "stored (price, fence): (120," in out


def test_fenced_store_sigstopped_worker_child_cannot_overwrite(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A pool child SIGSTOPped past its 1 s lease resumes and writes with its old fence:
    the UPDATE ... WHERE fence < :fence refuses it, the next holder's price stays."""
    db = tmp_path / "prices.sqlite3"
    base = f"redis://127.0.0.1:{redis_server.port}"
    env = {"REDIS_URL": base, "PRICES_DB": str(db), "PRICE_LOCK_TTL": "1"}
    client = Celery("client", broker=f"{base}/0", backend=f"{base}/2")
    locks = redis_server.client(db=1)

    def journal(what: str) -> list[tuple[Any, ...]]:
        if not db.exists():
            return []
        with (
            contextlib.closing(sqlite3.connect(db, timeout=10)) as conn,
            contextlib.suppress(sqlite3.OperationalError),  # no table yet
        ):
            return conn.execute(
                "SELECT pid, price, fence FROM journal WHERE what = ? ORDER BY at", (what,)
            ).fetchall()
        return []

    with _workers("fenced_store", env, tmp_path, concurrency=2):
        slow = client.send_task("tasks.set_price", ("sku-9", 100), {"work": 2.5})
        pid, _, old_fence = wait_for(lambda: journal("start"), 20, "the slow run to start")[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: not locks.exists("redlock:{price:sku-9}"), 5, "its lease to run out")
            fast = client.send_task("tasks.set_price", ("sku-9", 200))
            assert fast.get(timeout=20) is True
        finally:
            os.kill(pid, signal.SIGCONT)
        assert slow.get(timeout=20) is False
    client.close()
    (refused,) = journal("refused")
    (applied,) = journal("applied")
    assert refused == (pid, 100, old_fence)
    assert applied[2] > old_fence
    with contextlib.closing(sqlite3.connect(db)) as conn:
        stored = conn.execute("SELECT price, fence FROM prices WHERE sku = 'sku-9'").fetchone()
    assert stored == (200, applied[2])


# -- redlock_masters ------------------------------------------------------------------------
def test_redlock_masters_check_survives_one_master_and_reports_no_quorum(
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    """check.py over three masters: held and exclusive with all three and with one down;
    with two down it exits 3 naming the lost quorum, promptly."""
    servers = redis_servers(3)
    env = {"REDLOCK_URLS": ",".join(f"redis://127.0.0.1:{s.port}/1" for s in servers)}
    code, out = _run("redlock_masters", "check.py", env)
    assert code == 0, out
    # A majority granted before acquire() returned; the third grant may still be on its way.
    assert out.count("holds it") >= 2 and "a second owner gets it too? False" in out
    assert "released on every master" in out
    servers[0].kill()
    code, out = _run("redlock_masters", "check.py", env)
    assert code == 0, out
    assert out.count("holds it") == 2 and "unreachable" in out
    assert "released on every master" not in out  # one did not answer: said as it is
    assert "released on the masters that answered; 1 unreachable" in out
    servers[1].kill()
    begin = time.monotonic()
    code, out = _run("redlock_masters", "check.py", env)
    assert code == 3, out
    assert "no quorum" in out
    assert time.monotonic() - begin < 15


def test_redlock_masters_task_runs_exclusively_with_one_master_down(
    redis_server: RedisServer,
    redis_servers: Callable[[int], list[RedisServer]],
    tmp_path: Path,
) -> None:
    """The example's task on a prefork worker, one of its three masters killed: four
    rebuilds of one index still run one at a time, with increasing fences."""
    masters = redis_servers(3)
    base = f"redis://127.0.0.1:{redis_server.port}"
    env = {
        "REDLOCK_URLS": ",".join(f"redis://127.0.0.1:{s.port}/1" for s in masters),
        "CELERY_BROKER_URL": f"{base}/0",
        "CELERY_RESULT_BACKEND": f"{base}/2",
    }
    masters[2].kill()
    client = Celery("client", broker=f"{base}/0", backend=f"{base}/2")
    with _workers("redlock_masters", env, tmp_path, concurrency=2):
        results = [client.send_task("tasks.rebuild_index", ("main",)) for _ in range(4)]
        runs = sorted((r.get(timeout=60) for r in results), key=lambda r: r["started"])
    client.close()
    for earlier, later in itertools.pairwise(runs):
        assert later["started"] >= earlier["finished"]
        assert later["fence"] > earlier["fence"]
