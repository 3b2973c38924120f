"""The test mode for users: ``redlock_url = "memory://"`` with no server, the plugin's
fixtures, docs/testing.md as written, and the start-up refusals where memory:// cannot
hold (a prefork worker, a beat)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from inprocess import gated
from workers import Worker

from celery_redlock import ConfigError, Lock, LockedTask, connect, is_skipped
from celery_redlock.testing import MEMORY_URL

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]


def _files(heading: str) -> dict[str, str]:
    """The files a section of docs/testing.md shows: each Python block under its label
    (a line such as ``conftest.py`` in backquotes, then a colon), as printed."""
    page = (ROOT / "docs" / "testing.md").read_text()
    section = page.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^`(\w+)\.py`[^\n]*:\n\n```python\n(.*?)```", section, re.S | re.M)
    return dict(found)


@pytest.mark.parametrize(
    "plugins",
    [(), ("-p", "no:celery", "-p", "celery.contrib.pytest")],
    ids=["pytest-celery", "celery.contrib.pytest"],
)
def test_the_testing_page_runs_as_written(
    pytester: pytest.Pytester, plugins: tuple[str, ...]
) -> None:
    """docs/testing.md's conftest.py and test file, copied as they are into an empty
    directory, pass in a fresh pytest process with no server running for them, with
    pytest-celery installed or with Celery's plugin loaded by -p instead."""
    files = _files("A complete test")
    assert sorted(files) == ["conftest", "test_sync"]
    pytester.makeconftest(files["conftest"])
    pytester.makepyfile(test_sync=files["test_sync"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *plugins, timeout=120)
    result.assert_outcomes(passed=3)


def test_without_celerys_plugin_the_fixtures_are_missing_as_the_page_says(
    pytester: pytest.Pytester,
) -> None:
    """Neither pytest-celery nor -p celery.contrib.pytest: the page's test fails with the
    error the page names."""
    files = _files("A complete test")
    pytester.makeconftest(files["conftest"])
    pytester.makepyfile(test_sync=files["test_sync"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:celery", timeout=120)
    page = " ".join((ROOT / "docs" / "testing.md").read_text().split())
    assert "fails with \"fixture 'celery_app' not found\"" in page
    result.stdout.fnmatch_lines(["*fixture 'celery_app' not found*"])


def test_the_own_app_eager_section_runs_as_written(pytester: pytest.Pytester) -> None:
    """docs/testing.md's own-app files (the app, its conftest.py, its tests) pass as
    printed, with no server and without Celery's pytest plugin: a key held by the test
    in the app's memory:// store skips the eager call."""
    files = _files("Your own app, eager")
    assert sorted(files) == ["conftest", "proj", "test_proj"]
    # The one change: the app's Redis is a closed port, so that nothing here can reach a
    # server on localhost:6379 (the page's point is that nothing tries).
    pytester.makepyfile(proj=files["proj"].replace("redis://localhost:6379", "redis://127.0.0.1:9"))
    pytester.makeconftest(files["conftest"])
    pytester.makepyfile(test_proj=files["test_proj"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:celery", timeout=120)
    result.assert_outcomes(passed=2)


# The in-process worker below is the user's: pytest-celery's celery_app on the plugin's
# redlock_celery_config (memory:// broker, results and locks), and redlock_worker.
@pytest.fixture(scope="session")
def celery_config(redlock_celery_config: dict[str, Any]) -> dict[str, Any]:
    return redlock_celery_config


@pytest.fixture
def slow(celery_app: Celery) -> Iterator[Any]:
    """A locked task that holds k:<n> until ``slow.release`` is set (set after the test)."""

    @celery_app.task(base=LockedTask, bind=True, shared=False, name="tm-threads.slow",
                     lock_key="k:<n>", lock_on_contended="skip")  # fmt: skip
    def slow(self: Any, n: int) -> int:
        slow.started.set()
        assert slow.release.wait(10)
        assert self.lock is not None
        return int(self.lock.fence)

    with gated(slow):
        yield slow


def test_a_threads_worker_on_memory_skips_a_second_run_of_one_key(
    slow: Any, redlock_store: Any, redlock_worker: Any
) -> None:
    """An in-process worker with the threads pool on memory:// (broker and locks): while one
    run of k:1 holds its lock, a second is skipped; afterwards the key is free again."""
    first = slow.delay(1)
    assert slow.started.wait(10)
    assert is_skipped(slow.delay(1).get(timeout=10))
    slow.release.set()
    assert isinstance(first.get(timeout=10), int)
    assert Lock(connect(MEMORY_URL), "k:1").acquire(blocking=False)


def test_eager_and_direct_calls_lock_on_memory_with_a_non_redis_broker() -> None:
    """A project whose broker is RabbitMQ runs a LockedTask eagerly and directly with
    redlock_url = memory:// (no server for the locks): a held key skips both."""
    app = Celery("tm-eager", broker="amqp://guest:guest@127.0.0.1:5672//")
    app.conf.update(redlock_url="memory://tm-eager", task_always_eager=True)

    @app.task(base=LockedTask, bind=True, shared=False, name="tm-eager.job",
              lock_key="job:<n>", lock_on_contended="skip")  # fmt: skip
    def job(self: Any, n: int) -> int:
        return int(self.lock.fence)

    try:
        assert isinstance(job.delay(1).get(), int)
        assert isinstance(job(1), int)
        with Lock(connect("memory://tm-eager"), "job:1"):
            assert is_skipped(job.delay(1).get())
            assert is_skipped(job(1))
    finally:
        app.close()


def test_a_prefork_worker_on_memory_stops_at_start_up(tmp_path: Path) -> None:
    """celery worker -P prefork with redlock_url = memory://: exits non-zero with one line
    saying why (its children would not share the locks), before it is ready."""
    env = {
        "REDLOCK_TEST_BROKER": "memory://",
        "REDLOCK_TEST_BACKEND": "cache+memory://",
        "REDLOCK_TEST_LOCKS": MEMORY_URL,
        "REDLOCK_TEST_RECORD": "redis://127.0.0.1:1/0",
        "REDLOCK_TEST_CONF": "",
    }
    worker = Worker("tests.apps.configapp", env, tmp_path / "prefork.log")
    try:
        assert worker.wait_exit() != 0
        text = worker.text()
    finally:
        worker.stop()
    lines = [line for line in text.splitlines() if "memory://" in line]
    assert len(lines) == 1, text
    assert "prefork" in lines[0] and "would not be shared" in lines[0]
    assert "Traceback" not in text and "ready." not in text


def test_a_beat_on_memory_stops_at_start_up(tmp_path: Path) -> None:
    """celery beat -S LeaderScheduler with redlock_url = memory://: exits non-zero naming
    why (other beats would not see its leader lock)."""
    env = {**os.environ, "BEATAPP_BROKER": "memory://", "BEATAPP_LOCKS": MEMORY_URL}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "celery", "-A", "tests.apps.beatapp", "beat", "-l", "info",
            "--pidfile=", f"--schedule={tmp_path / 'schedule'}",
            "-S", "celery_redlock.beat:LeaderScheduler"]  # fmt: skip
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    text = done.stdout + done.stderr
    assert done.returncode != 0, text
    assert "memory://" in text and "beat" in text and "would not be shared" in text


def test_check_single_process_names_the_url_and_the_way_out() -> None:
    """The start-up refusal is a ConfigError that names the URL and says what to use."""
    from celery_redlock.app.config import load_settings  # noqa: PLC0415

    settings = load_settings({"redlock_url": "memory://x"})
    with pytest.raises(ConfigError, match=r"memory://x.*point redlock_url at Redis"):
        settings.check_single_process("a prefork pool")
    load_settings({"redlock_url": "redis://127.0.0.1:1/0"}).check_single_process("beat")
