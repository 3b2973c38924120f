"""Faults on clients as users build them: ``redis.Redis(host, port)`` with redis-py's
defaults (redis-py 6+ retries a refused connect three times with backoff; 5.x does not
retry) and ``connect(url)``. Every test starts from the first call after the fault.

What must hold: a dead, frozen or slow master costs a quorum call at most one per-node
timeout whatever the client's retry policy; with a majority alive, acquire is granted,
holds are never lost and a release returns within a per-node timeout; with a majority
dead, ``StoreUnavailable`` within 2 s; ``acquire(timeout=T)`` returns within T and a few
milliseconds. No test here tunes a client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from servers import RedisServer, wait_for

from celery_redlock import Lock, Redlock, StoreUnavailable, connect
from celery_redlock.core.backends.redis.client import checkout
from celery_redlock.core.keys import lock_keys

Servers = Callable[[int], list[RedisServer]]

#: How the user built the clients: redis-py's defaults, or this package's connect().
CLIENTS = ["redis.Redis(host, port)", "connect(url)"]
#: A lease whose per-node timeout (5%) is 250 ms, renewed every 1.7 s.
TTL = 5.0
#: Scheduling slack of a loaded CI machine on top of a bound.
SLACK = 0.1


def clients_for(how: str, servers: list[RedisServer]) -> list[Any]:
    """Clients of *servers* built the way *how* says, nothing tuned."""
    if how == "connect(url)":
        return list(connect([s.url for s in servers]))
    return [redis.Redis(host=s.host, port=s.port) for s in servers]


def warm(clients: list[Any], masters: int) -> None:
    """Lock and release until every master has answered an acquire (in some round: a
    majority decides each): each is heard from, so a call after the fault goes out as in
    steady state."""
    heard: set[str] = set()
    for i in range(50):
        lock = Redlock(clients, f"warm:{i}", ttl=TTL, auto_renew=False)
        assert lock.acquire(blocking=False)
        heard |= {name for name, said in lock.masters.items() if "acquired" in said}
        lock.release()
        # The next round starts once this release reached every master: a master slower
        # than the majority (a loaded machine) would otherwise stay a call behind and never
        # answer a round in time.
        key = lock_keys(f"warm:{i}").lock
        wait_for(lambda key=key: not any(c.exists(key) for c in clients), 3, "the release")
        if len(heard) == masters:
            return
    raise AssertionError(f"a master never answered: {lock.masters}")


def held_on(
    how: str, servers: list[RedisServer], name: str, ttl: float
) -> tuple[list[Any], Redlock]:
    """Warmed clients (:func:`clients_for` *how*, :func:`warm`) of *servers*, and a Redlock
    on them that holds *name* for *ttl* seconds."""
    clients = clients_for(how, servers)
    warm(clients, len(servers))
    holder = Redlock(clients, name, ttl=ttl)
    assert holder.acquire(blocking=False)
    return clients, holder


def fault(server: RedisServer, kind: str) -> None:
    """SIGKILL (*dead*) or SIGSTOP (*frozen*) *server*."""
    if kind == "dead":
        server.kill()
    else:
        server.pause()


def renewal_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The renewal thread's WARNING lines (failed rounds, lost locks)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "celery_redlock.renew" and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("kind", ["dead", "frozen"])
@pytest.mark.parametrize("how", CLIENTS)
def test_minority_down_costs_a_call_at_most_a_per_node_timeout_and_loses_no_hold(
    how: str, kind: str, redis_servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """One of three masters dead or frozen: the first acquire after the fault is granted
    and its release returns within a per-node timeout, and three locks held through it
    (renewed every 1.7 s) are renewed without a failed round and never lost."""
    caplog.set_level(logging.WARNING, logger="celery_redlock.renew")
    servers = redis_servers(3)
    clients = clients_for(how, servers)
    warm(clients, 3)
    held = [Redlock(clients, f"held:{i}", ttl=TTL) for i in range(3)]
    for lock in held:
        assert lock.acquire(blocking=False)
    fault(servers[0], kind)
    try:
        fresh = Redlock(clients, "fresh", ttl=TTL)
        budget = fresh.per_node_timeout + SLACK
        began = time.monotonic()
        assert fresh.acquire(blocking=False), fresh.masters
        assert time.monotonic() - began < budget, "acquire waited on the dead master"
        began = time.monotonic()
        fresh.release()
        assert time.monotonic() - began < budget, "release waited on the dead master"
        # Three renewal rounds with the master still down.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            assert all(lock.owned() for lock in held)
            time.sleep(0.25)
        assert not any(lock.lost for lock in held)
        assert renewal_failures(caplog) == []
    finally:
        servers[0].resume()
        for lock in held:
            lock.release()


@pytest.mark.parametrize("kind", ["dead", "frozen"])
@pytest.mark.parametrize("how", CLIENTS)
def test_majority_down_is_quorum_unavailable_within_two_seconds(
    how: str, kind: str, redis_servers: Servers
) -> None:
    """Two of three masters dead or frozen: the first acquire after the fault, blocking
    with a long timeout, raises StoreUnavailable within 2 s, naming both."""
    servers = redis_servers(3)
    clients = clients_for(how, servers)
    warm(clients, 3)
    for server in servers[:2]:
        fault(server, kind)
    try:
        for name in ("first", "second"):  # the second call too, once they are known bad
            began = time.monotonic()
            with pytest.raises(StoreUnavailable) as caught:  # per-node timeout 500 ms
                Redlock(clients, name, ttl=10).acquire(timeout=30)
            assert time.monotonic() - began < 2.0
            assert caught.value.needed == 2 and caught.value.total == 3
    finally:
        for server in servers[:2]:
            server.resume()


@pytest.mark.parametrize("how", CLIENTS)
def test_five_masters_two_dead_grant_and_time_out_on_time(how: str, redis_servers: Servers) -> None:
    """Five masters, two dead: a free name is granted at once; a held one makes a
    blocking acquire return False at its timeout, not seconds later."""
    servers = redis_servers(5)
    clients, holder = held_on(how, servers, "five:held", 30)
    servers[0].kill()
    servers[1].kill()
    try:
        began = time.monotonic()
        free = Redlock(clients, "five:free", ttl=30)
        assert free.acquire(timeout=3)
        assert time.monotonic() - began < free.per_node_timeout + SLACK
        free.release()
        began = time.monotonic()
        assert not Redlock(clients, "five:held", ttl=30).acquire(timeout=1.0)
        assert 1.0 <= time.monotonic() - began < 1.0 + SLACK
    finally:
        holder.release()


@pytest.mark.parametrize("timeout", [0.5, 1.0])
@pytest.mark.parametrize("how", CLIENTS)
def test_blocking_acquire_returns_at_its_timeout_with_a_master_frozen(
    how: str, timeout: float, redis_servers: Servers
) -> None:
    """The name held elsewhere and one master frozen: acquire(timeout=T) returns False
    within T and a few milliseconds (no last attempt waits a per-node timeout past it)."""
    servers = redis_servers(3)
    clients, holder = held_on(how, servers, "frozen:held", 10)
    servers[0].pause()
    try:
        waiter = Redlock(clients, "frozen:held", ttl=10)  # per-node timeout 500 ms
        began = time.monotonic()
        assert not waiter.acquire(timeout=timeout)
        elapsed = time.monotonic() - began
        assert timeout <= elapsed < timeout + SLACK, elapsed  # a few ms, on a busy CI
    finally:
        servers[0].resume()
        holder.release()


@pytest.mark.parametrize("how", CLIENTS)
def test_one_redis_dead_answers_at_once(how: str, redis_server: RedisServer) -> None:
    """One Redis dead: acquire(timeout=2) raises StoreUnavailable at once (a refused
    connect is not retried with backoff), and owned() of a held lock answers at once
    (from its local deadline, Redis being unable to say)."""
    (client,) = clients_for(how, [redis_server])
    lock = Lock(client, "one:held", ttl=10, auto_renew=False)
    assert lock.acquire(blocking=False)
    redis_server.kill()
    began = time.monotonic()
    with pytest.raises(StoreUnavailable):
        Lock(client, "one:fresh", ttl=10).acquire(timeout=2)
    assert time.monotonic() - began < 0.5
    began = time.monotonic()
    assert lock.owned()
    assert time.monotonic() - began < 0.5


@pytest.mark.parametrize("how", CLIENTS)
def test_one_redis_frozen_is_unavailable_within_the_lock_socket_timeout(
    how: str, redis_server: RedisServer
) -> None:
    """One Redis frozen: acquire raises StoreUnavailable after the lock traffic's socket
    timeout (2 s at most, whatever the client's own), and works again once it resumes."""
    (client,) = clients_for(how, [redis_server])
    with Lock(client, "frozen:warm", ttl=10):
        pass
    redis_server.pause()
    try:
        began = time.monotonic()
        with pytest.raises(StoreUnavailable):
            Lock(client, "frozen:one", ttl=10).acquire(blocking=False)
        assert time.monotonic() - began < 2.0 + 5 * SLACK  # one socket timeout, on a busy CI
    finally:
        redis_server.resume()
    assert wait_for(lambda: Lock(client, "frozen:two", ttl=10).acquire(blocking=False), 5)


def test_the_users_client_keeps_its_own_policy(redis_server: RedisServer) -> None:
    """The lock traffic has connections of its own: the user's pool is left to the user
    (a lock works while the user holds its only connection), and the user's client keeps
    its own settings (retry policy, timeouts, protocol)."""
    client = redis.Redis(host=redis_server.host, port=redis_server.port, max_connections=1)
    settings = dict(client.connection_pool.connection_kwargs)
    user_conn = checkout(client.connection_pool)  # the user's only connection
    try:
        with Lock(client, "own:policy", ttl=5):
            pass  # runs although the user's pool has nothing to give
    finally:
        client.connection_pool.release(user_conn)
    after = client.connection_pool.connection_kwargs
    for key in ("retry", "retry_on_error", "socket_timeout", "socket_connect_timeout"):
        assert after.get(key) is settings.get(key), key
    assert client.set("own:key", 1)


def test_lock_connections_end_with_the_users_client(redis_server: RedisServer) -> None:
    """Clients made and dropped in a loop: the lock traffic's connections go with each
    user's pool, so the server's client list stays flat."""
    import gc  # noqa: PLC0415 - only this test collects

    admin = redis_server.client()
    before = len(admin.client_list())
    for i in range(50):
        client = redis.Redis(host=redis_server.host, port=redis_server.port)
        with Lock(client, f"loop:{i}", ttl=5, auto_renew=False):
            pass
        client.close()
        del client
    gc.collect()
    assert wait_for(lambda: len(admin.client_list()) <= before + 1, 5), admin.client_list()
