"""docs/migrating.md: each documented mapping from celery-once and celery-singleton, run
next to the original library with the same calls (publish side, no worker unless the
mapping is about the run).

Each case names the option line the page documents; the test fails if the page no
longer says it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from servers import RedisServer, wait_for
from test_task_inprocess import Env, forget_results, worker

from celery_redlock import AlreadyQueued, LockedTask

celery_once = pytest.importorskip("celery_once")
celery_singleton = pytest.importorskip("celery_singleton")
from celery_singleton.exceptions import DuplicateTaskError  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"


@pytest.fixture
def env(shared_redis: RedisServer, redis_client: redis.Redis) -> Iterator[Env]:
    """The shared throwaway server, flushed; apps closed after."""
    e = Env(shared_redis)
    try:
        yield e
    finally:
        gc.collect()
        for app in e.apps:
            forget_results(app)
            app.close()
        e.locks.close()
        e.rec.close()


def _app(env: Env) -> Celery:
    app = env.app()
    # both libraries keep one client per process for the first URL they see: the
    # session's shared server, db 4, is the only one they are ever given here
    url = f"{env.base}/4"
    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": url, "default_timeout": 3600},
    }
    app.conf.singleton_backend_url = url
    return app


@dataclass(frozen=True)
class Mapping:
    """One documented row: their task options, ours, and the line the page shows."""

    theirs: dict[str, Any]
    ours: dict[str, Any]
    documented: str


ONCE = {
    "default": Mapping(
        {},
        {"lock_on": "enqueue+run", "lock_on_duplicate": "raise", "lock_key": "once:<user_id>"},
        '`base=LockedTask, lock_on="enqueue+run", lock_on_duplicate="raise"`',
    ),
    "graceful": Mapping(
        {"once": {"graceful": True}},
        {"lock_on": "enqueue+run", "lock_on_duplicate": "return", "lock_key": "once:<user_id>"},
        '`lock_on_duplicate="return"` (the default)',
    ),
    "keys": Mapping(
        {"once": {"keys": ["user_id"], "graceful": True}},
        {"lock_on": "enqueue+run", "lock_key": "proj.sync:<user_id>"},
        '`lock_key="proj.sync:<user_id>"`',
    ),
    "timeout": Mapping(
        {"once": {"timeout": 600, "graceful": True}},
        {"lock_on": "enqueue+run", "lock_key": "once:<user_id>", "lock_enqueue_ttl": 600},
        "`lock_enqueue_ttl=600`",
    ),
    "unlock_before_run": Mapping(
        {"once": {"unlock_before_run": True, "graceful": True}},
        {"lock_on": "enqueue", "lock_key": "once:<user_id>"},
        '| `once={"unlock_before_run": True}` | `lock_on="enqueue"` |',
    ),
}

SINGLETON = {
    "default": Mapping(
        {},
        {"lock_on": "enqueue+run", "lock_key": "single:<user_id>:<full>"},
        '`base=LockedTask, lock_on="enqueue+run"` (`lock_on_duplicate="return"` is the default)',
    ),
    "unique_on": Mapping(
        {"unique_on": ["user_id"]},
        {"lock_on": "enqueue+run", "lock_key": "proj.sync:<user_id>"},
        '| `unique_on=["user_id"]` | `lock_key="proj.sync:<user_id>"` |',
    ),
    "raise_on_duplicate": Mapping(
        {"raise_on_duplicate": True},
        {"lock_on": "enqueue+run", "lock_key": "single:<user_id>", "lock_on_duplicate": "raise"},
        '`lock_on_duplicate="raise"` (`AlreadyQueued` with `task_id`, `ttl`, `state`)',
    ),
    "lock_expiry": Mapping(
        {"lock_expiry": 600, "unique_on": ["user_id"]},
        {"lock_on": "enqueue+run", "lock_key": "single:<user_id>", "lock_enqueue_ttl": 600},
        "`lock_enqueue_ttl=600` (default 3600 s",
    ),
}


def _tasks(
    env: Env, base: type, mapping: Mapping
) -> tuple[Celery, Callable[..., Any], Callable[..., Any]]:
    """(app, their task, our task) with the mapping's options; bodies record each run."""
    app = _app(env)

    @app.task(base=base, shared=False, name="mig.theirs", **mapping.theirs)
    def theirs(user_id: int, full: bool = False) -> int:
        env.push("theirs", user_id)
        return user_id

    @app.task(base=LockedTask, shared=False, name="mig.ours", **mapping.ours)
    def ours(user_id: int, full: bool = False) -> int:
        env.push("ours", user_id)
        env.hold_until(f"go:{user_id}")
        return user_id

    return app, theirs, ours


def _their_ttl(env: Env) -> int:
    """The longest TTL (s) among the keys the original library wrote (db 4)."""
    theirs = env.server.client(db=4)
    return max(int(theirs.ttl(key)) for key in theirs.scan_iter())


def test_every_mapping_is_on_the_page() -> None:
    """The page states each mapping this module runs."""
    page = DOC.read_text()
    for mapping in [*ONCE.values(), *SINGLETON.values()]:
        assert mapping.documented in page, mapping.documented


@pytest.mark.parametrize("case", ["default", "graceful", "keys", "timeout"])
def test_celery_once_mapping_refuses_the_same_calls(env: Env, case: str) -> None:
    """QueueOnce and its mapping refuse the same second calls; ours returns the queued
    task's result where celery-once's graceful returns a REJECTED placeholder, and raises
    AlreadyQueued with the holder's task id where it raises its own AlreadyQueued."""
    mapping = ONCE[case]
    _, theirs, ours = _tasks(env, celery_once.QueueOnce, mapping)
    first_theirs, first_ours = theirs.delay(1), ours.delay(1)
    other = 2 if case != "keys" else 1  # keys: a call differing only in `full` is a duplicate
    call = {"full": True} if case == "keys" else {}
    if case == "default":
        with pytest.raises(celery_once.AlreadyQueued):
            theirs.delay(1)
        with pytest.raises(AlreadyQueued) as info:
            ours.delay(1)
        assert info.value.task_id == first_ours.id
        return
    dup_theirs, dup_ours = theirs.delay(other, **call), ours.delay(other, **call)
    if case == "keys":
        assert dup_theirs.state == "REJECTED" and dup_theirs.id is None
        assert dup_ours.id == first_ours.id
    else:  # a different user is no duplicate in either
        assert dup_theirs.id not in (None, first_theirs.id)
        assert dup_ours.id != first_ours.id
        assert theirs.delay(1).state == "REJECTED"
        assert ours.delay(1).id == first_ours.id
    if case == "timeout":
        their_ttl = _their_ttl(env)
        assert 590 <= their_ttl <= 600
        assert 590_000 <= env.locks.pttl("redlock:{once:1}:queued") <= 600_000


def test_celery_once_unlock_before_run_maps_to_enqueue(env: Env) -> None:
    """unlock_before_run / lock_on="enqueue": once the first call runs, the next one is
    queued (not refused); ours still keeps the two runs apart."""
    _, _, ours = _tasks(env, celery_once.QueueOnce, ONCE["unlock_before_run"])
    with worker(ours.app, concurrency=2):
        first = ours.delay(1)
        wait_for(lambda: env.items("ours") == [1])
        second = ours.delay(1)
        assert second.id != first.id
        assert ours.delay(1).id == second.id  # and that one is queued once
        env.rec.set("go:1", 1)
        assert second.get(timeout=15) == 1 and first.get(timeout=15) == 1
    assert env.items("ours") == [1, 1]


@pytest.mark.parametrize("case", ["default", "unique_on", "raise_on_duplicate", "lock_expiry"])
def test_celery_singleton_mapping_refuses_the_same_calls(env: Env, case: str) -> None:
    """Singleton and its mapping refuse the same second calls: both return the existing
    task's AsyncResult, or both raise with its task id."""
    mapping = SINGLETON[case]
    _, theirs, ours = _tasks(env, celery_singleton.Singleton, mapping)
    first_theirs, first_ours = theirs.delay(1), ours.delay(1)
    call = {"full": True} if case == "unique_on" else {}
    if case == "raise_on_duplicate":
        with pytest.raises(DuplicateTaskError) as their_error:
            theirs.delay(1)
        with pytest.raises(AlreadyQueued) as our_error:
            ours.delay(1)
        assert their_error.value.task_id == first_theirs.id
        assert our_error.value.task_id == first_ours.id
        return
    assert theirs.delay(1, **call).id == first_theirs.id
    assert ours.delay(1, **call).id == first_ours.id
    assert theirs.delay(2).id != first_theirs.id
    assert ours.delay(2).id != first_ours.id
    if case == "default":  # all arguments count in both
        assert theirs.delay(1, full=True).id != first_theirs.id
        assert ours.delay(1, full=True).id != first_ours.id
    if case == "lock_expiry":
        their_ttl = _their_ttl(env)
        assert 590 <= their_ttl <= 600
        assert 590_000 <= env.locks.pttl("redlock:{single:1}:queued") <= 600_000
