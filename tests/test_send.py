"""The one send path (core/send.py, core/fanout.py) against real servers."""

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
from celery_redlock.core.scripts import RELEASE
from celery_redlock.core.send import Plain, checkout, pack, text_encoding
from celery_redlock.core.stores.redis import RedisStore

ProxyFactory = Callable[[RedisServer], FaultProxy]


def lock_connections(server: RedisServer, name: str) -> int:
    """Connections the server has from clients named *name* (CLIENT SETNAME)."""
    clients = server.client().client_list()
    return sum(1 for c in clients if c.get("name") == name)


def test_lock_traffic_of_one_thread_uses_one_held_connection(redis_server: RedisServer) -> None:
    """200 acquire/release cycles from one thread keep to the one connection the store holds."""
    client = redis.Redis(host=redis_server.host, port=redis_server.port, client_name="held")
    lock = Lock(client, "send:held", ttl=5, auto_renew=False)
    for _ in range(200):
        assert lock.acquire(blocking=False)
        lock.release()
    assert lock_connections(redis_server, "held") == 1


def test_a_server_that_lost_its_scripts_gets_them_sent_whole(redis_client: redis.Redis) -> None:
    """After SCRIPT FLUSH, the next lock call answers NOSCRIPT by sending the script with EVAL
    on the same connection: the caller never sees NOSCRIPT."""
    lock = Lock(redis_client, "send:noscript", ttl=5, auto_renew=False)
    with lock:
        pass
    redis_client.script_flush()
    with lock:
        assert lock.owned()
    assert not redis_client.exists(lock.keys.lock)


def test_a_plain_command_error_reply_leaves_the_connection_in_step(
    redis_client: redis.Redis,
) -> None:
    """An error reply (WRONGTYPE) is raised, and the next command on the same held
    connection gets its own reply, not a leftover."""
    redis_client.set("send:string", "x")
    redis_client.hset("send:hash", "token", "t")
    store = RedisStore.of(redis_client)
    with pytest.raises(redis.ResponseError):
        store.call(Plain("HGET", "send:string", "token"))
    assert store.call(Plain("HGET", "send:hash", "token")) == b"t"


def test_an_exception_between_send_and_read_drops_the_connection(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """An exception landing in the waiting thread (as LockLost does) drops the connection:
    the late reply is never read as the answer to the next command."""
    proxy = fault_proxy(redis_server)
    client = proxy.client(socket_timeout=5)
    client.set("send:a", "first")
    client.set("send:b", "second")
    store = RedisStore.of(client)
    assert store.call(Plain("GET", "send:a")) == b"first"  # the held connection exists
    proxy.delay_replies(0.5)
    caught: list[BaseException] = []

    def waiter() -> None:
        try:
            store.call(Plain("GET", "send:a"))
        except BaseException as exc:  # the interrupt below
            caught.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.1)  # the GET is out, its reply held back by the proxy
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident or 0), ctypes.py_object(KeyboardInterrupt)
    )
    thread.join(5)
    assert caught and isinstance(caught[0], KeyboardInterrupt)
    proxy.heal()
    assert store.call(Plain("GET", "send:b")) == b"second"


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


def test_checkout_passes_a_command_name_only_to_pools_that_need_one(
    redis_server: RedisServer,
) -> None:
    """redis-py < 5.3 requires get_connection(command_name); newer versions take none. The
    signature decides, so locks work on both (and a TypeError is never taken for a sign)."""
    old = OldPool(host=redis_server.host, port=redis_server.port)
    conn = checkout(old)
    old.release(conn)
    assert OldPool.names == ["EVALSHA"]
    lock = Lock(redis.Redis(connection_pool=old), "send:old-pool", ttl=5, auto_renew=False)
    with lock:
        assert lock.owned()
    new = redis.ConnectionPool(host=redis_server.host, port=redis_server.port)
    new.release(checkout(new))


class BrokenPool(redis.ConnectionPool):
    """A pool that fails the way a version mismatch does: a TypeError, not a Redis error."""

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("get_connection() missing 1 required positional argument")


def test_a_bug_or_version_mismatch_is_raised_not_reported_as_redis_down(
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    """A TypeError from inside the client reaches the caller as it is, for Lock and for
    Redlock: it is never turned into QuorumUnavailable (retried forever as "Redis down")."""
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
    give-back release, queued behind the acquire on that master, removes the key there at
    once instead of leaving it for the whole 30 s lease."""
    servers = redis_servers(3)
    proxies = [fault_proxy(s) for s in servers]
    clients = connect([p.url for p in proxies], socket_timeout=2.0)
    lock = Redlock(clients, "send:late", ttl=30, auto_renew=False, per_node_timeout=0.1)
    with lock:  # every master connected, with the scripts loaded
        pass
    members = lock.store.members
    assert wait_for(lambda: all(not m.first_contact and not m.running for m in members), 5)
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


def test_release_script_status_reaches_the_caller_as_sent(redis_client: redis.Redis) -> None:
    """A script call through the store returns the script's own reply (release of a
    missing key: 0), not a translated value."""
    reply = RedisStore.of(redis_client).call(RELEASE(["send:none", "send:none:n"], ["t", 1000]))
    assert reply == 0


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "a" * 40, 2, "redlock:{sync:42}", "redlock:{sync:42}:fence", "tok", 30000),
        ("HMGET", "redlock:{zé}", "token", "info"),
        ("EVAL", "return 1", 0, b"\x00\xff raw", -7, 2.5, 10**20),
        ("SET", "k", ""),
    ],
)
def test_pack_gives_the_bytes_redis_py_would_send(args: tuple[Any, ...], encoding: str) -> None:
    """Our packer writes exactly what redis-py's pack_command writes for the same client
    encoding, for every argument type lock commands use (packing needs no connection)."""
    conn = redis.Connection(encoding=encoding)
    expected = b"".join(conn.pack_command(*args))
    assert pack(args, *text_encoding(conn)) == expected


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_a_lock_name_outside_ascii_is_the_key_redis_py_itself_names(
    redis_server: RedisServer, encoding: str
) -> None:
    """Whatever the client's encoding, and whether redis-py packs commands itself or with
    hiredis (which writes UTF-8 whatever the encoding), the key our scripts write is the
    key redis-py's own commands on that client read."""
    client = redis.Redis(host=redis_server.host, port=redis_server.port, encoding=encoding)
    try:
        for _ in range(3):  # the first call and those on the held connection alike
            with Lock(client, "z\u00e9", ttl=5, auto_renew=False):
                assert client.exists("redlock:{z\u00e9}") == 1
            assert client.exists("redlock:{z\u00e9}") == 0
        assert client.exists("redlock:{z\u00e9}:fence") == 1
        assert client.dbsize() == 1, "a second spelling of the key was written"
    finally:
        client.close()


def test_pack_refuses_what_redis_cannot_store() -> None:
    """A value of a type neither we nor redis-py would send is a TypeError naming it."""
    with pytest.raises(TypeError, match="dict"):
        pack(("SET", "k", {"a": 1}), "utf-8", "strict")
