"""LockedTask on a real worker of every pool Celery ships (`celery -A tests.apps.poolapp worker
-P <pool>` subprocesses): runs, renewal past the lease, exclusion on one key, a lost lock
interrupting its body, the start-up lines, and a killed run's key freed at once (prefork:
a SIGKILLed child, by the main process; gevent and eventlet: revoke(terminate=True)).

One worker per pool serves all of that pool's tests (a module fixture parametrised by pool:
pytest runs each pool's tests together), leases are short, and the bodies only sleep and
wait on sockets, as green threads must.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.concurrency import get_implementation
from celery.concurrency.base import BasePool
from servers import RedisServer, wait_for
from workers import Worker, close_publisher, running_worker, worker_env

from celery_redlock import Lock

pytestmark = pytest.mark.slow

APP = "tests.apps.poolapp"
#: Every pool Celery ships, with the concurrency its worker gets here.
POOLS = {"prefork": 2, "threads": 4, "solo": 1, "gevent": 8, "eventlet": 8}
#: The start-up line of a pool without child processes (celery_redlock.worker.pools).
NO_CHILD = "no pool child to watch"
SOLO_WAIT = "lock_on_contended='wait', but this worker's pool is solo"


def _env(server: RedisServer) -> dict[str, str]:
    return worker_env(server)


@pytest.fixture(scope="module", params=list(POOLS))
def pool_worker(
    request: pytest.FixtureRequest, server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    """One worker of the pool (the parameter), shared by that pool's tests."""
    pool: str = request.param
    log = tmp_path_factory.mktemp(pool) / "worker.log"
    with running_worker(APP, _env(server), log, concurrency=POOLS[pool], pool=pool) as w:
        yield w


@pytest.fixture
def client(server: RedisServer, pool_worker: Worker) -> Iterator[Celery]:
    """The test app (it imports the tasks, so a publish takes enqueue-time holds), pointed
    at this module's server; the record list is emptied first."""
    from celery_redlock.app.state import state_for  # noqa: PLC0415
    from tests.apps import poolapp  # noqa: PLC0415 - configured below, not from the env

    server.client(db=3).delete("events")
    env = _env(server)
    app: Celery = poolapp.app
    app.conf.update(
        broker_url=env["REDLOCK_TEST_BROKER"],
        result_backend=env["REDLOCK_TEST_BACKEND"],
        redlock_url=env["REDLOCK_TEST_LOCKS"],
        result_backend_transport_options={"retry_policy": {"max_retries": 2}},
    )
    state_for(app).reset()
    try:
        yield app
    finally:
        close_publisher(app)


def _events(server: RedisServer, kind: str) -> list[dict[str, Any]]:
    events = [json.loads(r) for r in server.client(db=3).lrange("events", 0, -1)]
    return [e for e in events if e["event"] == kind]


def _terminates(pool: str) -> bool:
    """Whether this Celery's *pool* can terminate a running task (``revoke(terminate=True)``):
    eventlet can, gevent from Celery 5.4 on; threads and solo cannot."""
    with warnings.catch_warnings():  # eventlet's pool module warns when imported unpatched
        warnings.simplefilter("ignore")
        cls = get_implementation(pool)
    return getattr(cls, "terminate_job", None) is not BasePool.terminate_job


def _lock_exists(server: RedisServer, name: str) -> bool:
    return bool(server.client(db=1).exists(f"redlock:{{{name}}}"))


def test_calls_on_one_key_run_in_turn_and_a_body_outliving_its_lease_keeps_it(
    client: Celery, server: RedisServer, pool_worker: Worker
) -> None:
    """The test holds a key while 3 calls on it arrive: none runs during the hold or beside
    another (the bodies' own timestamps, rising fences), and the first, 1.8 s of sleep and
    socket waits on a 1.2 s lease, still owns its lock at the end (renewal ran)."""
    key = uuid.uuid4().hex[:8]
    outside = Lock(server.client(db=1), f"turn:{key}", ttl=5)
    assert outside.acquire(blocking=False)
    results = [client.send_task(f"{APP}.turn", args=(key, 1.8, True))]
    results += [client.send_task(f"{APP}.turn", args=(key, 0.2)) for _ in range(2)]
    time.sleep(0.4)  # the test's hold lasts 0.4 s: the calls arrive meanwhile and retry
    held_to = time.time()
    outside_fence = outside.fence
    outside.release()
    fences = [r.get(timeout=30) for r in results]
    runs = sorted(_events(server, "turn"), key=lambda e: e["start"])
    assert len(runs) == 3
    assert runs[0]["start"] >= held_to, "a run started during the test's hold"
    for before, after in itertools.pairwise(runs):
        assert after["start"] >= before["end"], (before, after)
        assert after["fence"] > before["fence"]
    assert all(run["fence"] > outside_fence for run in runs)
    assert sorted(fences) == [run["fence"] for run in runs]
    long_run = next(run for run in runs if run["end"] - run["start"] > 1.5)
    assert long_run["owned"] is True and long_run["lost"] is False, long_run
    assert all(run["owned"] and not run["lost"] for run in runs), runs
    assert not _lock_exists(server, f"turn:{key}")


def test_a_lost_lock_interrupts_the_body_with_lock_lost(
    client: Celery, server: RedisServer, pool_worker: Worker
) -> None:
    """The key of a running body (0.9 s lease, lock_on_lost="raise") is deleted: the body
    gets LockLost within a renewal interval, inside one long sleep (a threads pool body: at
    its next instruction, so it sleeps in short steps there), and the run fails with it."""
    name = uuid.uuid4().hex[:8]
    step = 0.05 if pool_worker.pool == "threads" else 10.0
    result = client.send_task(f"{APP}.stealable", args=(name, 10.0, step))
    wait_for(lambda: _events(server, "steal-start"), 20, "the body to start")
    assert server.client(db=1).delete(f"redlock:{{steal:{name}}}") == 1
    stolen_at = time.time()
    result.get(timeout=10, propagate=False)
    assert result.state == "FAILURE"
    assert isinstance(result.result, Exception) and "LockLost" in type(result.result).__name__
    assert name in str(result.result)
    lost = _events(server, "lost")
    assert len(lost) == 1, lost
    assert lost[0]["t"] - stolen_at < 0.9 / 3 + 0.7, lost[0]["t"] - stolen_at
    assert not _events(server, "steal-end")


def test_a_call_locked_at_publish_runs_and_frees_its_key(
    client: Celery, server: RedisServer, pool_worker: Worker
) -> None:
    """lock_on="enqueue+run": the call runs (its result comes back) and its key is freed."""
    name = uuid.uuid4().hex[:8]
    result = client.tasks[f"{APP}.queued"].delay(name)
    assert result.get(timeout=20) == name
    wait_for(lambda: not _lock_exists(server, f"queued:{name}"), 5, "the key to be freed")
    assert not server.client(db=1).exists(f"redlock:{{queued:{name}}}:queued")


def test_metrics_count_where_the_worker_exports_them(client: Celery, pool_worker: Worker) -> None:
    """Prometheus lock metrics stay on where a body runs in the worker's own process (solo
    sends worker_process_init there too), and are off in a prefork child, whose private
    registry nothing scrapes (no PROMETHEUS_MULTIPROC_DIR)."""
    seen = client.send_task(f"{APP}.metrics_state", args=(uuid.uuid4().int % 10**6,))
    state = seen.get(timeout=20)
    in_child = pool_worker.pool == "prefork"
    assert (state["pid"] != pool_worker.proc.pid) is in_child
    assert state["hook"] is not in_child


def test_the_worker_says_once_at_start_what_its_pool_cannot_do(pool_worker: Worker) -> None:
    """A pool without children says so in one start-up line (prefork says nothing); solo
    warns of its task with lock_on_contended="wait"; no pool trips over its "pid"."""
    text = pool_worker.text()
    lines = [line for line in text.splitlines() if NO_CHILD in line]
    if pool_worker.pool == "prefork":
        assert lines == []
    else:
        assert len(lines) == 1, lines
        assert f"pool {pool_worker.pool} " in lines[0]
    waits = [line for line in text.splitlines() if SOLO_WAIT in line]
    assert len(waits) == (1 if pool_worker.pool == "solo" else 0), waits
    if waits:
        assert "tests.apps.poolapp.waiting" in waits[0] and "'retry'" in waits[0]
    assert "OverflowError" not in text
    assert "could not watch pool child" not in text


def test_a_killed_run_frees_its_key_at_once(
    client: Celery, server: RedisServer, pool_worker: Worker
) -> None:
    """A run holding a 30 s lease is killed: prefork, its child SIGKILLed (the main process
    frees the key); gevent and eventlet, revoke(terminate=True) where the pool can (the green
    thread is killed and its run releases). Either way the key is free within seconds, and
    the next run runs."""
    pool = pool_worker.pool
    if pool != "prefork" and not _terminates(pool):
        pytest.skip(f"{pool}: no child to kill, and this Celery's pool cannot terminate a task")
    name = uuid.uuid4().hex[:8]
    result = client.send_task(f"{APP}.hold", args=(name, 20))
    wait_for(lambda: _events(server, "hold-start"), 20, "the body to start")
    assert _lock_exists(server, f"hold:{name}")
    killed = time.monotonic()
    if pool == "prefork":
        child = _events(server, "hold-start")[0]["pid"]
        assert child != pool_worker.proc.pid
        os.kill(child, signal.SIGKILL)
    else:
        result.revoke(terminate=True)
    wait_for(lambda: not _lock_exists(server, f"hold:{name}"), 10, "the key to be freed")
    assert time.monotonic() - killed < 5, "freed at once, not after the 30 s lease"
    result.get(propagate=False, timeout=10)
    assert result.state == ("FAILURE" if pool == "prefork" else "REVOKED")
    after = client.send_task(f"{APP}.hold", args=(name, 0))
    assert after.get(timeout=20) == name
