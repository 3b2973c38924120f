"""One behaviour suite, run unchanged against every backend.

Each test takes ``target``: what a user passes as a primitive's first argument, for each of
:data:`BACKENDS` (an in-process ``memory://`` store, a plain Redis, a Sentinel master, a
Redis Cluster, and a Redlock quorum of three Redis servers). A test states a behaviour of
the public API (``Lock``, ``Semaphore``, ``RateLimiter``, ``QueuedHold``, ``LockRecords``,
the operator's ``force_release``) or of a backend verb, and must hold on each of them.
What a quorum lacks (permits above 1, rate limits, queued holds, operator verbs) is refused
with a ``ConfigError`` when the primitive is built: the same test asserts the refusal there
and the behaviour elsewhere; operator reads go to each master, as ``celery locks`` does.

Adding a backend: add its name to :data:`BACKENDS` and a branch to ``target`` (and to
``nodes`` when it has Redis servers whose commands can be counted).

Servers are shared per module (Sentinel and Cluster are slow to start) or per session
(``shared_redis``); tests are kept apart by lock names with a uuid in them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from servers import ClusterSetup, RedisServer, SentinelSetup, wait_child, wait_for
from tricky_names import TRICKY_NAMES

from celery_redlock.core import (
    ConfigError,
    Handover,
    Lock,
    LockContended,
    LockLost,
    LockRecords,
    NotOwned,
    QueuedHold,
    RateLimiter,
    RedlockError,
    RunLock,
    Semaphore,
    Slot,
    Status,
    admin,
    connect,
    lock_keys,
    open_backend,
)
from celery_redlock.core.admin import ForceRelease, LockInfo, RateInfo
from celery_redlock.core.backend_types import RECENT_BYTES
from celery_redlock.core.backends.memory import MemoryBackend

#: Every backend the suite runs on; a new backend is done when it passes with its name here.
BACKENDS = ["memory", "redis", "sentinel", "cluster", "quorum"]
PREFIX = "redlock:"
#: Commands that servers, sentinels and replicas send by themselves (or this suite sends to
#: count): not a waiter's.
_NOISE = frozenset(
    {"info", "ping", "publish", "replconf", "config", "client", "hello", "command",
     "subscribe", "cluster", "select", "psync", "sync", "role", "auth", "readonly"}
)  # fmt: skip


# -- the backends ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sentinel_once() -> Iterator[SentinelSetup]:
    """One Sentinel setup (a master, a replica, three sentinels) for the module."""
    setup = SentinelSetup.start()
    try:
        yield setup
    finally:
        setup.stop()


@pytest.fixture(scope="module")
def cluster_once() -> Iterator[ClusterSetup]:
    """One three-master Redis Cluster for the module."""
    cluster = ClusterSetup.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _healthy(server: RedisServer) -> RedisServer:
    """The session's shared server as other tests may have left it: running."""
    if server.paused:
        server.resume()
    if not server.alive():
        server.restart()
    return server


@pytest.fixture(params=BACKENDS)
def target(request: pytest.FixtureRequest) -> Iterator[Any]:
    """What a user passes as a primitive's first argument, for each backend."""
    kind = request.param
    clients: list[Any] = []
    if kind == "memory":  # a fresh store of its own per test
        store = connect(f"memory://behaviour-{uuid.uuid4().hex}")
        try:
            yield store
        finally:
            store.clear()  # type: ignore[union-attr]
        return
    if kind == "redis":
        clients = [_healthy(request.getfixturevalue("shared_redis")).client()]
    elif kind == "sentinel":
        setup: SentinelSetup = request.getfixturevalue("sentinel_once")
        clients = [setup.sentinel().master_for(setup.master_name, socket_timeout=5)]
    elif kind == "cluster":
        clients = [request.getfixturevalue("cluster_once").client()]
    elif kind == "quorum":
        clients = [server.client() for server in request.getfixturevalue("three_servers")]
    else:  # pragma: no cover - a name in BACKENDS without a branch here
        raise AssertionError(f"no target for backend {kind!r}")
    try:
        yield clients if kind == "quorum" else clients[0]
    finally:
        for client in clients:
            client.close()


@pytest.fixture
def nodes(request: pytest.FixtureRequest, target: Any) -> list[RedisServer]:
    """The Redis servers behind ``target`` whose commands can be counted (none for memory)."""
    kind = request.node.callspec.params["target"]
    if kind == "redis":
        return [request.getfixturevalue("shared_redis")]
    if kind == "sentinel":
        return [request.getfixturevalue("sentinel_once").master]
    if kind == "cluster":
        return list(request.getfixturevalue("cluster_once").nodes)
    if kind == "quorum":
        return list(request.getfixturevalue("three_servers"))
    return []


@pytest.fixture
def name() -> str:
    """A lock name no other test uses (servers are shared)."""
    return f"behaviour:{uuid.uuid4().hex[:16]}"


def _quorum(target: Any) -> bool:
    """True for a Redlock quorum: it refuses permits above 1, rate limits and queued holds."""
    return open_backend(target).masters > 1


def _stores(target: Any) -> list[Any]:
    """Where the operator verbs go: each master of a quorum (as ``celery locks`` reads
    them), else the target itself."""
    return list(target) if isinstance(target, list) else [target]


def read_lock(target: Any, prefix: str, name: str) -> list[LockInfo]:
    """``admin.read_lock`` on every store of *target* (each master's copy)."""
    return [info for store in _stores(target) for info in admin.read_lock(store, prefix, name)]


def scan_locks(target: Any, prefix: str, pattern: str = "*") -> list[LockInfo]:
    """``admin.scan_locks`` on every store of *target*, sorted by name."""
    found = [i for store in _stores(target) for i in admin.scan_locks(store, prefix, pattern)]
    return sorted(found, key=lambda info: info.name)


def scan_rates(target: Any, prefix: str, pattern: str = "*") -> list[RateInfo]:
    """``admin.scan_rates`` on every store of *target* (a quorum's masters keep none)."""
    return [i for store in _stores(target) for i in admin.scan_rates(store, prefix, pattern)]


def read_rate(target: Any, prefix: str, name: str) -> RateInfo | None:
    """``admin.read_rate`` on the first store of *target* that has the limiter."""
    found = (admin.read_rate(store, prefix, name) for store in _stores(target))
    return next((info for info in found if info is not None), None)


def force_release(target: Any, prefix: str, name: str) -> ForceRelease:
    """``admin.force_release`` on every store: released where any master released it
    (with the highest fence removed), else gone."""
    done = [admin.force_release(store, prefix, name) for store in _stores(target)]
    removed = [f for f in done if f.outcome == "released"]
    if not removed:
        return ForceRelease("gone")
    fences = [f.fence for f in removed if f.fence is not None]
    return ForceRelease("released", removed[0].record, max(fences) if fences else None)


def _commands(servers: list[RedisServer]) -> list[int]:
    """Per server: calls of every command but the servers' own chatter (INFO commandstats)."""
    counts = []
    for server in servers:
        client = server.client()
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        counts.append(
            sum(
                int(entry["calls"])
                for key, entry in stats.items()
                if key.removeprefix("cmdstat_").split("|")[0] not in _NOISE
            )
        )
    return counts


def _on_every_master(target: Any, name: str) -> None:
    """Wait until every master stores the lock: a quorum returns at a majority, and the
    last master's grant may land just after (on one Redis or memory: at once)."""
    masters = open_backend(target).masters
    assert wait_for(lambda: len(read_lock(target, PREFIX, name)) >= masters, timeout=5)


def _increasing(values: list[int]) -> bool:
    """True when each value is strictly above the one before it."""
    return all(a < b for a, b in itertools.pairwise(values))


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run *fn* in a thread; the dict gets its ``result`` (or ``error``) and ``at`` (when)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # reported to the test, not lost in the thread
            out["error"] = exc
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _join_all(threads: list[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout} s"


# -- mutual exclusion and ownership ------------------------------------------------------
def test_two_lock_objects_exclude_each_other(target: Any, name: str) -> None:
    """While one Lock object holds a name another cannot take it; after the release it can."""
    a = Lock(target, name, ttl=10, auto_renew=False)
    b = Lock(target, name, ttl=10, auto_renew=False)
    assert a.acquire(blocking=False)
    assert b.acquire(blocking=False) is False
    assert b.acquire(blocking=True, timeout=0.05) is False
    a.release()
    assert b.acquire(blocking=False)
    assert a.acquire(blocking=False) is False
    b.release()


def test_sixteen_threads_never_hold_at_once(target: Any, name: str) -> None:
    """16 threads taking turns on one name never overlap, and each holder's fence is higher."""
    guard = threading.Lock()
    state = {"inside": 0, "most": 0}
    fences: list[int] = []
    errors: list[str] = []

    def work() -> None:
        for _ in range(3):
            lock = Lock(target, name, ttl=10, auto_renew=False)
            try:  # a healthy backend must not refuse 16 threads, nor fail their releases
                if not lock.acquire(blocking=True, timeout=30):
                    errors.append("acquire timed out")
                    continue
            except RedlockError as exc:
                errors.append(f"acquire: {type(exc).__name__}: {exc}")
                continue
            with guard:
                state["inside"] += 1
                state["most"] = max(state["most"], state["inside"])
                fences.append(lock.fence or 0)
            time.sleep(0.001)
            with guard:
                state["inside"] -= 1
            try:
                lock.release()
            except RedlockError as exc:
                errors.append(f"release: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, daemon=True) for _ in range(16)]
    for thread in threads:
        thread.start()
    _join_all(threads, 60)
    assert state["most"] == 1
    assert errors == [], (
        f"{len(errors)} of 48 lock cycles by 16 threads on a healthy backend failed; the "
        f"first: {errors[0]}"
    )
    assert len(fences) == 48
    assert _increasing(fences), fences


def test_another_object_cannot_release_or_extend(target: Any, name: str) -> None:
    """Another Lock object's release() and extend() raise NotOwned; the holder keeps its lock."""
    a = Lock(target, name, ttl=10, auto_renew=False)
    b = Lock(target, name, ttl=10, auto_renew=False)
    assert a.acquire(blocking=False)
    with pytest.raises(NotOwned) as released:
        b.release()
    assert type(released.value) is NotOwned
    with pytest.raises(NotOwned) as extended:
        b.extend(5)
    assert type(extended.value) is NotOwned
    assert a.owned() and b.locked()
    a.release()


def test_a_different_token_cannot_release_or_extend(target: Any, name: str) -> None:
    """The backend's release/extend naming another token is TAKEN and changes nothing."""
    a = Lock(target, name, ttl=10, auto_renew=False)
    assert a.acquire(blocking=False)
    backend, slot = open_backend(target), Slot(lock_keys(name, PREFIX))
    assert backend.release(slot, "f" * 40, 10_000) is Status.TAKEN
    assert backend.extend(slot, "f" * 40, 60_000, replace=True) is Status.TAKEN
    assert [h.token for h in backend.holders(slot)] == [a.token]
    assert a.owned()
    a.release()


def test_a_resent_acquire_is_idempotent(target: Any, name: str) -> None:
    """An acquire re-sent with the same token is granted again with the same fence."""
    backend, slot, token = open_backend(target), Slot(lock_keys(name, PREFIX)), "a" * 40
    first = backend.acquire(slot, token, 10_000, "{}", wait=False, fence_ttl_ms=0)
    again = backend.acquire(slot, token, 10_000, "{}", wait=False, fence_ttl_ms=0)
    assert first.acquired and again.acquired
    assert first.fence is not None and again.fence == first.fence
    assert [h.token for h in backend.holders(slot)] == [token]
    other = backend.acquire(slot, "b" * 40, 10_000, "{}", wait=False, fence_ttl_ms=0)
    assert not other.acquired
    assert backend.release(slot, token, 10_000) is Status.OK
    assert not backend.locked(slot)


def test_fences_strictly_increase_across_holders(target: Any, name: str) -> None:
    """Each acquisition's fence is above every earlier holder's, whichever object takes it."""
    locks = [Lock(target, name, ttl=10, auto_renew=False) for _ in range(3)]
    fences = []
    for i in range(9):
        lock = locks[i % 3]
        assert lock.acquire(blocking=False)
        assert lock.fence is not None
        fences.append(lock.fence)
        lock.release()
        assert lock.fence is None
    assert _increasing(fences), fences


def test_fences_increase_after_the_fence_counter_expired(target: Any, name: str) -> None:
    """A fence counter that expired (a short fence_ttl) restarts above every fence it gave."""
    lock = Lock(target, name, ttl=1, auto_renew=False, fence_ttl=0.05)
    fences = []
    for _ in range(3):
        assert lock.acquire(blocking=False)
        fences.append(lock.fence or 0)
        lock.release()
        time.sleep(0.12)  # the counter lives 50 ms after its last use
    assert _increasing(fences), fences


# -- leases and loss -----------------------------------------------------------------------
def test_a_lease_expires_on_the_clock(target: Any, name: str) -> None:
    """A 250 ms lease (not rounded to seconds) ends on the clock; its waiter gets it soon after."""
    a = Lock(target, name, ttl=0.25, auto_renew=False)
    b = Lock(target, name, ttl=10, auto_renew=False)
    assert a.acquire(blocking=False)
    leases = [info.ttl_ms for info in read_lock(target, PREFIX, name)]
    assert leases and all(0 < ms <= 250 for ms in leases), leases
    assert b.acquire(blocking=False) is False
    started = time.monotonic()
    assert b.acquire(blocking=True, timeout=5)
    took = time.monotonic() - started
    assert took < 1.5, f"the waiter took {took:.3f} s to get a lock whose lease was 250 ms"
    assert (b.fence or 0) > (a.fence or 0)
    assert not a.owned()
    with pytest.raises(LockLost):
        a.release()
    b.release()


def test_extend_never_resurrects_a_lost_lock(target: Any, name: str) -> None:
    """extend() of a removed or expired lock raises LockLost and never recreates the key."""
    a = Lock(target, name, ttl=30, auto_renew=False)
    assert a.acquire(blocking=False)
    _on_every_master(target, name)
    assert force_release(target, PREFIX, name).outcome == "released"
    assert a.valid_until > time.monotonic()  # the local clock still says held
    with pytest.raises(LockLost):
        a.extend(30)
    assert not a.locked() and read_lock(target, PREFIX, name) == []
    # Expired: the backend's extend of that token finds nothing, and writes nothing.
    short = Lock(target, name, ttl=0.1, auto_renew=False)
    assert short.acquire(blocking=False)
    token = short.token
    assert token is not None
    assert wait_for(lambda: read_lock(target, PREFIX, name) == [], timeout=3)  # every master
    backend, slot = open_backend(target), Slot(lock_keys(name, PREFIX))
    assert backend.extend(slot, token, 30_000, replace=False) is Status.GONE
    assert not short.locked() and read_lock(target, PREFIX, name) == []
    with pytest.raises(LockLost):
        short.extend(30)


def test_release_after_a_forced_release_raises_lock_lost(target: Any, name: str) -> None:
    """After a forced release, release() raises LockLost though the local lease looks valid."""
    a = Lock(target, name, ttl=30, auto_renew=False)
    assert a.acquire(blocking=False)
    _on_every_master(target, name)
    forced = force_release(target, PREFIX, name)
    assert forced.outcome == "released" and forced.fence is not None and a.fence is not None
    if _quorum(target):
        # Each master stores the fence it gave; a quorum reports the highest one removed,
        # which is above the holder's own fence (the highest of the grants it decided on)
        # when a master that answered after the decision had a higher counter.
        assert forced.fence >= a.fence
    else:
        assert forced.fence == a.fence
    assert a.valid_until > time.monotonic()
    with pytest.raises(LockLost):
        a.release()
    assert force_release(target, PREFIX, name).outcome == "gone"


def test_release_after_a_takeover_raises_lock_lost(target: Any, name: str) -> None:
    """After a takeover the old holder's release() raises LockLost; the new one keeps the lock."""
    a = Lock(target, name, ttl=30, auto_renew=False)
    b = Lock(target, name, ttl=30, auto_renew=False)
    assert a.acquire(blocking=False)
    first = a.fence
    _on_every_master(target, name)
    assert force_release(target, PREFIX, name).outcome == "released"
    assert b.acquire(blocking=False)
    assert a.valid_until > time.monotonic()
    with pytest.raises(LockLost):
        a.release()
    assert b.owned() and not a.owned()
    assert first is not None and b.fence is not None and b.fence > first
    b.release()


def test_a_resent_release_is_ok(target: Any, name: str) -> None:
    """A re-sent copy of one's own release is OK, even after another owner took the lock."""
    backend, slot, token = open_backend(target), Slot(lock_keys(name, PREFIX)), "c" * 40
    assert backend.acquire(slot, token, 10_000, "{}", wait=False, fence_ttl_ms=0).acquired
    assert backend.release(slot, token, 10_000) is Status.OK
    assert backend.release(slot, token, 10_000) is Status.OK
    b = Lock(target, name, ttl=10, auto_renew=False)
    assert b.acquire(blocking=False)
    assert backend.release(slot, token, 10_000) is Status.OK
    assert b.owned()
    b.release()


def _recent_bytes(target: Any, nodes: list[RedisServer], key: str) -> int:
    """Bytes of the released-token record at *key*, on the one store or master holding the
    most (a cluster: the node that serves its slot)."""
    if not nodes:
        entry = open_backend(target).entries.get(key)  # memory: the store's own entry
        return 0 if entry is None else len(entry.value)
    sizes = []
    for server in nodes:
        with contextlib.suppress(Exception):  # a cluster node that does not serve the slot
            sizes.append(server.client().strlen(key))
    return max(sizes)


def test_the_released_token_record_is_capped_and_keeps_the_recent_ones(
    target: Any, name: str, nodes: list[RedisServer]
) -> None:
    """10,000 releases of one name within one lease keep its released-token record under
    the cap (RECENT_BYTES), and a re-sent copy of a recent release still reads OK, while one
    of the first (long dropped) reads as gone."""
    backend, slot = open_backend(target), Slot(lock_keys(name, PREFIX))
    tokens = [f"{i:040x}" for i in range(10_000)]
    for token in tokens:
        assert backend.acquire(slot, token, 60_000, "{}", wait=False, fence_ttl_ms=0).acquired
        assert backend.release(slot, token, 60_000) is Status.OK
    assert 0 < _recent_bytes(target, nodes, slot.keys.released) <= RECENT_BYTES
    for recent in tokens[-10:]:  # a re-sent copy of one of the last releases
        assert backend.release(slot, recent, 60_000) is Status.OK
    assert backend.release(slot, tokens[0], 60_000) is Status.GONE


# -- waiting ---------------------------------------------------------------------------------
def test_a_blocked_acquire_is_woken_by_the_release(
    target: Any, name: str, nodes: list[RedisServer]
) -> None:
    """A blocked acquire is woken by the release within 1 s and sends no command while blocked."""
    holder = Lock(target, name, ttl=10, auto_renew=False)
    waiter = Lock(target, name, ttl=10, auto_renew=False)
    assert holder.acquire(blocking=False)
    thread, out = _in_thread(lambda: waiter.acquire(blocking=True, timeout=8))
    time.sleep(0.15)  # the waiter has asked once and is blocked on a release notice now
    before = _commands(nodes)
    time.sleep(0.4)  # a poll loop would show in the counts (scripts' own commands count too)
    sent = [after - first for after, first in zip(_commands(nodes), before, strict=True)]
    assert "result" not in out and "error" not in out, out
    released = time.monotonic()
    holder.release()
    thread.join(9)
    assert out.get("result") is True, out
    woke = out["at"] - released
    assert woke < 1.0, f"woken {woke:.3f} s after the release"
    assert all(n <= 2 for n in sent), f"commands per server while blocked for 0.4 s: {sent}"
    waiter.release()


def test_a_waiter_times_out_with_false(target: Any, name: str) -> None:
    """A blocking acquire with a timeout returns False when the holder keeps the lock."""
    holder = Lock(target, name, ttl=10, auto_renew=False)
    assert holder.acquire(blocking=False)
    waiter = Lock(target, name, ttl=10, auto_renew=False)
    started = time.monotonic()
    assert waiter.acquire(blocking=True, timeout=0.3) is False
    took = time.monotonic() - started
    assert 0.25 <= took < 2.0, took
    assert holder.owned() and waiter.fence is None
    holder.release()


def test_with_raises_lock_contended_with_the_holders_record(target: Any, name: str) -> None:
    """``with lock:`` on a held name raises LockContended with the holder's record and lease."""
    info = {"task_name": "proj.sync", "task_id": "id-holder"}
    holder = Lock(target, name, ttl=10, auto_renew=False, owner_info=info)
    assert holder.acquire(blocking=False)
    contender = Lock(target, name, ttl=10, auto_renew=False, blocking=False)
    with pytest.raises(LockContended) as contended, contender:
        pytest.fail("entered a held lock")
    assert contended.value.holder["task_id"] == "id-holder"
    assert contended.value.holder["pid"] == os.getpid()
    assert contended.value.ttl_ms is not None and 0 < contended.value.ttl_ms <= 10_000
    holder.release()
    with Lock(target, name, ttl=10, auto_renew=False, blocking=False) as lock:
        assert lock.owned()
    assert not lock.locked()


def test_reentrant_locks_count_their_acquisitions(target: Any, name: str) -> None:
    """reentrant=True takes the lock again and needs as many releases; a plain Lock refuses."""
    lock = Lock(target, name, ttl=10, auto_renew=False, reentrant=True)
    assert lock.acquire(blocking=False)
    fence = lock.fence
    assert lock.acquire(blocking=False)
    assert lock.fence == fence
    lock.release()
    assert lock.owned() and lock.locked()
    lock.release()
    assert not lock.locked()
    with pytest.raises(NotOwned):
        lock.release()
    plain = Lock(target, name, ttl=10, auto_renew=False)
    assert plain.acquire(blocking=False)
    with pytest.raises(RedlockError, match="already held"):
        plain.acquire(blocking=False)
    plain.release()


# -- renewal ---------------------------------------------------------------------------------
def test_auto_renew_keeps_a_lock_past_several_ttls(target: Any, name: str) -> None:
    """A 0.5 s lease renewed by the process's renewal thread is still held after 1.6 s."""
    lock = Lock(target, name, ttl=0.5)
    assert lock.acquire(blocking=False)
    time.sleep(1.6)
    assert lock.owned() and not lock.lost
    assert Lock(target, name, ttl=10, auto_renew=False).acquire(blocking=False) is False
    lock.release()


def test_max_hold_stops_renewal(target: Any, name: str) -> None:
    """Renewal stops at max_hold: the lease runs out, another takes it, release() is LockLost."""
    lock = Lock(target, name, ttl=0.5, max_hold=0.8)
    other = Lock(target, name, ttl=10, auto_renew=False)
    assert lock.acquire(blocking=False)
    started = time.monotonic()
    assert other.acquire(blocking=True, timeout=5)
    took = time.monotonic() - started
    assert 0.7 <= took < 3.0, f"renewed for {took:.3f} s; max_hold 0.8 s, lease 0.5 s"
    assert not lock.owned()
    with pytest.raises(LockLost):
        lock.release()
    other.release()


# -- reads ---------------------------------------------------------------------------------
def test_owned_locked_and_read_holder(target: Any, name: str) -> None:
    """owned() is the holder's, locked() anyone's, read_holder() the holder's record."""
    info = {"task_name": "proj.report", "task_id": "id-7"}
    a = Lock(target, name, ttl=10, auto_renew=False, owner_info=info)
    b = Lock(target, name, ttl=10, auto_renew=False)
    assert not a.owned() and not a.locked() and a.read_holder() is None
    assert a.acquire(blocking=False)
    assert a.owned() and a.locked() and b.locked() and not b.owned()
    record = a.read_holder()
    assert record is not None
    assert record["task_name"] == "proj.report" and record["task_id"] == "id-7"
    assert record["pid"] == os.getpid() and record["hostname"]
    assert abs(record["acquired_at"] - time.time()) < 60
    assert b.read_holder() == record
    a.release()
    assert not a.owned() and not a.locked() and a.read_holder() is None


# -- semaphores ------------------------------------------------------------------------------
def test_a_semaphore_never_exceeds_its_limit(target: Any, name: str) -> None:
    """Semaphore(limit=3) never lets 12 threads hold more than 3; fences rise (quorum: refused)."""
    if _quorum(target):
        with pytest.raises(ConfigError, match="Redlock"):
            Semaphore(target, name, 3)
        mutex = Semaphore(target, name, 1, auto_renew=False)  # limit 1 is the mutex: fine
        assert mutex.acquire(blocking=False)
        mutex.release()
        return
    guard = threading.Lock()
    state = {"inside": 0, "most": 0}
    fences: list[int] = []
    errors: list[str] = []

    def work() -> None:
        for _ in range(4):
            permit = Semaphore(target, name, 3, ttl=5, auto_renew=False)
            if not permit.acquire(blocking=True, timeout=30):
                errors.append("timed out")
                continue
            with guard:
                state["inside"] += 1
                state["most"] = max(state["most"], state["inside"])
                fences.append(permit.fence or 0)
            time.sleep(0.002)
            with guard:
                state["inside"] -= 1
            permit.release()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(12)]
    for thread in threads:
        thread.start()
    _join_all(threads, 60)
    assert errors == [] and len(fences) == 48
    assert 1 <= state["most"] <= 3
    assert len(set(fences)) == 48
    permits = [Semaphore(target, name, 3, ttl=10, auto_renew=False) for _ in range(4)]
    assert all(p.acquire(blocking=False) for p in permits[:3])
    assert permits[3].acquire(blocking=False) is False
    assert permits[3].locked()
    held = [p.fence or 0 for p in permits[:3]]
    assert max(fences) < held[0] < held[1] < held[2]
    permits[0].release()
    assert permits[3].acquire(blocking=False)
    assert (permits[3].fence or 0) > held[2]
    for permit in permits[1:]:
        permit.release()


# -- rate limits -----------------------------------------------------------------------------
def test_a_rate_limiter_grants_at_most_rate_plus_burst_minus_one_per_period(
    target: Any, name: str
) -> None:
    """RateLimiter("5/s", burst=2) grants <= 6 per second, says retry_after (quorum: refused)."""
    if _quorum(target):
        with pytest.raises(ConfigError, match="Redlock"):
            RateLimiter(target, name, "5/s", burst=2)
        return
    limiter = RateLimiter(target, name, "5/s", burst=2)
    assert limiter.acquire() and limiter.acquire()  # the burst
    refused = limiter.acquire()
    assert not refused.granted and 0 < refused.retry_after <= 0.2
    again = limiter.acquire()  # the refusal took nothing: the wait only shrank
    assert not again.granted and again.retry_after <= refused.retry_after
    time.sleep(again.retry_after + 0.005)
    assert limiter.acquire().granted
    # Grants as fast as they come for 1.2 s: (sent, answered) times of each grant.
    spans: list[tuple[float, float]] = []
    stop = time.monotonic() + 1.2
    while time.monotonic() < stop:
        sent = time.monotonic()
        grant = limiter.acquire()
        if grant.granted:
            spans.append((sent, time.monotonic()))
        else:
            assert 0 < grant.retry_after <= 0.2
            time.sleep(min(grant.retry_after, 0.05))
    most = 5 + 2 - 1
    assert len(spans) >= 5
    for i in range(len(spans) - most):  # grant i+6 is at least one period after grant i
        assert spans[i + most][1] - spans[i][0] >= 1.0, spans


# -- queued holds ----------------------------------------------------------------------------
def test_queued_hold_claim_duplicate_replace_release_and_hand_over(target: Any, name: str) -> None:
    """QueuedHold claims, duplicates, replaces, releases, hands over to a Lock (quorum: refused)."""
    if _quorum(target):
        with pytest.raises(ConfigError, match="enqueue-time holds") as refused:
            QueuedHold(target, name)
        with pytest.raises(ConfigError) as refused_run:
            RunLock(target, name, handover=Handover("t1"), auto_renew=False)
        assert str(refused.value) == str(refused_run.value)
        return
    hold = QueuedHold(target, name)
    assert hold.claim("t1", 60).outcome == "queued"
    assert hold.claim("t1", 60).outcome == "queued"  # its own hold, renewed
    duplicate = hold.claim("t2", 60)
    assert (duplicate.outcome, duplicate.owner, duplicate.state) == ("duplicate", "t1", "queued")
    replaced = hold.claim("t3", 60, replace=True)
    assert (replaced.outcome, replaced.owner) == ("replaced", "t1")
    assert hold.release("t1") is False  # not t1's any more
    stale = RunLock(target, name, handover=Handover("t1"), auto_renew=False)
    assert stale.acquire(blocking=False) is False
    assert stale.superseded and stale.queued_owner == "t3"
    run = RunLock(target, name, handover=Handover("t3"), auto_renew=False)
    assert run.acquire(blocking=False)
    assert hold.release("t3") is False  # the hold became the lock
    running = hold.claim("t4", 60, running_blocks=True)
    assert (running.outcome, running.owner, running.state) == ("duplicate", "t3", "running")
    run.release()
    assert hold.claim("t4", 60, running_blocks=True).outcome == "queued"
    assert hold.release("t4") is True
    assert hold.release("t4") is False


def test_a_gone_run_is_kept_for_its_redelivered_copy(target: Any, name: str) -> None:
    """keep_for_redelivery: the run of task t1 (its process gone, its message coming back)
    stays t1's: a new call is its duplicate (shown queued) or is queued behind it, no other
    id's hand-over and no stale token can take it, and t1's copy, already waiting, is woken
    and takes it over with a higher fence; the call queued behind it runs next."""
    if _quorum(target):
        return  # no queued holds on a quorum (refused: the test above)
    hold = QueuedHold(target, name)
    assert hold.claim("t1", 60).outcome == "queued"
    t1 = {"task_id": "t1"}  # a worker's run records its task id
    run = RunLock(target, name, ttl=30, handover=Handover("t1"), auto_renew=False, owner_info=t1)
    assert run.acquire(blocking=False)
    assert hold.keep_for_redelivery("t1", 60, pid=-1) is False  # another process's run
    assert hold.keep_for_redelivery("t2", 60) is False  # another task id's
    copy = RunLock(target, name, ttl=30, handover=Handover("t1"), auto_renew=False)
    began = time.monotonic()
    thread, out = _in_thread(lambda: copy.acquire(blocking=True, timeout=20))
    assert hold.keep_for_redelivery("t1", 60, pid=os.getpid()) is True
    thread.join(21)
    assert out.get("result") is True, out
    assert out["at"] - began < 10, "woken by the keep, not by the 30 s lease"
    assert copy.fence is not None and run.fence is not None and copy.fence > run.fence
    with pytest.raises(LockLost):
        run.release()  # the gone run's token holds nothing any more
    copy.release()
    assert hold.claim("t2", 60).outcome == "queued"  # the name is free again


def test_a_kept_run_is_a_duplicate_and_queues_one_behind_it(target: Any, name: str) -> None:
    """While t1's run is kept for its copy (`celery locks` shows it queued, with its fence):
    a "return" call gets t1 (state "queued"), a
    "queue_one" call is queued behind it and keeps its hold when t1's copy takes over, and
    another id's hand-over is refused until t1's copy has run."""
    if _quorum(target):
        return
    hold = QueuedHold(target, name)
    t1 = Handover("t1", strict=False)
    run = RunLock(target, name, handover=t1, auto_renew=False, owner_info={"task_id": "t1"})
    assert run.acquire(blocking=False)
    assert hold.keep_for_redelivery("t1", 60)
    [kept] = read_lock(target, "redlock:", name)
    assert (kept.state, kept.record["task_id"], kept.fence) == ("queued", "t1", run.fence)
    dup = hold.claim("t2", 60, running_blocks=True)
    assert (dup.outcome, dup.owner, dup.state) == ("duplicate", "t1", "queued")
    assert hold.claim("t3", 60).outcome == "queued"  # one queued behind the kept run
    other = RunLock(target, name, ttl=30, handover=Handover("t3"), auto_renew=False)
    assert other.acquire(blocking=False) is False
    copy = RunLock(target, name, ttl=30, handover=Handover("t1"), auto_renew=False)
    assert copy.acquire(blocking=False), "t1's copy takes it over, t3's hold notwithstanding"
    assert hold.claim("t4", 60).owner == "t3"  # t3 still queued
    copy.release()
    assert other.acquire(blocking=False)
    other.release()


# -- records ---------------------------------------------------------------------------------
def test_lock_records_are_written_only_by_the_holder(target: Any, name: str) -> None:
    """LockRecords are claimed only by the holder, never go stale, and reach the next holder."""
    a = Lock(target, name, ttl=30, auto_renew=False)
    records = LockRecords(a, "ticks")
    assert records.claim("beat", {"at": 1}, n=1).outcome == "lost"
    assert a.acquire(blocking=False)
    assert records.claim("beat", {"at": 1}, n=1).outcome == "claimed"
    assert records.claim("beat", {"at": 1}, n=1).outcome == "claimed"  # a re-sent copy
    stale = records.claim("beat", {"at": 0}, n=0)
    assert stale.outcome == "stale" and json.loads(stale.record)["n"] == 1
    assert json.loads(records.load()["beat"]) == {"at": 1, "fence": a.fence, "n": 1}
    _on_every_master(target, name)
    assert force_release(target, PREFIX, name).outcome == "released"
    b = Lock(target, name, ttl=30, auto_renew=False)
    assert b.acquire(blocking=False)
    assert records.claim("beat", {"at": 2}, n=2).outcome == "lost"  # a's lease looks valid
    mine = LockRecords(b, "ticks")
    assert json.loads(mine.load()["beat"])["n"] == 1
    assert mine.claim("beat", {"at": 2}, n=2).outcome == "claimed"
    assert json.loads(mine.load()["beat"]) == {"at": 2, "fence": b.fence, "n": 2}
    b.release()


# -- fork ------------------------------------------------------------------------------------
def _child_report(lock: Lock, target: Any, name: str) -> dict[str, Any]:
    """In the forked child: what touching the parent's lock and locking anew give."""
    report: dict[str, Any] = {"owned": lock.owned(), "fence": lock.fence}
    for verb in ("release", "extend"):
        try:
            getattr(lock, verb)()
            report[verb] = "ok"
        except RedlockError as exc:
            report[verb] = type(exc).__name__
    own = Lock(target, f"{name}:child", ttl=10, auto_renew=False)
    report["own"] = own.acquire(blocking=False)
    if report["own"]:
        own.release()
    same = Lock(target, name, ttl=10, auto_renew=False)
    report["sees_parent"] = same.read_holder() is not None
    report["same"] = same.acquire(blocking=False)
    if report["same"]:
        same.release()
    return report


def test_a_forked_child_holds_none_of_its_parents_locks(target: Any, name: str) -> None:
    """A forked child holds none of its parent's locks (NotOwned) and can lock on its own.

    In the child, the parent's Lock object is not held: release() and extend() raise
    NotOwned (not LockLost), owned() is False, fence is None. What it sees of the name:
    on Redis backends the parent's lock, held (so it cannot take it); on memory an empty
    store, since a forked child gets a new one per URL (it sees no lock of its parent's,
    takes the same name freely, and the parent never sees that: it still holds its own).
    """
    lock = Lock(target, name, ttl=30)
    assert lock.acquire(blocking=False)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: report, then leave without pytest's cleanup
        try:
            os.close(read_end)
            try:
                report = _child_report(lock, target, name)
            except BaseException as exc:  # reported to the parent
                report = {"error": repr(exc)}
            os.write(write_end, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 30.0)
        seen = json.loads(os.read(read_end, 65536) or b"{}") if ready else {"error": "silent"}
    finally:
        os.close(read_end)
        assert wait_child(pid) == 0
    memory = isinstance(open_backend(target), MemoryBackend)
    assert seen == {
        "owned": False,
        "fence": None,
        "release": "NotOwned",
        "extend": "NotOwned",
        "own": True,
        "same": memory,
        "sees_parent": not memory,
    }
    assert lock.owned()
    lock.release()


# -- names -----------------------------------------------------------------------------------
def test_tricky_names_are_held_side_by_side_and_read_back_as_written(target: Any) -> None:
    """Tricky names hold locks, holds, permits, limiters side by side; all read back as stored."""
    prefix = f"names-{uuid.uuid4().hex[:8]}:"  # the names are fixed: apart by prefix
    stored = sorted(lock_keys(n).name for n in TRICKY_NAMES)
    quorum, masters = _quorum(target), open_backend(target).masters
    locks = [Lock(target, n, ttl=30, key_prefix=prefix) for n in TRICKY_NAMES]
    holds = [] if quorum else [QueuedHold(target, n, key_prefix=prefix) for n in TRICKY_NAMES]
    permits = [] if quorum else [Semaphore(target, n, 2, key_prefix=prefix) for n in TRICKY_NAMES]
    limiters = (
        [] if quorum else [RateLimiter(target, n, "1/m", key_prefix=prefix) for n in TRICKY_NAMES]
    )
    try:
        assert all(lock.acquire(blocking=False) for lock in locks)  # "\\}{" beside "}{"
        assert all(hold.claim("t-queued", 60).outcome == "queued" for hold in holds)
        assert all(permit.acquire(blocking=False) for permit in permits)
        assert all(limiter.acquire() for limiter in limiters)
        rows_per_name = masters if quorum else 3  # a lock per master; or lock, hold, permit
        assert wait_for(
            lambda: len(scan_locks(target, prefix)) == rows_per_name * len(stored), timeout=5
        )
        counts = Counter((i.name, i.kind, i.state) for i in scan_locks(target, prefix))
        expected = {(n, "lock", "held"): masters for n in stored}
        if not quorum:
            expected |= {(n, "lock", "queued"): 1 for n in stored}
            expected |= {(n, "permit", "held"): 1 for n in stored}
        assert counts == expected
        for name in TRICKY_NAMES:
            keys = lock_keys(name, prefix)
            rows = read_lock(target, prefix, name)
            assert len(rows) == rows_per_name and {i.name for i in rows} == {keys.name}
            assert {i.key for i in rows if i.kind == "lock" and i.state == "held"} == {keys.lock}
            rate = read_rate(target, prefix, name)
            assert (rate.name if rate else None) == (None if quorum else keys.name)
        assert [i.name for i in scan_rates(target, prefix)] == ([] if quorum else stored)
        escaped = sorted(n for n in stored if n.startswith(("}", "\\")))
        for pattern, names in (
            ("[}\\\\]*", escaped),
            ("}{", ["}{"]),
            ("a*", ["a:fence", "a}:fence", "a}b"]),
        ):
            assert sorted({i.name for i in scan_locks(target, prefix, pattern)}) == names
            assert [i.name for i in scan_rates(target, prefix, pattern)] == (
                [] if quorum else names
            )
    finally:
        for held in (*locks, *permits):
            with contextlib.suppress(RedlockError):  # not acquired: the test failed above
                held.release()
        for hold in holds:
            hold.release("t-queued")
