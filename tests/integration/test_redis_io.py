"""How lock traffic reaches Redis: through the client's own pool, with nothing held
between calls, and errors that are not Redis being down raised as they are."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import redis
from servers import FaultProxy, RedisServer, wait_child, wait_for

from celery_redlock import Lock, Redlock, connect
from celery_redlock.core import ConfigError, Slot, Status, lock_keys
from celery_redlock.core.backends.redis import RedisBackend

ProxyFactory = Callable[[RedisServer], FaultProxy]


def lock_connections(server: RedisServer, name: str) -> int:
    """Connections the server has from clients named *name* (CLIENT SETNAME)."""
    clients = server.client().client_list()
    return sum(1 for c in clients if c.get("name") == name)


def test_lock_traffic_of_one_thread_holds_no_connection_between_calls(
    redis_server: RedisServer,
) -> None:
    """200 acquire/release cycles from one thread on a one-connection pool: the lock
    traffic's own pool (the user's cap of one) gets its connection back after every call,
    and the application's own commands in between keep theirs: two connections in all."""
    client = redis.Redis(
        host=redis_server.host, port=redis_server.port, client_name="held", max_connections=1
    )
    lock = Lock(client, "send:held", ttl=5, auto_renew=False)
    for i in range(200):
        assert lock.acquire(blocking=False)
        assert client.set("send:app", i)  # the user's one connection is the user's
        lock.release()
    assert lock_connections(redis_server, "held") == 2


def test_a_server_that_lost_its_scripts_gets_them_sent_whole(redis_client: redis.Redis) -> None:
    """After SCRIPT FLUSH, the next lock call answers NOSCRIPT by sending the script with EVAL:
    the caller never sees NOSCRIPT."""
    lock = Lock(redis_client, "send:noscript", ttl=5, auto_renew=False)
    with lock:
        pass
    redis_client.script_flush()
    with lock:
        assert lock.owned()
    assert not redis_client.exists(lock.keys.lock)


def test_an_error_reply_leaves_the_connection_in_step(redis_client: redis.Redis) -> None:
    """An error reply (WRONGTYPE: foreign data at the key) is a ConfigError, and the next
    call gets its own reply, not a leftover."""
    redis_client.set("redlock:{send:string}", "x")
    with pytest.raises(ConfigError):
        Lock(redis_client, "send:string", ttl=5, auto_renew=False).acquire(blocking=False)
    with Lock(redis_client, "send:hash", ttl=5, auto_renew=False) as lock:
        assert lock.owned()


def test_an_exception_between_send_and_read_drops_the_connection(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """An exception landing in a thread waiting for a lock's reply (as LockLost does) drops
    that connection: the late reply is never read as the answer to the next command."""
    proxy = fault_proxy(redis_server)
    client = proxy.client(socket_timeout=5, max_connections=1)
    client.set("send:b", "second")
    holder = Lock(client, "send:a", ttl=5, auto_renew=False)
    assert holder.acquire(blocking=False)
    proxy.delay_replies(0.5)
    caught: list[BaseException] = []

    def waiter() -> None:
        try:
            Lock(client, "send:a", ttl=5, auto_renew=False).acquire(blocking=False)
        except BaseException as exc:  # the interrupt below
            caught.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.1)  # the acquire is out, its reply held back by the proxy
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident or 0), ctypes.py_object(KeyboardInterrupt)
    )
    thread.join(5)
    assert caught and isinstance(caught[0], KeyboardInterrupt)
    proxy.heal()
    assert client.get("send:b") == b"second"
    assert holder.owned()
    holder.release()


def test_a_forked_child_uses_a_connection_of_its_own(redis_server: RedisServer) -> None:
    """A child forked while the parent holds a connection takes its own: both can lock,
    and neither reads the other's replies."""
    client = redis.Redis(host=redis_server.host, port=redis_server.port, client_name="fork")
    lock = Lock(client, "send:fork", ttl=5, auto_renew=False)
    with lock:
        pass
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            child = Lock(client, "send:fork:child", ttl=5, auto_renew=False)
            for _ in range(50):
                assert child.acquire(blocking=False)
                child.release()
            code = 0
        finally:
            os._exit(code)
    for _ in range(50):
        assert lock.acquire(blocking=False)
        lock.release()
    assert wait_child(pid) == 0
    with lock:
        assert lock.owned()


class OldPool(redis.ConnectionPool):
    """A pool with redis-py < 5.3's signature: get_connection needs a command name."""

    names: ClassVar[list[str]] = []

    def get_connection(self, command_name: str, *keys: Any, **options: Any) -> Any:  # type: ignore[override]
        self.names.append(command_name)
        try:
            return super().get_connection()
        except TypeError:  # redis-py < 5.3 itself: it wants the name too
            return super().get_connection(command_name)


def test_a_pool_that_needs_a_command_name_serves_a_wait(redis_server: RedisServer) -> None:
    """redis-py < 5.3 requires get_connection(command_name); newer versions take none. The
    signature decides, so the wait for a release notice (the one verb that takes a
    connection from the pool itself) works on both, and gives the connection back."""
    slot = Slot(lock_keys("send:old-pool"))
    old = OldPool(host=redis_server.host, port=redis_server.port, max_connections=1)
    RedisBackend(redis.Redis(connection_pool=old)).wait(slot, 0.05)
    assert OldPool.names == ["BLPOP"]
    assert old.get_connection("PING") is not None  # its one connection was given back
    new = redis.Redis(host=redis_server.host, port=redis_server.port, max_connections=1)
    RedisBackend(new).wait(slot, 0.05)
    assert new.ping()


class BrokenPool(redis.ConnectionPool):
    """A pool that fails the way a version mismatch does: a TypeError, not a Redis error."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("get_connection() missing 1 required positional argument")


def test_a_bug_or_version_mismatch_is_raised_not_reported_as_redis_down(
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    """A TypeError from inside the client reaches the caller as it is, for Lock and for
    Redlock: it is never turned into StoreUnavailable (retried forever as "Redis down")."""
    servers = redis_servers(3)
    broken = redis.Redis(connection_pool=BrokenPool(host=servers[0].host, port=servers[0].port))
    with pytest.raises(TypeError):
        Lock(broken, "send:bug", ttl=5, auto_renew=False).acquire(blocking=False)
    clients = [broken, *(s.client() for s in servers[1:])]
    with pytest.raises(TypeError):
        Redlock(clients, "send:bug", ttl=5, auto_renew=False).acquire(blocking=False)


def test_a_master_that_answers_too_late_is_given_back_its_grant(
    redis_servers: Callable[[int], list[RedisServer]], fault_proxy: ProxyFactory
) -> None:
    """A master slower than the per-node timeout grants after the attempt gave up: the
    give-back release, sent after the acquire on that master answered, removes the key
    there at once instead of leaving it for the whole 30 s lease."""
    servers = redis_servers(3)
    proxies = [fault_proxy(s) for s in servers]
    clients = connect([p.url for p in proxies], socket_timeout=2.0)
    lock = Redlock(clients, "send:late", ttl=30, auto_renew=False, per_node_timeout=0.1)
    with lock:  # every master connected, with the scripts loaded
        pass
    backend: Any = lock.backend
    assert wait_for(lambda: not any(backend.in_flight(i) for i in range(3)), 5)
    blocker = Lock(clients[1], "send:late", ttl=30, auto_renew=False, owner_info={"x": 1})
    other = Lock(clients[2], "send:late", ttl=30, auto_renew=False, owner_info={"x": 2})
    assert blocker.acquire(blocking=False) and other.acquire(blocking=False)
    fence_before = int(servers[0].client().get(lock.keys.fence))
    proxies[0].delay(0.4)  # master 0 grants, but only after the attempt gave up on it
    assert not lock.acquire(blocking=False)
    assert "no answer" in lock.masters[f"127.0.0.1:{proxies[0].port}/0"]
    # The acquire ran there (late), then the release behind it: nothing is left.
    assert wait_for(lambda: int(servers[0].client().get(lock.keys.fence)) > fence_before, 5)
    assert wait_for(lambda: not servers[0].client().exists(lock.keys.lock), timeout=5)
    proxies[0].heal()
    blocker.release()
    other.release()


def test_release_status_reaches_the_caller_as_the_script_said(redis_client: redis.Redis) -> None:
    """A release of a lock nobody holds (and this token never released) is GONE, as the
    script said: not OK, not an error."""
    backend = RedisBackend.of(redis_client)
    assert backend.release(Slot(lock_keys("send:none")), "t", 1000) is Status.GONE


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_a_lock_name_outside_ascii_is_the_key_redis_py_itself_names(
    redis_server: RedisServer, encoding: str
) -> None:
    """Whatever the client's encoding, and whether redis-py packs commands itself or with
    hiredis (which writes UTF-8 whatever the encoding), the key our scripts write is the
    key redis-py's own commands on that client read."""
    client = redis.Redis(host=redis_server.host, port=redis_server.port, encoding=encoding)
    try:
        for _ in range(3):  # the first call (loads the scripts) and later ones alike
            with Lock(client, "z\u00e9", ttl=5, auto_renew=False):
                assert client.exists("redlock:{z\u00e9}") == 1
            assert client.exists("redlock:{z\u00e9}") == 0
        assert client.exists("redlock:{z\u00e9}:fence") == 1
        assert client.exists("redlock:{z\u00e9}:recent") == 1
        assert client.dbsize() == 2, "a second spelling of a key was written"
    finally:
        client.close()
