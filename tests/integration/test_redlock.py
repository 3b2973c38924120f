"""Redlock over real, throwaway masters: quorum, faults, fencing, waiting and renewal."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.sentinel import Sentinel
from servers import FaultProxy, RedisServer, locked_increment, run_forked, wait_for

from celery_redlock import (
    ConfigError,
    Lock,
    LockContended,
    LockLost,
    Redlock,
    StoreUnavailable,
    connect,
)
from celery_redlock.core.backend_types import Slot
from celery_redlock.core.backends.redis import RedisBackend
from celery_redlock.core.keys import lock_keys
from celery_redlock.core.renewal import get_manager

Servers = Callable[[int], list[RedisServer]]
ProxyFactory = Callable[[RedisServer], FaultProxy]

SOCKET_TIMEOUT = 1.0  # clients in these tests; per-node timeouts are far below it


def clients_of(servers: list[RedisServer], **options: Any) -> list[Any]:
    """connect() clients for *servers*, with a short socket timeout."""
    options.setdefault("socket_timeout", SOCKET_TIMEOUT)
    return connect([s.url for s in servers], **options)


def holds_key(server: RedisServer, name: str) -> bool:
    """True when *server* has the lock key of lock *name*."""
    client = server.client(socket_timeout=2)
    try:
        return bool(client.exists(lock_keys(name).lock))
    finally:
        client.close()


def warm(lock: Redlock, servers: list[RedisServer], tries: int = 50) -> None:
    """Acquire and release until every master has answered an acquire (in some round):
    each is then heard from, and later calls there wait the per-node timeout, not the
    longer first-contact one. (A majority decides a round, so one round may not wait for
    a slow master.) Returns once the last release has reached every master."""
    answered: set[str] = set()
    for _ in range(tries):
        assert lock.acquire(blocking=False)
        answered |= {name for name, said in lock.masters.items() if "acquired" in said}
        lock.release()
        # Each round starts on free masters: a master slower than the majority (a loaded
        # machine) would otherwise answer every later round "held" by the round before.
        wait_for(lambda: not any(holds_key(s, lock.name) for s in servers), 3, "the release")
        if len(answered) == lock.backend.masters:
            return
    raise AssertionError(f"a master never answered an acquire: {lock.masters}")


# --------------------------------------------------------------------------- basics


def test_acquire_takes_every_master_and_release_frees_them(redis_servers: Servers) -> None:
    """A free Redlock is granted on a majority (here all), owned and locked, and released."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:basic", ttl=5)
    assert lock.acquire(blocking=False)
    assert lock.fence is not None and lock.fence >= 1
    assert lock.valid_until > time.monotonic() + 4
    assert wait_for(lambda: sum(holds_key(s, "rl:basic") for s in servers) == 3, 2)
    assert lock.owned() and lock.locked()
    lock.release()  # returns once a majority confirmed; the last master follows
    assert not lock.locked()
    assert wait_for(lambda: not any(holds_key(s, "rl:basic") for s in servers), 2)
    assert set(lock.masters) == {f"127.0.0.1:{s.port}/0" for s in servers}


def test_contended_with_raises_lock_contended_carrying_holder_and_masters(
    redis_servers: Servers,
) -> None:
    """Another owner holds a majority: acquire is False, `with` raises LockContended."""
    servers = redis_servers(3)
    clients = clients_of(servers)
    holder = Redlock(clients, "rl:busy", ttl=5, owner_info={"task_name": "sync"})
    assert holder.acquire(blocking=False)
    try:
        other = Redlock(clients, "rl:busy", ttl=5, blocking=False)
        assert not other.acquire()
        with pytest.raises(LockContended) as caught, other:
            pytest.fail("the body must not run")
        assert caught.value.holder.get("task_name") == "sync"
        assert len(caught.value.masters) == 3
        assert sum("held" in text for text in caught.value.masters.values()) >= 2
        assert caught.value.ttl_ms is not None and 0 < caught.value.ttl_ms <= 5000
    finally:
        holder.release()


def test_blocking_waiter_is_woken_by_the_release_not_the_ttl(redis_servers: Servers) -> None:
    """A blocked acquire gets the lock right after the holder releases, long before the TTL."""
    servers = redis_servers(3)
    clients = clients_of(servers)
    holder = Redlock(clients, "rl:wait", ttl=20)
    assert holder.acquire(blocking=False)
    waiter = Redlock(clients_of(servers), "rl:wait", ttl=20)
    got: list[float] = []

    def wait() -> None:
        if waiter.acquire(timeout=10):
            got.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)  # let it block
    released_at = time.monotonic()
    holder.release()
    thread.join(15)
    assert got, "the waiter never got the lock"
    assert got[0] - released_at < 1.0  # the notice, not the 20 s lease
    waiter.release()


def test_split_vote_retries_soon_and_gives_back_what_it_took(redis_servers: Servers) -> None:
    """No one has a majority (two other owners, one master each): retry after jitter, not TTL."""
    servers = redis_servers(3)
    clients = clients_of(servers)
    x = Lock(clients[0], "rl:split", ttl=10, auto_renew=False, owner_info={"task_id": "x"})
    y = Lock(clients[1], "rl:split", ttl=10, auto_renew=False, owner_info={"task_id": "y"})
    assert x.acquire(blocking=False) and y.acquire(blocking=False)
    servers[2].reset_stats()
    lock = Redlock(clients, "rl:split", ttl=2)  # per-node timeout 100 ms: jitter <= 100 ms
    began = time.monotonic()
    assert not lock.acquire(timeout=0.6)
    assert time.monotonic() - began < 1.5
    # Each attempt took master 2 and gave it back: several attempts, nothing left there.
    assert servers[2].command_count("evalsha") >= 6  # >= 3 attempts x (acquire + release)
    assert not holds_key(servers[2], "rl:split")
    x.release()  # now masters 0 and 2 are free: a majority
    began = time.monotonic()
    assert lock.acquire(timeout=5)
    assert time.monotonic() - began < 1.0
    lock.release()
    y.release()


def test_extend_needs_a_quorum_and_recomputes_validity(redis_servers: Servers) -> None:
    """extend() lengthens the lease on a majority; with a majority gone the lock is lost."""
    servers = redis_servers(3)
    clients = clients_of(servers)
    lock = Redlock(clients, "rl:extend", ttl=2, auto_renew=False)
    assert lock.acquire(blocking=False)
    before = lock.valid_until
    lock.extend(10, replace=True)
    assert lock.valid_until > before + 7
    key = lock_keys("rl:extend").lock
    # A majority confirmed before extend() returned; the last master follows.
    assert wait_for(lambda: all(8000 < s.client().pttl(key) <= 10000 for s in servers), 2)
    for server in servers[:2]:
        server.client().delete(key)
    with pytest.raises(LockLost):
        lock.extend()
    assert lock.lost and not lock.owned()


def test_extend_with_a_majority_unreachable_is_quorum_unavailable_not_lost(
    redis_servers: Servers,
) -> None:
    """Two of three masters down: extend() cannot confirm, raises StoreUnavailable."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:extend-down", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    servers[0].kill()
    servers[1].kill()
    with pytest.raises(StoreUnavailable) as caught:
        lock.extend()
    assert caught.value.needed == 2 and caught.value.total == 3
    assert not lock.lost  # not known to be lost: the local deadline still decides


def test_owned_and_locked_follow_the_majority(redis_servers: Servers) -> None:
    """Losing the key on one master keeps the lock; losing it on two loses it."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:owned", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    key = lock_keys("rl:owned").lock
    assert wait_for(lambda: all(holds_key(s, "rl:owned") for s in servers), 2)
    servers[0].client().delete(key)
    assert lock.owned() and lock.locked()
    servers[1].client().delete(key)
    assert not lock.locked()
    assert not lock.owned() and lock.lost


def test_release_after_the_lease_ran_out_and_was_taken_raises_lock_lost(
    redis_servers: Servers,
) -> None:
    """A holder whose lease expired and was taken over gets LockLost, and frees nothing."""
    servers = redis_servers(3)
    clients = clients_of(servers)
    first = Redlock(clients, "rl:late", ttl=0.3, auto_renew=False)
    assert first.acquire(blocking=False)
    time.sleep(0.45)
    second = Redlock(clients, "rl:late", ttl=5, auto_renew=False)
    assert second.acquire(blocking=False)
    assert second.fence is not None and first.fence is not None and second.fence > first.fence
    with pytest.raises(LockLost):
        first.release()
    assert second.owned()
    second.release()


def test_renewal_keeps_a_one_second_redlock_for_four_seconds(redis_servers: Servers) -> None:
    """auto_renew keeps a ttl=1 Redlock owned on every master well past its TTL."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:renew", ttl=1)
    assert lock.acquire(blocking=False)
    rounds = get_manager().rounds
    time.sleep(4)
    assert not lock.lost and lock.owned()
    assert lock.valid_until > time.monotonic()
    assert get_manager().rounds - rounds >= 8  # every ttl/3
    for server in servers:
        assert server.client().pttl(lock_keys("rl:renew").lock) > 0
    lock.release()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([], id="empty"),
        pytest.param("redis://127.0.0.1:6379/0", id="a-url-string"),
        pytest.param([object()], id="not-a-client"),
    ],
)
def test_bad_master_lists_are_config_errors(bad: Any) -> None:
    """Redlock refuses an empty list, a string and non-clients with ConfigError."""
    with pytest.raises(ConfigError):
        Redlock(bad, "rl:bad")


def test_the_same_master_twice_is_a_config_error(redis_servers: Servers) -> None:
    """Listing one server twice would let it vote twice: ConfigError naming it."""
    server = redis_servers(1)[0]
    clients = connect([server.url, server.url])
    with pytest.raises(ConfigError, match=str(server.port)):
        Redlock(clients, "rl:twice")
    with pytest.raises(ConfigError):
        Redlock(clients[:1], "rl:twice", per_node_timeout=0)


def test_two_sentinel_groups_with_the_same_master_name_are_two_masters() -> None:
    """Sentinel clients count as the same master only with the same name *and* sentinels."""
    group_a = Sentinel([("127.0.0.1", 1), ("127.0.0.1", 2)]).master_for("mymaster")
    group_b = Sentinel([("127.0.0.1", 3), ("127.0.0.1", 4)]).master_for("mymaster")
    group_c = Sentinel([("127.0.0.1", 5), ("127.0.0.1", 6)]).master_for("mymaster")
    lock = Redlock([group_a, group_b, group_c], "rl:sentinels")  # nothing is contacted yet
    assert lock.quorum == 2
    with pytest.raises(ConfigError, match="more than once"):
        Redlock(
            [group_a, Sentinel([("127.0.0.1", 2), ("127.0.0.1", 1)]).master_for("mymaster")], "x"
        )


def lanes_idle(lock: Lock) -> bool:
    """True when no call to any master of *lock* is still running."""
    backend: Any = lock.backend
    return not any(backend.in_flight(i) for i in range(backend.masters))


def test_clients_are_not_kept_alive_by_redlock_bookkeeping(redis_servers: Servers) -> None:
    """Once a Redlock and its clients are dropped, the per-master registry lets them go."""
    servers = redis_servers(3)
    clients = clients_of(servers)
    lock = Redlock(clients, "rl:gc", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()
    # Calls still running in a master's lane (a reply read late) hold it until they end.
    assert wait_for(functools.partial(lanes_idle, lock), 5)
    refs = [weakref.ref(c) for c in clients]
    del lock, clients
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_fence_that_cannot_be_written_back_is_quorum_unavailable_and_given_back(
    redis_servers: Servers,
) -> None:
    """Granted by masters 0 and 1 (fences 101 and 6), but master 1 refuses to raise its
    counter: no fence can be promised, so StoreUnavailable, and both keys are given back."""
    servers = redis_servers(3)
    name = "rl:no-write-back"
    for server in servers:  # this user may not SET: raise_fence.lua fails for it
        server.client().execute_command(
            "ACL", "SETUSER", "nofence", "on", ">pw", "~redlock:*", "+@all", "-set"
        )
    servers[0].client().set(lock_keys(name).fence, 100)
    clients = connect([f"redis://nofence:pw@127.0.0.1:{s.port}/0" for s in servers])
    servers[2].kill()
    # fence_ttl=None: a counter this user creates without SET (a new one is seeded with it)
    lock = Redlock(clients, name, ttl=5, fence_ttl=None)
    with pytest.raises(StoreUnavailable) as caught:
        lock.acquire(blocking=False)
    assert "writing fence 101 back failed" in str(caught.value)
    assert not holds_key(servers[0], name) and not holds_key(servers[1], name)


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("n", [3, 5])
def test_majority_paused_raises_quorum_unavailable_promptly_and_leaves_nothing(
    redis_servers: Servers, n: int
) -> None:
    """A majority SIGSTOPped: a *blocking* acquire raises StoreUnavailable within ~2 per-node
    timeouts, naming every master, and the live masters keep nothing of it."""
    servers = redis_servers(n)
    down = servers[: n // 2 + 1]
    live = servers[n // 2 + 1 :]
    lock = Redlock(clients_of(servers), "rl:majority", ttl=2)  # per-node timeout 100 ms
    warm(lock, servers)
    for server in down:
        server.pause()
    try:
        for _ in range(2):  # also the second time, when the paused masters are known bad
            began = time.monotonic()
            with pytest.raises(StoreUnavailable) as caught:
                lock.acquire()
            elapsed = time.monotonic() - began
            assert elapsed < 4 * lock.per_node_timeout + 0.1, elapsed
            assert caught.value.needed == n // 2 + 1 and caught.value.total == n
            assert set(caught.value.errors) == {f"127.0.0.1:{s.port}/0" for s in servers}
            for server in live:
                assert not holds_key(server, "rl:majority")
    finally:
        for server in down:
            server.resume()


def test_majority_killed_raises_quorum_unavailable_at_once(redis_servers: Servers) -> None:
    """Two of three masters SIGKILLed: StoreUnavailable, also when blocking, in well under 1 s."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:killed", ttl=10)
    servers[0].kill()
    servers[2].kill()
    began = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        lock.acquire(timeout=30)
    assert time.monotonic() - began < 2 * lock.per_node_timeout + 0.2
    assert "ConnectionError" in caught.value.errors[f"127.0.0.1:{servers[0].port}/0"]
    assert not holds_key(servers[1], "rl:killed")


def test_paused_master_does_not_slow_an_acquire_the_others_decide(
    redis_servers: Servers,
) -> None:
    """One master SIGSTOPped: acquire and release complete on the other two at once."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:paused", ttl=2)  # per-node timeout 100 ms
    warm(lock, servers)
    servers[0].pause()
    try:
        began = time.monotonic()
        assert lock.acquire(blocking=False)
        lock.release()
        assert time.monotonic() - began < lock.per_node_timeout
    finally:
        servers[0].resume()


def test_a_release_a_paused_majority_did_not_answer_can_be_sent_again(
    redis_servers: Servers,
) -> None:
    """Two of three masters SIGSTOPped during release(): StoreUnavailable, the lock still
    held here; once they resume, release() again answers OK and no master holds the key."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:release-again", ttl=5)  # per-node 250 ms
    warm(lock, servers)
    assert lock.acquire(blocking=False)
    assert wait_for(lambda: all(holds_key(s, lock.name) for s in servers), 3, "every grant")
    for server in servers[:2]:
        server.pause()
    try:
        with pytest.raises(StoreUnavailable):
            lock.release()
        assert lock.token is not None and not lock.lost
    finally:
        for server in servers[:2]:
            server.resume()
    quorum = lock.backend
    gates = quorum.gates  # type: ignore[attr-defined]
    assert wait_for(lambda: all(gate.calls == 0 for gate in gates), timeout=5, what="answers")
    lock.release()
    assert lock.token is None and not lock.lost
    assert wait_for(lambda: not any(holds_key(s, lock.name) for s in servers), 3, "the release")


def test_an_answer_nobody_waited_for_gives_its_connection_back(redis_servers: Servers) -> None:
    """A paused master's answers, which the other two made needless, are read once it
    resumes (by the next call there, or the reaper): nothing stays outstanding, its
    release ran after its acquire (nothing left held there), and it is asked again."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:parked", ttl=2)
    warm(lock, servers)  # every master heard from: calls are sent directly
    quorum = lock.backend
    gates = quorum.gates  # type: ignore[attr-defined]
    servers[0].pause()
    try:
        assert lock.acquire(blocking=False)
        lock.release()
        assert gates[0].calls >= 1  # its acquire (and release) are still out there
    finally:
        servers[0].resume()
    assert wait_for(lambda: all(gate.calls == 0 for gate in gates), timeout=5)
    # The release went to the paused master after its acquire (behind it, on the same
    # connection): once it ran both, it holds nothing.
    assert not holds_key(servers[0], "rl:parked")
    said = []
    for _ in range(20):  # and the master is asked again, and answers
        assert lock.acquire(blocking=False)
        said.append(lock.masters[f"127.0.0.1:{servers[0].port}/0"])
        lock.release()
    assert any("acquired" in outcome for outcome in said), said


_RELEASE_AND_EXIT = """
import sys
from celery_redlock import Redlock, connect
lock = Redlock(connect(sys.argv[1:], socket_timeout=5), "rl:exit", ttl=10)
assert lock.acquire(blocking=False)
print("acquired", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
"""


@contextlib.contextmanager
def released_while_paused(servers: list[RedisServer]) -> Iterator[subprocess.Popen[str]]:
    """A process holding ``rl:exit`` on all three masters releases it with the third
    paused; the block runs once it has said so (the master still paused). Afterwards the
    master resumes and the process has 10 s to exit, else it is killed."""
    child = subprocess.Popen(
        [sys.executable, "-c", _RELEASE_AND_EXIT, *(s.url for s in servers)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "acquired"
        assert wait_for(lambda: all(holds_key(s, "rl:exit") for s in servers), 3, "3 grants")
        servers[2].pause()
        try:
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "released"
            yield child
        finally:
            servers[2].resume()
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10)
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_script_that_releases_and_exits_leaves_nothing_on_a_master_that_answered_late(
    redis_servers: Servers,
) -> None:
    """A process releases (decided by two masters) and exits while the third is paused;
    its release there, sent as EVALSHA to a server that never ran the release script,
    is answered NOSCRIPT once the master resumes: the exiting process reads that answer
    and sends the script, so no master holds the key (it did for the lease's 10 s)."""
    servers = redis_servers(3)
    with released_while_paused(servers) as child:
        time.sleep(0.1)  # the process is exiting, its release there unanswered
    assert child.returncode == 0
    assert not any(holds_key(s, "rl:exit") for s in servers)


def test_a_script_exits_within_a_round_timeout_while_a_master_stays_paused(
    redis_servers: Servers,
) -> None:
    """What an exit waits for is bounded: with the third master paused throughout, the
    process that released on the other two waits the round's timeout there (5% of the
    10 s lease: 0.5 s), not its clients' 5 s socket timeout, and the key left there ends
    with its lease."""
    servers = redis_servers(3)
    with released_while_paused(servers) as child:
        began = time.monotonic()
        assert child.wait(timeout=10) == 0
        # 0.5 s and the interpreter's own exit (1.6 s seen on a loaded machine), under 5 s.
        assert time.monotonic() - began < 3.0
    assert not holds_key(servers[0], "rl:exit") and not holds_key(servers[1], "rl:exit")


def test_paused_master_whose_vote_is_needed_costs_the_per_node_timeout_then_is_given_back(
    redis_servers: Servers,
) -> None:
    """Master 0 SIGSTOPped and master 1 held elsewhere: the attempt ends after ~per_node_timeout
    (not the 1 s socket timeout), and when master 0 resumes, the late acquire it then runs is
    undone by the release queued behind it on the same connection (long before the 10 s TTL)."""
    servers = redis_servers(3)
    clients = clients_of(servers)
    lock = Redlock(clients, "rl:needed", ttl=10, per_node_timeout=0.1)
    warm(lock, servers)
    other = Lock(clients[1], "rl:needed", ttl=10, auto_renew=False)
    assert other.acquire(blocking=False)
    servers[0].pause()
    try:
        began = time.monotonic()
        assert not lock.acquire(blocking=False)
        elapsed = time.monotonic() - began
        assert 0.08 <= elapsed < SOCKET_TIMEOUT / 2, elapsed
        assert "no answer within 100 ms" in lock.masters[f"127.0.0.1:{servers[0].port}/0"]
        assert not holds_key(servers[2], "rl:needed")  # given back where it was granted
    finally:
        servers[0].resume()
    assert wait_for(lambda: not holds_key(servers[0], "rl:needed"), 3)
    other.release()


def test_fences_rise_across_holders_whose_quorums_differ(
    redis_servers: Servers, fault_proxy: ProxyFactory
) -> None:
    """Counters seeded 100/5/50; quorums {1,2}, {0,1}, {1,2}: fences 51 < 101 < 102.

    Without writing the chosen fence back, the third holder would get 52 < 101.
    """
    servers = redis_servers(3)
    proxies = [fault_proxy(s) for s in servers]
    clients = connect([p.url for p in proxies], socket_timeout=0.2)
    name = "rl:fence"
    fence_key = lock_keys(name).fence
    for server, seed in zip(servers, (100, 5, 50), strict=True):
        server.client().set(fence_key, seed)
    fences = []
    for down in (0, 2, 0):
        proxies[down].blackhole()
        try:
            lock = Redlock(clients, name, ttl=2, auto_renew=False)
            assert lock.acquire(blocking=False), lock.masters
            fences.append(lock.fence)
            lock.release()
            # Stay silent until every request to it has given up, so none lands later.
            backend: Any = lock.backend
            assert wait_for(lambda i=down, b=backend: not b.in_flight(i), 5)
        finally:
            proxies[down].heal()
    assert fences == [51, 101, 102]
    # Each chosen fence was written back to the quorum's lower counter (master 1).
    assert int(servers[1].client().get(fence_key)) == 102


def test_a_master_that_lost_its_scripts_gets_them_inline(redis_servers: Servers) -> None:
    """SCRIPT FLUSH on one master: its NOSCRIPT reply is answered by sending the script
    whole on the same connection, so that master still grants (and releases)."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:noscript", ttl=5, auto_renew=False)
    with lock:  # every master now has an open connection and the scripts
        pass
    servers[1].client().script_flush()
    assert lock.acquire(blocking=False), lock.masters
    # Its answer takes a second round trip: the other two may decide before it comes.
    answer = lock.masters[f"127.0.0.1:{servers[1].port}/0"]
    assert answer.startswith(("acquired", "NoAnswer: not waited for")), lock.masters
    assert wait_for(lambda: holds_key(servers[1], "rl:noscript"), 2, "the flushed master's grant")
    lock.release()
    assert wait_for(lambda: not holds_key(servers[1], "rl:noscript"), 2)


def test_new_names_restart_alike_on_every_master_so_no_fence_is_written_back(
    redis_servers: Servers,
) -> None:
    """Names never seen before (sync:<user_id>): every master restarts the counter at the
    same whole second of its clock, so the fences agree and the acquire needs no second
    round (no raise_fence script); only a name whose restart straddles a second may."""
    servers = redis_servers(3)
    clients = clients_of(servers)
    warm(Redlock(clients, "rl:warm", ttl=10), servers)
    admins = [s.client() for s in servers]
    for admin in admins:
        admin.config_resetstat()
    agreed = 0
    for i in range(20):
        lock = Redlock(clients, f"rl:new:{i}", ttl=10, auto_renew=False)
        assert lock.acquire(blocking=False)
        fence_key = lock_keys(lock.name).fence
        assert wait_for(lambda k=fence_key: all(a.exists(k) for a in admins), 3, "counters")
        counters = {int(a.get(fence_key)) for a in admins}
        agreed += counters == {lock.fence}
        assert lock.fence is not None and lock.fence % 1_000_000 == 0  # a whole second, in us
        lock.release()
    assert agreed >= 18, f"only {agreed} of 20 new names restarted alike"
    scripts = sum(a.info("commandstats")["cmdstat_evalsha"]["calls"] for a in admins)
    assert scripts <= 20 * 3 * 2 + 3 * 2, f"{scripts} scripts: write-back rounds were sent"


def test_fence_ttl_on_redlock_keeps_a_ttl_on_every_masters_counter(
    redis_servers: Servers,
) -> None:
    """fence_ttl with 3 masters: each counter is seeded from its own clock (rounded to the
    quorum's step), a quorum holds the chosen fence with its TTL; after expiry fences
    still rise."""
    servers = redis_servers(3)
    lock = Redlock(clients_of(servers), "rl:fence-ttl", ttl=5, auto_renew=False, fence_ttl=0.6)
    fence_key = lock_keys("rl:fence-ttl").fence
    with lock:
        first = lock.fence
    assert first is not None
    # A majority decides: the last master's acquire may land just after.
    assert wait_for(lambda: all(s.client().exists(fence_key) for s in servers), timeout=3)
    counters = [int(s.client().get(fence_key)) for s in servers]
    assert sum(c >= first for c in counters) >= 2, counters  # a quorum holds the fence
    assert all(0 < s.client().pttl(fence_key) <= 600 for s in servers)  # raised ones too
    assert wait_for(lambda: not any(s.client().exists(fence_key) for s in servers), timeout=3)
    with lock:
        assert lock.fence is not None and lock.fence > first


def test_a_blackholed_master_neither_slows_acquires_nor_ties_up_the_pool(
    redis_servers: Servers, fault_proxy: ProxyFactory
) -> None:
    """50 acquire/release cycles with one master silent stay fast, and only a few calls to it
    are left hanging at any time (each would hold a pool thread until its socket timeout)."""
    servers = redis_servers(3)
    proxies = [fault_proxy(s) for s in servers]
    clients = connect([p.url for p in proxies], socket_timeout=2.0)
    lock = Redlock(clients, "rl:silent", ttl=2, auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()
    proxies[0].blackhole()
    try:
        began = time.monotonic()
        hanging = 0
        for _ in range(50):
            assert lock.acquire(blocking=False), lock.masters
            lock.release()
            hanging = max(hanging, proxies[0].connection_count)
        assert time.monotonic() - began < 50 * lock.per_node_timeout / 4
        # One call of ours runs on a master at a time (plus connections still closing).
        assert hanging <= 3, hanging
        # Decided by the other two: the silent one was not waited for (or, once its
        # oldest call outlived the per-node timeout, not asked).
        said = lock.masters[f"127.0.0.1:{proxies[0].port}/0"]
        assert "not waited for" in said or "not answering" in said, said
    finally:
        proxies[0].heal()


def test_waiting_on_a_master_that_went_silent_is_a_redlock_error(
    redis_servers: Servers, fault_proxy: ProxyFactory
) -> None:
    """The release-notice wait on a silent master (its new connection's handshake times out)
    raises StoreUnavailable, never a raw redis error; a Redlock waiter then tries again."""
    server = redis_servers(1)[0]
    proxy = fault_proxy(server)
    client = connect(proxy.url, socket_timeout=0.2, socket_connect_timeout=0.2)
    proxy.blackhole()
    with pytest.raises(StoreUnavailable):
        RedisBackend.of(client).wait(Slot(lock_keys("rl:silent-wait")), 0.5)
    proxy.heal()


# --------------------------------------------------------------------------- many processes

#: Competing processes and their rounds each: every round contends with the 7 others
#: (they start together), so a grant to two at once shows within a few hundred rounds.
PROCESSES = 8
ROUNDS = 75
#: Rounds of each of the 4 processes of the minority-fault runs (the fault at a quarter).
FAULT_ROUNDS = 60


def _exclusion_worker(
    urls: list[str], counter_port: int, name: str, rounds: int, start: Any
) -> None:
    """One competing process: lock, read-modify-write the counter, log the fence."""
    clients = connect(urls, socket_timeout=SOCKET_TIMEOUT)
    counter = redis.Redis(host="127.0.0.1", port=counter_port, socket_timeout=10)
    if not start.wait(30):
        raise SystemExit(4)
    unavailable = 0
    try:
        for _ in range(rounds):
            lock = Redlock(clients, name, ttl=10)
            for _attempt in range(6):
                try:
                    if not lock.acquire(timeout=60):
                        raise RuntimeError(f"no lock within 60 s: {lock.masters}")
                    break
                except StoreUnavailable:
                    # A starved host can miss a per-node timeout; a Celery task would be
                    # retried. Counted, and the test bounds it.
                    unavailable += 1
                    counter.rpush("unavailable", "1")
                    if unavailable > 5:
                        raise
            locked_increment(counter, lock)
    except Exception as exc:  # tell the test what went wrong, then fail
        counter.rpush("errors", f"{type(exc).__name__}: {exc}")
        raise
    counter.close()


def run_exclusion(
    urls: list[str],
    counter: redis.Redis,
    counter_port: int,
    processes: int,
    rounds: int,
    fault: Callable[[], None] | None = None,
) -> None:
    """Run *processes* workers of *rounds* each; call *fault* once a quarter is done."""
    total = processes * rounds

    def quarter_then_fault() -> None:
        if fault is not None:
            assert wait_for(lambda: int(counter.get("counter") or 0) >= total // 4, 60)
            fault()

    run_forked(
        _exclusion_worker,
        (urls, counter_port, "rl:mutex", rounds),
        processes,
        meanwhile=quarter_then_fault,
        why=lambda: [e.decode() for e in counter.lrange("errors", 0, -1)],
    )
    assert int(counter.get("counter") or 0) == total
    # StoreUnavailable with every master up only happens on a starved host; a handful
    # at most, or something is wrong.
    assert counter.llen("unavailable") <= processes, counter.llen("unavailable")
    fences = [int(f) for f in counter.lrange("fences", 0, -1)]
    assert len(fences) == total
    assert all(b > a for a, b in itertools.pairwise(fences)), "fence went backwards"


@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 5])
def test_eight_processes_on_n_masters_never_overlap_and_fences_increase(
    redis_servers: Servers, redis_client: redis.Redis, shared_redis: RedisServer, n: int
) -> None:
    """8 processes x 75 Redlock-guarded read/increment/write rounds give 600, fences rising."""
    servers = redis_servers(n)
    run_exclusion([s.url for s in servers], redis_client, shared_redis.port, PROCESSES, ROUNDS)


@pytest.mark.slow
def test_minority_killed_mid_run_locks_are_still_granted_and_exclusive(
    redis_servers: Servers, redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """One of three masters SIGKILLed mid-run: every round still gets the lock, no overlap."""
    servers = redis_servers(3)
    urls = [s.url for s in servers]
    run_exclusion(urls, redis_client, shared_redis.port, 4, FAULT_ROUNDS, servers[1].kill)


@pytest.mark.slow
def test_minority_blackholed_mid_run_locks_are_still_granted_and_exclusive(
    redis_servers: Servers,
    fault_proxy: ProxyFactory,
    redis_client: redis.Redis,
    shared_redis: RedisServer,
) -> None:
    """Two of five masters go silent mid-run (blackholed): every round still locks, no overlap."""
    servers = redis_servers(5)
    proxies = [fault_proxy(s) for s in servers]

    def blackhole_two() -> None:
        proxies[0].blackhole()
        proxies[3].blackhole()

    run_exclusion(
        [p.url for p in proxies], redis_client, shared_redis.port, 4, FAULT_ROUNDS, blackhole_two
    )
