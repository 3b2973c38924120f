"""A stateful property test of flow control: random sequences of runs taking several holds
and of operators pausing and changing limits, checked step by step against a small
reference model, on memory and on Redis.

Five lock objects stand for five runs (``auto_renew=False``, a 60 s lease: nothing expires
under the model). Each takes its own key and rules, all or nothing:

====== ========= =============================================
object primary   rules
====== ========= =============================================
0      ``p0``    ``Limit("L", 2)``, ``Limit("M", 1)``
1      ``p1``    ``Limit("L", 2)``
2      ``p2``    ``Limit("M", 1)``, ``Rate("R", burst 2)``
3      ``p0``    ``Limit("L", 2)``, ``Rate("R", burst 2)``
4      ``M``     ``Limit("p1", 1)``
====== ========= =============================================

A Limit of one is the mutex of its name, the one a run whose own key is that name takes:
objects 0, 2 and 4 exclude each other on ``M``, 1 and 4 on ``p1``. The Rate refills once
an hour, so it grants two units in the whole test. Operators pause
and resume any of the names, and set or unset ``L``'s limit. The model predicts each
acquire (taken, or refused because a name is paused, the primary is held, a Limit is
full, the Rate is spent); a refusal must leave every hold as it was (no permit taken, no
Rate unit spent), and the permits the backend holds must be the model's at every step.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from servers import RedisServer

from celery_redlock.core import Lock, Slot, connect
from celery_redlock.core.backend_types import Rule
from celery_redlock.core.backends.redis import RedisBackend
from celery_redlock.core.keys import lock_keys, permit_keys

TTL = 60.0
HOUR_US = 3_600_000_000
#: object -> (its primary, its Limits {name: limit}, whether it takes a unit of R)
RUNS: list[tuple[str, dict[str, int], bool]] = [
    ("p0", {"L": 2, "M": 1}, False),
    ("p1", {"L": 2}, False),
    ("p2", {"M": 1}, True),
    ("p0", {"L": 2}, True),
    ("M", {"p1": 1}, False),
]
NAMES = st.sampled_from(["p0", "p1", "p2", "L", "M", "R"])
OBJECTS = st.integers(min_value=0, max_value=len(RUNS) - 1)


class FlowModel(RuleBasedStateMachine):
    """Four runs' holds against the reference model (see the module doc)."""

    #: "memory" or "redis".
    backend: ClassVar[str] = "memory"
    server: ClassVar[RedisServer | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"fm{uuid.uuid4().hex[:10]}:"
        if self.backend == "memory":
            self.store: Any = connect(f"memory://flow-{uuid.uuid4().hex}")
            self.client = None
        else:
            assert self.server is not None
            self.client = self.server.client()
            self.store = RedisBackend.of(self.client)
        self.locks = [self._lock(i) for i in range(len(RUNS))]
        #: the model: who holds L's permits, and each mutex (a primary, a Limit of one);
        #: paused names; L's override
        self.limit_holders: dict[str, set[int]] = {"L": set()}
        self.mutex: dict[str, int | None] = dict.fromkeys(("p0", "p1", "p2", "M"))
        self.paused: set[str] = set()
        self.override: int | None = None
        self.units = 0  # of R taken
        self.holding = [False] * len(RUNS)

    def _rules(self, i: int) -> list[Rule]:
        _, limits, rated = RUNS[i]
        out = []
        for name, limit in limits.items():
            k = lock_keys(name, self.prefix) if limit == 1 else permit_keys(name, self.prefix)
            out.append(Rule(k, limit=limit))
        if rated:
            out.append(Rule(lock_keys("R", self.prefix), interval_us=HOUR_US, burst=2))
        return out

    def _lock(self, i: int) -> Lock:
        lock = Lock(self.target, RUNS[i][0], ttl=TTL, key_prefix=self.prefix, auto_renew=False)
        lock.hold_with(self._rules(i))
        return lock

    @property
    def target(self) -> Any:
        return self.store if self.client is None else self.client

    def _control(self, name: str, kind: str, value: str | None) -> None:
        self.store.set_control(lock_keys(name, self.prefix).control, kind, value, 0)

    def _limit_of(self, name: str, declared: int) -> int:
        return self.override if name == "L" and self.override is not None else declared

    def _expected(self, i: int) -> set[str]:
        """Every reason run *i* is refused now (empty when it takes everything). The
        backend names one of them (controls and rules are checked before the primary,
        whose holder is a reason only when none of them refuses)."""
        primary, limits, rated = RUNS[i]
        names = {primary, *limits, *(["R"] if rated else [])}
        reasons = set()
        if names & self.paused:
            reasons.add("paused")
        for n, lim in limits.items():
            taken = (
                self.mutex[n] is not None
                if lim == 1
                else len(self.limit_holders[n]) >= self._limit_of(n, lim)
            )
            if taken:
                reasons.add("limit")
        if rated and self.units >= 2:
            reasons.add("rate")
        if not reasons and self.mutex[primary] is not None:
            reasons.add("held")
        return reasons

    @precondition(lambda self: not all(self.holding))
    @rule(i=OBJECTS)
    def acquire(self, i: int) -> None:
        if self.holding[i]:
            return
        expected = self._expected(i)
        got = self.locks[i].acquire(blocking=False)
        assert got is (not expected), (i, expected, self.locks[i].refusal)
        if got:
            primary, limits, rated = RUNS[i]
            self.mutex[primary] = i
            for name, lim in limits.items():
                if lim == 1:
                    self.mutex[name] = i
                else:
                    self.limit_holders[name].add(i)
            self.units += 1 if rated else 0
            self.holding[i] = True
            fences = self.locks[i].fences
            assert set(fences) == {primary, *limits}, fences
        elif expected == {"held"}:
            assert self.locks[i].refused_by == "", self.locks[i].refused_by
        else:
            assert self.locks[i].refusal in expected, (self.locks[i].refusal, expected)

    @rule(i=OBJECTS)
    def release(self, i: int) -> None:
        if not self.holding[i]:
            return
        self.locks[i].release()
        primary, limits, _ = RUNS[i]
        self.mutex[primary] = None
        for name, lim in limits.items():
            if lim == 1:
                self.mutex[name] = None
            else:
                self.limit_holders[name].discard(i)
        self.holding[i] = False

    @rule(name=NAMES)
    def pause(self, name: str) -> None:
        self._control(name, "pause", "model")
        self.paused.add(name)

    @rule(name=NAMES)
    def resume(self, name: str) -> None:
        self._control(name, "pause", None)
        self.paused.discard(name)

    @rule(n=st.integers(min_value=1, max_value=3))
    def set_limit(self, n: int) -> None:
        self._control("L", "limit", str(n))
        self.override = n

    @rule()
    def unset_limit(self) -> None:
        self._control("L", "limit", None)
        self.override = None

    @invariant()
    def backend_agrees_with_the_model(self) -> None:
        for name, holders in self.limit_holders.items():
            slot = Slot(permit_keys(name, self.prefix), 2)
            tokens = {h.token for h in self.store.holders(slot)}
            mine = {self.locks[i].token for i in holders}
            assert tokens == mine, (name, len(tokens), len(mine))
        for name, holder in self.mutex.items():
            found = self.store.holders(Slot(lock_keys(name, self.prefix)))
            expect = [] if holder is None else [self.locks[holder].token]
            assert [h.token for h in found] == expect, name

    def teardown(self) -> None:
        for i, lock in enumerate(self.locks):
            if self.holding[i]:
                lock.release()
        if self.client is not None:
            self.client.close()
        else:
            self.store.clear()


def _model_tests(backend: str, examples: int) -> type:
    machine = type(f"FlowModel_{backend}", (FlowModel,), {"backend": backend})

    class Case(machine.TestCase):  # type: ignore[name-defined,misc]
        @pytest.fixture(autouse=True)
        def _server(self, request: pytest.FixtureRequest) -> Iterator[None]:
            if backend == "redis":
                server = request.getfixturevalue("shared_redis")
                if server.paused:
                    server.resume()
                if not server.alive():
                    server.restart()
                machine.server = server
            yield
            machine.server = None

    Case.settings = settings(
        max_examples=examples,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    Case.__name__ = Case.__qualname__ = f"Test{backend.title()}FlowModel"
    return Case


# memory:// runs the same Lua scripts as Redis (on fakeredis): as many examples as Redis.
TestMemoryFlowModel = _model_tests("memory", 40)
TestRedisFlowModel = _model_tests("redis", 40)
