"""``lock_limit`` and ``lock_rate`` on real prefork workers (`celery -A tests.apps.limitsapp`).

Two workers of concurrency 4 share one Redis: a key with 3 permits never has more than 3
runs at once and does reach 3; a permit holder SIGKILLed mid-task gets its permit back
from the worker's main process at once; a holder paused past its lease loses its permit
with a fence below its successor's; 20 starts a second hold across both workers and are
reached, without slowing other keys; a limit on Redlock masters stops the worker.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from servers import RedisServer, free_port, wait_for
from test_observability import EventCapture
from workers import Worker, close_publisher, publisher, stop_workers, values_of, worker_env

pytestmark = pytest.mark.slow

APP = "tests.apps.limitsapp"


def _env(server: RedisServer, locks: str | None = None) -> dict[str, str]:
    return worker_env(server, locks=locks)


def _events(server: RedisServer, kind: str) -> list[dict[str, Any]]:
    events = [json.loads(r) for r in server.client(db=3).lrange("events", 0, -1)]
    return [e for e in events if e["event"] == kind]


@pytest.fixture(scope="module")
def workers(
    server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    """Two prefork workers of concurrency 4 on the same broker and lock Redis, sending
    task events (-E)."""
    logs = tmp_path_factory.mktemp("limits")
    started = [
        Worker(APP, _env(server), logs / f"w{i}.log", concurrency=4, extra=("-E",))
        for i in range(2)
    ]
    try:
        for w in started:
            w.wait_ready()
        yield started
    finally:
        stop_workers(started)


@pytest.fixture
def client(server: RedisServer, workers: list[Worker]) -> Iterator[Celery]:
    """A client app for the shared workers; the record list is emptied first."""
    server.client(db=3).delete("events")
    env = _env(server)
    app = publisher(env["REDLOCK_TEST_BROKER"], env["REDLOCK_TEST_BACKEND"])
    try:
        yield app
    finally:
        close_publisher(app)


def _permits(server: RedisServer, name: str) -> int:
    return int(server.client(db=1).hlen(f"redlock:{{{name}}}:permits"))


def test_sixty_runs_with_three_permits_never_overlap_more_than_three_and_reach_three(
    client: Celery, server: RedisServer
) -> None:
    """60 runs of one key with lock_limit=3 on two workers (8 processes): at most 3 run at
    once, 3 do, every fence differs, and nothing is left held."""
    results = [client.send_task(f"{APP}.imports", args=(7, 0.1)) for _ in range(60)]
    assert values_of(results, 90) == [7] * 60
    runs = _events(server, "interval")
    assert len(runs) == 60
    edges = sorted(
        itertools.chain.from_iterable(((e["start"], 1), (e["end"], -1)) for e in runs),
        key=lambda edge: (edge[0], edge[1]),  # an end before a start at the same instant
    )
    inside = most = 0
    for _, step in edges:
        inside += step
        most = max(most, inside)
    assert most == 3
    assert len({e["fence"] for e in runs}) == 60
    assert _permits(server, "import:7") == 0


def test_permit_holder_sigkilled_gets_its_permit_back_at_once(
    client: Celery, server: RedisServer
) -> None:
    """A pool child SIGKILLed while holding one of 2 permits (30 s lease): the main process
    gives back exactly that permit at once; the other holder keeps its own."""
    name = f"kill-{os.getpid()}"
    victim = client.send_task(f"{APP}.keep", args=(name, 20))
    other = client.send_task(f"{APP}.keep", args=(name, 4))
    wait_for(lambda: len(_events(server, "start")) == 2, 20)
    child = next(e["pid"] for e in _events(server, "start") if e["task_id"] == victim.id)
    assert _permits(server, f"keep:{name}") == 2
    os.kill(child, signal.SIGKILL)
    began = time.monotonic()
    wait_for(lambda: _permits(server, f"keep:{name}") == 1, 10)
    freed = time.monotonic() - began
    assert freed < 5, "freed by the main process, not by the 30 s lease running out"
    holders = server.client(db=1).hvals(f"redlock:{{keep:{name}}}:permits")
    assert [other.id in h.decode() for h in holders] == [True]
    assert victim.get(propagate=False, timeout=10) is not None
    assert victim.state == "FAILURE"
    assert other.get(timeout=20) == name


def test_holder_paused_past_its_lease_loses_its_permit_to_a_higher_fence(
    client: Celery, server: RedisServer
) -> None:
    """Both permits held; one holder SIGSTOPped past its 1.5 s lease: a waiting run gets that
    permit with a higher fence, and the paused run, resumed, learns it lost it (LockLost)."""
    name = f"pause-{os.getpid()}"
    paused = client.send_task(f"{APP}.hold", args=(name, 4))
    wait_for(lambda: len(_events(server, "start")) == 1, 20)
    first = _events(server, "start")[0]
    busy = client.send_task(f"{APP}.hold", args=(name, 5))
    wait_for(lambda: len(_events(server, "start")) == 2, 20)
    os.kill(first["pid"], signal.SIGSTOP)
    try:
        successor = client.send_task(f"{APP}.hold", args=(name, 0.1))
        wait_for(lambda: len(_events(server, "start")) == 3, 10)
    finally:
        os.kill(first["pid"], signal.SIGCONT)
    third = _events(server, "start")[2]
    assert third["task_id"] == successor.id
    assert third["fence"] > first["fence"]
    assert successor.get(timeout=20) == name
    wait_for(lambda: _events(server, "lost"), 10)
    lost = _events(server, "lost")
    assert [e["fence"] for e in lost] == [first["fence"]]
    assert paused.get(propagate=False, timeout=20) is not None
    assert paused.state == "FAILURE" and "LockLost" in repr(paused.result)
    assert busy.get(timeout=20) == name


def test_twenty_a_second_over_two_workers_hold_and_are_reached_other_keys_run_at_once(
    client: Celery, server: RedisServer
) -> None:
    """lock_rate="20/s" over 200 runs of one key from two workers: no one-second window has
    more than 20 + 1 starts, runs come back within their lock retry budget (task retries
    untouched), the held backlog keeps up with the rate (3/4 of it or more), and another
    key's runs sent while a 5/s key's backlog is held start before that backlog is through."""
    # 48 runs at 5/s: about 9.5 s of slots, more runs than the two workers' 8 processes and
    # 8 prefetched messages hold. Once the broker's queue is empty the workers hold all of
    # them, re-queued for their slots (waited on: under load the fetching takes seconds).
    held = [client.send_task(f"{APP}.call_held", args=("held", n)) for n in range(48)]
    broker = server.client(db=0)
    wait_for(lambda: broker.llen("celery") == 0, 60)
    others = [client.send_task(f"{APP}.call_api", args=("other", n)) for n in range(10)]
    results = [client.send_task(f"{APP}.call_api", args=("acme", n)) for n in range(200)]
    wait_for(lambda: broker.llen("celery") == 0, 60)
    fetched = time.time()  # from here on the workers hold all of acme's runs still to start
    # Every run ends with its own stored result (no late RETRY of an earlier attempt).
    values_of(others, 30)
    values_of(results, 60)
    values_of(held, 60)
    calls = _events(server, "call")
    acme = sorted(e["t"] for e in calls if e["partner"] == "acme")
    assert len(acme) == 200
    most = max(sum(1 for u in acme[i:] if u < t + 1.0) for i, t in enumerate(acme))
    assert most <= 20 + 1, most
    # The held backlog keeps up with the rate: a re-queued run that backed off past its slot
    # would leave the rate half used. Measured once the workers hold the whole backlog: how
    # fast a loaded machine fetches 200 messages is no behaviour of the limiter. The figure
    # itself is a benchmark's (0.9 of the rate and more on a quiet machine); three quarters
    # leaves room for a loaded one.
    # A machine so loaded that the workers refuse and re-queue runs slower than the rate
    # starts them (seen under 4 test processes at load 8: 179 of 200 had run by then)
    # holds no backlog to measure: the whole run's throughput then only has to show that
    # no run waited seconds past its slot (more than half the rate).
    still = [t for t in acme if t >= fetched]
    if len(still) >= 40:
        throughput = (len(still) - 1) / (still[-1] - still[0])
        assert throughput >= 0.75 * 20, ("held backlog", throughput)
    else:
        throughput = (len(acme) - 1) / (acme[-1] - acme[0])
        assert throughput > 0.5 * 20, ("no backlog held", len(still), throughput)
    assert all(e["retries"] == 0 for e in calls)
    assert max(e["lock_retries"] for e in calls) <= 5
    other = sorted(e["t"] for e in calls if e["partner"] == "other")
    assert len(other) == 10
    backlog = sorted(e["t"] for e in calls if e["partner"] == "held")
    assert len(backlog) == 48
    # A key that waited behind the held backlog (its runs occupying the processes or the
    # prefetch) would start after all but the last 16 of it at most; the other key's runs
    # are through with 3 s of it (16 slots) still ahead. The backlog's length is the rate's,
    # not the machine's: a loaded machine only stretches it.
    later = sum(1 for t in backlog if t > other[-1])
    assert later >= 16, f"another key waited behind a held backlog: {later} of 48 after it"


def test_a_limit_on_redlock_masters_stops_the_worker_naming_task_and_option(
    tmp_path: Path, server: RedisServer
) -> None:
    """redlock_url a list of three masters: the worker refuses to start, naming a task, its
    lock_limit and the counter-example."""
    masters = ",".join(f"redis://127.0.0.1:{free_port()}/0" for _ in range(3))
    worker = Worker(APP, _env(server, locks=masters), tmp_path / "redlock.log")
    try:
        assert worker.wait_exit(40) != 0
        text = worker.text()
    finally:
        worker.stop()
    assert "task 'tests.apps.limitsapp." in text
    assert "lock_limit=" in text and "B on 2 and 3, C on 1 and 3" in text


def test_permits_and_rate_refusals_are_redlock_events(client: Celery, server: RedisServer) -> None:
    """With -E, a permit's acquire and release are redlock-acquired/-released events with
    its fence, and a rate refusal is redlock-rate-limited with the lock and retry_after."""
    capture = EventCapture(client)
    try:
        capture.wait_live(client)
        name = f"ev-{os.getpid()}"
        permit = client.send_task(f"{APP}.keep", args=(name, 0.0))
        assert permit.get(timeout=20) == name
        calls = [client.send_task(f"{APP}.call_api", args=(name, n)) for n in range(3)]
        for call in calls:
            call.get(timeout=20)
        wait_for(lambda: capture.of("redlock-released", permit.id), 10)

        def refusals() -> list[dict[str, Any]]:
            return [e for c in calls for e in capture.of("redlock-rate-limited", c.id)]

        wait_for(refusals, 10)
        refused = refusals()
    finally:
        capture.stop()
    [acquired] = capture.of("redlock-acquired", permit.id)
    start = _events(server, "start")[0]
    assert acquired["lock"] == f"keep:{name}" and acquired["fence"] == start["fence"]
    assert refused and all(e["lock"] == f"api:{name}" for e in refused)
    assert all(0 < e["retry_after"] <= 0.15 and e["policy"] == "retry" for e in refused), refused
