"""Worker-level configuration on real `celery worker` subprocesses (and one in-process worker).

The flags ``--redlock-url``, ``--redlock-ttl``, ``--redlock-disable`` each change what that
worker does; ``app.conf.redlock_tasks`` locks tasks that do not use ``LockedTask``; bad
settings stop the worker with one clear message; an unreachable lock Redis is reported once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from inprocess import gated, settings_on
from servers import RedisServer, free_port, wait_for
from workers import Worker, close_publisher, publisher, publishing, worker_env

from celery_redlock import is_skipped

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.apps.configapp"
PLAIN = "tests.apps.configplain"
SECRET = f"pw-{uuid.uuid4().hex}"


def _env(server: RedisServer, broker_db: int, record_db: int, **extra: str) -> dict[str, str]:
    """:func:`worker_env` with a broker and a record database of its own, and no
    REDLOCK_TEST_CONF unless *extra* gives one."""
    base = f"redis://127.0.0.1:{server.port}"
    more = {"REDLOCK_TEST_RECORD": f"{base}/{record_db}", "REDLOCK_TEST_CONF": "", **extra}
    return worker_env(server, broker=f"{base}/{broker_db}", **more)


def _records(server: RedisServer, db: int, kind: str) -> list[dict[str, Any]]:
    events = [json.loads(r) for r in server.client(db=db).lrange("events", 0, -1)]
    return [e for e in events if e["event"] == kind]


def _keys_everywhere(server: RedisServer, pattern: str, password: str | None = None) -> list[str]:
    """Keys matching *pattern* in every database of *server* (SCAN, bounded)."""
    found: list[str] = []
    for db in range(16):
        client = server.client(db=db, password=password)
        found += [f"{db}:{k.decode()}" for k in client.scan_iter(match=pattern, count=1000)]
        client.close()
    return found


# -- servers and the module's workers --------------------------------------------------------
@pytest.fixture(scope="module")
def flag_server() -> Iterator[RedisServer]:
    """A password-protected Redis that only ``--redlock-url`` points at."""
    # The password is set after start: RedisServer.start() checks readiness without AUTH, so
    # extra_args=["--requirepass", ...] would never look ready.
    srv = RedisServer.start()
    try:
        srv.client().config_set("requirepass", SECRET)
        yield srv
    finally:
        srv.stop()


FLAGS_BROKER, FLAGS_RECORD = 5, 3
DISABLED_BROKER, DISABLED_RECORD = 6, 4
PLAIN_BROKER, PLAIN_RECORD = 7, 8


@pytest.fixture(scope="module")
def workers(
    server: RedisServer, flag_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Worker]]:
    """Three workers started together, each on its own broker database.

    ``flags``: --redlock-url to the password server and --redlock-ttl 7; ``disabled``:
    --redlock-disable; ``plain``: configplain, locked by redlock_tasks only.
    """
    logs = tmp_path_factory.mktemp("workers")
    flag_url = f"redis://:{SECRET}@127.0.0.1:{flag_server.port}/1"
    started: dict[str, Worker] = {}
    try:
        started["flags"] = Worker(
            APP,
            _env(server, FLAGS_BROKER, FLAGS_RECORD),
            logs / "flags.log",
            extra=("--redlock-url", flag_url, "--redlock-ttl", "7"),
        )
        started["disabled"] = Worker(
            APP,
            _env(server, DISABLED_BROKER, DISABLED_RECORD),
            logs / "disabled.log",
            concurrency=2,
            extra=("--redlock-disable",),
        )
        started["plain"] = Worker(
            PLAIN, _env(server, PLAIN_BROKER, PLAIN_RECORD), logs / "plain.log", concurrency=2
        )
        for w in started.values():
            w.wait_ready()
        yield started
    finally:
        for w in started.values():  # all shut down at once, then each is waited for
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in started.values():
            w.stop()


# -- --help ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_worker_help_documents_each_flag(server: RedisServer) -> None:
    """`celery worker --help` lists --redlock-url, --redlock-ttl, --redlock-lock-on and
    --redlock-disable with help."""
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "worker", "--help"],
        cwd=ROOT,
        env={**os.environ, **_env(server, 0, 3)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    flat = " ".join(out.split())  # click wraps long help text over several lines
    assert "--redlock-url" in flat and "overrides app.conf.redlock_url" in flat
    assert "--redlock-ttl" in flat and "Default lock lease in seconds" in flat
    assert "--redlock-lock-on" in flat and "enqueue or enqueue+run" in flat
    assert "--redlock-disable" in flat and "WITHOUT locks" in flat


# -- each flag changes that worker ---------------------------------------------------------
@pytest.fixture
def flags(workers: dict[str, Worker], server: RedisServer) -> Iterator[Celery]:
    """A publisher to the ``flags`` worker (--redlock-url, --redlock-ttl 7)."""
    with publishing(_env(server, FLAGS_BROKER, FLAGS_RECORD)) as client:
        yield client


@pytest.mark.slow
def test_redlock_url_flag_puts_locks_on_the_flag_server(
    flags: Celery, server: RedisServer, flag_server: RedisServer
) -> None:
    """With --redlock-url the lock key is on the flag's server, not on app.conf.redlock_url's."""
    name = f"url-{uuid.uuid4().hex[:6]}"
    result = flags.send_task(f"{APP}.held", args=(name, 1.0))
    start = wait_for(lambda: _records(server, FLAGS_RECORD, "start"), 20)[-1]
    assert start["name"] == name and start["locked"] is True
    key = f"redlock:{{cfg:{name}}}"
    on_flag = flag_server.client(db=1, password=SECRET)
    assert on_flag.exists(key), "held on the --redlock-url server"
    assert int(on_flag.hget(key, "fence")) == start["fence"]
    assert _keys_everywhere(server, f"*cfg:{name}*") == [], "nothing on the conf server"
    assert result.get(timeout=20) == name
    assert not on_flag.exists(key), "released on the flag server"


@pytest.mark.slow
def test_celery_locks_with_the_workers_redlock_url_shows_what_it_holds(
    workers: dict[str, Worker], server: RedisServer, flag_server: RedisServer
) -> None:
    """A worker started with --redlock-url holds a lock: `celery locks list` with the same
    --redlock-url shows it; without it, the command says where it looked instead."""
    env = _env(server, FLAGS_BROKER, FLAGS_RECORD)
    name = f"cli-{uuid.uuid4().hex[:6]}"
    flag_url = f"redis://:{SECRET}@127.0.0.1:{flag_server.port}/1"
    argv = [sys.executable, "-m", "celery", "-A", APP, "locks", "list"]
    with publishing(env) as client:
        result = client.send_task(f"{APP}.held", args=(name, 4.0))
        wait_for(
            lambda: [e for e in _records(server, FLAGS_RECORD, "start") if e["name"] == name], 20
        )
        run_env = {**os.environ, **env}
        found = subprocess.run(
            [*argv, "--redlock-url", flag_url], cwd=ROOT, env=run_env, capture_output=True,
            text=True, timeout=60, check=False,
        )  # fmt: skip
        assert found.returncode == 0, found.stderr
        assert f"cfg:{name}" in found.stdout and "running" in found.stdout, found.stdout
        assert SECRET not in found.stdout + found.stderr
        elsewhere = subprocess.run(
            argv, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=60, check=False
        )
        assert f"cfg:{name}" not in elsewhere.stdout
        assert f"no locks held at redis://127.0.0.1:{server.port}/1" in elsewhere.stdout
        assert result.get(timeout=20) == name


@pytest.mark.slow
def test_redlock_ttl_flag_sets_the_lease(
    flags: Celery, server: RedisServer, flag_server: RedisServer
) -> None:
    """--redlock-ttl 7 (app.conf says 30): the held lock's PTTL is in (5000, 7000] ms."""
    server.client(db=FLAGS_RECORD).delete("events")
    name = f"ttl-{uuid.uuid4().hex[:6]}"
    result = flags.send_task(f"{APP}.held", args=(name, 1.0))
    wait_for(lambda: _records(server, FLAGS_RECORD, "start"), 20)
    pttl = flag_server.client(db=1, password=SECRET).pttl(f"redlock:{{cfg:{name}}}")
    assert 5000 < pttl <= 7000, pttl
    assert result.get(timeout=20) == name


@pytest.mark.slow
def test_startup_line_shows_where_locks_live_with_the_password_masked(
    workers: dict[str, Worker], flag_server: RedisServer
) -> None:
    """The start-up line names the flag's server and TTL; the password never reaches the log."""
    text = workers["flags"].text()
    lines = [line for line in text.splitlines() if "celery-redlock: locks at" in line]
    assert len(lines) == 1, text[-3000:]
    assert f"redis://:***@127.0.0.1:{flag_server.port}/1" in lines[0]
    assert "ttl=7.0s" in lines[0]
    assert SECRET not in text


@pytest.mark.slow
def test_redlock_disable_flag_runs_unlocked_with_a_loud_warning(
    workers: dict[str, Worker], server: RedisServer, flag_server: RedisServer
) -> None:
    """--redlock-disable: two same-key runs overlap, no lock key exists, a WARNING says DISABLED."""
    name = f"off-{uuid.uuid4().hex[:6]}"
    with publishing(_env(server, DISABLED_BROKER, DISABLED_RECORD)) as client:
        results = [client.send_task(f"{APP}.held", args=(name, 2.0)) for _ in range(2)]

        def both_started() -> list[dict[str, Any]]:
            starts = _records(server, DISABLED_RECORD, "start")
            return starts if len(starts) == 2 else []

        starts = wait_for(both_started, 20)
        assert [s["locked"] for s in starts] == [False, False]
        assert _keys_everywhere(server, f"*{name}*") == []
        assert _keys_everywhere(flag_server, f"*{name}*", password=SECRET) == []
        assert [r.get(timeout=20) for r in results] == [name, name]
        ends = _records(server, DISABLED_RECORD, "end")
        assert max(s["t"] for s in starts) < min(e["t"] for e in ends), "the runs overlapped"
    text = workers["disabled"].text()
    warnings = [line for line in text.splitlines() if "DISABLED" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], text[-3000:]
    assert "celery-redlock: locks at" not in text


# -- redlock_tasks --------------------------------------------------------------------------
@pytest.mark.slow
def test_redlock_tasks_locks_a_plain_shared_task_on_prefork(
    workers: dict[str, Worker], server: RedisServer
) -> None:
    """redlock_tasks alone locks a plain shared_task on prefork: same key skipped, other runs."""
    with publishing(_env(server, PLAIN_BROKER, PLAIN_RECORD)) as client:
        first = client.send_task(f"{PLAIN}.plain_hold", args=(5, 2.0))
        wait_for(lambda: _records(server, PLAIN_RECORD, "plain"), 20)
        assert server.client(db=1).exists("redlock:{plain:5}")
        second = client.send_task(f"{PLAIN}.plain_hold", args=(5, 0.0))
        skipped = second.get(timeout=20)
        assert is_skipped(skipped), skipped
        assert skipped["lock"] == "plain:5" and skipped["holder"]["task_id"] == first.id
        other = client.send_task(f"{PLAIN}.plain_hold", args=(6, 0.0))
        assert other.get(timeout=20) == 6
        assert first.get(timeout=20) == 5
        runs = _records(server, PLAIN_RECORD, "plain")
        assert sorted(r["n"] for r in runs) == [5, 6], "the skipped call never ran its body"
        assert all(r["locked"] and isinstance(r["fence"], int) for r in runs)
        assert not server.client(db=1).exists("redlock:{plain:5}")


# -- the in-process worker: pytest-celery's celery_app, the plugin's redlock_worker -----------
@pytest.fixture(scope="session")
def celery_config(shared_redis: RedisServer) -> dict[str, Any]:
    """celery_app: broker, results and locks in dbs 10-12 of the shared server; its tasks
    named inproc.* are locked by redlock_tasks."""
    tasks = {"inproc.*": {"lock_key": "ip:<n>", "lock_on_contended": "skip"}}
    return settings_on(shared_redis, 10, 11, 12, redlock_tasks=tasks)


@pytest.fixture
def slow(celery_app: Celery) -> Iterator[Any]:
    """A plain task (no LockedTask) that runs until ``slow.release`` is set (after the test
    at the latest); ``slow.started`` is set when a body starts."""

    @celery_app.task(name="inproc.slow", shared=False)
    def slow(n: int) -> int:
        slow.started.set()
        slow.release.wait(10)
        return n

    with gated(slow):
        yield slow


def test_redlock_tasks_locks_a_plain_task_in_process(
    slow: Any, redlock_worker: Any, shared_redis: RedisServer
) -> None:
    """In-process worker: redlock_tasks locks a plain task (same key skipped), no install()."""
    first = slow.delay(1)
    assert slow.started.wait(10)
    assert shared_redis.client(db=12).exists("redlock:{ip:1}")
    assert is_skipped(slow.delay(1).get(timeout=10))
    slow.release.set()
    assert first.get(timeout=10) == 1
    assert not shared_redis.client(db=12).exists("redlock:{ip:1}")


# -- settings checked at start-up -------------------------------------------------------------
def _failed_start(server: RedisServer, tmp_path: Path, conf: dict[str, Any]) -> tuple[int, str]:
    w = Worker(APP, _env(server, 9, 3, REDLOCK_TEST_CONF=json.dumps(conf)), tmp_path / "bad.log")
    try:
        return w.wait_exit(), w.text()
    finally:
        w.stop()


@pytest.mark.slow
def test_wrong_type_setting_stops_the_worker_with_one_message(
    server: RedisServer, tmp_path: Path
) -> None:
    """redlock_ttl="ten": the worker exits non-zero with one line naming the setting."""
    code, text = _failed_start(server, tmp_path, {"redlock_ttl": "ten"})
    assert code != 0
    lines = [line for line in text.splitlines() if "redlock_ttl" in line]
    assert len(lines) == 1, text
    assert "redlock_ttl='ten'" in lines[0] and "number of seconds" in lines[0]
    assert "Traceback" not in text and "ready." not in text


@pytest.mark.slow
def test_misspelt_setting_stops_the_worker_with_did_you_mean(
    server: RedisServer, tmp_path: Path
) -> None:
    """An unknown redlock_tll setting: the worker exits non-zero suggesting redlock_ttl."""
    code, text = _failed_start(server, tmp_path, {"redlock_tll": 10})
    assert code != 0
    lines = [line for line in text.splitlines() if "redlock_tll" in line]
    assert len(lines) == 1, text
    assert "did you mean 'redlock_ttl'" in lines[0]
    assert "Traceback" not in text and "ready." not in text


@pytest.mark.slow
def test_unreachable_lock_redis_is_one_error_line_and_the_worker_runs(
    server: RedisServer, tmp_path: Path
) -> None:
    """Lock Redis on a closed port: one ERROR line at start-up naming it; the worker stays up."""
    port = free_port()
    env = _env(server, 9, 3, REDLOCK_TEST_LOCKS=f"redis://127.0.0.1:{port}/1")
    w = Worker(APP, env, tmp_path / "unreachable.log")
    try:
        w.wait_ready()

        def said() -> list[str]:
            return [line for line in w.text().splitlines() if "unreachable" in line]

        assert wait_for(said, 10, "the unreachable lock Redis's line"), w.text()[-3000:]
        time.sleep(0.5)  # and 0.5 s later, still the one line
        assert w.proc.poll() is None, "the worker keeps running"
        text = w.text()
        lines = said()
        assert len(lines) == 1, text[-3000:]
        assert "ERROR" in lines[0] and f"127.0.0.1:{port}" in lines[0]
        assert "Traceback" not in text
    finally:
        w.stop()


# -- Django-style settings --------------------------------------------------------------------
def _ns_env(server: RedisServer, **extra: str) -> dict[str, str]:
    base = f"redis://127.0.0.1:{server.port}"
    return {
        "NS_BROKER": f"{base}/9",
        "NS_LOCKS": f"{base}/6",
        "NS_TTL": "12",
        "NS_RECORD": f"{base}/10",
        **extra,
    }


@pytest.mark.slow
def test_django_style_namespaced_settings_are_read_and_used(
    server: RedisServer, tmp_path: Path
) -> None:
    """config_from_object(..., namespace="CELERY") with CELERY_REDLOCK_URL (database 6)
    and CELERY_REDLOCK_TTL = 12: a prefork worker logs that URL and TTL, and a run's lock
    lives there with that lease."""
    env = _ns_env(server)
    server.client(db=10).delete("events")
    w = Worker("tests.apps.djangoish", env, tmp_path / "ns.log")
    app = publisher(env["NS_BROKER"], env["NS_BROKER"])
    try:
        w.wait_ready()
        assert f"locks at redis://127.0.0.1:{server.port}/6 (ttl=12.0s" in w.text()
        result = app.send_task("ns.hold", ("a", 2.0))
        started = wait_for(lambda: _records(server, 10, "start"), 20, "the run")
        assert started[0]["ttl"] == 12.0
        locks = server.client(db=6)
        assert locks.exists("redlock:{ns:a}") and 0 < locks.pttl("redlock:{ns:a}") <= 12_000
        assert result.get(timeout=20) == "a"
    finally:
        close_publisher(app)
        w.stop()


@pytest.mark.slow
def test_misspelt_namespaced_setting_stops_the_worker_in_one_line(
    server: RedisServer, tmp_path: Path
) -> None:
    """CELERY_REDLOCK_TLL in a Django-style settings module: the worker exits non-zero
    with one line that names it as written and suggests CELERY_REDLOCK_TTL."""
    env = _ns_env(server, NS_EXTRA=json.dumps({"CELERY_REDLOCK_TLL": 3}))
    w = Worker("tests.apps.djangoish", env, tmp_path / "ns-typo.log")
    try:
        code = w.wait_exit(40)
    finally:
        w.stop()
    text = w.text()
    assert code != 0
    lines = [line for line in text.splitlines() if "CELERY_REDLOCK_TLL" in line]
    assert len(lines) == 1, text
    assert "did you mean 'CELERY_REDLOCK_TTL'" in lines[0]
    assert "Traceback" not in text and "ready." not in text


# -- a bad task option, a bad beat setting: one line at start ------------------------------------
def _start_fails(app: str, command: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """Run `celery -A app COMMAND` (bounded); its exit code and everything it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, *command],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _ours(text: str) -> list[str]:
    """The lines a failed start printed, without Celery's banner and root warning."""
    return [
        line
        for line in text.splitlines()
        if line.strip() and not any(part in line for part in _BANNER)
    ]


#: Parts of what Celery prints at any start (its root-user warning, beat's banner).
_BANNER = (
    "SecurityWarning",
    "absolutely not recommended",
    "--uid",
    "User information",
    "_warn_or_raise_security_error",
    "celery beat v",
    "LocalTime",
    "Configuration",
    ". broker",
    ". loader",
    ". scheduler",
    ". db",
    ". logfile",
    ". maxinterval",
)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["worker", "beat"])
def test_a_bad_lock_key_stops_a_worker_and_a_beat_in_one_line(
    server: RedisServer, tmp_path: Path, command: str
) -> None:
    """A lock_key naming <usr_id> on a task that takes user_id: `celery worker` and
    `celery beat` each exit non-zero printing one line that names the task, the option
    and the fix, with no traceback."""
    base = f"redis://127.0.0.1:{server.port}"
    env = {"BADKEY_BROKER": f"{base}/11", "BADKEY_LOCKS": f"{base}/12"}
    argv = ["worker", "-P", "prefork", "-c", "1"] if command == "worker" else ["beat"]
    if command == "beat":
        argv += ["-s", str(tmp_path / "schedule"), "--pidfile="]
    code, text = _start_fails("tests.apps.badkeyapp", argv, env, tmp_path)
    assert code != 0, text
    assert "Traceback" not in text, text
    lines = _ours(text)
    assert len(lines) == 1, text
    assert lines[0].startswith("Error: task 'tests.apps.badkeyapp.sync_user': lock_key"), lines
    assert "did you mean <user_id>?" in lines[0]


@pytest.mark.slow
def test_a_beat_on_memory_locks_stops_in_one_line(server: RedisServer, tmp_path: Path) -> None:
    """redlock_url="memory://" under `celery beat -S LeaderScheduler`: one line saying why
    (beat processes would not share the locks), exit non-zero, no traceback."""
    env = _env(server, 13, 14, REDLOCK_TEST_CONF=json.dumps({"redlock_url": "memory://beat"}))
    argv = ["beat", "-S", "celery_redlock.beat:LeaderScheduler", "-s", str(tmp_path / "s")]
    code, text = _start_fails(APP, [*argv, "--pidfile="], env, tmp_path)
    assert code != 0, text
    assert "Traceback" not in text, text
    lines = _ours(text)
    assert len(lines) == 1, text
    assert lines[0].startswith("Error: redlock_url='memory://beat' keeps locks in this process")
