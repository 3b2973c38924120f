"""The lean script path (core/_wire.py): one held connection per pool and process.

What could go wrong with a held connection, each against a real server: a late
reply answering the next command, a forked child sharing its parent's socket,
threads interleaving on one socket, a flushed script cache, a client that does
not fit the lean path.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import redis
from redis.backoff import AbstractBackoff, NoBackoff
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


@pytest.mark.skipif(not _wire._KERNEL_TIMEOUTS, reason="kernel socket timeouts: Linux only")
def test_the_held_socket_keeps_its_timeout_in_the_kernel_and_it_still_fires(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """The held socket is blocking (no poll before each send and recv) with socket_timeout
    as SO_RCVTIMEO/SO_SNDTIMEO, and a reply later than that still raises TimeoutError in
    about socket_timeout, not later."""
    proxy = fault_proxy(redis_server)
    client = proxy.client(socket_timeout=0.25, retry=Retry(NoBackoff(), 0))
    assert echo(client, "warm") == b"warm"
    held = _wire._held_for(client)
    assert held is not None and held.sock is not None
    assert held.sock.gettimeout() is None  # blocking: Python polls no more
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        seconds, micros = struct.unpack("ll", held.sock.getsockopt(socket.SOL_SOCKET, option, 16))
        assert seconds + micros / 1e6 == pytest.approx(0.25, abs=0.005)
    proxy.delay_replies(1.0)
    started = time.monotonic()
    with pytest.raises(RedisTimeoutError, match="Timeout reading from socket"):
        echo(client, "late")
    assert 0.2 <= time.monotonic() - started < 0.6
    proxy.heal()
    time.sleep(1.1)
    assert echo(client, "next") == b"next"  # a fresh socket, set up the same way
    assert held.sock.gettimeout() is None


@pytest.mark.skipif(not _wire._KERNEL_TIMEOUTS, reason="kernel socket timeouts: Linux only")
@pytest.mark.parametrize("timeout", [0.25, 2.0, 1.9999999, 1e-9])
def test_a_timeout_becomes_a_valid_kernel_time_value(timeout: float) -> None:
    """The kernel takes the value (microseconds below one second) and keeps the limit, a
    tiny timeout included (0 would mean no limit at all). It rounds up to its clock
    tick, so what it reports back may be a few milliseconds longer."""
    ours, other = socket.socketpair()
    with ours, other:
        ours.settimeout(timeout)
        _wire._kernel_timeouts(ours)
        assert ours.gettimeout() is None  # the kernel has the limit now, not Python
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            seconds, micros = struct.unpack("ll", ours.getsockopt(socket.SOL_SOCKET, option, 16))
            assert 0 <= micros < 1_000_000
            assert max(timeout, 1e-6) - 1e-6 <= seconds + micros / 1e6 <= timeout + 0.011


def test_a_client_without_socket_timeout_keeps_a_blocking_socket_and_no_kernel_limit(
    redis_server: RedisServer,
) -> None:
    """No socket_timeout means no limit: nothing is invented for the held socket."""
    client = redis_server.client(socket_timeout=None)
    assert echo(client, "x") == b"x"
    held = _wire._held_for(client)
    assert held is not None and held.sock is not None
    assert held.sock.gettimeout() is None
    assert held.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == bytes(16)
    client.close()


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


def test_a_held_connection_killed_by_the_server_is_re_sent_on_a_fresh_one(
    redis_server: RedisServer,
) -> None:
    """CLIENT KILL of the held connection: the next call fails on the dead socket, the
    client's retry policy reconnects and re-sends once, and the call answers; with no
    re-send allowed the same call raises redis-py's ConnectionError, not a socket error."""
    for retries, expect_answer in ((1, True), (0, False)):
        client = redis.Redis(
            host="127.0.0.1",
            port=redis_server.port,
            socket_timeout=5,
            retry=Retry(NoBackoff(), retries),
        )
        assert echo(client, "warm") == b"warm"
        held = _wire._held_for(client)
        assert held is not None and held.sock is not None  # the fast path applies next
        held.conn.send_command("CLIENT", "ID")
        my_id = int(held.conn.read_response())
        other = redis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=5)
        assert other.client_kill_filter(_id=my_id) == 1
        other.close()
        time.sleep(0.05)  # the server has closed its end
        if expect_answer:
            assert echo(client, "after kill") == b"after kill"
            assert held.sock is not None and held.sock is held.conn._sock  # a new socket
        else:
            with pytest.raises(redis.ConnectionError):
                echo(client, "after kill")
            assert echo(client, "then") == b"then"  # reconnects on the next call
        client.close()


def test_socket_errors_from_a_send_are_reported_as_redis_py_reports_them() -> None:
    """The fast path maps sendall's errors the way send_packed_command does, so the retry
    policy (which picks errors by type) sees the same types."""
    timeout = _wire._as_send_error(TimeoutError("timed out"))
    assert type(timeout) is RedisTimeoutError
    assert str(timeout) == "Timeout writing to socket"
    # SO_SNDTIMEO running out on a held socket (see _kernel_timeouts) is a timeout too.
    kernel = _wire._as_send_error(BlockingIOError(11, "Resource temporarily unavailable"))
    assert type(kernel) is RedisTimeoutError
    assert str(kernel) == "Timeout writing to socket"
    reset = _wire._as_send_error(ConnectionResetError(104, "Connection reset by peer"))
    assert type(reset) is redis.ConnectionError
    assert str(reset) == "Error 104 while writing to socket. Connection reset by peer."
    odd = _wire._as_send_error(OSError("weird"))
    assert str(odd) == "Error UNKNOWN while writing to socket. weird."
    other = ValueError("not a socket error")
    assert _wire._as_send_error(other) is other


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


class RecordingBackoff(AbstractBackoff):
    """No sleeping; records every reset() and compute(failures) the retry policy makes (in a
    class attribute: each connection works on its own deep copy of the client's Retry)."""

    log: ClassVar[list[Any]] = []

    def reset(self) -> None:
        RecordingBackoff.log.append("reset")

    def compute(self, failures: int) -> float:
        RecordingBackoff.log.append(failures)
        return 0


def test_the_retry_policy_sees_the_same_failures_and_backoffs_as_in_redis_py(
    redis_server: RedisServer, fault_proxy: ProxyFactory
) -> None:
    """Every reply late, Retry(backoff, 2): the lean path runs its first attempt outside
    call_with_retry and replays that failure into it, so the backoff is asked for exactly
    what redis-py's own evalsha asks it for: compute(1), then compute(2)."""
    proxy = fault_proxy(redis_server)
    backoff = RecordingBackoff
    client = proxy.client(socket_timeout=0.2, retry=Retry(backoff(), 2), **BARE_CONNECT)
    assert echo(client, "warm") == b"warm"
    backoff.log.clear()
    assert echo(client, "warm again") == b"warm again"
    assert backoff.log == []  # a first attempt that succeeds never involves the policy
    sha = client.script_load(ECHO.source)
    logs = []
    for run in (lambda: echo(client, "lean"), lambda: client.evalsha(sha, 1, "e:{k}", "py")):
        backoff.log.clear()
        proxy.delay_replies(0.5)
        with pytest.raises(RedisTimeoutError):
            run()
        proxy.heal()
        time.sleep(0.6)
        logs.append(list(backoff.log))
    # reset() also runs inside each reconnect (redis-py's connect() has its own retry), and
    # which connection is fresh differs between the paths; the backoffs asked for do not.
    lean, py = ([entry for entry in log if entry != "reset"] for log in logs)
    assert lean == py == [1, 2]
    assert logs[0][0] == "reset"  # the policy starts clean before the failure is counted


class CountingRetry(Retry):
    """A Retry subclass: it may do its own thing per attempt, so it must see every one."""

    calls = 0

    def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        """Count, then retry as usual."""
        CountingRetry.calls += 1
        return super().call_with_retry(do, fail, *args, **kwargs)


def test_a_custom_retry_class_runs_every_call(redis_client: redis.Redis) -> None:
    """A subclass of Retry gets every lean-path call through its own call_with_retry."""
    pool = redis.ConnectionPool(
        **{**redis_client.connection_pool.connection_kwargs, "retry": CountingRetry(NoBackoff(), 1)}
    )
    client = redis.Redis(connection_pool=pool)
    assert _wire._held_for(client) is not None
    assert echo(client, "a") == b"a"  # connects (the connection's own connect may count too)
    CountingRetry.calls = 0
    for value in ("b", "c", "d"):
        assert echo(client, value) == value.encode()
    assert CountingRetry.calls == 3
    client.close()
    pool.disconnect()


def test_the_held_connection_goes_with_its_pool(shared_redis: RedisServer) -> None:
    """The record of the held connection lives on the pool: a pool nobody uses any more is
    collected (with its held connection), not kept alive by celery-redlock."""
    pool = redis.ConnectionPool(host="127.0.0.1", port=shared_redis.port)
    client = redis.Redis(connection_pool=pool)
    assert echo(client, "x") == b"x"
    assert _wire._held_for(client) is not None
    gone = weakref.ref(pool)
    del client, pool
    gc.collect()
    assert gone() is None


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


def test_ascii_arguments_are_packed_as_the_general_packer_packs_them() -> None:
    """_bulk_ascii gives _bulk's bytes for ASCII str and int, and None for anything else;
    only encodings that write ASCII text as ASCII bytes use it."""
    samples: list[tuple[Any, ...]] = [
        ("redlock:{k:1}", "redlock:{k:1}:fence", "a" * 40, 30000, '{"pid":1,"x":"y"}', "0", 0),
        ("", -42, 10**30, "\x00\x7f"),
        (),
    ]
    for values in samples:
        assert _wire._bulk_ascii(values) == _wire._bulk(values, "utf-8", "strict")
    for odd in ["h\u00e9llo", b"raw", 1.5, True, None]:
        assert _wire._bulk_ascii(("k", odd)) is None
    assert _wire._ascii_superset("utf-8") and _wire._ascii_superset("latin-1")
    assert not _wire._ascii_superset("utf-16") and not _wire._ascii_superset("no-such")


def test_a_client_whose_encoding_is_not_ascii_compatible_sends_what_redis_py_would(
    shared_redis: RedisServer,
) -> None:
    """encoding='utf-16' never takes the ASCII path: the script gets the UTF-16 bytes."""
    client = redis.Redis(host="127.0.0.1", port=shared_redis.port, encoding="utf-16")
    held = _wire._held_for(client)
    assert held is not None and not held.ascii
    assert ECHO(client, ["echo:{k}"], ["abc"]) == "abc".encode("utf-16")
    client.close()


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


# -- our own reply reader ---------------------------------------------------------------------
#: Scripts whose replies cover every RESP type a script can return: nested arrays, nils,
#: status and error replies, Lua errors, a reply larger than one socket read, non-ASCII,
#: and (with redis.setresp(3), to a RESP3 client) maps, sets, doubles and booleans.
REPLY_SHAPES = {
    "integer": "return 7",
    "negative integer": "return -1",
    "two integers": "return {1, 7}",
    "two integers, one negative": "return {0, -5}",
    "three integers": "return {1, 2, 3}",
    "integer and text": "return {1, 'x'}",
    "nested": "return {1, 'two', {3, 'four', {}}}",
    "nil": "return false",
    "empty": "return {}",
    "truncated at nil": "return {1, false, 'x'}",
    "true": "return true",
    "float to int": "return 3.99",
    "status": "return {ok='fine'}",
    "error reply": "return redis.error_reply('MYERR custom text')",
    "err table": "return {err='NOTMINE not yours'}",
    "lua error": "error('boom')",
    "non-ascii": "return ARGV[1]",
    "big bulk": "return string.rep('a', 300000)",
    "hash": "return redis.call('HGETALL', KEYS[1])",
    "resp3 map": "redis.setresp(3); return redis.call('HGETALL', KEYS[1])",
    "resp3 set": "redis.setresp(3); return redis.call('SMEMBERS', KEYS[2])",
    "resp3 double": "redis.setresp(3); return redis.call('ZSCORE', KEYS[2] .. ':z', 'm')",
    "resp3 null": "redis.setresp(3); return redis.call('GET', KEYS[1] .. ':none')",
}


def _outcome(run: Callable[..., Any], *args: Any) -> Any:
    """run(*args)'s reply, or (type, message) of the error it raised."""
    try:
        return run(*args)
    except redis.RedisError as exc:
        return (type(exc), str(exc))


@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decoded"])
@pytest.mark.parametrize("protocol", [2, 3])
def test_our_reader_returns_what_redis_pys_parser_returns(
    shared_redis: RedisServer, protocol: int, decode: bool
) -> None:
    """Every reply shape, over RESP2 and RESP3, as bytes and decoded: the lean path (our own
    reader on the held connection) and redis-py's evalsha give the same value or error."""
    client = shared_redis.client(protocol=protocol, decode_responses=decode)
    setup = shared_redis.client()
    setup.hset("shape:{k}", mapping={"a": "1", "b": "\u00e9"})
    setup.sadd("shape:{k}:s", "x", "y")
    setup.zadd("shape:{k}:s:z", {"m": 1.5})
    keys, args = ["shape:{k}", "shape:{k}:s"], ["h\u00e9llo \u2603"]
    try:
        assert echo(client, "warm") in (b"warm", "warm")
        held = _wire._held_for(client)
        assert held is not None and held.sock is held.conn._sock  # the reader is in use
        for name, source in REPLY_SHAPES.items():
            script = Script(f"<shape {name}>", source=source)
            lean = _outcome(script, client, keys, args)
            theirs = _outcome(client.evalsha, script.sha, 2, *keys, *args)
            assert lean == theirs, name
            assert echo(client, name) in (name.encode(), name)  # still in step afterwards
    finally:
        setup.delete("shape:{k}", "shape:{k}:s", "shape:{k}:s:z")
        setup.close()
        client.close()


def test_a_push_frame_before_the_reply_is_passed_on_and_the_reply_still_read(
    shared_redis: RedisServer,
) -> None:
    """RESP3 client tracking on the held connection: an invalidation push that arrives before
    a script's reply goes to redis-py's push handler, and the reply is read after it."""
    client = shared_redis.client(protocol=3)
    other = shared_redis.client()
    try:
        assert echo(client, "warm") == b"warm"
        held = _wire._held_for(client)
        assert held is not None and held.conn is not None
        seen: list[Any] = []
        held.conn._parser.set_invalidation_push_handler(seen.append)
        held.conn.send_command("CLIENT", "TRACKING", "ON")
        assert held.conn.read_response() in (b"OK", "OK")
        other.set("push:{k}", "v1")
        held.conn.send_command("GET", "push:{k}")  # a plain read: tracked for this connection
        assert held.conn.read_response() == b"v1"
        other.set("push:{k}", "v2")  # the server pushes an invalidation to the held one
        time.sleep(0.2)
        reader = Script("<read>", source="return redis.call('GET', KEYS[1])")
        assert reader(client, ["push:{k}"], []) == b"v2"
        assert seen and b"invalidate" in [item for item in seen[0] if isinstance(item, bytes)]
        assert echo(client, "after") == b"after"
    finally:
        other.delete("push:{k}")
        other.close()
        client.close()


def test_replies_split_at_every_byte_are_parsed_when_complete() -> None:
    """_parse asks for more bytes (never guesses) until a reply is whole, at every split."""
    parser = redis.Redis().connection_pool.make_connection()._parser
    replies = {
        b"*3\r\n:0\r\n$6\r\nh\xc3\xa9llo\r\n:1500\r\n": [0, b"h\xc3\xa9llo", 1500],
        b"*2\r\n:1\r\n*2\r\n$-1\r\n_\r\n": [1, [None, None]],
        b"%1\r\n+a\r\n#t\r\n": {b"a": True},
        b",1.5\r\n": 1.5,
        b"=8\r\ntxt:abcd\r\n": b"abcd",
    }
    for raw, expected in replies.items():
        for cut in range(len(raw)):
            with pytest.raises(_wire._Incomplete):
                _wire._parse(raw[:cut], 0, parser, None)
        assert _wire._parse(raw, 0, parser, None) == (expected, len(raw))


def test_the_integer_fast_path_reads_only_whole_integer_replies() -> None:
    """_integers takes exactly a whole ``:n`` or ``*2 :a :b`` reply and gives what _parse gives;
    a cut reply, two replies in one read, or any other shape is left to _parse (None)."""
    parser = redis.Redis().connection_pool.make_connection()._parser
    taken = [b":1\r\n", b":-1\r\n", b":0\r\n", b"*2\r\n:1\r\n:12345\r\n", b"*2\r\n:0\r\n:-7\r\n"]
    for raw in taken:
        assert _wire._integers(raw) == _wire._parse(raw, 0, parser, None)[0], raw
        for cut in range(1, len(raw)):
            assert _wire._integers(raw[:cut]) is None, (raw, cut)
    left = [
        b":1\r\n:2\r\n",  # two replies in one read: the reader must see the extra one
        b"*2\r\n:1\r\n:2\r\n:3\r\n",
        b"*3\r\n:1\r\n:2\r\n:3\r\n",
        b"*2\r\n:1\r\n$1\r\nx\r\n",
        b"*2\r\n$1\r\nx\r\n:1\r\n",
        b"$1\r\n1\r\n",
        b"-ERR no\r\n",
        b">2\r\n:1\r\n:2\r\n",
    ]
    for raw in left:
        assert _wire._integers(raw) is None, raw
