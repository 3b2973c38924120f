"""``LockRecords`` (core/records.py): records only the lock's holder may write, on one Redis
and over Redlock masters, against real servers."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from servers import RedisServer, wait_for

from celery_redlock.core.connect import connect
from celery_redlock.core.errors import StoreUnavailable
from celery_redlock.core.lock import Lock, Redlock
from celery_redlock.core.records import LockRecords, record_version

KEY = "redlock:{beat:leader:t}"
RECORDS = f"{KEY}:ticks"


@pytest.fixture
def masters(redis_servers: Callable[[int], list[RedisServer]]) -> list[RedisServer]:
    """Three independent masters."""
    return redis_servers(3)


@pytest.fixture
def held() -> Iterator[list[Lock | Redlock]]:
    """Locks a test acquired; released (quietly) afterwards."""
    locks: list[Lock | Redlock] = []
    yield locks
    for lock in locks:
        if lock.fence is not None:
            with contextlib.suppress(Exception):  # some are lost on purpose
                lock.release()


def redlock(servers: list[RedisServer], held: list[Lock | Redlock], ttl: float = 10) -> Redlock:
    """A Redlock on *servers*, acquired on every one of them: the majority decides, and the
    last master's grant may land after acquire() returned (a test that then deletes the
    key on two masters must not see it come back)."""
    lock = Redlock(connect([s.url for s in servers]), "beat:leader:t", ttl, auto_renew=False)
    assert lock.acquire(blocking=False)
    held.append(lock)
    admins = [s.client() for s in servers]
    assert wait_for(lambda: all(a.exists(KEY) for a in admins), 3, "every master's grant")
    return lock


def stored(client: redis.Redis, field: str = "heartbeat") -> dict[str, object] | None:
    raw = client.hget(RECORDS, field)
    return None if raw is None else json.loads(raw)


def test_single_redis_claim_writes_the_version_and_a_new_holder_refuses_the_old_one(
    redis_client: redis.Redis,
) -> None:
    """On one Redis a claim stores the record with (fence, n); once another acquisition holds
    the lock, the old holder's claim is "lost" and writes nothing."""
    a = Lock(redis_client, "beat:leader:t", 10, auto_renew=False)
    assert a.acquire(blocking=False)
    records = LockRecords(a, "ticks")
    assert records.key == RECORDS
    claim = records.claim("heartbeat", {"at": 1.5}, n=1)
    assert claim.outcome == "claimed"
    assert stored(redis_client) == {"at": 1.5, "fence": a.fence, "n": 1}

    redis_client.delete(KEY)  # A's lease "expired" in Redis; B takes the lock
    b = Lock(redis_client, "beat:leader:t", 10, auto_renew=False)
    assert b.acquire(blocking=False)
    try:
        late = records.claim("heartbeat", {"at": 2.5}, n=2)
        assert late.outcome == "lost"
        assert stored(redis_client) == {"at": 1.5, "fence": a.fence, "n": 1}
        assert LockRecords(b, "ticks").load() == {"heartbeat": claim.record}
    finally:
        b.release()


def test_a_re_sent_claim_succeeds_and_an_older_one_of_the_same_holder_is_stale(
    redis_client: redis.Redis,
) -> None:
    """The same claim twice is "claimed" both times (a retried call); a claim with a lower n
    under the same fence (a late copy) is "stale", returns the stored record, writes nothing."""
    lock = Lock(redis_client, "beat:leader:t", 10, auto_renew=False)
    assert lock.acquire(blocking=False)
    try:
        records = LockRecords(lock, "ticks")
        first = records.claim("heartbeat", {"at": 3.0}, n=3)
        again = records.claim("heartbeat", {"at": 3.0}, n=3)
        assert (first.outcome, again.outcome) == ("claimed", "claimed")
        old = records.claim("heartbeat", {"at": 2.0}, n=2)
        assert old.outcome == "stale"
        assert old.record == first.record
        assert stored(redis_client) == {"at": 3.0, "fence": lock.fence, "n": 3}
    finally:
        lock.release()


def test_claim_after_the_local_deadline_is_lost_without_writing(
    redis_client: redis.Redis,
) -> None:
    """Past the lease's local deadline a claim is "lost" and nothing is written."""
    lock = Lock(redis_client, "beat:leader:t", 0.2, auto_renew=False)
    assert lock.acquire(blocking=False)
    time.sleep(0.3)
    assert LockRecords(lock, "ticks").claim("heartbeat", {"at": 1.0}, n=1).outcome == "lost"
    assert stored(redis_client) is None


def test_redlock_claim_needs_a_majority_and_a_minority_down_is_fine(
    masters: list[RedisServer], held: list[Lock | Redlock]
) -> None:
    """Over 3 masters a claim succeeds with one master down (written on the other two) and is
    "unavailable" with two down; it never raises."""
    lock = redlock(masters, held)
    records = LockRecords(lock, "ticks")
    clients = [m.client() for m in masters]
    masters[2].kill()
    claim = records.claim("heartbeat", {"at": 1.0}, n=1)
    assert claim.outcome == "claimed", claim
    assert [stored(c) for c in clients[:2]] == [{"at": 1.0, "fence": lock.fence, "n": 1}] * 2
    masters[1].kill()
    down = records.claim("heartbeat", {"at": 2.0}, n=2)
    assert down.outcome == "unavailable"
    assert f"127.0.0.1:{masters[1].port}" in down.detail
    assert stored(clients[0]) == {"at": 2.0, "fence": lock.fence, "n": 2}  # a minority only


def test_redlock_deposed_holder_is_refused_on_the_new_majority(
    masters: list[RedisServer], held: list[Lock | Redlock]
) -> None:
    """When B holds two of three masters, A's claim is refused there ("lost"); the write A
    still manages on its last master does not survive B's load, which takes the newest
    record by fence."""
    a = redlock(masters, held)
    a_records = LockRecords(a, "ticks")
    assert a_records.claim("heartbeat", {"at": 1.0}, n=1).outcome == "claimed"
    clients = [m.client() for m in masters]
    for client in clients[:2]:  # A's keys expired on m0, m1 (m2 lags behind)
        client.delete(KEY)
    b = Redlock(connect([m.url for m in masters]), "beat:leader:t", 10, auto_renew=False)
    assert b.acquire(blocking=False)
    held.append(b)
    assert b.fence is not None and a.fence is not None and b.fence > a.fence
    b_records = LockRecords(b, "ticks")
    assert b_records.claim("heartbeat", {"at": 2.0}, n=2).outcome == "claimed"

    late = a_records.claim("heartbeat", {"at": 5.0}, n=9)
    assert late.outcome == "lost"
    assert stored(clients[2]) == {"at": 5.0, "fence": a.fence, "n": 9}  # A's minority write
    newest = json.loads(b_records.load()["heartbeat"])
    assert newest == {"at": 2.0, "fence": b.fence, "n": 2}


def test_redlock_load_takes_the_newest_record_per_field_and_needs_a_majority(
    masters: list[RedisServer], held: list[Lock | Redlock]
) -> None:
    """load() returns per field the record with the highest (fence, n) over the masters that
    answer (unreadable ones rank lowest), and raises StoreUnavailable below a majority."""
    lock = redlock(masters, held)
    clients = [m.client() for m in masters]
    rows = [
        {"x": '{"fence":4,"n":9}', "y": "not json"},
        {"x": '{"fence":5,"n":1}', "y": '{"fence":1,"n":1}'},
        {"x": '{"fence":5,"n":0}', "z": '{"fence":2,"n":2}'},
    ]
    for client, row in zip(clients, rows, strict=True):
        client.hset(RECORDS, mapping=row)
    records = LockRecords(lock, "ticks")
    assert records.load() == {"x": '{"fence":5,"n":1}', "y": '{"fence":1,"n":1}', "z": rows[2]["z"]}
    assert record_version("not json") == (-1, -1)
    masters[0].kill()
    masters[1].kill()
    with pytest.raises(StoreUnavailable):
        records.load()


def test_redlock_claims_do_not_wait_on_a_stalled_master(
    masters: list[RedisServer], held: list[Lock | Redlock]
) -> None:
    """With one master paused (SIGSTOP), claims return as soon as the other two wrote, well
    before the client's socket timeout, and a master still busy with an earlier call is not
    sent another."""
    lock = redlock(masters, held)
    records = LockRecords(lock, "ticks")
    masters[2].pause()
    try:
        for n in range(1, 4):
            started = time.monotonic()
            claim = records.claim("heartbeat", {"at": float(n)}, n=n)
            assert claim.outcome == "claimed", claim
            assert time.monotonic() - started < 1.0, "a claim waited for the stalled master"
        stalled = lock.backend.in_flight(2)
        # One call runs there, the claims after it wait behind it (dropped unrun); the
        # acquire's answer, sent directly before the pause, may be outstanding too.
        assert 0 < stalled <= 4, "the paused master was sent more calls"
    finally:
        masters[2].resume()
    assert stored(masters[0].client()) == {"at": 3.0, "fence": lock.fence, "n": 3}
