"""Sentinel failovers, planned (``SENTINEL FAILOVER``) and not (a SIGKILLed master), with
real sentinels: no key gets two holders that were not told, fences never repeat or go
back, and each process follows the new master from the sentinels' announcement on.

A master, a replica and three sentinels (``down-after-milliseconds`` 1000) from
``SentinelSetup``; locks through ``connect("sentinel://...")``, as a worker builds them.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import itertools
import json
import os
import re
import signal
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import kombu
import pytest
import redis
from celery import Celery
from redis.sentinel import Sentinel
from servers import RABBIT, RedisServer, SentinelSetup, rabbitmq_up, wait_for
from workers import Worker, idle_before_stop

from celery_redlock import Lock, Semaphore, StoreUnavailable, connect
from celery_redlock.core.backend_types import Rule
from celery_redlock.core.backends.redis import sentinel as sentinel_module
from celery_redlock.core.backends.redis.sentinel import CHANNELS, MasterWatch, watch_of
from celery_redlock.core.keys import lock_keys, permit_keys

APP = "tests.apps.failoverapp"


def sentinel_url(setup: SentinelSetup) -> str:
    """The URL a worker is given: every sentinel, and the master's name."""
    return ";".join(setup.sentinel_urls) + f"?master={setup.master_name}"


def watch(client: redis.Redis) -> MasterWatch:
    """The watch of a Sentinel client's pool in this process."""
    return watch_of(client.connection_pool)


def listeners() -> list[threading.Thread]:
    """This process's sentinel listener threads."""
    return [t for t in threading.enumerate() if t.name.startswith("celery-redlock-sentinel-")]


def address_of(server: RedisServer) -> tuple[str, int]:
    """(host, port) of a server."""
    return (server.host, server.port)


def role_of(server: RedisServer) -> str:
    """'master' or 'slave', as the server says; 'unknown' when it drops the connection,
    as a server does to its clients while its role changes (redis-py 5.0 does not retry)."""
    client = server.client(socket_timeout=1)
    try:
        role = client.execute_command("ROLE")[0]
    except redis.ConnectionError:
        return "unknown"
    finally:
        client.close()
    return role.decode() if isinstance(role, bytes) else str(role)


class Promotion:
    """A thread that polls a replica's ROLE every 5 ms and keeps when it became a master."""

    def __init__(self, server: RedisServer) -> None:
        self.at: float | None = None
        self._thread = threading.Thread(target=self._poll, args=(server,), daemon=True)
        self._thread.start()

    def _poll(self, server: RedisServer) -> None:
        client = server.client(socket_timeout=1)
        deadline = time.monotonic() + 30
        try:
            while self.at is None and time.monotonic() < deadline:
                with contextlib.suppress(redis.RedisError):
                    if client.execute_command("ROLE")[0] in (b"master", "master"):
                        self.at = time.time()
                time.sleep(0.005)
        finally:
            client.close()


def logged_at(line: str) -> float:
    """The wall-clock time of a worker log line ("[2026-01-01 10:00:00,123: ...")."""
    stamp = line[1 : line.index(":", 18)]
    seconds, millis = stamp.split(",")
    return time.mktime(time.strptime(seconds, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


class SentinelEvents:
    """Every event the sentinels publish, with the wall-clock time it arrived here."""

    def __init__(self, setup: SentinelSetup) -> None:
        self.seen: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._listen, args=(host, port), daemon=True)
            for host, port in setup.sentinels
        ]
        for thread in self._threads:
            thread.start()

    def _listen(self, host: str, port: int) -> None:
        client = redis.Redis(host, port, socket_timeout=2)
        pubsub = client.pubsub()
        try:
            pubsub.psubscribe("*")
            while not self._stop.is_set():
                with contextlib.suppress(redis.RedisError):
                    message = pubsub.get_message(timeout=0.2)
                    if message and message["type"] == "pmessage":
                        channel = message["channel"].decode()
                        if "hello" not in channel:
                            self.seen.append((time.time(), channel, message["data"].decode()))
        finally:
            pubsub.close()
            client.close()

    def first(self, channel: str, after: float = 0.0, containing: str = "") -> float | None:
        """When *channel* was first heard after *after* (None: not yet)."""
        for at, name, data in list(self.seen):
            if name == channel and at >= after and containing in data:
                return at
        return None

    def stop(self) -> None:
        """Stop listening."""
        self._stop.set()
        for thread in self._threads:
            thread.join(5)


# --------------------------------------------------------------------------- the watch


def test_a_pool_finalized_while_a_watch_is_being_made_does_not_deadlock() -> None:
    """The cyclic collector can finalize a dropped pool (its watch's ``_gone``) at any
    allocation, also in a thread that holds the watches' lock to make another pool's
    watch: the finalizer takes that lock again in the same thread, and returns. (Seen in
    make test-compat: a Lock.acquire on a Sentinel client hung until pytest-timeout.)"""
    dropped = Sentinel([("127.0.0.1", 1)]).master_for("gone")  # nothing is connected
    cycle: list[Any] = [dropped.connection_pool, watch_of(dropped.connection_pool)]
    cycle.append(cycle)  # the pool now lives until the cyclic collector runs
    del dropped, cycle
    ended = threading.Event()

    def collect_under_the_lock() -> None:
        with sentinel_module._watches_lock:  # where watch_of() makes a watch
            gc.collect()  # the pool's finalizer runs here
        ended.set()

    thread = threading.Thread(target=collect_under_the_lock, daemon=True)
    thread.start()
    assert ended.wait(10), "the pool's finalizer deadlocked on the watches' lock"
    live = Sentinel([("127.0.0.1", 1)]).master_for("live")
    assert watch_of(live.connection_pool) is watch_of(live.connection_pool)


def test_one_watch_per_pool_with_a_thread_per_sentinel_gone_with_the_client(
    sentinel_setup: SentinelSetup,
) -> None:
    """Locks on a Sentinel client start one listener per sentinel for the client's pool,
    however many locks and threads use it; a dropped client takes its listeners and their
    sentinel connections with it; a forked child starts its own and its parent's go on."""
    setup = sentinel_setup
    before = len(listeners())
    admin = [redis.Redis(h, p) for h, p in setup.sentinels]

    def subscribers() -> int:
        return sum(
            sum(1 for c in s.client_list() if int(c.get("psub", 0)) == len(CHANNELS)) for s in admin
        )

    idle = subscribers()
    client = connect(sentinel_url(setup))
    for i in range(50):  # locks made and dropped in a loop, from several threads
        lock = Lock(client, f"flat:{i % 5}", ttl=5, auto_renew=False)
        assert lock.acquire(blocking=False)
        lock.release()

    def use(shared: redis.Redis, n: int) -> None:
        with Lock(shared, f"t:{n}", ttl=5):
            pass

    workers = [threading.Thread(target=use, args=(client, n)) for n in range(8)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(10)
    assert len(listeners()) - before == 3
    assert wait_for(lambda: subscribers() - idle == 3, 5, "one subscription per sentinel")
    assert watch(client).view == (address_of(setup.master), 0)

    pid = os.fork()
    if pid == 0:  # the child: its own watch once it locks, the parent's threads are not here
        code = 1
        try:
            inherited = len(listeners())
            Lock(client, "child", ttl=5, auto_renew=False).acquire()
            code = 0 if (inherited, len(listeners())) == (0, 3) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(listeners()) - before == 3

    del client, lock, workers
    gc.collect()
    assert wait_for(lambda: len(listeners()) == before, 5, "the listeners to stop")
    assert wait_for(lambda: subscribers() == idle, 5, "their subscriptions to close")
    for s in admin:
        s.close()


def test_a_replaced_master_refuses_callers_that_have_not_heard(
    sentinel_setup: SentinelSetup,
) -> None:
    """A master marked as replaced by a later config-epoch (as every process that hears
    the switch marks the old one) refuses a caller that still thinks it is the master:
    the call is reported unavailable, nothing is written, and the next call asks the
    sentinels again."""
    setup = sentinel_setup
    client = connect(sentinel_url(setup))
    lock = Lock(client, "marked", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()
    setup.master.client().set("redlock:replaced-master-epoch", 7)
    with pytest.raises(StoreUnavailable, match="replaced as the master"):
        lock.acquire(blocking=False)
    assert not setup.master.client().exists(lock_keys("marked").lock)
    setup.master.client().delete("redlock:replaced-master-epoch")
    assert lock.acquire(blocking=False)
    lock.release()


@pytest.mark.skipif(
    "force_master_ip" not in inspect.signature(Sentinel.__init__).parameters,
    reason="this redis-py has no force_master_ip",
)
def test_a_sentinel_client_that_forces_the_master_ip_locks_there(
    sentinel_setup: SentinelSetup,
) -> None:
    """A Sentinel client whose connections go to a forced IP ("localhost" here, as for a
    master behind NAT) locks and unlocks: the watch names the master as its connections
    reach it, not as the sentinels spell it."""
    setup = sentinel_setup
    sentinel = Sentinel(setup.sentinels, force_master_ip="localhost", socket_timeout=2)
    client = sentinel.master_for(setup.master_name, socket_timeout=2)
    lock = Lock(client, "forced", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    assert setup.master.client().exists(lock.keys.lock)
    assert watch(client).view == (("localhost", setup.master.port), 0)
    lock.release()


@pytest.mark.slow
def test_no_lock_is_granted_on_the_old_master_once_its_replica_is_being_promoted(
    sentinel_setup: SentinelSetup,
) -> None:
    """SENTINEL FAILOVER under a tight loop of acquires on new names: every lock the old
    master granted is on the promoted replica (from the leader's order to promote it
    until the switch, calls are refused, not granted by a master whose writes the
    replica no longer receives), and once the sentinels name the new master, calls are
    granted there again."""
    setup = sentinel_setup
    client = connect(sentinel_url(setup))
    new_master = address_of(setup.replica)
    granted: list[tuple[str, int]] = []
    refused = 0
    assert Lock(client, "warm", ttl=1, auto_renew=False).acquire(blocking=False)
    setup.sentinel().sentinels[0].execute_command("SENTINEL", "FAILOVER", setup.master_name)
    deadline = time.monotonic() + 15
    for i in itertools.count():
        if watch(client).view == (new_master, 1) or time.monotonic() > deadline:
            break
        lock = Lock(client, f"p:{i}", ttl=30, auto_renew=False)
        try:
            if lock.acquire(blocking=False):
                granted.append((lock.keys.lock, lock.fence or 0))
        except StoreUnavailable:
            refused += 1
            time.sleep(0.002)
    assert watch(client).view == (new_master, 1)
    # Grants on new names through the whole failover (99 and 31 seen on a loaded machine).
    assert refused > 0 and len(granted) >= 20, (refused, len(granted))
    print(f"\n{len(granted)} locks granted, {refused} calls refused during the failover")
    replica = setup.replica.client()
    missing = [key for key, _ in granted if not replica.exists(key)]
    assert not missing, f"{len(missing)} of {len(granted)} locks granted by the old master"
    after = Lock(client, "after", ttl=5, auto_renew=False)
    assert after.acquire(blocking=False)
    assert replica.exists(after.keys.lock)
    after.release()


@pytest.mark.slow
def test_fences_from_the_new_master_top_every_fence_of_the_old_one(
    sentinel_setup: SentinelSetup,
) -> None:
    """SENTINEL FAILOVER while a process that has not heard of it (a plain client of the
    old master) keeps taking the lock there, after the promotion: once the sentinels name
    the new master, a new client's first fence there is above all of the old master's,
    the client made before the failover locks there too, and fences go on rising."""
    setup = sentinel_setup
    client = connect(sentinel_url(setup))
    lock = Lock(client, "fenced", ttl=5, auto_renew=False)
    fences = []
    for _ in range(3):
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
    stale = Lock(setup.master.client(), "fenced", ttl=0.05, auto_renew=False)
    setup.sentinel().sentinels[0].execute_command("SENTINEL", "FAILOVER", setup.master_name)
    wait_for(lambda: role_of(setup.replica) == "master", 10, "the promotion")
    old_fences: list[int | None] = []
    for _ in range(200):  # counted up on the old master after the promotion
        try:
            assert stale.acquire(blocking=False)
            old_fences.append(stale.fence)
            stale.release()
        except (StoreUnavailable, redis.exceptions.ReadOnlyError):
            # The sentinels make the old master a replica and kill its clients (a client
            # without redis-py's default retry sees the reset): its counting ends there.
            break
    assert len(old_fences) >= 10, old_fences
    assert old_fences[-1] is not None and fences[-1] is not None
    assert old_fences[-1] > fences[-1]
    new_master = address_of(setup.replica)
    wait_for(lambda: setup.master_addresses() == [new_master] * 3, 15, "the switch")
    fresh = Lock(connect(sentinel_url(setup)), "fenced", ttl=5, auto_renew=False)
    assert fresh.acquire(blocking=False)  # a client made now: on the new master anyway
    first = fresh.fence
    fresh.release()
    assert first is not None and first > old_fences[-1], (fences, old_fences[-3:], first)
    new_fences = []
    for _ in range(3):
        assert lock.acquire(blocking=False)
        assert setup.replica.client().exists(lock.keys.lock), "locked on the new master"
        new_fences.append(lock.fence)
        lock.release()
    assert new_fences[0] > first
    # A semaphore's permit and a run's Limit rule get the new master's floor too.
    floor = 10**12 + int(time.time() * 1e6) - 10**6  # epoch 1, the clock a second ago
    permit = Semaphore(client, "fenced:permits", 3, ttl=5, auto_renew=False)
    assert permit.acquire(blocking=False)
    ruled = Lock(client, "fenced:run", ttl=5, auto_renew=False)
    ruled.hold_with([Rule(permit_keys("fenced:limit"), limit=2)])
    assert ruled.acquire(blocking=False)
    assert permit.fence is not None and permit.fence > floor
    assert ruled.fences["fenced:limit"] > floor and ruled.fence is not None
    assert ruled.fence > floor
    permit.release()
    ruled.release()
    # The client marked the old master as replaced before it locked on the new one.
    assert setup.master.client().get("redlock:replaced-master-epoch") == b"1"
    assert new_fences == sorted(set(new_fences))


@pytest.mark.slow
def test_a_lock_missing_on_the_new_master_is_reported_lost_at_the_switch(
    sentinel_setup: SentinelSetup, caplog: pytest.LogCaptureFixture
) -> None:
    """A held lock (30 s lease: renewed every 10 s) that the promoted replica lacks, as
    one written too late to be replicated: when the sentinels announce the switch, its
    holder is told at once (on_lost, within a second), and a WARNING names it with the
    old and new master; a lock the new master has is kept."""
    setup = sentinel_setup
    client = connect(sentinel_url(setup))
    lost: list[float] = []
    missing = Lock(client, "missing", ttl=30, on_lost=lambda _lock: lost.append(time.time()))
    kept = Lock(client, "kept", ttl=30)
    assert missing.acquire(blocking=False) and kept.acquire(blocking=False)
    replica = setup.replica.client()
    wait_for(lambda: replica.exists(missing.keys.lock) and replica.exists(kept.keys.lock), 5)
    replica.config_set("replica-read-only", "no")  # a write the replica keeps to itself
    replica.delete(missing.keys.lock)
    events = SentinelEvents(setup)
    try:
        caplog.set_level("INFO", "celery_redlock.failover")
        setup.sentinel().sentinels[0].execute_command("SENTINEL", "FAILOVER", setup.master_name)
        wait_for(lambda: lost, 15, "the loss to be reported")
        switched = events.first("+switch-master")
    finally:
        events.stop()
    assert switched is not None and lost[0] - switched < 1.0, (switched, lost)
    print(f"\nthe loss was reported {lost[0] - switched:.3f} s after +switch-master")
    assert missing.lost and not kept.lost and kept.owned()
    warning = next(r for r in caplog.records if r.levelname == "WARNING")
    text = warning.getMessage()
    assert "'missing'" in text and "'kept'" in text
    assert f"{setup.master.port}" in text and f"{setup.replica.port}" in text
    kept.release()


# --------------------------------------------------------------------------- two workers

KEYS = 3  # keys the stream calls
# A run holds its key 1 s: still longer than a planned switch (0.4 s after the command) and
# shorter than the lease, so the run under way at the switch holds a lock there; each
# phase's 6 runs (2 a key, so each key's fences are compared within and across phases)
# take 2 s rather than the 4 s of 2 s holds.
BODY = 1.0  # seconds a run holds its key
TTL = 3.0  # its lease (renewed every second)
EVERY = 0.25  # seconds between two calls on one key


class Stream:
    """A thread that calls ``hold(k, BODY)`` for each key every EVERY seconds."""

    def __init__(self, app: Celery, queue: str) -> None:
        self.app, self.queue = app, queue
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(EVERY):
            for key in range(KEYS):
                self.app.send_task(f"{APP}.hold", args=(key, BODY), queue=self.queue)
                self.sent += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _overlaps(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every pair of runs of one key whose holds overlap (runs sorted by start)."""
    pairs = []
    for i, first in enumerate(runs):
        for later in runs[i + 1 :]:
            if later["start"] >= first["end"]:
                break
            pairs.append((first, later))
    return pairs


def _wait_for_runs(record: redis.Redis, since: float, what: str) -> None:
    """Wait until 6 runs that started at *since* or later have recorded themselves."""

    def started() -> int:
        return sum(json.loads(r)["start"] >= since for r in record.lrange("runs", 0, -1))

    wait_for(lambda: started() >= 6, 30, what, interval=0.1)


@pytest.mark.slow
def test_failover_planned_and_not_under_a_stream_of_runs_on_two_workers(
    sentinel_setup: SentinelSetup, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two prefork workers (3 children each) run a stream of locked runs on 3 keys while
    the sentinels fail over on command, then again after the new master is SIGKILLed.
    From the runs' own records: no two runs of a key overlap unless one of them was told
    (LockLost in its body), each key's fences rise in the order its runs started, and a
    worker logs a WARNING naming the locks it held when the master changed."""
    setup = sentinel_setup
    events = SentinelEvents(setup)
    queue = f"failover-{uuid.uuid4().hex[:8]}"
    broker = RABBIT if rabbitmq_up() else f"redis://127.0.0.1:{redis_server.port}/0"
    record = redis_server.client(db=3)
    env = {
        "REDLOCK_TEST_BROKER": broker,
        "REDLOCK_TEST_LOCKS": sentinel_url(setup),
        "REDLOCK_TEST_RECORD": f"redis://127.0.0.1:{redis_server.port}/3",
        "REDLOCK_TEST_TTL": str(TTL),
    }
    workers = [
        Worker(APP, env, tmp_path / f"w{i}.log", concurrency=3, extra=("-Q", queue))
        for i in range(2)
    ]
    app = Celery("client", broker=broker)
    stream = Stream(app, queue)
    timeline: dict[str, float] = {}
    try:
        for w in workers:
            w.wait_ready()
        # Each sentinel polls INFO every second instead of every 10 s, and says hello every
        # 0.5 s instead of 2 s: a sentinel converts an old master that still says it is one
        # after 4 hello periods, so about 2 s after the switch instead of 8 to 10 (the
        # clients follow the switch itself; that wait bought nothing but time).
        for sentinel in setup.sentinel().sentinels:
            sentinel.execute_command(
                "SENTINEL", "DEBUG", "INFO-PERIOD", 1000, "PUBLISH-PERIOD", 500
            )
        stream.start()
        wait_for(lambda: record.llen("runs") >= 6, 30, "runs before the failover")
        # The failover starts just after a run took its key: that run still holds it when
        # the master switches (about 0.4 s on, the run holds BODY, 1 s), so a worker has a lock to
        # warn about. Seen free first: the run just recorded may not have released it yet.
        lock = lock_keys(f"key:{json.loads(record.lindex('runs', -1))['key']}").lock
        master = setup.master.client()
        wait_for(lambda: not master.exists(lock), 10, "the key's release", interval=0.002)
        wait_for(lambda: master.exists(lock), 10, "the key's next run", interval=0.002)

        # A planned failover: the old master stays a writable master until converted.
        old, new = setup.master, setup.replica
        promotion = Promotion(new)
        timeline["failover"] = time.time()
        setup.sentinel().sentinels[0].execute_command("SENTINEL", "FAILOVER", setup.master_name)
        wait_for(lambda: role_of(old) == "slave", 30, "the old master's conversion", interval=0.05)
        timeline["converted"] = time.time()
        timeline["promoted"] = promotion.at or float("nan")
        _wait_for_runs(record, since=timeline["failover"], what="runs after the planned failover")

        # An unplanned one: the new master is SIGKILLed, the old one promoted back.
        timeline["kill"] = time.time()
        new.kill()
        wait_for(lambda: role_of(old) == "master", 30, "the second failover", interval=0.05)
        timeline["promoted back"] = time.time()
        _wait_for_runs(record, since=timeline["kill"], what="runs after the kill")
        stream.stop()
        # No task left for a pool child to start, or a warm shutdown may wait 30 s for
        # Celery's pool (see idle_before_stop); the runs under way go on.
        idle_before_stop(app, workers, queue)
        for w in workers:  # warm shutdowns, side by side: the last runs end and record
            w.proc.send_signal(signal.SIGTERM)
        for w in workers:
            w.proc.wait(BODY + 20)
    finally:
        stream.stop()
        events.stop()
        for w in workers:
            w.stop()
        app.close()
        if broker == RABBIT:
            with kombu.Connection(RABBIT) as conn:
                conn.default_channel.queue_delete(queue)

    runs = [json.loads(r) for r in record.lrange("runs", 0, -1)]
    by_key: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_key[run["key"]].append(run)
    for key_runs in by_key.values():
        key_runs.sort(key=lambda r: r["start"])
    logs = "".join(w.text() for w in workers)
    _report(timeline, events, by_key, logs)

    phases = [
        ("before", 0, timeline["failover"]),
        ("planned", timeline["failover"], timeline["kill"]),
        ("killed", timeline["kill"], float("inf")),
    ]
    for phase, since, until in phases:
        assert sum(since <= r["start"] < until for r in runs) >= 6, phase
    untold = [
        (a, b)
        for key_runs in by_key.values()
        for a, b in _overlaps(key_runs)
        if a["told"] is None and b["told"] is None
    ]
    assert not untold, untold
    for key, key_runs in by_key.items():
        fences = [r["fence"] for r in key_runs]
        backwards = [(a, b) for a, b in itertools.pairwise(key_runs) if b["fence"] <= a["fence"]]
        assert not backwards, (key, fences)
    moves = _heard_of_moves(logs)
    assert moves, "no worker logged that the master moved"
    # Each process warns about the locks it holds when it hears of a move. The stream is
    # timed so that a run holds its key across the first move; on a loaded machine a move
    # can come after that run ended. A WARNING is owed for each move that a run held its
    # key across: from before the first process heard of it until after the last one did.
    owed = 0
    for move, (heard, warned) in moves.items():
        if any(r["start"] < heard[0] and r["end"] > heard[-1] for r in runs):
            owed += 1
            assert warned, f"no WARNING when the master moved under a held lock ({move})"
    print(f"{len(moves)} moves heard, {owed} with a run holding its key across")


#: A worker's log line: its local time to the millisecond, then the move it tells of.
_MOVE_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): (\w+)/.*Sentinel master .* moved "
    r"from .* to (\S+ \(config-epoch \d+\))"
)


def _heard_of_moves(logs: str) -> dict[str, tuple[list[float], bool]]:
    """Each move of the Sentinel master the workers logged (by the new master and its
    config-epoch): when each process logged it (the epoch, sorted) and whether one of
    them did so at WARNING."""
    moves: dict[str, tuple[list[float], bool]] = {}
    for line in logs.splitlines():
        found = _MOVE_LINE.match(line)
        if found:
            stamp, millis, level, move = found.groups()
            at = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
            heard, warned = moves.get(move, ([], False))
            moves[move] = (sorted([*heard, at]), warned or level == "WARNING")
    return moves


def _report(
    timeline: dict[str, float],
    events: SentinelEvents,
    by_key: dict[int, list[dict[str, Any]]],
    logs: str,
) -> None:
    """Print what the run measured (shown with ``pytest -s``)."""
    t0 = timeline["failover"]
    kill = timeline["kill"]
    marks = {
        "send-slaveof-noone": events.first("+failover-state-send-slaveof-noone", t0),
        "promoted": events.first("+promoted-slave", t0),
        "switch": events.first("+switch-master", t0),
        "convert-to-slave": events.first("+convert-to-slave", t0),
        "kill: sdown": events.first("+sdown", kill, "master"),
        "kill: switch": events.first("+switch-master", kill),
    }
    print("\nplanned failover at 0.000 s; killed the new master at %.3f s" % (kill - t0))
    for name, at in marks.items():
        print(f"  {name:20s} {'-' if at is None else f'{at - t0:7.3f} s'}")
    print(f"  replica promoted     {timeline['promoted'] - t0:7.3f} s (ROLE polled)")
    print(f"  old master converted {timeline['converted'] - t0:7.3f} s (ROLE polled)")
    for phase, since, until in (("planned", t0, kill), ("killed", kill, float("inf"))):
        stamped = [line for line in logs.splitlines() if line[:3] == "[20"]
        lines = [line for line in stamped if since <= logged_at(line) < until]
        held_back = [logged_at(line) - t0 for line in lines if "is under way: lock" in line]
        followed = [logged_at(line) - t0 for line in lines if "moved from" in line]
        print(
            f"  {phase}: {len(held_back)} processes held calls back at "
            f"{min(held_back, default=0):.3f}-{max(held_back, default=0):.3f} s, "
            f"{len(followed)} followed the new master at "
            f"{min(followed, default=0):.3f}-{max(followed, default=0):.3f} s"
        )
    for key, runs in sorted(by_key.items()):
        told = [r for r in runs if r["told"] is not None]
        pairs = _overlaps(runs)
        print(
            f"key {key}: {len(runs)} runs, {len(told)} told of a loss, {len(pairs)} overlaps "
            + ", ".join(f"{min(a['end'], b['end']) - b['start']:.3f} s" for a, b in pairs)
        )
        around = [r for r in runs if t0 - 2 <= r["start"] <= t0 + 14 or kill - 2 <= r["start"]]
        print(
            "  fences (start s: fence): "
            + ", ".join(f"{r['start'] - t0:.2f}: {r['fence']}" for r in around)
        )
    warnings = [line for line in logs.splitlines() if "while this process held" in line]
    print(f"{len(warnings)} WARNING lines, first: {warnings[0] if warnings else None}")
