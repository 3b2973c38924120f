"""Observability: LockEvent hooks, the logging hook, Prometheus metrics and redlock-* events.

Hooks and logs are checked on an in-process worker (threads pool) against a real Redis:
pytest-celery's ``celery_app`` and the plugin's ``redlock_worker``, configured by this
module's ``celery_config``, ``celery_worker_pool`` and ``celery_worker_parameters``.
Celery events on a real `celery worker -E` subprocess with an event receiver, and
through what reads them: Celery's ``State``, Flower's ``EventsState`` and the dumper of
`celery events --dump`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, states
from celery.events.dumper import Dumper
from celery.events.state import State
from flower.events import EventsState
from inprocess import settings_on
from prometheus_client import CollectorRegistry
from servers import RedisServer, logger_at_debug, wait_for
from workers import Worker, close_publisher, publisher, worker_env

import celery_redlock
from celery_redlock import SKIPPED, Lock, LockContended, LockedTask, LockEvent, is_skipped
from celery_redlock.app.observability import (
    BEAT_ROLE,
    CELERY_EVENT_KINDS,
    celery_event_type,
    disable_prometheus,
    enable_prometheus,
    logging_hook,
)
from celery_redlock.app.state import state_for
from celery_redlock.core import events

APP = "tests.apps.configapp"


# -- hooks and the logging hook on an in-process worker ----------------------------------------
class _Run:
    """Lets the test see a task body start and decide when it ends."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.finish = threading.Event()
        self.fence: int | None = None


@pytest.fixture(scope="session")
def celery_config(shared_redis: RedisServer) -> dict[str, Any]:
    """celery_app's settings: broker, results and locks in dbs 13-15 of the shared server."""
    return settings_on(shared_redis, 13, 14, 15)


@pytest.fixture
def obs_app(celery_app: Celery, shared_redis: RedisServer) -> tuple[Celery, dict[str, Any]]:
    """celery_app with two locked tasks (skip on contention; a 0.9 s lease that warns on loss)."""
    app = celery_app
    shared_redis.client(db=15).flushdb()
    runs: dict[int, _Run] = {}

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,  # Celery's default shared=True would add it to every later app
        name="obs.work",
        lock_key="obs:<n>",
        lock_on_contended="skip",
    )
    def work(self: Any, n: int) -> int:
        run = runs[n]
        run.fence = self.lock.fence
        run.started.set()
        run.finish.wait(10)
        return n

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="obs.lossy",
        lock_key="obs:<n>",
        lock_ttl=0.9,
        lock_on_lost="warn",
    )
    def lossy(self: Any, n: int) -> bool:
        runs[n].started.set()
        deadline = time.monotonic() + 5
        while not self.lock.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        return bool(self.lock.lost)

    return app, {"work": work, "lossy": lossy, "runs": runs}


@pytest.fixture
def obs_worker(obs_app: tuple[Celery, dict[str, Any]], redlock_worker: Any) -> Iterator[Any]:
    """redlock_worker on obs_app's app, started once its tasks exist; a body still waiting
    (a failed test) is let go before the worker stops."""
    try:
        yield redlock_worker
    finally:
        for run in obs_app[1]["runs"].values():
            run.finish.set()


def test_hook_gets_frozen_events_for_acquire_contend_release_and_loss(
    obs_app: tuple[Celery, dict[str, Any]], obs_worker: Any, shared_redis: RedisServer
) -> None:
    """add_hook gets one frozen LockEvent per acquire/contend/release/loss, fields filled."""
    _, tasks = obs_app
    runs: dict[int, _Run] = tasks["runs"]
    runs[1], runs[2] = _Run(), _Run()
    seen: list[LockEvent] = []
    hook = celery_redlock.add_hook(seen.append)
    try:
        first = tasks["work"].delay(1)
        assert runs[1].started.wait(10)
        second = tasks["work"].delay(1)
        assert is_skipped(second.get(timeout=10))
        runs[1].finish.set()
        assert first.get(timeout=10) == 1

        lossy = tasks["lossy"].delay(2)
        assert runs[2].started.wait(10)
        shared_redis.client(db=15).delete("redlock:{obs:2}")
        assert lossy.get(timeout=10) is True
    finally:
        celery_redlock.remove_hook(hook)

    mine = [e for e in seen if e.name in ("obs:1", "obs:2")]
    by_kind: dict[str, list[LockEvent]] = {}
    for event in mine:
        by_kind.setdefault(event.kind, []).append(event)
    assert sorted(by_kind) == ["acquired", "contended", "lost", "released"], mine

    acquired = [e for e in by_kind["acquired"] if e.name == "obs:1"]
    assert len(acquired) == 1
    acq = acquired[0]
    assert acq.key == "redlock:{obs:1}"
    assert acq.fence == runs[1].fence and isinstance(acq.fence, int)
    assert acq.holder["task_name"] == "obs.work" and acq.holder["task_id"] == first.id
    assert acq.waited is not None and 0 <= acq.waited < 5 and acq.held is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        acq.fence = 0  # type: ignore[misc]

    [contended] = by_kind["contended"]
    assert contended.name == "obs:1" and contended.holder["task_id"] == first.id
    assert contended.waited is not None and contended.waited >= 0

    released = [e for e in by_kind["released"] if e.name == "obs:1"]
    assert len(released) == 1
    rel = released[0]
    assert rel.fence == acq.fence and rel.holder["task_id"] == first.id
    assert rel.held is not None and rel.held > 0

    [lost] = by_kind["lost"]
    assert lost.name == "obs:2" and lost.key == "redlock:{obs:2}"
    assert lost.holder["task_name"] == "obs.lossy" and lost.holder["task_id"] == lossy.id
    assert lost.held is not None and lost.held > 0 and lost.error


class _Filtered:
    """A hook that says which event kinds it takes."""

    def __init__(self, *kinds: str) -> None:
        self.kinds = kinds
        self.seen: list[str] = []

    def lock_event_filter(self, kind: str) -> bool:
        return kind in self.kinds

    def __call__(self, event: LockEvent) -> None:
        self.seen.append(event.kind)


def test_events_that_no_hooks_filter_takes_are_not_built(shared_redis: RedisServer) -> None:
    """Only filtered hooks: an event none of them takes never reaches any hook (it is not
    built); one unfiltered hook, and every event is built and handed to every hook again."""
    client = shared_redis.client(db=9)
    saved = events._hooks
    only_released = _Filtered("released")
    takes_all: list[str] = []
    try:
        events._set_hooks((only_released,))
        assert not events.wanted("acquired") and events.wanted("released")
        with Lock(client, f"filtered-{uuid.uuid4().hex[:6]}", 5):
            pass
        assert only_released.seen == ["released"]

        events._set_hooks((only_released, lambda e: takes_all.append(e.kind)))
        assert events.wanted("acquired")
        with Lock(client, f"filtered-{uuid.uuid4().hex[:6]}", 5):
            pass
        assert takes_all == ["acquired", "released"]
        assert only_released.seen == ["released", "acquired", "released"]
    finally:
        events._set_hooks(saved)


def test_a_filter_that_raises_never_breaks_the_lock(shared_redis: RedisServer) -> None:
    """A broken lock_event_filter is logged; the lock works and the hook gets the events."""

    class Broken(_Filtered):
        def lock_event_filter(self, kind: str) -> bool:
            raise RuntimeError("broken filter")

    client = shared_redis.client(db=9)
    saved = events._hooks
    broken = Broken()
    try:
        events._set_hooks((broken,))
        assert events.wanted("acquired") is True
        lock = Lock(client, f"broken-filter-{uuid.uuid4().hex[:6]}", 5)
        with lock:
            assert lock.owned()
        assert not client.exists(lock.keys.lock)
        assert broken.seen == ["acquired", "released"]
    finally:
        events._set_hooks(saved)


def test_the_logging_hook_takes_routine_events_only_while_debug_is_on() -> None:
    """logging_hook's filter follows its logger's level, read at each event; a loss and a
    renewal failure (one WARNING line each, in words, from the lock) are DEBUG here."""
    logger = logging.getLogger("celery_redlock.events")
    level = logger.level
    want = logging_hook.lock_event_filter  # type: ignore[attr-defined]
    try:
        logger.setLevel(logging.INFO)
        assert not want("acquired") and not want("released") and want("contended")
        assert not want("lost") and not want("renew_failed") and not want("granted")
        logger.setLevel(logging.DEBUG)
        assert want("acquired") and want("released") and want("lost")
        logger.setLevel(logging.WARNING)
        assert not want("lost") and not want("contended")
    finally:
        logger.setLevel(level)


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_logging_hook_writes_one_line_per_event_on_celery_redlock_events(
    obs_app: tuple[Celery, dict[str, Any]], obs_worker: Any
) -> None:
    """The logging hook logs lock-acquired/-released with task, fence, wait and hold times."""
    _, tasks = obs_app
    runs: dict[int, _Run] = tasks["runs"]
    runs[3] = _Run()
    runs[3].finish.set()
    handler = _ListHandler()
    with logger_at_debug("celery_redlock.events", handler):
        result = tasks["work"].delay(3)
        assert result.get(timeout=10) == 3
    lines = [r.getMessage() for r in handler.records if "name='obs:3'" in r.getMessage()]
    assert len(lines) == 2, lines
    acquired, released = lines
    assert acquired.startswith("lock-acquired ")
    assert f"task=obs.work[{result.id}]" in acquired and f"fence={runs[3].fence}" in acquired
    assert "waited=" in acquired
    assert released.startswith("lock-released ") and "held=" in released
    assert f"fence={runs[3].fence}" in released


def _contended_lines(holder: dict[str, Any], waiter: dict[str, Any]) -> list[logging.LogRecord]:
    """The logging hook's lock-contended records when a Lock with record *waiter* finds one
    with record *holder* holding the name (the memory backend)."""
    store = celery_redlock.connect(f"memory://contended-{uuid.uuid4().hex}")
    first = Lock(store, "c:1", owner_info=holder)
    second = Lock(store, "c:1", owner_info=waiter)
    handler = _ListHandler()
    assert first.acquire(blocking=False)
    try:
        with logger_at_debug("celery_redlock.events", handler):
            events.add_hook(logging_hook)
            try:
                assert second.acquire(blocking=False) is False
            finally:
                events.remove_hook(logging_hook)
    finally:
        first.release()
    return [r for r in handler.records if r.getMessage().startswith("lock-contended")]


def test_a_contended_line_names_the_waiting_task_and_the_holder() -> None:
    """lock-contended says which task waited (task=) and which one holds the lock
    (holder=), not the holder as if it were the one waiting."""
    holder = {"task_name": "proj.a", "task_id": "id-a"}
    [line] = _contended_lines(holder, {"task_name": "proj.b", "task_id": "id-b"})
    message = line.getMessage()
    assert "task=proj.b[id-b]" in message and "holder=proj.a[id-a]" in message, message
    assert line.levelno == logging.INFO


def test_a_standby_beat_waiting_for_the_leader_lock_logs_at_debug() -> None:
    """A standby beat asks for the leader lock every few seconds: its contention is
    routine, a DEBUG line, where another waiter's is INFO."""
    beat = {"role": BEAT_ROLE, "app": "proj"}
    assert [r.levelno for r in _contended_lines(beat, beat)] == [logging.DEBUG]


# -- Prometheus -------------------------------------------------------------------------------
def test_prometheus_counts_into_a_fresh_registry(shared_redis: RedisServer) -> None:
    """enable_prometheus(fresh registry) counts events and wait/hold times there, exactly once."""
    registry = CollectorRegistry()
    task = f"prom-{uuid.uuid4().hex[:6]}"

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"task": task, **labels})

    assert enable_prometheus() is True  # what install(app) does: the default registry
    assert enable_prometheus(registry) is True
    assert enable_prometheus(registry) is True  # idempotent: no duplicate collectors
    client = shared_redis.client(db=9)
    try:
        for _ in range(2):
            with Lock(client, f"{task}:a", 5, owner_info={"task_name": task}):
                other = Lock(client, f"{task}:a", 5, owner_info={"task_name": task})
                assert other.acquire(blocking=False) is False
        assert sample("celery_redlock_events_total", kind="acquired") == 2
        assert sample("celery_redlock_events_total", kind="contended") == 2
        assert sample("celery_redlock_events_total", kind="released") == 2
        assert sample("celery_redlock_wait_seconds_count") == 4  # 2 acquired + 2 contended
        assert sample("celery_redlock_hold_seconds_count") == 2
        held = sample("celery_redlock_hold_seconds_sum")
        assert held is not None and held > 0
    finally:
        disable_prometheus(registry)
    # disabled: the collectors are gone from the registry and nothing more is counted there
    with Lock(client, f"{task}:b", 5, owner_info={"task_name": task}):
        pass
    client.close()
    assert sample("celery_redlock_events_total", kind="acquired") is None
    assert list(registry.collect()) == []


# -- Celery events from a real worker ---------------------------------------------------------
class EventCapture:
    """Celery events received in a background thread (bounded by a timeout)."""

    def __init__(self, app: Celery, timeout: float = 30.0) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._run, args=(timeout,), daemon=True)
        self.thread.start()

    def _run(self, timeout: float) -> None:
        with self.app.connection_for_read() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            with contextlib.suppress(TimeoutError, OSError):
                self.receiver.capture(limit=None, timeout=timeout, wakeup=True)

    def wait_live(self, client: Celery, tries: int = 20) -> None:
        """Return once an event has arrived: the receiver is subscribed.

        The receiver subscribes to the event fanout only once its thread drains, and a
        worker started `--without-heartbeat` sends events only when asked, so a single
        wakeup answered before the subscription is lost. Ask again every half second.
        """
        for _ in range(tries):
            client.control.heartbeat()
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                if self.events:
                    return
                time.sleep(0.02)
        raise AssertionError(f"no Celery event reached the receiver after {tries} heartbeats")

    def of(self, kind: str, task_id: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e["type"] == kind and e.get("uuid") == task_id]

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(10)


@pytest.mark.slow
def test_worker_with_E_sends_redlock_events(redis_server: RedisServer, tmp_path: Path) -> None:
    """`celery worker -E` sends redlock-acquired/-contended/-released with lock and fence."""
    env = worker_env(redis_server, REDLOCK_TEST_CONF="")
    worker = Worker(APP, env, tmp_path / "events.log", concurrency=2, extra=("-E",))
    client = Celery(
        "client", broker=env["REDLOCK_TEST_BROKER"], backend=env["REDLOCK_TEST_BACKEND"]
    )
    capture: EventCapture | None = None
    try:
        worker.wait_ready()
        capture = EventCapture(client)
        capture.wait_live(client)
        name = f"ev-{uuid.uuid4().hex[:6]}"
        first = client.send_task(f"{APP}.held", args=(name, 1.0))
        wait_for(lambda: redis_server.client(db=3).llen("events"), 20)
        second = client.send_task(f"{APP}.held", args=(name, 0.0))
        with pytest.raises(LockContended):
            second.get(timeout=20)
        assert first.get(timeout=20) == name
        wait_for(lambda: capture is not None and capture.of("redlock-released", first.id), 10)
        start = json.loads(redis_server.client(db=3).lindex("events", 0))
    finally:
        if capture is not None:
            capture.stop()
        worker.stop()
        client.close()

    [acquired] = capture.of("redlock-acquired", first.id)
    assert acquired["lock"] == f"cfg:{name}" and acquired["fence"] == start["fence"]
    [released] = capture.of("redlock-released", first.id)
    assert released["lock"] == f"cfg:{name}" and released["fence"] == start["fence"]
    assert released["held"] > 0
    [contended] = capture.of("redlock-contended", second.id)
    assert contended["lock"] == f"cfg:{name}" and contended["policy"] == "raise"
    assert contended["holder"]["task_id"] == first.id


# -- every redlock-* event through Celery's State, Flower and `celery events --dump` ----------
EVENTS_APP = "tests.apps.eventsapp"
#: Celery's own events of one task, in the order its worker sends them.
OWN = ("task-received", "task-started", "task-succeeded")


def _known_publisher(env: dict[str, str]) -> Celery:
    """The events app in this process (its task classes: holds at publish), on this test's
    server, sending task events (task_send_sent_event) as a publisher."""
    from tests.apps import eventsapp  # noqa: PLC0415 - configured from the environment

    app: Celery = eventsapp.app
    app.conf.update(
        broker_url=env["REDLOCK_TEST_BROKER"],
        result_backend=env["REDLOCK_TEST_BACKEND"],
        redlock_url=env["REDLOCK_TEST_LOCKS"],
        task_send_sent_event=True,
    )
    state_for(app).reset()
    return app


def _wait_started(server: RedisServer, task_id: str) -> None:
    """Until the body of task *task_id* has recorded its start."""
    records = server.client(db=3)

    def seen() -> bool:
        found = (json.loads(r) for r in records.lrange("events", 0, -1))
        return any(e["event"] == "start" and e["task_id"] == task_id for e in found)

    wait_for(seen, 20, f"task {task_id} to start")


def _make_every_kind(server: RedisServer, known: Celery, blind: Celery) -> list[Any]:
    """Runs and calls that make each kind of redlock-* event once at least; their results,
    every one stored as a success."""
    from tests.apps import eventsapp  # noqa: PLC0415 - configured by _known_publisher

    def started(task_id: str) -> None:
        _wait_started(server, task_id)

    # acquired, contended (a skipped run), released
    first = eventsapp.hold.delay("h", 1.5)
    started(first.id)
    second = eventsapp.hold.delay("h", 0.0)
    assert is_skipped(second.get(timeout=20))
    assert first.get(timeout=20) == "h"
    # lost: the key goes while the run holds it
    lossy = eventsapp.lossy.delay("l")
    started(lossy.id)
    server.client(db=1).delete("redlock:{evl:l}")
    assert lossy.get(timeout=20) is True
    # rate-limited: one start a minute, the second skipped
    paced = [eventsapp.paced.delay("r")]
    assert paced[0].get(timeout=20) == "r"
    paced.append(eventsapp.paced.delay("r"))
    assert is_skipped(paced[1].get(timeout=20))
    # duplicate at the worker: sent by name where the class is unknown (uuid: the call's)
    by_name = blind.send_task("ev.once", args=("w", 1.5))
    started(by_name.id)
    dup = blind.send_task("ev.once", args=("w", 0.0))
    assert is_skipped(dup.get(timeout=20))
    assert by_name.get(timeout=20) == "w"
    # duplicate at the publisher: the call is not sent (no uuid)
    queued = eventsapp.once.delay("p", 0.5)
    assert eventsapp.once.delay("p", 0.5).id == queued.id
    assert queued.get(timeout=20) == "p"
    # superseded: the newest call takes the hold, the older message is skipped. The newer
    # comes due a second after the older: both debounced by 2 s, they come due together,
    # and a newer run that starts first takes the lock and the hold, so the older is then
    # contended, not superseded (issue 49: latest wins whatever the order).
    older = eventsapp.newest.delay("n", 1)
    newer = eventsapp.newest.apply_async(("n", 2), countdown=3.0)
    assert is_skipped(older.get(timeout=20))
    assert newer.get(timeout=20) == 2
    # control: an operator's pause and resume (a publisher's events, no uuid)
    controls = celery_redlock.control(known)
    controls.pause("ev:paused", seconds=30)
    assert controls.resume("ev:paused") is True
    return [first, second, lossy, *paced, by_name, dup, queued, older, newer]


def _task_states(state: Any) -> dict[str, tuple[str, Any]]:
    return {tid: (task.state, task.result) for tid, task in state.tasks.items()}


def _fed(make: Any, events: list[dict[str, Any]]) -> Any:
    """A state *make()* fed a copy of each event (State changes the dicts it is given)."""
    state = make()
    for event in events:
        state.event(copy.deepcopy(event))
    return state


def _flower() -> EventsState:
    return EventsState(max_tasks_in_memory=10000)


@pytest.mark.slow
def test_every_redlock_event_leaves_celery_state_and_flower_as_celery_says(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Every kind of redlock-* event, sent for real by a `worker -E` and a publisher with
    task_send_sent_event, goes through Celery's State, Flower's EventsState and `celery
    events --dump` without error and changes no task's state or worker count: a running
    task stays STARTED, a skipped run ends SUCCESS with its stored result."""
    env = worker_env(redis_server)
    worker = Worker(EVENTS_APP, env, tmp_path / "events.log", concurrency=2, extra=("-E",))
    blind = publisher(env["REDLOCK_TEST_BROKER"], env["REDLOCK_TEST_BACKEND"])
    known = _known_publisher(env)
    capture: EventCapture | None = None
    try:
        worker.wait_ready()
        capture = EventCapture(blind, timeout=90)
        capture.wait_live(blind)
        results = _make_every_kind(redis_server, known, blind)
        wanted = {celery_event_type(kind) for kind in CELERY_EVENT_KINDS}

        def missing() -> list[str]:
            assert capture is not None
            seen = list(capture.events)
            done = {e.get("uuid") for e in seen if e["type"] == "task-succeeded"}
            kinds = wanted - {e["type"] for e in seen}
            got = {r.id: [e["type"] for e in seen if e.get("uuid") == r.id] for r in results}
            return sorted(kinds) + [
                f"no task-succeeded for result {i}, only {got[r.id]}"
                for i, r in enumerate(results)
                if r.id not in done
            ]

        with contextlib.suppress(AssertionError):
            wait_for(lambda: not missing(), 20)
        assert not missing(), "events not received (a run without task-succeeded stays STARTED)"
        values = {r.id: r.get(timeout=5) for r in results}
    finally:
        if capture is not None:
            capture.stop()
        worker.stop()
        close_publisher(blind)
        close_publisher(known)

    events = list(capture.events)
    ours = [e for e in events if e["type"].startswith("redlock-")]
    assert {e["type"] for e in ours} == wanted
    assert not [e for e in events if e["type"].startswith("task-lock")]
    from_publisher = [e for e in ours if "uuid" not in e]
    assert {e["type"] for e in from_publisher} == {"redlock-duplicate", "redlock-control"}

    # Each task's own events around ours: while it runs, and after it ended.
    own = {(e["uuid"], e["type"]): e for e in events if e["type"] in OWN and e.get("uuid")}
    with_ours = sorted({e["uuid"] for e in ours if "uuid" in e})
    first, skipped, lossy, _, refused, _, dup, _, older, _ = results
    assert {first.id, skipped.id, lossy.id, refused.id, dup.id, older.id} <= set(with_ours)
    for make in (State, _flower):
        for ours_while_running in (True, False):
            state = make()
            for tid in with_ours:
                mine = [e for e in ours if e.get("uuid") == tid] + from_publisher
                for kind in OWN[:2]:
                    state.event(copy.deepcopy(own[tid, kind]))
                if ours_while_running:
                    for event in mine:
                        state.event(copy.deepcopy(event))
                    assert state.tasks[tid].state == states.STARTED, (make, tid)
                state.event(copy.deepcopy(own[tid, "task-succeeded"]))
                if not ours_while_running:
                    for event in mine:
                        state.event(copy.deepcopy(event))
                task = state.tasks[tid]
                assert task.state == states.SUCCESS, (make, tid)
                assert task.result == own[tid, "task-succeeded"]["result"]
    assert is_skipped(values[skipped.id])  # the skipped run, SUCCESS above with it
    assert SKIPPED in own[skipped.id, "task-succeeded"]["result"]

    # Everything in the order it arrived: what Celery's own events alone make of it.
    celerys = [e for e in events if not e["type"].startswith("redlock-")]
    for make in (State, _flower):
        everything, alone = _fed(make, events), _fed(make, celerys)
        assert _task_states(everything) == _task_states(alone)
        assert set(everything.workers) == set(alone.workers)
        assert all(everything.tasks[r.id].state == states.SUCCESS for r in results)
    counts, own_counts = _fed(_flower, events).counter, _fed(_flower, celerys).counter
    for host, by_type in counts.items():
        celery_part = {t: n for t, n in by_type.items() if not t.startswith("redlock-")}
        assert celery_part == {t: n for t, n in own_counts[host].items() if n}
    assert sum(c["task-received"] for c in counts.values()) == len(results)
    assert sum(c["task-succeeded"] for c in counts.values()) == len(results)
    assert sum(c[t] for c in counts.values() for t in wanted) == len(ours)

    # `celery events --dump`: one line each, no reconnect.
    out = io.StringIO()
    dumper = Dumper(out=out)
    for event in events:
        dumper.on_event(copy.deepcopy(event))
    lines = out.getvalue().splitlines()
    assert len([line for line in lines if "] redlock " in line]) == len(ours)


@pytest.mark.slow
def test_a_skipped_run_ends_success_when_flower_turns_events_on(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """A worker started without -E whose task events are turned on at run time, as Flower
    does (enable_events), ends a skipped run with Celery's task-succeeded: SUCCESS in
    Flower, as in the result backend (and sends no redlock-* events, as the docs say)."""
    env = worker_env(redis_server)
    worker = Worker(EVENTS_APP, env, tmp_path / "events.log", concurrency=2, heartbeat=True)
    blind = publisher(env["REDLOCK_TEST_BROKER"], env["REDLOCK_TEST_BACKEND"])
    capture: EventCapture | None = None
    try:
        worker.wait_ready()
        capture = EventCapture(blind, timeout=60)
        capture.wait_live(blind)
        assert blind.control.enable_events(reply=True, timeout=5)
        first = blind.send_task("ev.hold", args=("f", 1.5))
        _wait_started(redis_server, first.id)
        skipped = blind.send_task("ev.hold", args=("f", 0.0))
        assert is_skipped(skipped.get(timeout=20))
        assert first.get(timeout=20) == "f"
        wait_for(lambda: capture is not None and capture.of("task-succeeded", skipped.id), 10)
    finally:
        if capture is not None:
            capture.stop()
        worker.stop()
        close_publisher(blind)
    flower = _fed(_flower, capture.events)
    # the pool's processes cannot see events turned on at run time: no redlock-* events
    assert not [e for e in capture.events if e["type"].startswith("redlock-")]
    assert flower.tasks[skipped.id].state == states.SUCCESS
    assert SKIPPED in flower.tasks[skipped.id].result
    assert flower.tasks[first.id].state == states.SUCCESS
