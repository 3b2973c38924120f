"""LockedTask on real prefork workers (`celery -A tests.apps.lockapp worker` subprocesses).

These are the failure cases only a real pool shows: a child SIGKILLed mid-task, a
hard time limit, revoke(terminate=True), the whole worker SIGKILLed, and
exclusion across pool processes, on a Redis broker and on RabbitMQ.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu
import pytest
from celery import Celery
from servers import RABBIT, RedisServer, rabbitmq_up, wait_for
from workers import Worker, close_publisher, publisher, publishing, running_worker, worker_env

pytestmark = pytest.mark.slow

APP = "tests.apps.lockapp"


def _env(server: RedisServer, ttl: float, broker: str | None = None) -> dict[str, str]:
    return worker_env(server, broker=broker, REDLOCK_TEST_TTL=str(ttl))


def _client_app(env: dict[str, str]) -> Celery:
    return publisher(env["REDLOCK_TEST_BROKER"], env["REDLOCK_TEST_BACKEND"])


def _events(server: RedisServer, kind: str | None = None) -> list[dict[str, Any]]:
    raw = server.client(db=3).lrange("events", 0, -1)
    events = [json.loads(r) for r in raw]
    return [e for e in events if kind is None or e["event"] == kind]


@pytest.fixture(scope="module")
def worker(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A prefork worker with concurrency 4 and a 30 s lock TTL, shared by this module."""
    with running_worker(
        APP, _env(server, 30), tmp_path_factory.mktemp("w") / "worker.log", concurrency=4
    ) as w:
        yield w


@pytest.fixture
def client(server: RedisServer, worker: Worker) -> Iterator[Celery]:
    """A client app for the shared worker; the record list is emptied first."""
    server.client(db=3).delete("events")
    with publishing(_env(server, 30)) as app:
        yield app


def _lock_exists(server: RedisServer, name: str) -> bool:
    return bool(server.client(db=1).exists(f"redlock:{{{name}}}"))


def _own_broker_env(server: RedisServer, ttl: float, broker_db: int) -> dict[str, str]:
    """The environment of a test's own worker: a broker database of its own, so that the
    module's shared worker does not pick its tasks up; the record list is emptied first."""
    server.client(db=3).delete("events")
    return _env(server, ttl, broker=f"redis://127.0.0.1:{server.port}/{broker_db}")


def _started_hold(server: RedisServer, app: Celery, prefix: str, seconds: float) -> str:
    """A new name (*prefix*-...) held by a ``hold`` task of *seconds*, once its body has
    started."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    app.send_task(f"{APP}.hold", args=(name, seconds))
    wait_for(lambda: _events(server, "start"), 20)
    return name


def test_runs_for_one_user_never_overlap_and_other_users_do(
    client: Celery, server: RedisServer
) -> None:
    """40 tasks over 4 user ids on prefork c=4: same-id runs never overlap, others do."""
    results = [client.send_task(f"{APP}.interval", args=(i % 4, 0.15)) for i in range(40)]
    for r in results:
        r.get(timeout=60)
    by_user: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in _events(server, "interval"):
        by_user[e["user"]].append(e)
    assert sorted(by_user) == [0, 1, 2, 3]
    assert sum(len(v) for v in by_user.values()) == 40
    for runs in by_user.values():
        runs.sort(key=lambda e: e["start"])
        for before, after in itertools.pairwise(runs):
            assert after["start"] >= before["end"], (before, after)
            assert after["fence"] > before["fence"]
    everything = sorted((e for runs in by_user.values() for e in runs), key=lambda e: e["start"])
    overlaps = sum(
        1
        for a, b in itertools.pairwise(everything)
        if b["start"] < a["end"] and b["user"] != a["user"]
    )
    assert overlaps > 0, "different users should run in parallel on 4 processes"


def test_child_sigkilled_mid_task_frees_lock_well_before_ttl(
    client: Celery, server: RedisServer
) -> None:
    """A pool child SIGKILLed while holding a 30 s lock: the main process frees it at once."""
    name = f"kill-{uuid.uuid4().hex[:6]}"
    result = client.send_task(f"{APP}.hold", args=(name, 20))
    wait_for(lambda: _events(server, "start"), 20)
    child = _events(server, "start")[0]["pid"]
    assert _lock_exists(server, f"hold:{name}")
    killed = time.monotonic()
    os.kill(child, signal.SIGKILL)
    began = time.monotonic()
    wait_for(lambda: not _lock_exists(server, f"hold:{name}"), 15)
    freed = time.monotonic() - began
    assert time.monotonic() - killed < 10, "freed well before the 30 s TTL"
    assert freed < 10
    assert result.get(propagate=False, timeout=10) is not None
    assert result.state == "FAILURE"


def test_hard_time_limit_frees_lock_well_before_ttl(client: Celery, server: RedisServer) -> None:
    """A hard time limit (1.5 s) kills the child; its 30 s lock is released at once."""
    name = f"limit-{uuid.uuid4().hex[:6]}"
    result = client.send_task(f"{APP}.limited", args=(name, 20))
    wait_for(lambda: _events(server, "start"), 20)
    started = time.monotonic()
    wait_for(lambda: not _lock_exists(server, f"limited:{name}"), 15)
    assert time.monotonic() - started < 8, "released around the 1.5 s limit, not the 30 s TTL"
    result.get(propagate=False, timeout=10)
    assert result.state == "FAILURE"
    assert "TimeLimitExceeded" in repr(result.result)


def test_revoke_terminate_frees_lock_well_before_ttl(client: Celery, server: RedisServer) -> None:
    """revoke(terminate=True) of a running locked task frees its 30 s lock at once."""
    name = f"revoke-{uuid.uuid4().hex[:6]}"
    result = client.send_task(f"{APP}.hold", args=(name, 20))
    wait_for(lambda: _events(server, "start"), 20)
    assert _lock_exists(server, f"hold:{name}")
    revoked = time.monotonic()
    client.control.revoke(result.id, terminate=True, signal="SIGKILL")
    wait_for(lambda: not _lock_exists(server, f"hold:{name}"), 15)
    assert time.monotonic() - revoked < 10
    # the next run of the same key proceeds
    again = client.send_task(f"{APP}.hold", args=(name, 0.05))
    assert again.get(timeout=20) == name


def test_terminated_child_is_not_released_while_it_still_runs(
    client: Celery, server: RedisServer
) -> None:
    """The main process releases only after the child is gone: no 'end' of the old run
    is recorded after the next holder started."""
    name = f"term-{uuid.uuid4().hex[:6]}"
    result = client.send_task(f"{APP}.hold", args=(name, 20))
    wait_for(lambda: _events(server, "start"), 20)
    client.control.revoke(result.id, terminate=True)  # SIGTERM: the child dies promptly
    wait_for(lambda: not _lock_exists(server, f"hold:{name}"), 15)
    nxt = client.send_task(f"{APP}.hold", args=(name, 0.05))
    assert nxt.get(timeout=20) == name
    starts = [e for e in _events(server, "start") if e["name"] == name]
    assert len(starts) == 2 and starts[1]["fence"] > starts[0]["fence"]
    ends = [e for e in _events(server, "end") if e["name"] == name]
    assert len(ends) == 1, "the terminated run never finished its body"


def test_whole_worker_sigkilled_lock_expires_within_ttl_then_next_run_proceeds(
    server: RedisServer, tmp_path: Path
) -> None:
    """SIGKILL of the whole worker: nobody releases, the 3 s lease expires, the next run works."""
    env = _own_broker_env(server, 3, broker_db=4)
    with publishing(env) as app:
        with running_worker(APP, env, tmp_path / "first.log") as first:
            name = _started_hold(server, app, "wk", 30)
            first.kill()
            killed = time.monotonic()
            assert _lock_exists(server, f"hold:{name}"), "nobody is left to release it"
            wait_for(lambda: not _lock_exists(server, f"hold:{name}"), 10)
            assert time.monotonic() - killed <= 3.0 + 0.5, "expired within one TTL"
        with running_worker(APP, env, tmp_path / "second.log"):
            assert app.send_task(f"{APP}.hold", args=(name, 0.05)).get(timeout=20) == name


@pytest.mark.skipif(not rabbitmq_up(), reason="no RabbitMQ on 127.0.0.1:5672")
def test_exclusion_end_to_end_with_rabbitmq_broker(server: RedisServer, tmp_path: Path) -> None:
    """Same-key runs never overlap with RabbitMQ as the broker (Redis only for locks)."""
    server.client(db=3).delete("events")
    queue = f"redlock-{uuid.uuid4().hex[:8]}"  # private: stale messages never reach it
    env = _env(server, 30, broker=RABBIT)
    w = Worker(APP, env, tmp_path / "rabbit.log", concurrency=4, extra=("-Q", queue))
    app = _client_app(env)
    try:
        w.wait_ready()
        results = [
            app.send_task(f"{APP}.interval", args=(i % 2, 0.1), queue=queue) for i in range(12)
        ]
        for r in results:
            r.get(timeout=60)
        by_user: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for e in _events(server, "interval"):
            by_user[e["user"]].append(e)
        assert sum(len(v) for v in by_user.values()) == 12
        for runs in by_user.values():
            runs.sort(key=lambda e: e["start"])
            for before, after in itertools.pairwise(runs):
                assert after["start"] >= before["end"]
    finally:
        w.stop()
        close_publisher(app)
        _delete_queue(queue)


def _delete_queue(name: str) -> None:
    with kombu.Connection(RABBIT) as conn:
        conn.default_channel.queue_delete(name)


def test_soft_time_limit_releases_when_the_body_ends(client: Celery, server: RedisServer) -> None:
    """SoftTimeLimitExceeded inside the body: the lock is released as the body exits."""
    name = f"soft-{uuid.uuid4().hex[:6]}"
    result = client.send_task(f"{APP}.soft", args=(name, 10))
    result.get(propagate=False, timeout=20)
    assert result.state == "FAILURE"
    assert "SoftTimeLimitExceeded" in repr(result.result)
    assert not _lock_exists(server, f"soft:{name}"), "released before the result was stored"


def test_stolen_lock_raises_lock_lost_in_a_sleeping_prefork_child(
    client: Celery, server: RedisServer
) -> None:
    """A prefork child asleep in time.sleep gets LockLost within ~one renewal interval
    after its key is deleted from outside (the signal path interrupts the sleep)."""
    name = f"steal-{uuid.uuid4().hex[:6]}"
    result = client.send_task(f"{APP}.stealable", args=(name, 20))
    wait_for(lambda: _events(server, "start"), 20)
    server.client(db=1).delete(f"redlock:{{steal:{name}}}")
    stolen = time.time()
    wait_for(lambda: _events(server, "lost"), 10)
    lost = _events(server, "lost")[0]
    # one renewal interval is ttl/3 = 0.5 s; allow a command timeout and scheduling on top
    assert lost["t"] - stolen < 1.5, lost
    # The body's LockLostInterrupt names the lock (its rendered name) and why it was lost.
    assert lost["error"].startswith(f"lock 'steal:{name}': lost while the task ran ("), lost
    result.get(propagate=False, timeout=10)
    assert result.state == "FAILURE"
    assert "LockLost" in repr(result.result)
    assert not _events(server, "end"), "the body did not go on after losing its lock"


def test_warm_shutdown_finishes_the_task_and_releases(server: RedisServer, tmp_path: Path) -> None:
    """SIGTERM (warm shutdown) while a task holds its lock: the task finishes, the lock is
    released, and the worker exits cleanly."""
    env = _own_broker_env(server, 30, broker_db=5)
    with publishing(env) as app, running_worker(APP, env, tmp_path / "warm.log") as w:
        name = _started_hold(server, app, "warm", 1.5)
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(30) == 0
        assert [e["name"] for e in _events(server, "end")] == [name]
        assert not _lock_exists(server, f"hold:{name}")


@pytest.mark.parametrize("multiprocess", [False, True], ids=["private-registry", "multiproc-dir"])
def test_pool_children_count_metrics_only_where_they_can_be_scraped(
    server: RedisServer, tmp_path: Path, multiprocess: bool
) -> None:
    """Without PROMETHEUS_MULTIPROC_DIR a prefork child's counts land in its own copy of the
    registry, which nothing can scrape: install()'s default metrics are off in the child.
    With the directory set they stay on, and the children's counts reach the directory."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415
    from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415

    env = _env(server, 30)
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    if multiprocess:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)
    queue = f"metrics-{uuid.uuid4().hex[:8]}"  # only this worker, not the module's shared one
    w = Worker(APP, env, tmp_path / "worker.log", concurrency=1, extra=("-Q", queue))
    app = _client_app(env)
    try:
        w.wait_ready()
        state = app.send_task(f"{APP}.metrics_state", args=(uuid.uuid4().int % 10**6,), queue=queue)
        seen = state.get(timeout=30)
        assert seen["pid"] != w.proc.pid  # it ran in a pool child
        if multiprocess:
            assert seen["hook"] is True and seen["registries"] == 1
        else:
            assert seen["hook"] is False and seen["registries"] == 0
    finally:
        close_publisher(app)
        w.stop()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(prom_dir))
    acquired = registry.get_sample_value(
        "celery_redlock_events_total",
        {"kind": "acquired", "task": f"{APP}.metrics_state"},
    )
    if multiprocess:
        assert acquired == 1.0
    else:
        assert acquired is None  # nothing was written there
