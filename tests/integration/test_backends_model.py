"""A stateful property test: random sequences of what users and operators do to one lock
name, checked step by step against a small reference model, on each backend.

Hypothesis drives three ``Lock`` objects of one name (``auto_renew=False`` and a 60 s
lease, so time does not move under the model) through: non-blocking acquire, a waiter (a
blocking acquire with a short timeout), release, extend, owned(), the end of the holder's
lease on the backend (expire), dropping the holding object (its key stays until its
lease ends: a new object cannot take it), and an operator's forced release. The model
knows who holds the name (an object, or a dropped object's left-over lease), each
object's view (free, believes it holds, knows it lost), and the highest fence given; it
predicts each step's result (True/False, ``NotOwned``, ``LockLost``, ``RedlockError``) and
each fence (strictly above every earlier one). Every rule and the invariant assert, so
the first disagreement fails the test, and hypothesis shrinks it to a short sequence.

One TestCase per backend (:func:`_model_tests`): memory, Redis, a quorum of three Redis
servers, and (cheap) a quorum of three memory stores.
"""

from __future__ import annotations

import gc
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from servers import RedisServer, wait_for

from celery_redlock.core import (
    Lock,
    LockLost,
    NotOwned,
    RedlockError,
    Slot,
    connect,
    lock_keys,
    open_backend,
)
from celery_redlock.core.admin import ForceRelease, force_release
from celery_redlock.core.backends.quorum import QuorumBackend

PREFIX = "redlock:"
TTL = 60.0  # long: nothing expires unless the machine says so
WAIT = 0.02  # a waiter's timeout (seconds)
OBJECTS = st.integers(min_value=0, max_value=2)


class LockModel(RuleBasedStateMachine):
    """Three Lock objects of one name against the reference model (see the module doc)."""

    #: "memory", "redis", "quorum" (of Redis servers) or "memory-quorum".
    backend: ClassVar[str] = "memory"
    #: The Redis servers of the run (set by the TestCase's fixture).
    servers: ClassVar[list[RedisServer]] = []

    def __init__(self) -> None:
        super().__init__()
        self.name = f"model:{uuid.uuid4().hex[:16]}"
        self.slot = Slot(lock_keys(self.name, PREFIX))
        self.clients: list[Any] = []
        self.stores: list[Any] = []
        members: list[Any]
        if self.backend in ("memory", "memory-quorum"):
            count = 1 if self.backend == "memory" else 3
            urls = [f"memory://model-{uuid.uuid4().hex}" for _ in range(count)]
            self.stores = [connect(url) for url in urls]
            members = list(self.stores)
        else:
            self.clients = [server.client() for server in self.servers]
            members = list(self.clients)
        # A quorum with a generous per-master timeout: on a loaded test machine a master
        # that misses the default (250 ms for a read) is an outage by contract, which is
        # not what this model is about (test_backends.py runs quorums as users make them).
        self.target: Any = (
            members[0] if len(members) == 1 else open_backend(members, per_node_timeout=2.0)
        )
        #: Where an operator's verbs go: the one store, or each master (as celery locks).
        self.masters: list[Any] = members
        self.generation = 0
        self.locks: list[Lock] = []
        self.who: list[str] = []
        for i in range(3):
            self.locks.append(self._new_lock(i))
        #: Each object's view: "free", "held" (believes it holds) or "lost" (knows).
        self.view = ["free"] * 3
        self.tokens: list[str | None] = [None] * 3
        self.fences: list[int | None] = [None] * 3
        #: The acquisition the backend holds: its token, its owner's tag and fence.
        self.holder: str | None = None
        self.holder_who: str | None = None
        self.holder_fence: int | None = None
        self.top_fence = 0
        self.probe = Lock(self.target, self.name, ttl=TTL, auto_renew=False)

    def _new_lock(self, i: int) -> Lock:
        self.generation += 1
        tag = f"object-{i}-{self.generation}"
        lock = Lock(self.target, self.name, ttl=TTL, auto_renew=False, owner_info={"who": tag})
        if i < len(self.who):
            self.who[i] = tag
        else:
            self.who.append(tag)
        return lock

    def _mine(self, i: int) -> bool:
        """Object *i* believes it holds, and the backend holds its acquisition."""
        return self.view[i] == "held" and self.tokens[i] == self.holder

    def _expected_loss(self, i: int) -> type[NotOwned] | None:
        """What release/extend of object *i* must raise (None: succeed)."""
        if self.view[i] == "free":
            return NotOwned
        return None if self._mine(i) else LockLost

    def _settle(self) -> None:
        """On a quorum, let member calls still running end first (a decided acquire or
        release may still be on its way to the last master): the model's steps are
        sequential, and an operator's forced release reports what any master held."""
        backend = open_backend(self.target)
        if isinstance(backend, QuorumBackend):
            idle = lambda: all(backend.in_flight(i) == 0 for i in range(backend.masters))  # noqa: E731
            assert wait_for(idle, timeout=5), "quorum calls still running after 5 s"

    def _free(self, i: int) -> None:
        self.view[i], self.tokens[i], self.fences[i] = "free", None, None

    # -- taking the lock ------------------------------------------------------------------
    def _attempt(self, i: int, *, blocking: bool) -> None:
        lock = self.locks[i]
        timeout = WAIT if blocking else None  # a timeout goes with blocking only
        if self.view[i] == "held":  # not reentrant: taking it again is refused
            with pytest.raises(RedlockError, match="already held") as refused:
                lock.acquire(blocking=blocking, timeout=timeout)
            assert type(refused.value) is RedlockError
            return
        started = time.monotonic()
        got = lock.acquire(blocking=blocking, timeout=timeout)
        took = time.monotonic() - started
        assert got is (self.holder is None), (
            f"acquire by object {i} gave {got}; the model says the lock is "
            f"{'held by ' + str(self.holder_who) if self.holder else 'free'}"
        )
        if not got:
            # A blocking attempt whose deadline came before the masters answered (a loaded
            # machine) knows no holder; any holder it names is the model's.
            if lock.holder or not blocking:
                assert lock.holder.get("who") == self.holder_who, lock.holder
            if blocking:
                assert took >= WAIT * 0.9, f"a waiter gave up after {took:.4f} s"
            return
        assert took < 2.0, f"a free lock took {took:.3f} s to take"
        fence = lock.fence
        assert fence is not None and fence > self.top_fence, (fence, self.top_fence)
        self.top_fence = fence
        self.view[i], self.tokens[i], self.fences[i] = "held", lock.token, fence
        self.holder, self.holder_who, self.holder_fence = lock.token, self.who[i], fence

    @rule(i=OBJECTS)
    def acquire(self, i: int) -> None:
        """A non-blocking acquire: True exactly when nobody holds the name."""
        self._attempt(i, blocking=False)

    @rule(i=OBJECTS)
    def waiter(self, i: int) -> None:
        """A blocking acquire with a short timeout: False after the timeout while held,
        True at once while free."""
        self._attempt(i, blocking=True)

    # -- giving it back, keeping it ---------------------------------------------------------
    @rule(i=OBJECTS)
    def release(self, i: int) -> None:
        """release(): ok for the holder; NotOwned for an object that holds nothing; LockLost
        for one whose acquisition ended or was taken, whatever its local clock says."""
        expected = self._expected_loss(i)
        if expected is None:
            self.locks[i].release()
            self.holder = self.holder_who = self.holder_fence = None
        else:
            with pytest.raises(expected) as raised:
                self.locks[i].release()
            assert type(raised.value) is expected, raised.value
        self._free(i)

    @rule(i=OBJECTS)
    def extend(self, i: int) -> None:
        """extend(): ok for the holder; NotOwned for an object that holds nothing; LockLost
        (and never a new key) for one whose acquisition ended or was taken."""
        expected = self._expected_loss(i)
        if expected is None:
            self.locks[i].extend()
            return
        with pytest.raises(expected) as raised:
            self.locks[i].extend()
        assert type(raised.value) is expected, raised.value
        if expected is LockLost:
            self.view[i] = "lost"

    @rule(i=OBJECTS)
    def owned(self, i: int) -> None:
        """owned(): True only for the holder; an object that believed it held learns the
        loss here."""
        mine = self._mine(i)
        assert self.locks[i].owned() is mine
        if self.view[i] == "held" and not mine:
            self.view[i] = "lost"

    # -- what happens to a holder --------------------------------------------------------------
    @precondition(lambda self: self.holder is not None)
    @rule()
    def expire(self) -> None:
        """The holder's lease ends on the backend (its local clock does not move)."""
        self._settle()
        key = self.slot.keys.lock
        if self.clients:  # Redis: the server ends the lease (every master of a quorum)
            ended = [bool(client.pexpire(key, 1)) for client in self.clients]
            assert ended[0] if self.backend == "redis" else sum(ended) >= 2, ended
            assert wait_for(lambda: not any(c.exists(key) for c in self.clients), timeout=2)
        else:  # memory: the store's own verb ends the lease in 1 ms, its clock does the rest
            assert self.holder is not None
            for store in self.stores:
                assert store.extend(self.slot, self.holder, 1, replace=True) == 1
            assert wait_for(lambda: not any(s.holders(self.slot) for s in self.stores), 2)
        self.holder = self.holder_who = self.holder_fence = None

    @precondition(lambda self: any(self._mine(i) for i in range(3)))
    @rule()
    def drop(self) -> None:
        """The holding object is dropped without a release: its lease stays on the backend
        until it ends, so a new object (in its place) cannot take the name."""
        i = next(i for i in range(3) if self._mine(i))
        gone = weakref.ref(self.locks[i])
        self.locks[i] = self._new_lock(i)
        gc.collect()  # the test's own cycles (a traceback kept by pytest.raises) go first
        assert gone() is None, "the dropped Lock object is still alive"
        self._free(i)
        assert self.locks[i].acquire(blocking=False) is False
        assert self.locks[i].holder.get("who") == self.holder_who

    @rule()
    def forced_release(self) -> None:
        """An operator's forced release: removes whatever acquisition holds the name."""
        self._settle()
        forced = self._force_release()
        if self.holder is None:
            assert forced.outcome == "gone", forced
            return
        assert forced.outcome == "released", forced
        assert forced.record.get("who") == self.holder_who, forced
        assert forced.fence is not None and self.holder_fence is not None
        if isinstance(open_backend(self.target), QuorumBackend):
            # Each master stores the fence it gave; a quorum reports the highest removed,
            # which exceeds the holder's own fence (the highest of the grants it decided
            # on) when a master that answered after the decision had a higher counter.
            assert forced.fence >= self.holder_fence, (forced.fence, self.holder_fence)
        else:
            assert forced.fence == self.holder_fence, (forced.fence, self.holder_fence)
        self.holder = self.holder_who = self.holder_fence = None

    def _force_release(self) -> ForceRelease:
        """``force_release`` on each master: released where any released it (with the
        highest fence removed), else gone."""
        done = [force_release(master, PREFIX, self.name) for master in self.masters]
        removed = [f for f in done if f.outcome == "released"]
        if not removed:
            return ForceRelease("gone")
        fences = [f.fence for f in removed if f.fence is not None]
        return ForceRelease("released", removed[0].record, max(fences) if fences else None)

    # -- what must hold after every step --------------------------------------------------------
    @invariant()
    def backend_agrees_with_the_model(self) -> None:
        """locked() and the holder's record are the model's; each object's fence, token
        and lost flag are its view's."""
        assert self.probe.locked() is (self.holder is not None)
        record = self.probe.read_holder()
        assert (None if record is None else record.get("who")) == self.holder_who, record
        for i, lock in enumerate(self.locks):
            assert lock.fence == self.fences[i], (i, lock.fence, self.fences[i])
            assert lock.token == self.tokens[i]
            if self.view[i] != "free":
                assert lock.lost is (self.view[i] == "lost"), (i, self.view[i])

    def teardown(self) -> None:
        try:
            self._force_release()
        finally:
            for store in self.stores:
                store.clear()
            for client in self.clients:
                client.close()


def _model_tests(backend: str, examples: int, servers: str | None) -> type:
    """The TestCase running :class:`LockModel` on *backend* (*servers*: the fixture giving
    its Redis servers)."""
    machine = type(f"LockModel_{backend}", (LockModel,), {"backend": backend})

    class Case(machine.TestCase):  # type: ignore[name-defined,misc]
        @pytest.fixture(autouse=True)
        def _servers(self, request: pytest.FixtureRequest) -> Iterator[None]:
            found = [] if servers is None else request.getfixturevalue(servers)
            found = found if isinstance(found, list) else [found]
            for server in found:  # the session's shared server as other tests left it
                if server.paused:
                    server.resume()
                if not server.alive():
                    server.restart()
            machine.servers = found
            yield
            machine.servers = []

    Case.settings = settings(
        max_examples=examples,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    title = "".join(part.title() for part in backend.split("-"))
    Case.__name__ = Case.__qualname__ = f"Test{title}Model"
    return Case


# memory:// runs the same Lua scripts as Redis (on fakeredis): as many examples as Redis.
# Each example is up to 25 steps of every rule; a run draws new sequences (the examples
# database replays a failing one first), so these counts are per run, not for all time.
# A quorum's step is three members' calls (and memory-quorum's three Lua engines in this
# process): fewer examples, at 0.3-0.5 CPU-seconds each.
TestMemoryModel = _model_tests("memory", 20, None)
TestRedisModel = _model_tests("redis", 20, "shared_redis")
TestQuorumModel = _model_tests("quorum", 12, "three_servers")
TestMemoryQuorumModel = _model_tests("memory-quorum", 12, None)
