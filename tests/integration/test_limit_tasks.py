"""``lock_limit``, ``lock_rate`` and ``lock_rate_burst`` on in-process Celery workers.

The options checked at decoration and against the settings, each ``lock_on_contended``
policy over a rate (retry at its slot within the lock's own budget, skip, wait, raise with
``RateLimited``), semaphores through ``redlock_tasks`` and the ``redlock_limit`` setting,
a rate refusal giving the permit back, and the metrics of refusals. The prefork cases
are in test_limit_workers.py.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from inprocess import Env, worker
from prometheus_client import CollectorRegistry
from servers import RedisServer, wait_for

from celery_redlock import (
    ConfigError,
    Limit,
    LockedTask,
    RateLimited,
    RateLimiter,
    Semaphore,
    is_skipped,
)
from celery_redlock.app.observability import disable_prometheus, enable_prometheus
from celery_redlock.app.state import state_for
from celery_redlock.install import check_locked_tasks


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("lock_limit", 0, "a whole number >= 1"),
        ("lock_limit", "3", "a whole number >= 1"),
        ("lock_limit", True, "a whole number >= 1"),
        ("lock_rate", "10/w", 'like "10/s"'),
        ("lock_rate", 10, 'a string such as "10/m"'),
        ("lock_rate", "0/s", 'like "10/s"'),
        ("lock_rate_burst", 0, "a whole number >= 1"),
        ("lock_rate_burst", None, None),
    ],
)
def test_bad_limit_and_rate_options_fail_at_decoration_naming_task_and_option(
    env: Env, option: str, value: Any, says: str | None
) -> None:
    """A bad lock_limit, lock_rate or lock_rate_burst is a ConfigError when the task is
    defined, naming the task, the option and what it must be."""
    app = env.app()
    app.finalize()  # a finalized app builds the task class right in the decorator
    if says is None:  # None is "not set" for the burst: accepted

        @app.task(base=LockedTask, lock_rate="1/s", shared=False, **{option: value})
        def fine() -> None: ...

        return
    with pytest.raises(ConfigError) as bad:

        @app.task(base=LockedTask, name="proj.bad", shared=False, **{option: value})
        def bad_task() -> None: ...

    assert f"task 'proj.bad': {option}={value!r} is not valid" in str(bad.value)
    assert says in str(bad.value)


def test_no_cap_without_a_rate_and_a_burst_without_a_rate_are_refused_at_decoration(
    env: Env,
) -> None:
    """lock_limit=None with no lock_rate on the task limits nothing, and lock_rate_burst
    needs a lock_rate: both are ConfigErrors when the task is defined; the redlock_rate
    setting gives a rate to the tasks that set none."""
    app = env.app(redlock_rate="5/m")
    app.finalize()
    with pytest.raises(ConfigError, match=r"'proj\.nothing': lock_limit=None is not valid"):

        @app.task(base=LockedTask, name="proj.nothing", lock_limit=None, shared=False)
        def nothing() -> None: ...

    with pytest.raises(ConfigError, match=r"'proj\.burst': lock_rate_burst=3 is not valid"):

        @app.task(base=LockedTask, name="proj.burst", lock_rate_burst=3, shared=False)
        def burst() -> None: ...

    @app.task(base=LockedTask, name="proj.ok", shared=False)
    def ok() -> None: ...

    check_locked_tasks(app, state_for(app))
    options = state_for(app).options_for(app.tasks["proj.ok"])
    assert (options.limit, options.rate) == (1, "5/m")


def test_limits_and_rates_on_redlock_masters_are_refused_naming_task_and_option(
    env: Env, redis_servers: Any
) -> None:
    """With redlock_url a list of masters, lock_limit=3, a lock_rate and lock_limits are
    refused (with the counter-example, or why); lock_limit=1 is the Redlock mutex and
    passes."""
    urls = [s.url for s in redis_servers(3)]
    for options, says in (
        ({"lock_limit": 3}, "lock_limit=3: semaphores (a limit above 1"),
        ({"lock_limit": 3}, "B on 2 and 3, C on 1 and 3"),
        ({"lock_rate": "5/s"}, "lock_rate='5/s': rate limits (RateLimiter, lock_rate) are not"),
        ({"lock_rate": "5/s"}, "three grants while each master counted two"),
        ({"lock_limits": [Limit("all", 2)]}, "lock_limits=(Limit(key='all', limit=2),): flow"),
        ({"lock_limits": [Limit("all", 2)]}, "could not be one step on a majority"),
    ):
        app = env.app(lock_url=urls)

        @app.task(base=LockedTask, name="proj.limited", shared=False, **options)
        def limited() -> None: ...

        with pytest.raises(ConfigError, match=r"task 'proj\.limited': ") as refused:
            check_locked_tasks(app, state_for(app))
        assert says in str(refused.value)
    app = env.app(lock_url=urls)

    @app.task(base=LockedTask, name="proj.mutex", lock_limit=1, shared=False)
    def mutex() -> None: ...

    check_locked_tasks(app, state_for(app))


# ------------------------------------------------------------------------------ semaphores
def test_redlock_tasks_and_the_limit_setting_give_tasks_permits_with_fences(env: Env) -> None:
    """redlock_tasks {"lock_limit": 2} (no base class) and the redlock_limit setting make
    semaphores: self.lock is a permit with a fence, and at most 2 run at once."""
    app = env.app(
        redlock_tasks={"proj.cfg": {"lock_key": "cfg:<n>", "lock_on_contended": "wait"}},
        redlock_limit=2,
    )

    @app.task(name="proj.cfg", bind=True, shared=False)
    def cfg(self: Any, n: int) -> None:
        env.push("runs", {"start": time.time(), "fence": self.lock.fence})
        assert isinstance(self.lock, Semaphore) and self.lock.limit == 2
        time.sleep(0.3)
        env.push("ends", {"end": time.time()})

    with worker(app, concurrency=4):
        results = [cfg.delay(1) for _ in range(4)]
        for r in results:
            r.get(timeout=20)
    starts = sorted(r["start"] for r in env.items("runs"))
    ends = sorted(r["end"] for r in env.items("ends"))
    assert starts[2] >= ends[0] - 0.01 and starts[3] >= ends[1] - 0.01  # never 3 at once
    assert starts[1] < ends[0]  # 2 did run at once
    assert len({r["fence"] for r in env.items("runs")}) == 4


# ------------------------------------------------------------------------------ over the rate
def test_raise_over_the_rate_fails_with_rate_limited_carrying_retry_after(env: Env) -> None:
    """lock_rate="1/m" with "raise": the second run fails with RateLimited, whose
    retry_after is the time to the next slot (about a minute)."""
    app = env.app()

    @app.task(
        base=LockedTask, lock_key="r:<n>", lock_limit=None, lock_rate="1/m",
        lock_on_contended="raise", shared=False,
    )  # fmt: skip
    def once(n: int) -> int:
        return n

    with worker(app):
        assert once.delay(1).get(timeout=10) == 1
        with pytest.raises(RateLimited) as refused:
            once.delay(1).get(timeout=10)
        assert once.delay(2).get(timeout=10) == 2  # another key has its own rate
    assert 55 < refused.value.retry_after <= 60
    assert refused.value.name == "r:1" and refused.value.rate == "1/m"


def test_skip_over_the_rate_returns_a_marker_saying_when(env: Env) -> None:
    """ "skip" over the rate: the run does not run, its result says rate limited and when."""
    app = env.app()

    @app.task(
        base=LockedTask, lock_key="s", lock_limit=None, lock_rate="1/m",
        lock_on_contended="skip", shared=False,
    )  # fmt: skip
    def once() -> str:
        env.push("ran", 1)
        return "ran"

    with worker(app):
        assert once.delay().get(timeout=10) == "ran"
        skipped = once.delay().get(timeout=10)
    assert is_skipped(skipped) and skipped["reason"] == "rate limited"
    assert 55 < skipped["retry_after"] <= 60
    assert env.items("ran") == [1]


def test_retry_over_the_rate_comes_back_at_its_slot_within_the_lock_budget(env: Env) -> None:
    """ "retry" at 2/s: three runs sent at once start about 0.5 s apart, each re-queued run
    once, counted in redlock_retries and never in the task's own retries."""
    app = env.app()

    @app.task(
        base=LockedTask, bind=True, lock_key="q", lock_limit=None, lock_rate="2/s",
        max_retries=0, shared=False,
    )  # fmt: skip
    def spaced(self: Any, n: int) -> None:
        env.push(
            "runs",
            {
                "t": time.time(),
                "retries": self.request.retries,
                "lock_retries": int(
                    (self.request.headers or {}).get("redlock_retries")
                    or getattr(self.request, "redlock_retries", 0)
                    or 0
                ),
            },
        )

    with worker(app, concurrency=3):
        results = [spaced.delay(n) for n in range(3)]
        for r in results:
            r.get(timeout=20)
    runs = sorted(env.items("runs"), key=lambda r: r["t"])
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(runs)]
    assert all(0.45 < gap < 0.8 for gap in gaps), gaps
    assert [r["retries"] for r in runs] == [0, 0, 0]
    assert sorted(r["lock_retries"] for r in runs) == [0, 1, 1]


def test_wait_over_the_rate_sleeps_until_its_slot(env: Env) -> None:
    """ "wait" at 5/s with burst 2: two start at once, the next ones 0.2 s apart."""
    app = env.app()

    @app.task(
        base=LockedTask, lock_key="w", lock_limit=None, lock_rate="5/s", lock_rate_burst=2,
        lock_on_contended="wait", shared=False,
    )  # fmt: skip
    def paced() -> None:
        env.push("t", time.time())

    with worker(app, concurrency=4):
        results = [paced.delay() for _ in range(4)]
        for r in results:
            r.get(timeout=20)
    times = sorted(env.items("t"))
    assert times[1] - times[0] < 0.1
    assert 0.15 < times[2] - times[0] < 0.35 and 0.15 < times[3] - times[2] < 0.35


def test_a_run_refused_by_the_rate_gives_its_permit_back_at_once(env: Env) -> None:
    """lock_limit=2 and lock_rate="1/m": the second run takes a permit, is refused by the
    rate, and leaves no permit behind while the first still runs."""
    app = env.app()

    @app.task(
        base=LockedTask, lock_key="both", lock_limit=2, lock_rate="1/m",
        lock_on_contended="raise", shared=False,
    )  # fmt: skip
    def both(seconds: float) -> None:
        env.push("started", 1)
        time.sleep(seconds)

    with worker(app, concurrency=2):
        first = both.delay(1.0)
        wait_for(lambda: env.items("started"))
        with pytest.raises(RateLimited):
            both.delay(0).get(timeout=10)
        assert env.locks.hlen("redlock:{both}:permits") == 1
        first.get(timeout=10)
    assert not env.locks.exists("redlock:{both}:permits")


# ------------------------------------------------------------------------------ metrics
def test_rate_refusals_are_counted_per_task_in_prometheus(shared_redis: RedisServer) -> None:
    """Each refusal of a limiter with a task's owner_info counts as kind="rate_limited"."""
    registry = CollectorRegistry()
    enable_prometheus(registry)
    client = shared_redis.client(db=9)
    try:
        limiter = RateLimiter(client, "prom:rate", "1/m", owner_info={"task_name": "proj.p"})
        limiter.acquire()
        for _ in range(3):
            assert not limiter.acquire()
        labels = {"kind": "rate_limited", "task": "proj.p"}
        assert registry.get_sample_value("celery_redlock_events_total", labels) == 3
    finally:
        disable_prometheus(registry)
        client.delete(limiter.key)
        client.close()
