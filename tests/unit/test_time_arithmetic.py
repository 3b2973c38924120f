"""Time arithmetic under freezegun, on the memory backend: no server, no sleeping.

The memory backend's in-process server reads ``time.time()`` (key expiry, the scripts'
``TIME``, the fence counter's start), the lock's local deadline ``time.monotonic()``, and
the publish side ``datetime.now()``: freezegun moves them all at once, so each test steps
time by exactly what it is about. Expiry is Redis's: a key lives through the millisecond
its TTL ends (PTTL 0) and is gone 1 ms later.

Beat's leader lease is tested through the pieces ``LeaderScheduler`` uses (a core
``Lock`` with beat's lease, ``LockRecords`` with beat's suffix, the renewal round's
``renewal()``/``renew``/``renewed()`` steps): the scheduler itself refuses ``memory://``
at start-up, and its standby waits block on real time.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish
from freezegun import freeze_time

from celery_redlock import Lock, LockedTask, LockLost, RateLimiter, connect
from celery_redlock.beat import RECORDS_SUFFIX, LeaderScheduler
from celery_redlock.core import ConfigError, LockRecords, RateGrant
from celery_redlock.core.admin import read_lock
from celery_redlock.core.backend_types import Renewal
from celery_redlock.task.contention import backoff_delay, rate_delay

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
    """A 30 s lease holds at 29.9 s and still at 30 s (as Redis does, a key lives through
    the millisecond its TTL ends: PTTL 0), and is free 1 ms later: the next owner takes it,
    and the first owner's release then says LockLost."""
    first = Lock(memory, "lease", ttl=30, auto_renew=False)
    second = Lock(memory, "lease", ttl=30, auto_renew=False)
    assert first.acquire(blocking=False)
    clock.tick(29.9)
    assert not second.acquire(blocking=False)
    clock.tick(0.1)
    assert not second.acquire(blocking=False) and second.holder_ttl_ms == 0
    clock.tick(0.001)
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
    with countdown=30 holds it 3630 s, and an earlier expires cuts the hold to it (+5 s),
    gone 1 ms after it ends."""
    app, job, store = _publisher(f"hold-{uuid.uuid4().hex[:8]}")
    try:
        job.apply_async((1,), eta=START + dt.timedelta(minutes=10))
        assert _hold_ttl(store, "job:1") == pytest.approx(4200, abs=0.002)
        job.apply_async((2,), countdown=30)
        assert _hold_ttl(store, "job:2") == pytest.approx(3630, abs=0.002)
        job.apply_async((3,), countdown=30, expires=START + dt.timedelta(seconds=100))
        assert _hold_ttl(store, "job:3") == pytest.approx(105, abs=0.002)
        clock.tick(105.001)
        assert not [i for i in read_lock(store, "redlock:", "job:3") if i.state == "queued"]
        assert _hold_ttl(store, "job:2") == pytest.approx(3630 - 105, abs=0.002)
    finally:
        app.close()


# -- debounce deadlines (lock_debounce with lock_on_duplicate="replace") -----------------------
def _debounced(name: str, lock_on: str) -> tuple[Celery, Any, Any]:
    """An eager-off app on Celery's memory broker whose task debounces 30 s on one key."""
    app = Celery(name, broker="memory://")
    url = f"memory://{name}"
    app.conf.update(redlock_url=url, redlock_lock_on=lock_on, redlock_lock_enqueue_ttl=3600)

    @app.task(
        base=LockedTask,
        shared=False,
        name=f"{name}.job",
        lock_key="job",
        lock_on_duplicate="replace",
        lock_debounce=30,
    )
    def job(n: int) -> int:
        return n

    return app, job, connect(url)


@contextlib.contextmanager
def _sent(task_name: str) -> Iterator[dict[str, tuple[Any, Any]]]:
    """Task id -> (eta, expires) headers of each message of *task_name* as it is sent."""
    seen: dict[str, tuple[Any, Any]] = {}

    def record(headers: Any = None, **_: Any) -> None:
        if headers and headers.get("task") == task_name:
            seen[headers["id"]] = (headers.get("eta"), headers.get("expires"))

    before_task_publish.connect(record, weak=False)
    try:
        yield seen
    finally:
        before_task_publish.disconnect(record)


def _queued(store: Any, name: str) -> tuple[Any, Any]:
    """(task id, seconds left) of the enqueue-time hold of *name*."""
    [hold] = [info for info in read_lock(store, "redlock:", name) if info.state == "queued"]
    return hold.record["task_id"], hold.ttl_ms / 1000


def _at(seconds: float) -> str:
    return (START + dt.timedelta(seconds=seconds)).isoformat()


@pytest.mark.parametrize("lock_on", ["enqueue", "enqueue+run"])
def test_debounce_sends_each_call_at_its_deadline_and_holds_its_key_that_much_longer(
    clock: Any, lock_on: str
) -> None:
    """lock_debounce=30, lock_enqueue_ttl=3600: a call is sent with countdown max(its
    countdown, 30) (ETA now+30 s; countdown=5 -> +30; countdown=100 -> +100), each newer
    call takes the hold (3600 s + that delay); an explicit eta is sent as given (2 s ahead:
    hold 3602 s); expires 10 s ahead cuts the hold to 15 s: 0 ms left at 15 s, gone 1 ms
    later."""
    app, job, store = _debounced(f"debounce-{uuid.uuid4().hex[:8]}", lock_on)
    try:
        with _sent(job.name) as sent:
            first = job.delay(1)
            assert sent[first.id] == (_at(30), None)
            assert _queued(store, "job") == (first.id, pytest.approx(3630, abs=0.002))
            clock.tick(10)
            short = job.apply_async((2,), countdown=5)
            assert sent[short.id] == (_at(40), None)
            assert _queued(store, "job") == (short.id, pytest.approx(3630, abs=0.002))
            long = job.apply_async((3,), countdown=100)
            assert sent[long.id] == (_at(110), None)
            assert _queued(store, "job") == (long.id, pytest.approx(3700, abs=0.002))
            timed = job.apply_async((4,), eta=START + dt.timedelta(seconds=12))
            assert sent[timed.id] == (_at(12), None)
            assert _queued(store, "job") == (timed.id, pytest.approx(3602, abs=0.002))
            expiring = job.apply_async((5,), expires=START + dt.timedelta(seconds=20))
            assert sent[expiring.id] == (_at(40), _at(20))
            assert _queued(store, "job") == (expiring.id, pytest.approx(15, abs=0.002))
            clock.tick(14.999)
            assert _queued(store, "job") == (expiring.id, pytest.approx(0.001, abs=0.0005))
            clock.tick(0.001)
            assert _queued(store, "job") == (expiring.id, 0)
            clock.tick(0.001)
            assert not [i for i in read_lock(store, "redlock:", "job") if i.state == "queued"]
    finally:
        app.close()


@pytest.mark.parametrize("lock_on", ["enqueue", "enqueue+run"])
def test_a_republish_of_the_running_request_is_not_debounced(clock: Any, lock_on: str) -> None:
    """Sent with the 30 s debounce, then run at +30 s: re-published under its own task id
    from its run (self.retry() with countdown=2; then with none), it is sent at +32 s and
    then at once, keeping its hold for 3602 s and then 3600 s: no debounce added."""
    app, job, store = _debounced(f"republish-{uuid.uuid4().hex[:8]}", lock_on)
    try:
        with _sent(job.name) as sent:
            first = job.delay(1)
            assert sent.pop(first.id) == (_at(30), None)
            clock.tick(30)
            job.push_request(id=first.id, args=(1,), kwargs={})  # as the worker runs it
            try:
                job.apply_async((1,), task_id=first.id, countdown=2)
                assert sent.pop(first.id) == (_at(32), None)
                assert _queued(store, "job") == (first.id, pytest.approx(3602, abs=0.002))
                job.apply_async((1,), task_id=first.id)
                assert sent.pop(first.id) == (None, None)
                assert _queued(store, "job") == (first.id, pytest.approx(3600, abs=0.002))
            finally:
                job.pop_request()
    finally:
        app.close()


# -- beat's leader lease -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("conf", "ttl", "retry"),
    [
        ({"redlock_beat_ttl": 12}, 12.0, 4.0),
        ({"redlock_ttl": 45}, 45.0, 15.0),
        ({"redlock_ttl": 45, "redlock_beat_ttl": 9}, 9.0, 3.0),
        ({}, 30.0, 10.0),
        ({"redlock_beat_ttl": 0.12}, 0.12, 0.05),
    ],
)
def test_beat_lease_is_redlock_beat_ttl_else_redlock_ttl(
    conf: dict[str, Any], ttl: float, retry: float
) -> None:
    """The leader lease is redlock_beat_ttl, else redlock_ttl (default 30 s), in the leader
    lock's TTL and beat's banner; standbys retry every third of it, never under 50 ms.
    (The scheduler is built on a Redis URL it never contacts: its lock connects lazily,
    and memory:// is refused at start-up, checked last.)"""
    app = Celery(f"beat{uuid.uuid4().hex[:6]}", broker="memory://")
    app.conf.update(redlock_url="redis://127.0.0.1:1/0", **conf)
    scheduler = LeaderScheduler(app)
    try:
        assert scheduler.ttl == ttl
        assert scheduler.retry_interval == pytest.approx(retry)
        assert scheduler.leader_lock.ttl_ms == round(ttl * 1000)
        assert f"(ttl {ttl:g}s)" in scheduler.info
        assert scheduler.records_key == f"redlock:{{{scheduler.lock_name}}}:{RECORDS_SUFFIX}"
    finally:
        scheduler.close()
    in_process = Celery(f"beat{uuid.uuid4().hex[:6]}", broker="memory://")
    in_process.conf.update(redlock_url="memory://beat", **conf)
    with pytest.raises(ConfigError, match="beat's leader election"):
        LeaderScheduler(in_process)


BEAT_TTL = 30.0  # drift 1% + 2 ms = 0.302 s: the local deadline is 29.698 s after acquiring


def _beats(store: Any, lost: list[Any]) -> tuple[Lock, Lock]:
    """A leader and a standby lock as beat builds them (renewal driven by the test)."""
    info = {"role": "beat-leader", "app": "t"}
    leader = Lock(
        store, "beat:leader:t", BEAT_TTL, auto_renew=False, owner_info=info, on_lost=lost.append
    )
    standby = Lock(store, "beat:leader:t", BEAT_TTL, auto_renew=False, owner_info=info)
    return leader, standby


def _renewal_round(lock: Lock) -> None:
    """One round of the renewal thread for *lock*, as ``RenewalManager._round`` runs it."""
    started = time.monotonic()
    lock.expire_if_past(started)
    due = lock.renewal()
    if due is not None:
        token, ms = due
        [outcome] = lock.backend.renew([Renewal(lock.slot, token, ms)])
        lock.renewed(started, token, outcome)


def _taken_over_1_ms_after_the_key_expires(standby: Lock, clock: Any) -> None:
    """From the leader's last refused claim (1 ms past its local deadline, 301 ms before
    its key expires): *standby* is refused with 1 ms left, then with 0 ms (Redis keeps a
    key through its last millisecond), and gets the lock 1 ms later."""
    clock.tick(0.301)
    assert not standby.acquire(blocking=False) and standby.holder_ttl_ms == 1
    clock.tick(0.001)
    assert not standby.acquire(blocking=False) and standby.holder_ttl_ms == 0
    clock.tick(0.001)
    assert standby.acquire(blocking=False)


def test_a_beat_leader_claims_ticks_until_its_local_deadline_and_a_standby_takes_over_at_expiry(
    memory: Any, clock: Any
) -> None:
    """A 30 s leader lease: the standby is told the exact lease left (26 s at +4 s: its
    wait); the leader's tick claims go through at +29.697 s and are refused from +29.698 s
    (ttl - drift) although the key lives on; the standby is refused at +29.999 s (1 ms
    left) and at +30 s (0 ms left: Redis keeps a key through its last millisecond), takes
    over at +30.001 s with the next fence, and loads the last tick claimed."""
    lost: list[Any] = []
    leader, standby = _beats(memory, lost)
    began = time.monotonic()
    assert leader.acquire(blocking=False)
    assert leader.valid_until - began == pytest.approx(29.698, abs=1e-6)
    ticks = LockRecords(leader, RECORDS_SUFFIX)
    clock.tick(4)
    assert not standby.acquire(blocking=False) and standby.holder_ttl_ms == 26_000
    clock.tick(25.697)
    assert ticks.claim("heartbeat", {"at": 29.697}, 1).outcome == "claimed"
    clock.tick(0.001)
    refused = ticks.claim("heartbeat", {"at": 29.698}, 2)
    assert (refused.outcome, refused.detail) == (
        "lost",
        "the lease ran out before a confirmed renewal",
    )
    _taken_over_1_ms_after_the_key_expires(standby, clock)
    assert leader.fence is not None and standby.fence == leader.fence + 1
    [(field, record)] = LockRecords(standby, RECORDS_SUFFIX).load().items()
    assert field == "heartbeat" and '"at":29.697' in record and '"n":1' in record
    assert ticks.claim("heartbeat", {"at": 30.0}, 2).outcome == "lost"
    with pytest.raises(LockLost):
        leader.release()
    standby.release()


def test_a_renewal_round_restarts_the_beat_lease_from_when_the_round_began(
    memory: Any, clock: Any
) -> None:
    """Renewal rounds come every ttl/3 (10 s): the round at +10 s sets the key to a full
    30 s again and the local deadline to +10 + 29.698 s; claims hold until +39.697 s and
    are refused at +39.698 s; the standby gets the lock at +40.001 s, not before."""
    lost: list[Any] = []
    leader, standby = _beats(memory, lost)
    began = time.monotonic()
    assert leader.acquire(blocking=False)
    ticks = LockRecords(leader, RECORDS_SUFFIX)
    clock.tick(BEAT_TTL / 3)
    _renewal_round(leader)
    assert leader.valid_until - began == pytest.approx(39.698, abs=1e-6)
    assert not standby.acquire(blocking=False) and standby.holder_ttl_ms == 30_000
    clock.tick(29.697)
    assert ticks.claim("heartbeat", {"at": 39.697}, 1).outcome == "claimed"
    clock.tick(0.001)
    assert ticks.claim("heartbeat", {"at": 39.698}, 2).outcome == "lost"
    _taken_over_1_ms_after_the_key_expires(standby, clock)
    assert not lost  # the leader was never told: its lease ended, nobody took it early
    standby.release()


def test_a_paused_beat_leader_is_never_renewed_past_its_deadline_and_cannot_claim_after(
    memory: Any, clock: Any
) -> None:
    """A leader paused through its renewal rounds wakes at +29.698 s, its key still alive:
    the round marks it lost (on_lost once) and does not renew it. The standby takes over at
    +30.001 s with the next fence and continues from tick n=42; the old leader's n=43 is
    refused, the new leader's n=43 claimed, a re-claim of n=43 is stale (returning the
    stored record) and n=44 goes through; a release hands over at the same instant."""
    lost: list[Any] = []
    leader, standby = _beats(memory, lost)
    assert leader.acquire(blocking=False)
    old = LockRecords(leader, RECORDS_SUFFIX)
    assert old.claim("heartbeat", {"at": 0}, 42).outcome == "claimed"
    clock.tick(29.698)
    _renewal_round(leader)
    assert leader.lost and leader.lost_reason == "the lease ran out before a confirmed renewal"
    assert lost == [leader]
    assert not standby.acquire(blocking=False) and standby.holder_ttl_ms == 302
    clock.tick(0.303)
    assert standby.acquire(blocking=False)
    assert leader.fence is not None and standby.fence == leader.fence + 1
    new = LockRecords(standby, RECORDS_SUFFIX)
    assert '"n":42' in new.load()["heartbeat"]
    assert old.claim("heartbeat", {"at": 30}, 43).outcome == "lost"
    claimed = new.claim("heartbeat", {"at": 30}, 43)
    assert claimed.outcome == "claimed"
    again = new.claim("heartbeat", {"at": 30.5}, 43)
    assert (again.outcome, again.record) == ("stale", claimed.record)
    assert new.claim("heartbeat", {"at": 40}, 44).outcome == "claimed"
    assert lost == [leader]
    handed = standby.fence
    standby.release()
    successor = Lock(memory, "beat:leader:t", BEAT_TTL, auto_renew=False)
    assert successor.acquire(blocking=False) and successor.fence == handed + 1
    successor.release()
