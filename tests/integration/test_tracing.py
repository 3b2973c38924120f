"""OpenTelemetry spans of locked runs on a real in-process worker and a real Redis.

The OpenTelemetry SDK records into an ``InMemorySpanExporter``; opentelemetry-
instrumentation-celery's ``CeleryInstrumentor`` makes each run's ``run/<task>`` span,
as it does for users. Every test checks that the lock's spans are children of that
span (same trace, parent span id = the task span's id) and carry the attributes
docs/tracing.md lists.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from inprocess import Env, worker
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from servers import wait_for
from workers import Worker, close_publisher, publisher, values_of

from celery_redlock import Limit, Lock, LockedTask, add_hook, control, remove_hook
from celery_redlock.app import tracing
from celery_redlock.core.events import LockEvent

#: The attribute in which CeleryInstrumentor puts a run's task id.
MESSAGE_ID = "messaging.message.id"


class Spans:
    """What the SDK exported so far, with lookups by name and parent."""

    def __init__(self, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
        self.provider = provider
        self.exporter = exporter

    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all() if s.name == name]

    def task_span(self, task_id: str) -> ReadableSpan:
        """The ``run/<task>`` span of the run of *task_id* (CeleryInstrumentor's)."""
        found = [
            s
            for s in self.all()
            if s.name.startswith("run/") and (s.attributes or {}).get(MESSAGE_ID) == task_id
        ]
        assert len(found) == 1, [(s.name, s.attributes) for s in self.all()]
        return found[0]

    def children(self, parent: ReadableSpan, name: str) -> list[ReadableSpan]:
        """Spans called *name* whose parent is *parent*, in the same trace."""
        ctx = parent.get_span_context()
        return [
            s
            for s in self.named(name)
            if s.parent is not None
            and s.parent.span_id == ctx.span_id
            and s.get_span_context().trace_id == ctx.trace_id
        ]


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spans]:
    """An SDK provider with an in-memory exporter, CeleryInstrumentor on it, and lock
    spans on with it; all undone afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    monkeypatch.setattr(tracing, "_mode", tracing._mode)  # restored after disable_tracing
    assert tracing.enable_tracing(provider)
    try:
        yield Spans(provider, exporter)
    finally:
        tracing.disable_tracing()
        instrumentor.uninstrument()
        provider.shutdown()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def one(items: list[ReadableSpan]) -> ReadableSpan:
    assert len(items) == 1, [(s.name, s.attributes) for s in items]
    return items[0]


def test_acquired_and_released_run_has_acquire_and_hold_spans_under_its_task_span(
    env: Env, spans: Spans
) -> None:
    """A run that takes its lock and releases it: ``redlock.acquire`` (acquired, wait,
    fence) and ``redlock.hold`` (released, held for the body's time) are children of the
    run's task span."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="acct:<n>")
    def work(n: int) -> int:
        time.sleep(0.2)
        return n

    with worker(app):
        result = work.delay(7)
        assert result.get(timeout=10) == 7
        wait_for(lambda: spans.named("run/" + work.name))
    task = spans.task_span(result.id)
    acquire = one(spans.children(task, "redlock.acquire"))
    hold = one(spans.children(task, "redlock.hold"))
    a, h = attrs(acquire), attrs(hold)
    assert a["redlock.key"] == "acct:7" and a["redlock.redis_key"] == "redlock:{acct:7}"
    assert a["redlock.kind"] == "mutex" and a["redlock.outcome"] == "acquired"
    assert isinstance(a["redlock.fence"], int) and a["redlock.fence"] >= 1
    assert 0 <= a["redlock.wait_ms"] < 1000
    assert h["redlock.outcome"] == "released" and h["redlock.fence"] == a["redlock.fence"]
    assert 200 <= h["redlock.held_ms"] < 5000
    assert hold.status.status_code is not StatusCode.ERROR
    # The hold starts where the acquire ends and spans the body, inside the task's span.
    assert acquire.end_time is not None and hold.start_time is not None
    assert hold.start_time >= acquire.end_time - 1_000_000
    assert hold.end_time is not None and hold.end_time - hold.start_time >= 200_000_000
    assert task.start_time is not None and task.end_time is not None
    assert task.start_time <= acquire.start_time and hold.end_time <= task.end_time


def _first_holds(env: Env, app: Celery, **lock: Any) -> Any:
    """A LockedTask on *app* (*lock*: its lock settings) that returns its tag; the run
    tagged "first" sets "first-started", then holds its lock until "go" is set."""

    @app.task(base=LockedTask, shared=False, **lock)
    def held(tag: str) -> str:
        if tag == "first":
            env.rec.set("first-started", 1)
            env.hold_until("go")
        return tag

    return held


def _second_while_first_holds(env: Env, task: Any) -> tuple[Any, Any]:
    """The results of a run "first" of *task* and, once it has started (holding the lock),
    a run "second"."""
    first = task.delay("first")
    assert env.hold_until("first-started")
    return first, task.delay("second")


def test_contended_run_names_the_holder_in_its_acquire_span(env: Env, spans: Spans) -> None:
    """A second run of a held key (lock_on_contended="skip"): its ``redlock.acquire`` is
    ``contended``, names the holding run's task id and the policy applied (``skip``), and
    no hold span is made for it."""
    app = env.app()
    report = _first_holds(env, app, lock_key="report", lock_on_contended="skip")
    with worker(app, concurrency=2):
        first, second = _second_while_first_holds(env, report)
        second.get(timeout=10)
        env.rec.set("go", 1)
        assert first.get(timeout=10) == "first"
        wait_for(lambda: len(spans.named("run/" + report.name)) == 2)
    task = spans.task_span(second.id)
    acquire = one(spans.children(task, "redlock.acquire"))
    a = attrs(acquire)
    assert a["redlock.outcome"] == "contended" and a["redlock.key"] == "report"
    assert a["redlock.holder.task_id"] == first.id
    assert a["redlock.holder.task_name"] == report.name
    assert a["redlock.policy"] == "skip"
    assert "redlock.fence" not in a
    assert spans.children(task, "redlock.hold") == []
    # The holder's own spans are under its own task span.
    holder_task = spans.task_span(first.id)
    assert attrs(one(spans.children(holder_task, "redlock.hold")))["redlock.outcome"] == "released"
    assert "redlock.policy" not in attrs(one(spans.children(holder_task, "redlock.acquire")))


def test_a_waiting_run_names_the_wait_policy_on_its_refused_attempt(env: Env, spans: Spans) -> None:
    """lock_on_contended="wait" on a held key: the refused attempt's span says
    ``redlock.policy`` = ``wait``; the wait that got the lock is ``acquired``, without one."""
    app = env.app()
    drain = _first_holds(env, app, lock_key="queue", lock_on_contended="wait", lock_wait_timeout=10)
    with worker(app, concurrency=2):
        first, second = _second_while_first_holds(env, drain)
        wait_for(lambda: len(spans.named("redlock.acquire")) >= 2)  # the refused attempt ended
        env.rec.set("go", 1)
        assert second.get(timeout=10) == "second" and first.get(timeout=10) == "first"
        wait_for(lambda: len(spans.named("run/" + drain.name)) == 2)
    task = spans.task_span(second.id)
    refused, waited = sorted(
        (attrs(s) for s in spans.children(task, "redlock.acquire")),
        key=lambda a: a["redlock.outcome"] != "contended",
    )
    assert refused["redlock.outcome"] == "contended" and refused["redlock.policy"] == "wait"
    assert waited["redlock.outcome"] == "acquired" and "redlock.policy" not in waited


def test_lost_hold_ends_under_the_task_span_although_the_renewal_thread_saw_it(
    env: Env, spans: Spans
) -> None:
    """A body outlives its lease because renewal fails (its key is deleted: the renewal
    round answers "gone"); the loss is seen on the renewal thread, and the
    ``redlock.hold`` span still ends under the run's task span: ``lost``, an error."""
    app = env.app()
    seen: list[str] = []

    def record_thread(event: LockEvent) -> None:
        if event.kind == "lost":
            seen.append(threading.current_thread().name)

    @app.task(base=LockedTask, shared=False, lock_key="victim", lock_ttl=0.9, lock_on_lost="warn")
    def victim() -> str:
        env.rec.set("started", 1)
        deadline = time.monotonic() + 10
        while not env.rec.exists("done") and time.monotonic() < deadline:
            time.sleep(0.02)
        return "finished"

    add_hook(record_thread)
    try:
        with worker(app, concurrency=1):
            result = victim.delay()
            assert env.hold_until("started")
            assert env.locks.delete("redlock:{victim}") == 1
            wait_for(lambda: seen, timeout=5, what="the loss to be seen")
            env.rec.set("done", 1)
            assert result.get(timeout=10) == "finished"
            wait_for(lambda: spans.named("run/" + victim.name))
    finally:
        remove_hook(record_thread)
    task = spans.task_span(result.id)
    assert seen and seen[0] != threading.main_thread().name
    assert "MainThread" not in seen[0] and "Worker" not in seen[0], seen
    hold = one(spans.children(task, "redlock.hold"))
    h = attrs(hold)
    assert h["redlock.outcome"] == "lost" and h["redlock.lost_reason"]
    assert hold.status.status_code is StatusCode.ERROR
    assert hold.end_time is not None and task.end_time is not None
    assert hold.end_time < task.end_time  # ended when it was lost, not at the run's end
    assert attrs(one(spans.children(task, "redlock.acquire")))["redlock.outcome"] == "acquired"


def test_enqueue_spans_say_queued_and_duplicate_with_the_holders_id(env: Env, spans: Spans) -> None:
    """Two publishes of a lock_on="enqueue" task under one caller span: the first one's
    ``redlock.enqueue`` says ``queued``, the second's ``duplicate`` with the first call's
    task id; both are children of the caller's span."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="sync:<user>", lock_on="enqueue")
    def sync(user: int) -> int:
        return user

    tracer = spans.provider.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        first = sync.delay(1)
        second = sync.delay(1)
    assert second.id == first.id  # lock_on_duplicate="return": the queued call's result
    with worker(app):
        assert first.get(timeout=10) == 1
        wait_for(lambda: spans.named("run/" + sync.name))
    parent = one([s for s in spans.all() if s.name == "caller"])
    assert parent.get_span_context().span_id == caller.get_span_context().span_id
    enqueues = spans.children(parent, "redlock.enqueue")
    queued, duplicate = sorted(enqueues, key=lambda s: s.start_time or 0)
    q, d = attrs(queued), attrs(duplicate)
    assert q["redlock.outcome"] == "queued" and q["redlock.key"] == "sync:1"
    assert q["redlock.lock_on"] == "enqueue" and q["redlock.task"] == sync.name
    assert d["redlock.outcome"] == "duplicate" and d["redlock.holder.task_id"] == first.id
    # The run of the queued message takes its lock by hand-over, under its task span.
    task = spans.task_span(first.id)
    assert attrs(one(spans.children(task, "redlock.acquire")))["redlock.outcome"] == "acquired"


def test_lock_limits_run_shows_each_hold_taken_and_the_rule_that_refused(
    env: Env, spans: Spans
) -> None:
    """Runs with lock_limits=[Limit("partner", 1)]: the one that runs has a
    ``redlock.rule`` event per rule (held, fence); another key's run refused by the rule
    is ``contended``, refused_by the rule, with a ``refused`` rule event; a run of a
    paused key is ``paused``."""
    app = env.app()

    @app.task(
        base=LockedTask,
        shared=False,
        lock_key="job:<n>",
        lock_limits=[Limit("partner", 1)],
        lock_on_contended="skip",
    )
    def job(n: int) -> int:
        if n == 1:
            env.rec.set("one-started", 1)
            env.hold_until("go")
        return n

    with worker(app, concurrency=2):
        holder = job.delay(1)
        assert env.hold_until("one-started")
        refused = job.delay(2)
        refused.get(timeout=10)
        env.rec.set("go", 1)
        assert holder.get(timeout=10) == 1
        control(app).pause("job:3", 30, reason="test")
        paused = job.delay(3)
        paused.get(timeout=10)
        wait_for(lambda: len(spans.named("run/" + job.name)) == 3)
    took = one(spans.children(spans.task_span(holder.id), "redlock.acquire"))
    assert attrs(took)["redlock.outcome"] == "acquired"
    rules = [dict(e.attributes or {}) for e in took.events if e.name == "redlock.rule"]
    assert len(rules) == 1, rules
    assert rules[0]["redlock.rule.name"] == "partner" and rules[0]["redlock.rule.kind"] == "limit"
    assert rules[0]["redlock.rule.outcome"] == "held" and rules[0]["redlock.rule.limit"] == 1
    assert isinstance(rules[0]["redlock.rule.fence"], int)

    no = one(spans.children(spans.task_span(refused.id), "redlock.acquire"))
    n = attrs(no)
    assert n["redlock.outcome"] == "contended" and n["redlock.key"] == "job:2"
    assert n["redlock.refused_by"] == "partner" and n["redlock.refusal"] == "limit"
    events = [dict(e.attributes or {}) for e in no.events if e.name == "redlock.rule"]
    assert events == [
        {
            "redlock.rule.name": "partner",
            "redlock.rule.outcome": "refused",
            "redlock.rule.refusal": "limit",
        }
    ]
    stopped = attrs(one(spans.children(spans.task_span(paused.id), "redlock.acquire")))
    assert stopped["redlock.outcome"] == "paused" and stopped["redlock.refused_by"] == "job:3"
    assert stopped["redlock.refusal"] == "paused" and stopped["redlock.pause_reason"] == "test"


def test_rate_limited_and_unavailable_runs_say_so_in_their_acquire_span(
    env: Env, spans: Spans
) -> None:
    """A run refused by its ``lock_rate`` is ``rate_limited`` (kind ``rate``, when its
    next slot is free); a run whose lock Redis does not answer (a closed port,
    ``redlock_fail_open``: it runs unlocked) is ``unavailable`` with an error status."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="api", lock_rate="1/m",
              lock_on_contended="skip")  # fmt: skip
    def call_api() -> str:
        return "called"

    closed = env.app(lock_url="redis://127.0.0.1:9/1", redlock_fail_open=True)

    @closed.task(base=LockedTask, shared=False, lock_key="nowhere")
    def unlocked() -> str:
        return "ran"

    with worker(app, concurrency=1):
        first = call_api.delay()
        first.get(timeout=10)
        second = call_api.delay()
        second.get(timeout=10)
        wait_for(lambda: len(spans.named("run/" + call_api.name)) == 2)
    with worker(closed, concurrency=1):
        lone = unlocked.delay()
        assert lone.get(timeout=20) == "ran"
        wait_for(lambda: spans.named("run/" + unlocked.name))
    # The run takes its key's mutex, then asks the rate, which refuses: the mutex goes
    # back at once.
    task = spans.task_span(second.id)
    mutex, rate = sorted(
        (attrs(s) for s in spans.children(task, "redlock.acquire")),
        key=lambda a: a["redlock.kind"],
    )
    assert (mutex["redlock.kind"], mutex["redlock.outcome"]) == ("mutex", "acquired")
    assert rate["redlock.outcome"] == "rate_limited" and rate["redlock.kind"] == "rate"
    assert rate["redlock.key"] == "api" and 0 < rate["redlock.retry_after_ms"] <= 60_000
    assert rate["redlock.policy"] == "skip"
    # The first run got its rate slot: that attempt is a span too (``granted``), no hold.
    first_task = spans.task_span(first.id)
    mutex, rate = sorted(
        (attrs(s) for s in spans.children(first_task, "redlock.acquire")),
        key=lambda a: a["redlock.kind"],
    )
    assert (mutex["redlock.kind"], mutex["redlock.outcome"]) == ("mutex", "acquired")
    assert (rate["redlock.kind"], rate["redlock.outcome"]) == ("rate", "granted")
    assert rate["redlock.key"] == "api" and 0 <= rate["redlock.wait_ms"] < 1000
    assert "redlock.policy" not in rate
    assert attrs(one(spans.children(first_task, "redlock.hold")))["redlock.kind"] == "mutex"
    assert attrs(one(spans.children(task, "redlock.hold")))["redlock.outcome"] == "released"
    failed = one(spans.children(spans.task_span(lone.id), "redlock.acquire"))
    f = attrs(failed)
    assert f["redlock.outcome"] == "unavailable" and f["redlock.key"] == "nowhere"
    assert f["redlock.error"] and failed.status.status_code is StatusCode.ERROR


def test_a_lock_outside_any_span_makes_none_and_inside_one_makes_children(
    env: Env, spans: Spans
) -> None:
    """A ``Lock`` taken where no span is current (a script, a beat's leader lock) makes
    no span; the same lock taken inside the caller's span makes its acquire and hold
    spans there."""
    lock = Lock(env.locks, "plain", ttl=5)
    with lock:
        pass
    assert spans.all() == []
    with spans.provider.get_tracer("test").start_as_current_span("caller"), lock:
        pass
    caller = one(spans.named("caller"))
    assert attrs(one(spans.children(caller, "redlock.acquire")))["redlock.outcome"] == "acquired"
    assert attrs(one(spans.children(caller, "redlock.hold")))["redlock.outcome"] == "released"


def test_prefork_children_that_set_a_provider_get_spans_without_being_told(
    env: Env, tmp_path: Path
) -> None:
    """A real ``celery worker -P prefork`` whose pool children set OpenTelemetry up in
    ``worker_process_init`` (tests/apps/otelapp.py, as docs/tracing.md shows), with no
    call to celery-redlock: each child decides by itself, and each run's acquire and
    hold spans are children of its task span, made in that child."""
    urls = {
        "OTELAPP_BROKER": f"{env.base}/0",
        "OTELAPP_BACKEND": f"{env.base}/2",
        "OTELAPP_LOCKS": f"{env.base}/1",
        "OTELAPP_RECORD": f"{env.base}/3",
    }
    w = Worker("tests.apps.otelapp", urls, tmp_path / "worker.log", concurrency=2)
    client = publisher(urls["OTELAPP_BROKER"], urls["OTELAPP_BACKEND"])
    try:
        w.wait_ready()
        results = [client.send_task("tests.apps.otelapp.work", args=(n,)) for n in range(4)]
        assert values_of(results, timeout=30) == [0, 1, 2, 3]

        def spans_of_all_runs() -> list[dict[str, Any]]:
            found = [json.loads(s) for s in env.rec.lrange("spans", 0, -1)]
            runs = [s for s in found if s["name"].startswith("run/")]
            return found if len(runs) == 4 else []

        found = wait_for(spans_of_all_runs, timeout=10, what="the four runs' spans")
    finally:
        w.stop()
        close_publisher(client)
    for result in results:
        task = one_record(found, "run/", result.id)
        children = [
            s
            for s in found
            if s["parent_id"] == task["span_id"] and s["trace_id"] == task["trace_id"]
        ]
        by_name = {s["name"]: s for s in children}
        assert sorted(by_name) == ["redlock.acquire", "redlock.hold"], children
        n = results.index(result)
        assert by_name["redlock.acquire"]["attributes"]["redlock.key"] == f"otel:{n}"
        assert by_name["redlock.acquire"]["attributes"]["redlock.outcome"] == "acquired"
        assert by_name["redlock.hold"]["attributes"]["redlock.outcome"] == "released"
        assert {s["pid"] for s in children} == {task["pid"]} != {w.proc.pid}


def one_record(found: list[dict[str, Any]], prefix: str, task_id: str) -> dict[str, Any]:
    """The one exported span named *prefix*... of the run of *task_id*."""
    runs = [
        s
        for s in found
        if s["name"].startswith(prefix) and s["attributes"].get(MESSAGE_ID) == task_id
    ]
    assert len(runs) == 1, runs
    return runs[0]


def test_a_semaphore_run_names_its_kind_and_permits(env: Env, spans: Spans) -> None:
    """A run of a ``lock_limit=2`` task: its acquire and hold spans say ``semaphore``
    with ``redlock.limit`` 2, and the hold has the permit's fence."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="pool", lock_limit=2)
    def pooled() -> str:
        return "ok"

    with worker(app):
        result = pooled.delay()
        assert result.get(timeout=10) == "ok"
        wait_for(lambda: spans.named("run/" + pooled.name))
    task = spans.task_span(result.id)
    acquire = attrs(one(spans.children(task, "redlock.acquire")))
    hold = attrs(one(spans.children(task, "redlock.hold")))
    for found in (acquire, hold):
        assert (found["redlock.kind"], found["redlock.limit"]) == ("semaphore", 2), found
    assert acquire["redlock.outcome"] == "acquired" and hold["redlock.outcome"] == "released"
    assert hold["redlock.fence"] == acquire["redlock.fence"]


def test_a_duplicate_found_by_the_worker_is_an_enqueue_span_under_the_task_span(
    env: Env, spans: Spans
) -> None:
    """Messages sent by name from a process that does not know the task class carry no
    hold: the worker checks them. With lock_on="enqueue+run", the second one, sent while
    the first runs, is a duplicate: a ``redlock.enqueue`` span under its task span names
    the running one."""
    app = env.app()

    @app.task(
        base=LockedTask, shared=False, name="tr.sync", lock_key="s:<n>", lock_on="enqueue+run"
    )
    def sync(n: int) -> int:
        env.rec.set("running", 1)
        env.hold_until("go")
        return n

    plain = Celery("plain", broker=f"{env.base}/0", backend=f"{env.base}/2", set_as_current=False)
    env.apps.append(plain)
    queue = app.conf.task_default_queue
    with worker(app, concurrency=2):
        first = plain.send_task("tr.sync", args=(1,), queue=queue)
        assert env.hold_until("running")
        second = plain.send_task("tr.sync", args=(1,), queue=queue)
        wait_for(lambda: spans.named("run/tr.sync"), what="the duplicate's run span")
        env.rec.set("go", 1)
        assert first.get(timeout=10) == 1
        wait_for(lambda: len(spans.named("run/tr.sync")) == 2)
    task = spans.task_span(second.id)
    found = attrs(one(spans.children(task, "redlock.enqueue")))
    assert found["redlock.outcome"] == "duplicate" and found["redlock.key"] == "s:1"
    assert found["redlock.holder.task_id"] == first.id
    assert spans.children(task, "redlock.acquire") == []
