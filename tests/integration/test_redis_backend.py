"""The Redis backend's verbs against real throwaway servers: exact release reports, nothing
held past a call, client-side errors kept apart from an unavailable Redis, one renewal
script per node."""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster
from servers import ClusterSetup, FaultProxy, RedisServer, wait_for

from celery_redlock.core.backend_types import Handover, Renewal, Slot, Status, Superseded
from celery_redlock.core.backends.redis import RedisBackend, cannot_decide, server_refused
from celery_redlock.core.backends.redis.client import lock_client
from celery_redlock.core.errors import ConfigError, StoreUnavailable
from celery_redlock.core.keys import lock_keys, permit_keys, rate_key

RECORD = json.dumps({"hostname": "test", "pid": 1})


def mutex(name: str = "job") -> Slot:
    return Slot(lock_keys(name))


def permits(name: str = "pool", limit: int = 3) -> Slot:
    return Slot(permit_keys(name), limit=limit)


def token() -> str:
    return secrets.token_hex(16)


def take(backend: RedisBackend, slot: Slot, tok: str, ttl_ms: int = 10_000) -> int:
    grant = backend.acquire(slot, tok, ttl_ms, RECORD, wait=False, fence_ttl_ms=0)
    assert grant.acquired, grant
    assert grant.fence is not None
    return grant.fence


def checkout(pool: Any) -> Any:
    """A connection from *pool* through its public API, on any redis-py version."""
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3 needs a command name
        return pool.get_connection("PING")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def backend(redis_client: redis.Redis, shared_redis: RedisServer) -> Iterator[RedisBackend]:
    """A backend on a fresh client of the (flushed) shared server."""
    client = shared_redis.client()
    try:
        yield RedisBackend.of(client)
    finally:
        client.close()


# -- exact release reports ------------------------------------------------------------------
def test_resent_release_is_ok(backend: RedisBackend) -> None:
    """A release sent twice by the same token reports OK both times."""
    slot, tok = mutex(), token()
    take(backend, slot, tok)
    assert backend.release(slot, tok, 10_000) is Status.OK
    assert backend.release(slot, tok, 10_000) is Status.OK


def test_release_after_force_release_is_gone(backend: RedisBackend) -> None:
    """A holder whose lock an operator removed learns it: GONE, not OK."""
    slot, tok = mutex(), token()
    fence = take(backend, slot, tok)
    assert backend.force_release(slot, fence, 1000).outcome == "released"
    assert backend.release(slot, tok, 10_000) is Status.GONE


def test_release_after_another_token_took_it_is_taken(backend: RedisBackend) -> None:
    """A lock taken by another token after a forced release reports TAKEN to the old holder,
    while a re-sent copy of a release that did happen still reports OK."""
    slot, first, second, third = mutex(), token(), token(), token()
    take(backend, slot, first)
    backend.force_release(slot, None, 1000)
    take(backend, slot, second)
    assert backend.release(slot, first, 10_000) is Status.TAKEN
    assert backend.release(slot, second, 10_000) is Status.OK
    take(backend, slot, third)
    assert backend.release(slot, second, 10_000) is Status.OK  # its own, re-sent
    assert [h.token for h in backend.holders(slot)] == [third]


def test_release_after_expiry_is_gone(backend: RedisBackend) -> None:
    """A lease that ran out on the server reports GONE; so does the remembered token once
    its notice time has passed."""
    slot, tok, other = mutex(), token(), token()
    take(backend, slot, tok, ttl_ms=50)
    time.sleep(0.15)
    assert backend.release(slot, tok, 10_000) is Status.GONE
    take(backend, slot, other)
    assert backend.release(slot, other, 50) is Status.OK
    time.sleep(0.15)
    assert backend.release(slot, other, 50) is Status.GONE


def test_permit_release_reports(backend: RedisBackend) -> None:
    """A permit's re-sent release is OK; an expired permit's release is GONE."""
    slot, tok, short = permits(), token(), token()
    take(backend, slot, tok)
    assert backend.release(slot, tok, 10_000) is Status.OK
    assert backend.release(slot, tok, 10_000) is Status.OK
    take(backend, slot, short, ttl_ms=50)
    time.sleep(0.15)
    assert backend.release(slot, short, 10_000) is Status.GONE


def test_resent_release_after_lost_reply(
    shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """A release whose reply was lost (unavailable to the caller) is OK when sent again."""
    proxy = FaultProxy.start(shared_redis.host, shared_redis.port)
    # A short read timeout of the user's (the lock client keeps the shorter of its 2 s and
    # the user's), so the late reply costs the test half a second.
    client = proxy.client(socket_timeout=0.5)
    try:
        backend, slot, tok = RedisBackend.of(client), mutex(), token()
        take(backend, slot, tok)
        proxy.delay_replies(1.5)
        with pytest.raises(StoreUnavailable):
            backend.release(slot, tok, 10_000)
        assert wait_for(lambda: not redis_client.exists(slot.keys.lock), 5, "the release")
        proxy.heal()
        assert backend.release(slot, tok, 10_000) is Status.OK
    finally:
        client.close()
        proxy.stop()


def test_unclear_acquire_is_taken_back(
    shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """An acquire whose reply was lost (the connection reset after the server ran it) raises
    StoreUnavailable, and the token's hold is taken back: nothing is left held."""
    proxy = FaultProxy.start(shared_redis.host, shared_redis.port)
    client = proxy.client(socket_timeout=0.3)
    try:
        backend, slot = RedisBackend.of(client), mutex()
        take(backend, mutex("warm"), token())  # connected, and the script cached
        proxy.delay_replies(10)

        def cut_after_the_script_ran() -> None:
            wait_for(lambda: redis_client.exists(slot.keys.lock), 5, "the lock key")
            # The reply held back is lost with its connection; the lock client's one
            # re-send (which finds its own token) times out too: the acquire is unclear.
            proxy.drop()

        cutter = threading.Thread(target=cut_after_the_script_ran)
        cutter.start()
        with pytest.raises(StoreUnavailable):
            backend.acquire(slot, token(), 30_000, RECORD, wait=False, fence_ttl_ms=0)
        cutter.join()
        proxy.heal()  # the take-back's second try (from the give-back thread) gets through
        assert wait_for(lambda: not redis_client.exists(slot.keys.lock), 5, "the release")
    finally:
        proxy.heal()
        client.close()
        proxy.stop()


# -- nothing held past a call ------------------------------------------------------------
def test_many_calls_on_a_tiny_pool(redis_server: RedisServer) -> None:
    """200 verb calls on a client whose pool allows 2 connections all succeed, and neither
    the server's client list nor this process's open files grow past the pool's 2. (A
    server of its own: other tests' background threads, such as the event log's writer,
    use the shared one.) The bound is the cap, not the count after a first round: a wait
    answered after its slack closes its connection, so that count is 1 or 2 by timing."""
    client = redis_server.client(max_connections=2)
    redis_client = redis_server.client()
    backend = RedisBackend.of(client)
    slot, sem = mutex(), permits()
    clients, fds = len(redis_client.client_list()), open_fds()  # the listing client only

    def round_trip(i: int) -> None:
        tok = token()
        s = sem if i % 2 else slot
        take(backend, s, tok)
        assert backend.holders(s)[0].token == tok
        assert backend.locked(s) is (s is slot)
        assert backend.extend(s, tok, 5000, replace=True) == 5000
        assert backend.renew([Renewal(s, tok, 5000)]) == [Status.OK]
        assert backend.release(s, tok, 1000) is Status.OK

    try:
        round_trip(0)
        backend.wait(slot, 0.01)
        for i in range(1, 34):  # 6 verbs each: 198 calls, and the wait below
            round_trip(i)
        backend.wait(slot, 0.01)
        assert len(redis_client.client_list()) <= clients + 2
        assert open_fds() <= fds + 2
        assert client.ping()  # the user's own client still works
    finally:
        client.close()
        redis_client.close()


def test_exhausted_pool_is_not_unavailable(
    backend: RedisBackend, shared_redis: RedisServer
) -> None:
    """A pool with no connection to give (the lock traffic's own, with the user's cap of
    2) raises the client's own error, not StoreUnavailable, and nothing is taken back
    (nothing was sent)."""
    client = shared_redis.client(max_connections=2)
    pool = lock_client(client).connection_pool
    held = [checkout(pool), checkout(pool)]
    try:
        tiny = RedisBackend.of(client)
        for call in (
            lambda: tiny.acquire(mutex(), token(), 1000, RECORD, wait=False, fence_ttl_ms=0),
            lambda: tiny.holders(mutex()),
            lambda: tiny.wait(mutex(), 0.01),
        ):
            with pytest.raises(redis.exceptions.ConnectionError) as caught:
                call()
            assert not cannot_decide(caught.value)
    finally:
        for conn in held:
            pool.release(conn)
        client.close()


def test_stopped_server_is_unavailable(redis_server: RedisServer) -> None:
    """Every verb on a stopped server raises StoreUnavailable naming its address, at once
    on a client with redis-py's defaults (the lock client retries a refused connect once,
    without the user's backoff)."""
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    backend, slot, tok = RedisBackend.of(client), mutex(), token()
    take(backend, slot, tok)
    redis_server.stop()
    try:
        for call in (
            lambda: backend.acquire(slot, token(), 1000, RECORD, wait=False, fence_ttl_ms=0),
            lambda: backend.release(slot, tok, 1000),
            lambda: backend.renew([Renewal(slot, tok, 1000)]),
            lambda: backend.wait(slot, 0.1),
            lambda: backend.holders(slot),
            lambda: backend.scan("redlock:"),
        ):
            began = time.monotonic()
            with pytest.raises(StoreUnavailable) as caught:
                call()
            assert time.monotonic() - began < 0.5, "waited on redis-py's backoff"
            assert list(caught.value.errors) == [backend.describe()]
    finally:
        client.close()


def test_health_probe_reads_credentials_replica_and_a_stopped_server() -> None:
    """check() says ok for a master, "credentials" for a refused password, "replica" for
    a replica, and "unreachable" (promptly, naming the error) once the server stops."""
    master = RedisServer.start(["--requirepass", "s3cret"])
    replica = RedisServer.start(["--replicaof", master.host, str(master.port)])
    clients = [
        redis.Redis(host=master.host, port=master.port, password="s3cret"),
        redis.Redis(host=master.host, port=master.port, password="wrong"),
        redis.Redis(host=replica.host, port=replica.port),
    ]
    try:
        [ok] = RedisBackend.of(clients[0]).check()
        assert (ok.state, ok.where) == ("ok", RedisBackend.of(clients[0]).describe())
        assert ok.ok
        [refused] = RedisBackend.of(clients[1]).check()
        assert refused.state == "credentials" and refused.detail
        [copy] = RedisBackend.of(clients[2]).check()
        assert copy.state == "replica" and not copy.ok
        master.stop()
        began = time.monotonic()
        [down] = RedisBackend.of(clients[0]).check()
        assert down.state == "unreachable" and down.detail
        assert time.monotonic() - began < 1.0
    finally:
        for client in clients:
            client.close()
        replica.stop()
        master.stop()


def test_wait_returns_on_release_and_gives_its_connection_back(
    shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """A waiter wakes on the holder's release, long before its timeout, and its connection
    is back in the pool afterwards."""
    client = shared_redis.client(max_connections=2)
    backend, slot, tok = RedisBackend.of(client), mutex(), token()
    try:
        take(backend, slot, tok)
        refused = backend.acquire(slot, token(), 10_000, RECORD, wait=True, fence_ttl_ms=0)
        assert not refused.acquired and refused.wait_ms
        timer = threading.Timer(0.3, backend.release, (slot, tok, 10_000))
        timer.start()
        started = time.monotonic()
        backend.wait(slot, 5.0, refused)
        assert 0.2 < time.monotonic() - started < 2.0
        timer.join()
        pool = lock_client(client).connection_pool  # the one the lock traffic uses
        both = [checkout(pool), checkout(pool)]  # nothing is held by the wait
        for conn in both:
            pool.release(conn)
    finally:
        client.close()


# -- renewal -----------------------------------------------------------------------------
def test_renew_of_1000_items_is_one_script(redis_server: RedisServer) -> None:
    """Renewing 1,000 locks and permits on one Redis is one script call, a status each."""
    client = redis_server.client()
    backend = RedisBackend.of(client)
    try:
        items = []
        for i in range(1000):
            slot = mutex(f"job:{i}") if i % 2 else permits(f"pool:{i}")
            tok = token()
            take(backend, slot, tok)
            items.append(Renewal(slot, tok, 20_000))
        items.append(Renewal(mutex("never"), token(), 20_000))
        backend.renew(items[:1])  # the server caches the script
        redis_server.reset_stats()
        statuses = backend.renew(items)
        assert statuses == [Status.OK] * 1000 + [Status.GONE]
        assert redis_server.command_count("evalsha") == 1
        assert redis_server.command_count("eval") == 0
        assert 19_000 < client.pttl(items[1].slot.keys.lock) <= 20_000
    finally:
        client.close()


def test_cluster_renew_and_scan(redis_cluster: ClusterSetup) -> None:
    """On a cluster, renewal is one script per node across slots, a scan finds every lock on
    every primary, and reads and waits go to the node that owns the slot."""
    host, port = redis_cluster.startup_nodes[0]
    client = RedisCluster(host=host, port=port)
    backend = RedisBackend.of(client)
    try:
        items = []
        for i in range(60):
            slot, tok = mutex(f"job:{i}"), token()
            take(backend, slot, tok)
            items.append(Renewal(slot, tok, 20_000))
        assert backend.renew(items) == [Status.OK] * 60  # each node caches the script
        for node in redis_cluster.nodes:
            node.reset_stats()
        assert backend.renew(items) == [Status.OK] * 60
        calls = [n.command_count("evalsha") + n.command_count("eval") for n in redis_cluster.nodes]
        assert calls == [1, 1, 1]
        found = backend.scan("redlock:", "job:*")
        assert sorted(i.name for i in found) == sorted(f"job:{i}" for i in range(60))
        assert [h.token for h in backend.holders(items[1].slot)] == [items[1].token]
        assert [i.name for i in backend.read("redlock:", "job:1")] == ["job:1"]
        backend.wait(items[1].slot, 0.01)  # on the node that owns the slot
        assert backend.release(items[0].slot, items[0].token, 1000) is Status.OK
        assert backend.release(items[0].slot, items[0].token, 1000) is Status.OK
    finally:
        client.close()


# -- reads, queued holds, records, rates, foreign data ------------------------------------
def test_holders_and_locked(backend: RedisBackend) -> None:
    """holders() shows the mutex's holder with fence and lease, permits first to expire
    first; locked() is True only when no permit is left."""
    slot, tok = mutex(), token()
    assert backend.holders(slot) == [] and not backend.locked(slot)
    fence = take(backend, slot, tok)
    (holder,) = backend.holders(slot)
    assert (holder.token, holder.fence, holder.record["hostname"]) == (tok, fence, "test")
    assert holder.ttl_ms is not None and 9000 < holder.ttl_ms <= 10_000
    sem = permits(limit=2)
    long, short = token(), token()
    take(backend, sem, long, 10_000)
    assert not backend.locked(sem)
    take(backend, sem, short, 5000)
    assert backend.locked(sem)
    assert [h.token for h in backend.holders(sem)] == [short, long]
    refused = backend.acquire(sem, token(), 1000, RECORD, wait=False, fence_ttl_ms=0)
    assert not refused.acquired and refused.holder_ttl_ms is not None


def test_queued_hold_and_handover(backend: RedisBackend) -> None:
    """An enqueue-time hold is taken, seen as a duplicate, handed over to the run, and
    removed by force."""
    slot = mutex("sync:1")
    assert (
        backend.enqueue(slot, "t1", 10_000, RECORD, replace=False, running_blocks=True).outcome
        == "queued"
    )
    dup = backend.enqueue(slot, "t2", 10_000, RECORD, replace=False, running_blocks=True)
    assert (dup.outcome, dup.owner, dup.state) == ("duplicate", "t1", "queued")
    refused = backend.take_over(
        slot, token(), 10_000, RECORD, Handover("t2"), wait=False, fence_ttl_ms=0
    )
    assert isinstance(refused, Superseded) and refused.queued_owner == "t1"
    assert backend.take_over(
        slot, token(), 10_000, RECORD, Handover("t1"), wait=False, fence_ttl_ms=0
    ).acquired
    assert backend.dequeue(slot, "t1") is Status.GONE  # handed over: the hold is gone
    backend.enqueue(slot, "t3", 10_000, RECORD, replace=False, running_blocks=False)
    assert [i.state for i in backend.read("redlock:", "sync:1")] == ["held", "queued"]
    assert backend.force_dequeue(slot, "t9").outcome == "refused"
    assert backend.force_dequeue(slot, None).outcome == "released"
    assert backend.force_dequeue(slot, None).outcome == "gone"


def test_records_claim_and_load(backend: RedisBackend) -> None:
    """A claim is written only while the token holds the lock, never over a newer version."""
    slot, tok = mutex("beat"), token()
    fence = take(backend, slot, tok)
    new = json.dumps({"fence": fence, "n": 2})
    assert backend.claim(slot, "ticks", tok, "e", new, (fence, 2)).outcome == "claimed"
    old = json.dumps({"fence": fence, "n": 1})
    stale = backend.claim(slot, "ticks", tok, "e", old, (fence, 1))
    assert (stale.outcome, stale.record) == ("stale", new)
    assert backend.claim(slot, "ticks", token(), "e", old, (fence, 3)).outcome == "lost"
    assert backend.load_records(slot, "ticks") == {"e": new}


def test_rate_and_read_rate(backend: RedisBackend) -> None:
    """A rate limiter grants its burst, then refuses; its state is readable."""
    key = rate_key("api")
    grants = [backend.rate("api", key, 1_000_000, 2, mode="take") for _ in range(3)]
    assert [bool(g) for g in grants] == [True, True, False]
    info = backend.read_rate("redlock:", "api")
    assert info is not None and (info.burst, info.free) == (2, 0)
    assert [i.name for i in backend.scan_rates("redlock:")] == ["api"]


def test_foreign_data(backend: RedisBackend, redis_client: redis.Redis) -> None:
    """Data that is not ours at a lock's keys is a ConfigError (or FOREIGN), never
    StoreUnavailable."""
    slot = mutex("odd")
    redis_client.set(slot.keys.lock, "x")
    with pytest.raises(ConfigError, match="holds a string"):
        backend.acquire(slot, token(), 1000, RECORD, wait=False, fence_ttl_ms=0)
    assert backend.release(slot, token(), 1000) is Status.FOREIGN
    with pytest.raises(ConfigError):
        backend.holders(slot)
    with pytest.raises(ConfigError):
        backend.read("redlock:", "odd")
    redis_client.set(f"{slot.keys.lock}:ticks", "x")
    with pytest.raises(ConfigError, match="not a hash of records"):
        backend.load_records(slot, "ticks")
    redis_client.set(rate_key("odd"), "x")
    with pytest.raises(ConfigError, match="rate limiter"):
        backend.rate("odd", rate_key("odd"), 1000, 1, mode="take")


def test_one_backend_per_client(shared_redis: RedisServer) -> None:
    """of() gives one backend per client object; it holds no connection; a non-redis-py
    client is refused."""
    client = shared_redis.client()
    try:
        assert RedisBackend.of(client) is RedisBackend.of(client)
        assert RedisBackend.of(client) != RedisBackend.of(shared_redis.client())
        assert (
            RedisBackend.of(client).identity() == RedisBackend.of(shared_redis.client()).identity()
        )
        assert RedisBackend.of(client).masters == 1
        with pytest.raises(ConfigError):
            RedisBackend.of(object())
    finally:
        client.close()


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (redis.exceptions.ConnectionError("Error 111 connecting"), True),
        (redis.exceptions.TimeoutError("Timeout reading from socket"), True),
        (redis.exceptions.AuthenticationError("invalid password"), True),
        (TimeoutError("timed out"), True),  # socket.timeout is an alias
        (redis.exceptions.ResponseError("MISCONF Redis is configured to save RDB"), True),
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), True),
        (
            redis.exceptions.ResponseError("Command # 1 (X) of pipeline caused error: MISCONF x"),
            True,
        ),
        (redis.exceptions.ClusterDownError("The cluster is down"), True),
        (redis.exceptions.RedisClusterException("Redis Cluster cannot be connected."), True),
        (redis.exceptions.MaxConnectionsError("Too many connections"), False),
        (redis.exceptions.ConnectionError("Too many connections"), False),
        (redis.exceptions.ConnectionError("No connection available."), False),
        (redis.exceptions.DataError("Invalid input of type: 'dict'"), False),
        (redis.exceptions.ResponseError("WRONGTYPE Operation against a key"), False),
        (redis.exceptions.ResponseError("BUSYKEY Target key name already exists."), False),
        (redis.exceptions.RedisClusterException("all keys must map to the same key slot"), False),
        (ValueError("a bug"), False),
    ],
)
def test_cannot_decide(error: Exception, expected: bool) -> None:
    """Only what a later attempt may mend counts as 'cannot decide' (unavailable)."""
    assert cannot_decide(error) is expected
    if isinstance(error, redis.exceptions.ResponseError):
        assert server_refused(error) is expected
