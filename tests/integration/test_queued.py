"""The enqueue-time hold (core.queued.QueuedHold) and its hand-over to the lock
(RunLock(handover=...)), against a real redis-server."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable

import pytest
import redis
from servers import RedisServer

from celery_redlock import AlreadyQueued, ConfigError, LockEvent, QueuedHold, add_hook
from celery_redlock.core import Handover, RunLock, remove_hook
from celery_redlock.core.admin import force_dequeue, read_lock, scan_locks


def test_a_second_claim_is_a_duplicate_of_the_first(redis_client: redis.Redis) -> None:
    """The first claim holds the name for its task id; another id gets that id back, with
    the hold's record and lease; the same id renews its own hold."""
    hold = QueuedHold(redis_client, "sync:42", owner_info={"task_name": "t.sync"})
    assert hold.claim("a", ttl=60).outcome == "queued"
    dup = hold.claim("b", ttl=60)
    assert (dup.outcome, dup.owner, dup.state) == ("duplicate", "a", "queued")
    assert dup.holder["task_name"] == "t.sync" and dup.holder["task_id"] == "a"
    assert dup.ttl_ms is not None and 55_000 < dup.ttl_ms <= 60_000
    assert hold.claim("a", ttl=120).outcome == "queued"  # a retry of a: renewed
    assert redis_client.pttl("redlock:{sync:42}:queued") > 110_000


def test_replace_takes_the_hold_and_names_the_one_replaced(redis_client: redis.Redis) -> None:
    """replace=True: the newest call holds the name; the reply names the task it replaced."""
    hold = QueuedHold(redis_client, "k")
    hold.claim("a", ttl=60)
    found = hold.claim("b", ttl=60, replace=True)
    assert (found.outcome, found.owner) == ("replaced", "a")
    assert redis_client.hget("redlock:{k}:queued", "owner") == b"b"


def test_a_running_holder_blocks_only_when_asked(redis_client: redis.Redis) -> None:
    """running_blocks=True: while another task id's run holds the lock, a claim is a
    duplicate of that run; False: it is queued behind it; the running id itself (a
    retry) is queued either way."""
    lock = RunLock(redis_client, "k", ttl=30, handover=Handover("run-1"), auto_renew=False)
    assert lock.acquire(blocking=False)
    hold = QueuedHold(redis_client, "k")
    dup = hold.claim("b", ttl=60, running_blocks=True)
    assert (dup.outcome, dup.owner, dup.state) == ("duplicate", "run-1", "running")
    assert hold.claim("run-1", ttl=60, running_blocks=True).outcome == "queued"
    assert hold.release("run-1")
    assert hold.claim("b", ttl=60).outcome == "queued"
    lock.release()


def test_release_is_owner_checked(redis_client: redis.Redis) -> None:
    """Only the task id that holds the name can give it back."""
    hold = QueuedHold(redis_client, "k")
    hold.claim("a", ttl=60)
    assert not hold.release("b")
    assert redis_client.exists("redlock:{k}:queued")
    assert hold.release("a")
    assert not hold.release("a")


def test_hand_over_turns_the_hold_into_the_lock(redis_client: redis.Redis) -> None:
    """Acquiring with the hold's owner deletes the hold and records the owner on the lock;
    a hand-over by a superseded id is refused and changes nothing."""
    hold = QueuedHold(redis_client, "k")
    hold.claim("a", ttl=60)
    stale = RunLock(redis_client, "k", handover=Handover("old"), auto_renew=False)
    assert not stale.acquire(blocking=True, timeout=5)  # refused at once, no waiting
    assert stale.superseded and stale.queued_owner == "a"
    assert stale.holder["task_id"] == "a"
    assert not redis_client.exists("redlock:{k}")
    lock = RunLock(redis_client, "k", handover=Handover("a"), auto_renew=False)
    assert lock.acquire(blocking=False)
    assert not redis_client.exists("redlock:{k}:queued")
    assert redis_client.hget("redlock:{k}", "owner") == b"a"
    lock.release()


def test_lenient_hand_over_keeps_a_retry_in_place(redis_client: redis.Redis) -> None:
    """strict=False (a retry of a task that already ran): the lock is taken although a
    newer call holds the queued slot, and that call's hold is left alone."""
    hold = QueuedHold(redis_client, "k")
    hold.claim("b", ttl=60)
    lock = RunLock(redis_client, "k", handover=Handover("a", strict=False), auto_renew=False)
    assert lock.acquire(blocking=False)
    assert redis_client.hget("redlock:{k}:queued", "owner") == b"b"
    lock.release()


def test_contended_hand_over_keeps_the_hold_and_reports_its_owner(
    redis_client: redis.Redis,
) -> None:
    """The lock held by another run: the hand-over is refused as contention, the hold stays
    with its owner (its place in line), and the reply says whose it is."""
    runner = RunLock(redis_client, "k", owner_info={"task_id": "r"}, auto_renew=False)
    assert runner.acquire()
    QueuedHold(redis_client, "k").claim("a", ttl=60)
    lock = RunLock(redis_client, "k", handover=Handover("a"), auto_renew=False)
    assert not lock.acquire(blocking=False)
    assert not lock.superseded and lock.queued_owner == "a"
    assert lock.holder["task_id"] == "r"
    assert redis_client.hget("redlock:{k}:queued", "owner") == b"a"
    runner.release()
    assert lock.acquire(blocking=False)
    assert not redis_client.exists("redlock:{k}:queued")
    lock.release()


def test_no_duplicate_slips_in_during_the_hand_over(redis_client: redis.Redis) -> None:
    """Claims racing a hand-over (running_blocks=True, as "enqueue+run"): every claim is
    either a duplicate of the queued hold or of the run, never a second hold."""
    hold = QueuedHold(redis_client, "race")
    hold.claim("first", ttl=60)
    outcomes: list[str] = []
    start = threading.Event()

    def claims() -> None:
        start.wait(5)
        for i in range(200):
            found = hold.claim(f"other-{i}", ttl=60, running_blocks=True)
            outcomes.append(f"{found.outcome}:{found.owner}")

    thread = threading.Thread(target=claims)
    thread.start()
    start.set()
    lock = RunLock(redis_client, "race", handover=Handover("first"), auto_renew=False)
    assert lock.acquire(blocking=False)
    thread.join(10)
    assert set(outcomes) <= {"duplicate:first"}
    assert len(outcomes) == 200
    lock.release()


def test_duplicate_event_names_the_holder(redis_client: redis.Redis) -> None:
    """A duplicate claim emits one LockEvent of kind duplicate carrying the holder's record."""
    seen: list[LockEvent] = []
    hook: Callable[[LockEvent], None] = seen.append
    add_hook(hook)
    try:
        hold = QueuedHold(redis_client, "ev", owner_info={"task_name": "t"})
        hold.claim("a", ttl=60)
        hold.claim("b", ttl=60)
    finally:
        remove_hook(hook)
    dups = [e for e in seen if e.kind == "duplicate"]
    assert len(dups) == 1
    assert dups[0].holder["task_id"] == "a" and dups[0].name == "ev"


def test_quorum_refuses_enqueue_holds_clearly(
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    """A Redlock quorum cannot hand over atomically: ConfigError saying what to do."""
    clients = [s.client() for s in redis_servers(3)]
    with pytest.raises(ConfigError, match="lock_on='run'") as refused:
        QueuedHold(clients, "k")
    with pytest.raises(ConfigError, match="Redlock masters") as refused_run:
        RunLock(clients, "k", handover=Handover("a"))
    assert str(refused.value) == str(refused_run.value)


def test_foreign_data_at_the_hold_is_a_config_error(redis_client: redis.Redis) -> None:
    """Something else at the hold's key: ConfigError naming that key, not "Redis down"."""
    redis_client.set("redlock:{k}:queued", "x")
    with pytest.raises(ConfigError, match="queued hold"):
        QueuedHold(redis_client, "k").claim("a", ttl=60)


def test_inspect_shows_queued_and_running(redis_client: redis.Redis) -> None:
    """scan_locks lists the run's lock as running and the queued hold as queued, each with
    its task id; force_dequeue removes only the task id it is given."""
    owner = {"task_name": "t", "task_id": "r"}
    lock = RunLock(redis_client, "k", owner_info=owner, auto_renew=False)
    lock.acquire()
    QueuedHold(redis_client, "k", owner_info={"task_name": "t"}).claim("q", ttl=60)
    rows = scan_locks(redis_client, "redlock:")
    assert [(r.name, r.state, r.record["task_id"]) for r in rows] == [
        ("k", "running", "r"),
        ("k", "queued", "q"),
    ]
    assert [i.state for i in read_lock(redis_client, "redlock:", "k")] == ["running", "queued"]
    assert force_dequeue(redis_client, "redlock:", "k", "other").outcome == "refused"
    assert force_dequeue(redis_client, "redlock:", "k", "q").outcome == "released"
    assert force_dequeue(redis_client, "redlock:", "k").outcome == "gone"
    lock.release()


def test_already_queued_survives_pickling() -> None:
    """AlreadyQueued keeps its task id, ttl and state through a result backend."""
    exc = AlreadyQueued("sync:42", "abc", 12.5, "running", {"task_id": "abc"})
    back = pickle.loads(pickle.dumps(exc))
    assert (back.name, back.task_id, back.ttl, back.state) == ("sync:42", "abc", 12.5, "running")
    assert str(back) == str(exc)
    assert type(exc)(*exc.args).task_id == "abc"  # Celery's JSON backend rebuilds from args
