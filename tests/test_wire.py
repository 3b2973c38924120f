"""The lean script path (core/_wire.py): one held connection per pool and process.

What could go wrong with a held connection, each against a real server: a late
reply answering the next command, a forked child sharing its parent's socket,
threads interleaving on one socket, a flushed script cache, a client that does
not fit the lean path.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from servers import BARE_CONNECT, FaultProxy, RedisServer, wait_child

from celery_redlock import Lock
from celery_redlock.core import _wire
from celery_redlock.core.scripts import Script

ProxyFactory = Callable[[RedisServer], FaultProxy]

# A script whose reply names its own argument: an answer to the wrong call is visible.
ECHO = Script("<test echo>", source="return ARGV[1]")


def echo(client: redis.Redis, value: str) -> Any:
    """Run the echo script through the lean path."""
    return ECHO(client, ["echo:{k}"], [value])


@pytest.fixture
def alarm() -> Iterator[None]:
    """Restore SIGALRM after a test that interrupts a blocking read with it."""
    previous = signal.getsignal(signal.SIGALRM)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


class Interrupted(Exception):
    """Raised from a signal handler in the middle of a blocking read."""


def test_lean_path_answers_each_call_with_its_own_reply(redis_client: redis.Redis) -> None:
    """500 calls with distinct arguments each get their own answer, on one held connection."""
    for i in range(500):
        assert echo(redis_client, f"v{i}") == f"v{i}".encode()
    held = _wire._held_for(redis_client)
    assert held is not None and held.conn is not None


def test_an_exception_during_the_read_drops_the_connection_so_the_late_reply_is_never_used(
    redis_server: RedisServer, fault_proxy: ProxyFactory, alarm: None
) -> None:
    """Ctrl-C or LockLost raised while a reply is pending: the next call still reads its own."""
    proxy = fault_proxy(redis_server)
    client = proxy.client(socket_timeout=5, retry=Retry(NoBackoff(), 0))
    assert echo(client, "warm") == b"warm"
    held = _wire._held_for(client)
    assert held is not None
    first_conn = held.conn

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    signal.signal(signal.SIGALRM, interrupt)
    proxy.delay_replies(0.5)
    signal.setitimer(signal.ITIMER_REAL, 0.1)  # lands while the read waits for "stale"
    with pytest.raises(Interrupted):
        echo(client, "stale")
    proxy.heal()
    time.sleep(0.6)  # the "stale" reply has arrived by now, on the dropped socket
    for i in range(20):
        assert echo(client, f"fresh{i}") == f"fresh{i}".encode()
    assert held.conn is first_conn  # the same object, reconnected: nothing leaked from the pool


def test_a_timed_out_call_is_not_answered_by_its_late_reply(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """A reply later than socket_timeout (no re-send allowed) raises; the next call is clean."""
    proxy = fault_proxy(redis_server)
    client = proxy.client(socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
    assert echo(client, "warm") == b"warm"
    proxy.delay_replies(0.5)
    with pytest.raises(RedisTimeoutError):
        echo(client, "late")
    proxy.heal()
    time.sleep(0.6)
    assert echo(client, "next") == b"next"


def test_the_clients_retry_policy_re_sends_like_redis_py_does(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """Retry(NoBackoff(), 2), every reply late: the lean path and redis-py's own evalsha both
    run the script 3 times, then raise TimeoutError."""
    proxy = fault_proxy(redis_server)
    client = proxy.client(socket_timeout=0.2, retry=Retry(NoBackoff(), 2), **BARE_CONNECT)
    assert echo(client, "warm") == b"warm"
    sha = client.script_load(ECHO.source)
    counts = []
    for run in (lambda: echo(client, "lean"), lambda: client.evalsha(sha, 1, "e:{k}", "py")):
        redis_server.reset_stats()
        proxy.delay_replies(0.5)
        with pytest.raises(RedisTimeoutError):
            run()
        proxy.heal()
        time.sleep(0.6)  # let the late replies drain before counting and the next round
        counts.append(redis_server.command_count("evalsha"))
    assert counts == [3, 3]


def test_a_forked_child_takes_its_own_connection(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """Parent and fork child run locks at once over one client object: no crossed replies."""
    assert echo(redis_client, "parent") == b"parent"
    held = _wire._held_for(redis_client)
    assert held is not None
    parent_conn = held.conn
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child process
        code = 0
        try:
            for i in range(300):
                if echo(redis_client, f"child{i}") != f"child{i}".encode():
                    code = 3
                    break
            child_held = _wire._held_for(redis_client)
            if child_held is None or child_held.conn is parent_conn:
                code = 4
        except BaseException:
            code = 5
        os._exit(code)
    try:
        for i in range(300):
            assert echo(redis_client, f"parent{i}") == f"parent{i}".encode()
    finally:
        status = wait_child(pid)
    assert status == 0, f"child exit code {status} (3: crossed reply, 4: shared connection)"
    assert _wire._held_for(redis_client) is held and held.conn is parent_conn


def test_threads_sharing_one_client_each_get_their_own_replies(
    redis_client: redis.Redis,
) -> None:
    """8 threads x 200 calls: the busy held connection sends the others to the pool."""
    errors: list[str] = []

    def run(n: int) -> None:
        for i in range(200):
            got = echo(redis_client, f"t{n}-{i}")
            if got != f"t{n}-{i}".encode():
                errors.append(f"thread {n} call {i} got {got!r}")
                return

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_a_flushed_script_cache_is_reloaded_on_the_held_connection(
    redis_client: redis.Redis,
) -> None:
    """SCRIPT FLUSH between two lock cycles: the next acquire loads the script and works."""
    lock = Lock(redis_client, "wire:flush", ttl=5, auto_renew=False)
    with lock:
        pass
    redis_client.script_flush()
    with lock:
        assert lock.fence == 2


def test_lock_cycles_reuse_one_connection(
    shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """200 acquire/release cycles open no new connection after the first."""
    lock = Lock(redis_client, "wire:reuse", ttl=5, auto_renew=False)
    with lock:
        pass
    before = int(shared_redis.client().info("stats")["total_connections_received"])
    for _ in range(200):
        with lock:
            pass
    after = int(shared_redis.client().info("stats")["total_connections_received"])
    assert after - before <= 1  # the one `info` client above


class CountingRedis(redis.Redis):
    """A subclass that wraps execute_command: the lean path must leave it to redis-py."""

    calls = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        """Count, then run the command as usual."""
        CountingRedis.calls += 1
        return super().execute_command(*args, **options)


def test_clients_that_do_not_fit_use_redis_pys_own_evalsha(shared_redis: RedisServer) -> None:
    """A Redis subclass, a single-connection client and a one-connection pool go through
    redis-py's own evalsha."""
    sub = CountingRedis(host="127.0.0.1", port=shared_redis.port)
    assert _wire._held_for(sub) is None
    CountingRedis.calls = 0
    assert echo(sub, "sub") == b"sub"
    assert CountingRedis.calls >= 1
    single = redis.Redis(host="127.0.0.1", port=shared_redis.port, single_connection_client=True)
    assert _wire._held_for(single) is None
    assert echo(single, "single") == b"single"
    one = redis.BlockingConnectionPool(host="127.0.0.1", port=shared_redis.port, max_connections=1)
    tiny = redis.Redis(connection_pool=one)
    assert _wire._held_for(tiny) is None  # holding its only connection would starve it
    assert echo(tiny, "tiny") == b"tiny"
    assert tiny.ping()  # and the pool still has its connection for everything else
    sub.close()
    single.close()
    tiny.close()


def test_arguments_of_every_supported_type_are_sent_as_redis_py_would(
    redis_client: redis.Redis,
) -> None:
    """str (non-ASCII too), bytes, int and float arrive as redis-py's encoder would send them."""
    for value, expected in [
        ("h\u00e9llo \u2603", "h\u00e9llo \u2603".encode()),
        (b"\x00raw\xff", b"\x00raw\xff"),
        (-42, b"-42"),
        (1.5, b"1.5"),
        ("", b""),
    ]:
        assert ECHO(redis_client, ["echo:{k}"], [value]) == expected
    # a type the lean path does not pack falls back to redis-py, which refuses it clearly
    with pytest.raises(redis.DataError):
        ECHO(redis_client, ["echo:{k}"], [None])
