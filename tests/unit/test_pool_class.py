"""The worker learns its pool from the pool class Celery hands it (never from the "pid" a
pool passes), watches children only where tasks run in child processes, and an error in
that bookkeeping, after the message was acknowledged, is logged while the run goes on."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import Any
from unittest.mock import Mock

import pytest
from celery import Celery
from celery.concurrency import get_implementation
from celery.contrib.testing.mocks import TaskMessage
from celery.worker import state as worker_state

from celery_redlock import LockedTask
from celery_redlock.app.state import state_for
from celery_redlock.worker import child_watch
from celery_redlock.worker.pools import Pool, pool_of
from celery_redlock.worker.request import LockedRequest


def test_each_pool_celery_ships_is_told_apart_by_its_class() -> None:
    """prefork has children; solo, threads and gevent run in the worker (gevent green); a
    subclass is its base's kind; an unknown class or a non-class has no children."""
    prefork, solo, threads = (get_implementation(n) for n in ("prefork", "solo", "threads"))
    gevent = get_implementation("gevent")  # imports gevent, patches nothing
    assert pool_of(prefork) == Pool("prefork", children=True)
    assert pool_of(solo) == Pool("solo", solo=True)
    assert pool_of(threads) == Pool("threads", threads=True)
    assert pool_of(gevent) == Pool("gevent", green=True)
    own = type("OwnPrefork", (prefork,), {"__module__": "proj.pools"})
    assert pool_of(own) == Pool("proj.pools:OwnPrefork", children=True)
    assert pool_of(type("Odd", (), {})).children is False
    assert pool_of("prefork") == Pool("'prefork'")


def test_only_a_pool_without_children_has_a_start_up_line() -> None:
    """prefork: nothing to say; the others say there is no child to watch, and what a lost
    lock does to a body there (threads: next instruction; green: next yield)."""
    assert Pool("prefork", children=True).limits() is None
    solo = Pool("solo", solo=True).limits()
    threads = Pool("threads", threads=True).limits()
    green = Pool("gevent", green=True).limits()
    assert solo is not None and threads is not None and green is not None
    for line in (solo, threads, green):
        assert "no pool child to watch" in line
    assert "next Python instruction" in threads
    assert "gevent.sleep(0)" in green and "lock_ttl/3" in green


@pytest.fixture
def app() -> Iterator[Celery]:
    """An app with one locked task, on the in-process store."""
    app = Celery("pools", broker="memory://", set_as_current=False)
    app.conf.redlock_url = "memory://"

    @app.task(base=LockedTask, shared=False, name="pools.job")
    def job() -> None: ...

    yield app
    app.close()


def _accept(app: Celery, pool: Pool, pid: int) -> tuple[LockedRequest, Mock]:
    """A LockedRequest of pools.job accepted by *pool* with *pid*; and its on_ack."""
    state_for(app).pool = pool
    acked = Mock()
    message = TaskMessage("pools.job", id=f"t-{time.monotonic_ns()}")
    request = LockedRequest(message, app=app, task=app.tasks["pools.job"], on_ack=acked)
    try:
        request.on_accepted(pid, time.monotonic())
    finally:
        worker_state.task_ready(request)  # on_accepted counted it among the active ones
    return request, acked


def test_an_error_watching_the_child_is_logged_and_the_run_goes_on(
    app: Celery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """prefork: the watch raises after the message was acknowledged; on_accepted logs it
    (naming the task and the pid) and returns, so the pool runs the body."""

    def broken(pid: int, on_gone: Any) -> None:
        raise OverflowError("signed integer is greater than maximum")

    monkeypatch.setattr(child_watch, "watch", broken)
    with caplog.at_level(logging.ERROR, logger="celery_redlock.release"):
        request, acked = _accept(app, pool_of(get_implementation("prefork")), 4242)
    acked.assert_called_once()
    assert request.worker_pid == 4242
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "pools.job" in errors[0].getMessage() and "4242" in errors[0].getMessage()
    assert errors[0].exc_info is not None


@pytest.mark.parametrize("pool", ["gevent", "threads", "solo"])
def test_a_pool_without_children_is_never_watched(
    app: Celery, monkeypatch: pytest.MonkeyPatch, pool: str
) -> None:
    """gevent passes the id() of a green thread as its "pid", threads and solo the worker's
    own: none of it reaches the child watch."""
    watched: list[int] = []
    monkeypatch.setattr(child_watch, "watch", lambda pid, on_gone: watched.append(pid))
    pid = id(object()) if pool == "gevent" else os.getpid()
    _accept(app, pool_of(get_implementation(pool)), pid)
    assert watched == []
    _accept(app, pool_of(get_implementation("prefork")), 4243)
    assert watched == [4243]
