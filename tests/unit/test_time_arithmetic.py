"""Time arithmetic under freezegun, on the memory backend: no server, no sleeping.

The memory backend and the lock's local deadline read ``time.monotonic()``, and the
publish side reads ``datetime.now()``: freezegun moves both at once, so each test
steps time by exactly what it is about.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from freezegun import freeze_time

from celery_redlock import Lock, LockedTask, LockLost, RateLimiter, connect
from celery_redlock.contention import backoff_delay, rate_delay
from celery_redlock.core import RateGrant
from celery_redlock.core.admin import read_lock

START = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def memory() -> Any:
    """A fresh memory store for one test."""
    return connect(f"memory://time-{uuid.uuid4().hex}")


@pytest.fixture
def clock() -> Iterator[Any]:
    """Frozen time at START (wall clock and monotonic clock), stepped by the test."""
    with freeze_time(START) as frozen:
        yield frozen


def test_a_lease_ends_exactly_at_its_ttl_on_the_clock(memory: Any, clock: Any) -> None:
    """A 30 s lease holds at 29.9 s and is free at 30 s: the next owner takes it, and
    the first owner's release then says LockLost."""
    first = Lock(memory, "lease", ttl=30, auto_renew=False)
    second = Lock(memory, "lease", ttl=30, auto_renew=False)
    assert first.acquire(blocking=False)
    clock.tick(29.9)
    assert not second.acquire(blocking=False)
    clock.tick(0.1)
    assert second.acquire(blocking=False)
    assert second.fence is not None and first.fence is not None and second.fence > first.fence
    with pytest.raises(LockLost):
        first.release()
    second.release()


def test_a_refused_rate_grant_names_the_exact_wait(memory: Any, clock: Any) -> None:
    """At 10/m a second call is refused with retry_after 6.0 s exactly; 5.999 s later it
    is still refused with 0.001 s left, and at 6 s it is granted."""
    limiter = RateLimiter(memory, "partner", "10/m")
    assert limiter.acquire()
    refused = limiter.acquire()
    assert not refused and refused.retry_after == pytest.approx(6.0, abs=1e-6)
    clock.tick(5.999)
    again = limiter.acquire()
    assert not again and again.retry_after == pytest.approx(0.001, abs=1e-6)
    clock.tick(0.001)
    assert limiter.acquire()


def test_a_burst_is_spent_then_refilled_one_interval_at_a_time(memory: Any, clock: Any) -> None:
    """burst=3 at 1/s: three grants at once, the fourth waits 1 s; after 3 s idle, three
    at once again."""
    limiter = RateLimiter(memory, "bursty", "1/s", burst=3)
    assert all(limiter.acquire() for _ in range(3))
    fourth = limiter.acquire()
    assert not fourth and fourth.retry_after == pytest.approx(1.0, abs=1e-6)
    clock.tick(3)
    assert all(limiter.acquire() for _ in range(3))
    assert not limiter.acquire()


class _Retry:
    """The retry options a contended strategy reads."""

    def __init__(self, jitter: bool) -> None:
        self.max_retries = 50
        self.retry_backoff = 1.0
        self.retry_backoff_max = 60.0
        self.retry_jitter = jitter


def test_contention_backoff_doubles_to_its_cap_and_jitter_stays_in_its_half() -> None:
    """Without jitter the backoff is 1, 2, 4 ... s capped at 60 s; with jitter each delay
    lies in [d/2, d] of the same d, over many draws."""
    plain = [backoff_delay(_Retry(jitter=False), n) for n in range(8)]
    assert plain == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    for n, delay in enumerate(plain):
        draws = [backoff_delay(_Retry(jitter=True), n) for _ in range(200)]
        assert all(delay / 2 <= d <= delay for d in draws), (n, min(draws), max(draws))
        assert max(draws) - min(draws) > delay / 10, "jitter should spread the retries"


def test_a_rate_refusal_comes_back_just_before_its_slot() -> None:
    """A run refused by its rate limit is re-queued to arrive a little before its slot:
    the lead is a quarter interval, at most 50 ms; jitter stays within its first half."""
    grant = RateGrant(False, retry_after=2.0)
    assert rate_delay(_Retry(jitter=False), grant, interval=6.0) == pytest.approx(1.95)
    assert rate_delay(_Retry(jitter=False), grant, interval=0.1) == pytest.approx(1.975)
    draws = [rate_delay(_Retry(jitter=True), grant, interval=6.0) for _ in range(200)]
    assert all(1.95 <= d <= 1.975 for d in draws)
    assert rate_delay(_Retry(jitter=False), RateGrant(False, retry_after=0.01), 6.0) == 0.0


def _publisher(name: str) -> tuple[Celery, Any, Any]:
    """An app publishing to Celery's memory broker with enqueue-time holds on memory://."""
    app = Celery(name, broker="memory://")
    url = f"memory://{name}"
    app.conf.update(redlock_url=url, redlock_lock_on="enqueue", redlock_lock_enqueue_ttl=3600)

    @app.task(base=LockedTask, shared=False, name=f"{name}.job", lock_key="job:<n>")
    def job(n: int) -> int:
        return n

    return app, job, connect(url)


def _hold_ttl(store: Any, name: str) -> float:
    [hold] = [info for info in read_lock(store, "redlock:", name) if info.state == "queued"]
    return hold.ttl_ms / 1000


def test_an_eta_or_countdown_lengthens_the_enqueue_hold_by_exactly_that(clock: Any) -> None:
    """lock_enqueue_ttl=3600: a call with an ETA 10 min ahead holds its key 4200 s, one
    with countdown=30 holds it 3630 s, and an earlier expires cuts the hold to it (+5 s)."""
    app, job, store = _publisher(f"hold-{uuid.uuid4().hex[:8]}")
    try:
        job.apply_async((1,), eta=START + dt.timedelta(minutes=10))
        assert _hold_ttl(store, "job:1") == pytest.approx(4200, abs=0.002)
        job.apply_async((2,), countdown=30)
        assert _hold_ttl(store, "job:2") == pytest.approx(3630, abs=0.002)
        job.apply_async((3,), countdown=30, expires=START + dt.timedelta(seconds=100))
        assert _hold_ttl(store, "job:3") == pytest.approx(105, abs=0.002)
        clock.tick(105)
        assert not [i for i in read_lock(store, "redlock:", "job:3") if i.state == "queued"]
        assert _hold_ttl(store, "job:2") == pytest.approx(3630 - 105, abs=0.002)
    finally:
        app.close()
