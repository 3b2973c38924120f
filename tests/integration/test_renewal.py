"""The per-process renewal thread against a real redis-server.

Keeps short leases alive, batches every lock on a node into one script per
round, hands a paused holder's loss back before it writes again, reports a
dead Redis as a loss, survives the errors, and starts afresh after fork.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import redis
from servers import RedisServer, holder_script, in_forked_child, logger_at_debug, wait_for

from celery_redlock import Lock, LockLost, connect
from celery_redlock.core.renewal import RenewalManager, get_manager

RENEWAL_THREAD = "celery-redlock-renewal"


def renewal_threads() -> list[threading.Thread]:
    """The live renewal threads of this process."""
    return [t for t in threading.enumerate() if t.name == RENEWAL_THREAD and t.is_alive()]


# --------------------------------------------------------------------------- keeping alive


def test_one_second_lock_held_for_five_seconds_stays_held(redis_client: redis.Redis) -> None:
    """ttl=1 s held 5 s: owned() stays True and the key never expires, one acquisition."""
    lock = Lock(redis_client, "renew:5s", ttl=1.0)
    assert lock.acquire(blocking=False)
    fence = lock.fence
    token = redis_client.hget(lock.keys.lock, "token")
    deadline = time.monotonic() + 5.0
    checks = 0
    while time.monotonic() < deadline:
        assert lock.owned()
        assert redis_client.pttl(lock.keys.lock) > 0
        assert lock.valid_until > time.monotonic()
        checks += 1
        time.sleep(0.2)
    assert checks >= 20
    assert redis_client.hget(lock.keys.lock, "token") == token
    assert redis_client.hget(lock.keys.lock, "fence") == str(fence).encode()
    assert not lock.lost
    lock.release()  # raises LockLost if the lease had lapsed at any point
    assert not redis_client.exists(lock.keys.lock)


def test_thousand_locks_are_renewed_by_one_thread_with_one_command_per_round(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """1000 held locks: one renewal thread, one EVALSHA per round for all of them."""
    ttl = 1.5  # a round every 0.5 s
    locks = [Lock(redis_client, f"many:{i}", ttl=ttl) for i in range(1000)]
    try:
        for lock in locks:
            assert lock.acquire(blocking=False)
        assert len(renewal_threads()) == 1
        manager = get_manager()
        assert len(manager.held()) == 1000
        shared_redis.reset_stats()
        rounds_before = manager.rounds
        time.sleep(3.0)  # twice the TTL: only renewal keeps the keys
        rounds = manager.rounds - rounds_before
        evalsha = shared_redis.command_count("evalsha")
        assert 3 <= rounds <= 3.0 / (ttl / 3) + 2, rounds
        assert evalsha <= rounds + 1, (evalsha, rounds)
        assert len(renewal_threads()) == 1
        with redis_client.pipeline(transaction=False) as pipe:
            for lock in locks:
                pipe.pttl(lock.keys.lock)
            ttls = pipe.execute()
        assert min(ttls) > 0, "a lock expired despite renewal"
        assert not any(lock.lost for lock in locks)
    finally:
        for lock in locks:
            if lock.fence is not None:
                lock.release()
    assert not manager.held()


def test_short_lock_taken_while_the_thread_sleeps_for_a_long_one_is_renewed_in_time(
    redis_client: redis.Redis,
) -> None:
    """The thread, asleep until a 30 s lock's round, is woken for a 0.5 s lock acquired later."""
    long = Lock(redis_client, "renew:long", ttl=30.0)
    assert long.acquire(blocking=False)
    time.sleep(0.1)  # the renewal thread is now asleep until the long lock's first round
    short = Lock(redis_client, "renew:short", ttl=0.5)
    assert short.acquire(blocking=False)
    time.sleep(1.2)  # more than two of the short lock's TTLs
    assert short.owned() and not short.lost
    assert redis_client.pttl(short.keys.lock) > 0
    short.release()
    long.release()


def _cpu_seconds(thread: threading.Thread) -> float:
    """CPU time (user + system) the thread has used so far, from /proc."""
    stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_collected_lock_is_dropped_and_the_thread_then_sleeps() -> None:
    """A lock nobody references leaves the manager's held locks, and the renewal thread,
    with nothing left to renew, sleeps instead of spinning."""
    manager = RenewalManager()
    lock = Lock(connect("memory://renewal-dropped"), "dropped", ttl=0.3, auto_renew=False)
    assert lock.acquire(blocking=False)
    manager.register(lock)
    try:
        assert wait_for(lambda: manager.rounds >= 1, timeout=3, what="a first round")
        del lock
        gc.collect()
        assert manager.held() == []
        time.sleep(0.2)  # past the round the collected lock had asked for
        thread = manager.thread
        assert thread is not None and thread.is_alive()
        before, started = _cpu_seconds(thread), time.monotonic()
        time.sleep(0.5)
        used = _cpu_seconds(thread) - before
        assert used < 0.1, (
            f"the idle renewal thread used {used:.2f} s CPU in {time.monotonic() - started:.2f} s"
        )
    finally:
        manager.stop()


class _HoldOnStop(logging.Handler):
    """Holds the renewal thread at its "stopped" log line, after it left its loop."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.entered = threading.Event()
        self.go_on = threading.Event()

    def handle(self, record: logging.LogRecord) -> bool:
        # handle(), not emit(): emit runs under the handler's lock, which would also hold
        # up the new thread's own "started" line.
        if record.getMessage().startswith("renewal thread stopped"):
            self.entered.set()
            self.go_on.wait(10)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        pass


def test_lock_taken_while_a_stopping_thread_is_still_alive_is_renewed(
    redis_client: redis.Redis,
) -> None:
    """stop() then a new lock while the old thread is still exiting: a new thread renews it.

    The old thread has left its loop but is alive (held at its last log line). A manager
    that looked at "is the thread alive?" would start no new thread, and the lock would
    expire after one TTL with nobody renewing it.
    """
    manager = get_manager()
    warm = Lock(redis_client, "renew:warm", ttl=30.0)
    assert warm.acquire(blocking=False)  # makes sure a renewal thread is running
    warm.release()
    old = manager.thread
    assert old is not None and old.is_alive()

    hold = _HoldOnStop()
    with logger_at_debug("celery_redlock.renew", hold):
        try:
            manager.stop(timeout=0)
            assert hold.entered.wait(5), "the renewal thread did not stop"
            assert old.is_alive()  # left its loop, not yet gone

            lock = Lock(redis_client, "renew:after-stop", ttl=0.5)
            assert lock.acquire(blocking=False)
            time.sleep(1.2)  # more than two TTLs
            assert lock.owned() and not lock.lost
            assert redis_client.pttl(lock.keys.lock) > 0
            assert manager.thread is not None and manager.thread is not old
            lock.release()
        finally:
            hold.go_on.set()
    old.join(5)
    assert not old.is_alive()


# --------------------------------------------------------------------------- a paused holder

_PAUSABLE_HOLDER = r"""
import sys, time
import redis
from celery_redlock import Lock

port, name = int(sys.argv[1]), sys.argv[2]
client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)


def on_lost(lock):
    client.rpush("lost", str(lock.fence))


lock = Lock(client, name, ttl=1.0, on_lost=on_lost)
assert lock.acquire(timeout=5)
fence = lock.fence
client.rpush("ready", str(fence))
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    if not lock.owned():
        break
    client.rpush("writes", f"child:{fence}")
    if client.getdel("park"):
        client.rpush("parked", "1")
        time.sleep(1.0)  # the parent SIGSTOPs us in here, between two check-then-write steps
    else:
        time.sleep(0.02)
client.rpush("done", "owned" if lock.owned() else "not-owned", "lost" if lock.lost else "kept")
"""


def _process_state(pid: int) -> str:
    """The one-letter state of a process from /proc (T when stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
def test_sigstopped_holder_learns_of_the_loss_before_writing_again(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """A holder paused past its TTL loses the lock; on SIGCONT it sees the loss, writes nothing."""
    name = "renew:paused"
    with holder_script(_PAUSABLE_HOLDER, shared_redis, name, "ready") as (proc, child_fence):
        assert wait_for(lambda: redis_client.llen("writes") >= 3)  # working under the lock
        redis_client.set("park", "1")
        assert redis_client.blpop(["parked"], timeout=5) is not None
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_for(lambda: _process_state(proc.pid) == "T", timeout=2)
        stopped_at = time.monotonic()

        key = f"redlock:{{{name}}}"
        assert wait_for(lambda: not redis_client.exists(key), timeout=3), "lease never ran out"
        assert time.monotonic() - stopped_at < 1.5  # the lease was not renewed while stopped
        new = Lock(redis_client, name, ttl=10, auto_renew=False)
        assert new.acquire(timeout=2)
        assert new.fence is not None and new.fence > child_fence
        redis_client.rpush("writes", f"new:{new.fence}")

        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(15) == 0
    writes = [w.decode() for w in redis_client.lrange("writes", 0, -1)]
    marker = writes.index(f"new:{new.fence}")
    assert set(writes[:marker]) == {f"child:{child_fence}"}
    assert writes[marker + 1 :] == [], "the paused holder wrote after losing the lock"
    assert redis_client.lrange("lost", 0, -1) == [str(child_fence).encode()]  # on_lost fired
    assert redis_client.lrange("done", 0, -1) == [b"not-owned", b"lost"]
    assert new.owned()  # the resumed holder's renewal did not touch the new owner's key
    assert redis_client.pttl(new.keys.lock) > 8000
    new.release()


# --------------------------------------------------------------------------- Redis dies


def test_redis_killed_mid_hold_reports_the_loss_and_a_restart_lets_the_client_reacquire(
    redis_server: RedisServer,
) -> None:
    """Redis SIGKILLed: on_lost fires within the TTL; after a restart the client locks again."""
    client = connect(redis_server.url)
    lost_at: list[float] = []
    lost = threading.Event()

    def on_lost(_lock: object) -> None:
        lost_at.append(time.monotonic())
        lost.set()

    lock = Lock(client, "renew:redis-dies", ttl=1.0, on_lost=on_lost)
    assert lock.acquire(blocking=False)
    time.sleep(0.5)  # at least one renewal round went through
    assert lock.owned()
    thread = get_manager().thread
    assert thread is not None and thread.is_alive()

    killed = time.monotonic()
    redis_server.kill()
    assert lost.wait(3), "no loss reported after Redis died"
    assert lost_at[0] - killed <= 1.0 + 0.5
    assert lock.lost and not lock.owned()
    assert thread.is_alive(), "the renewal thread died on a Redis error"

    redis_server.restart()
    with pytest.raises(LockLost):
        lock.release()
    again = Lock(client, "renew:redis-dies", ttl=1.0)
    assert again.acquire(timeout=3)
    time.sleep(1.5)  # longer than the TTL: the same renewal thread keeps it alive
    assert again.owned()
    assert get_manager().thread is thread
    again.release()
    assert lock.acquire(timeout=3)  # the lost Lock object can be taken again, too
    lock.release()


def test_a_round_redis_fails_is_one_line_naming_the_node_and_each_loss_is_one_line(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis dies under three held locks: each failed round is one WARNING line naming the
    node and the three locks (never one lock's line naming another lock); each lock's loss
    is then one line of its own, naming the failed round as the cause."""
    client = connect(redis_server.url)
    names = [f"renew:round:{i}" for i in range(3)]
    locks = [Lock(client, name, ttl=1.2) for name in names]
    assert all(lock.acquire(blocking=False) for lock in locks)
    with caplog.at_level(logging.WARNING, "celery_redlock.renew"):
        redis_server.kill()
        # A lock is marked lost a moment before its line is written: wait for the lines.
        wait_for(
            lambda: (
                all(lock.lost for lock in locks)
                and sum("LOST" in r.getMessage() for r in caplog.records) >= len(names)
            ),
            5,
            "the three losses and their lines",
        )
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    rounds = [m for m in lines if m.startswith("renewal round on ")]
    assert rounds, lines
    for line in rounds:
        assert "Redis unavailable" in line and "3 locks not renewed" in line, line
        assert all(repr(name) in line for name in names), line
    assert not [m for m in lines if m.startswith("renewal of ")], lines
    for name in names:
        lost = [m for m in lines if "LOST" in m and repr(name) in m]
        assert len(lost) == 1, lines
        assert "the last round failed: Redis unavailable" in lost[0], lost
    assert len(lines) == len(rounds) + 3, lines


def test_a_failed_renewal_of_one_lock_names_that_lock_only(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """One held lock on a Redis that dies: its renewal failure line names it, and no other
    lock, and the error's cause."""
    lock = Lock(connect(redis_server.url), "renew:alone", ttl=1.2)
    assert lock.acquire(blocking=False)
    with caplog.at_level(logging.WARNING, "celery_redlock.renew"):
        redis_server.kill()
        wait_for(lambda: lock.lost, 5, "the loss")
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("renewal")]
    assert failed, caplog.records
    for line in failed:
        assert line.startswith("renewal of lock 'renew:alone' failed (Redis unavailable ("), line
        assert line.count("renew:alone") == 1, line


# --------------------------------------------------------------------------- fork


def _child_after_fork(port: int, parent_manager: RenewalManager, parent_lock: Lock) -> int:
    """Runs in the forked child: fresh manager, none of the parent's locks, its own thread."""
    manager = get_manager()
    if manager is parent_manager:
        return 10
    if manager.held() or manager.thread is not None or renewal_threads():
        return 11
    if parent_lock.owned() or parent_lock.fence is not None:
        return 12
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    mine = Lock(client, "fork:child", ttl=0.5)
    if not mine.acquire(timeout=2):
        return 13
    threads = renewal_threads()
    if len(threads) != 1 or manager.thread is not threads[0]:
        return 14
    time.sleep(1.2)  # over two TTLs: only the child's renewal thread keeps it alive
    if not mine.owned() or not client.pttl(mine.keys.lock) > 0 or manager.rounds < 2:
        return 15
    mine.release()
    return 0


def test_forked_child_gets_a_fresh_manager_and_its_own_renewal_thread(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """After os.fork the child holds none of the parent's locks and renews its own."""
    parent_lock = Lock(redis_client, "fork:parent", ttl=1.0)
    assert parent_lock.acquire(blocking=False)
    parent_manager = get_manager()
    assert parent_manager.thread is not None and parent_manager.thread.is_alive()
    child = partial(_child_after_fork, shared_redis.port, parent_manager, parent_lock)
    assert in_forked_child(child) == 0
    assert get_manager() is parent_manager
    assert parent_lock.owned()  # the parent's thread kept renewing meanwhile
    assert not redis_client.exists("redlock:{fork:child}")
    parent_lock.release()
