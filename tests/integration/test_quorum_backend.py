"""The quorum backend's verbs over member backends: Redlock's decisions (majorities, fences
across different majorities, contention, split votes), members that are down, stalled or
broken, the order of a give-back behind its acquire, and per-item renewal."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
from servers import RedisServer, wait_for

from celery_redlock.core import connect, open_backend
from celery_redlock.core.backend import (
    Admin,
    Backend,
    Permits,
    QueuedHolds,
    Rates,
    has,
    lacks,
)
from celery_redlock.core.backend_types import Grant, Renewal, Slot, Status
from celery_redlock.core.backends.quorum import QuorumBackend
from celery_redlock.core.backends.redis import RedisBackend
from celery_redlock.core.errors import ConfigError, StoreUnavailable
from celery_redlock.core.keys import lock_keys

RECORD = json.dumps({"hostname": "test", "pid": 1})
TTL = 10_000
TIMEOUT = 0.25  # per-member timeout of the quorums under test (memory:// members: fakeredis,
# which a loaded machine can hold up past 100 ms)


class PoolExhausted(Exception):
    """What a client whose connection pool is empty raises: no outage."""


class Flaky:
    """A member backend over a memory store that fails on demand (a stub backend, which
    calls every verb the usual way: no ``send``).

    ``down``: every verb raises StoreUnavailable; ``stall``: every verb blocks until
    :meth:`heal` (at most 30 s); ``broken``: every verb raises :class:`PoolExhausted`.
    ``log`` records ``(verb, "start"|"end", monotonic)`` of every call that ran.
    """

    masters = 1

    def __init__(self, url: str) -> None:
        self.inner = open_backend(connect(url))
        self.mode = "ok"
        self.gate = threading.Event()
        self.gate.set()
        self.log: list[tuple[str, str, float]] = []
        self.running = 0
        self.most_running = 0
        self.lock = threading.Lock()
        #: Set when a call is refused (``down``).
        self.refused = threading.Event()

    def fail(self, mode: str) -> None:
        self.mode = mode
        if mode == "stall":
            self.gate.clear()

    def heal(self) -> None:
        self.mode = "ok"
        self.gate.set()

    def describe(self) -> str:
        return self.inner.describe()

    def identity(self) -> Any:
        return self.inner.identity()

    def __getattr__(self, verb: str) -> Callable[..., Any]:
        if verb == "send":  # a stub: its verbs run where the quorum calls them
            raise AttributeError(verb)
        method = getattr(self.inner, verb)

        def call(*args: Any, **kwargs: Any) -> Any:
            mode = self.mode
            if mode == "down":
                self.refused.set()
                raise StoreUnavailable("x", {self.describe(): "ConnectionError: refused"})
            if mode == "broken":
                raise PoolExhausted("Too many connections")
            with self.lock:
                self.running += 1
                self.most_running = max(self.most_running, self.running)
                self.log.append((verb, "start", time.monotonic()))
            try:
                if mode == "stall":
                    self.gate.wait(30)
                return method(*args, **kwargs)
            finally:
                with self.lock:
                    self.running -= 1
                    self.log.append((verb, "end", time.monotonic()))

        return call


@pytest.fixture
def flaky(request: pytest.FixtureRequest) -> Iterator[list[Flaky]]:
    """Three fresh flaky members (stores of their own), healed at teardown."""
    name = request.node.name
    members = [Flaky(f"memory://q-{name}-{uuid.uuid4().hex}-{i}") for i in range(3)]
    warm_up = mutex("warm-up")
    for member in members:  # a new store's first script sets up its Lua engine: not timed
        assert member.inner.acquire(warm_up, "w", TTL, RECORD, wait=False, fence_ttl_ms=0).acquired
        member.inner.release(warm_up, "w", TTL)
    yield members
    for member in members:
        member.heal()


def quorum_of(members: list[Flaky], **options: Any) -> QuorumBackend:
    """A quorum over *members*, each heard from once (no first-contact wait)."""
    quorum = QuorumBackend([cast(Backend, m) for m in members], per_node_timeout=TIMEOUT, **options)
    quorum.holders(mutex("warm-up"))
    for member in members:
        member.log.clear()
    return quorum


def mutex(name: str) -> Slot:
    return Slot(lock_keys(name))


def take(backend: Any, slot: Slot, token: str, ttl_ms: int = TTL) -> Grant:
    return cast(Grant, backend.acquire(slot, token, ttl_ms, RECORD, wait=False, fence_ttl_ms=0))


def settle(check: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait (bounded) until *check()* holds."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# -- construction -----------------------------------------------------------------------
def test_construction_refuses_bad_member_lists() -> None:
    """An empty list, a string, a member listed twice or a bad timeout is a ConfigError."""
    a, b = (
        open_backend(connect("memory://q-construct-a")),
        open_backend(connect("memory://q-construct-b")),
    )
    with pytest.raises(ConfigError, match="non-empty list"):
        QuorumBackend([])
    with pytest.raises(ConfigError, match="non-empty list"):
        QuorumBackend(cast(Any, "memory://x"))
    with pytest.raises(ConfigError, match="more than once: memory://q-construct-a"):
        QuorumBackend([a, b, open_backend(connect("memory://q-construct-a"))])
    for bad in (0, -1.0, True):
        with pytest.raises(ConfigError, match="per_node_timeout"):
            QuorumBackend([a, b], per_node_timeout=cast(Any, bad))


def test_shape_equality_and_timeouts() -> None:
    """masters, quorum and describe come from the members; equal members make equal
    quorums; the per-member timeout follows the lease unless set."""
    members = [open_backend(connect(f"memory://q-shape-{i}")) for i in range(5)]
    quorum = QuorumBackend(members)
    assert (quorum.masters, quorum.quorum) == (5, 3)
    assert quorum.describe() == ", ".join(m.describe() for m in members)
    assert quorum == QuorumBackend(list(members)) and hash(quorum) == hash(QuorumBackend(members))
    assert quorum != QuorumBackend(members[:3])
    assert isinstance(quorum, Backend)
    assert quorum.timeout(30_000) == pytest.approx(1.5)
    assert quorum.timeout(100) == pytest.approx(0.05)
    assert quorum.timeout(None) == pytest.approx(0.25)
    assert QuorumBackend(members, per_node_timeout=0.3).timeout(30_000) == pytest.approx(0.3)


# -- acquire ------------------------------------------------------------------------------
def test_majority_acquires_with_one_member_down(flaky: list[Flaky]) -> None:
    """One member of three down: the other two grant, the fence is theirs, and the grant
    says what each master answered."""
    quorum = quorum_of(flaky)
    flaky[2].fail("down")
    # The quorum reads no answer past a decided majority: the other two answer once the
    # down member has refused, so its refusal is in the report.
    flaky[0].fail("stall")
    flaky[1].fail("stall")
    granted: list[Grant] = []
    taker = threading.Thread(target=lambda: granted.append(take(quorum, mutex("one-down"), "t1")))
    taker.start()
    assert flaky[2].refused.wait(5)
    flaky[0].heal()
    flaky[1].heal()
    taker.join(5)
    assert not taker.is_alive()
    (grant,) = granted
    assert grant.acquired and grant.fence == 1
    assert grant.masters[flaky[0].describe()] == "acquired (fence 1)"
    assert "ConnectionError: refused" in grant.masters[flaky[2].describe()]
    assert quorum.release(mutex("one-down"), "t1", TTL) is Status.OK


def test_two_members_down_is_unavailable_promptly(flaky: list[Flaky]) -> None:
    """Two of three down (refusing, or stalled): StoreUnavailable within about two
    timeouts, naming the masters, never a contention."""
    quorum = quorum_of(flaky)
    flaky[1].fail("down")
    flaky[2].fail("down")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        take(quorum, mutex("two-down"), "t1")
    assert time.monotonic() - started < 2 * TIMEOUT
    assert caught.value.needed == 2 and caught.value.total == 3
    assert flaky[0].inner.holders(mutex("two-down")) == []  # the grant there was given back

    flaky[1].fail("stall")
    flaky[2].fail("stall")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no answer within 250 ms"):
        take(quorum, mutex("two-stalled"), "t2")
    assert time.monotonic() - started < 2 * TIMEOUT + 0.05


def test_first_contact_waits_three_timeouts(flaky: list[Flaky]) -> None:
    """A member never heard from in this process is waited for three timeouts (its first
    call connects); after one answer, one timeout."""
    quorum = QuorumBackend([cast(Backend, m) for m in flaky], per_node_timeout=TIMEOUT)
    for member in flaky[1:]:
        member.fail("stall")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        take(quorum, mutex("first"), "t1")
    assert 3 * TIMEOUT <= time.monotonic() - started < 3 * TIMEOUT + 0.2


def test_a_stalled_member_runs_one_call_and_is_then_sent_nothing(flaky: list[Flaky]) -> None:
    """A member that stops answering runs one call of ours at a time (one pool thread):
    later calls wait behind it and are dropped unrun when their round gave up; once its
    call has run longer than a timeout it is sent nothing more, and counts as not
    answering."""
    quorum = quorum_of(flaky)
    flaky[0].fail("stall")
    for k in range(9):
        grant = take(quorum, mutex(f"stalled-{k}"), "t")
        assert grant.acquired  # the other two are a majority
    assert flaky[0].most_running == 1
    time.sleep(TIMEOUT * 1.5)  # the stalled call has now run past a timeout: stuck
    queued = quorum.in_flight(0)
    grant = take(quorum, mutex("stalled-last"), "t")
    assert grant.acquired
    assert "still busy with an earlier call" in grant.masters[flaky[0].describe()]
    assert quorum.in_flight(0) <= queued, "a stuck member was sent more"
    flaky[0].heal()
    settle(lambda: quorum.in_flight(0) == 0)
    assert flaky[0].most_running == 1


def test_a_client_side_error_propagates_as_itself(flaky: list[Flaky]) -> None:
    """A member's client-side error (pool exhausted) is raised as it is, never reported as
    a master being down; the grants the attempt got elsewhere are given back."""
    quorum = quorum_of(flaky)
    flaky[2].fail("broken")
    flaky[1].fail("stall")  # the attempt waits for the broken member's answer
    with pytest.raises(PoolExhausted):
        take(quorum, mutex("broken"), "t1")
    flaky[1].heal()
    settle(lambda: len(flaky[1].log) == 4)  # its acquire, then the give-back behind it
    assert flaky[0].inner.holders(mutex("broken")) == []
    assert flaky[1].inner.holders(mutex("broken")) == []
    for verb in (
        lambda: quorum.holders(mutex("broken")),
        lambda: quorum.release(mutex("broken"), "t1", TTL),
        lambda: quorum.renew([Renewal(mutex("broken"), "t1", TTL)]),
    ):
        with pytest.raises(PoolExhausted):
            verb()


def test_fences_increase_across_different_majorities(flaky: list[Flaky]) -> None:
    """The module docstring's timeline: counters 100, 5, 50; A, B and C each hold a
    different majority, and the write-back makes their fences 51 < 101 < 102."""
    quorum = quorum_of(flaky)
    slot = mutex("timeline")
    for member, counter in zip(flaky, (100, 5, 50), strict=True):
        member.inner.raise_fence(slot, counter, 0)

    flaky[0].fail("down")
    a = take(quorum, slot, "A")
    assert a.fence == 51
    assert flaky[1].inner.raise_fence(slot, 0, 0) == 51  # m1 was raised to A's fence
    assert quorum.release(slot, "A", TTL) is Status.OK
    flaky[0].heal()

    flaky[2].fail("down")
    b = take(quorum, slot, "B")
    assert b.fence == 101
    assert quorum.release(slot, "B", TTL) is Status.OK
    flaky[2].heal()

    flaky[0].fail("down")
    c = take(quorum, slot, "C")
    assert c.fence == 102
    assert max(member.inner.raise_fence(slot, 0, 0) for member in flaky) == 102


def test_contention_waits_on_a_member_of_the_holder(flaky: list[Flaky]) -> None:
    """A holder with a majority: refused, with its record and lease, a wait of its lease
    at most, on one of its members; the caller's own grant is given back."""
    quorum = quorum_of(flaky)
    slot = mutex("contended")
    holder = json.dumps({"task_name": "sync", "task_id": "abc"})
    for member in flaky[1:]:
        member.inner.acquire(slot, "other", 5_000, holder, wait=False, fence_ttl_ms=0)
    grant = take(quorum, slot, "mine")
    assert not grant.acquired
    assert grant.holder == {"task_name": "sync", "task_id": "abc"}
    assert grant.holder_ttl_ms is not None and 0 < grant.holder_ttl_ms <= 5_000
    assert grant.wait_ms == grant.holder_ttl_ms
    assert grant.wait_on in (1, 2)
    # The two refusals decide the round: member 0's grant is given back when it has come
    # by then, else once it comes (its give-back follows its acquire, in the background).
    said = grant.masters[flaky[0].describe()]
    assert said.endswith(", given back") or said == "NoAnswer: not waited for", said
    wait_for(lambda: flaky[0].inner.holders(slot) == [], 5, "member 0's give-back")


def test_a_split_vote_retries_soon(flaky: list[Flaky]) -> None:
    """Three holders with one member each: nobody has a majority, so the wait is a short
    random one (within the timeout), not a holder's lease."""
    quorum = quorum_of(flaky)
    slot = mutex("split")
    for k, member in enumerate(flaky):
        member.inner.acquire(slot, f"x{k}", TTL, json.dumps({"pid": k}), wait=False, fence_ttl_ms=0)
    grant = take(quorum, slot, "z")
    assert not grant.acquired
    assert grant.wait_ms is not None and 1 <= grant.wait_ms <= TIMEOUT * 1000


def test_release_never_overtakes_a_refused_acquire_on_a_slow_member(flaky: list[Flaky]) -> None:
    """A refused attempt whose acquire is still running on a slow member: the give-back
    there runs after that acquire ends, so no stray grant stays."""
    quorum = quorum_of(flaky)
    slot = mutex("order")
    for member in flaky[:2]:
        member.inner.acquire(slot, "holder", TTL, RECORD, wait=False, fence_ttl_ms=0)
    flaky[2].fail("stall")
    grant = take(quorum, slot, "late")
    assert not grant.acquired
    assert [e[:2] for e in flaky[2].log] == [("acquire", "start")]
    flaky[2].heal()
    settle(lambda: len(flaky[2].log) == 4)
    verbs = [e[:2] for e in flaky[2].log]
    assert verbs == [
        ("acquire", "start"),
        ("acquire", "end"),
        ("release", "start"),
        ("release", "end"),
    ]
    assert flaky[2].inner.holders(slot) == []


def test_a_foreign_member_is_a_config_error(flaky: list[Flaky]) -> None:
    """Foreign data at a lock key on two members: ConfigError naming the masters, not an
    outage, and the grant the third gave is given back."""
    quorum = quorum_of(flaky)
    keys = lock_keys("foreign")
    slot = Slot(dataclasses.replace(keys, lock=keys.fence, fence=keys.fence + "2"))
    for member in flaky[:2]:  # the lock key is now a counter (a string), not a lock
        member.inner.raise_fence(mutex("foreign"), 7, 0)
    with pytest.raises(ConfigError, match="2 of 3 masters refused the acquire") as caught:
        take(quorum, slot, "t")
    assert flaky[0].describe() in str(caught.value)
    assert flaky[2].inner.holders(slot) == []


# -- release, extend, renew ---------------------------------------------------------------
def test_release_reports(flaky: list[Flaky]) -> None:
    """OK on a majority; TAKEN when another token holds a majority; GONE when nobody
    holds it; StoreUnavailable when too few answer."""
    quorum = quorum_of(flaky)
    slot = mutex("release")
    take(quorum, slot, "t1")
    flaky[0].fail("down")
    assert quorum.release(slot, "t1", TTL) is Status.OK
    assert quorum.release(slot, "t1", TTL) is Status.OK  # a re-sent copy
    flaky[0].heal()
    for member in flaky[1:]:
        member.inner.acquire(slot, "t2", TTL, RECORD, wait=False, fence_ttl_ms=0)
    assert quorum.release(slot, "t3", TTL) is Status.TAKEN
    assert quorum.release(mutex("nobody"), "t3", TTL) is Status.GONE
    flaky[1].fail("down")
    flaky[2].fail("down")
    with pytest.raises(StoreUnavailable):
        quorum.release(slot, "t2", TTL)


def test_release_with_a_granting_member_down_is_not_a_loss(flaky: list[Flaky]) -> None:
    """Granted on members 0 and 1 (2 was held by another then), and 1 goes down: the
    release hears OK from 0 and "gone" from 2, which never had it. Within Redlock's
    model (a minority fails) the lock was held to the end: OK, not a loss. Once a
    member that answers and says "gone" leaves no majority possible, it is GONE."""
    quorum = quorum_of(flaky)
    slot = mutex("half-heard")
    flaky[2].inner.acquire(slot, "other", TTL, RECORD, wait=False, fence_ttl_ms=0)
    assert quorum.acquire(slot, "t1", TTL, RECORD, wait=False, fence_ttl_ms=0).acquired
    flaky[2].inner.release(slot, "other", TTL)
    flaky[1].fail("down")
    assert quorum.release(slot, "t1", TTL) is Status.OK
    assert flaky[0].inner.holders(slot) == [] and flaky[2].inner.holders(slot) == []
    flaky[1].heal()
    take(quorum, slot, "t2")
    flaky[0].inner.force_release(slot, None, TTL)  # removed there, by no release of t2
    flaky[1].fail("down")
    assert quorum.release(slot, "t2", TTL) is Status.OK  # 2 says OK, 1 may hold it
    flaky[1].heal()
    take(quorum, slot, "t3")
    flaky[0].inner.force_release(slot, None, TTL)
    flaky[2].inner.force_release(slot, None, TTL)
    flaky[1].fail("down")
    assert quorum.release(slot, "t3", TTL) is Status.GONE  # only 1 could still hold it


def test_extend_is_the_quorum_th_longest_lease(flaky: list[Flaky]) -> None:
    """The lock lives while a majority holds it: the q-th longest new lease; GONE when
    a majority no longer holds it."""
    quorum = quorum_of(flaky)
    slot = mutex("extend")
    take(quorum, slot, "t1")
    lease = quorum.extend(slot, "t1", 20_000, replace=True)
    assert isinstance(lease, int) and not isinstance(lease, Status)
    assert 19_000 < lease <= 20_000
    assert quorum.extend(slot, "other", 20_000, replace=True) is Status.TAKEN
    flaky[0].inner.release(slot, "t1", TTL)
    flaky[1].inner.release(slot, "t1", TTL)
    assert quorum.extend(slot, "t1", 20_000, replace=True) is Status.GONE


def test_renew_settles_each_item_by_its_own_majority(flaky: list[Flaky]) -> None:
    """One batch per member; per item OK with a majority, StoreUnavailable while the
    silent members could still make one, else the lowest status; all members down
    raises."""
    quorum = quorum_of(flaky)
    held, lone, taken, near = (mutex(n) for n in ("r-held", "r-lone", "r-taken", "r-near"))
    take(quorum, held, "t")
    flaky[0].inner.acquire(lone, "t", TTL, RECORD, wait=False, fence_ttl_ms=0)
    for member in flaky[:2]:
        member.inner.acquire(taken, "other", TTL, RECORD, wait=False, fence_ttl_ms=0)
    flaky[0].inner.acquire(near, "t", TTL, RECORD, wait=False, fence_ttl_ms=0)
    items = [Renewal(s, "t", TTL) for s in (held, lone, taken)]
    assert quorum.renew(items) == [Status.OK, Status.GONE, Status.TAKEN]

    flaky[2].fail("down")
    outcomes = quorum.renew([Renewal(held, "t", TTL), Renewal(near, "t", TTL)])
    assert outcomes[0] is Status.OK
    assert isinstance(outcomes[1], StoreUnavailable)
    assert outcomes[1].name == "r-near"
    for member in flaky:
        member.fail("down")
    with pytest.raises(StoreUnavailable):
        quorum.renew(items)
    assert quorum.renew([]) == []


# -- reads, waits, records ----------------------------------------------------------------
def test_holders_locked_and_was_done(flaky: list[Flaky]) -> None:
    """holders: the acquisition a majority holds (highest fence, q-th lease); locked: a
    majority; was_done: any member's mark."""
    quorum = quorum_of(flaky)
    slot = mutex("reads")
    assert quorum.holders(slot) == [] and not quorum.locked(slot)
    grant = take(quorum, slot, "t1")
    (holder,) = quorum.holders(slot)
    assert holder.token == "t1" and holder.fence == grant.fence
    assert holder.record == {"hostname": "test", "pid": 1}
    assert quorum.locked(slot)
    flaky[0].inner.release_done(slot, "t1", TTL, "run-1", 60_000)
    assert quorum.was_done(slot, "run-1") and not quorum.was_done(slot, "run-2")
    flaky[1].inner.release(slot, "t1", TTL)
    assert quorum.holders(slot) == [] and not quorum.locked(slot)
    flaky[1].fail("down")
    flaky[2].fail("down")
    for read in (lambda: quorum.holders(slot), lambda: quorum.locked(slot)):
        with pytest.raises(StoreUnavailable):
            read()


def test_wait_is_woken_by_a_release(flaky: list[Flaky]) -> None:
    """A waiter blocked on the holder's member returns when the holder releases."""
    quorum = quorum_of(flaky)
    slot = mutex("wake")
    take(quorum, slot, "holder")
    refused = quorum.acquire(slot, "waiter", TTL, RECORD, wait=True, fence_ttl_ms=0)
    assert not refused.acquired
    done = threading.Event()

    def waiter() -> None:
        quorum.wait(slot, 5.0, refused)
        done.set()

    started = time.monotonic()
    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    assert not done.is_set()
    assert quorum.release(slot, "holder", TTL) is Status.OK
    assert done.wait(2.0)
    assert time.monotonic() - started < 0.5  # woken, not the 1 s cap of a wait
    thread.join(2.0)
    flaky[refused.wait_on].fail("down")
    quorum.wait(slot, 5.0, refused)  # a member that is down: returns at once


def test_records_need_a_majority(flaky: list[Flaky]) -> None:
    """A claim is claimed on a majority, lost where another token holds it, stale under a
    newer version; records load from a majority, newest first."""
    quorum = quorum_of(flaky)
    slot = mutex("records")
    grant = take(quorum, slot, "t1")
    record = json.dumps({"at": 1, "fence": grant.fence, "n": 2})
    flaky[2].fail("down")
    claim = quorum.claim(slot, "ticks", "t1", "beat", record, (grant.fence or 0, 2))
    assert claim.outcome == "claimed" and claim.record == record
    flaky[2].heal()
    assert quorum.load_records(slot, "ticks") == {"beat": record}
    older = json.dumps({"at": 0, "fence": grant.fence, "n": 1})
    stale = quorum.claim(slot, "ticks", "t1", "beat", older, (grant.fence or 0, 1))
    assert stale.outcome == "stale" and stale.record == record
    lost = quorum.claim(slot, "ticks", "t9", "beat", record, (grant.fence or 0, 3))
    assert lost.outcome == "lost"
    late = quorum.claim(slot, "ticks", "t1", "beat", record, (1, 2), time.monotonic() - 1)
    assert late.outcome == "lost"
    flaky[0].fail("down")
    flaky[1].fail("down")
    with pytest.raises(StoreUnavailable):
        quorum.load_records(slot, "ticks")
    with pytest.raises(StoreUnavailable):
        quorum.claim(slot, "ticks", "t1", "beat", record, (grant.fence or 0, 4))


# -- what a quorum lacks -------------------------------------------------------------------
def test_what_a_quorum_lacks(flaky: list[Flaky]) -> None:
    """A quorum has the lock verbs, done marks and records, and none of queued holds,
    rates, permits or operator verbs (celery locks reads each master); each lack has the
    reason that says why."""
    quorum = quorum_of(flaky)
    for capability in (QueuedHolds, Rates, Permits, Admin):
        assert not has(quorum, capability)
    assert not hasattr(quorum, "enqueue") and not hasattr(quorum, "scan")
    assert "hand-over from a queued hold" in lacks(quorum, QueuedHolds)
    assert "three grants while each master counted two" in lacks(quorum, Rates)
    assert "B on 2 and 3, C on 1 and 3" in lacks(quorum, Permits)
    assert lacks(quorum, Rates).startswith("rate limits (RateLimiter, lock_rate) are not ")
    assert quorum.describe() in lacks(quorum, Permits)


# -- over real servers ------------------------------------------------------------------
@pytest.fixture
def three_redis(redis_servers: Callable[[int], list[RedisServer]]) -> list[RedisServer]:
    """Three throwaway Redis servers."""
    return redis_servers(3)


def test_redlock_over_three_redis_servers(three_redis: list[RedisServer]) -> None:
    """Over three real Redis backends: acquire, extend, holders, release; with one server
    stopped a majority still decides; with two, StoreUnavailable."""
    clients = [s.client(socket_timeout=1.0) for s in three_redis]
    try:
        quorum = QuorumBackend([RedisBackend.of(c) for c in clients], per_node_timeout=0.5)
        slot = mutex("real")
        grant = take(quorum, slot, "t1")
        assert grant.acquired and grant.fence is not None
        assert quorum.holders(slot)[0].token == "t1"
        assert quorum.release(slot, "t1", TTL) is Status.OK
        three_redis[0].stop()
        second = take(quorum, slot, "t2")
        assert second.acquired and (second.fence or 0) > grant.fence
        assert quorum.renew([Renewal(slot, "t2", TTL)]) == [Status.OK]
        assert quorum.release(slot, "t2", TTL) is Status.OK
        three_redis[1].stop()
        with pytest.raises(StoreUnavailable):
            take(quorum, slot, "t3")
    finally:
        for client in clients:
            client.close()
