"""``Semaphore`` against a real redis-server: up to *limit* holders, each with its own permit.

Never more than the limit across processes, owner-checked permits, expired permits
freeing themselves, fences rising across permits, waiting by notification, renewal in
the one batched script per node (with locks alongside), and the Redlock refusal.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from lua import PERMIT_ACQUIRE, run_script
from servers import ClusterSetup, RedisServer, run_forked, wait_for

from celery_redlock import (
    ConfigError,
    Lock,
    LockContended,
    LockLost,
    NotOwned,
    Semaphore,
    connect,
)
from celery_redlock.core.backend import Permits, lacks
from celery_redlock.core.backends import open_backend
from celery_redlock.core.keys import lock_keys
from celery_redlock.core.renewal import get_manager

# --------------------------------------------------------------------------- the limit

PROCESSES = 8
ROUNDS = 200
LIMIT = 3

#: Counts holders in Redis: INCR on entry, DECR on exit, the highest count seen kept.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


def _semaphore_worker(port: int, rounds: int, start: Any) -> None:
    """One competing process: take a permit, count itself in, log the fence, count out."""
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
    enter = client.register_script(_ENTER)
    if not start.wait(30):
        raise SystemExit(4)
    for _ in range(rounds):
        sem = Semaphore(client, "sem:counter", LIMIT, ttl=10)
        if not sem.acquire(timeout=60):
            raise SystemExit(3)
        try:
            enter(keys=["inside", "most"])
            client.rpush("fences", str(sem.fence))
            client.decr("inside")
        finally:
            sem.release()
    client.close()


@pytest.mark.slow
def test_eight_processes_never_hold_more_than_three_permits(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """8 processes x 200 rounds on Semaphore(limit=3): never more than 3 inside, 3 reached,
    every fence distinct."""
    run_forked(_semaphore_worker, (shared_redis.port, ROUNDS), PROCESSES)
    assert int(redis_client.get("most") or 0) == LIMIT
    assert int(redis_client.get("inside") or 0) == 0
    fences = [int(f) for f in redis_client.lrange("fences", 0, -1)]
    assert len(fences) == len(set(fences)) == PROCESSES * ROUNDS
    assert not redis_client.exists("redlock:{sem:counter}:permits")  # all given back


def test_limit_permits_then_contended_with_the_first_to_expire_as_holder(
    redis_client: redis.Redis,
) -> None:
    """Three permits go to three objects; the fourth is refused, told about the permit that
    expires first, and `with` raises LockContended; locked() says when all are taken."""
    sems = [
        Semaphore(redis_client, "sem:three", 3, ttl=5 + i, owner_info={"n": i}, blocking=False)
        for i in range(4)
    ]
    assert not sems[0].locked()
    assert [s.acquire(blocking=False) for s in sems[:3]] == [True, True, True]
    assert sems[0].locked()
    assert not sems[3].acquire(blocking=False)
    assert sems[3].holder["n"] == 0  # the 5 s permit expires first
    assert sems[3].holder_ttl_ms is not None and 4000 < sems[3].holder_ttl_ms <= 5000
    with pytest.raises(LockContended), sems[3]:
        pass
    assert sorted(r["n"] for r in sems[3].read_holders()) == [0, 1, 2]
    sems[1].release()
    assert not sems[0].locked()
    with sems[3] as held:
        assert held.owned() and held.fence is not None
    for s in (sems[0], sems[2]):
        s.release()
    assert not redis_client.exists(sems[0].keys.lock)


def test_fences_rise_across_permits_and_the_locks_of_the_name(redis_client: redis.Redis) -> None:
    """Every permit of a name gets a fence above every earlier one, locks of the name
    included (one counter)."""
    seen: list[int] = []
    lock = Lock(redis_client, "sem:fences")
    for _ in range(3):
        sems = [Semaphore(redis_client, "sem:fences", 2) for _ in range(2)]
        for s in sems:
            assert s.acquire(blocking=False)
            assert s.fence is not None
            seen.append(s.fence)
        for s in sems:
            s.release()
        assert lock.acquire(blocking=False)
        assert lock.fence is not None
        seen.append(lock.fence)
        lock.release()
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


# --------------------------------------------------------------------------- ownership


def test_non_owner_release_and_extend_raise_not_owned(redis_client: redis.Redis) -> None:
    """A Semaphore object that holds no permit cannot release or extend, whatever others hold."""
    holder = Semaphore(redis_client, "sem:owner", 2)
    other = Semaphore(redis_client, "sem:owner", 2)
    assert holder.acquire(blocking=False)
    with pytest.raises(NotOwned):
        other.release()
    with pytest.raises(NotOwned):
        other.extend()
    assert holder.owned() and not other.owned()
    assert len(holder.read_holders()) == 1
    holder.release()


def test_expired_permit_frees_itself_and_its_holder_cannot_touch_the_next(
    redis_client: redis.Redis,
) -> None:
    """A permit left to expire (a paused holder) frees its place within its TTL without
    anyone's help; the successor's fence is higher, and the old holder's release and extend
    raise LockLost and leave the successor's permit alone."""
    paused = Semaphore(redis_client, "sem:expire", 2, ttl=0.3, auto_renew=False)
    other = Semaphore(redis_client, "sem:expire", 2, ttl=10)
    successor = Semaphore(redis_client, "sem:expire", 2, ttl=10)
    assert paused.acquire(blocking=False) and other.acquire(blocking=False)
    assert not successor.acquire(blocking=False)
    began = time.monotonic()
    assert successor.acquire(timeout=2)  # woken by no one: capped at the paused permit's lease
    assert time.monotonic() - began < 0.6
    assert paused.fence is not None and successor.fence is not None
    assert successor.fence > paused.fence
    assert not paused.owned()
    with pytest.raises(LockLost):
        paused.extend()
    with pytest.raises(LockLost):
        paused.release()
    assert other.owned() and successor.owned()
    assert len(successor.read_holders()) == 2
    other.release()
    successor.release()
    assert redis_client.keys("*permits*") == []


def test_a_permit_nobody_releases_leaves_no_key_behind(redis_client: redis.Redis) -> None:
    """The permits key expires with its longest permit: a crashed holder costs no memory."""
    sem = Semaphore(redis_client, "sem:leak", 2, ttl=0.2, auto_renew=False, fence_ttl=0.2)
    assert sem.acquire(blocking=False)
    assert 0 < redis_client.pttl(sem.keys.lock) <= 200
    assert wait_for(lambda: not redis_client.keys("redlock:{sem:leak}*"), timeout=2)


def test_re_sent_acquire_finds_its_own_permit_with_the_same_fence(
    redis_client: redis.Redis,
) -> None:
    """The acquire script run twice with one token (a client re-send) holds one permit."""
    keys = Semaphore(redis_client, "sem:resend", 2).keys
    args = ["t" * 40, 5000, "{}", "0", 0, 2]
    first = run_script(redis_client, PERMIT_ACQUIRE, [keys.lock, keys.fence, keys.waiting], args)
    again = run_script(redis_client, PERMIT_ACQUIRE, [keys.lock, keys.fence, keys.waiting], args)
    assert first == again == [1, 1]
    assert redis_client.hlen(keys.lock) == 1


def test_release_matching_releases_exactly_that_permit(redis_client: redis.Redis) -> None:
    """The main process's release of a dead child's permit (by its holder record) leaves the
    other permits alone."""
    a = Semaphore(redis_client, "sem:match", 3, owner_info={"task_id": "a"})
    b = Semaphore(redis_client, "sem:match", 3, owner_info={"task_id": "b"})
    assert a.acquire(blocking=False) and b.acquire(blocking=False)
    outsider = Semaphore(redis_client, "sem:match", 3, auto_renew=False)
    assert not outsider.release_matching(task_id="c")
    assert outsider.release_matching(task_id="a")
    assert [r["task_id"] for r in outsider.read_holders()] == ["b"]
    assert b.owned()
    b.release()


# --------------------------------------------------------------------------- waiting


def test_two_releases_at_once_wake_two_waiters(redis_client: redis.Redis) -> None:
    """Two permits given back together wake both blocked waiters at once (a notice each),
    long before the holders' leases would have run out."""
    holders = [Semaphore(redis_client, "sem:wake", 2, ttl=30) for _ in range(2)]
    for h in holders:
        assert h.acquire(blocking=False)
    got: list[float] = []

    def wait() -> None:
        sem = Semaphore(redis_client, "sem:wake", 2, ttl=30)
        if sem.acquire(timeout=10):
            got.append(time.monotonic())
            time.sleep(0.2)
            sem.release()

    threads = [threading.Thread(target=wait) for _ in range(2)]
    for t in threads:
        t.start()
    assert wait_for(lambda: int(redis_client.info("clients")["blocked_clients"]) == 2, 5)
    released = time.monotonic()
    for h in holders:
        h.release()
    for t in threads:
        t.join(15)
    assert len(got) == 2
    assert max(got) - released < 1.0


# --------------------------------------------------------------------------- renewal


def test_permits_and_locks_renew_in_one_script_per_round(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """Permits (1 s TTL) held 3 s stay held, renewed with the locks of the process in one
    script per round; a permit past max_hold is not renewed and expires."""
    sems = [Semaphore(redis_client, f"sem:renew:{i % 5}", 4, ttl=1.0) for i in range(20)]
    locks = [Lock(redis_client, f"lock:renew:{i}", ttl=1.0) for i in range(20)]
    capped = Semaphore(redis_client, "sem:capped", 2, ttl=0.6, max_hold=0.3)
    for held in (*sems, *locks, capped):
        assert held.acquire(blocking=False)
    manager = get_manager()
    shared_redis.reset_stats()
    before = manager.rounds
    time.sleep(3.0)
    rounds = manager.rounds - before
    assert rounds >= 5
    assert shared_redis.command_count("evalsha") <= rounds + 1
    assert all(s.owned() for s in sems) and all(lk.owned() for lk in locks)
    assert not any(s.lost for s in sems)
    assert capped.lost and not redis_client.exists(capped.keys.lock)
    for held in (*sems, *locks):
        held.release()


def test_cluster_renews_permits_and_locks_in_one_script_per_node(
    redis_cluster: ClusterSetup,
) -> None:
    """On a Redis Cluster, permits across many slots renew with the locks in one script per
    node per round, and stay held past their TTL."""
    host, port = redis_cluster.startup_nodes[0]
    client = connect(f"redis://{host}:{port}/0", cluster=True)
    names = [f"csem:{i}" for i in range(60)]
    assert len({client.keyslot(lock_keys(n).lock) for n in names}) > 40
    held: list[Lock] = [Semaphore(client, n, 2, ttl=0.9) for n in names]
    held += [Lock(client, f"clock:{i}", ttl=0.9) for i in range(60)]
    for h in held:
        assert h.acquire(blocking=False)
    manager = get_manager()
    assert wait_for(lambda: manager.rounds >= 1, 3)
    for node in redis_cluster.nodes:
        node.reset_stats()
    before = manager.rounds
    assert wait_for(lambda: manager.rounds >= before + 4, 6)
    rounds = manager.rounds - before
    for node in redis_cluster.nodes:
        scripts = node.command_count("evalsha") + node.command_count("eval")
        assert scripts <= rounds + 1, (node, scripts, rounds)
    assert all(h.owned() for h in held)
    for h in held:
        h.release()


# --------------------------------------------------------------------------- Redlock, input


def test_limit_above_one_on_redlock_masters_is_refused_with_the_counter_example(
    redis_servers: Any,
) -> None:
    """Three masters, limit 2: refused with a ConfigError that shows why (A on {1,2}, B on
    {2,3}, C on {1,3}); limit 1 on the same masters is a Redlock mutex and works."""
    clients = [s.client() for s in redis_servers(3)]
    with pytest.raises(ConfigError) as refused:
        Semaphore(clients, "sem:redlock", 2)
    assert str(refused.value) == lacks(open_backend(clients), Permits)
    assert "B on 2 and 3, C on 1 and 3" in str(refused.value)
    mutex = Semaphore(clients, "sem:redlock", 1, ttl=5)
    assert mutex.acquire(blocking=False)
    assert not Lock(clients, "sem:redlock").acquire(blocking=False)  # one and the same lock
    mutex.release()


def test_semaphore_of_one_is_the_lock_of_the_name(redis_client: redis.Redis) -> None:
    """limit=1 uses the lock's own key: it and a Lock of the name exclude each other."""
    sem = Semaphore(redis_client, "sem:one", 1)
    assert sem.keys.lock == Lock(redis_client, "sem:one").keys.lock
    assert sem.acquire(blocking=False)
    assert not Lock(redis_client, "sem:one").acquire(blocking=False)
    sem.release()


@pytest.mark.parametrize("limit", [0, -1, 2.5, True, "3", None])
def test_bad_limit_is_a_config_error_naming_it(redis_client: redis.Redis, limit: Any) -> None:
    """A limit that is not a whole number >= 1 is refused before anything is sent."""
    with pytest.raises(ConfigError, match="limit must be a whole number >= 1"):
        Semaphore(redis_client, "sem:bad", limit)


def test_foreign_data_at_the_permits_key_is_a_config_error(redis_client: redis.Redis) -> None:
    """A string where the permits hash should be is named, not mistaken for an outage."""
    redis_client.set("redlock:{sem:foreign}:permits", "not a hash")
    with pytest.raises(ConfigError, match="sem:foreign"):
        Semaphore(redis_client, "sem:foreign", 2).acquire(blocking=False)
