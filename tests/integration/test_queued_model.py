"""A stateful property test of one name's queued hold and run lock: random sequences of
what publishers, workers and the worker's main process do, checked step by step against
a small reference model, on the memory backend and on Redis.

Three task ids (``a``, ``b``, ``c``) go through: a publish's claim on each
``lock_on_duplicate`` policy's terms (``replace``, ``running_blocks``), a worker's
hand-over (``RunLock(handover=Handover(t, strict))``: strict for a first delivery, not for
a retry), the run's release, a gone run kept for its redelivered copy
(``QueuedHold.keep_for_redelivery``), and a message's give-back of its hold (``release``).
The model knows the queued hold's owner and the lock's state (free, a run of a task id,
or a run of a task id kept for its copy); it predicts each outcome (queued, replaced,
duplicate of whom in which state; acquired, refused, superseded; kept or not) and that
fences only rise. The first disagreement fails, and hypothesis shrinks it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from servers import RedisServer

from celery_redlock.core import Handover, LockLost, QueuedHold, RunLock, connect
from celery_redlock.core.admin import read_lock

PREFIX = "redlock:"
TTL = 60.0  # nothing expires under the model
TASKS = st.sampled_from(["a", "b", "c"])


class QueuedModel(RuleBasedStateMachine):
    """One name's queued hold and lock against the reference model (see the module doc)."""

    #: "memory" or "redis".
    backend: ClassVar[str] = "memory"
    server: ClassVar[RedisServer | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.name = f"qmodel:{uuid.uuid4().hex[:16]}"
        self.client: Any = None
        if self.backend == "memory":
            self.target: Any = connect(f"memory://qmodel-{uuid.uuid4().hex}")
        else:
            assert self.server is not None
            self.client = self.target = self.server.client()
        self.hold = QueuedHold(self.target, self.name)
        #: The model: the queued hold's owner, the lock's owner and whether it is kept.
        self.queued: str | None = None
        self.owner: str | None = None
        self.kept = False
        #: The RunLock that holds the lock for its task id (None once kept or released).
        self.run: RunLock | None = None
        self.top_fence = 0

    # -- a publish ---------------------------------------------------------------------------
    @rule(t=TASKS, replace=st.booleans(), running_blocks=st.booleans())
    def claim(self, t: str, replace: bool, running_blocks: bool) -> None:
        found = self.hold.claim(t, TTL, replace=replace, running_blocks=running_blocks)
        q = self.queued
        if q is not None and q != t:
            if not replace:
                assert (found.outcome, found.owner, found.state) == ("duplicate", q, "queued")
                return
            assert (found.outcome, found.owner) == ("replaced", q)
            self.queued = t
            return
        if q is None and running_blocks and self.owner is not None and self.owner != t:
            state = "queued" if self.kept else "running"
            assert (found.outcome, found.owner, found.state) == ("duplicate", self.owner, state)
            return
        assert found.outcome == "queued", found
        self.queued = t

    # -- a worker ------------------------------------------------------------------------------
    @rule(t=TASKS, strict=st.booleans())
    def hand_over(self, t: str, strict: bool) -> None:
        lock = RunLock(
            self.target,
            self.name,
            TTL,
            handover=Handover(t, strict=strict),
            auto_renew=False,
            owner_info={"task_id": t},
        )
        got = lock.acquire(blocking=False)
        taking_kept = self.kept and self.owner == t
        if self.owner is not None and not taking_kept:
            assert got is False and not lock.superseded
            return
        if not taking_kept and strict and self.queued not in (None, t):
            assert got is False and lock.superseded and lock.queued_owner == self.queued
            return
        assert got is True, (t, strict, self.queued, self.owner, self.kept)
        assert lock.fence is not None and lock.fence > self.top_fence
        self.top_fence = lock.fence
        self.owner, self.kept, self.run = t, False, lock
        if self.queued == t:
            self.queued = None

    @rule()
    def release(self) -> None:
        if self.run is None:
            return
        self.run.release()
        self.owner, self.run = None, None

    # -- the worker's main process ---------------------------------------------------------------
    @rule(t=TASKS)
    def keep_for_redelivery(self, t: str) -> None:
        kept = self.hold.keep_for_redelivery(t, TTL, pid=os.getpid())
        expected = self.owner == t and not self.kept
        assert kept is expected, (t, self.owner, self.kept)
        if kept:
            assert self.run is not None
            gone = self.run
            self.kept, self.run = True, None
            with pytest.raises(LockLost):  # the gone run's token holds nothing now
                gone.release()

    # -- a message that does not run ------------------------------------------------------------
    @rule(t=TASKS)
    def give_back(self, t: str) -> None:
        assert self.hold.release(t) is (self.queued == t)
        if self.queued == t:
            self.queued = None

    # -- what must hold after every step --------------------------------------------------------
    @invariant()
    def backend_agrees_with_the_model(self) -> None:
        infos = read_lock(self.target, PREFIX, self.name)
        queued = [i for i in infos if i.key.endswith(":queued")]
        locks = [i for i in infos if not i.key.endswith(":queued")]
        assert [i.record.get("task_id") for i in queued] == (
            [] if self.queued is None else [self.queued]
        )
        assert [i.record.get("task_id") for i in locks] == (
            [] if self.owner is None else [self.owner]
        )
        if locks:
            assert locks[0].state == ("queued" if self.kept else "held"), locks[0].state

    def teardown(self) -> None:
        if self.client is not None:
            self.client.close()
        else:
            self.target.clear()


def _cases(backend: str, examples: int, server: str | None) -> type:
    machine = type(f"QueuedModel_{backend}", (QueuedModel,), {"backend": backend})

    class Case(machine.TestCase):  # type: ignore[name-defined,misc]
        @pytest.fixture(autouse=True)
        def _server(self, request: pytest.FixtureRequest) -> Iterator[None]:
            found = None if server is None else request.getfixturevalue(server)
            if found is not None and found.paused:
                found.resume()
            if found is not None and not found.alive():
                found.restart()
            machine.server = found
            yield
            machine.server = None

    Case.settings = settings(
        max_examples=examples,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    Case.__name__ = Case.__qualname__ = f"Test{backend.title()}QueuedModel"
    return Case


# Up to 30 steps an example, new sequences each run (a failing one is replayed first); a
# memory:// step runs its Lua script in this process (fakeredis), slower than Redis.
TestMemoryQueuedModel = _cases("memory", 50, None)
TestRedisQueuedModel = _cases("redis", 50, "shared_redis")
