"""Hygiene: the core as strangers call it, and nothing held beyond a call.

The patterns users write, on every backend that applies (``memory://``, one Redis, a
Redlock over three throwaway servers): function-scoped ``Lock``, ``Semaphore``,
``RateLimiter`` and ``Redlock`` made and dropped in a loop on one shared client, a fresh
``redis.Redis`` per call, 16 threads on one client, clients whose pools allow two
connections, a forked child locking on an inherited client. After each, every call
succeeded, and open file descriptors, threads and the server's ``CLIENT LIST`` are where
they were after a short warm-up, within a constant slack (:data:`SLACK` per server
watched), never a slack that grows with the number of calls. Run with ``-s`` to see the
figures of each case.

Threads: the process's I/O pool (``celery-redlock-io-*``, made on demand up to
:data:`~celery_redlock.core.threads.MAX_WORKERS`) and the renewal thread are per process
and bounded, so they are counted apart: every other thread must stay flat, the pool must
stay within its bound, and there is at most one renewal thread.

Then what errors mean: a client-side error (every connection of the pool checked out, a
wrong argument type) is raised as itself, never as Redis or a quorum being unavailable;
and a ``release()`` reports exactly: a re-sent copy of this holder's own release (a lost
reply) counts as released, while a release after another owner took the key raises
``LockLost`` whatever the local lease says.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import select
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from servers import RESEND, FaultProxy, RedisServer, wait_child, wait_for

from celery_redlock.core import (
    ConfigError,
    Lock,
    LockLost,
    NotOwned,
    RateLimiter,
    Redlock,
    Semaphore,
    StoreUnavailable,
    connect,
    get_manager,
)
from celery_redlock.core.backends.redis.client import lock_client
from celery_redlock.core.threads import MAX_WORKERS

#: What may be added to each figure after any number of calls, per server watched: a
#: client's pool keeps as many connections as calls overlapped on it (a Redlock runs one
#: call of ours at a time per master, beside a waiter's), never one per call.
SLACK = 4
#: Function-scoped calls per primitive on one shared client, each count past the 100
#: connections of a default pool (the old leak showed at call 101, and a leak of anything
#: per call shows in the figures after SLACK calls): a Redlock's fewer, each is three
#: masters' calls; memory:// fewer, each is a Lua script run in this process (fakeredis),
#: about ten times a real server's time. (Ten times these proved nothing more, at 30
#: CPU-seconds of the suite's budget.)
CALLS = 400
REDLOCK_CALLS = 250
MEMORY_CALLS = {"memory": 250, "redlock-memory": 150}
#: Calls on clients whose pools allow 2 connections, and with a fresh client per call
#: (a Redlock's: a quarter, three fresh clients per call).
SMALL_CALLS = 200
#: Lock cycles per thread, 16 threads on one client at once (a Barrier starts them
#: together): a Redlock's and memory://'s fewer.
THREADS, PER_THREAD = 16, 50
PER_THREAD_OF = {"redlock": 30, "memory": 30}
#: Lock calls of the forked child on its inherited client (the parent's keep going meanwhile).
CHILD_CALLS = 120
_IO_THREAD = "celery-redlock-io"
_RENEWAL_THREAD = "celery-redlock-renewal"


# -- servers and targets ------------------------------------------------------------------
@pytest.fixture
def admins(three_servers: list[RedisServer]) -> Iterator[list[redis.Redis]]:
    """One admin client per server (one connection each, counted in every baseline),
    after FLUSHALL."""
    clients = [server.client() for server in three_servers]
    for client in clients:
        client.flushall()
    try:
        yield clients
    finally:
        for client in clients:
            client.close()


def memory() -> Any:
    """A memory store of this test's own."""
    return connect(f"memory://hygiene-{uuid.uuid4().hex}")


def target_of(kind: str, three_servers: Sequence[RedisServer], **client_options: Any) -> Any:
    """What a user passes to a primitive for *kind*: a memory store, a client of one Redis,
    or a list of three masters (memory stores or clients)."""
    if kind == "memory":
        return memory()
    if kind == "redis":
        return three_servers[0].client(**client_options)
    if kind == "redlock":
        return [server.client(**client_options) for server in three_servers]
    if kind == "redlock-memory":
        return [memory() for _ in range(3)]
    raise AssertionError(kind)


def watched(kind: str, admins: list[redis.Redis]) -> list[redis.Redis]:
    """The admin clients of the servers *kind* uses (none for memory)."""
    return {"redis": admins[:1], "redlock": admins}.get(kind, [])


def close(target: Any) -> None:
    for client in target if isinstance(target, list) else [target]:
        if isinstance(client, redis.Redis):
            client.close()


# -- figures ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Figures:
    fds: int
    threads: int  # threading.active_count()
    io_threads: int  # the process's I/O pool, bounded by MAX_WORKERS
    renewal_threads: int
    clients: int | None  # CLIENT LIST (normal clients) summed over the watched servers

    @property
    def other_threads(self) -> int:
        return self.threads - self.io_threads - self.renewal_threads

    def __str__(self) -> str:
        clients = "-" if self.clients is None else self.clients
        return (
            f"fds={self.fds} threads={self.threads} (io={self.io_threads} "
            f"renewal={self.renewal_threads}) clients={clients}"
        )


def figures(admins: Sequence[redis.Redis] = ()) -> Figures:
    gc.collect()
    names = [t.name for t in threading.enumerate()]
    clients = None
    if admins:
        clients = sum(len(admin.client_list(_type="normal")) for admin in admins)
    return Figures(
        fds=len(os.listdir("/proc/self/fd")),
        threads=threading.active_count(),
        io_threads=sum(name.startswith(_IO_THREAD) for name in names),
        renewal_threads=sum(name == _RENEWAL_THREAD for name in names),
        clients=clients,
    )


def slack_for(watch: Sequence[redis.Redis]) -> int:
    """SLACK per watched server (a Redlock's three masters each keep their own pool)."""
    return SLACK * max(1, len(watch))


def settled(before: Figures, watch: Sequence[redis.Redis]) -> Figures:
    """The figures once the servers have seen closed connections go (bounded wait)."""
    if watch and before.clients is not None:
        most = before.clients + slack_for(watch)
        with contextlib.suppress(AssertionError):  # assert_flat says what stayed open
            wait_for(lambda: (figures(watch).clients or 0) <= most, timeout=3.0, interval=0.05)
    return figures(watch)


def assert_flat(case: str, before: Figures, after: Figures, watch: Sequence[redis.Redis]) -> None:
    """fds and CLIENT LIST within SLACK per watched server of the baseline, other threads
    within SLACK; the library's own threads within their per-process bounds; nothing left
    registered for renewal."""
    slack = slack_for(watch)
    print(f"\nhygiene {case}: before {before} | after {after}")
    assert after.fds <= before.fds + slack, f"{case}: open files grew: {before} -> {after}"
    assert after.other_threads <= before.other_threads + SLACK, (
        f"{case}: threads grew: {before} -> {after}"
    )
    assert after.io_threads <= MAX_WORKERS, f"{case}: I/O pool past its bound: {after}"
    assert after.renewal_threads <= 1, f"{case}: more than one renewal thread: {after}"
    if before.clients is not None:
        assert after.clients is not None
        assert after.clients <= before.clients + slack, (
            f"{case}: the server's client list grew: {before} -> {after}"
        )
    assert get_manager().held() == [], f"{case}: locks left registered for renewal"


def run_calls(call: Callable[[int], object], n: int, first: int = 0) -> int:
    """Call ``call(i)`` for each i; every call must succeed (returns how many did)."""
    done = 0
    for i in range(first, first + n):
        try:
            call(i)
        except Exception as exc:
            pytest.fail(f"call {i + 1 - first} of {n} failed: {type(exc).__name__}: {exc}")
        done += 1
    return done


WARM_UP = 5


def hygiene(
    case: str, call: Callable[[int], object], n: int, admins: Sequence[redis.Redis]
) -> None:
    """Warm up, take the baseline, make *n* calls, and check that nothing grew."""
    run_calls(call, WARM_UP)
    before = figures(admins)
    assert run_calls(call, n, first=WARM_UP) == n
    assert_flat(case, before, settled(before, admins), admins)


# -- the primitives as users write them ---------------------------------------------------
def lock_call(target: Any) -> Callable[[int], None]:
    def export(i: int) -> None:
        with Lock(target, f"job:{i}", ttl=10):
            pass

    return export


def semaphore_call(target: Any) -> Callable[[int], None]:
    def export(i: int) -> None:
        with Semaphore(target, "s", 3):
            pass

    return export


def rate_call(target: Any) -> Callable[[int], None]:
    def export(i: int) -> None:
        grant = RateLimiter(target, f"r:{i}", "100000/s").acquire()
        assert grant, grant

    return export


def redlock_call(masters: list[Any]) -> Callable[[int], None]:
    def export(i: int) -> None:
        with Redlock(masters, f"q:{i}"):
            pass

    return export


PRIMITIVES: dict[str, Callable[[Any], Callable[[int], None]]] = {
    "Lock": lock_call,
    "Semaphore": semaphore_call,
    "RateLimiter": rate_call,
    "Redlock": redlock_call,
}


@pytest.mark.parametrize(
    ("primitive", "kind"),
    [
        ("Lock", "memory"),
        ("Lock", "redis"),
        ("Semaphore", "memory"),
        ("Semaphore", "redis"),
        ("RateLimiter", "memory"),
        ("RateLimiter", "redis"),
        ("Redlock", "redlock"),
        ("Redlock", "redlock-memory"),
    ],
)
def test_function_scoped_primitive_on_one_shared_client(
    primitive: str, kind: str, three_servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """Hundreds of function-scoped primitives (see CALLS) on one shared client all
    succeed and leave fds, threads and CLIENT LIST flat (the old core failed at call 101 of
    a ``with Lock`` in a function: each dropped Lock kept a connection of the client's
    100-connection pool)."""
    target = target_of(kind, three_servers)
    calls = MEMORY_CALLS.get(kind, REDLOCK_CALLS if kind == "redlock" else CALLS)
    try:
        hygiene(
            f"{calls} x {primitive} on {kind}",
            PRIMITIVES[primitive](target),
            calls,
            watched(kind, admins),
        )
        if kind == "redis":
            assert target.ping()  # the user's own client still works
    finally:
        close(target)


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "dropped"])
@pytest.mark.parametrize("kind", ["redis", "redlock"])
def test_fresh_client_per_call(
    kind: str, closed: bool, three_servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """A fresh ``redis.Redis`` (or three, for a Redlock) made per call, locked with and then
    closed or just dropped, leaves no socket, thread or server connection behind: nothing
    in the core keeps a client (or its backend) alive past the call."""
    n = SMALL_CALLS if kind == "redis" else SMALL_CALLS // 4  # three clients per call

    def call(i: int) -> None:
        target = target_of(kind, three_servers)
        primitive = Lock if kind == "redis" else Redlock
        with primitive(target, f"fresh:{i}", ttl=10):
            pass
        if closed:
            close(target)

    hygiene(
        f"{n} x fresh client ({'closed' if closed else 'dropped'}) on {kind}",
        call,
        n,
        watched(kind, admins),
    )


def run_threads(call: Callable[[int], object], per_thread: int, first: int) -> None:
    """THREADS threads each making *per_thread* calls at once; every call must succeed."""
    failures: list[str] = []
    done = [0] * THREADS
    start = threading.Barrier(THREADS)

    def worker(k: int) -> None:
        start.wait(timeout=30)
        for i in range(per_thread):
            try:
                call(first + k * per_thread + i)
            except Exception as exc:
                failures.append(f"thread {k} call {i + 1}: {type(exc).__name__}: {exc}")
                return
            done[k] += 1

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in workers), "a thread did not finish"
    assert not failures, f"{len(failures)} threads failed, first: {failures[0]}"
    assert sum(done) == THREADS * per_thread


@pytest.mark.parametrize("kind", ["memory", "redis", "redlock"])
def test_threads_on_one_client(
    kind: str, three_servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """16 threads each doing 50 lock cycles (30 on a Redlock or memory://) on one client (one
    set of masters) all succeed, and leave fds, threads and CLIENT LIST flat: a busy
    client is not reported as an unavailable Redis or quorum. The warm-up runs on the 16
    threads too: the client's pool keeps up to one connection per thread that used it at
    once."""
    target = target_of(kind, three_servers)
    watch = watched(kind, admins)
    try:
        export = lock_call(target)
        run_threads(export, 20, first=0)
        before = figures(watch)
        per_thread = PER_THREAD_OF.get(kind, PER_THREAD)
        run_threads(export, per_thread, first=1_000_000)
        case = f"{THREADS} threads x {per_thread} Locks on {kind}"
        assert_flat(case, before, settled(before, watch), watch)
    finally:
        close(target)


def blocking_pool(host: str, port: int, timeout: float = 20) -> redis.Redis:
    """A client whose BlockingConnectionPool allows 2 connections (waits up to *timeout*)."""
    pool = redis.BlockingConnectionPool(host=host, port=port, max_connections=2, timeout=timeout)
    return redis.Redis(connection_pool=pool)


def tiny_target(
    kind: str,
    pool: str,
    three_servers: list[RedisServer],
    fault_proxy: Callable[[RedisServer], FaultProxy],
    timeout: float = 20,
) -> Any:
    """*kind*'s target on clients whose pools allow 2 connections; "redlock, one master
    5 ms away" puts a proxy that delays each chunk by 5 ms before the third master."""
    places = [(s.host, s.port) for s in three_servers]
    if kind == "redlock, one master 5 ms away":
        proxy = fault_proxy(three_servers[2])
        proxy.delay(0.005)
        places[2] = (proxy.host, proxy.port)
    elif kind == "redis":
        places = places[:1]

    def client(host: str, port: int) -> redis.Redis:
        if pool == "max_connections=2":
            return redis.Redis(host=host, port=port, max_connections=2, socket_timeout=5)
        return blocking_pool(host, port, timeout)

    clients = [client(host, port) for host, port in places]
    return clients[0] if kind == "redis" else clients


TINY = ["max_connections=2", "BlockingConnectionPool(2)"]


@pytest.mark.parametrize(
    ("primitive", "kind", "pool"),
    [
        *[(p, "redis", pool) for pool in TINY for p in ("Lock", "Semaphore", "RateLimiter")],
        *[("Redlock", "redlock", pool) for pool in TINY],
        *[("Redlock", "redlock, one master 5 ms away", pool) for pool in TINY],
    ],
)
def test_tiny_pool(
    primitive: str,
    kind: str,
    pool: str,
    three_servers: list[RedisServer],
    admins: list[redis.Redis],
    fault_proxy: Callable[[RedisServer], FaultProxy],
) -> None:
    """200 function-scoped calls on clients whose pools allow 2 connections (each master
    too, one of them farther away than the others) all succeed and leave everything flat:
    a primitive takes at most what one call needs and gives it back (the old core failed
    a Lock on a pool of 2 at call 3, a Redlock at call 9 on pools of 8)."""
    target = tiny_target(kind, pool, three_servers, fault_proxy)
    watch = admins[:1] if kind == "redis" else admins
    try:
        case = f"{SMALL_CALLS} x {primitive} on {kind}, {pool}"
        hygiene(case, PRIMITIVES[primitive](target), SMALL_CALLS, watch)
        for client in target if isinstance(target, list) else [target]:
            assert client.ping()  # the user's own client still works
    finally:
        close(target)


# -- a forked child -----------------------------------------------------------------------
def _child(target: Any, held: Lock, out: int) -> None:
    """In the forked child: report what it sees of the parent's lock and lock on the
    inherited client; never returns."""
    report: dict[str, Any] = {}
    code = 1
    try:
        other = Lock(target, "parent:held", ttl=5, blocking=False)
        report["sees_parent_lock"] = not other.acquire()
        if not report["sees_parent_lock"]:
            other.release()
        try:
            held.release()
            report["inherited_release"] = "released"
        except NotOwned:
            report["inherited_release"] = "NotOwned"
        export = lock_call(target)
        run = 0
        for i in range(WARM_UP):
            export(i)
            run += 1
        gc.collect()
        report["fds_before"] = len(os.listdir("/proc/self/fd"))
        for i in range(CHILD_CALLS):
            export(100_000 + i)
            run += 1
        gc.collect()
        report["fds_after"] = len(os.listdir("/proc/self/fd"))
        report["calls"] = run
        code = 0
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            os.write(out, json.dumps(report).encode())
        finally:
            os._exit(code)


@pytest.mark.parametrize("kind", ["memory", "redis", "redlock"])
def test_forked_child_locks_on_inherited_client(
    kind: str, three_servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """A forked child locks 120 times on a client inherited from its parent while the
    parent holds a lock and keeps locking: both succeed, the child cannot release the
    parent's lock, sees it held on a shared server (not in its own memory store), and
    neither process's fds, threads or CLIENT LIST grow."""
    target = target_of(kind, three_servers)
    watch = watched(kind, admins)
    export = lock_call(target)
    try:
        run_calls(export, WARM_UP)  # connections open in the inherited pool
        held = Lock(target, "parent:held", ttl=2)  # renewed every ~0.7 s meanwhile
        held.acquire()
        before = figures(watch)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(read)
            _child(target, held, write)
        os.close(write)
        parent_calls = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not select.select([read], [], [], 0)[0]:
            export(10_000 + parent_calls)
            parent_calls += 1
        code = wait_child(pid, timeout=30)
        data = b""
        while chunk := os.read(read, 65536):
            data += chunk
        os.close(read)
        report = json.loads(data or b"{}")
        assert code == 0, f"child exited {code}: {report}"
        assert report["calls"] == WARM_UP + CHILD_CALLS
        assert report["inherited_release"] == "NotOwned"
        assert report["sees_parent_lock"] is (kind != "memory"), report
        assert report["fds_after"] <= report["fds_before"] + slack_for(watch), report
        assert parent_calls > 0
        assert held.owned(), "the parent's lock was lost while the child ran"
        held.release()
        print(f"\nhygiene fork on {kind}: child {report}, parent calls {parent_calls}")
        assert_flat(f"fork on {kind} (parent)", before, settled(before, watch), watch)
    finally:
        close(target)


# -- client-side errors are not outages ---------------------------------------------------
def checkout(pool: Any) -> Any:
    """A connection from *pool* through its public API (redis-py < 5.3 wants a command
    name, as its signature says)."""
    first = next(iter(inspect.signature(pool.get_connection).parameters.values()), None)
    if first is not None and first.default is first.empty:
        return pool.get_connection("PING")
    return pool.get_connection()


def pool_exhausted(exc: BaseException) -> bool:
    """redis-py's word for a pool with no connection to give."""
    max_connections = getattr(redis.exceptions, "MaxConnectionsError", ())
    return isinstance(exc, max_connections) or (
        isinstance(exc, redis.ConnectionError)
        and str(exc) in ("Too many connections", "No connection available.")
    )


@pytest.mark.parametrize("pool", TINY)
@pytest.mark.parametrize("primitive", ["Lock", "Semaphore", "RateLimiter", "Redlock"])
def test_exhausted_pool_is_not_unavailable(
    primitive: str,
    pool: str,
    three_servers: list[RedisServer],
    admins: list[redis.Redis],
    fault_proxy: Callable[[RedisServer], FaultProxy],
) -> None:
    """With every connection of the lock traffic's 2-connection pool (the user's cap, on
    the lock client's own pool) checked out, acquiring raises redis' own pool error
    (MaxConnectionsError / "Too many connections"), not StoreUnavailable, leaves no lock
    behind, and works once the connections are back (the old core said "Redis
    unavailable", so LockedTask retried forever)."""
    kind = "redlock" if primitive == "Redlock" else "redis"
    target = tiny_target(kind, pool, three_servers, fault_proxy, timeout=0.2)
    clients = [lock_client(c) for c in (target if isinstance(target, list) else [target])]
    taken = [(c, checkout(c.connection_pool)) for c in clients for _ in range(2)]

    def acquire() -> object:
        if primitive == "RateLimiter":
            return RateLimiter(target, "exhausted", "10/s").acquire()
        if primitive == "Semaphore":
            return Semaphore(target, "exhausted", 3).acquire(blocking=False)
        cls = Redlock if primitive == "Redlock" else Lock
        return cls(target, "exhausted", ttl=10).acquire(blocking=False)

    try:
        with pytest.raises(Exception) as caught:
            acquire()
        assert not isinstance(caught.value, StoreUnavailable), caught.value
        assert pool_exhausted(caught.value), f"{type(caught.value).__name__}: {caught.value}"
    finally:
        for client, conn in taken:
            client.connection_pool.release(conn)
    try:
        assert not any(admin.keys("*exhausted*") for admin in watched(kind, admins))
        assert acquire()
    finally:
        for lock in get_manager().held():
            lock.release()  # type: ignore[attr-defined]
        close(target)


#: A wrong argument a user may pass, and the word the error must name.
WRONG_ARGUMENTS: dict[str, tuple[Callable[[Any], object], str]] = {
    "name=b'job'": (lambda t: Lock(t, b"job"), "name"),
    "name=5": (lambda t: Lock(t, 5), "name"),
    "key_prefix=b'x:'": (lambda t: Lock(t, "job", key_prefix=b"x:").acquire(False), "key_prefix"),
    "ttl='10'": (lambda t: Lock(t, "job", ttl="10"), "ttl"),
    "timeout='5'": (lambda t: Lock(t, "job", timeout="5"), "timeout"),
    "acquire(timeout='1')": (lambda t: Lock(t, "job").acquire(timeout="1"), "timeout"),
    "max_hold='5'": (lambda t: Lock(t, "job", max_hold="5"), "max_hold"),
    "owner_info=['a']": (lambda t: Lock(t, "job", owner_info=["a"]), "owner_info"),
    "Semaphore(limit='3')": (lambda t: Semaphore(t, "s", "3"), "limit"),
    "RateLimiter(rate=b'10/s')": (lambda t: RateLimiter(t, "r", b"10/s"), "rate"),
    "RateLimiter(burst='2')": (lambda t: RateLimiter(t, "r", "10/s", burst="2"), "burst"),
    "RateLimiter.acquire(timeout='1')": (
        lambda t: RateLimiter(t, "r", "10/s").acquire(True, timeout="1"),
        "timeout",
    ),
    "Redlock(per_node_timeout='1')": (
        lambda t: Redlock(t, "job", per_node_timeout="1"),
        "per_node_timeout",
    ),
}
_ONE_STORE_ONLY = ("Semaphore", "RateLimiter")  # refused on a quorum before the argument


@pytest.mark.parametrize("kind", ["memory", "redis", "redlock"])
@pytest.mark.parametrize("case", list(WRONG_ARGUMENTS))
def test_wrong_argument_type_is_named(
    case: str, kind: str, three_servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """A wrong argument type raises ConfigError or TypeError naming the argument, never
    StoreUnavailable, and takes nothing on the backend."""
    if case.startswith(_ONE_STORE_ONLY) and kind == "redlock":
        pytest.skip("refused on a list of masters whatever the arguments")
    if case.startswith("Redlock") and kind != "redlock":
        pytest.skip("Redlock takes a list of masters")
    make, word = WRONG_ARGUMENTS[case]
    target = target_of(kind, three_servers)
    try:
        with pytest.raises((ConfigError, TypeError)) as caught:
            make(target)
        assert not isinstance(caught.value, StoreUnavailable)
        assert word in str(caught.value), (
            f"{case}: {type(caught.value).__name__} does not name {word!r}: {caught.value}"
        )
        assert get_manager().held() == []
        assert not any(admin.dbsize() for admin in watched(kind, admins))
    finally:
        close(target)


# -- exact loss reports -------------------------------------------------------------------
class OwnPool(redis.ConnectionPool):
    """A pool class of a user's own: the lock traffic goes through it as it is."""


def evalsha_calls(admin: redis.Redis) -> int:
    """How many EVALSHA the server has run (a release is one)."""
    return int(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.mark.parametrize(
    "how", ["reply past socket_timeout, a client re-sending on timeouts", "connection reset"]
)
def test_release_whose_reply_is_lost_counts_as_released(
    how: str,
    three_servers: list[RedisServer],
    admins: list[redis.Redis],
    fault_proxy: Callable[[RedisServer], FaultProxy],
) -> None:
    """``Lock.release()`` whose reply is lost after the server ran it is re-sent (by the
    lock client's one retry after a reset connection; after a timeout, only by a client
    that re-sends on timeouts, which the Sentinel-managed clients below stand for); the
    copy finds its token remembered as released: no LockLost, the key is gone (a release
    that read "gone" as lost would raise here)."""
    proxy = fault_proxy(three_servers[0])
    if how == "connection reset":
        client = proxy.client()  # redis-py's defaults
    else:
        # A pool class of the user's own is used as it is (as a Sentinel-managed master's
        # is), with its retry policy: here one that re-sends after a timeout.
        own = OwnPool(
            host=proxy.host, port=proxy.port, socket_timeout=0.3, retry=Retry(NoBackoff(), 3),
            **RESEND,
        )  # fmt: skip
        client = redis.Redis(connection_pool=own)
    admin = admins[0]
    try:
        lock = Lock(client, "lost-reply", ttl=10)
        with lock:  # the server has the lock's scripts: a release is one EVALSHA
            pass
        assert lock.acquire(blocking=False)
        sent, held = evalsha_calls(admin), proxy.replies_held
        proxy.delay_replies(10)  # the release's reply is held back...

        def lose_the_reply() -> None:
            assert wait_for(lambda: not admin.exists(lock.keys.lock), timeout=5)
            # The proxy has read the reply and holds it: a heal before that would let it
            # through (a loaded machine schedules the proxy's thread late).
            assert wait_for(lambda: proxy.replies_held > held, timeout=5)
            proxy.heal()  # ...the re-sent copy goes straight through
            if how == "connection reset":
                proxy.drop()  # the held-back reply is lost with its connection

        cutter = threading.Thread(target=lose_the_reply)
        cutter.start()
        started = time.monotonic()
        try:
            lock.release()
        finally:
            cutter.join(timeout=10)
        assert time.monotonic() - started < 5
        assert evalsha_calls(admin) - sent >= 2, "the release was not re-sent: nothing was lost"
        assert not admin.exists(lock.keys.lock)
        assert lock.token is None and not lock.lost
        assert lock.acquire(blocking=False)  # free for the next holder
        lock.release()
    finally:
        proxy.heal()
        client.close()


@pytest.mark.parametrize("kind", ["memory", "redis", "redlock"])
def test_release_after_takeover_raises_lock_lost(
    kind: str, three_servers: list[RedisServer], admins: list[redis.Redis]
) -> None:
    """A holder whose key was removed (a restart without persistence, a forced release)
    and then taken by another Lock gets LockLost from release() although its local lease
    still looks valid, and the new holder keeps the lock."""
    target = target_of(kind, three_servers)
    try:
        first = Lock(target, "taken", ttl=30)
        assert first.acquire(blocking=False)
        if kind == "memory":
            assert first.backend.force_release(first.slot, None, 1000).outcome == "released"
        else:
            # A Redlock returns at a majority: the last master's grant may land just after.
            masters = watched(kind, admins)
            assert wait_for(lambda: all(a.exists(first.keys.lock) for a in masters), timeout=5)
            for admin in masters:
                assert admin.delete(first.keys.lock) == 1
        second = Lock(target, "taken", ttl=30)
        assert second.acquire(blocking=False)
        assert time.monotonic() < first.valid_until  # the local lease still looks valid
        with pytest.raises(LockLost):
            first.release()
        assert second.owned()
        second.release()
    finally:
        close(target)
