"""Lock servers that cannot serve: wrong URLs and passwords, TLS against a plain server, a
server still loading its data set (-LOADING), a read-only replica (-READONLY), and
``maxmemory`` reached under ``noeviction`` (-OOM). All of them real redis-servers.

What each case must give, decided per case:

* a URL no client can be made of is a configuration error: the worker does not start,
  and says so in one line naming the URL with its password masked;
* a refused password, a TLS URL for a plain server, and a replica where a master belongs
  are configuration errors too, but they can only be found by asking the server: the
  worker says so loudly at start-up (one ERROR line naming the server, password masked)
  and keeps running; locked tasks are retried, and fail when their lock retries run out;
* a server loading its data set, a replica (a failover may be in progress) and a server
  out of memory are transient: locked tasks are retried and run once the server serves
  again. Locks already held stay held through an OOM spell (renewal and release are
  allowed there).

In every case no task body runs without its lock, and no error says "bad input" about a
Redis that merely cannot serve.

The broker and result backend live on the session's healthy server; only the lock
store is broken.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker
from servers import RedisServer, free_port, wait_for
from workers import Worker, close_publisher

from celery_redlock import ConfigError, Lock, LockedTask, StoreUnavailable, connect

SECRET = "hunter2-secret"
_apps = itertools.count(1)


def lines(caplog: pytest.LogCaptureFixture, words: str, level: int = logging.DEBUG) -> list[str]:
    """celery_redlock messages at *level* or above that contain *words*."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("celery_redlock") and r.levelno >= level and words in r.getMessage()
    ]


def refused_twice(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    """The "not started, lock *key* unavailable" messages, once there are two (bounded): a
    task refused by the server twice, so retried, not failed."""
    words = f"not started, lock '{key}' unavailable"

    def two() -> list[str]:
        found = lines(caplog, words)
        return found if len(found) >= 2 else []

    return wait_for(two, 20, "two refused attempts")


def all_logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


class Runs:
    """What task bodies did: each run appends (name, fence it held) to a list in db 3."""

    def __init__(self, server: RedisServer) -> None:
        self.client = server.client(db=3, decode_responses=True)
        self.key = f"runs:{uuid.uuid4().hex[:8]}"

    def add(self, name: str, fence: int | None) -> None:
        self.client.rpush(self.key, json.dumps([name, fence]))

    def all(self) -> list[list[Any]]:
        return [json.loads(v) for v in self.client.lrange(self.key, 0, -1)]


@pytest.fixture
def runs(shared_redis: RedisServer, redis_client: redis.Redis) -> Runs:
    """The run record, on the (flushed) shared server."""
    return Runs(shared_redis)


@pytest.fixture
def make_app(shared_redis: RedisServer, runs: Runs) -> Iterator[Callable[..., tuple[Celery, Any]]]:
    """Factory: an app whose locks live at *lock_url*, with one LockedTask ``job(name)``
    that records the fence it ran under; broker and results on the healthy shared server."""
    apps: list[Celery] = []
    base = f"redis://{shared_redis.host}:{shared_redis.port}"

    def make(
        lock_url: str, client_options: dict[str, Any] | None = None, **options: Any
    ) -> tuple[Celery, Any]:
        number = next(_apps)
        app = Celery(f"badsrv{number}", broker=f"{base}/0", backend=f"{base}/2")
        app.conf.update(
            redlock_url=lock_url,
            redlock_client_options=client_options or {},
            task_default_queue=f"badsrv{number}-{uuid.uuid4().hex[:6]}",
            worker_hijack_root_logger=False,
            broker_connection_retry_on_startup=True,
            broker_transport_options={"polling_interval": 0.05},
            worker_prefetch_multiplier=1,
        )
        apps.append(app)
        task_options = {
            "lock_retry_backoff": 0.2,
            "lock_retry_backoff_max": 0.2,
            "lock_retry_jitter": False,
            **options,
        }

        @app.task(base=LockedTask, bind=True, lock_key="job:<name>", shared=False, **task_options)
        def job(self: Any, name: str, hold: float = 0.0) -> str:
            lock = self.lock
            runs.add(name, lock.fence if lock is not None else None)
            deadline = time.monotonic() + hold
            while time.monotonic() < deadline:
                time.sleep(0.01)
            return name

        return app, job

    try:
        yield make
    finally:
        gc.collect()  # results in reference cycles unsubscribe now, while the server is up
        for app in apps:
            close_publisher(app)


# start_worker, not redlock_worker: the start is under test (a ConfigError, start-up lines).
@contextlib.contextmanager
def worker(app: Celery) -> Iterator[Any]:
    """An in-process worker (threads pool) for *app*."""
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False) as w:
        yield w


def assert_locked_runs(runs: Runs, names: list[str]) -> None:
    """Exactly these runs happened, each under a lock (with a fence)."""
    done = runs.all()
    assert [name for name, _ in done] == names
    assert all(isinstance(fence, int) and fence >= 1 for _, fence in done), done


# ------------------------------------------------------------------------ URLs no client fits

BAD_URLS = [
    f"http://:{SECRET}@127.0.0.1:6390/1",
    f"redis://:{SECRET}@127.0.0.1:notaport/1",
    f"redis://:{SECRET}@127.0.0.1:6390/abc",
    f"sentinel://:{SECRET}@127.0.0.1:26390/1",
    f"user:{SECRET}@127.0.0.1:6390/1",
]


@pytest.mark.parametrize("url", BAD_URLS, ids=["scheme", "port", "db", "no-master", "no-scheme"])
def test_a_url_no_client_can_be_made_of_stops_the_worker_naming_it_masked(
    make_app: Callable[..., tuple[Celery, Any]], runs: Runs, url: str
) -> None:
    """A lock URL that cannot be a Redis client: a ConfigError when the worker starts (not
    deep in a task), naming the URL with the password masked; no task runs."""
    app, _job = make_app(url)
    with pytest.raises(ConfigError) as caught, worker(app):
        pass
    message = str(caught.value)
    assert SECRET not in message
    assert "127.0.0.1" in message
    assert runs.all() == []


@pytest.mark.slow
def test_a_bad_url_stops_a_real_worker_with_one_line_and_no_password(
    shared_redis: RedisServer, tmp_path: Path
) -> None:
    """``celery worker`` with an unusable lock URL exits non-zero after one line naming the
    URL, password masked, without a traceback."""
    base = f"redis://{shared_redis.host}:{shared_redis.port}"
    env = {
        "REDLOCK_TEST_BROKER": f"{base}/9",
        "REDLOCK_TEST_BACKEND": f"{base}/10",
        "REDLOCK_TEST_LOCKS": f"redis://:{SECRET}@127.0.0.1:6390/abc",
        "REDLOCK_TEST_RECORD": f"{base}/11",
    }
    w = Worker("tests.apps.configapp", env, tmp_path / "badurl.log")
    try:
        code = w.wait_exit()
        text = w.text()
    finally:
        w.stop()
    assert code != 0
    assert SECRET not in text
    named = [line for line in text.splitlines() if "redis://:***@127.0.0.1:6390/abc" in line]
    assert len(named) == 1, text
    assert "bad database number" in named[0]
    assert "Traceback" not in text and "ready." not in text


# ------------------------------------------------------------------------ refused, unreachable


@pytest.fixture(scope="module")
def password_server() -> Iterator[RedisServer]:
    """A server that requires a password."""
    server = RedisServer.start(["--requirepass", "the-right-one"])
    try:
        yield server
    finally:
        server.stop()


def test_wrong_or_missing_password_is_one_clear_error_naming_the_server(
    password_server: RedisServer,
) -> None:
    """Lock on a password-protected server with a wrong or no password: StoreUnavailable
    naming the server and saying the credentials were refused, never the password."""
    port = password_server.port
    for url in (f"redis://:{SECRET}@127.0.0.1:{port}/1", f"redis://127.0.0.1:{port}/1"):
        lock = Lock(connect(url), "pw", ttl=5)
        with pytest.raises(StoreUnavailable) as caught:
            lock.acquire(blocking=False)
        message = str(caught.value)
        assert f"127.0.0.1:{port}" in message and "AuthenticationError" in message
        assert SECRET not in message and SECRET not in repr(caught.value)


@pytest.mark.parametrize("case", ["wrong-password", "no-password", "tls-to-plain", "closed-port"])
def test_a_lock_server_refusing_us_is_loud_at_start_and_tasks_never_run_unlocked(
    make_app: Callable[..., tuple[Celery, Any]],
    password_server: RedisServer,
    runs: Runs,
    caplog: pytest.LogCaptureFixture,
    case: str,
    request: pytest.FixtureRequest,
) -> None:
    """Wrong password, no password, a TLS URL for a plain server, nothing listening: one
    ERROR at worker start naming the server (masked URL, what is wrong); the task is
    retried, then fails with StoreUnavailable when its lock retries run out; its body never
    runs; the password appears in no log line and no error."""
    caplog.set_level(logging.INFO, logger="celery_redlock")
    reasons: list[str] = []  # what Celery's "retry:" line says for each retry

    def on_retry(reason: Any = None, **_: Any) -> None:
        reasons.append(str(reason))

    signals.task_retry.connect(on_retry, weak=False)
    request.addfinalizer(lambda: signals.task_retry.disconnect(on_retry))
    port = password_server.port
    url, masked, words = {
        "wrong-password": (
            f"redis://:{SECRET}@127.0.0.1:{port}/1",
            f"redis://:***@127.0.0.1:{port}/1",
            "refused the credentials",
        ),
        "no-password": (
            f"redis://127.0.0.1:{port}/1",
            f"redis://127.0.0.1:{port}/1",
            "refused the credentials",
        ),
        "tls-to-plain": (
            f"rediss://:{SECRET}@127.0.0.1:{port}/1",
            f"rediss://:***@127.0.0.1:{port}/1",
            "asks for TLS",
        ),
        "closed-port": (
            f"redis://:{SECRET}@127.0.0.1:{free_port()}/1",
            None,
            "is unreachable",
        ),
    }[case]
    # A TLS client waits out its socket timeout for a server hello that never comes, on the
    # acquire and on the give-back after it: short timeouts keep the test short.
    short = {"socket_connect_timeout": 0.25, "socket_timeout": 0.25}
    app, job = make_app(url, short, lock_max_retries=1)
    with worker(app):
        startup = lines(caplog, words, logging.ERROR)
        assert len(startup) == 1, all_logged(caplog)
        if masked is not None:
            assert masked in startup[0]
        result = job.delay("a")
        with pytest.raises(StoreUnavailable) as caught:
            result.get(timeout=30, propagate=True)
    error = str(caught.value)
    assert "127.0.0.1" in error
    assert runs.all() == []
    retried = lines(caplog, "not started, lock 'job:a' unavailable", logging.WARNING)
    assert len(retried) == 1, all_logged(caplog)  # the first run, re-queued
    assert "(lock retry 1/1 in" in retried[0]
    assert len(lines(caplog, "gave up after 1 lock retries", logging.ERROR)) == 1  # its retry
    ours = [
        r
        for r in caplog.records
        if r.name.startswith("celery_redlock") and "job:a" in r.getMessage()
    ]
    assert len(ours) == 2, all_logged(caplog)  # one line of ours per attempt
    assert len(reasons) == 1 and "lock 'job:a' unavailable" in reasons[0], reasons
    assert "busy" not in reasons[0]  # contention's word
    assert SECRET not in all_logged(caplog) and SECRET not in error


# ------------------------------------------------------------------------ transient states


@pytest.fixture(scope="module")
def big_rdb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a dump.rdb of 20,000 small keys, made by a throwaway server."""
    server = RedisServer.start()
    try:
        client = server.client()
        for start in range(0, 20_000, 2_000):
            client.mset({f"filler:{i}": "x" * 10 for i in range(start, start + 2_000)})
        client.save()
        target = tmp_path_factory.mktemp("rdb")
        shutil.copy(Path(server.data_dir) / "dump.rdb", target / "dump.rdb")
    finally:
        server.stop()
    return target


@pytest.fixture
def loading_server(big_rdb: Path, tmp_path: Path) -> Iterator[RedisServer]:
    """A server that answers -LOADING: it loads 20,000 keys at 1 ms each (about 20 s);
    ``finish_loading`` ends that at once."""
    shutil.copy(big_rdb / "dump.rdb", tmp_path / "dump.rdb")
    args = ["--dir", str(tmp_path), "--dbfilename", "dump.rdb", "--key-load-delay", "1000"]
    server = RedisServer.start([*args, "--loading-process-events-interval-bytes", "1024"])
    try:
        assert int(server.client().info("persistence")["loading"]) == 1
        yield server
    finally:
        server.stop()


def finish_loading(server: RedisServer) -> None:
    """Let the server load the rest at full speed, and wait until it serves."""
    client = server.client()
    client.config_set("key-load-delay", 0)
    wait_for(lambda: int(client.info("persistence")["loading"]) == 0, 20, "loading to end")


def test_a_loading_server_retries_the_task_until_it_serves_then_runs_it_locked(
    make_app: Callable[..., tuple[Celery, Any]],
    loading_server: RedisServer,
    runs: Runs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """-LOADING is transient: a WARNING at start, the task is retried (its body does not
    run) while the server loads, and runs once, under its lock, when loading ends."""
    caplog.set_level(logging.INFO, logger="celery_redlock")
    app, job = make_app(f"redis://127.0.0.1:{loading_server.port}/1", lock_max_retries=200)
    with worker(app):
        assert len(lines(caplog, "is loading its data set", logging.WARNING)) == 1
        result = job.delay("a")
        refused = refused_twice(caplog, "job:a")
        assert f"127.0.0.1:{loading_server.port}" in refused[0]
        assert "loading" in refused[0].lower()
        assert runs.all() == []
        finish_loading(loading_server)
        assert result.get(timeout=30) == "a"
    assert_locked_runs(runs, ["a"])
    assert not loading_server.client(db=1).exists("redlock:{job:a}")


@pytest.fixture
def replica(redis_servers: Callable[[int], list[RedisServer]]) -> RedisServer:
    """A real replica (``--replicaof``) of a fresh master: read-only whether or not its
    first sync is done."""
    (master, server) = redis_servers(2)
    server.client().execute_command("REPLICAOF", master.host, str(master.port))
    role = server.client().execute_command("ROLE")
    assert role[0] in (b"slave", "slave"), role
    return server


def test_a_replica_is_an_error_at_start_and_tasks_wait_until_it_is_promoted(
    make_app: Callable[..., tuple[Celery, Any]],
    replica: RedisServer,
    runs: Runs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """-READONLY: the worker says at start that the lock URL is a read-only replica (one
    ERROR naming it); tasks are retried (never run unlocked) rather than failed, since a
    failover may be under way; promoted (REPLICAOF NO ONE), it serves and the task runs."""
    caplog.set_level(logging.INFO, logger="celery_redlock")
    app, job = make_app(f"redis://127.0.0.1:{replica.port}/1", lock_max_retries=200)
    with worker(app):
        startup = lines(caplog, "read-only replica", logging.ERROR)
        assert len(startup) == 1 and f"127.0.0.1:{replica.port}" in startup[0]
        result = job.delay("a")
        refused = refused_twice(caplog, "job:a")
        assert "ReadOnlyError" in refused[0] and f"127.0.0.1:{replica.port}" in refused[0]
        assert runs.all() == []
        replica.client().execute_command("REPLICAOF", "NO", "ONE")
        assert result.get(timeout=30) == "a"
    assert_locked_runs(runs, ["a"])


def test_out_of_memory_retries_new_tasks_and_keeps_held_locks_alive(
    make_app: Callable[..., tuple[Celery, Any]],
    redis_server: RedisServer,
    runs: Runs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """-OOM (maxmemory reached, noeviction): a task already running keeps its lock (renewal
    and release are allowed) and ends normally; a new task is retried, not run, and runs
    under its lock once memory is available again."""
    caplog.set_level(logging.INFO, logger="celery_redlock")
    admin = redis_server.client()
    admin.config_set("maxmemory-policy", "noeviction")
    app, job = make_app(
        f"redis://127.0.0.1:{redis_server.port}/1", lock_max_retries=200, lock_ttl=0.6
    )
    with worker(app):
        running = job.delay("held", 2.0)
        wait_for(lambda: runs.all(), 20, "the first task to start")
        admin.config_set("maxmemory", 1)  # far below what the server uses
        queued = job.delay("new")
        refused = refused_twice(caplog, "job:new")
        assert "OutOfMemoryError" in refused[0] and f"127.0.0.1:{redis_server.port}" in refused[0]
        assert running.get(timeout=30) == "held"  # 2 s at ttl 0.6: renewed through the OOM
        assert not lines(caplog, "LOST")
        assert [name for name, _ in runs.all()] == ["held"]
        admin.config_set("maxmemory", 0)
        assert queued.get(timeout=30) == "new"
    assert_locked_runs(runs, ["held", "new"])
    assert not redis_server.client(db=1).exists("redlock:{job:held}", "redlock:{job:new}")


def test_core_lock_reports_each_refusing_server_as_unavailable_naming_it(
    redis_server: RedisServer, replica: RedisServer, loading_server: RedisServer
) -> None:
    """Lock.acquire against OOM, a replica and a loading server: StoreUnavailable (retry
    later) naming the server and the reply, never a ConfigError about the key."""
    admin = redis_server.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        for server, words in (
            (redis_server, "OutOfMemoryError"),
            (replica, "ReadOnlyError"),
            (loading_server, "BusyLoadingError"),
        ):
            lock = Lock(connect(f"redis://127.0.0.1:{server.port}/1"), "refused", ttl=5)
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as caught:
                lock.acquire(timeout=5)
            assert time.monotonic() - started < 4  # an outage is not waited out
            assert words in str(caught.value) and f"127.0.0.1:{server.port}" in str(caught.value)
    finally:
        admin.config_set("maxmemory", 0)


def test_a_lock_held_when_the_server_starts_refusing_writes_is_released_cleanly(
    redis_server: RedisServer,
) -> None:
    """A lock taken before maxmemory is reached is extended and released under OOM (the
    next owner does not wait out a TTL)."""
    client = connect(f"redis://127.0.0.1:{redis_server.port}/1")
    lock = Lock(client, "oom:held", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    admin = redis_server.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        lock.extend()
        lock.release()
        assert not redis_server.client(db=1).exists(lock.keys.lock)
    finally:
        admin.config_set("maxmemory", 0)


def test_threads_waiting_on_a_refusing_server_are_not_left_blocked(
    redis_server: RedisServer,
) -> None:
    """A blocking acquire whose server goes OOM while it waits for a holder ends with
    StoreUnavailable within about the holder's lease, not after its own timeout."""
    client = connect(f"redis://127.0.0.1:{redis_server.port}/1")
    holder = Lock(client, "oom:wait", ttl=1.0, auto_renew=False)
    assert holder.acquire(blocking=False)
    admin = redis_server.client()
    admin.config_set("maxmemory-policy", "noeviction")
    outcome: list[BaseException | bool] = []

    def wait() -> None:
        try:
            outcome.append(Lock(client, "oom:wait", ttl=5).acquire(timeout=30))
        except BaseException as exc:  # recorded for the assertion below
            outcome.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.2)
    admin.config_set("maxmemory", 1)
    try:
        thread.join(10)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailable), outcome
    finally:
        admin.config_set("maxmemory", 0)
