"""A run re-queued by its lock: what its attempts store, in which order, on a real prefork
worker (`celery -A tests.apps.retryapp`) with a real Redis result backend.

Each task of the app has a result backend that stores some states late (a pause between
Celery's read of the stored state and its write, as a loaded machine makes) or refuses
them. A test sends several calls on one key with 10 ms lock backoffs, waits until the
worker has ended every attempt it started, then reads every stored state straight from
Redis and calls ``result.get()``: each must be the run's real outcome.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from servers import RedisServer, wait_for
from workers import Worker, publishing, running_worker, worker_env

pytestmark = pytest.mark.slow

APP = "tests.apps.retryapp"


@pytest.fixture(scope="module")
def worker(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One prefork worker of concurrency 6 (a child pauses in each slowed write)."""
    log = tmp_path_factory.mktemp("retry-order") / "worker.log"
    with running_worker(APP, worker_env(server), log, concurrency=6) as started:
        yield started


@pytest.fixture
def client(server: RedisServer, worker: Worker) -> Iterator[Celery]:
    with publishing(worker_env(server)) as app:
        yield app


def _stored(server: RedisServer, task_id: str) -> dict[str, Any]:
    """What the result backend holds for *task_id* now (read from Redis, never cached)."""
    raw = server.client(db=2).get(f"celery-task-meta-{task_id}")
    return json.loads(raw) if raw else {"status": "PENDING"}


def _events(server: RedisServer, name: str) -> list[dict[str, Any]]:
    events = [json.loads(r) for r in server.client(db=3).lrange("events", 0, -1)]
    return [e for e in events if e["task"] == f"{APP}.{name}"]


def _settled(server: RedisServer, name: str, ended: int) -> bool:
    """Every message of task *name* the worker received has ended its trace, and *ended*
    of them succeeded."""
    events = _events(server, name)
    received = sum(e["event"] == "received" for e in events)
    traced = [e["state"] for e in events if e["event"] == "ended"]
    return len(traced) == received and traced.count("SUCCESS") == ended


def _run(client: Celery, server: RedisServer, name: str, calls: list[tuple[Any, ...]]) -> list[Any]:
    results = []
    for args in calls:
        results.append(client.send_task(f"{APP}.{name}", args=args))
        time.sleep(0.005)
    wait_for(lambda: _settled(server, name, len(calls)), 60, f"the {name} runs to end")
    time.sleep(PAUSE_MARGIN)  # a write held by the backend's pauses lands by then
    assert any(e["state"] != "SUCCESS" for e in _events(server, name) if e["event"] == "ended")
    return results


#: Longer than twice the app's pause between a read and its write (``retryapp.PAUSE``).
PAUSE_MARGIN = 1.0


def test_a_late_retry_never_overwrites_the_next_attempts_success(
    client: Celery, server: RedisServer, worker: Worker
) -> None:
    """Six calls on one key, 10 ms backoffs, each RETRY written 0.3 s after Celery read the
    state: every stored state is SUCCESS with the run's value, and every get() returns it."""
    results = _run(client, server, "busy", [(n, 0.05) for n in range(6)])
    assert [_stored(server, r.id)["status"] for r in results] == ["SUCCESS"] * 6
    assert [r.get(timeout=5) for r in results] == list(range(6))


def test_a_run_re_queued_for_its_rate_slot_ends_with_its_own_outcome(
    client: Celery, server: RedisServer, worker: Worker
) -> None:
    """lock_rate="10/s": six calls at once, the refused ones re-queued for slots 100 ms
    apart, each RETRY written late: every stored state is SUCCESS, every get() returns."""
    results = _run(client, server, "paced", [(n,) for n in range(6)])
    assert [_stored(server, r.id)["status"] for r in results] == ["SUCCESS"] * 6
    assert [r.get(timeout=5) for r in results] == list(range(6))


def test_a_result_backend_refusing_every_retry_and_failure_loses_no_run(
    client: Celery, server: RedisServer, worker: Worker
) -> None:
    """The result backend refuses every RETRY and FAILURE of the task: each refused run is
    re-queued all the same, runs, and stores its SUCCESS; get() returns every value."""
    results = _run(client, server, "down", [(n, 0.05) for n in range(4)])
    assert [r.get(timeout=5) for r in results] == list(range(4))
    assert "the result backend refuses writes" in worker.text()


def test_a_refused_retry_store_publishes_after_celerys_failure(
    client: Celery, server: RedisServer, worker: Worker
) -> None:
    """The backend refuses RETRY and stores FAILURE late: Celery's FAILURE for that internal
    error lands before the next attempt is published, so every run ends SUCCESS."""
    results = _run(client, server, "flaky", [(n, 0.05) for n in range(4)])
    assert [_stored(server, r.id)["status"] for r in results] == ["SUCCESS"] * 4
    assert [r.get(timeout=5) for r in results] == list(range(4))


def test_an_on_retry_that_raises_loses_no_run_and_its_failure_is_replaced(
    client: Celery, server: RedisServer, worker: Worker
) -> None:
    """The task's on_retry raises (Celery then stores FAILURE, late here): each refused run
    is still re-queued, after that FAILURE, and every run ends SUCCESS."""
    results = _run(client, server, "hook", [(n, 0.05) for n in range(4)])
    assert [_stored(server, r.id)["status"] for r in results] == ["SUCCESS"] * 4
    assert [r.get(timeout=5) for r in results] == list(range(4))


def test_an_on_retry_that_does_not_call_ours_changes_nothing(
    client: Celery, server: RedisServer, worker: Worker
) -> None:
    """The task's on_retry neither calls LockedTask's nor raises: every run ends SUCCESS."""
    results = _run(client, server, "bare", [(n, 0.05) for n in range(4)])
    assert [_stored(server, r.id)["status"] for r in results] == ["SUCCESS"] * 4
    assert [r.get(timeout=5) for r in results] == list(range(4))


def test_a_lock_retry_that_cannot_be_published_stores_failure_and_frees_the_hold(
    client: Celery, server: RedisServer, worker: Worker
) -> None:
    """lock_on="enqueue": the second call's lock retry cannot be published: its state is
    FAILURE naming the broker's error (not RETRY for ever), get() raises it, and its
    enqueue-time hold is given back, so a third call is queued and runs."""
    first = client.send_task(f"{APP}.stuck", args=(1, 0.5))
    wait_for(lambda: "stuck[" in worker.text() and "] received" in worker.text(), 10, "first")
    time.sleep(0.1)  # the first run holds the key
    second = client.send_task(f"{APP}.stuck", args=(2, 0.0))
    with pytest.raises(Exception, match="broker refuses the lock retry"):
        second.get(timeout=10, propagate=True)
    assert _stored(server, second.id)["status"] == "FAILURE"
    assert first.get(timeout=10) == 1
    third = client.send_task(f"{APP}.stuck", args=(3, 0.0))
    assert third.id != second.id
    assert third.get(timeout=10) == 3
