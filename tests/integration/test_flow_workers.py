"""Flow control on real prefork workers (`celery -A tests.apps.flowapp`): ``lock_limits``,
operator controls and ``BackOff``.

Two workers of concurrency 3 share one Redis; each also consumes a queue of its own, so
that a test can hand runs to both. Every body records its start (and end) with
``time.monotonic()`` (one clock for every process on the machine) in Redis, and the tests
analyse those records: a mutex, a Limit and a Rate held together on every run; two
tasks taking two semaphores in opposite orders never deadlock; weighted costs stay
within their rate; a pause and a rate change reach every worker at their next start;
a body's BackOff holds its key back on every worker.
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from celery import Celery
from servers import RedisServer, wait_for
from workers import Worker, close_publisher, publisher, values_of, worker_env

from celery_redlock import control

pytestmark = pytest.mark.slow

APP = "tests.apps.flowapp"
QUEUES = ("fw0", "fw1")  # each worker's own queue (besides the default one)


def _events(server: RedisServer, kind: str) -> list[dict[str, Any]]:
    events = [json.loads(r) for r in server.client(db=3).lrange("events", 0, -1)]
    return [e for e in events if e["event"] == kind]


def _most_at_once(runs: Iterable[dict[str, Any]]) -> int:
    """The most [start, end] intervals open at one instant (an end before a start at the
    same instant)."""
    edges = sorted(
        itertools.chain.from_iterable(((r["start"], 1), (r["end"], -1)) for r in runs),
        key=lambda edge: (edge[0], edge[1]),
    )
    inside = most = 0
    for _, step in edges:
        inside += step
        most = max(most, inside)
    return most


def _most_in_a_second(starts: Iterable[tuple[float, int]]) -> int:
    """The most units (start time, units) in any one-second window [t, t + 1) that opens
    at a start."""
    ordered = sorted(starts)
    return max(
        (sum(u for s, u in ordered[i:] if s < t + 1.0) for i, (t, _) in enumerate(ordered)),
        default=0,
    )


def _permits(server: RedisServer, name: str) -> int:
    return int(server.client(db=1).hlen(f"redlock:{{{name}}}:permits"))


@pytest.fixture(scope="module")
def workers(
    server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    """Two prefork workers of concurrency 3 on one broker and lock Redis; worker i also
    consumes queue QUEUES[i]."""
    logs = tmp_path_factory.mktemp("flow")
    started = [
        Worker(
            APP, worker_env(server), logs / f"w{i}.log", concurrency=3, extra=("-Q", f"celery,{q}")
        )
        for i, q in enumerate(QUEUES)
    ]
    try:
        for w in started:
            w.wait_ready()
        yield started
    finally:
        for w in started:  # both warm shutdowns at once
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in started:
            w.stop()


@pytest.fixture
def client(server: RedisServer, workers: list[Worker]) -> Iterator[Celery]:
    """A client app for the shared workers, able to set controls (its redlock_url is
    theirs); the record list is emptied first."""
    server.client(db=3).delete("events")
    env = worker_env(server)
    app = publisher(env["REDLOCK_TEST_BROKER"], env["REDLOCK_TEST_BACKEND"])
    app.conf.redlock_url = env["REDLOCK_TEST_LOCKS"]
    try:
        yield app
    finally:
        close_publisher(app)


def test_mutex_limit_and_rate_hold_together_across_two_workers(
    client: Celery, server: RedisServer, workers: list[Worker]
) -> None:
    """30 calls of a task with lock_key "m:<n>", Limit("all", 2) and Rate("p:<p>", "5/s")
    (5 n, 2 p, 0.1 s bodies) from two workers of 3 processes: all run, on both workers;
    never more than 2 at once (and 2 do); never more than 5 + 1 (burst) starts of one p
    in a second; no two runs of one n overlap; each run holds a fence of its mutex and
    of "all"; both the Limit and a Rate refused starts on the way."""
    calls = [(i % 5, f"p{i % 2}") for i in range(30)]
    results = [
        client.send_task(f"{APP}.mixed", args=(n, p, 0.1), queue=QUEUES[i % 2])
        for i, (n, p) in enumerate(calls)
    ]
    assert values_of(results, 60) == [n for n, _ in calls]
    runs = _events(server, "mixed")
    assert len(runs) == 30
    assert _most_at_once(runs) == 2
    for p in {p for _, p in calls}:
        starts = [(r["start"], 1) for r in runs if r["p"] == p]
        assert len(starts) == 15
        assert _most_in_a_second(starts) <= 5 + 1, p
    for n in range(5):
        mine = sorted((r for r in runs if r["n"] == n), key=lambda r: r["start"])
        assert len(mine) == 6
        assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(mine)), n
    assert all(set(r["fences"]) == {f"m:{r['n']}", "all"} for r in runs)
    assert len({r["fences"]["all"] for r in runs}) == 30
    assert len({r["worker"] for r in runs}) == 2
    assert _permits(server, "all") == 0
    logs = "".join(w.text() for w in workers)
    assert "'all' is at its limit" in logs
    assert "'p:p0' is at its rate" in logs or "'p:p1' is at its rate" in logs


#: Runs of each of the two tasks: 6 processes and 2 permits make refusals from the first.
RUNS = 100


def test_two_tasks_taking_two_semaphores_in_opposite_orders_never_deadlock(
    client: Celery, server: RedisServer
) -> None:
    """100 runs of ab (its own semaphore "a", a Limit on "b") and 100 of ba (its own "b",
    a Limit on "a"), 2 permits each, interleaved on 6 processes: every run ends, both
    tasks progress together (each has a quarter of the first 100 starts), some runs were
    refused on the way, never more than 2 runs hold the pair at once, both tasks count
    fences on the same two semaphores, and no permit is left held."""
    results = []
    for i in range(RUNS):
        for name in ("ab", "ba"):
            results.append(client.send_task(f"{APP}.{name}", args=(i,), queue=QUEUES[i % 2]))
    # Every run ends with its own stored result (no late RETRY of an earlier attempt).
    assert values_of(results, 60) == [i for i in range(RUNS) for _ in range(2)]
    ab, ba = _events(server, "ab"), _events(server, "ba")
    assert sorted(r["i"] for r in ab) == list(range(RUNS))
    assert sorted(r["i"] for r in ba) == list(range(RUNS))
    first = sorted(ab + ba, key=lambda r: r["start"])[:RUNS]
    assert RUNS // 4 <= sum(r["event"] == "ab" for r in first) <= RUNS * 3 // 4
    assert any(r["lock_retries"] for r in ab + ba), "no run was ever refused"
    assert _most_at_once(ab + ba) <= 2
    assert all(set(r["fences"]) == {"a", "b"} for r in ab + ba)
    for name in ("a", "b"):
        assert len({r["fences"][name] for r in ab + ba}) == 2 * RUNS, name
        assert _permits(server, name) == 0


def test_weighted_costs_never_grant_more_than_rate_plus_burst_in_a_second(
    client: Celery, server: RedisServer
) -> None:
    """30 calls with costs 1..10 (165 units) against Rate("wc", "50/s", burst=10,
    cost="<cost>") on two workers: all run, and no one-second window holds more than
    50 + 10 units."""
    costs = [1 + i % 10 for i in range(30)]
    results = [
        client.send_task(f"{APP}.weighed", args=(i, c), queue=QUEUES[i % 2])
        for i, c in enumerate(costs)
    ]
    assert values_of(results, 60) == costs
    runs = _events(server, "weighed")
    assert sorted(r["cost"] for r in runs) == sorted(costs)
    most = _most_in_a_second((r["t"], r["cost"]) for r in runs)
    assert most <= 50 + 10, most


def test_a_pause_lets_running_runs_finish_and_starts_none_until_resumed(
    client: Celery, server: RedisServer, workers: list[Worker]
) -> None:
    """6 runs on Limit("batch", 2), 0.5 s each: "batch" paused while 2 run and 4 are
    queued. The 2 finish; none starts while paused (the queued ones are refused as
    paused); after resume() the 4 queued run, none before it, at most 2 at once."""
    results = [
        client.send_task(f"{APP}.batch", args=(i, 0.5), queue=QUEUES[i % 2]) for i in range(6)
    ]
    wait_for(lambda: len(_events(server, "start")) >= 2, 20, "two runs to start")
    control(client).pause("batch", reason="test maintenance")
    paused = time.monotonic()
    assert len(_events(server, "end")) == 0, "a run ended before the pause was set"
    wait_for(lambda: len(_events(server, "end")) == 2, 10, "the two running runs to finish")

    def refused_as_paused() -> bool:
        return any(
            "'batch' is paused until resumed (test maintenance)" in w.text() for w in workers
        )

    wait_for(refused_as_paused, 10, "a queued run to be refused as paused")
    resumed = time.monotonic()
    assert control(client).resume("batch") is True
    assert sorted(values_of(results, 30)) == list(range(6))

    starts = sorted(_events(server, "start"), key=lambda e: e["t"])
    ends = {e["i"]: e["t"] for e in _events(server, "end")}
    first, queued = starts[:2], starts[2:]
    assert len(queued) == 4
    assert all(ends[e["i"]] > paused for e in first), "the running runs finished while paused"
    assert all(e["t"] >= resumed for e in queued), (resumed, queued)
    assert all(e["lock_retries"] >= 1 for e in queued)
    runs = [{"start": e["t"], "end": ends[e["i"]]} for e in starts]
    assert _most_at_once(runs) <= 2
    assert _permits(server, "batch") == 0


def test_a_rate_lowered_at_run_time_holds_from_the_next_start_on_both_workers(
    client: Celery, server: RedisServer
) -> None:
    """10 runs of Rate("tick", "10/s") over both workers; after 3 have started, the rate is
    set to 3/s: from then on starts (after the first one, which the old rate's slot may
    admit) are at least 1/3 s apart, on both workers; unset() lifts it."""
    results = [client.send_task(f"{APP}.tick", args=(i,), queue=QUEUES[i % 2]) for i in range(10)]
    wait_for(lambda: len(_events(server, "tick")) >= 3, 20, "three runs to start")
    control(client).set_rate("tick", "3/s")
    changed = time.monotonic()
    try:
        assert sorted(values_of(results, 30)) == list(range(10))
    finally:
        control(client).unset("tick")
    starts = sorted(_events(server, "tick"), key=lambda e: e["t"])
    after = [e for e in starts if e["t"] > changed][1:]
    assert len(after) >= 3
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(after)]
    assert min(gaps) >= 1 / 3 - 0.03, gaps
    assert {e["worker"] for e in after} == {e["worker"] for e in starts}
    assert len({e["worker"] for e in starts}) == 2


def test_back_off_holds_its_key_on_every_worker_then_the_run_succeeds(
    client: Celery, server: RedisServer
) -> None:
    """A run raising BackOff(2) pauses its Rate key up:acme for 2 s: 6 runs of that key
    sent to both workers meanwhile are refused and none starts within 2 s of the
    back-off; then they run, and the backed-off run runs again and succeeds."""
    backed = client.send_task(f"{APP}.upstream", args=("acme", 0, 2.0), queue=QUEUES[0])
    wait_for(lambda: _events(server, "backoff"), 20, "the back-off")
    [off] = _events(server, "backoff")
    wait_for(
        lambda: [c for c in control(client).overrides("up:acme") if c.kind == "pause"],
        10,
        "the pause of up:acme",
    )
    others = [
        client.send_task(f"{APP}.upstream", args=("acme", i, 0), queue=QUEUES[i % 2])
        for i in range(1, 7)
    ]
    assert values_of([backed, *others], 30) == list(range(7))
    later = [c for c in _events(server, "call") if c["t"] > off["t"]]
    assert len(later) == 7
    # The pause is set after the body recorded the back-off: it ends 2 s after that, less
    # at most the millisecond the server rounds its clock down to.
    assert min(c["t"] for c in later) >= off["t"] + 2.0 - 0.002, [c["t"] - off["t"] for c in later]
    [again] = [c for c in later if c["i"] == 0]
    assert again["lock_retries"] == 1
    assert all(c["lock_retries"] >= 1 for c in later)
    assert len({c["worker"] for c in later}) == 2
    assert control(client).overrides("up:acme") == []
