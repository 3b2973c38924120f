"""The single-node ``Lock`` against a real redis-server.

Mutual exclusion across processes, ownership (threads, forks, expired holders),
millisecond TTLs, idempotent acquire under re-sends, extend never
resurrecting, waiting by notification with O(1) commands, reentrancy, bad input.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from lua import ACQUIRE, EXTEND, RELEASE, run_script
from redis.backoff import NoBackoff
from redis.retry import Retry
from servers import (
    RESEND,
    FaultProxy,
    RedisServer,
    holder_script,
    in_forked_child,
    locked_increment,
    run_forked,
    wait_child,
    wait_for,
)

from celery_redlock import (
    ConfigError,
    Lock,
    LockContended,
    LockLost,
    NotOwned,
    RedlockError,
    StoreUnavailable,
)
from celery_redlock.core import process
from celery_redlock.core.errors import describe_holder
from celery_redlock.core.lease import DEFAULT_FENCE_TTL
from celery_redlock.core.renewal import get_manager

ProxyFactory = Callable[[RedisServer], FaultProxy]


# --------------------------------------------------------------------------- helpers


def blocked_clients(client: redis.Redis) -> int:
    """How many clients the server has parked in a blocking command (BLPOP)."""
    return int(client.info("clients")["blocked_clients"])


def in_other_thread(fn: Callable[[], Any]) -> Any:
    """Run *fn* in a fresh thread; return what it returned or the exception it raised."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(fn)
        exc = future.exception(timeout=20)
        return exc if exc is not None else future.result()


def token_of(client: redis.Redis, lock: Lock) -> bytes | None:
    """The token stored in Redis for *lock*'s key (None when the key is gone)."""
    value = client.hget(lock.keys.lock, "token")
    return value if isinstance(value, bytes) or value is None else str(value).encode()


def held_with_token(client: redis.Redis, name: str, **options: Any) -> tuple[Lock, bytes]:
    """A 10 s Lock (*options* as its own) that holds *name*, taken without waiting, and the
    token Redis stores for it."""
    lock = Lock(client, name, ttl=10, **options)
    assert lock.acquire(blocking=False)
    token = token_of(client, lock)
    assert token is not None
    return lock, token


# --------------------------------------------------------------------------- mutual exclusion

#: Competing processes and their rounds each (they start together: every round contends).
PROCESSES = 8
ROUNDS = 75


def _exclusion_worker(port: int, name: str, rounds: int, start: Any) -> None:
    """One of the competing processes: lock, read-modify-write the counter, log the fence."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
    if not start.wait(30):
        raise SystemExit(4)
    for _ in range(rounds):
        lock = Lock(client, name, ttl=10)
        if not lock.acquire(timeout=60):
            raise SystemExit(3)
        locked_increment(client, lock)
    client.close()


@pytest.mark.slow
def test_eight_processes_never_overlap_and_fences_increase(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """8 processes x 75 locked read/increment/write rounds give 600, fences strictly rising."""
    run_forked(_exclusion_worker, (shared_redis.port, "mutex:counter", ROUNDS), PROCESSES)
    assert int(redis_client.get("counter") or 0) == PROCESSES * ROUNDS
    fences = [int(f) for f in redis_client.lrange("fences", 0, -1)]
    assert len(fences) == PROCESSES * ROUNDS
    assert all(b > a for a, b in itertools.pairwise(fences)), "fence went backwards"


# --------------------------------------------------------------------------- ownership


def test_other_threads_lock_instance_cannot_release_extend_or_take_ours(
    redis_client: redis.Redis,
) -> None:
    """A second Lock on the same name, used from another thread, can't take, release or extend."""
    ours, mine = held_with_token(redis_client, "own:thread", auto_renew=False)
    theirs = Lock(redis_client, "own:thread", ttl=10, auto_renew=False)

    assert in_other_thread(lambda: theirs.acquire(blocking=False)) is False
    assert type(in_other_thread(theirs.release)) is NotOwned
    assert type(in_other_thread(theirs.extend)) is NotOwned
    assert token_of(redis_client, ours) == mine
    assert ours.owned()
    ours.release()
    assert not redis_client.exists(ours.keys.lock)


def test_stale_instance_in_another_thread_is_refused_by_the_server(
    redis_client: redis.Redis,
) -> None:
    """A Lock whose key was force-removed and retaken cannot release/extend the new owner's key."""
    stale = Lock(redis_client, "own:stale", ttl=10, auto_renew=False)
    assert in_other_thread(lambda: stale.acquire(blocking=False)) is True
    redis_client.delete(stale.keys.lock)  # as `celery locks release --force` would
    ours, mine = held_with_token(redis_client, "own:stale", auto_renew=False)
    # stale still believes it holds the lock (its local lease is valid): only the
    # compare-and-act scripts in Redis stand between it and our key.
    assert stale.valid_until > time.monotonic()
    assert isinstance(in_other_thread(stale.extend), LockLost)
    assert isinstance(in_other_thread(stale.release), LockLost)
    assert token_of(redis_client, ours) == mine
    assert redis_client.pttl(ours.keys.lock) > 9000
    ours.release()


def test_same_lock_object_shared_with_another_thread_cannot_be_released_by_a_copy(
    redis_client: redis.Redis,
) -> None:
    """The release script refuses any token but the holder's: raw RELEASE/EXTEND with another."""
    ours, mine = held_with_token(redis_client, "own:raw", auto_renew=False)
    other = "f" * 40
    assert (
        in_other_thread(
            lambda: run_script(
                redis_client,
                RELEASE,
                [ours.keys.lock, ours.keys.notify, ours.keys.waiting, ours.keys.released],
                [other, 1000],
            )
        )
        == -1
    )
    assert (
        in_other_thread(
            lambda: run_script(redis_client, EXTEND, [ours.keys.lock], [other, 99999, "1"])
        )
        == -1
    )
    assert token_of(redis_client, ours) == mine
    assert redis_client.pttl(ours.keys.lock) <= 10000
    assert not redis_client.exists(ours.keys.notify)  # a refused release wakes nobody
    ours.release()


def _forked_child_checks(lock: Lock, port: int, parent_token: bytes) -> int:
    """Runs in the forked child: every way of touching the parent's lock must be refused."""
    try:
        lock.release()
        return 10
    except NotOwned as exc:
        if type(exc) is not NotOwned:
            return 11
    try:
        lock.extend(30)
        return 12
    except NotOwned as exc:
        if type(exc) is not NotOwned:
            return 13
    if lock.owned() or lock.fence is not None or lock.valid_until != 0.0:
        return 14
    if get_manager().held():
        return 15
    direct = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    if direct.hget(lock.keys.lock, "token") != parent_token:
        return 16
    if not direct.pttl(lock.keys.lock) > 0:
        return 17
    return 0


def test_forked_child_cannot_release_or_extend_the_parents_lock(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """In an os.fork() child, release()/extend() raise NotOwned and the key is untouched."""
    lock, mine = held_with_token(redis_client, "own:fork")
    assert in_forked_child(partial(_forked_child_checks, lock, shared_redis.port, mine)) == 0
    assert token_of(redis_client, lock) == mine
    assert lock.owned()
    lock.release()
    assert not redis_client.exists(lock.keys.lock)


def test_the_process_id_the_locks_compare_follows_every_fork() -> None:
    """The lock paths read this process's id from core.process (os.getpid() is a system
    call): a child of os.fork() sees its own id there, and so does its own child."""
    assert process.this.pid == os.getpid()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            code = 0 if process.this.pid == os.getpid() else 20
            if code == 0:
                grandchild = os.fork()
                if grandchild == 0:
                    os._exit(0 if process.this.pid == os.getpid() else 21)
                code = wait_child(grandchild)
        finally:
            os._exit(code)
    assert wait_child(pid) == 0
    assert process.this.pid == os.getpid()


def test_expired_holder_cannot_release_or_extend_the_new_holders_lock(
    redis_client: redis.Redis,
) -> None:
    """A holder whose lease ran out and was taken over gets LockLost; the new key stays intact."""
    old = Lock(redis_client, "own:expired", ttl=0.2, auto_renew=False)
    assert old.acquire(blocking=False)
    old_fence = old.fence
    assert wait_for(lambda: not redis_client.exists(old.keys.lock), timeout=2)
    new = Lock(redis_client, "own:expired", ttl=10, auto_renew=False)
    assert new.acquire(blocking=False)
    assert old_fence is not None and new.fence is not None and new.fence > old_fence
    mine = token_of(redis_client, new)

    with pytest.raises(LockLost, match=r"^lock 'own:expired': "):
        old.extend()
    with pytest.raises(LockLost, match=r"^lock 'own:expired': "):
        old.release()
    assert token_of(redis_client, new) == mine
    assert redis_client.hget(new.keys.lock, "fence") == str(new.fence).encode()
    assert redis_client.pttl(new.keys.lock) > 9000
    assert not old.owned()
    new.release()


# --------------------------------------------------------------------------- TTL in ms


def test_float_ttl_of_a_quarter_second_is_kept_in_milliseconds(redis_client: redis.Redis) -> None:
    """ttl=0.25 s becomes PX 250 in Redis, and the key is gone about 0.3 s later."""
    lock = Lock(redis_client, "ttl:float", ttl=0.25, auto_renew=False)
    started = time.monotonic()
    assert lock.acquire(blocking=False)
    answered = time.monotonic()
    pttl = redis_client.pttl(lock.keys.lock)
    read_ms = (time.monotonic() - started) * 1000
    assert 250 - read_ms - 1 <= pttl <= 250, (pttl, read_ms)  # ~200-250 ms, never whole seconds
    assert lock.ttl_ms == 250
    # The local deadline is the lease minus drift (1% + 2 ms), counted from before the request.
    assert started + 0.2455 <= lock.valid_until <= answered + 0.2455
    time.sleep(max(0.0, answered + 0.3 - time.monotonic()))
    assert not redis_client.exists(lock.keys.lock)
    assert not lock.owned()


def test_extend_after_expiry_raises_lock_lost_and_does_not_recreate_the_key(
    redis_client: redis.Redis,
) -> None:
    """extend() past the lease raises LockLost and leaves no key behind."""
    lock = Lock(redis_client, "ttl:extend-late", ttl=0.1, auto_renew=False)
    assert lock.acquire(blocking=False)
    assert wait_for(lambda: not redis_client.exists(lock.keys.lock), timeout=2)
    with pytest.raises(LockLost):
        lock.extend(10)
    assert not redis_client.exists(lock.keys.lock)
    assert lock.lost


def test_extend_of_a_vanished_key_inside_the_lease_is_refused_by_redis(
    redis_client: redis.Redis,
) -> None:
    """Even with a valid local lease, the extend script never recreates a missing key."""
    lock = Lock(redis_client, "ttl:extend-gone", ttl=10, auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.extend(20, replace=True)
    assert 19000 < redis_client.pttl(lock.keys.lock) <= 20000
    redis_client.delete(lock.keys.lock)
    with pytest.raises(LockLost):
        lock.extend(10)
    assert not redis_client.exists(lock.keys.lock)
    assert not lock.owned()


# --------------------------------------------------------------------------- idempotent acquire


def test_acquire_script_resent_with_the_same_token_reports_success(
    redis_client: redis.Redis,
) -> None:
    """Running ACQUIRE twice with one token: acquired both times, same fence, one INCR."""
    lock = Lock(redis_client, "resend:script", ttl=5, auto_renew=False, fence_ttl=None)
    keys = [lock.keys.lock, lock.keys.fence]
    first = run_script(redis_client, ACQUIRE, keys, ["tok-1", 5000, '{"pid":1}'])
    time.sleep(0.05)
    second = run_script(redis_client, ACQUIRE, keys, ["tok-1", 5000, '{"pid":1}'])
    assert first[0] == 1 and second[0] == 1
    assert first[1] == second[1] == 1
    assert redis_client.get(lock.keys.fence) == b"1"
    assert redis_client.pttl(lock.keys.lock) > 4950  # the re-send reset the lease
    other = run_script(redis_client, ACQUIRE, keys, ["tok-2", 5000, '{"pid":2}'])
    assert other[0] == 0 and b'"pid":1' in other[1] and 0 < other[2] <= 5000
    assert redis_client.get(lock.keys.fence) == b"1"


def test_acquire_resent_after_its_connection_broke_ends_holding_the_lock(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """An acquire whose connection breaks after the server ran it is sent again (the lock
    client's one immediate retry, whatever the user's client's policy); the copy finds its
    own token: held, with the first copy's fence."""
    proxy = fault_proxy(redis_server)
    direct = redis_server.client()
    for script in (ACQUIRE, RELEASE):
        direct.script_load(script.indexed.source)  # the variant a plain Redis runs
    client = proxy.client()  # redis-py's defaults: the lock traffic has a policy of its own
    assert client.ping()
    lock = Lock(client, "resend:held", ttl=10, auto_renew=False, fence_ttl=None)
    redis_server.reset_stats()
    proxy.delay_replies(10)  # the acquire's reply is held back...

    def lose_the_reply() -> None:
        assert wait_for(lambda: direct.exists(lock.keys.lock), timeout=5)
        proxy.heal()  # ...the copy goes straight through
        proxy.drop()  # the held-back reply is lost with its connection

    cutter = threading.Thread(target=lose_the_reply)
    cutter.start()
    try:
        assert lock.acquire(blocking=False)
    finally:
        cutter.join(10)
    assert redis_server.command_count("evalsha") >= 2, "no re-send happened"
    assert lock.owned()  # the token in Redis is this acquisition's
    assert lock.fence == 1 and direct.get(lock.keys.fence) == b"1"
    lock.release()
    assert not direct.exists(lock.keys.lock)


def test_acquire_whose_reply_is_late_raises_and_leaves_no_orphaned_key(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """A reply that never comes in time: acquire raises StoreUnavailable after one socket
    timeout (a timeout is not re-sent), and the hold it may have taken is given back."""
    proxy = fault_proxy(redis_server)
    direct = redis_server.client()
    for script in (ACQUIRE, RELEASE):
        direct.script_load(script.indexed.source)  # the variant a plain Redis runs
    # A short socket timeout of the user's: the lock client keeps the shorter of its own
    # and the user's.
    client = proxy.client(socket_timeout=0.2)
    assert client.ping()
    lock = Lock(client, "resend:gone", ttl=10, auto_renew=False, fence_ttl=None)
    redis_server.reset_stats()
    proxy.delay_replies(0.5)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        lock.acquire(blocking=False)
    assert time.monotonic() - started < 0.45, "the caller waited past one socket timeout"
    proxy.heal()
    assert direct.get(lock.keys.fence) == b"1"  # the acquire ran, once
    # The caller does not hold the lock, and no key is left for anyone to wait on (taken
    # back in the background, so the caller heard at once).
    assert lock.fence is None
    assert wait_for(lambda: not direct.exists(lock.keys.lock), timeout=5)
    assert not lock.owned()


def test_acquire_timing_out_until_the_network_heals_holds_or_leaves_nothing(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """Replies late until 1 s (a client that re-sends on timeouts, as a user may build
    one): the caller holds the lock or the key is gone."""
    proxy = fault_proxy(redis_server)
    direct = redis_server.client()
    for script in (ACQUIRE, RELEASE):
        direct.script_load(script.indexed.source)  # the variant a plain Redis runs
    client = proxy.client(socket_timeout=0.2, retry=Retry(NoBackoff(), 3), **RESEND)
    assert client.ping()
    lock = Lock(client, "resend:heal", ttl=10, auto_renew=False, fence_ttl=None)
    proxy.delay_replies(0.5)
    healer = threading.Timer(1.0, proxy.heal)  # after the acquire gave up, before cleanup did
    healer.start()
    try:
        held = lock.acquire(blocking=False)
    except StoreUnavailable:
        held = False
    finally:
        healer.join(5)
    assert direct.get(lock.keys.fence) == b"1", "the first acquire never reached Redis"
    if held:
        assert lock.owned()
        lock.release()
    else:  # taken back in the background
        assert wait_for(lambda: not direct.exists(lock.keys.lock), 5), "orphaned lock key"


# --------------------------------------------------------------------------- waiting


def test_waiter_gets_the_lock_within_milliseconds_of_the_release(
    redis_client: redis.Redis, shared_redis: RedisServer, record_property: Any
) -> None:
    """A blocked waiter is woken by the release notice: hand-off well under 100 ms."""
    latencies: list[float] = []
    for _ in range(5):
        holder = Lock(redis_client, "wait:handoff", ttl=10, auto_renew=False)
        assert holder.acquire(blocking=False)
        holder_fence = holder.fence or 0
        waiter = Lock(shared_redis.client(), "wait:handoff", ttl=10, auto_renew=False)
        got: dict[str, Any] = {}

        def wait(waiter: Lock = waiter, got: dict[str, Any] = got) -> None:
            got["ok"] = waiter.acquire(timeout=5)
            got["at"] = time.perf_counter()

        thread = threading.Thread(target=wait)
        thread.start()
        assert wait_for(lambda: blocked_clients(redis_client) == 1)
        released = time.perf_counter()
        holder.release()
        thread.join(6)
        assert got.get("ok") is True
        latencies.append(got["at"] - released)
        assert waiter.fence is not None and waiter.fence > holder_fence
        waiter.release()
    record_property("handoff_ms_median", round(statistics.median(latencies) * 1000, 3))
    print(f"hand-off latencies (ms): {[round(x * 1000, 2) for x in latencies]}")
    assert max(latencies) < 0.1, latencies


def test_three_waiters_are_handed_the_lock_one_after_another_by_notices(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """Holder + 3 blocked waiters, 10 s leases: each release wakes the next within ms.

    Only the first release happens while all three wait; the later ones come from
    waiters that took the lock, so the waiter mark must survive each hand-off.
    """
    holder = Lock(redis_client, "wait:chain", ttl=10, auto_renew=False)
    assert holder.acquire(blocking=False)
    order: list[tuple[int, float]] = []
    order_lock = threading.Lock()

    def wait(n: int) -> None:
        lock = Lock(shared_redis.client(), "wait:chain", ttl=10, auto_renew=False)
        if lock.acquire(timeout=8):
            with order_lock:
                order.append((n, time.perf_counter()))
            time.sleep(0.05)  # hold briefly, then hand on to the next waiter
            lock.release()

    threads = [threading.Thread(target=wait, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    assert wait_for(lambda: blocked_clients(redis_client) == 3)
    released = time.perf_counter()
    holder.release()
    for t in threads:
        t.join(10)
    assert len(order) == 3, order
    # Three holds of 50 ms each: the chain ends well under a second, far from the 10 s
    # lease a waiter without a notice would have slept out.
    assert order[-1][1] - released < 1.0, [round(at - released, 3) for _, at in order]
    assert not redis_client.exists(holder.keys.lock)


def test_a_release_nobody_waits_for_pushes_no_notice(redis_client: redis.Redis) -> None:
    """Uncontended and non-blocking contended use leave no :notify list and no waiter mark."""
    lock = Lock(redis_client, "wait:none", ttl=5, auto_renew=False)
    other = Lock(redis_client, "wait:none", ttl=5, auto_renew=False)
    with lock:
        assert other.acquire(blocking=False) is False  # will not wait: marks nothing
        assert not redis_client.exists(lock.keys.waiting)
    assert not redis_client.exists(lock.keys.notify)
    assert not redis_client.exists(lock.keys.lock)


def test_a_waiter_marks_the_lock_for_its_wait_plus_a_second(redis_client: redis.Redis) -> None:
    """A blocking contended attempt leaves a waiter mark outliving the holder's lease."""
    holder = Lock(redis_client, "wait:mark", ttl=3, auto_renew=False)
    assert holder.acquire(blocking=False)
    waiter = Lock(redis_client, "wait:mark", ttl=3, auto_renew=False)
    assert waiter.acquire(timeout=0.2) is False
    mark_ttl = redis_client.pttl(holder.keys.waiting)
    lease_left = redis_client.pttl(holder.keys.lock)
    assert lease_left + 500 < mark_ttl <= lease_left + 1000 + 50, (mark_ttl, lease_left)
    holder.release()
    assert redis_client.llen(holder.keys.notify) == 1  # someone may wait: a notice


def test_waiting_two_seconds_costs_o1_commands(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """A 2 s contended wait is one attempt, one BLPOP, one last attempt: no poll loop."""
    holder = Lock(redis_client, "wait:count", ttl=30, auto_renew=False)
    assert holder.acquire(blocking=False)
    waiter = Lock(shared_redis.client(), "wait:count", ttl=30, auto_renew=False)
    with shared_redis.monitor() as sent:
        started = time.monotonic()
        assert waiter.acquire(timeout=2.0) is False
        waited = time.monotonic() - started
    assert 1.9 <= waited < 3.0
    assert 1 <= sent["EVALSHA"] <= 3, sent
    assert 1 <= sent["BLPOP"] <= 2, sent
    assert waiter.holder.get("pid") == os.getpid()
    holder.release()


_DOOMED_HOLDER = r"""
import sys, time
import redis
from celery_redlock import Lock
port, name = int(sys.argv[1]), sys.argv[2]
client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
lock = Lock(client, name, ttl=1.0)
assert lock.acquire(timeout=5)
client.rpush("holder-ready", str(lock.fence))
time.sleep(30)
"""


@pytest.mark.slow
def test_waiter_gets_the_lock_within_the_remaining_ttl_when_the_holder_is_killed(
    redis_client: redis.Redis, shared_redis: RedisServer, record_property: Any
) -> None:
    """A SIGKILLed holder never releases; the waiter gets in within its remaining TTL, O(1) cmds."""
    name = "wait:dead-holder"
    with holder_script(_DOOMED_HOLDER, shared_redis, name, "holder-ready") as (proc, holder_fence):
        time.sleep(0.5)  # let its renewal thread run a round or two
        proc.kill()
        proc.wait(10)
    killed = time.monotonic()
    remaining = redis_client.pttl(f"redlock:{{{name}}}") / 1000
    assert 0 < remaining <= 1.0
    waiter = Lock(shared_redis.client(), name, ttl=5, auto_renew=False)
    with shared_redis.monitor() as sent:
        assert waiter.acquire(timeout=5)
    took = time.monotonic() - killed
    record_property("dead_holder_takeover_s", round(took, 3))
    assert took <= remaining + 0.5, (took, remaining)
    assert waiter.fence is not None and waiter.fence > holder_fence
    assert sent["EVALSHA"] <= 4, sent
    assert sent["BLPOP"] <= 3, sent
    waiter.release()


# --------------------------------------------------------------------------- reentrancy


def test_reentrant_lock_must_be_released_as_often_as_acquired(redis_client: redis.Redis) -> None:
    """reentrant=True: the same Lock acquires twice; the key stays until the second release."""
    lock = Lock(redis_client, "reentrant", ttl=10, reentrant=True, auto_renew=False)
    assert lock.acquire(blocking=False)
    fence = lock.fence
    assert lock.acquire(blocking=False)
    assert lock.fence == fence
    lock.release()
    assert redis_client.exists(lock.keys.lock)
    assert lock.owned()
    lock.release()
    assert not redis_client.exists(lock.keys.lock)
    with pytest.raises(NotOwned):
        lock.release()


def test_non_reentrant_second_acquire_raises_and_keeps_the_lock(redis_client: redis.Redis) -> None:
    """Without reentrant=True a second acquire by the same Lock is a RedlockError, not a wait."""
    lock = Lock(redis_client, "not-reentrant", ttl=10, auto_renew=False)
    assert lock.acquire(blocking=False)
    with pytest.raises(RedlockError, match="reentrant"):
        lock.acquire(timeout=1)
    assert lock.owned()
    other = Lock(redis_client, "not-reentrant", ttl=10, reentrant=True, auto_renew=False)
    assert other.acquire(blocking=False) is False  # reentrancy is per owner, not per name
    lock.release()
    assert not redis_client.exists(lock.keys.lock)


# --------------------------------------------------------------------------- context manager


def test_with_raises_lock_contended_carrying_the_holders_record(redis_client: redis.Redis) -> None:
    """`with lock:` on a held lock (non-blocking) raises LockContended naming the holder task."""
    holder = Lock(
        redis_client,
        "ctx:held",
        ttl=10,
        auto_renew=False,
        owner_info={"task_name": "proj.sync_user", "task_id": "abc-123"},
    )
    assert holder.acquire()
    contender = Lock(redis_client, "ctx:held", ttl=10, blocking=False, auto_renew=False)
    with pytest.raises(LockContended) as caught, contender:
        pytest.fail("the body must not run")
    err = caught.value
    assert err.name == "ctx:held"
    assert err.holder["task_name"] == "proj.sync_user"
    assert err.holder["task_id"] == "abc-123"
    assert err.holder["pid"] == os.getpid()
    assert "proj.sync_user" in str(err)
    assert err.ttl_ms is not None and 9000 < err.ttl_ms <= 10000, "the holder's lease left"
    assert "ms left" in str(err)
    holder.release()
    with contender:
        assert contender.owned()
    assert not redis_client.exists(contender.keys.lock)


class _NoNotes(Exception):
    """An exception without ``add_note``, as every exception is on Python 3.10."""

    add_note = None


def test_without_add_note_the_loss_under_a_raising_body_is_a_warning(
    redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Where exceptions take no notes (Python 3.10), a with block whose body raised and
    whose lock was lost propagates the body's exception and logs the loss on
    celery_redlock.release."""
    lock = Lock(redis_client, "ctx:no-notes", ttl=0.2, auto_renew=False)
    with caplog.at_level(logging.WARNING, "celery_redlock.release"), pytest.raises(_NoNotes), lock:
        assert wait_for(lambda: not redis_client.exists(lock.keys.lock), 3, "the expiry")
        raise _NoNotes("the body's own error")
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_redlock.release"]
    assert any("after this error raised LockLost" in line for line in lines), lines


def test_holder_without_task_name_is_described_by_task_id_or_as_an_owner() -> None:
    """Log wording: a record with only a task id names it; one with neither says 'an owner'."""
    assert describe_holder({"task_id": "t-1", "pid": 7}) == "task [t-1] pid 7"
    assert describe_holder({"hostname": "vm", "pid": 7}) == "an owner on vm pid 7"
    assert describe_holder({}) == "another owner"


def test_holder_record_in_redis_names_host_pid_time_and_current_owner_info(
    redis_client: redis.Redis,
) -> None:
    """The stored record shows who holds the lock, also after owner_info is edited in place."""
    lock = Lock(
        redis_client,
        "record",
        ttl=10,
        auto_renew=False,
        owner_info={"task_name": "proj.sync", "task_id": "a", "meta": {"n": 1}},
    )
    before = time.time()
    assert lock.acquire(blocking=False)
    first = json.loads(redis_client.hget(lock.keys.lock, "info") or b"{}")
    assert first["hostname"] == socket.gethostname()
    assert first["pid"] == os.getpid()
    assert before - 0.01 <= first["acquired_at"] <= time.time() + 0.01
    assert (first["task_name"], first["task_id"], first["meta"]) == ("proj.sync", "a", {"n": 1})
    lock.release()
    time.sleep(0.01)
    lock.owner_info["task_id"] = "b"
    lock.owner_info["meta"]["n"] = 2
    assert lock.acquire(blocking=False)
    second = json.loads(redis_client.hget(lock.keys.lock, "info") or b"{}")
    assert (second["task_id"], second["meta"]) == ("b", {"n": 2})
    assert second["acquired_at"] > first["acquired_at"]
    lock.release()


_JSON_VALUES = st.one_of(
    st.text(),  # quotes, backslashes, control characters, non-ASCII, surrogates
    st.integers(min_value=-(2**70), max_value=2**70),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.text(max_size=20), _JSON_VALUES, min_size=1, max_size=6))
def test_holder_record_keeps_any_json_owner_info_as_given(
    shared_redis: RedisServer, info: dict[str, Any]
) -> None:
    """Whatever JSON values owner_info holds (quotes, control characters, big ints), the
    stored record parses back to them, next to host, pid and time."""
    client = shared_redis.client()
    reserved = {"hostname", "pid", "acquired_at"}
    lock = Lock(client, "record:any", ttl=5, auto_renew=False, owner_info=info)
    assert lock.acquire(blocking=False)
    try:
        stored = json.loads(client.hget(lock.keys.lock, "info") or b"{}")
    finally:
        lock.release()
        client.close()
    assert {k: stored[k] for k in info} == json.loads(json.dumps(info))
    assert reserved <= set(stored)


# --------------------------------------------------------------------------- fence counter


def test_without_fence_ttl_the_fence_counter_counts_from_one_and_never_expires(
    redis_client: redis.Redis,
) -> None:
    """fence_ttl=None: fences 1, 2, 3 and a counter key without a TTL."""
    lock = Lock(redis_client, "fence:default", ttl=5, auto_renew=False, fence_ttl=None)
    fences = []
    for _ in range(3):
        with lock:
            fences.append(lock.fence)
    assert fences == [1, 2, 3]
    assert redis_client.pttl(lock.keys.fence) == -1


def test_a_fence_counter_with_fence_ttl_expires_and_fences_still_increase(
    redis_client: redis.Redis,
) -> None:
    """fence_ttl=0.5: the counter expires when unused, yet the next fence is higher.

    A counter that is gone restarts from the server clock in microseconds, so it is
    above anything the expired one reached by counting.
    """
    lock = Lock(redis_client, "fence:ttl", ttl=5, auto_renew=False, fence_ttl=0.5)
    before_us = int(time.time() * 1_000_000)
    with lock:
        first = lock.fence
    assert first is not None and first > before_us - 5_000_000  # seeded from the clock
    assert 0 < redis_client.pttl(lock.keys.fence) <= 500
    with lock:
        second = lock.fence
    assert second == first + 1  # within its life, the counter counts
    assert wait_for(lambda: not redis_client.exists(lock.keys.fence), timeout=3)
    with lock:
        third = lock.fence
    assert third is not None and second is not None and third > second
    assert 0 < redis_client.pttl(lock.keys.fence) <= 500


def test_switching_fence_ttl_on_keeps_the_existing_counter_and_gives_it_a_ttl(
    redis_client: redis.Redis,
) -> None:
    """A counter made without fence_ttl keeps counting and gets a TTL on the next acquire."""
    plain = Lock(redis_client, "fence:switch", ttl=5, auto_renew=False, fence_ttl=None)
    with plain:
        assert plain.fence == 1
    timed = Lock(redis_client, "fence:switch", ttl=5, auto_renew=False, fence_ttl=60)
    with timed:
        assert timed.fence == 2
    assert 0 < redis_client.pttl(timed.keys.fence) <= 60_000


def test_by_default_every_key_of_a_lock_expires(redis_client: redis.Redis) -> None:
    """Default options: after a hold and a release, each key left (the fence counter, a
    wake-up notice) has a TTL; the counter's is DEFAULT_FENCE_TTL."""
    lock = Lock(redis_client, "fence:expires", ttl=5, auto_renew=False)
    waiter = Lock(redis_client, "fence:expires", ttl=5, auto_renew=False)
    with lock:
        assert not waiter.acquire(timeout=0.01)  # leaves a waiter mark
    left = [k for k in redis_client.scan_iter("redlock:{fence:expires}*")]
    assert lock.keys.fence.encode() in left
    assert all(redis_client.pttl(k) > 0 for k in left), left
    assert 0 < redis_client.pttl(lock.keys.fence) <= DEFAULT_FENCE_TTL * 1000


def test_thousands_of_names_held_once_leave_no_key_behind(redis_client: redis.Redis) -> None:
    """Bounded memory: 3,000 distinct lock names, each held and released once with a short
    fence_ttl, leave nothing under the prefix once that lifetime has passed."""
    for i in range(3_000):
        lock = Lock(redis_client, f"user:{i}", ttl=5, auto_renew=False, fence_ttl=2.0)
        assert lock.acquire(blocking=False)
        lock.release()
    left = list(redis_client.scan_iter("redlock:{user:*", count=1000))
    assert left  # the counters of the names used last are still there ...
    pipe = redis_client.pipeline(transaction=False)
    for key in left:
        pipe.pttl(key)
    # ... each with its lifetime (-2: it expired between the scan and this look)
    ttls = dict(zip(left, pipe.execute(), strict=True))
    assert all(ms == -2 or 0 <= ms <= 2000 for ms in ttls.values()), {
        k: ms for k, ms in ttls.items() if not (ms == -2 or 0 <= ms <= 2000)
    }
    assert wait_for(lambda: not list(redis_client.scan_iter("redlock:{user:*", count=1000)), 10)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("fence_ttl", [0, -1, "60", float("inf")])
def test_bad_fence_ttl_is_a_config_error_naming_it(
    redis_client: redis.Redis, fence_ttl: Any
) -> None:
    """fence_ttl must be a positive number of seconds (or None)."""
    with pytest.raises(ConfigError) as caught:
        Lock(redis_client, "bad", ttl=5, fence_ttl=fence_ttl)
    assert "fence_ttl" in str(caught.value) and repr(fence_ttl) in str(caught.value)


@pytest.mark.parametrize("ttl", [0, -2.5, 0.0004, float("nan"), "30", None])
def test_bad_ttl_is_a_config_error_naming_the_value(redis_client: redis.Redis, ttl: Any) -> None:
    """ttl <= 0 (or not a number, or under a millisecond) raises ConfigError naming it."""
    with pytest.raises(ConfigError) as caught:
        Lock(redis_client, "bad", ttl=ttl)
    assert repr(ttl) in str(caught.value)


@pytest.mark.parametrize("name", ["", None, 42])
def test_bad_name_is_a_config_error_naming_the_value(redis_client: redis.Redis, name: Any) -> None:
    """An empty or non-string lock name raises ConfigError naming it."""
    with pytest.raises(ConfigError) as caught:
        Lock(redis_client, name)
    assert repr(name) in str(caught.value)


class NotARedis:
    """Something that is not a redis-py client."""


@pytest.mark.parametrize("client", [NotARedis(), "redis://127.0.0.1:6379/0", None])
def test_non_redis_client_is_a_config_error_naming_its_type(client: Any) -> None:
    """Passing anything but a redis-py client raises ConfigError naming what was given."""
    with pytest.raises(ConfigError) as caught:
        Lock(client, "name")
    assert type(client).__name__ in str(caught.value)
