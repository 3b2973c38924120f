"""A task's app state and resolved options are found once and handed down, not looked up
at every step: ``state_for(`` is called at the entry points only (at most 5 call sites
outside app/, the folder that defines it), and a run takes them from its task."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_redlock
from celery_redlock import LockedTask
from celery_redlock.app.state import state_for
from celery_redlock.task import locked_task as locked_task_module

PACKAGE = Path(celery_redlock.__file__).parent

#: Most call sites of ``state_for(`` allowed outside app/ (issue 39): the entry points.
MOST = 5

_CALL = re.compile(r"(?<!def )\bstate_for\(")


def _call_sites() -> list[str]:
    """``path:line`` of each ``state_for(`` in the package outside app/ (its definition
    excluded; a mention in a comment or docstring counts too: it is read as a use)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] == "app":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found.extend(f"{'/'.join(parts)}:{number}" for _ in _CALL.finditer(line))
    return found


def test_state_for_is_called_at_most_five_times_outside_app() -> None:
    """Outside app/, only the entry points look the app's state up (the task's binding,
    the worker's bootstep, install, beat, the pytest plugin's reset)."""
    sites = _call_sites()
    assert sites, "the count reads nothing: is the package where this test looks?"
    assert len(sites) <= MOST, f"{len(sites)} call sites of state_for( outside app/: {sites}"


def test_the_counter_sees_a_call_it_must_count() -> None:
    """The pattern counts a call, a call after ``.``, and not the definition."""
    text = "def state_for(app):\n    x = state_for(app)\n    y = module.state_for(app).held\n"
    assert len(_CALL.findall(text)) == 2


@pytest.fixture
def app() -> Celery:
    app = Celery("handed", set_as_current=False)
    app.conf.update(redlock_url="memory://handed-test", redlock_ttl=7.0, task_always_eager=False)
    return app


def test_a_task_binds_its_app_state_once_and_its_options_follow_a_reset(app: Celery) -> None:
    """The task's state is its app's, found once; its options are resolved once and again
    after the settings change (AppState.reset), as the pytest plugin's reset does."""

    @app.task(base=LockedTask, lock_key="k:<n>", name="handed.options")
    def job(n: int) -> int:
        return n

    state = state_for(app)
    assert job.redlock_state is state
    assert job.redlock_options is job.redlock_options  # cached, not resolved per read
    assert job.redlock_options.ttl == 7.0
    app.conf.redlock_ttl = 3.0
    state.reset()
    assert job.redlock_options.ttl == 3.0


def test_a_run_does_not_look_the_state_up(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the task's first use, its runs (acquire, body, release, after_return) and its
    lock names take the state and options from the task: no state_for call."""
    calls: list[Any] = []

    def counting(target: Any) -> Any:
        calls.append(target)
        return state_for(target)

    @app.task(base=LockedTask, lock_key="k:<n>", name="handed.run")
    def job(n: int) -> int:
        assert job.lock is not None and job.lock.name == f"k:{n}"
        return n * 2

    assert job.apply(args=(1,)).get() == 2  # first use: the class finds its app's state
    for module in list(sys.modules.values()):
        if (
            module.__name__.startswith("celery_redlock")
            and vars(module).get("state_for") is state_for
        ):
            monkeypatch.setattr(module, "state_for", counting)
    assert vars(locked_task_module)["state_for"] is counting
    for n in range(3):
        assert job.apply(args=(n,)).get() == n * 2
        assert job(n) == n * 2  # a direct call is locked too
    assert calls == []
    assert state_for(app).held == {}  # every run released its lock


def test_a_task_bound_to_another_app_takes_that_apps_state(app: Celery) -> None:
    """The state kept on a task class is its app's: bound to another app, it follows."""
    other = Celery("other", set_as_current=False)
    other.conf.update(redlock_url="memory://handed-other", redlock_ttl=9.0)

    class Job(LockedTask):  # type: ignore[misc]
        name = "handed.job"

        def run(self) -> None:
            return None

    job = app.register_task(Job())
    assert job.redlock_state is state_for(app)
    type(job).bind(other)
    assert job.redlock_state is state_for(other)
    assert job.redlock_options.ttl == 9.0
