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
import gc
import itertools
import json
import logging
import os
import select
import sys
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
    Redlock,
    RedlockError,
    RunLock,
    Semaphore,
    Slot,
    Status,
    StoreUnavailable,
    admin,
    connect,
    lock_keys,
    open_backend,
)
from celery_redlock.core.admin import ForceRelease, LockInfo, RateInfo
from celery_redlock.core.backend_types import RECENT_BYTES, Refused, Rule
from celery_redlock.core.backends.redis.scripts import ACQUIRE, HOLD_ALL, PERMIT_ACQUIRE, Script
from celery_redlock.core.keys import permit_keys
from celery_redlock.core.listing import Listing, ListQuery
from celery_redlock.core.renewal import get_manager

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
    """A 400 ms lease (not rounded to seconds) ends on the clock; its waiter gets it soon after."""
    a = Lock(target, name, ttl=0.4, auto_renew=False)
    b = Lock(target, name, ttl=10, auto_renew=False)
    # Connected first: a fresh client's first call (a Sentinel's master lookup, a
    # connect) on a loaded machine can outlast so short a lease, and a grant that comes
    # back after its lease ended is no grant.
    assert read_lock(target, PREFIX, name) == []
    assert a.acquire(blocking=False)
    leases = [info.ttl_ms for info in read_lock(target, PREFIX, name)]
    assert leases and all(0 < ms <= 400 for ms in leases), leases
    assert b.acquire(blocking=False) is False
    started = time.monotonic()
    assert b.acquire(blocking=True, timeout=5)
    took = time.monotonic() - started
    assert took < 1.5, f"the waiter took {took:.3f} s to get a lock whose lease was 400 ms"
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


def _loss_lines(caplog: pytest.LogCaptureFixture, name: str) -> list[tuple[str, str]]:
    """(level, message) of every record about lock *name* at WARNING or worse."""
    severe = ("WARNING", "ERROR", "CRITICAL")
    return [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.levelname in severe and repr(name) in r.getMessage()
    ]


def test_a_lock_outside_celery_logs_its_loss_once_at_warning(
    target: Any, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A Lock used outside Celery, force-released while held, logs its loss exactly once at
    WARNING (the lock, why), whoever finds it: the renewal thread (then its release raises
    LockLost with no second line), or its own release."""
    renewed = Lock(target, name, ttl=0.6)
    with caplog.at_level("DEBUG", logger="celery_redlock"):
        assert renewed.acquire(blocking=False)
        _on_every_master(target, name)
        assert force_release(target, PREFIX, name).outcome == "released"
        assert wait_for(lambda: renewed.lost, timeout=3, what="the renewal to see the loss")
        with pytest.raises(LockLost):
            renewed.release()
    found = _loss_lines(caplog, name)
    assert len(found) == 1 and found[0][0] == "WARNING", found
    assert found[0][1].startswith(f"lock {name!r} LOST after "), found
    assert "the key is gone" in found[0][1] or "another owner" in found[0][1], found
    caplog.clear()
    plain = Lock(target, name, ttl=30, auto_renew=False)
    with caplog.at_level("DEBUG", logger="celery_redlock"):
        assert plain.acquire(blocking=False)
        _on_every_master(target, name)
        assert force_release(target, PREFIX, name).outcome == "released"
        with pytest.raises(LockLost):
            plain.release()
    found = _loss_lines(caplog, name)
    assert len(found) == 1 and found[0][0] == "WARNING", found
    assert "LOST after" in found[0][1] and "found at its release" in found[0][1], found


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
        return int(open_backend(target).client.strlen(key))  # memory: its in-process server
    sizes = []
    for server in nodes:
        with contextlib.suppress(Exception):  # a cluster node that does not serve the slot
            sizes.append(server.client().strlen(key))
    return max(sizes)


def test_the_released_token_record_is_capped_and_keeps_the_recent_ones(
    target: Any, name: str, nodes: list[RedisServer]
) -> None:
    """Releases of one name within one lease, twenty times what the cap (RECENT_BYTES)
    holds, keep its released-token record under the cap, and a re-sent copy of a recent
    release still reads OK, while one of the first (long dropped) reads as gone."""
    backend, slot = open_backend(target), Slot(lock_keys(name, PREFIX))
    tokens = [f"{i:040x}" for i in range(20 * RECENT_BYTES // 40)]
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


# -- a Lock object's edge cases ------------------------------------------------------------
def _run_out(target: Any, name: str, lock: Lock) -> None:
    """Wait until *lock*'s lease ran out: past its local deadline, and its key gone from
    every master (the server may keep it a little longer than the local clock)."""
    assert wait_for(lambda: time.monotonic() > lock.valid_until, timeout=3, what="the deadline")
    assert wait_for(lambda: read_lock(target, PREFIX, name) == [], timeout=3, what="the expiry")


def test_a_lease_that_ran_out_is_taken_again_through_the_backend(target: Any, name: str) -> None:
    """A Lock whose lease ran out acquires again (a new fence, the loss reported once) and,
    once another owner holds the name, is refused like any other owner."""
    lost: list[Lock] = []
    lock = Lock(target, name, ttl=0.2, auto_renew=False, on_lost=lost.append)
    assert lock.acquire(blocking=False)
    first = lock.fence
    _run_out(target, name, lock)
    assert lock.acquire(blocking=False)
    assert lost == [lock] and not lock.lost
    assert first is not None and (lock.fence or 0) > first
    assert lock.owned() and lock.locked()
    _run_out(target, name, lock)
    other = Lock(target, name, ttl=10, auto_renew=False)
    assert other.acquire(blocking=False)
    assert lock.acquire(blocking=False) is False
    assert lost == [lock, lock]
    assert other.owned()
    with pytest.raises(LockLost):
        lock.release()
    other.release()


def test_a_reentrant_lease_that_ran_out_is_not_taken_again_from_memory(
    target: Any, name: str
) -> None:
    """reentrant=True: after its lease ran out and another Lock took the name, acquire()
    asks the backend and is refused: never two holders."""
    # 0.5 s: long enough that both acquires land inside the lease on a loaded machine
    lock = Lock(target, name, ttl=0.5, auto_renew=False, reentrant=True)
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)  # counted while the lease is valid
    _run_out(target, name, lock)
    other = Lock(target, name, ttl=10, auto_renew=False)
    assert other.acquire(blocking=False)
    assert lock.acquire(blocking=False) is False
    assert other.owned() and not lock.owned()
    assert [info.fence for info in read_lock(target, PREFIX, name)][:1] == [other.fence]
    other.release()
    assert lock.acquire(blocking=False)  # free again: taken afresh, counted from one
    lock.release()
    assert not lock.locked()


def test_a_reentrant_lock_counts_per_thread(target: Any, name: str) -> None:
    """A reentrant Lock shared by two threads is reentrant for the thread that holds it;
    the other thread is another owner: refused, or waits until the holder released."""
    lock = Lock(target, name, ttl=10, auto_renew=False, reentrant=True)
    assert lock.acquire(blocking=False) and lock.acquire(blocking=False)
    fence = lock.fence
    thread, out = _in_thread(lambda: (lock.acquire(blocking=False), lock.acquire(timeout=0.2)))
    _join_all([thread], 5)
    assert out.get("result") == (False, False), out
    thread, out = _in_thread(lock.release)
    _join_all([thread], 5)
    assert isinstance(out.get("error"), NotOwned), out
    assert lock.fence == fence and lock.owned()

    def take_hold_release() -> int | None:
        assert lock.acquire(timeout=8)
        held = lock.fence
        lock.release()
        return held

    waiter, out = _in_thread(take_hold_release)
    time.sleep(0.1)  # the waiter is blocked on this object now
    assert "result" not in out and "error" not in out, out
    lock.release()
    assert "result" not in out, "the waiter got in while the holder's thread still held it"
    released = time.monotonic()
    lock.release()
    _join_all([waiter], 9)
    assert out["at"] - released < 2.0, out
    assert fence is not None and (out.get("result") or 0) > fence, out
    assert not lock.locked()


def test_a_lock_nobody_references_is_no_longer_renewed(target: Any, name: str) -> None:
    """A held Lock that was dropped (no release) leaves the renewal thread's locks at the
    collection and its key expires within its TTL; one in a ``with`` block, bound to no
    name, stays among them and the next round renews it."""
    manager = get_manager()
    held = lambda lock_name: [lk for lk in manager.held() if lk.name == lock_name]  # noqa: E731

    def take_and_drop() -> None:
        assert Lock(target, name, ttl=1.0).acquire(blocking=False)

    take_and_drop()
    gc.collect()
    assert held(name) == []
    probe = Lock(target, name, ttl=10, auto_renew=False)
    expired = lambda: not probe.locked()  # noqa: E731 - a quorum's is three calls: 20 ms apart
    assert wait_for(expired, timeout=3, what="the dropped lock's expiry", interval=0.02)
    # Its round comes when asked (renew_soon), not a third of the lease later; a lease of
    # 5 s outlasts a pause of this process (a full collection on a loaded machine).
    with Lock(target, f"{name}:kept", ttl=5.0):
        gc.collect()
        (kept,) = held(f"{name}:kept")
        before = kept.valid_until
        manager.renew_soon()
        assert wait_for(lambda: kept.valid_until > before, timeout=4, what="a confirmed renewal")
        probe_kept = Lock(target, f"{name}:kept", ttl=10, auto_renew=False)
        assert probe_kept.locked()
    assert held(f"{name}:kept") == [] and not probe_kept.locked()


def test_a_release_the_backend_did_not_answer_can_be_retried(target: Any, name: str) -> None:
    """A release() that raised StoreUnavailable keeps the acquisition: a renewal answer
    that arrives meanwhile does not mark it lost, the key stays held, and release() again
    frees it."""
    real = open_backend(target)

    class Unanswered:
        """The real backend, whose first release does not get through."""

        failures = 1
        lock: Lock | None = None

        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        def release(self, slot: Slot, token: str, notice_ms: int) -> Status:
            if self.failures:
                self.failures -= 1
                assert self.lock is not None
                # A renewal round that read the lock before release() began answers now.
                self.lock.renewed(time.monotonic(), token, Status.GONE)
                raise StoreUnavailable(name, {"test": "release not answered"})
            return real.release(slot, token, notice_ms)

    backend = Unanswered()
    lost: list[Lock] = []
    lock = Lock(backend, name, ttl=10, on_lost=lost.append)
    backend.lock = lock
    assert lock.acquire(blocking=False)
    with pytest.raises(StoreUnavailable):
        lock.release()
    assert not lock.lost and lost == []
    assert lock.owned() and lock.valid_until > time.monotonic()
    other = Lock(target, name, ttl=10, auto_renew=False)
    assert other.acquire(blocking=False) is False
    lock.release()
    assert not lock.locked() and read_lock(target, PREFIX, name) == []
    assert other.acquire(blocking=False)
    other.release()
    with pytest.raises(NotOwned):
        lock.release()


@pytest.mark.parametrize(
    ("blocking", "timeout", "named"),
    [(True, -1, "-1"), (None, -0.5, "-0.5"), (True, float("nan"), "nan"), (False, 5, "5")],
)
def test_acquire_refuses_a_negative_or_nan_timeout_and_a_timeout_without_blocking(
    target: Any, name: str, blocking: bool | None, timeout: float, named: str
) -> None:
    """acquire() refuses a negative or NaN timeout, and one with blocking=False, with a
    ConfigError (a ValueError) naming it, on Lock, Semaphore and Redlock; nothing is taken."""
    locks: list[Lock] = [Lock(target, name, ttl=10), Semaphore(target, name, 1, ttl=10)]
    if isinstance(target, list):
        locks.append(Redlock(target, name, ttl=10))
    for lock in locks:
        with pytest.raises(ConfigError, match=f"timeout.*{named}") as refused:
            lock.acquire(blocking, timeout)
        assert isinstance(refused.value, ValueError)
        assert lock.fence is None
    assert not locks[0].locked()


def test_a_lock_made_non_blocking_refuses_a_timeout(target: Any, name: str) -> None:
    """Lock(blocking=False, timeout=...) and a timeout for a non-blocking Lock's acquire()
    are ConfigErrors; its own timeout does not bind a non-blocking call."""
    with pytest.raises(ConfigError, match="timeout=5 with blocking=False"):
        Lock(target, name, blocking=False, timeout=5)
    quick = Lock(target, name, ttl=10, auto_renew=False, blocking=False)
    with pytest.raises(ConfigError, match="timeout=1 with blocking=False"):
        quick.acquire(timeout=1)
    patient = Lock(target, name, ttl=10, auto_renew=False, timeout=5)
    assert patient.acquire(blocking=False)
    assert quick.acquire() is False
    patient.release()


def test_a_with_block_whose_body_raised_notes_the_loss_on_its_exception(
    target: Any, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``with`` body that raised while its lock was lost propagates its own exception,
    with the loss as a note (Python 3.10, which has no notes: a WARNING line on
    celery_redlock.release); a body that did not raise gets the LockLost."""
    lock = Lock(target, name, ttl=0.2, auto_renew=False)
    caplog.set_level(logging.WARNING, "celery_redlock.release")
    with pytest.raises(KeyError) as raised, lock:
        _run_out(target, name, lock)
        raise KeyError("the body's own error")
    if sys.version_info >= (3, 11):
        notes = getattr(raised.value, "__notes__", [])
    else:
        notes = [r.getMessage() for r in caplog.records if "after this error" in r.getMessage()]
    assert len(notes) == 1 and "LockLost" in notes[0] and repr(name) in notes[0], notes
    assert not lock.locked()
    with pytest.raises(LockLost), lock:
        _run_out(target, name, lock)


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
@pytest.mark.parametrize(
    ("blocking", "timeout", "named"),
    [(True, -1, "-1"), (True, -0.5, "-0.5"), (True, float("nan"), "nan"), (False, 5, "5")],
)
def test_a_rate_limiter_refuses_a_negative_or_nan_timeout_as_a_lock_does(
    target: Any, name: str, blocking: bool, timeout: float, named: str
) -> None:
    """RateLimiter.acquire() refuses a negative or NaN timeout, and one with
    blocking=False, with the ConfigError (a ValueError) naming it that Lock.acquire()
    gives; nothing is taken (a quorum has no rates)."""
    if _quorum(target):
        with pytest.raises(ConfigError, match="Redlock"):
            RateLimiter(target, name, "1/m")
        return
    limiter = RateLimiter(target, name, "1/m")
    with pytest.raises(ConfigError, match=f"timeout.*{named}") as refused:
        limiter.acquire(blocking, timeout)
    assert isinstance(refused.value, ValueError)
    assert limiter.acquire().granted  # the refused call took no slot


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
    memory = open_backend(target).describe().startswith("memory://")
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


# -- flow control ----------------------------------------------------------------------------
def _limit(name: str, limit: int) -> Rule:
    """A ``Limit(name, limit)`` rule as a run's lock takes it (``flow.rules_for``): a
    permit of *name*, or for a Limit of one the mutex of *name*."""
    keys = lock_keys(name, PREFIX) if limit == 1 else permit_keys(name, PREFIX)
    return Rule(keys, limit=limit)


def _rate(name: str, interval_us: int, burst: int = 1, cost: int = 1) -> Rule:
    """A ``Rate`` rule on *name*: a unit per *interval_us*, *burst* at once, *cost* a run."""
    return Rule(lock_keys(name, PREFIX), interval_us=interval_us, burst=burst, cost=cost)


def _ruled(target: Any, name: str, rules: list[Rule], ttl: float = 10, **options: Any) -> Lock:
    """A run's lock of *name*: it takes *rules* with it and obeys the operator controls."""
    options.setdefault("auto_renew", False)
    lock = Lock(target, name, ttl=ttl, **options)
    lock.hold_with(rules)
    return lock


def _control(target: Any, name: str, kind: str, value: str | None, ttl_ms: int = 0) -> bool:
    """Set (or lift: None) control *kind* of *name*, as ``celery locks pause / set`` does."""
    return open_backend(target).set_control(lock_keys(name, PREFIX).control, kind, value, ttl_ms)


def _permits(target: Any, name: str) -> int:
    """How many holds of *name* (a Limit's permits, or its mutex) there are."""
    return sum(1 for info in read_lock(target, PREFIX, name) if info.state != "queued")


def _free_units(target: Any, name: str) -> int | None:
    """Units a Rate of *name* grants right now (None: it was never used)."""
    info = read_rate(target, PREFIX, name)
    return None if info is None else info.free


def _without_flow(target: Any, name: str) -> bool:
    """True on a backend without flow control (a Redlock quorum), after asserting that a
    lock's rules are refused there with a ConfigError naming it, and that a lock asked to
    obey controls alone still works (reading none)."""
    if not _quorum(target):
        return False
    lock = Lock(target, name, ttl=10, auto_renew=False)
    with pytest.raises(ConfigError, match="flow control"):
        lock.hold_with([_limit(f"{name}:limit", 2)])
    lock.hold_with([], controlled=True)
    assert not lock.slot.controlled  # a quorum reads no controls
    assert lock.acquire(blocking=False)
    lock.release()
    return True


def test_flow_a_refusal_takes_nothing(target: Any, name: str) -> None:
    """A run refused by one of its rules, or by its own key's holder, holds nothing: its
    lock stays free, its other Limits' permits are not taken, its Rates' units are not
    spent (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    full, other = _limit(f"{name}:full", 1), _limit(f"{name}:other", 5)
    rate = _rate(f"{name}:rate", 60_000_000, burst=2)  # 1/m, 2 at once
    holder = _ruled(target, f"{name}:holder", [full])
    spender = _ruled(target, f"{name}:spender", [rate])
    assert holder.acquire(blocking=False) and spender.acquire(blocking=False)
    spender.release()  # a Rate's unit is spent for good: 1 of 2 left
    assert _free_units(target, rate.name) == 1
    run = _ruled(target, name, [full, other, rate])
    assert run.acquire(blocking=False) is False
    assert (run.refused_by, run.refusal) == (full.name, "limit")
    assert not run.locked() and read_lock(target, PREFIX, name) == []
    assert _permits(target, other.name) == 0
    assert _free_units(target, rate.name) == 1
    # Refused by a Rate: the Limit's permit is not taken.
    second = _ruled(target, f"{name}:second", [other, rate])
    assert second.acquire(blocking=False)  # the last unit
    third = _ruled(target, f"{name}:third", [other, rate])
    assert third.acquire(blocking=False) is False
    assert (third.refused_by, third.refusal) == (rate.name, "rate")
    assert third.holder_ttl_ms is not None and 0 < third.holder_ttl_ms <= 60_000
    assert _permits(target, other.name) == 1 and not third.locked()
    # Refused by its own key's holder (a plain contention): no rule is taken.
    squatter = Lock(target, f"{name}:fourth", ttl=10, auto_renew=False)
    assert squatter.acquire(blocking=False)
    fourth = _ruled(target, f"{name}:fourth", [other])
    assert fourth.acquire(blocking=False) is False
    assert (fourth.refused_by, fourth.refusal) == ("", "")
    assert _permits(target, other.name) == 1
    for lock in (squatter, second, holder):
        lock.release()


def test_flow_a_full_limit_refuses_with_its_name_and_its_holder(target: Any, name: str) -> None:
    """A Limit whose permits are all held refuses the next run: refused_by is the Limit's
    name, refusal "limit", holder the record of the permit that expires first, and no
    wait is known (a permit frees when its holder ends); once a permit is given back the
    run gets in (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    limit = _limit(f"{name}:imports", 2)
    first = _ruled(target, f"{name}:1", [limit], ttl=5, owner_info={"task_id": "t-1"})
    second = _ruled(target, f"{name}:2", [limit], ttl=10, owner_info={"task_id": "t-2"})
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    third = _ruled(target, f"{name}:3", [limit])
    assert third.acquire(blocking=False) is False
    assert (third.refused_by, third.refusal) == (limit.name, "limit")
    assert third.holder.get("task_id") == "t-1"  # its permit expires first
    assert third.holder_ttl_ms is None
    first.release()
    assert third.acquire(blocking=False)
    assert _permits(target, limit.name) == 2
    second.release()
    third.release()


def test_flow_a_limit_of_one_is_the_mutex_of_its_name(target: Any, name: str) -> None:
    """A Limit of one and a Lock of its name exclude each other: a run is refused while
    the Lock holds the name (its record as holder, no known wait), a Lock is refused while
    a run holds it, and their fences come from one counter (quorum: rules
    refused)."""
    if _without_flow(target, name):
        return
    shared = _limit(f"{name}:shared", 1)
    plain = Lock(target, shared.name, ttl=10, auto_renew=False, owner_info={"task_id": "t-9"})
    run = _ruled(target, name, [shared])
    assert plain.acquire(blocking=False)
    assert run.acquire(blocking=False) is False
    assert (run.refused_by, run.refusal) == (shared.name, "limit")
    assert run.holder.get("task_id") == "t-9" and run.holder_ttl_ms is None
    assert not run.locked()
    fence = plain.fence or 0
    plain.release()
    assert run.acquire(blocking=False)
    run_fence = run.fences[shared.name]
    assert run_fence > fence
    assert plain.acquire(blocking=False) is False
    holders = open_backend(target).holders(Slot(lock_keys(shared.name, PREFIX)))
    assert [h.token for h in holders] == [run.token]
    run.release()
    assert plain.acquire(blocking=False) and (plain.fence or 0) > run_fence
    plain.release()


def test_flow_a_pause_refuses_runs_until_it_lapses_or_is_lifted(target: Any, name: str) -> None:
    """A pause of a run's own name, or of one of its rules' names, refuses it ("paused",
    the reason as holder, the time left as the wait: None with no end); a timed pause
    lapses by itself, an open one holds until lifted; a Lock that is not a run's (user
    code) ignores pauses (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    set_at = time.monotonic()
    assert _control(target, name, "pause", "maintenance", 300)
    run = _ruled(target, name, [])
    assert run.acquire(blocking=False) is False
    assert (run.refused_by, run.refusal, run.holder) == (name, "paused", {"reason": "maintenance"})
    assert run.holder_ttl_ms is not None and 0 < run.holder_ttl_ms <= 300
    plain = Lock(target, name, ttl=10, auto_renew=False)
    assert plain.acquire(blocking=False)
    plain.release()
    assert wait_for(lambda: run.acquire(blocking=False), timeout=3, what="the pause to lapse")
    assert time.monotonic() - set_at >= 0.25
    run.release()
    limit = _limit(f"{name}:partner", 3)
    assert _control(target, limit.name, "pause", "upstream down")  # no end
    ruled = _ruled(target, f"{name}:ruled", [limit])
    assert ruled.acquire(blocking=False) is False
    assert (ruled.refused_by, ruled.refusal) == (limit.name, "paused")
    assert ruled.holder == {"reason": "upstream down"} and ruled.holder_ttl_ms is None
    assert _control(target, limit.name, "pause", None) is True
    assert _control(target, limit.name, "pause", None) is False  # nothing left to lift
    assert ruled.acquire(blocking=False)
    ruled.release()


def test_flow_a_run_without_rules_runs_its_own_acquire_script_alone(
    redis_server: RedisServer,
) -> None:
    """A run with no rules (a LockedTask run without lock_limits) pays for its own acquire
    script alone, acquire.lua for a mutex and permit_acquire.lua for a permit, never
    hold_all.lua; that script reads its name's controls: a pause refuses the run as
    hold_all.lua does, a limit set on a semaphore's name changes its permits. (Its own
    server: the scripts it loaded are the ones that ran.)"""
    client = redis_server.client()

    def loaded(script: Script) -> bool:
        return any(client.script_exists(script.sha, script.indexed.sha))

    try:
        run = _ruled(client, "hot:mutex", [])
        assert run.acquire(blocking=False)
        run.release()
        permits = [Semaphore(client, "hot:sem", 3, ttl=10, auto_renew=False) for _ in range(2)]
        for permit in permits:
            permit.hold_with([], controlled=True)
        assert _control(client, "hot:sem", "limit", "1")
        assert permits[0].acquire(blocking=False)
        assert permits[1].acquire(blocking=False) is False
        permits[0].release()
        assert _control(client, "hot:mutex", "pause", "deploy", 60_000)
        assert run.acquire(blocking=False) is False
        assert (run.refused_by, run.refusal) == ("hot:mutex", "paused")
        assert run.holder == {"reason": "deploy"}
        assert run.holder_ttl_ms is not None and 50_000 < run.holder_ttl_ms <= 60_000
        assert (loaded(ACQUIRE), loaded(PERMIT_ACQUIRE), loaded(HOLD_ALL)) == (True, True, False)
    finally:
        client.close()


def test_flow_a_blocked_run_gets_in_when_its_pause_ends(target: Any, name: str) -> None:
    """A blocking acquire refused by a 0.3 s pause waits out the pause's time left and gets
    in soon after it ends, not after its own timeout (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    run = _ruled(target, name, [])
    set_at = time.monotonic()
    assert _control(target, name, "pause", "deploy", 300)
    assert run.acquire(blocking=True, timeout=1.5)
    took = time.monotonic() - set_at
    run.release()
    assert 0.25 <= took < 1.2, f"got in {took:.3f} s after a 0.3 s pause"


def test_flow_a_run_blocked_by_a_limit_gets_in_soon_after_a_permit_is_given_back(
    target: Any, name: str
) -> None:
    """A blocking acquire refused by a full Limit gets in soon after the holder gives its
    permit back, not when the holder's lease would have ended or at its own timeout
    (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    limit = _limit(f"{name}:limit", 2)
    other = _ruled(target, f"{name}:other", [limit])
    assert other.acquire(blocking=False)
    holder = _ruled(target, f"{name}:holder", [limit])
    waiter = _ruled(target, f"{name}:waiter", [limit])
    assert holder.acquire(blocking=False)
    thread, out = _in_thread(lambda: waiter.acquire(blocking=True, timeout=1.0))
    wait_for(lambda: waiter.refusal == "limit", timeout=3, what="the waiter's first refusal")
    released_at = time.monotonic()
    holder.release()
    _join_all([thread], 5)
    assert out.get("result") is True, out
    waiter.release()
    other.release()
    took = out["at"] - released_at
    assert took < 0.5, f"got in {took:.3f} s after the permit was given back"


def test_flow_a_limit_override_admits_fewer_and_holders_above_it_keep_theirs(
    target: Any, name: str
) -> None:
    """A limit set on a Limit's name below its holders admits no new run until they are
    fewer than it, while those holders keep and give back their permits as usual; lifted,
    the rule's own limit is back (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    limit = _limit(f"{name}:imports", 3)
    runs = [_ruled(target, f"{name}:{i}", [limit]) for i in range(4)]
    assert runs[0].acquire(blocking=False) and runs[1].acquire(blocking=False)
    assert _control(target, limit.name, "limit", "1")
    assert runs[2].acquire(blocking=False) is False
    assert (runs[2].refused_by, runs[2].refusal) == (limit.name, "limit")
    assert runs[0].owned() and runs[1].owned() and _permits(target, limit.name) == 2
    runs[0].release()  # no LockLost: its permit was never taken away
    assert runs[2].acquire(blocking=False) is False  # 1 held, limit 1
    runs[1].release()
    assert runs[2].acquire(blocking=False)
    assert runs[3].acquire(blocking=False) is False
    assert _control(target, limit.name, "limit", None)
    assert runs[3].acquire(blocking=False)
    runs[2].release()
    runs[3].release()


def test_flow_a_limit_override_of_a_semaphores_own_name_admits_fewer(
    target: Any, name: str
) -> None:
    """A run holding one of 3 permits of its own name (lock_limit=3) obeys a limit of 1 set
    on that name: a second run is refused until the first gives its permit back (quorum: rules
    refused)."""
    if _without_flow(target, name):
        return
    runs = [Semaphore(target, name, 3, ttl=10, auto_renew=False) for _ in range(3)]
    for run in runs:
        run.hold_with([], controlled=True)
    assert _control(target, name, "limit", "1")
    assert runs[0].acquire(blocking=False)
    try:
        assert runs[1].acquire(blocking=False) is False
    finally:
        for run in runs:
            with contextlib.suppress(RedlockError):
                run.release()
    assert _control(target, name, "limit", None)
    assert runs[1].acquire(blocking=False) and runs[2].acquire(blocking=False)
    runs[1].release()
    runs[2].release()


def test_flow_a_rate_override_replaces_the_rules_rate_and_burst(target: Any, name: str) -> None:
    """A rate set on a Rate's name replaces the rule's interval, and its burst unless the
    override's is 0 (quorum: rules refused)."""
    if _without_flow(target, name):
        return

    def starts(rule: Rule, n: int) -> list[bool]:
        runs = [_ruled(target, f"{rule.name}:{i}", [rule]) for i in range(n)]
        got = [run.acquire(blocking=False) for run in runs]
        refused = [run for run in runs if not run.fence]
        for run in runs:
            if run.fence:
                run.release()
        for run in refused:
            assert (run.refused_by, run.refusal) == (rule.name, "rate")
            assert run.holder_ttl_ms is not None and 59_000 < run.holder_ttl_ms <= 60_000
        return got

    assert starts(_rate(f"{name}:own", 60_000_000), 2) == [True, False]  # 1/m, 1 at once
    looser = _rate(f"{name}:looser", 60_000_000)
    assert _control(target, looser.name, "rate", "1000|5|1000/s")
    assert starts(looser, 5) == [True] * 5
    stricter = _rate(f"{name}:stricter", 1_000, burst=2)  # 1000/s, 2 at once
    assert _control(target, stricter.name, "rate", "60000000|0|1/m")  # the rule's burst
    assert starts(stricter, 3) == [True, True, False]


def test_flow_a_weighted_run_takes_its_cost_in_units_at_most_the_burst_at_once(
    target: Any, name: str
) -> None:
    """A Rate taking cost units a run: with burst 4 (interval 1 minute), a cost of 3 leaves
    1 unit, so a cost of 2 is refused and a cost of 1 admitted; a cost above the burst (the
    rule's, or an override's) is a ConfigError that takes nothing (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    rate_name = f"{name}:rows"

    def run(cost: int, lock_name: str = name, burst: int = 4) -> Lock:
        return _ruled(target, lock_name, [_rate(rate_name, 60_000_000, burst=burst, cost=cost)])

    heavy = run(3)
    assert heavy.acquire(blocking=False)
    heavy.release()
    assert _free_units(target, rate_name) == 1
    refused = run(2)
    assert refused.acquire(blocking=False) is False and refused.refusal == "rate"
    assert _free_units(target, rate_name) == 1
    light = run(1)
    assert light.acquire(blocking=False)
    light.release()
    assert run(1).acquire(blocking=False) is False
    assert _free_units(target, rate_name) == 0
    with pytest.raises(ConfigError, match="burst"):
        run(5, f"{name}:too-big").acquire(blocking=False)
    assert read_lock(target, PREFIX, f"{name}:too-big") == []
    other = f"{name}:overridden"
    assert _control(target, other, "rate", "1000|2|1000/s")
    with pytest.raises(ConfigError, match="burst"):
        _ruled(target, f"{name}:over", [_rate(other, 1_000, burst=4, cost=3)]).acquire(
            blocking=False
        )
    assert read_lock(target, PREFIX, f"{name}:over") == [] and _free_units(target, other) is None


def test_flow_a_release_gives_back_every_limits_permit(target: Any, name: str) -> None:
    """A run's release gives back its lock and each of its Limits (a Limit of one: its
    name's mutex; else a permit): another run then takes them; a re-sent copy of that
    release is OK (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    first_limit, second_limit = _limit(f"{name}:a", 1), _limit(f"{name}:b", 2)
    first = _ruled(target, f"{name}:first", [first_limit, second_limit])
    second = _ruled(target, f"{name}:second", [first_limit, second_limit])
    assert first.acquire(blocking=False)
    assert second.acquire(blocking=False) is False and second.refused_by == first_limit.name
    assert _permits(target, first_limit.name) == _permits(target, second_limit.name) == 1
    token, slot = first.token, first.slot
    assert token is not None
    first.release()
    assert _permits(target, first_limit.name) == _permits(target, second_limit.name) == 0
    assert open_backend(target).release(slot, token, 10_000) is Status.OK  # a re-sent copy
    assert second.acquire(blocking=False)
    assert set(second.fences) == {second.name, first_limit.name, second_limit.name}
    second.release()


def test_flow_renewal_and_extend_keep_the_limits_permits_past_their_first_lease(
    target: Any, name: str
) -> None:
    """A run's Limits (mutexes, and permits of a Limit of 2 that both runs hold) live as
    long as its lock: renewed with it (0.5 s leases held past 1.1 s) and lengthened by
    extend(); given back, they are free (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    renewed_limit, extended_limit = _limit(f"{name}:renewed", 1), _limit(f"{name}:extended", 1)
    shared = _limit(f"{name}:shared", 2)
    # Scripts loaded and connections made first: the first call through a Sentinel or with
    # a script the server has not seen can outlast a 0.5 s lease on a loaded machine.
    warm = _ruled(target, f"{name}:warm", [_limit(f"{name}:warm-limit", 1)])
    assert warm.acquire(blocking=False)
    warm.release()
    renewed = _ruled(target, f"{name}:r", [renewed_limit, shared], ttl=0.5, auto_renew=True)
    extended = _ruled(target, f"{name}:e", [extended_limit, shared], ttl=0.5)
    assert renewed.acquire(blocking=False) and extended.acquire(blocking=False)
    started = time.monotonic()
    extended.extend(3)
    probes = [
        _ruled(target, f"{name}:probe:{i}", [rule])
        for i, rule in enumerate((renewed_limit, extended_limit, shared))
    ]
    checks = 0
    while time.monotonic() - started < 1.1:  # bounded: past two of the first leases
        for probe in probes:
            assert probe.acquire(blocking=False) is False, f"{probe.name} got in"
            assert probe.refusal == "limit"
        checks += 1
        time.sleep(0.05)
    assert checks >= 5
    assert renewed.owned() and extended.owned()
    renewed.release()
    extended.release()
    assert all(probe.acquire(blocking=False) for probe in probes)
    for probe in probes:
        probe.release()


def test_flow_fences_rise_per_name_and_lock_fences_names_the_lock_and_each_limit(
    target: Any, name: str
) -> None:
    """lock.fences maps the lock's name and each Limit's (not a Rate's) to its fence; each
    name's fences strictly increase across runs, and a Limit shares its name's counter
    with a Lock of that name (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    first, second, third = _limit(f"{name}:a", 2), _limit(f"{name}:b", 2), _limit(f"{name}:c", 1)
    run = _ruled(target, name, [first, second, third, _rate(f"{name}:rate", 1, burst=100)])
    seen: dict[str, list[int]] = {name: [], first.name: [], second.name: [], third.name: []}
    for _ in range(3):
        assert run.acquire(blocking=False)
        fences = run.fences
        assert set(fences) == set(seen) and fences[name] == run.fence
        for key, fence in fences.items():
            seen[key].append(fence)
        run.release()
        assert run.fences == {}
        for limit in (first, third):
            plain = Lock(target, limit.name, ttl=10, auto_renew=False)
            assert plain.acquire(blocking=False)
            seen[limit.name].append(plain.fence or 0)
            plain.release()
    assert all(_increasing(values) and len(values) >= 3 for values in seen.values()), seen


def test_flow_a_resent_acquire_holds_the_lock_and_its_limits_once(target: Any, name: str) -> None:
    """An acquire with rules re-sent with the same token is granted again with the same
    fences (its own permit does not refuse it), holds one permit and spends one unit;
    one release gives everything back (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    limit, permit = _limit(f"{name}:limit", 1), _limit(f"{name}:permit", 1_000)
    rate = _rate(f"{name}:rate", 60_000_000, burst=3)
    backend, token = open_backend(target), "a" * 40
    slot = Slot(lock_keys(name, PREFIX), rules=(limit, permit, rate))
    first = backend.acquire(slot, token, 10_000, "{}", wait=False, fence_ttl_ms=0)
    again = backend.acquire(slot, token, 10_000, "{}", wait=False, fence_ttl_ms=0)
    assert first.acquired and again.acquired
    assert len(first.fences) == 3 and min(first.fences[:2]) > 0 and first.fences[2] == 0
    assert (again.fence, again.fences) == (first.fence, first.fences)
    assert [h.token for h in backend.holders(slot)] == [token]
    assert _permits(target, limit.name) == 1 and _permits(target, permit.name) == 1
    assert _free_units(target, rate.name) == 2
    other = Slot(lock_keys(f"{name}:other", PREFIX), rules=(limit,))
    refused = backend.acquire(other, "b" * 40, 10_000, "{}", wait=False, fence_ttl_ms=0)
    assert isinstance(refused, Refused) and (refused.by, refused.reason) == (limit.name, "limit")
    assert backend.release(slot, token, 10_000) is Status.OK
    assert not backend.locked(slot) and _permits(target, limit.name) == 0
    assert _permits(target, permit.name) == 0


def test_flow_a_take_over_of_a_queued_hold_obeys_controls_and_takes_the_rules(
    target: Any, name: str
) -> None:
    """The hand-over of an enqueue-time hold to its run goes through flow control: refused
    while the name is paused (the hold stays queued), then taken with the run's Limit
    (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    limit = _limit(f"{name}:limit", 1)
    hold = QueuedHold(target, name)
    assert hold.claim("t1", 60).outcome == "queued"
    assert _control(target, name, "pause", "deploy")
    run = RunLock(target, name, handover=Handover("t1"), auto_renew=False)
    run.hold_with([limit])
    assert run.acquire(blocking=False) is False and run.refusal == "paused"
    assert hold.claim("t2", 60).owner == "t1"  # still queued for t1
    assert _permits(target, limit.name) == 0
    assert _control(target, name, "pause", None)
    assert run.acquire(blocking=False)
    assert set(run.fences) == {name, limit.name} and _permits(target, limit.name) == 1
    assert hold.release("t1") is False  # the hold became the lock
    run.release()
    assert _permits(target, limit.name) == 0


def test_flow_a_take_over_without_rules_obeys_its_names_pause(target: Any, name: str) -> None:
    """A hand-over without rules (a run with no lock_limits: acquire.lua with its name's
    control hash and the queued hold) is refused while the name is paused, as hold_all.lua
    refuses it, the hold staying queued for its task; once the pause is lifted it takes
    the hold over (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    hold = QueuedHold(target, name)
    assert hold.claim("t1", 60).outcome == "queued"
    assert _control(target, name, "pause", "deploy", 60_000)
    run = RunLock(target, name, handover=Handover("t1"), auto_renew=False)
    run.hold_with([], controlled=True)
    assert run.acquire(blocking=False) is False
    assert (run.refused_by, run.refusal, run.holder) == (name, "paused", {"reason": "deploy"})
    assert run.holder_ttl_ms is not None and 50_000 < run.holder_ttl_ms <= 60_000
    assert hold.claim("t2", 60).owner == "t1"  # still queued for t1
    assert _control(target, name, "pause", None)
    assert run.acquire(blocking=False)
    assert hold.release("t1") is False  # the hold became the lock
    run.release()


def test_flow_controls_lists_what_is_in_force(target: Any, name: str) -> None:
    """controls(prefix, pattern) lists each control in force under the prefix whose name
    matches: kind, value, time left (None: until lifted); a lapsed or lifted one is gone
    (quorum: rules refused)."""
    if _without_flow(target, name):
        return
    backend = open_backend(target)
    assert _control(target, f"{name}:a", "pause", "why", 60_000)
    assert _control(target, f"{name}:b", "limit", "2")
    assert _control(target, f"{name}:c", "rate", "1000|3|1000/s")
    assert _control(target, f"{name}:d", "pause", "brief", 150)
    assert wait_for(
        lambda: all(c.name != f"{name}:d" for c in backend.controls(PREFIX, f"{name}:*")),
        timeout=3,
        what="the 150 ms pause to lapse",
    )
    found = backend.controls(PREFIX, f"{name}:*")
    assert [(c.name, c.kind, c.value) for c in found] == [
        (f"{name}:a", "pause", "why"),
        (f"{name}:b", "limit", "2"),
        (f"{name}:c", "rate", "1000|3|1000/s"),
    ]
    left = [c.ttl_ms for c in found]
    assert left[0] is not None and 55_000 < left[0] <= 60_000 and left[1:] == [None, None]
    assert [c.name for c in backend.controls(PREFIX, f"{name}:a")] == [f"{name}:a"]
    assert backend.controls(f"other-{uuid.uuid4().hex[:8]}:", "*") == []
    assert _control(target, f"{name}:b", "limit", None)
    assert _control(target, f"{name}:b", "limit", None) is False
    assert [c.name for c in backend.controls(PREFIX, f"{name}:*")] == [f"{name}:a", f"{name}:c"]


# -- the operator's listing (the board's index) --------------------------------------------
def list_keys(target: Any, prefix: str, **query: Any) -> list[Listing]:
    """``admin.list_keys`` on every store of *target* (each master's page)."""
    return [admin.list_keys(store, prefix, ListQuery(**query)) for store in _stores(target)]


def test_the_listing_follows_acquire_renewal_release_and_expiry(target: Any) -> None:
    """A lock, a semaphore's permit and (not on a quorum) a queued hold are listed with
    their counts from acquire on, a renewed lock stays listed past its first lease, a
    released one goes, and one that expires unreleased goes without anyone releasing it."""
    prefix = f"listing-{uuid.uuid4().hex[:8]}:"
    quorum = _quorum(target)
    kept = Lock(target, "kept", ttl=0.3, key_prefix=prefix)  # renewed every 0.1 s
    given = Lock(target, "given", ttl=30, key_prefix=prefix, auto_renew=False)
    brief = Lock(target, "brief", ttl=0.2, key_prefix=prefix, auto_renew=False)
    permit = None if quorum else Semaphore(target, "pool", 2, ttl=30, key_prefix=prefix)
    hold = None if quorum else QueuedHold(target, "next", key_prefix=prefix)
    try:
        assert kept.acquire(blocking=False) and given.acquire(blocking=False)
        start = time.monotonic()
        assert brief.acquire(blocking=False)
        assert permit is None or permit.acquire(blocking=False)
        assert hold is None or hold.claim("t-1", 60).outcome == "queued"
        for page in list_keys(target, prefix):
            assert page.counts["mutex"] == page.counts["mutex:held"] == 3
            assert page.counts["semaphore"] == page.counts["queued"] == (0 if quorum else 1)
            assert [e.name for e in page.entries] == sorted(
                ["kept", "given", "brief"] + ([] if quorum else ["pool", "next"]),
                key=lambda n: lock_keys(n, prefix).lock,
            )
        given.release()
        assert wait_for(
            lambda: all(
                {e.name for e in p.entries} == {"kept"} | (set() if quorum else {"pool", "next"})
                for p in list_keys(target, prefix)
            ),
            timeout=5,
            what="the released and the expired lock gone, the renewed one kept",
        )
        assert wait_for(
            lambda: (
                time.monotonic() - start > 0.9
                and all(p.total == (1 if quorum else 3) for p in list_keys(target, prefix))
            ),
            timeout=5,
            what="the renewed lock listed three of its first leases later",
        )
    finally:
        for lock in (kept, permit):
            if lock is not None:
                with contextlib.suppress(RedlockError):
                    lock.release()
        if hold is not None:
            hold.release("t-1")


def test_the_listing_filters_counts_and_pages_every_key(target: Any) -> None:
    """More than 500 names: the counts by kind and state, the kind and state filters and
    the pages cover every one, in key order both ways; a task id filter finds its run."""
    prefix = f"pages-{uuid.uuid4().hex[:8]}:"
    quorum = _quorum(target)
    for master in _stores(target):
        each = open_backend(master)
        for i in range(600):  # the way the scripts write them, without 600 round trips
            owner = {"task_name": "proj.sync", "task_id": f"t-{i}"} if i % 3 == 0 else {}
            slot = Slot(lock_keys(f"n:{i:04d}", prefix))
            record = json.dumps({"hostname": "h", "pid": 1, **owner})
            grant = each.acquire(slot, f"tok-{i}", 30_000, record, wait=False, fence_ttl_ms=0)
            assert grant.acquired
    if not quorum:
        assert Semaphore(target, "n:sem", 3, ttl=30, key_prefix=prefix).acquire(blocking=False)
    for page in list_keys(target, prefix, limit=50):
        assert page.counts["mutex"] == 600 and page.counts["mutex:running"] == 200
        assert page.counts["mutex:held"] == 400
        assert page.counts["semaphore"] == (0 if quorum else 1)
        assert page.total == (600 if quorum else 601) and len(page.entries) == 50
    running = list_keys(target, prefix, kind="mutex", state="running", offset=190, limit=50)
    for page in running:
        assert page.total == 200
        assert [e.name for e in page.entries] == [f"n:{i:04d}" for i in range(570, 600, 3)]
        assert all(i.state == "running" for i in page.locks)
    if not quorum:
        (only,) = list_keys(target, prefix, kind="semaphore")
        assert [e.name for e in only.entries] == ["n:sem"] and only.locks[0].kind == "permit"
    for page in list_keys(target, prefix, pattern="n:05*", sort="-name", limit=3):
        assert [e.name for e in page.entries] == ["n:0599", "n:0598", "n:0597"]
        assert page.total == 100
    for page in list_keys(target, prefix, task_id="t-300"):
        assert [e.name for e in page.entries] == ["n:0300"] and page.counts["mutex"] == 1


def test_one_permit_is_released_by_its_fence_and_the_others_stay(target: Any, name: str) -> None:
    """``admin.force_release_permit`` removes the permit with the fence given only (the
    board's release of one permit): the other stays, its place can be taken at once, and
    the same fence again is gone (quorum: permits above 1 are refused)."""
    if _quorum(target):
        with pytest.raises(ConfigError, match="Redlock"):
            Semaphore(target, name, 2)
        return
    first = Semaphore(target, name, 2, ttl=30, key_prefix=PREFIX, auto_renew=False)
    second = Semaphore(target, name, 2, ttl=30, key_prefix=PREFIX, auto_renew=False)
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    assert first.fence is not None
    done = admin.force_release_permit(target, PREFIX, name, first.fence, limit=2)
    assert done.outcome == "released" and done.fence == first.fence
    left = [i.fence for i in read_lock(target, PREFIX, name) if i.kind == "permit"]
    assert left == [second.fence]
    third = Semaphore(target, name, 2, ttl=30, key_prefix=PREFIX, auto_renew=False)
    assert third.acquire(blocking=False)
    assert admin.force_release_permit(target, PREFIX, name, first.fence).outcome == "gone"
    second.release()
    third.release()
