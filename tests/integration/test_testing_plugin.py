"""The pytest plugin for users' own suites (``celery_redlock.testing``, loaded via pytest11).

Its fixtures are used here directly (the entry point auto-loads the plugin) and from a
user-style test file run by pytester in a separate pytest process without any conftest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redlock import Lock, LockedTask, is_skipped

pytest_plugins = ["pytester"]


def _app(client: redis.Redis) -> tuple[Celery, Any, list[dict[str, Any]]]:
    """A fresh app (no broker needed: tasks are applied eagerly) with one locked task that
    records its lock, fence and the PTTL of its key on *client*'s server."""
    app = Celery("plugin", broker="memory://", backend="cache+memory://")
    seen: list[dict[str, Any]] = []

    @app.task(
        base=LockedTask, bind=True, shared=False, name="plugin.work", lock_key="job:<n>",
        lock_on_contended="skip",
    )  # fmt: skip
    def work(self: Any, n: int) -> int:
        lock = self.lock
        pttl = client.pttl(f"redlock:{{job:{n}}}")
        seen.append({"n": n, "locked": lock is not None, "pttl": pttl})
        return n

    return app, work, seen


def test_redlock_redis_url_is_a_throwaway_loopback_server(redlock_redis_url: str) -> None:
    """redlock_redis_url points at a live loopback Redis (not 6379) where a core Lock works."""
    client = redis.Redis.from_url(redlock_redis_url)
    try:
        assert client.ping() is True
        assert client.connection_pool.connection_kwargs["host"] == "127.0.0.1"
        assert client.connection_pool.connection_kwargs["port"] != 6379
        with Lock(client, "plugin:direct", 5):
            assert Lock(client, "plugin:direct", 5).acquire(blocking=False) is False
        assert Lock(client, "plugin:direct", 5).acquire(blocking=False) is True
    finally:
        client.close()


def test_redlock_app_conf_locks_tasks_on_the_test_server(
    redlock_app_conf: Callable[..., None], redlock_redis_url: str
) -> None:
    """redlock_app_conf(app): tasks take a 5 s lease on the test server; a held key skips."""
    client = redis.Redis.from_url(redlock_redis_url)
    app, work, seen = _app(client)
    redlock_app_conf(app)
    try:
        assert work.apply(args=(1,)).get() == 1
        [run] = seen
        assert run["locked"] and 3000 < run["pttl"] <= 5000, run
        assert client.exists("redlock:{job:1}") == 0, "released after the run"
        with Lock(client, "job:1", 5, owner_info={"task_name": "someone"}):
            result = work.apply(args=(1,)).get()
        assert is_skipped(result) and result["holder"]["task_name"] == "someone"
        assert len(seen) == 1, "the skipped call did not run its body"
    finally:
        client.close()
        app.close()


def test_redlock_disable_runs_tasks_unlocked(
    redlock_app_conf: Callable[..., None], redlock_redis_url: str
) -> None:
    """redlock_app_conf(app, redlock_disable=True): a task runs unlocked while its key is held."""
    client = redis.Redis.from_url(redlock_redis_url)
    app, work, seen = _app(client)
    redlock_app_conf(app, redlock_disable=True)
    try:
        with Lock(client, "job:2", 5, owner_info={"task_name": "someone"}) as other:
            assert work.apply(args=(2,)).get() == 2
            assert other.owned(), "the other owner's lock was not touched"
        [run] = seen
        assert not run["locked"] and run["pttl"] > 0, "ran while the other owner held job:2"
    finally:
        client.close()
        app.close()


def test_plugin_works_in_a_users_suite_without_conftest(pytester: pytest.Pytester) -> None:
    """A user's test file using only the plugin's fixtures passes in a fresh pytest process."""
    pytester.makepyfile(
        test_user="""
        import redis
        from celery import Celery
        from celery_redlock import Lock, LockedTask, is_skipped

        def test_locked_task(redlock_app_conf, redlock_redis_url):
            app = Celery("user", broker="memory://", backend="cache+memory://")

            @app.task(base=LockedTask, shared=False, lock_key="u:<n>", lock_on_contended="skip")
            def job(n):
                return n

            redlock_app_conf(app)
            assert job.apply(args=(1,)).get() == 1
            with Lock(redis.Redis.from_url(redlock_redis_url), "u:1", 5):
                assert is_skipped(job.apply(args=(1,)).get())

        def test_same_server_for_the_session(redlock_redis_url):
            assert redis.Redis.from_url(redlock_redis_url).ping()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=60)
    result.assert_outcomes(passed=2)
