"""``RateLimiter`` (GCRA) against a real redis-server.

At most rate (+ burst - 1) grants in any period across processes, refusals that consume
nothing and say exactly when the next grant is, one round trip per decision, one key per
name that expires, the line for callers that come back later, and the refusals.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from typing import Any

import pytest
import redis
from servers import RedisServer, wait_for

from celery_redlock import ConfigError, LockEvent, RateLimited, RateLimiter, add_hook, remove_hook
from celery_redlock.core.backend import Rates, lacks
from celery_redlock.core.backends import open_backend
from celery_redlock.core.ratelimit import parse_rate


def test_burst_at_once_then_one_per_interval_and_refusals_consume_nothing(
    redis_client: redis.Redis,
) -> None:
    """burst=3 at 10/s: three grants at once, then refusals that say ~0.1 s; ten refusals
    in a row do not push the next grant later."""
    limiter = RateLimiter(redis_client, "rate:burst", "10/s", burst=3)
    grants = [limiter.acquire() for _ in range(3)]
    assert [g.granted for g in grants] == [True, True, True]
    assert [g.remaining for g in grants] == [2, 1, 0]
    refusals = [limiter.acquire() for _ in range(10)]
    assert not any(refusals)
    first = refusals[0].retry_after
    assert 0.05 < first <= 0.1
    assert refusals[-1].retry_after <= first  # nothing was consumed by the refusals
    time.sleep(refusals[-1].retry_after + 0.005)
    assert limiter.acquire()
    assert not limiter.acquire()


def test_one_round_trip_per_decision(redis_server: RedisServer) -> None:
    """Each non-blocking acquire (granted or refused) and each peek is one script call (on
    a server of its own: the session's shared one also serves what earlier tests left
    running, which a server-wide count would take in)."""
    limiter = RateLimiter(redis_server.client(), "rate:trips", "5/s")
    limiter.acquire()  # loads the script
    redis_server.reset_stats()
    for _ in range(20):
        limiter.acquire()
    limiter.peek()
    assert redis_server.command_count("evalsha") == 21
    assert redis_server.command_count("eval") == 0


def _hammer(port: int, start: Any, seconds: float) -> None:
    """One competing process: blocking acquires for *seconds*, logging each grant's time."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
    limiter = RateLimiter(client, "rate:shared", "50/s", burst=2)
    if not start.wait(30):
        raise SystemExit(4)
    end = time.time() + seconds
    while time.time() < end:
        if limiter.acquire(blocking=True, timeout=1.0):
            client.rpush("grants", repr(time.time()))
    client.close()


@pytest.mark.slow
def test_four_processes_never_exceed_the_rate_in_any_second_and_reach_it(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """4 processes blocking on one 50/s (burst 2) limiter for 2.5 s: no one-second window
    holds more than 50 + 1 grants, and the throughput is at least 90% of the rate."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_hammer, args=(shared_redis.port, start, 2.5)) for _ in range(4)]
    for proc in procs:
        proc.start()
    try:
        start.set()
        for proc in procs:
            proc.join(30)
        assert [p.exitcode for p in procs] == [0] * 4
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    times = sorted(float(t) for t in redis_client.lrange("grants", 0, -1))
    most = max(sum(1 for u in times[i:] if u < t + 1.0) for i, t in enumerate(times))
    assert most <= 50 + 2 - 1 + 1, most  # + 1: a grant's logged time trails its decision
    rate = (len(times) - 2) / (times[-1] - times[0])
    assert rate >= 0.9 * 50, rate


def test_one_key_per_name_that_expires_when_idle(redis_client: redis.Redis) -> None:
    """A limiter keeps one small hash (and is listed in the board's index); both are gone
    once the limiter is empty again."""
    limiters = [RateLimiter(redis_client, f"rate:mem:{i}", "2/s") for i in range(200)]
    for limiter in limiters:
        assert limiter.acquire()
    assert len(redis_client.keys("redlock:{*}:rate")) == 200
    assert sorted(redis_client.keys("redlock:index:*")) == [
        b"redlock:index:rate",
        b"redlock:index:timed",
    ]
    assert max(redis_client.hlen(lim.key) for lim in limiters) <= 3
    assert all(0 < redis_client.pttl(lim.key) <= 501 for lim in limiters)
    assert wait_for(lambda: not redis_client.keys("*"), timeout=3)


def test_callers_that_join_the_line_are_promised_one_slot_each(redis_client: redis.Redis) -> None:
    """Refused callers joining the line are told slots one interval apart, and a newcomer
    meanwhile is put behind them; each coming back at its own slot is granted within a
    fraction of the interval (a short wait for the one before it, never the next slot)."""
    limiter = RateLimiter(redis_client, "rate:line", "10/s")
    assert limiter.acquire(queue=True)
    began = time.monotonic()
    promised, slots = [], []  # each slot as the window of local times it can be at
    for _ in range(4):
        sent = time.monotonic()
        promised.append(limiter.acquire(queue=True))
        answered = time.monotonic()
        slots.append((sent + promised[-1].retry_after, answered + promised[-1].retry_after))
    assert not any(promised)
    waits = [p.retry_after for p in promised]
    # One interval (0.1 s) apart, within 10 ms, whatever each call's round trip took.
    for (a0, a1), (b0, b1) in itertools.pairwise(slots):
        assert b1 - a0 > 0.09 and b0 - a1 < 0.11, slots
    late = []
    for wait in waits:
        time.sleep(max(0.0, began + wait - time.monotonic()))
        assert limiter.acquire(blocking=True, timeout=0.05, queue=False)
        late.append(time.monotonic() - began - wait)
    assert max(late) < 0.05, late
    newcomer = limiter.acquire(queue=True)
    assert not newcomer and newcomer.retry_after > 0


def test_a_slot_whose_caller_does_not_come_back_goes_to_the_next_caller(
    redis_client: redis.Redis,
) -> None:
    """At 2/s (grace 50 ms): a caller promised the next slot never comes back; a newcomer
    asking with queue=True after that slot plus its grace is granted it instead of being
    put behind a line of no one, and the rate still holds (the next grant is an interval
    later)."""
    limiter = RateLimiter(redis_client, "rate:lapse", "2/s")
    assert limiter.grace_us == 50_000
    assert limiter.acquire(queue=True)
    began = time.monotonic()
    promised = limiter.acquire(queue=True)
    assert not promised and 0.4 < promised.retry_after <= 0.5
    time.sleep(promised.retry_after + 0.2)  # past the slot and its grace, before the next
    newcomer = limiter.acquire(queue=True)
    assert newcomer, f"refused {time.monotonic() - began:.3f} s after the first grant"
    after = limiter.acquire()
    assert not after and 0.4 < after.retry_after <= 0.5


def test_blocking_acquire_waits_the_computed_time_and_honours_its_timeout(
    redis_client: redis.Redis,
) -> None:
    """Blocking at 4/s: the second grant comes ~0.25 s after the first; with a timeout
    shorter than that it gives up at once, promised nothing."""
    limiter = RateLimiter(redis_client, "rate:block", "4/s")
    assert limiter.acquire()
    began = time.monotonic()
    refused = limiter.acquire(blocking=True, timeout=0.05)
    assert not refused and time.monotonic() - began < 0.05
    assert b"line" not in redis_client.hgetall(limiter.key)
    assert limiter.acquire(blocking=True, timeout=2)
    assert 0.15 < time.monotonic() - began < 0.4


def test_a_refusal_is_a_rate_limited_event_with_its_retry_after(redis_client: redis.Redis) -> None:
    """Hooks hear of each grant, and of each refused acquire with the time until the next
    slot."""
    seen: list[LockEvent] = []
    add_hook(seen.append)
    try:
        limiter = RateLimiter(redis_client, "rate:events", "1/m")
        assert limiter.acquire()
        refused = limiter.acquire()
    finally:
        remove_hook(seen.append)
    assert [e.kind for e in seen] == ["granted", "rate_limited"]
    assert seen[1].name == "rate:events" and seen[1].key == limiter.key
    assert seen[1].retry_after == refused.retry_after and 59 < refused.retry_after <= 60


def test_rate_limited_error_keeps_its_context_through_pickling() -> None:
    """RateLimited carries the name, retry_after and the rate, also once pickled."""
    import pickle  # noqa: PLC0415 - this test only

    error = pickle.loads(pickle.dumps(RateLimited("api:acme", 1.25, "10/m")))
    assert (error.name, error.retry_after, error.rate) == ("api:acme", 1.25, "10/m")
    assert "1.250 s" in str(error) and "10/m" in str(error)


@pytest.mark.parametrize(
    ("rate", "expected"),
    [("10/s", (10.0, 1.0)), ("5/m", (5.0, 60.0)), (" 2 / h ", (2.0, 3600.0)),
     ("1/d", (1.0, 86400.0)), (0.5, (0.5, 1.0)), (100, (100.0, 1.0))],
)  # fmt: skip
def test_rates_are_read_as_grants_per_period(rate: Any, expected: tuple[float, float]) -> None:
    """N/s, N/m, N/h, N/d and plain numbers per second."""
    assert parse_rate(rate)[:2] == expected


@pytest.mark.parametrize("rate", ["10", "10/w", "ten/s", "0/s", "-1/m", 0, True, None, "1e9/s"])
def test_bad_rates_and_bursts_are_config_errors(redis_client: redis.Redis, rate: Any) -> None:
    """A rate that is not N/period (or is zero, or absurdly fast) is refused when made."""
    with pytest.raises(ConfigError, match="rate"):
        RateLimiter(redis_client, "rate:bad", rate)


@pytest.mark.parametrize("burst", [0, 1.5, "2", False])
def test_bad_burst_is_a_config_error(redis_client: redis.Redis, burst: Any) -> None:
    """burst must be a whole number >= 1."""
    with pytest.raises(ConfigError, match="burst must be a whole number"):
        RateLimiter(redis_client, "rate:bad", "1/s", burst=burst)


def test_redlock_masters_are_refused_with_the_reason(redis_servers: Any) -> None:
    """A rate limiter over a list of masters is refused: majorities count different grants."""
    clients = [s.client() for s in redis_servers(3)]
    with pytest.raises(ConfigError) as refused:
        RateLimiter(clients, "rate:redlock", "10/s")
    assert str(refused.value) == lacks(open_backend(clients), Rates)
    assert "three grants while each master counted two" in str(refused.value)


def test_foreign_data_at_the_key_is_a_config_error(redis_client: redis.Redis) -> None:
    """A list where the limiter's hash should be is named, not taken for an outage."""
    redis_client.rpush("redlock:{rate:foreign}:rate", "x")
    with pytest.raises(ConfigError, match="rate:foreign"):
        RateLimiter(redis_client, "rate:foreign", "1/s").acquire()
