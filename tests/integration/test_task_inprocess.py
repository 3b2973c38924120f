"""LockedTask on real in-process Celery workers (threads and solo pools) and real Redis.

Every test builds a fresh ``Celery`` app whose tasks are defined with ``shared=False``
(so apps never leak into each other) and runs them on ``start_worker`` from
``celery.contrib.testing``: the worker runs in a background thread of this process,
with a throwaway Redis as broker (db 0), result backend (db 2) and lock store (db 1);
task bodies write what they saw to db 3, which the test reads.

The prefork-only failures (a SIGKILLed child, hard time limits, revoke(terminate=True),
a killed worker) are covered by test_task_worker.py, not here.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import json
import logging
import os
import pickle
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, signals
from celery.exceptions import Ignore, Reject
from celery.result import AsyncResult
from inprocess import Env, worker
from servers import RedisServer, wait_for

from celery_redlock import (
    BackOff,
    ConfigError,
    Lock,
    LockContended,
    LockedTask,
    LockLost,
    StoreUnavailable,
    install,
    is_skipped,
)
from celery_redlock.app.state import state_for
from celery_redlock.core.backend_types import Slot, Status
from celery_redlock.core.backends.redis import RedisBackend
from celery_redlock.core.backends.redis.scripts import ACQUIRE, HOLD_ALL, RELEASE, Script
from celery_redlock.core.keys import LockKeys
from celery_redlock.core.lock import Lock as CoreLock
from celery_redlock.task import next_attempt
from celery_redlock.task import run as run_module
from celery_redlock.task.interrupt import LockLostInterrupt, Watch, watch_of
from celery_redlock.task.locked_task import needs_postrun_net

LOGGER = "celery_redlock"


# ------------------------------------------------------------------------------- helpers


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    """celery_redlock log messages at *level* or above."""
    return [
        r.getMessage() for r in caplog.records if r.name.startswith(LOGGER) and r.levelno >= level
    ]


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """caplog capturing celery_redlock's INFO lines."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


@contextlib.contextmanager
def postrun_net_off() -> Iterator[None]:
    """Disconnect the task_postrun safety net for a while (if some class connected it)."""
    receiver = run_module.on_postrun
    connected = signals.task_postrun.disconnect(receiver)
    try:
        yield
    finally:
        if connected:
            signals.task_postrun.connect(receiver, weak=False)


@pytest.fixture
def no_safety_net(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Switch both safety nets off (LockedTask.after_return and the task_postrun receiver),
    so only the body wrapper can release."""
    monkeypatch.delattr(LockedTask, "after_return")
    with postrun_net_off():
        yield


# ------------------------------------------------------------------ 1. keys and templates
def test_template_binds_positional_keyword_and_defaulted_calls_to_one_key(env: Env) -> None:
    """Positional, keyword and defaulted calls of sync(user_id, full) all hold redlock:{sync:42}."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="sync:<user_id>")
    def sync(user_id: int, full: bool = False) -> list[str]:
        return env.held_keys()  # observed in Redis while this run holds its lock

    calls = [
        sync.delay(42),
        sync.delay(user_id=42),
        sync.delay(42, True),
        sync.delay(42, full=True),
        sync.apply_async(kwargs={"full": False, "user_id": 42}),
    ]
    with worker(app):
        seen = [r.get(timeout=10) for r in calls]
    assert seen == [["redlock:{sync:42}"]] * len(calls)
    assert env.held_keys() == []


def test_dict_argument_gives_the_same_key_in_any_key_order(env: Env) -> None:
    """A dict argument renders canonically: {'a','b'} and {'b','a'} lock one key."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="cfg:<cfg>")
    def configure(cfg: dict[str, Any]) -> list[str]:
        return env.held_keys()

    with worker(app):
        first = configure.delay({"a": 1, "b": [1, 2]}).get(timeout=10)
        second = configure.delay({"b": [1, 2], "a": 1}).get(timeout=10)
    assert first == second == ['redlock:{cfg:{"a":1,"b":[1,2]}}']


def test_callable_key_singleton_and_per_call_override(env: Env) -> None:
    """A callable lock_key, the task-name singleton and apply_async(lock_key=...) pick the key."""
    app = env.app()

    @app.task(
        base=LockedTask,
        shared=False,
        lock_key=lambda user_id, full=False: f"cb-{user_id}",
    )
    def by_callable(user_id: int, full: bool = False) -> list[str]:
        return env.held_keys()

    @app.task(base=LockedTask, shared=False, name="inproc.nightly")
    def nightly() -> list[str]:
        return env.held_keys()

    @app.task(base=LockedTask, shared=False, lock_key="sync:<user_id>")
    def sync(user_id: int) -> list[str]:
        return env.held_keys()

    with worker(app):
        assert by_callable.delay(7).get(timeout=10) == ["redlock:{cb-7}"]
        assert by_callable.delay(user_id=7).get(timeout=10) == ["redlock:{cb-7}"]
        assert nightly.delay().get(timeout=10) == ["redlock:{inproc.nightly}"]
        assert sync.apply_async((42,), lock_key="other").get(timeout=10) == ["redlock:{other}"]
        assert sync.apply_async((42,), lock_key="o:<user_id>").get(timeout=10) == ["redlock:{o:42}"]
        assert sync.delay(42).get(timeout=10) == ["redlock:{sync:42}"]


def test_per_call_template_with_an_unknown_name_fails_at_the_call(env: Env) -> None:
    """apply_async(lock_key="o:<usr>") raises ConfigError at the caller, not in the worker."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, name="inproc.sync", lock_key="sync:<user_id>")
    def sync(user_id: int) -> None:
        raise AssertionError("never sent")

    with pytest.raises(ConfigError, match=r"'inproc.sync'.*<usr>.*did you mean <user_id>"):
        sync.apply_async((42,), lock_key="o:<usr>")
    assert env.server.client().llen(app.conf.task_default_queue) == 0


def _per_call_app(env: Env) -> tuple[Celery, Any]:
    """An app with one locked task, ``inproc.sync``, that de-duplicates at publish."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, name="inproc.sync", lock_key="sync:<user_id>",
              lock_on="enqueue+run")  # fmt: skip
    def sync(user_id: int) -> list[str]:
        return env.held_keys()

    app.finalize()
    return app, sync


#: where -> (the call, what the error names as the call, the task it names)
PER_CALL_REFUSED: dict[str, tuple[Callable[[Celery, Any], Any], str, str]] = {
    "apply_async": (lambda app, sync: sync.apply_async((42,), lock_on_duplicate="raise"),
                    "apply_async", "inproc.sync"),
    "signature": (lambda app, sync: sync.signature((42,), lock_on_duplicate="raise"),
                  "signature", "inproc.sync"),
    "signature.set": (lambda app, sync: sync.s(42).set(lock_on_duplicate="raise").apply_async(),
                      "apply_async", "inproc.sync"),
    "send_task": (lambda app, sync: app.send_task("inproc.sync", (42,), lock_on_duplicate="raise"),
                  "send_task", "inproc.sync"),
    "send_task-unknown": (lambda app, sync: app.send_task("elsewhere.sync", (42,),
                                                          lock_on_duplicate="raise"),
                          "send_task", "elsewhere.sync"),
}  # fmt: skip


@pytest.mark.parametrize("where", list(PER_CALL_REFUSED))
def test_a_lock_option_passed_per_call_is_refused_naming_task_option_and_fix(
    env: Env, where: str
) -> None:
    """lock_on_duplicate passed per call (apply_async, a signature, send_task) is a
    ConfigError naming the task, the option and where to set it; nothing is published
    and no key is held."""
    app, sync = _per_call_app(env)
    call, verb, task = PER_CALL_REFUSED[where]
    with pytest.raises(ConfigError) as info:
        call(app, sync)
    text = str(info.value)
    assert text.startswith(
        f"task {task!r}: lock_on_duplicate cannot be passed per call "
        f"({verb}(lock_on_duplicate='raise') would be ignored): "
    ), text
    assert "@app.task(base=LockedTask, lock_on_duplicate='raise')" in text
    assert "app.conf.redlock_lock_on_duplicate" in text
    assert "lock_key is the one lock option a call may pass" in text
    assert env.server.client().llen(app.conf.task_default_queue) == 0
    assert env.held_keys() == []


def test_per_call_once_misspelt_options_and_delay_are_refused(env: Env) -> None:
    """once= (celery-once's) and a misspelt lock option are refused at the call with the
    fix; delay() takes no options (Celery refuses the unknown argument)."""
    app, sync = _per_call_app(env)
    with pytest.raises(ConfigError, match=r"^task 'inproc.sync': send_task\(once=.*migrating"):
        app.send_task("inproc.sync", (42,), once={"graceful": True})
    with pytest.raises(ConfigError, match=r"lock_keys='x'\) is not an option.*mean lock_key\?"):
        sync.apply_async((42,), lock_keys="x")
    with pytest.raises(ConfigError, match=r"lock_ttl cannot be passed per call"):
        sync.subtask((42,), lock_ttl=5)
    with pytest.raises(TypeError, match="lock_on_duplicate"):
        sync.delay(42, lock_on_duplicate="raise")
    # None, as Celery's own signatures drop it, is no option at all
    assert sync.apply_async((42,), lock_on_duplicate=None, once=None).id
    assert env.server.client().llen(app.conf.task_default_queue) == 1


def test_per_call_lock_key_works_through_signatures_and_send_task(env: Env) -> None:
    """lock_key per call names the run's lock through a signature's options, send_task by
    name, and send_task from an installed app that does not know the task (the worker
    renders the template)."""
    app, sync = _per_call_app(env)
    client = env.app()
    client.conf.task_default_queue = app.conf.task_default_queue
    install(client)
    with worker(app):
        by_set = sync.s(42).set(lock_key="s:<user_id>").apply_async()
        assert by_set.get(timeout=10) == ["redlock:{s:42}"]
        by_signature = sync.signature((43,), lock_key="sig-43").apply_async()
        assert by_signature.get(timeout=10) == ["redlock:{sig-43}"]
        by_name = app.send_task("inproc.sync", (44,), lock_key="by-name")
        assert by_name.get(timeout=10) == ["redlock:{by-name}"]
        blind = client.send_task("inproc.sync", (45,), lock_key="blind:<user_id>")
        assert AsyncResult(blind.id, app=app).get(timeout=10) == ["redlock:{blind:45}"]


# ------------------------------------------------------ 2. bad options fail at decoration
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"lock_key": "sync:<usr>"}, ["<usr>", "did you mean <user_id>?", "user_id, full"]),
        ({"lock_kye": "sync:<user_id>"}, ["unknown lock option 'lock_kye'", "'lock_key'?"]),
        (
            {"lock_on_contended": "sometimes"},
            ["lock_on_contended='sometimes'", "'retry', 'skip', 'wait', 'raise'"],
        ),
        ({"lock_on_lost": "ignore"}, ["lock_on_lost='ignore'", "'raise', 'warn'"]),
        ({"lock_ttl": 0}, ["lock_ttl=0", "> 0"]),
        ({"lock_ttl": "ten"}, ["lock_ttl='ten'", "a number of seconds"]),
        ({"lock_max_retries": -1}, ["lock_max_retries=-1", "whole number"]),
    ],
)
def test_bad_option_is_a_config_error_at_decoration(
    env: Env, options: dict[str, Any], expected: list[str]
) -> None:
    """A bad template, unknown option, policy or TTL raises ConfigError naming task and fix."""
    app = env.app()
    app.finalize()  # a finalized app builds the task class right in the decorator
    with pytest.raises(ConfigError) as info:

        @app.task(base=LockedTask, shared=False, name="inproc.bad", **options)
        def bad(user_id: int, full: bool = False) -> None:
            raise AssertionError("never runs")

    message = str(info.value)
    assert "'inproc.bad'" in message
    for part in expected:
        assert part in message
    assert "inproc.bad" not in app.tasks


def test_bad_template_on_a_lazy_app_fails_when_the_app_is_finalized(env: Env) -> None:
    """On a not yet finalized app the ConfigError comes at finalize (worker start), not later."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, name="inproc.lazy", lock_key="x:<usr>")
    def lazy(user_id: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(ConfigError, match=r"'inproc.lazy'.*did you mean <user_id>"):
        app.finalize()


# ------------------------------------------------------------- 3.-6. contention policies
def _holding_task(app: Celery, env: Env, **options: Any) -> Any:
    """A task on job:<n> that counts its runs and holds the lock until flag ``go:<n>``."""

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="job:<n>", **options)
    def job(self: Any, n: int, hold: bool = True) -> dict[str, Any]:
        env.rec.incr(f"runs:{n}")
        env.push("started", {"id": self.request.id, "t": time.time()})
        if hold:
            env.hold_until(f"go:{n}")
        env.push("ended", {"id": self.request.id, "t": time.time()})
        return {"id": self.request.id, "retries": self.request.retries}

    return job


def _started(env: Env, task_id: str) -> dict[str, Any]:
    return wait_for(lambda: next((e for e in env.items("started") if e["id"] == task_id), None))


def test_skip_does_not_run_and_returns_a_marker_naming_the_holder(
    env: Env, logs: pytest.LogCaptureFixture
) -> None:
    """skip: B's body never runs, get() returns at once a skipped marker with A's task id."""
    app = env.app()
    job = _holding_task(app, env, lock_on_contended="skip")
    with worker(app):
        a = job.delay(1)
        _started(env, a.id)
        b = job.delay(1)
        begin = time.monotonic()
        result = b.get(timeout=10)
        took = time.monotonic() - begin
        assert not a.ready()  # A still holds the lock: B did not wait for it
        env.rec.set("go:1", 1)
        assert a.get(timeout=10)["id"] == a.id
    assert took < 3.0
    assert is_skipped(result)
    assert result["lock"] == "job:1"
    assert result["holder"]["task_id"] == a.id
    assert result["holder"]["task_name"] == job.name
    assert b.state == "SUCCESS"
    assert env.rec.get("runs:1") == "1"
    skipped = [r for r in logs.records if "skipped" in r.getMessage() and b.id in r.getMessage()]
    assert len(skipped) == 1
    assert skipped[0].name == "celery_redlock.task"
    assert a.id in skipped[0].getMessage() and "job:1" in skipped[0].getMessage()


@pytest.fixture
def trace_logs(logs: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """``logs``, plus Celery's tracer (``celery.app.trace``) at INFO."""
    logs.set_level(logging.INFO, logger="celery.app.trace")
    return logs


def celery_failure_records(caplog: pytest.LogCaptureFixture, task_id: str) -> list[Any]:
    """The records Celery's tracer logged for *task_id*'s failure."""
    return [r for r in caplog.records if r.name == "celery.app.trace" and task_id in r.getMessage()]


def test_raise_fails_with_lock_contended(env: Env, trace_logs: pytest.LogCaptureFixture) -> None:
    """raise: B ends FAILURE with LockContended naming A, without running its body; Celery
    logs it as an expected failure (INFO, no traceback)."""
    app = env.app()
    job = _holding_task(app, env, lock_on_contended="raise")
    with worker(app):
        a = job.delay(1)
        _started(env, a.id)
        b = job.delay(1)
        exc = b.get(timeout=10, propagate=False)
        assert not a.ready()
        env.rec.set("go:1", 1)
        a.get(timeout=10)
    assert b.state == "FAILURE"
    assert isinstance(exc, LockContended)
    assert str(exc).startswith("lock 'job:1' is held by task ")
    assert exc.name == "job:1"  # rebuilt from the JSON result with its context
    assert exc.holder["task_id"] == a.id
    assert env.rec.get("runs:1") == "1"
    failed = celery_failure_records(trace_logs, b.id)
    assert failed and all(r.levelno == logging.INFO and r.exc_info is None for r in failed)
    assert "raised expected" in failed[0].getMessage()


def test_the_tasks_own_throws_are_kept_beside_the_lock_failures(env: Env) -> None:
    """throws=(KeyError,) on a LockedTask: KeyError, LockContended, StoreUnavailable,
    BackOff (a body that backed off until its lock retries ran out) and LockLost."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="t:<n>", throws=(KeyError,))
    def picky(n: int) -> int:
        return n

    assert set(picky.throws) == {KeyError, LockContended, StoreUnavailable, BackOff, LockLost}
    assert picky.throws[0] is KeyError


def test_wait_is_woken_by_the_release_notice_not_the_ttl(env: Env) -> None:
    """wait with lock_ttl=30: B starts within 0.5 s of A's end, so the release notice woke it."""
    app = env.app()
    job = _holding_task(app, env, lock_on_contended="wait", lock_ttl=30, lock_wait_timeout=20)
    with worker(app):
        a = job.delay(1)
        _started(env, a.id)
        b = job.delay(1)
        time.sleep(0.5)  # B is now blocked in its acquire
        assert env.rec.get("runs:1") == "1"
        env.rec.set("go:1", 1)
        assert b.get(timeout=15)["id"] == b.id
        a.get(timeout=10)
    a_end = next(e["t"] for e in env.items("ended") if e["id"] == a.id)
    b_start = next(e["t"] for e in env.items("started") if e["id"] == b.id)
    assert 0 < b_start - a_end < 0.5, b_start - a_end


def test_wait_timeout_shorter_than_the_holder_fails_with_lock_contended(env: Env) -> None:
    """wait, lock_wait_timeout=0.3, A holds on: B fails with LockContended, A is unaffected."""
    app = env.app()
    job = _holding_task(app, env, lock_on_contended="wait", lock_wait_timeout=0.3)
    with worker(app):
        a = job.delay(1)
        _started(env, a.id)
        begin = time.monotonic()
        b = job.delay(1)
        exc = b.get(timeout=10, propagate=False)
        took = time.monotonic() - begin
        assert not a.ready()
        env.rec.set("go:1", 1)
        a.get(timeout=10)
    assert b.state == "FAILURE"
    assert isinstance(exc, LockContended) and exc.holder["task_id"] == a.id
    assert 0.3 <= took < 3.0
    assert env.rec.get("runs:1") == "1"


def test_retry_requeues_with_backoff_outside_the_tasks_own_retry_budget(
    env: Env, logs: pytest.LogCaptureFixture
) -> None:
    """retry: B (max_retries=0) is re-queued with exponential backoff, then runs once, retries=0."""
    app = env.app()
    job = _holding_task(
        app,
        env,
        lock_on_contended="retry",
        max_retries=0,
        lock_max_retries=50,
        lock_retry_backoff=0.05,
        lock_retry_backoff_max=0.2,
        lock_retry_jitter=False,
    )
    with worker(app):
        a = job.delay(1)
        _started(env, a.id)
        b = job.delay(1, hold=False)
        wait_for(lambda: len([m for m in messages(logs) if b.id in m and "lock retry" in m]) >= 4)
        env.rec.set("go:1", 1)
        result = b.get(timeout=10)
        a.get(timeout=10)
    assert result == {"id": b.id, "retries": 0}  # lock retries leave request.retries alone
    assert env.rec.get("runs:1") == "2"
    retries = [m for m in messages(logs) if b.id in m and "lock retry" in m]
    delays = [float(re.search(r" in ([0-9.]+)s", m).group(1)) for m in retries]  # type: ignore[union-attr]
    assert delays[:4] == [0.05, 0.1, 0.2, 0.2]
    numbers = [int(re.search(r"lock retry (\d+)/50", m).group(1)) for m in retries]  # type: ignore[union-attr]
    assert numbers == list(range(1, len(numbers) + 1))
    a_end = next(e["t"] for e in env.items("ended") if e["id"] == a.id)
    b_start = next(e["t"] for e in env.items("started") if e["id"] == b.id)
    assert b_start > a_end


def test_a_lock_retry_is_published_after_its_retry_state_is_stored(env: Env) -> None:
    """A run refused by a held key: when its next attempt is published, the result backend
    already holds this attempt's RETRY; a BackOff's re-queue likewise. Eager and direct
    calls, which re-queue nothing, leave no next attempt behind."""
    app = env.app()
    job = _counting(app, env, lock_on_contended="retry", lock_retry_backoff=0.01)

    @app.task(base=LockedTask, bind=True, shared=False, name="inproc.backs_off", lock_key="bo")
    def backs_off(self: Any) -> str:
        if not getattr(self.request, "redlock_retries", 0):
            raise BackOff(0.05)
        return "ran"

    seen: dict[str, str] = {}

    def at_publish(headers: Any = None, **_: Any) -> None:
        if headers and headers.get("redlock_retries") and headers["id"] not in seen:
            seen[headers["id"]] = app.backend.get_task_meta(headers["id"])["status"]

    outside = Lock(env.locks, "down:1", ttl=10, owner_info={"task_id": "outside"})
    assert outside.acquire(blocking=False)
    signals.before_task_publish.connect(at_publish, weak=False)
    try:
        with worker(app):
            refused = job.delay(1)
            wait_for(lambda: refused.id in seen)
            outside.release()
            assert refused.get(timeout=10) == "ran"
            backed = backs_off.delay()
            assert backed.get(timeout=10) == "ran"
    finally:
        signals.before_task_publish.disconnect(at_publish)
        if outside.owned():
            outside.release()
    assert seen == {refused.id: "RETRY", backed.id: "RETRY"}

    eager = env.app(task_always_eager=True)
    eager_job = _counting(eager, env, "inproc.eager_counted", lock_on_contended="retry")

    @eager.task(base=LockedTask, shared=False, name="inproc.eager_backs_off", lock_key="bo")
    def eager_backs_off() -> str:
        raise BackOff(0)

    with pytest.raises(Exception, match="BackOff"):  # as Celery's eager result rebuilds it
        eager_backs_off.delay().get()
    with pytest.raises(BackOff):
        eager_backs_off()
    assert eager_job.delay(1).get() == "ran"
    assert getattr(next_attempt._local, "next", None) is None


def test_retry_budget_spent_fails_with_lock_contended(
    env: Env, logs: pytest.LogCaptureFixture
) -> None:
    """lock_max_retries=2 while A holds on: B ends FAILURE with LockContended after 2 retries."""
    logs.set_level(logging.INFO, logger="celery.app.trace")
    app = env.app()
    job = _holding_task(
        app,
        env,
        lock_on_contended="retry",
        lock_max_retries=2,
        lock_retry_backoff=0.05,
        lock_retry_jitter=False,
    )
    with worker(app):
        a = job.delay(1)
        _started(env, a.id)
        b = job.delay(1)
        exc = b.get(timeout=10, propagate=False)
        assert not a.ready()
        env.rec.set("go:1", 1)
        a.get(timeout=10)
    assert b.state == "FAILURE"
    assert isinstance(exc, LockContended) and exc.holder["task_id"] == a.id
    assert env.rec.get("runs:1") == "1"
    gave_up = [m for m in messages(logs, logging.ERROR) if b.id in m]
    assert len(gave_up) == 1
    assert "gave up after 2 lock retries" in gave_up[0]
    failed = celery_failure_records(logs, b.id)  # our ERROR line says why; no traceback
    assert failed and all(r.levelno < logging.ERROR and r.exc_info is None for r in failed)
    assert len([m for m in messages(logs) if b.id in m and "lock retry" in m]) == 2


# -------------------------------------------------------------------- 7. self.retry()
@pytest.mark.parametrize(("policy", "countdown"), [("retry", 0.1), ("skip", 0)])
def test_self_retry_from_a_locked_task_runs_again_and_succeeds(
    env: Env, policy: str, countdown: float
) -> None:
    """self.retry() re-runs the task (not skipped or blocked by its own lock) and it succeeds."""
    app = env.app()

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        lock_key="flaky:<n>",
        lock_on_contended=policy,
        max_retries=3,
        lock_retry_backoff=0.05,
    )
    def flaky(self: Any, n: int) -> str:
        env.push(f"flaky:{n}", self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=countdown)
        return "done"

    with worker(app):
        results = [flaky.delay(n) for n in range(12)]  # several, so the race shows up
        assert [r.get(timeout=10) for r in results] == ["done"] * 12
    for n in range(12):
        assert env.items(f"flaky:{n}") == [0, 1]
    assert env.held_keys() == []


# -------------------------------------------------------- 8. released on every exit
def test_a_run_is_one_object_on_its_request_that_says_its_kind(env: Env) -> None:
    """A run keeps one LockedRun in one request attribute, made once: a worker's run is
    WORKER, apply() EAGER, a direct call DIRECT. While the body runs the task's lock is
    the run's and the run is in state.held under its task id; after the release neither."""
    app = env.app()
    state = state_for(app)

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="one:<n>")
    def seen(self: Any, n: int) -> list[Any]:
        run = run_module.run_of(self.request)
        assert run is not None and self.lock is run.lock is not None
        attrs = sorted(a for a in vars(self.request) if a.startswith("_redlock"))
        held = state.held.get(run.task_id) is run if run.task_id else None
        return [run.kind.name, attrs, held]

    assert seen.apply(args=(1,)).get() == ["EAGER", ["_redlock_run"], True]
    assert seen(2) == ["DIRECT", ["_redlock_run"], None]
    with worker(app):
        assert seen.delay(3).get(timeout=10) == ["WORKER", ["_redlock_run"], True]
    assert state.held == {}
    assert env.held_keys() == []


def test_released_on_every_exit_before_the_result_is_ready(env: Env, no_safety_net: None) -> None:
    """Success, error, self.retry(), Ignore and Reject each free the key by the time they end."""
    app = env.app()
    finished: dict[str, threading.Event] = {}

    def on_postrun(task_id: str | None = None, **_: Any) -> None:
        if task_id in finished:
            finished[task_id].set()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="exit:<how>", max_retries=1)
    def leave(self: Any, how: str) -> str:
        env.push("held", [how, self.request.retries, env.held_keys()])
        if how == "error":
            raise ValueError("boom")
        if how == "retry" and self.request.retries == 0:
            raise self.retry(countdown=1.0)
        if how == "ignore":
            raise Ignore()
        if how == "reject":
            raise Reject("no", requeue=False)
        return how

    signals.task_postrun.connect(on_postrun, weak=False)
    try:
        with worker(app):
            assert leave.delay("ok").get(timeout=10) == "ok"
            assert env.held_keys() == []

            exc = leave.delay("error").get(timeout=10, propagate=False)
            assert isinstance(exc, ValueError)
            assert env.held_keys() == []

            retried = leave.delay("retry")
            wait_for(lambda: retried.state == "RETRY")
            assert env.held_keys() == []  # released before the RETRY state was stored
            assert retried.get(timeout=10) == "retry"
            assert env.held_keys() == []

            for how in ("ignore", "reject"):
                task_id = str(uuid.uuid4())
                finished[task_id] = threading.Event()
                leave.apply_async((how,), task_id=task_id)
                assert finished[task_id].wait(10)
                assert env.held_keys() == []
    finally:
        signals.task_postrun.disconnect(on_postrun)
    held = env.items("held")
    assert [h[:2] for h in held] == [
        ["ok", 0],
        ["error", 0],
        ["retry", 0],
        ["retry", 1],
        ["ignore", 0],
        ["reject", 0],
    ]
    for how, _, keys in held:
        assert keys == [f"redlock:{{exit:{how}}}"]


class _FailsAfterAcquire(LockedTask):  # abstract: no body of its own
    """A base whose own before_start ends the run after the lock was taken (the window the
    safety nets exist for: the body wrapper, which normally releases, never starts).
    Each task passes its Env as the ``test_env`` option."""

    test_env: Env

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().before_start(task_id, args, kwargs)
        how = args[0]
        self.test_env.push("acquired", [how, self.test_env.held_keys()])
        if how == "error":
            raise ValueError("after the acquire")
        if how == "ignore":
            raise Ignore()
        if how == "reject":
            raise Reject("no", requeue=False)


def test_needs_postrun_net_only_for_classes_with_their_own_hooks(env: Env) -> None:
    """The task_postrun receiver is needed (and connected) only for a class with its own
    before_start, __call__ or after_return; plain LockedTask tasks rely on after_return."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="p:<n>")
    def plain_locked(n: int) -> None:
        return None

    class OwnCall(LockedTask):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    class OwnAfterReturn(LockedTask):
        def after_return(self, *args: Any) -> None:  # does not call ours
            return None

    @app.task(base=OwnCall, shared=False)
    def with_call() -> None:
        return None

    @app.task(base=OwnAfterReturn, shared=False)
    def with_after_return() -> None:
        return None

    @app.task(base=_FailsAfterAcquire, shared=False, lock_key="f:<how>", test_env=env)
    def with_before_start(how: str) -> None:
        return None

    def cls(task: Any) -> type:
        return type(task._get_current_object())  # the task class behind app.task's proxy

    assert not needs_postrun_net(cls(plain_locked))
    for task in (with_call, with_after_return, with_before_start):
        assert needs_postrun_net(cls(task)), task.name
    receivers = [r for _, r in signals.task_postrun.receivers]
    assert run_module.on_postrun in receivers


@pytest.mark.parametrize("how", ["error", "ignore", "reject"])
def test_lock_taken_by_a_run_whose_body_never_starts_is_freed_when_it_ends(
    env: Env, how: str
) -> None:
    """A task class's own before_start failing after the acquire (an error, Ignore or Reject:
    the body wrapper never runs) still leaves the key free when the run ends, long before
    the TTL: through after_return (error) or the task_postrun receiver (Ignore, Reject)."""
    app = env.app()
    done = threading.Event()

    @app.task(
        base=_FailsAfterAcquire, shared=False, lock_key="net:<how>", lock_ttl=60, test_env=env
    )
    def guarded(how: str) -> None:
        env.push("ran", how)

    def on_postrun(sender: Any = None, **_: Any) -> None:
        if sender is not None and sender.name == guarded.name:
            done.set()

    signals.task_postrun.connect(on_postrun, weak=False)
    try:
        with worker(app):
            guarded.apply_async((how,))
            assert done.wait(10)
            # after the receivers of this run, at most a few ms: never the 60 s TTL
            assert wait_for(lambda: env.held_keys() == [], timeout=5)
    finally:
        signals.task_postrun.disconnect(on_postrun)
    assert env.items("acquired") == [[how, [f"redlock:{{net:{how}}}"]]]
    assert env.items("ran") == []


@pytest.mark.parametrize("then", ["given-back", "taken-by-another"])
def test_a_run_waiting_on_its_own_task_id_runs_once_and_is_never_dropped(
    env: Env, logs: pytest.LogCaptureFixture, then: str
) -> None:
    """A run finds its lock held under its own task id and attempt, never renewed: what an
    acquire whose reply was lost leaves behind. It waits for that lease, and is never
    dropped as a copy of a running delivery, since none runs:

    * ``given-back``: the holder is released before its lease ends (the lost acquire's
      background give-back): the waiting run takes the lock and runs;
    * ``taken-by-another``: the key goes without a wake-up (a server restarted without
      persistence) and another task holds the lock when the wait ends: the contended
      strategy applies (a retry), and the task runs once that holder is done.
    """
    app = env.app()

    @app.task(
        base=LockedTask,
        shared=False,
        lock_key="ghost",
        lock_retry_backoff=0.05,
        lock_retry_backoff_max=0.2,
    )
    def job() -> str:
        env.push("ran", 1)
        return "ran"

    task_id = str(uuid.uuid4())
    ghost = CoreLock(
        env.locks, "ghost", 1.5, auto_renew=False, owner_info={"task_id": task_id, "retries": 0}
    )
    assert ghost.acquire(blocking=False)
    other = CoreLock(env.locks, "ghost", 2.0, auto_renew=False, owner_info={"task_id": "other"})
    with worker(app):
        result = job.apply_async(task_id=task_id)
        assert wait_for(lambda: any("another delivery" in m for m in messages(logs)), 10)
        if then == "given-back":
            ghost.release()
        else:
            env.locks.delete("redlock:{ghost}")
            assert other.acquire(blocking=False)
            try:
                assert wait_for(lambda: any("lock retry" in m for m in messages(logs)), 10)
            finally:
                other.release()
        assert result.get(timeout=15) == "ran"
    assert env.items("ran") == [1]
    assert not any("dropped" in m for m in messages(logs))


def test_after_return_alone_frees_a_lock_whose_body_never_started(env: Env) -> None:
    """With the task_postrun receiver disconnected, LockedTask.after_return is what frees the
    key when the class's own before_start raises after the acquire."""
    app = env.app()

    @app.task(base=_FailsAfterAcquire, shared=False, lock_key="ar:<how>", lock_ttl=60, test_env=env)
    def guarded(how: str) -> None:
        env.push("ran", how)

    # Make the task class now: its own before_start connects the receiver, which
    # postrun_net_off() must find connected to take it away.
    guarded._get_current_object()
    with postrun_net_off(), worker(app):
        assert run_module.on_postrun not in [r for _, r in signals.task_postrun.receivers]
        result = guarded.apply_async(("error",))
        assert isinstance(result.get(timeout=10, propagate=False), ValueError)
        assert wait_for(lambda: env.held_keys() == [], timeout=5)
    assert env.items("acquired") == [["error", ["redlock:{ar:error}"]]]
    assert env.items("ran") == []


def test_a_locked_run_leaves_nothing_to_the_cyclic_garbage_collector(env: Env) -> None:
    """A run's lock, its LockLost watch and their state are freed by reference counting when
    the run ends. A lock <-> watch cycle left 6 objects per run for the cyclic collector,
    and the collections they triggered cost every task."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="gc:<n>")
    def work(n: int) -> int:
        return n

    assert work.apply((0,)).get() == 0  # warm-up: client, plan and renewal thread exist now
    ours = (CoreLock, LockKeys, Watch)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage
    try:
        for n in range(1, 21):
            assert work.apply((n,)).get() == n
        gc.collect()
        left = sorted({type(o).__name__ for o in gc.garbage if isinstance(o, ours)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
    assert env.held_keys() == []


def test_direct_call_and_apply_lock_and_release(env: Env) -> None:
    """task(...) and task.apply() hold the lock while the body runs and release it after."""
    app = env.app()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="direct:<n>")
    def direct(self: Any, n: int, fail: bool = False) -> list[str]:
        keys = env.held_keys()
        if fail:
            raise ValueError(keys)
        assert self.lock is not None and self.lock.owned()
        return keys

    assert direct(1) == ["redlock:{direct:1}"]
    assert env.held_keys() == []
    with pytest.raises(ValueError, match="direct:2"):
        direct(2, fail=True)
    assert env.held_keys() == []
    assert direct.apply((3,)).get() == ["redlock:{direct:3}"]
    assert env.held_keys() == []
    result = direct.apply((4,), {"fail": True})
    assert result.state == "FAILURE"
    assert "direct:4" in str(result.result)
    assert env.held_keys() == []


def test_a_run_without_lock_limits_sends_its_own_acquire_script_alone(env: Env) -> None:
    """A run of a task with no lock_limits takes its lock with acquire.lua alone (which
    reads its name's operator controls itself), never hold_all.lua: from an empty script
    cache, the scripts the server holds after the run are its acquire's and release's."""
    app = env.app()

    @app.task(base=LockedTask, shared=False, lock_key="hot:<n>")
    def hot(n: int) -> int:
        return n

    admin = env.server.client()

    def loaded(script: Script) -> bool:
        return any(admin.script_exists(script.sha, script.indexed.sha))

    try:
        admin.script_flush()
        with worker(app):
            assert hot.delay(1).get(timeout=10) == 1
        assert (loaded(ACQUIRE), loaded(RELEASE), loaded(HOLD_ALL)) == (True, True, False)
    finally:
        admin.close()


def test_a_task_nested_in_a_body_gets_its_own_request_and_lock(env: Env) -> None:
    """A task run eagerly or called directly inside another's body gets its own request
    and lock; the outer run keeps its own, and every lock is released at the end (also for
    a class with its own before_start)."""
    app = env.app()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="inner:<n>")
    def inner(self: Any, n: int) -> list[Any]:
        return [self.request.id, env.held_keys()]

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="outer:<n>")
    def outer(self: Any, n: int) -> list[Any]:
        nested_eager = inner.apply((n,), task_id=f"eager-{n}").get()
        nested_direct = inner(n + 100)
        return [self.request.id, nested_eager, nested_direct, env.held_keys(), self.lock.name]

    class OwnBeforeStart(LockedTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            super().before_start(task_id, args, kwargs)
            env.push("own", [task_id, env.held_keys()])

    @app.task(base=OwnBeforeStart, bind=True, shared=False, lock_key="own:<n>")
    def own(self: Any, n: int) -> list[Any]:
        return [self.request.id, self.lock.name]

    got = outer.apply((1,), task_id="outer-1").get()
    assert got[0] == "outer-1"
    assert got[1] == ["eager-1", ["redlock:{inner:1}", "redlock:{outer:1}"]]
    assert got[2][0] != "outer-1"  # the direct call's own request, not the outer one's
    assert got[2][1] == ["redlock:{inner:101}", "redlock:{outer:1}"]
    assert got[3] == ["redlock:{outer:1}"]
    assert got[4] == "outer:1"
    assert env.held_keys() == []

    assert own.apply((2,), task_id="own-2").get() == ["own-2", "own:2"]
    assert env.items("own") == [["own-2", ["redlock:{own:2}"]]]
    assert env.held_keys() == []


# ------------------------------------------------------------ 9.-11. while the body runs
def test_task_running_three_times_its_ttl_keeps_its_lock(
    env: Env, logs: pytest.LogCaptureFixture
) -> None:
    """lock_ttl=1, body runs 3 s: the key stays with one token and fence all along, never lost."""
    app = env.app()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="long", lock_ttl=1)
    def long(self: Any) -> dict[str, Any]:
        env.push("fence", self.lock.fence)
        time.sleep(3.0)
        outcome = {"lost": self.lock.lost, "owned": self.lock.owned(), "fence": self.lock.fence}
        env.push("done", 1)  # the release follows at once, before the result is stored
        return outcome

    with worker(app):
        result = long.delay()
        wait_for(lambda: env.items("fence"))
        seen: set[tuple[str, str]] = set()
        ttls: list[int] = []
        give_up = time.monotonic() + 10
        while not env.items("done") and time.monotonic() < give_up:
            token, fence = env.locks.hmget("redlock:{long}", ["token", "fence"])
            ttl = env.locks.pttl("redlock:{long}")
            if env.items("done"):
                break  # the body is over: the release may have come between the two reads
            assert token is not None, "the lock key vanished while the task ran"
            seen.add((token, fence))
            ttls.append(ttl)
            time.sleep(0.1)
        outcome = result.get(timeout=10)
    assert len(ttls) >= 20
    assert len(seen) == 1
    assert int(next(iter(seen))[1]) == env.items("fence")[0] == outcome["fence"]
    assert all(0 < t <= 1000 for t in ttls)
    assert outcome["lost"] is False and outcome["owned"] is True
    assert not [m for m in messages(logs, logging.WARNING) if "lost" in m.lower()]


def test_release_racing_a_renewal_round_is_not_reported_lost(
    env: Env, logs: pytest.LogCaptureFixture
) -> None:
    """A renewal round that answers "key gone" after our own release does not mark it lost."""
    lost: list[Any] = []

    class RacingBackend(RedisBackend):
        lock: Any = None

        def release(self, slot: Slot, token: str, notice_ms: int) -> Status:
            status = super().release(slot, token, notice_ms)
            # The answer of a round that took its targets before release() started: the
            # key is gone now, because we just deleted it ourselves.
            self.lock.renewed(time.monotonic(), token, Status.GONE)
            return status

    backend = RacingBackend(env.locks)
    lock = Lock(backend, "race", ttl=5, on_lost=lost.append)
    backend.lock = lock
    assert lock.acquire(blocking=False)
    lock.release()
    assert lost == []
    assert not lock.lost
    assert not [m for m in messages(logs, logging.WARNING) if "LOST" in m]


def _victim(app: Celery, env: Env, policy: str, ttl: float) -> Any:
    """A task that sleeps in small steps and records when LockLost reached it."""

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        lock_key="victim",
        lock_ttl=ttl,
        lock_on_lost=policy,
    )
    def victim(self: Any, steps: int = 120, step: float = 0.025) -> dict[str, Any]:
        env.push(
            "started",
            {
                "thread": threading.current_thread().name,
                # which interrupt path this run uses: a signal (main thread) or an async exception
                "signal": watch_of(self.lock).use_signal,
            },
        )
        try:
            for _ in range(steps):
                time.sleep(step)
        except LockLost as exc:
            env.rec.set("lost_at", time.time())
            env.push("lost", {"type": type(exc).__name__, "name": exc.name, "text": str(exc)})
            raise
        return {"lost": self.lock.lost, "owned": self.lock.owned()}

    return victim


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_stolen_lock_raises_lock_lost_in_the_body(
    env: Env, logs: pytest.LogCaptureFixture, pool: str
) -> None:
    """on_lost=raise: LockLost reaches a worker-thread body within ttl/3 (async-exception path)."""
    ttl = 1.2
    app = env.app()
    victim = _victim(app, env, "raise", ttl)
    with worker(app, pool=pool, concurrency=1):
        result = victim.delay()
        started = wait_for(lambda: env.items("started"))[0]
        time.sleep(0.1)
        stolen_at = time.time()
        assert env.locks.delete("redlock:{victim}") == 1
        exc = result.get(timeout=10, propagate=False)
    # start_worker runs the worker in a background thread; solo runs the body in that thread,
    # threads in a pool thread: either way not the main thread, so the PyThreadState_SetAsyncExc
    # path (an exception at the body's next bytecode, hence the short sleep steps).
    assert started["thread"] != "MainThread" and started["signal"] is False
    assert result.state == "FAILURE"
    assert type(exc).__name__ == "LockLost"
    assert "victim" in str(exc)
    assert isinstance(exc, LockLost) and exc.name == "victim"
    # What the body itself caught names the lock too (the async-exception path).
    seen = wait_for(lambda: env.items("lost"), timeout=1)[0]
    assert seen["type"] == "LockLostInterrupt" and seen["name"] == "victim", seen
    assert seen["text"].startswith("lock 'victim': lost while the task ran ("), seen
    lost_at = float(wait_for(lambda: env.rec.get("lost_at"), timeout=1))
    assert 0 < lost_at - stolen_at < ttl / 3 + 0.5, lost_at - stolen_at
    lost = [m for m in messages(logs, logging.WARNING) if "'victim'" in m]
    assert len(lost) == 1 and f"of task {victim.name}[{result.id}] LOST" in lost[0], lost


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_stolen_lock_with_warn_lets_the_body_finish_flagged(
    env: Env, logs: pytest.LogCaptureFixture, pool: str
) -> None:
    """on_lost=warn: the body finishes, self.lock.lost is True inside it, the loss is logged."""
    app = env.app()
    victim = _victim(app, env, "warn", 1.2)
    with worker(app, pool=pool, concurrency=1):
        result = victim.delay(steps=60)  # 1.5 s
        started = wait_for(lambda: env.items("started"))[0]
        time.sleep(0.1)
        assert env.locks.delete("redlock:{victim}") == 1
        outcome = result.get(timeout=10)
    assert started["thread"] != "MainThread" and started["signal"] is False
    assert result.state == "SUCCESS"
    assert outcome == {"lost": True, "owned": False}
    assert env.rec.get("lost_at") is None
    lost = [m for m in messages(logs, logging.WARNING) if "'victim'" in m]
    assert len(lost) == 1 and f"of task {victim.name}[{result.id}] LOST" in lost[0], lost


@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_every_loss_line_names_the_rendered_lock(
    env: Env, logs: pytest.LogCaptureFixture, policy: str
) -> None:
    """The one line that reports a loss names the lock by its rendered name, the task and
    its id, and so do the errors the body and caller see."""
    app = env.app()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="sync:<user_id>",
              lock_ttl=0.9, lock_on_lost=policy)  # fmt: skip
    def sync(self: Any, user_id: int) -> bool:
        env.push("started", 1)
        try:
            for _ in range(60):  # 1.5 s in small steps: the async exception lands between them
                time.sleep(0.025)
        except LockLost as exc:
            copy = pickle.loads(pickle.dumps(exc))  # as a result backend stores it
            env.push("caught", [str(exc), type(copy) is LockLostInterrupt and str(copy)])
            raise
        return bool(self.lock.lost)

    with worker(app, pool="threads", concurrency=1):
        result = sync.delay(42)
        wait_for(lambda: env.items("started"))
        assert env.locks.delete("redlock:{sync:42}") == 1
        outcome = result.get(timeout=10, propagate=False)
    lines = [m for m in messages(logs, logging.WARNING) if "lost" in m.lower()]
    # The renewal's "LOST", and nothing more: the watch and the release say it at DEBUG.
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"lock 'sync:42' of task {sync.name}[{result.id}] LOST after ")
    if policy == "raise":
        caught, copied = env.items("caught")[0]
        assert caught.startswith("lock 'sync:42': lost while the task ran ("), caught
        assert copied == caught
        assert isinstance(outcome, LockLost) and str(outcome).startswith("lock 'sync:42': ")
    else:
        assert outcome is True  # the body ran on, flagged


def test_stolen_lock_interrupts_a_main_thread_body_by_signal(env: Env) -> None:
    """A direct call in the main thread gets LockLost even inside one long sleep (signal path)."""
    app = env.app()
    victim = _victim(app, env, "raise", 1.2)
    stealer = threading.Timer(0.3, lambda: env.locks.delete("redlock:{victim}"))
    begin = time.monotonic()
    stealer.start()
    try:
        with pytest.raises(LockLost, match="victim"):
            victim(steps=1, step=5.0)  # one 5 s sleep: only a signal can cut it short
    finally:
        stealer.cancel()
        stealer.join()
    assert time.monotonic() - begin < 0.3 + 1.2 / 3 + 0.5
    assert env.rec.get("lost_at") is not None
    # What the body itself caught names the lock too (the signal path).
    seen = env.items("lost")[0]
    assert seen["type"] == "LockLostInterrupt" and seen["name"] == "victim", seen
    assert seen["text"].startswith("lock 'victim': lost while the task ran ("), seen
    assert env.items("started")[0] == {"thread": "MainThread", "signal": True}
    assert env.held_keys() == []


def test_lost_lock_interrupt_never_lands_after_the_body_returned(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LockLost interrupt sent just as the body returns never surfaces after run_locked."""
    app = env.app()
    body_done = threading.Event()
    real = ctypes.pythonapi.PyThreadState_SetAsyncExc

    def late_send(thread: Any, exc: Any) -> int:
        # The renewal thread decided to interrupt while the body still ran; this send is
        # held back until the body has returned: the race, made certain.
        if exc is not None:
            body_done.wait(1.0)
        return int(real(thread, exc))

    monkeypatch.setattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", late_send)

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="late", lock_ttl=0.6)
    def late(self: Any) -> str:
        env.locks.delete("redlock:{late}")
        wait_for(lambda: self.lock.lost, timeout=3)  # the renewal thread saw the loss
        return "returned"

    outcome: list[str] = []

    def caller() -> None:
        try:
            outcome.append(late())
        except LockLost:
            outcome.append("LockLost in the call")
        body_done.set()
        try:
            for _ in range(50):  # plain code after the task call: nothing may land here
                time.sleep(0.01)
            outcome.append("clean")
        except LockLost:
            outcome.append("LockLost AFTER the call returned")

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert outcome[-1] == "clean", outcome
    assert env.held_keys() == []


def test_fence_strictly_increases_across_runs_and_lock_is_owned(env: Env) -> None:
    """self.lock.fence is an int, strictly increasing per key across runs; owned() is True."""
    app = env.app()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="fenced:<n>")
    def fenced(self: Any, n: int) -> list[Any]:
        return [self.lock.fence, self.lock.owned(), type(self.lock.fence).__name__]

    with worker(app):
        runs = [fenced.delay(1).get(timeout=10) for _ in range(4)]
        other = fenced.delay(2).get(timeout=10)
    runs.append(fenced(1))
    fences = [r[0] for r in runs]
    assert all(r[1] is True and r[2] == "int" for r in [*runs, other])
    assert all(a < b for a, b in itertools.pairwise(fences)), fences
    assert int(env.locks.get("redlock:{fenced:1}:fence")) == fences[-1]
    # redlock_fence_ttl unset: the default lifetime of one hour
    assert 0 < env.locks.pttl("redlock:{fenced:1}:fence") <= 3_600_000


def test_redlock_fence_ttl_gives_task_fence_counters_a_ttl(env: Env) -> None:
    """redlock_fence_ttl=60: a task's fence counter expires when unused; fences still rise."""
    app = env.app(redlock_fence_ttl=60)

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="ft:<n>")
    def timed(self: Any, n: int) -> Any:
        return self.lock.fence

    with worker(app):
        first = timed.delay(1).get(timeout=10)
        second = timed.delay(1).get(timeout=10)
    assert second == first + 1
    assert 0 < env.locks.pttl("redlock:{ft:1}:fence") <= 60_000
    env.locks.delete("redlock:{ft:1}:fence")  # as if it had expired
    assert timed(1) > second


# ------------------------------------------------------------------ 12. Redis down
def _counting(app: Celery, env: Env, name: str = "inproc.counted", **options: Any) -> Any:
    @app.task(base=LockedTask, bind=True, shared=False, name=name, lock_key="down:<n>", **options)
    def counted(self: Any, n: int) -> str:
        env.rec.incr("runs")
        return "ran"

    return counted


@pytest.mark.parametrize("outage", ["stopped", "blackholed"])
def test_redis_down_retries_then_fails_without_running(
    env: Env,
    logs: pytest.LogCaptureFixture,
    redis_server: RedisServer,
    fault_proxy: Callable[[RedisServer], Any],
    outage: str,
) -> None:
    """Lock Redis down: body never runs; RETRY, then FAILURE(StoreUnavailable); no tracebacks."""
    logs.set_level(logging.INFO, logger="celery.app.trace")
    if outage == "stopped":
        url = f"redis://127.0.0.1:{redis_server.port}/1"
        redis_server.stop()
    else:
        proxy = fault_proxy(redis_server)
        proxy.blackhole()
        url = f"redis://127.0.0.1:{proxy.port}/1"
    app = env.app(
        lock_url=url,
        redlock_client_options={"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
    )
    counted = _counting(
        app, env, lock_max_retries=1, lock_retry_backoff=0.5, lock_retry_jitter=False
    )
    with worker(app):
        result = counted.delay(1)
        wait_for(lambda: result.state == "RETRY", timeout=10, interval=0.005)
        exc = result.get(timeout=15, propagate=False)
    assert result.state == "FAILURE"
    assert isinstance(exc, StoreUnavailable)
    assert exc.name == "down:1"
    assert env.rec.get("runs") is None
    ours = [r for r in logs.records if r.name.startswith(LOGGER) and r.levelno >= logging.WARNING]
    assert all(r.exc_info is None for r in ours), [r.getMessage() for r in ours]
    warnings = [r.getMessage() for r in ours if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # the first run: re-queued, one line
    assert all("not started" in m and result.id in m and "down:1" in m for m in warnings)
    assert "unavailable" in warnings[0] and "(lock retry 1/1 in" in warnings[0]
    errors = [r.getMessage() for r in ours if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors  # worker start-up, and its retry's give-up (one line)
    assert "unreachable" in errors[0]
    assert "gave up after 1 lock retries" in errors[1] and result.id in errors[1]
    failed = celery_failure_records(logs, result.id)
    assert failed and all(r.levelno < logging.ERROR and r.exc_info is None for r in failed)


def test_redis_down_with_fail_open_runs_unlocked_and_warns(
    env: Env, logs: pytest.LogCaptureFixture, redis_server: RedisServer
) -> None:
    """redlock_fail_open=True: with the lock Redis down the body runs unlocked, with a warning."""
    url = f"redis://127.0.0.1:{redis_server.port}/1"
    redis_server.stop()
    app = env.app(
        lock_url=url,
        redlock_fail_open=True,
        redlock_client_options={"socket_timeout": 0.3, "socket_connect_timeout": 0.3},
    )
    counted = _counting(app, env)
    with worker(app):
        result = counted.delay(1)
        assert result.get(timeout=10) == "ran"
    assert env.rec.get("runs") == "1"
    assert any("UNLOCKED" in m and result.id in m for m in messages(logs, logging.WARNING))


# ------------------------------------------------------------- 13.-15. apps and settings
def test_two_apps_keep_their_own_settings_and_clients(
    env: Env, redis_servers: Callable[[int], list[RedisServer]]
) -> None:
    """Two apps in one process lock on their own servers with their own TTLs."""
    first, second = redis_servers(2)
    apps = [
        env.app(lock_url=f"{first.url[:-2]}/1", redlock_ttl=5),
        env.app(lock_url=f"{second.url[:-2]}/1", redlock_ttl=7),
    ]
    stores = [first.client(db=1, decode_responses=True), second.client(db=1, decode_responses=True)]
    tasks = []
    for app in apps:

        @app.task(base=LockedTask, bind=True, shared=False, lock_key="same")
        def where(self: Any) -> list[Any]:
            return [
                self.lock.ttl,
                [s.exists("redlock:{same}") for s in stores],
                [s.pttl("redlock:{same}") for s in stores],
            ]

        tasks.append(where)
    try:
        seen = []
        for app, task in zip(apps, tasks, strict=True):
            with worker(app):
                seen.append(task.delay().get(timeout=10))
        seen.extend([tasks[0](), tasks[1](), tasks[0]()])  # interleaved in one process
    finally:
        for s in stores:
            s.close()
    for (ttl, exists, pttl), home in zip(seen, [0, 1, 0, 1, 0], strict=True):
        assert ttl == [5.0, 7.0][home]
        assert exists == [int(i == home) for i in range(2)]
        assert [5000, 7000][home] - 1000 < pttl[home] <= [5000, 7000][home]
    assert state_for(apps[0]).clients() is not state_for(apps[1]).clients()
    assert state_for(apps[0]).settings.ttl == 5.0
    assert state_for(apps[1]).settings.ttl == 7.0


def test_a_forked_child_makes_its_own_lock_clients_and_takes_locks(env: Env) -> None:
    """After os.fork() the child does not use its parent's Redis clients (their sockets are
    the parent's): it builds its own from the same settings and locks with them."""
    app = env.app()

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="fork:<n>")
    def forked(self: Any, n: int) -> list[str]:
        return env.held_keys()

    assert forked(0) == ["redlock:{fork:0}"]  # the parent's clients exist now
    parent_clients = state_for(app).clients()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running pytest's exit code
        code = 1
        try:
            own = state_for(app).clients() is not parent_clients
            os.write(write_end, json.dumps([own, forked(1)]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as report:
            got = json.loads(report.read() or b"null")
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert got == [True, ["redlock:{fork:1}"]]
    assert state_for(app).clients() is parent_clients  # the parent's are untouched
    assert env.held_keys() == []


def test_task_options_are_resolved_once_per_settings_load(env: Env) -> None:
    """A task's lock options and its app's defaults are resolved on its first run and kept
    while the settings are (one resolution per class, not per run); after reset() (what
    changing settings in a test needs) the next run sees the new defaults."""
    app = env.app(redlock_ttl=5)

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="plan:<n>")
    def ttl_of(self: Any, n: int) -> float:
        assert self.lock is not None
        return self.lock.ttl

    state = state_for(app)
    assert ttl_of(1) == 5.0
    [plan] = state.task_options.values()
    assert ttl_of(2) == 5.0 and list(state.task_options.values()) == [plan]
    app.conf.redlock_ttl = 9
    state.reset()
    assert ttl_of(3) == 9.0
    [new_plan] = state.task_options.values()
    assert new_plan is not plan and new_plan.ttl == 9.0
    assert env.held_keys() == []  # every run released its lock


def test_eager_mode_keeps_lock_semantics(env: Env) -> None:
    """task_always_eager: a held lock still makes .delay() skip (skip) or fail (retry -> wait)."""
    app = env.app(task_always_eager=True)
    skipper = _counting(app, env, lock_on_contended="skip")
    retrier = _counting(
        app, env, "inproc.retrier", lock_on_contended="retry", lock_wait_timeout=0.3
    )
    outside = Lock(env.locks, "down:1", ttl=10, owner_info={"task_id": "outside"})
    assert outside.acquire(blocking=False)
    try:
        result = skipper.delay(1).get()
        assert is_skipped(result)
        assert result["holder"]["task_id"] == "outside"
        begin = time.monotonic()
        with pytest.raises(LockContended, match="down:1") as info:
            retrier.delay(1).get()
        assert info.value.holder["task_id"] == "outside"
        assert time.monotonic() - begin >= 0.3
    finally:
        outside.release()
    assert env.rec.get("runs") is None
    assert skipper.delay(1).get() == "ran"
    assert env.rec.get("runs") == "1"


def test_eager_self_retry_and_per_call_key(env: Env) -> None:
    """Eager: self.retry() re-runs and succeeds; apply_async(lock_key=...) picks the key."""
    app = env.app(task_always_eager=True)

    @app.task(base=LockedTask, bind=True, shared=False, lock_key="e:<n>", max_retries=2)
    def eager(self: Any, n: int) -> list[Any]:
        env.push("eager", [self.request.retries, env.held_keys()])
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return env.held_keys()

    assert eager.delay(1).get() == ["redlock:{e:1}"]
    assert env.items("eager") == [[0, ["redlock:{e:1}"]], [1, ["redlock:{e:1}"]]]
    assert eager.apply_async((2,), lock_key="per-call").get() == ["redlock:{per-call}"]
    assert env.held_keys() == []


def test_redlock_disable_runs_unlocked(env: Env, logs: pytest.LogCaptureFixture) -> None:
    """redlock_disable=True: the worker warns loudly and tasks run while the lock is held."""
    app = env.app(redlock_disable=True)

    @app.task(
        base=LockedTask, bind=True, shared=False, lock_key="down:<n>", lock_on_contended="raise"
    )
    def unlocked(self: Any, n: int) -> bool:
        env.rec.incr("runs")
        return self.lock is None

    outside = Lock(env.locks, "down:1", ttl=10)
    assert outside.acquire(blocking=False)
    try:
        with worker(app):
            assert unlocked.delay(1).get(timeout=10) is True
        assert unlocked(1) is True
    finally:
        outside.release()
    assert env.rec.get("runs") == "2"
    assert any("DISABLED" in m for m in messages(logs, logging.WARNING))


def test_settings_typo_and_wrong_type_are_config_errors(env: Env) -> None:
    """An unknown redlock_* setting gets a did-you-mean; a wrong type names the setting."""
    app = env.app(
        redlock_ttll=5, redlock_max_retries="3", redlock_on_lost="never", redlock_fence_ttl=0
    )
    with pytest.raises(ConfigError) as info:
        state_for(app).settings  # noqa: B018 - loading is the check
    message = str(info.value)
    assert "unknown setting 'redlock_ttll' (did you mean 'redlock_ttl'?)" in message
    assert "redlock_max_retries='3' must be a whole number" in message
    assert "redlock_on_lost='never' must be one of 'raise', 'warn'" in message
    assert "redlock_fence_ttl=0 must be > 0" in message


def test_bad_setting_stops_the_worker_at_start(env: Env) -> None:
    """A bad redlock_* setting raises ConfigError when the worker starts, before any task runs."""
    app = env.app(redlock_ttl="thirty")

    @app.task(base=LockedTask, shared=False)
    def anything() -> None:
        raise AssertionError("never runs")

    with (
        pytest.raises(ConfigError, match=r"redlock_ttl='thirty' must be a number"),
        worker(app),
    ):
        raise AssertionError("the worker started")
