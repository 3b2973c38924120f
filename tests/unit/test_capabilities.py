"""The seam split by capability: a backend implements a capability or does not, a primitive
asks for one once, when it is built, and a lack is one ConfigError with one message
wherever it is asked (a primitive, a task option at worker start). No server: a quorum of
memory backends lacks what a quorum of Redis masters lacks."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from celery import Celery

from celery_redlock import LockedTask, QueuedHold, RateLimiter, Semaphore, connect
from celery_redlock.app.state import state_for
from celery_redlock.core import Handover, RunLock, open_backend
from celery_redlock.core.backend import (
    Admin,
    Backend,
    DoneMarks,
    InProcess,
    Permits,
    QueuedHolds,
    Rates,
    Records,
    Sendable,
    has,
    lacks,
    need,
)
from celery_redlock.core.backend_types import Grant, Holder, Renewal, Slot, Status
from celery_redlock.core.backends.redis import RedisBackend, verbs
from celery_redlock.core.errors import ConfigError, StoreUnavailable
from celery_redlock.worker.bootstep import check_locked_tasks


def _quorum_urls() -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"memory://cap-{tag}-{i}" for i in range(3)]


def test_each_backend_has_the_capabilities_it_can_keep() -> None:
    """One store (memory) has every capability; a quorum has the lock verbs, done marks
    and records, and neither permits, queued holds, rates nor operator verbs."""
    store = open_backend(connect("memory://cap-one"))
    quorum = open_backend(connect(_quorum_urls()))
    for capability in (Permits, QueuedHolds, DoneMarks, Rates, Records, Admin, InProcess):
        assert has(store, capability), capability
    for capability in (DoneMarks, Records):
        assert has(quorum, capability), capability
    for capability in (Permits, QueuedHolds, Rates, Admin, InProcess):
        assert not has(quorum, capability), capability
        with pytest.raises(ConfigError) as lacking:
            need(quorum, capability)
        assert str(lacking.value) == lacks(quorum, capability)


def test_a_missing_capability_is_one_message_wherever_it_is_asked() -> None:
    """Semaphore, RateLimiter, QueuedHold and a RunLock's hand-over on a quorum raise the
    ConfigError that need() gives, naming the backend and what it lacks; a worker start
    with a task option that needs it names the task and the option, then the same text."""
    urls = _quorum_urls()
    quorum = open_backend(connect(urls))
    asked = {
        Permits: lambda: Semaphore(connect(urls), "sem", 2),
        Rates: lambda: RateLimiter(connect(urls), "api", "5/s"),
        QueuedHolds: lambda: QueuedHold(connect(urls), "q"),
    }
    for capability, build in asked.items():
        with pytest.raises(ConfigError) as refused:
            build()
        assert str(refused.value) == lacks(quorum, capability)
        assert quorum.describe() in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        RunLock(connect(urls), "run", handover=Handover("t1"))
    assert str(refused.value) == lacks(quorum, QueuedHolds)

    app = Celery("caps", broker="memory://", set_as_current=False)
    app.conf.redlock_url = urls

    @app.task(base=LockedTask, lock_limit=3, shared=False)
    def pooled() -> None: ...

    @app.task(base=LockedTask, lock_rate="10/s", shared=False)
    def limited() -> None: ...

    @app.task(base=LockedTask, lock_on="enqueue", shared=False)
    def queued() -> None: ...

    app.finalize()
    with pytest.raises(ConfigError) as at_start:
        check_locked_tasks(app, state_for(app))
    message = str(at_start.value)
    for task, option, capability in (
        (pooled, "lock_limit=3", Permits),
        (limited, "lock_rate='10/s'", Rates),
        (queued, "lock_on='enqueue'", QueuedHolds),
    ):
        assert f"task {task.name!r}: {option}: {lacks(quorum, capability)}" in message


class _LockVerbsOnly:
    """A backend of someone else's with the lock verbs only (over a memory store)."""

    masters = 1

    def __init__(self) -> None:
        self.inner = open_backend(connect(f"memory://verbs-{uuid.uuid4().hex}"))

    def describe(self) -> str:
        return "a store of the lock verbs only"

    def acquire(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int,
        deadline: float | None = None,
    ) -> Grant:  # fmt: skip
        return self.inner.acquire(slot, token, ttl_ms, record, wait=wait, fence_ttl_ms=fence_ttl_ms)

    def release(self, slot: Slot, token: str, notice_ms: int) -> Status:
        return self.inner.release(slot, token, notice_ms)

    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        return self.inner.extend(slot, token, ms, replace=replace)

    def renew(self, items: Sequence[Renewal]) -> list[Status | StoreUnavailable]:
        return self.inner.renew(items)

    def wait(self, slot: Slot, seconds: float, refused: Grant | None = None) -> None:
        self.inner.wait(slot, seconds, refused)

    def holders(self, slot: Slot) -> list[Holder]:
        return self.inner.holders(slot)

    def locked(self, slot: Slot) -> bool:
        return self.inner.locked(slot)


def test_a_backend_of_someone_elses_gets_what_it_implements() -> None:
    """A class with the lock verbs only is a Backend: a Lock runs on it, and every other
    capability is refused naming it (structural, no registration)."""
    from celery_redlock import Lock  # noqa: PLC0415

    verbs: Any = _LockVerbsOnly()
    assert isinstance(verbs, Backend)
    with Lock(verbs, "mine", ttl=5, auto_renew=False) as lock:
        assert lock.fence is not None and lock.locked()
    for capability in (Permits, QueuedHolds, DoneMarks, Rates, Records, Admin):
        assert not has(verbs, capability)
    with pytest.raises(ConfigError, match="are not available on a store of the lock verbs only"):
        Semaphore(verbs, "pool", 2)
    assert Semaphore(verbs, "pool", 1, ttl=5, auto_renew=False).acquire(blocking=False)


class _Forwarding:
    """A stub that forwards every verb to a memory store (as test doubles often do)."""

    masters = 1

    def __init__(self) -> None:
        self.inner = open_backend(connect(f"memory://forward-{uuid.uuid4().hex}"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_forwarding_stub_implements_what_it_forwards() -> None:
    """Capabilities are looked up as attribute access does, so a stub forwarding its verbs
    with __getattr__ has them on every Python (isinstance against a runtime protocol looks
    members up statically from Python 3.12 on)."""
    stub: Any = _Forwarding()
    for capability in (QueuedHolds, DoneMarks, Rates, Records, Admin, InProcess):
        assert has(stub, capability), capability
    assert RateLimiter(stub, "api", "5/s").acquire()


def test_each_sendable_verb_is_a_seam_method_that_the_redis_backend_can_send() -> None:
    """A verb sent now and answered later is one of a closed set (not a free string):
    each names the method a backend runs when it does not send it, and the Redis backend
    builds each one's script call."""
    assert set(verbs.SENDABLE) == set(Sendable)
    for verb in Sendable:
        method = verb.on(RedisBackend)
        assert method is getattr(RedisBackend, verb.value), verb
        assert verbs.SENDABLE[verb].__name__ == verb.value, verb
