"""docs/migrating.md as printed: each mapping from celery-once and celery-singleton, run
next to the original library with the same calls (publish side, no worker unless the
mapping is about the run).

The options are read from the page: the first code span of each cell of a mapping table
is evaluated as the keyword arguments of ``@app.task(...)`` (theirs on the left, ours on
the right), the settings rows are executed, and the Python blocks are executed as
printed (``# before`` and ``# after`` in apps of their own). A row without a test here,
or a test whose row is gone, fails.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from inprocess import Env, worker
from servers import wait_for

from celery_redlock import AlreadyQueued, ConfigError, LockedTask, RedlockError
from celery_redlock.app.config import SETTINGS
from celery_redlock.app.state import state_for

celery_once = pytest.importorskip("celery_once")
celery_singleton = pytest.importorskip("celery_singleton")
from celery_singleton.exceptions import (  # noqa: E402
    CelerySingletonException,
    DuplicateTaskError,
)

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "migrating.md").read_text()
#: What the page's code may name.
NAMES = {
    "QueueOnce": celery_once.QueueOnce,
    "Singleton": celery_singleton.Singleton,
    "LockedTask": LockedTask,
}


# -- reading the page ----------------------------------------------------------------------
def _section(heading: str) -> str:
    """The text under ``## <heading>`` up to the next ``## ``."""
    return PAGE.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _table(text: str) -> list[list[str]]:
    """The cells of the first table in *text* (header and rule dropped)."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    first = text.splitlines().index(rows[0])
    table = []
    for line in text.splitlines()[first:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return table[2:]


def _spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def _mappings(heading: str) -> dict[str, dict[str, Any]]:
    """The section's mapping table: their options (the left cell's first code span, as
    printed) -> ours, each evaluated as ``@app.task`` keyword arguments."""
    found = {}
    for left, right in _table(_section(heading)):
        theirs, ours = _spans(left)[0], _spans(right)[0]
        found[theirs] = {
            "theirs": eval(f"dict({theirs})", dict(NAMES)),  # the page's code
            "ours": eval(f"dict({ours})", dict(NAMES)),
        }
    return found


def _blocks(heading: str) -> list[str]:
    """The section's Python blocks, as printed."""
    return re.findall(r"```python\n(.*?)```", _section(heading), re.S)


ONCE = _mappings("celery-once (`QueueOnce`)")
SINGLETON = _mappings("celery-singleton (`Singleton`)")

ONCE_CASES = {
    "plain": "base=QueueOnce",
    "graceful": 'base=QueueOnce, once={"graceful": True}',
    "keys": 'base=QueueOnce, once={"keys": ["user_id"]}',
    "no_keys": 'base=QueueOnce, once={"keys": []}',
    "timeout": 'base=QueueOnce, once={"timeout": 600}',
    "unlock_before_run": 'base=QueueOnce, once={"unlock_before_run": True}',
}
SINGLETON_CASES = {
    "plain": "base=Singleton",
    "unique_on": 'base=Singleton, unique_on=["user_id"]',
    "raise_on_duplicate": "base=Singleton, raise_on_duplicate=True",
    "lock_expiry": "base=Singleton, lock_expiry=600",
}


# -- fixtures and helpers ---------------------------------------------------------------------
def _url(env: Env) -> str:
    # both libraries keep one client per process for the first URL they see: the
    # session's shared server, db 4, is the only one they are ever given here
    return f"{env.base}/4"


def _app(env: Env) -> Celery:
    app = env.app()
    url = _url(env)
    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": url, "default_timeout": 3600},
    }
    app.conf.singleton_backend_url = url
    return app


def _tasks(env: Env, mapping: dict[str, Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(their task, our task) with the row's options; the bodies record each run."""
    app = _app(env)

    @app.task(shared=False, name="proj.theirs", **mapping["theirs"])
    def theirs(user_id: int, full: bool = False) -> int:
        env.push("theirs", user_id)
        return user_id

    @app.task(shared=False, name="proj.sync", **mapping["ours"])
    def ours(user_id: int, full: bool = False) -> int:
        env.push("ours", user_id)
        env.hold_until(f"go:{user_id}")
        return user_id

    return theirs, ours


def _their_ttl(env: Env) -> int:
    """The longest TTL (s) among the keys the original library wrote (db 4)."""
    theirs = env.server.client(db=4)
    return max(int(theirs.ttl(key)) for key in theirs.scan_iter())


def _run_block(env: Env, code: str) -> dict[str, Any]:
    """Execute a block of the page as module ``proj`` with its own app; its names."""
    # The block's @app.task makes its tasks on this app alone (shared=False): a shared task
    # would be added to every app finalized later in this process.
    app = SimpleNamespace(task=functools.partial(_app(env).task, shared=False))
    namespace: dict[str, Any] = {**NAMES, "app": app, "__name__": "proj"}
    namespace["AlreadyQueued"] = AlreadyQueued
    exec(compile(code, "docs/migrating.md", "exec"), namespace)  # the page's code
    return namespace


def _before_after(block: str) -> tuple[str, str]:
    before, after = block.split("# after\n", 1)
    return before.split("# before\n", 1)[1], after


# -- the page and the tests agree ---------------------------------------------------------
def test_every_row_has_a_test_and_every_test_a_row() -> None:
    """The mapping tables hold exactly the rows this module runs, and every mapping of a
    plain task (all arguments) keys ours on all arguments too."""
    assert sorted(ONCE) == sorted(ONCE_CASES.values())
    assert sorted(SINGLETON) == sorted(SINGLETON_CASES.values())
    for plain in (ONCE["base=QueueOnce"], SINGLETON["base=Singleton"]):
        assert plain["ours"]["lock_key"] == "proj.sync:<*>"


# -- settings ---------------------------------------------------------------------------------
def test_settings_rows_configure_the_same_behaviour(env: Env) -> None:
    """Each settings row, executed as printed on both sides (URL: a throwaway Redis), gives
    the same answer to a duplicate; a row that names settings names real ones."""
    rows = _table(_section("Settings"))
    assert len(rows) == 5
    url = _url(env)

    def executed(cell: str) -> Celery:
        app = env.app()
        for span in _spans(cell):
            exec(span, {"app": app, "URL": url})  # the page's code
        return app

    # ONCE -> redlock_url and redlock_lock_enqueue_ttl
    theirs_app, ours_app = executed(rows[0][0]), executed(rows[0][1])
    assert ours_app.conf.redlock_url == url
    assert state_for(ours_app).settings.enqueue_ttl == 3600
    theirs = theirs_app.task(base=celery_once.QueueOnce, shared=False, name="s.once")(_body)
    ours = ours_app.task(base=LockedTask, shared=False, name="s.ours", lock_on="enqueue+run",
                         lock_on_duplicate="raise")(_body)  # fmt: skip
    theirs.delay(1), ours.delay(1)
    with pytest.raises(celery_once.AlreadyQueued):
        theirs.delay(1)
    with pytest.raises(AlreadyQueued):
        ours.delay(1)
    assert 3590 <= env.server.client(db=4).ttl("redlock:{s.ours}:queued") <= 3600
    # singleton's names -> ours
    for name in _spans(rows[1][1]):
        assert name in SETTINGS, name
    # singleton_raise_on_duplicate -> redlock_lock_on_duplicate
    theirs_app, ours_app = executed(rows[2][0]), executed(rows[2][1])
    theirs_app.conf.singleton_backend_url = url
    ours_app.conf.redlock_url = url
    theirs = theirs_app.task(base=celery_singleton.Singleton, shared=False, name="s.single")(_body)
    ours = ours_app.task(base=LockedTask, shared=False, name="s.ours2",
                         lock_on="enqueue+run")(_body)  # fmt: skip
    theirs.delay(1), ours.delay(1)
    with pytest.raises(DuplicateTaskError):
        theirs.delay(1)
    with pytest.raises(AlreadyQueued):
        ours.delay(1)
    # redlock_lock_on makes every locked task de-duplicate at publish
    ours_app = executed(rows[3][1])
    ours_app.conf.redlock_url = url
    ours = ours_app.task(base=LockedTask, shared=False, name="s.ours3")(_body)
    assert ours.delay(1).id == ours.delay(1).id


def _body(user_id: int) -> int:
    return user_id


# -- celery-once ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["plain", "graceful", "keys", "no_keys", "timeout"])
def test_celery_once_row_refuses_the_same_calls(env: Env, case: str) -> None:
    """QueueOnce and the row's options refuse the same second calls and queue the same
    others; ours returns the queued task's result where celery-once's graceful returns a
    REJECTED placeholder, and raises its own AlreadyQueued with the holder's task id."""
    theirs, ours = _tasks(env, ONCE[ONCE_CASES[case]])
    first_theirs, first_ours = theirs.delay(1), ours.delay(1)
    same = {"keys": [((1,), {"full": True})], "no_keys": [((2,), {})]}.get(case, [])
    same += [((), {"user_id": 1})]  # a keyword is the same argument in both
    other = {"keys": [((2,), {})], "no_keys": []}.get(case, [((2,), {}), ((1,), {"full": True})])
    for args, kwargs in same:
        if case == "graceful":
            rejected = theirs.delay(*args, **kwargs)
            assert rejected.state == "REJECTED" and rejected.id is None
            assert ours.delay(*args, **kwargs).id == first_ours.id
            continue
        with pytest.raises(celery_once.AlreadyQueued):
            theirs.delay(*args, **kwargs)
        with pytest.raises(AlreadyQueued) as info:
            ours.delay(*args, **kwargs)
        assert info.value.task_id == first_ours.id
    for args, kwargs in other:  # e.g. report.delay("d1"); report.delay("d2"): both queued
        assert theirs.delay(*args, **kwargs).id not in (None, first_theirs.id)
        assert ours.delay(*args, **kwargs).id not in (None, first_ours.id)
    if case == "timeout":
        assert 590 <= _their_ttl(env) <= 600
        name = 'proj.sync:{"full":false,"user_id":1}'
        assert 590_000 <= env.locks.pttl(f"redlock:{{{name}}}:queued") <= 600_000


def test_celery_once_keys_as_passed_ours_with_defaults(env: Env) -> None:
    """What the page says behaves differently: celery-once keys on the arguments as
    passed, so an explicit default is another key there; here it is the same call."""
    theirs, ours = _tasks(env, ONCE["base=QueueOnce"])
    theirs.delay(1), ours.delay(1)
    assert theirs.delay(1, full=False).id is not None  # queued again
    with pytest.raises(AlreadyQueued):
        ours.delay(1, full=False)


def test_celery_once_unlock_before_run_maps_to_enqueue(env: Env) -> None:
    """unlock_before_run / lock_on="enqueue": once the first call runs, the next one is
    queued (not refused); ours still keeps the two runs apart."""
    _, ours = _tasks(env, ONCE[ONCE_CASES["unlock_before_run"]])
    with worker(ours.app, concurrency=2):
        first = ours.delay(1)
        wait_for(lambda: env.items("ours") == [1])
        second = ours.delay(1)
        assert second.id != first.id
        with pytest.raises(AlreadyQueued) as info:  # and that one is queued once
            ours.delay(1)
        assert info.value.task_id == second.id
        env.rec.set("go:1", 1)
        assert second.get(timeout=15) == 1 and first.get(timeout=15) == 1
    assert env.items("ours") == [1, 1]


def test_celery_once_example_runs_as_printed(env: Env) -> None:
    """The page's before/after block: both refuse a second call of user 42 (any `full`),
    queue user 7, and hold a queued key for 600 s."""
    before, after = _before_after(_blocks("celery-once (`QueueOnce`)")[0])
    theirs, ours = _run_block(env, before)["sync"], _run_block(env, after)["sync"]
    assert ours.name == "proj.sync"
    first = ours.delay(42)
    theirs.delay(42)
    assert theirs.delay(42, full=True).state == "REJECTED"
    assert ours.delay(42, full=True).id == first.id
    assert theirs.delay(7).id is not None and ours.delay(7).id != first.id
    assert 590 <= _their_ttl(env) <= 600
    assert 590_000 <= env.locks.pttl("redlock:{proj.sync:42}:queued") <= 600_000


def test_celery_once_exceptions_and_attributes_as_stated(env: Env) -> None:
    """celery-once's AlreadyQueued does not catch ours; countdown/message became ttl and
    str(exc); ours carries the holder's task id and state."""
    theirs, ours = _tasks(env, ONCE["base=QueueOnce"])
    theirs.delay(1)
    first = ours.delay(1)
    with pytest.raises(celery_once.AlreadyQueued) as their_error:
        theirs.delay(1)
    assert 3590 < their_error.value.countdown <= 3600
    assert their_error.value.message.startswith("Expires in ")
    assert not issubclass(AlreadyQueued, celery_once.AlreadyQueued)
    with pytest.raises(AlreadyQueued) as our_error:
        try:
            ours.delay(1)
        except celery_once.AlreadyQueued:  # pragma: no cover - the point: it does not catch
            pytest.fail("celery_once.AlreadyQueued caught celery_redlock.AlreadyQueued")
    exc = our_error.value
    assert isinstance(exc, RedlockError)
    assert exc.ttl is not None and 3590 < exc.ttl <= 3600
    assert exc.task_id == first.id and exc.state == "queued" and exc.holder
    assert first.id in str(exc) and 'proj.sync:{"full":false,"user_id":1}' in str(exc)


def test_per_call_duplicate_snippet_runs_as_printed(env: Env) -> None:
    """The page's try/except gives the holder's result for a duplicate, and the new
    call's result otherwise, on the plain QueueOnce row's task."""
    (snippet,) = [b for b in _blocks("celery-once (`QueueOnce`)") if "except" in b]
    _, sync = _tasks(env, ONCE["base=QueueOnce"])
    namespace = {"sync": sync, "AlreadyQueued": AlreadyQueued}
    exec(snippet, namespace)  # the page's code
    first = namespace["result"]
    assert first.id is not None
    exec(snippet, namespace)
    assert namespace["result"].id == first.id


# -- celery-singleton ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["plain", "unique_on", "raise_on_duplicate", "lock_expiry"])
def test_celery_singleton_row_refuses_the_same_calls(env: Env, case: str) -> None:
    """Singleton and the row's options refuse the same second calls: both return the
    existing task's AsyncResult, or both raise with its task id."""
    theirs, ours = _tasks(env, SINGLETON[SINGLETON_CASES[case]])
    first_theirs, first_ours = theirs.delay(1), ours.delay(1)
    if case == "raise_on_duplicate":
        with pytest.raises(DuplicateTaskError) as their_error:
            theirs.delay(1)
        with pytest.raises(AlreadyQueued) as our_error:
            ours.delay(1)
        assert their_error.value.task_id == first_theirs.id
        assert our_error.value.task_id == first_ours.id
        assert not issubclass(AlreadyQueued, CelerySingletonException)
        return
    call = {"full": True} if case == "unique_on" else {}
    assert theirs.delay(1, **call).id == first_theirs.id
    assert ours.delay(1, **call).id == first_ours.id
    assert theirs.delay(2).id != first_theirs.id
    assert ours.delay(2).id != first_ours.id
    if case == "plain":  # all arguments count in both
        assert theirs.delay(1, full=True).id != first_theirs.id
        assert ours.delay(1, full=True).id != first_ours.id
        # what behaves differently: theirs hashes arguments as passed, ours as bound
        assert theirs.delay(user_id=1).id != first_theirs.id
        assert ours.delay(user_id=1).id == first_ours.id
    if case == "lock_expiry":
        assert 590 <= _their_ttl(env) <= 600
        name = 'proj.sync:{"full":false,"user_id":1}'
        assert 590_000 <= env.locks.pttl(f"redlock:{{{name}}}:queued") <= 600_000


def test_celery_singleton_example_runs_as_printed(env: Env) -> None:
    """The page's before/after block: both raise for a second call of user 42 with the
    first task's id, and queue user 7."""
    before, after = _before_after(_blocks("celery-singleton (`Singleton`)")[0])
    theirs, ours = _run_block(env, before)["sync"], _run_block(env, after)["sync"]
    first_theirs, first_ours = theirs.delay(42), ours.delay(42)
    with pytest.raises(DuplicateTaskError) as their_error:
        theirs.delay(42, full=True)
    with pytest.raises(AlreadyQueued) as our_error:
        ours.delay(42, full=True)
    assert their_error.value.task_id == first_theirs.id
    assert our_error.value.task_id == first_ours.id
    assert theirs.delay(7).id != first_theirs.id and ours.delay(7).id != first_ours.id
    assert 590 <= _their_ttl(env) <= 600


# -- options passed per call ------------------------------------------------------------------
def test_once_per_call_is_refused_with_the_printed_error(env: Env) -> None:
    """apply_async(once=...) on a LockedTask raises the ConfigError the page prints, and
    publishes nothing."""
    section = _section("Options passed per call")
    printed = re.search(r"```\n(ConfigError: .*?)\n```", section, re.S)
    assert printed is not None
    _, sync = _tasks(env, ONCE["base=QueueOnce"])
    with pytest.raises(ConfigError) as info:
        sync.apply_async((42,), once={"graceful": True})
    assert f"ConfigError: {info.value}" == printed.group(1)
    assert env.held_keys() == []
    assert sync.delay(42).id is not None  # the key was not taken by the refused call


def test_plain_queue_once_tasks_keep_their_once_option(env: Env) -> None:
    """A QueueOnce task still reads its own per-call once= on an app where celery-redlock
    is installed (a migration done task by task)."""
    theirs, _ = _tasks(env, ONCE["base=QueueOnce"])
    theirs.delay(1)
    assert theirs.apply_async((1,), once={"graceful": True}).state == "REJECTED"
