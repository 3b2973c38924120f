"""De-duplication from enqueue (lock_on="enqueue" / "enqueue+run") on real in-process
workers: a Redis broker, and RabbitMQ (127.0.0.1:5672) where the broker matters.

Apps, the shared throwaway Redis (broker db 0, locks db 1, results db 2, records db 3)
and the in-process worker come from test_task_inprocess.
"""

from __future__ import annotations

import functools
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from amqp.exceptions import ChannelError
from celery import Celery, chord, group, signals
from celery.result import AsyncResult
from inprocess import Env, worker
from prometheus_client import CollectorRegistry
from servers import RABBIT, rabbitmq_up, wait_for
from test_observability import EventCapture

from celery_redlock import (
    AlreadyQueued,
    ConfigError,
    LockedTask,
    LockEvent,
    install,
    is_skipped,
)
from celery_redlock.app.observability import disable_prometheus, enable_prometheus
from celery_redlock.core import add_hook, remove_hook
from celery_redlock.core.admin import scan_locks
from celery_redlock.task.dedup import HOLD_HEADER, hold_for


def queued_messages(app: Celery) -> int:
    """Messages waiting in the app's default queue (any broker; a Redis list that is gone
    is an empty queue)."""
    with app.connection_for_write() as conn:
        try:
            declared = conn.default_channel.queue_declare(
                queue=app.conf.task_default_queue, passive=True
            )
        except ChannelError:
            return 0
        return int(declared.message_count)


def hold_owner(env: Env, name: str) -> str | None:
    """The task id holding lock *name*'s enqueue-time hold, or None."""
    return env.locks.hget(f"redlock:{{{name}}}:queued", "owner")


@pytest.fixture
def sent() -> Iterator[list[str]]:
    """Task names of every message published in this process while the test runs."""
    names: list[str] = []

    def count(sender: Any = None, **_: Any) -> None:
        names.append(str(sender))

    signals.before_task_publish.connect(count, weak=False)
    try:
        yield names
    finally:
        signals.before_task_publish.disconnect(count)


@pytest.fixture
def events() -> Iterator[list[LockEvent]]:
    """LockEvents emitted in this process while the test runs."""
    seen: list[LockEvent] = []
    add_hook(seen.append)
    try:
        yield seen
    finally:
        remove_hook(seen.append)


def _app(env: Env, broker: str, **conf: Any) -> Celery:
    app = env.app(**conf)
    if broker == "rabbitmq":
        app.conf.broker_url = RABBIT
    return app


BROKERS = [
    "redis",
    pytest.param(
        "rabbitmq",
        marks=pytest.mark.skipif(not rabbitmq_up(), reason="no RabbitMQ on 127.0.0.1:5672"),
    ),
]


# ------------------------------------------------------------------- one queued per key
@pytest.mark.parametrize("broker", BROKERS)
def test_twenty_calls_with_the_worker_stopped_queue_one_message_that_runs_once(
    env: Env, broker: str
) -> None:
    """20 delay(42) while no worker runs: one message is queued, every call returns its
    task id; the body runs once when the worker starts, and the key is free after."""
    app = _app(env, broker)

    @app.task(base=LockedTask, shared=False, lock_key="sync:<user_id>", lock_on="enqueue+run")
    def sync(user_id: int) -> int:
        env.push("runs", user_id)
        return user_id

    try:
        results = [sync.delay(42) for _ in range(20)]
        assert len({r.id for r in results}) == 1
        assert queued_messages(app) == 1
        assert hold_owner(env, "sync:42") == results[0].id
        with worker(app):
            assert results[-1].get(timeout=15) == 42
        assert env.items("runs") == [42]
        assert queued_messages(app) == 0
        assert env.held_keys() == []
    finally:
        if broker == "rabbitmq":
            with app.connection_for_write() as conn:
                conn.default_channel.queue_delete(app.conf.task_default_queue)


def test_enqueue_queues_a_call_made_while_it_runs(env: Env) -> None:
    """lock_on="enqueue": a call while the first runs is queued, and runs after it (the
    run itself is still locked); a third call while that one is queued returns it."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="k", lock_on="enqueue")
    def slow(n: int) -> int:
        env.push("start", n)
        env.hold_until(f"go:{n}")
        env.push("end", n)
        return n

    with worker(app, concurrency=2):
        first = slow.delay(1)
        wait_for(lambda: env.items("start") == [1])
        assert hold_owner(env, "k") is None  # handed over: the lock holds it now
        second = slow.delay(2)
        assert second.id != first.id
        assert slow.delay(3).id == second.id  # queued: a duplicate of the second
        env.rec.set("go:1", 1)
        env.rec.set("go:2", 1)
        assert first.get(timeout=10) == 1 and second.get(timeout=10) == 2
    starts, ends = env.items("start"), env.items("end")
    assert starts == [1, 2] and ends == [1, 2]


def test_enqueue_and_run_returns_the_running_call(env: Env, events: list[LockEvent]) -> None:
    """lock_on="enqueue+run": a call while one runs returns the running task's result,
    with one log line, one LockEvent naming the holder, nothing sent."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="k", lock_on="enqueue+run")
    def slow() -> str:
        env.push("runs", 1)
        env.hold_until("go")
        return "done"

    with worker(app):
        first = slow.delay()
        wait_for(lambda: env.items("runs"))
        again = slow.delay()
        assert again.id == first.id
        assert queued_messages(app) == 0
        env.rec.set("go", 1)
        assert again.get(timeout=10) == "done"
    assert env.items("runs") == [1]
    dups = [e for e in events if e.kind == "duplicate"]
    assert len(dups) == 1 and dups[0].holder["task_id"] == first.id


def test_raise_gives_already_queued_with_task_id_and_time_left(env: Env) -> None:
    """lock_on_duplicate="raise": the second call raises AlreadyQueued naming the queued
    task id, its state and the seconds left on its hold (lock_enqueue_ttl)."""
    app = env.app()

    @app.task(
        base=LockedTask,
        shared=False,
        lock_key="k",
        lock_on="enqueue",
        lock_on_duplicate="raise",
        lock_enqueue_ttl=120,
    )
    def job() -> None:
        return None

    first = job.delay()
    with pytest.raises(AlreadyQueued) as info:
        job.delay()
    assert info.value.task_id == first.id and info.value.state == "queued"
    assert info.value.ttl is not None and 110 < info.value.ttl <= 120


def test_duplicate_is_logged_once_naming_the_holder(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Each duplicate call is one INFO line naming the queued task id."""
    caplog.set_level(logging.INFO, logger="celery_redlock")
    app = env.app()

    @app.task(base=LockedTask, shared=False, name="dd.job", lock_key="k", lock_on="enqueue")
    def job() -> None:
        return None

    first = job.delay()
    job.delay()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("celery_redlock")]
    assert len(lines) == 1
    assert first.id in lines[0] and "not sent" in lines[0] and "'k'" in lines[0]


# ---------------------------------------------------------------- replace and queue_one
def test_replace_with_debounce_runs_a_burst_once_with_the_last_arguments(env: Env) -> None:
    """replace + lock_debounce=1: 10 calls with 1..10 over 0.5 s run the body exactly once,
    with 10; the 9 superseded messages are skipped visibly (their results say so)."""
    app = env.app()

    @app.task(
        base=LockedTask,
        shared=False,
        lock_key="deb",
        lock_on="enqueue",
        lock_on_duplicate="replace",
        lock_debounce=1,
    )
    def refresh(n: int) -> int:
        env.push("runs", n)
        return n

    with worker(app):
        results = []
        for n in range(1, 11):
            results.append(refresh.delay(n))
            time.sleep(0.05)
        assert results[-1].get(timeout=15) == 10
        skipped = [r.get(timeout=15) for r in results[:-1]]
    assert env.items("runs") == [10]
    assert all(is_skipped(s) for s in skipped)
    assert all(s["reason"] == f"superseded by task {results[-1].id}" for s in skipped[-1:])
    assert env.held_keys() == []


def test_queue_one_keeps_exactly_one_more_queued_while_one_runs(env: Env, sent: list[str]) -> None:
    """queue_one under "enqueue+run": 10 calls while one runs send one message; all 10
    return it; it runs after the first."""
    app = env.app()

    @app.task(
        base=LockedTask,
        shared=False,
        name="dd.q1",
        lock_key="q1",
        lock_on="enqueue+run",
        lock_on_duplicate="queue_one",
        lock_on_contended="retry",
        lock_retry_backoff=0.2,
        lock_retry_backoff_max=0.5,
        lock_retry_jitter=False,
    )
    def job(n: int) -> int:
        env.push("start", n)
        env.hold_until(f"go:{n}")
        return n

    first = job.delay(0)
    with worker(app, concurrency=1):
        wait_for(lambda: env.items("start") == [0])
        sent.clear()
        later = [job.delay(n) for n in range(1, 11)]
        assert len({r.id for r in later}) == 1 and later[0].id != first.id
        assert sent == ["dd.q1"]
        assert hold_owner(env, "q1") == later[0].id
        env.rec.set("go:0", 1)
        env.rec.set("go:1", 1)
        assert later[0].get(timeout=10) == 1
    assert env.items("start") == [0, 1]


# ------------------------------------------------------------- retries keep their place
def test_self_retry_in_enqueue_run_runs_again_and_no_duplicate_gets_in(env: Env) -> None:
    """self.retry() in an "enqueue+run" task: the retry runs and succeeds under the same
    task id; calls made during the retry's countdown return that task id; no other run."""
    app = env.app()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="rt", lock_on="enqueue+run")
    def flaky(self: Any) -> int:
        env.push("runs", self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=1.0)
        return self.request.retries

    with worker(app):
        first = flaky.delay()
        wait_for(lambda: env.items("runs") == [0])
        during = [flaky.delay() for _ in range(5)]
        assert {r.id for r in during} == {first.id}
        assert first.get(timeout=15) == 1
    assert env.items("runs") == [0, 1]
    assert env.held_keys() == []


def test_contention_retry_keeps_the_hold(env: Env) -> None:
    """lock_on="enqueue": a queued message that meets a running one is re-queued by the
    contention retry and keeps its hold meanwhile (calls return it), then runs."""
    app = env.app()

    @app.task(
        base=LockedTask,
        shared=False,
        lock_key="ct",
        lock_on="enqueue",
        lock_retry_backoff=0.2,
        lock_retry_backoff_max=0.5,
        lock_retry_jitter=False,
    )
    def job(n: int) -> int:
        env.push("start", n)
        env.hold_until(f"go:{n}")
        return n

    with worker(app, concurrency=2):
        job.delay(1)
        wait_for(lambda: env.items("start") == [1])
        second = job.delay(2)
        wait_for(lambda: second.state == "RETRY")
        assert hold_owner(env, "ct") == second.id
        assert job.delay(3).id == second.id
        env.rec.set("go:1", 1)
        env.rec.set("go:2", 1)
        assert second.get(timeout=10) == 2
    assert env.items("start") == [1, 2]


# ----------------------------------------------------------------- every way to publish
def test_send_task_by_name_is_checked_in_a_process_that_knows_the_task(env: Env) -> None:
    """app.send_task("name") where the LockedTask is registered de-duplicates like delay()."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, name="dd.named", lock_key="n", lock_on="enqueue")
    def named() -> None:
        return None

    app.finalize()  # as in a worker, beat, or any process that used a task of the app
    first = app.send_task("dd.named")
    assert app.send_task("dd.named").id == first.id
    assert named.delay().id == first.id
    assert queued_messages(app) == 1


def test_messages_sent_without_the_class_are_skipped_visibly_by_the_worker(env: Env) -> None:
    """send_task by name from a process that lacks the task class takes no hold: the worker
    recognises the duplicate of the running call before the body runs, and its result
    says so."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, name="dd.blind", lock_key="b", lock_on="enqueue+run")
    def blind() -> str:
        env.push("runs", 1)
        env.hold_until("go")
        return "ran"

    client = env.app()
    client.conf.task_default_queue = app.conf.task_default_queue
    with worker(app, concurrency=2):
        first = client.send_task("dd.blind")
        wait_for(lambda: env.items("runs"))
        second = client.send_task("dd.blind")
        outcome = AsyncResult(second.id, app=app).get(timeout=10)
        env.rec.set("go", 1)
        assert AsyncResult(first.id, app=app).get(timeout=10) == "ran"
    assert is_skipped(outcome) and outcome["task_id"] == first.id
    assert env.items("runs") == [1]


def test_chord_header_duplicates_still_complete_the_chord(env: Env) -> None:
    """Duplicates inside a chord header reach the worker, are skipped there, and count: the
    chord's body runs once every header member ended."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="c:<n>", lock_on="enqueue")
    def part(n: int) -> int:
        env.push("parts", n)
        return n

    @app.task(shared=False)
    def total(values: list[Any]) -> int:
        return sum(v for v in values if isinstance(v, int))

    with worker(app, concurrency=2):
        result = chord([part.s(1), part.s(1), part.s(2)])(total.s())
        assert result.get(timeout=15) in (3, 4)
    assert sorted(env.items("parts")) in ([1, 2], [1, 1, 2])


def _dedup_doc_block(containing: str) -> str:
    """The Python block of docs/dedup.md that contains *containing*, as printed."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "dedup.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if containing in b]
    return block


def test_the_documented_chord_callback_handles_skipped_header_results(env: Env) -> None:
    """docs/dedup.md's chord, run as printed on an in-process worker: the duplicate acme
    member is skipped with the marker the page shows, and the callback adds up the rows
    of the runs and names the call the duplicate was folded into."""
    app = env.app()

    def write_export(account: str) -> int:
        env.push("exports", account)
        env.hold_until(f"go:{account}")
        return len(account)

    # The block's @app.task makes its tasks on this app alone (shared=False): a shared
    # task would be added to every app finalized later in this process.
    namespace: dict[str, Any] = {
        "app": SimpleNamespace(task=functools.partial(app.task, shared=False)),
        "write_export": write_export,
        "__name__": "proj",
    }
    exec(_dedup_doc_block("def summarize"), namespace)  # the page's code: sends the chord
    result = namespace["result"]
    members = result.parent.results
    with worker(app, concurrency=2):
        wait_for(lambda: members[1].ready(), timeout=15, what="the duplicate member skipped")
        env.rec.set("go:globex", 1)
        env.rec.set("go:acme", 1)
        summary = result.get(timeout=15)
    skipped = members[1].get(timeout=5)
    assert is_skipped(skipped)
    assert summary == {"rows": 4 + 6, "duplicates": {"export:acme": members[0].id}}
    assert sorted(env.items("exports")) == ["acme", "globex"]
    # the marker as the page shows it: the same keys, the reason in the same words
    shown = eval(_dedup_doc_block('"celery_redlock.skipped": True'))  # the page's literal
    assert sorted(skipped) == sorted(shown)
    # The first acme member is running or, if the worker took the duplicate first, still
    # queued: the reason says which.
    assert skipped["reason"] in {
        f"duplicate of task {members[0].id} (running)",
        f"duplicate of task {members[0].id} (queued)",
    }
    assert skipped["lock"] == shown["lock"] == "export:acme"
    assert skipped["task_id"] == members[0].id


def test_group_duplicates_are_skipped_visibly_and_chain_steps_run(env: Env) -> None:
    """Canvas members whose result the canvas awaits are never dropped silently: a group's
    duplicate members reach the worker and are skipped there (the group's results say
    so); a chain step whose key is held is sent and runs, after the holder."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="g", lock_on="enqueue+run")
    def member(n: int) -> int:
        env.push("runs", n)
        env.hold_until(f"go:{n}")
        return n

    @app.task(shared=False)
    def after(value: Any) -> Any:
        return value

    outcome = group([member.s(1), member.s(2), member.s(3)]).apply_async()
    chained = (member.si(4) | after.s()).apply_async()
    env.rec.set("go:4", 1)
    with worker(app, concurrency=2):
        wait_for(lambda: all(r.ready() for r in outcome.results[1:]), timeout=15)
        env.rec.set("go:1", 1)
        # Each member's state is read from the backend: Celery 5.3's result subscription
        # can miss the last member of a group some of whose members were ready already.
        wait_for(outcome.ready, timeout=15)
        values = outcome.get(timeout=5)
        assert chained.get(timeout=15) == 4
    assert values[0] == 1 and all(is_skipped(v) for v in values[1:])
    assert env.items("runs") == [1, 4]


def test_a_link_target_is_sent_and_skipped_while_a_delay_in_a_body_returns_the_holder(
    env: Env,
) -> None:
    """While job(1) runs its key: a link callback job(...) that Celery applies after its
    parent (not frozen, but given parent_id) is sent under its own id and skipped by its
    worker; a plain job.delay() made inside another task's body is still a duplicate
    answered with the running call's id, nothing sent."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="lk", lock_on="enqueue+run")
    def job(n: int) -> int:
        env.push("runs", n)
        env.hold_until(f"go:{n}")
        return n

    @app.task(shared=False)
    def starter() -> int:
        return 3

    @app.task(shared=False)
    def caller() -> str:
        return str(job.delay(2).id)

    with worker(app, concurrency=3):
        first = job.delay(1)
        wait_for(lambda: env.items("runs") == [1])
        assert caller.delay().get(timeout=10) == first.id
        parent = starter.apply_async(link=job.s())
        assert parent.get(timeout=10) == 3
        wait_for(lambda: parent.children, timeout=10)
        (callback,) = parent.children
        assert callback.id != first.id
        marker = callback.get(timeout=10)
        assert is_skipped(marker) and marker["task_id"] == first.id
        env.rec.set("go:1", 1)
        assert first.get(timeout=10) == 1
    assert env.items("runs") == [1]


# ------------------------------------------------------- holds freed when a message ends
def test_revoked_and_expired_messages_free_their_hold_when_a_worker_sees_them(env: Env) -> None:
    """A revoked queued message and one past its expires= release their holds as the
    worker discards them (the expired one's hold is capped near its expiry anyway); the
    next call is queued and runs."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="r:<n>", lock_on="enqueue")
    def job(n: int) -> int:
        env.push("runs", n)
        return n

    with worker(app):
        revoked = job.apply_async((1,), countdown=1.0)
        expired = job.apply_async((2,), countdown=1.0, expires=0.5)
        assert hold_owner(env, "r:1") == revoked.id and hold_owner(env, "r:2") == expired.id
        assert 0 < env.locks.pttl("redlock:{r:2}:queued") <= 5_500  # capped by expires
        app.control.revoke(revoked.id)
        waited = time.monotonic()
        wait_for(lambda: hold_owner(env, "r:1") is None and hold_owner(env, "r:2") is None, 4.5)
        assert time.monotonic() - waited < 4.5  # released by the worker, not by expiry
        assert job.delay(1).get(timeout=10) == 1
    assert env.items("runs") == [1]


def test_a_message_for_a_task_the_worker_does_not_know_frees_its_hold(env: Env) -> None:
    """A message that took a hold at publish but names a task its worker does not know is
    rejected unread (``task_unknown``): the worker's bootstep gives the hold back at once,
    with its app's state, so the next call of the key is queued."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="u", lock_on="enqueue")
    def job() -> None:
        return None

    task_id = str(uuid.uuid4())
    with worker(app):
        # Given a hold of "u" for a message of a task name no process knows
        assert hold_for(job.redlock_state, job, "u").claim(task_id, 30).outcome == "queued"
        assert hold_owner(env, "u") == task_id
        # When that message reaches the worker
        app.send_task("nobody.knows.this", task_id=task_id, headers={HOLD_HEADER: "u"})
        # Then its hold is given back long before its 30 s lease ends
        wait_for(lambda: hold_owner(env, "u") is None, 10)


def test_hold_lives_lock_enqueue_ttl_plus_the_countdown(env: Env) -> None:
    """The hold of a message with a countdown lives lock_enqueue_ttl plus that delay."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="t", lock_on="enqueue", lock_enqueue_ttl=10)
    def job() -> None:
        return None

    job.apply_async(countdown=30)
    assert 39_000 < env.locks.pttl("redlock:{t}:queued") <= 40_000


def test_locks_list_shows_queued_and_running_with_task_ids(env: Env) -> None:
    """While one call runs and the next is queued, the inspect layer of `celery locks list`
    shows the key as running (first task id) and queued (second task id)."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="ls", lock_on="enqueue")
    def job(n: int) -> int:
        env.push("start", n)
        env.hold_until(f"go:{n}")
        return n

    with worker(app, concurrency=1):
        first = job.delay(1)
        wait_for(lambda: env.items("start") == [1])
        second = job.delay(2)
        rows = scan_locks(env.locks, "redlock:")
        assert [(r.state, r.record.get("task_id")) for r in rows] == [
            ("running", first.id),
            ("queued", second.id),
        ]
        env.rec.set("go:1", 1)
        env.rec.set("go:2", 1)
        second.get(timeout=10)


# ----------------------------------------------------------------------- bad settings
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"lock_on": "publish"}, "'run', 'enqueue', 'enqueue+run'"),
        ({"lock_on": "enqueue", "lock_on_duplicate": "drop"}, "'return', 'raise'"),
        (
            {"lock_on": "enqueue", "lock_on_duplicate": "return", "lock_debounce": 1},
            "must be used with lock_on_duplicate='replace' on the same task (the newest "
            "call's arguments run once the calls stop); it sets 'return'",
        ),
        ({"lock_debounce": 1}, "it sets none"),
        ({"lock_on": "enqueue+run", "lock_limit": 3}, "must be used with lock_limit=1"),
        ({"lock_on": "run", "lock_on_duplicate": "raise"}, "must be used with lock_on='enqueue'"),
        ({"lock_on": "enqueue", "lock_enqueue_ttl": 0}, "lock_enqueue_ttl=0"),
    ],
)
def test_bad_dedup_options_fail_at_decoration(
    env: Env, options: dict[str, Any], expected: str
) -> None:
    """Each bad lock_on option (or combination) is a ConfigError naming the task and fix."""
    app = env.app()
    app.finalize()
    with pytest.raises(ConfigError, match=r"'dd\.bad'") as info:

        @app.task(base=LockedTask, shared=False, name="dd.bad", **options)
        def bad() -> None:
            return None

    assert expected in str(info.value)


def test_redlock_quorum_refuses_enqueue_holds_at_publish(env: Env, redis_servers: Any) -> None:
    """With a list of masters (Redlock), lock_on="enqueue" is refused with a ConfigError at
    the first publish (and at worker start), never half-applied."""
    urls = [f"redis://127.0.0.1:{s.port}/0" for s in redis_servers(3)]
    app = env.app(lock_url=urls)

    @app.task(base=LockedTask, shared=False, name="dd.rl", lock_on="enqueue")
    def rl() -> None:
        return None

    with pytest.raises(ConfigError, match=r"enqueue-time holds .* are not available on") as refused:
        rl.delay()
    assert "could not be one atomic step on a majority of Redlock masters" in str(refused.value)
    assert queued_messages(app) == 0


def test_redlock_tasks_give_a_plain_task_publish_time_dedup(env: Env) -> None:
    """redlock_tasks with lock_on="enqueue+run" on a task without the base class, in a
    publisher that called install(app): five delay(7) with no worker running send one
    message and return its id; it runs once."""
    app = env.app(redlock_tasks={"dd.plain": {"lock_key": "plain:<n>", "lock_on": "enqueue+run"}})

    @app.task(name="dd.plain", shared=False)
    def plain(n: int) -> int:
        env.push("runs", n)
        return n

    install(app)  # a worker installs itself; a publisher of redlock_tasks says so
    assert not app.finalized  # the first publish finalizes it, and so applies redlock_tasks
    results = [plain.delay(7) for _ in range(5)]
    assert len({r.id for r in results}) == 1
    assert queued_messages(app) == 1
    assert hold_owner(env, "plain:7") == results[0].id
    with worker(app):
        assert results[-1].get(timeout=15) == 7
    assert env.items("runs") == [7]
    assert env.held_keys() == []


def test_redlock_lock_on_setting_is_the_default_of_tasks_that_do_not_set_it(env: Env) -> None:
    """app.conf.redlock_lock_on="enqueue" makes a LockedTask without lock_on de-duplicate
    at publish; a task that sets lock_on="run" keeps sending every call."""
    app = env.app(redlock_lock_on="enqueue")

    @app.task(base=LockedTask, shared=False, lock_key="d:<n>")
    def defaulted(n: int) -> int:
        return n

    @app.task(base=LockedTask, shared=False, lock_key="r:<n>", lock_on="run")
    def per_run(n: int) -> int:
        return n

    assert defaulted.delay(1).id == defaulted.delay(1).id
    assert per_run.delay(1).id != per_run.delay(1).id
    assert queued_messages(app) == 3


def test_eager_calls_skip_the_publish_check_and_still_lock_the_run(env: Env) -> None:
    """task_always_eager: no hold is taken (nothing is queued), the run is locked as usual."""
    app = env.app(task_always_eager=True)

    @app.task(base=LockedTask, shared=False, lock_key="e", lock_on="enqueue+run")
    def job() -> list[str]:
        return env.held_keys()

    assert job.delay().get() == ["redlock:{e}"]
    assert job.delay().get() == ["redlock:{e}"]
    assert env.held_keys() == []


def test_threads_racing_one_key_send_one_message(env: Env) -> None:
    """8 threads x 10 calls of one key at once: exactly one message, one task id."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="race", lock_on="enqueue+run")
    def job() -> None:
        return None

    ids: list[str] = []
    barrier = threading.Barrier(8)

    def calls() -> None:
        barrier.wait(5)
        ids.extend(job.delay().id for _ in range(10))

    threads = [threading.Thread(target=calls) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(ids) == 80 and len(set(ids)) == 1
    assert queued_messages(app) == 1
    assert uuid.UUID(ids[0])


def test_duplicate_is_a_celery_event_and_a_metric(env: Env) -> None:
    """A publisher that sends task events (task_send_sent_event) sends redlock-duplicate
    naming the holder; the Prometheus hook counts the duplicate by kind and task."""
    registry = CollectorRegistry()
    enable_prometheus(registry)
    app = env.app(task_send_sent_event=True)

    @app.task(base=LockedTask, shared=False, name="dd.ev", lock_key="ev", lock_on="enqueue")
    def job() -> None:
        return None

    capture = EventCapture(app, timeout=20)
    try:
        for _ in range(40):  # until the receiver is subscribed to the event fanout
            with app.events.default_dispatcher() as dispatcher:
                dispatcher.send("worker-heartbeat")
            if capture.events:
                break
            time.sleep(0.25)
        first = job.delay()
        job.delay()
        wait_for(lambda: [e for e in capture.events if e["type"] == "redlock-duplicate"])
        count = registry.get_sample_value(
            "celery_redlock_events_total", {"kind": "duplicate", "task": "dd.ev"}
        )
    finally:
        capture.stop()
        disable_prometheus(registry)
    [event] = [e for e in capture.events if e["type"] == "redlock-duplicate"]
    assert event["holder"] == first.id and event["lock"] == "ev" and event["state"] == "queued"
    assert count == 1.0


# --------------------------------------- the claim answered while Celery builds the message
@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """The headers of every message published in this process while the test runs."""
    seen: list[dict[str, Any]] = []

    def record(headers: Any = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    signals.before_task_publish.connect(record, weak=False)
    try:
        yield seen
    finally:
        signals.before_task_publish.disconnect(record)


@pytest.mark.parametrize("hooked", [True, False], ids=["while-building", "before-publish"])
def test_a_duplicate_sends_nothing_whether_decided_while_building_or_before(
    env: Env, published: list[dict[str, Any]], hooked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain call's claim is answered while Celery builds its message (the builder is
    wrapped): a duplicate stops there, before any broker work or publish signal. Where the
    builder cannot be wrapped, the answer is read before the publish: the same outcome."""
    if not hooked:
        monkeypatch.setattr("celery_redlock.task.claiming.hook", lambda app: False)
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="b:<n>", lock_on="enqueue")
    def build(n: int) -> int:
        return n

    first = build.delay(7)
    again = build.delay(7)
    other = build.delay(8)
    assert again.id == first.id and other.id != first.id
    assert [h.get("id") for h in published] == [first.id, other.id]
    assert all(h.get("redlock_hold") in ("b:7", "b:8") for h in published)
    assert queued_messages(app) == 2
    assert hold_owner(env, "b:7") == first.id
    wrapped = getattr(app.amqp.create_task_message, "redlock_decides", False)
    assert wrapped is hooked


def test_a_publish_that_fails_gives_back_the_hold_it_claimed(env: Env) -> None:
    """The broker refuses the publish after the claim was answered: the hold taken for it
    is given back (owner-checked), so the next call is sent, not a duplicate of nothing."""
    app = env.app(broker_connection_retry=False, task_publish_retry=False)
    app.conf.broker_url = f"redis://127.0.0.1:{_closed_port()}/0"

    @app.task(base=LockedTask, shared=False, lock_key="f:<n>", lock_on="enqueue")
    def fails(n: int) -> int:
        return n

    with pytest.raises(Exception) as refused:  # kombu's OperationalError
        fails.delay(1)
    assert not isinstance(refused.value, ConfigError)
    assert wait_for(lambda: hold_owner(env, "f:1") is None, timeout=5)


def test_a_claim_that_cannot_be_answered_sends_the_call_without_a_hold(
    env: Env, published: list[dict[str, Any]]
) -> None:
    """The lock Redis is down when the claim is sent: the call is sent anyway, without the
    hold header, so that its worker checks it for duplicates before it runs."""
    app = env.app(lock_url=f"redis://127.0.0.1:{_closed_port()}/1")

    @app.task(base=LockedTask, shared=False, lock_key="d:<n>", lock_on="enqueue")
    def down(n: int) -> int:
        return n

    result = down.delay(3)
    assert [h.get("id") for h in published] == [result.id]
    assert "redlock_hold" not in published[0]
    assert queued_messages(app) == 1


def _closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
