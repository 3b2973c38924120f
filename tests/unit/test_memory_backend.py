"""The memory backend's verbs, without a server: the Lua scripts of the Redis backend on
the in-process server of ``connect("memory://...")``: exclusion, leases, fences, releases,
notices, permits, rate grants, stores per URL, what a forked child sees, and the error
that says how to install the engine when it is missing."""

from __future__ import annotations

import json
import os
import select
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from freezegun import freeze_time
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redlock.core import connect, open_backend
from celery_redlock.core.backend_types import Handover, Renewal, Slot, Status, Superseded
from celery_redlock.core.errors import ConfigError
from celery_redlock.core.keys import LockKeys, lock_keys, permit_keys, rate_key

RECORD = json.dumps({"hostname": "here", "pid": 1})


def memory(name: str) -> Any:
    """The memory backend of ``memory://<name>``, as a primitive opens it."""
    return open_backend(connect(f"memory://{name}"))


@pytest.fixture
def store() -> Iterator[Any]:
    """A store of its own for each test."""
    backend = memory(f"test-{uuid.uuid4().hex}")
    yield backend
    backend.clear()


def lock(name: str = "job") -> Slot:
    return Slot(lock_keys(name))


def take(
    store: Any,
    slot: Slot,
    token: str,
    ttl_ms: int = 10_000,
    *,
    fence_ttl_ms: int = 0,
) -> bool:
    return store.acquire(
        slot, token, ttl_ms, RECORD, wait=False, fence_ttl_ms=fence_ttl_ms
    ).acquired


def run_threads(count: int, target: Callable[[], None], seconds: float = 30.0) -> None:
    threads = [threading.Thread(target=target, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds)
        assert not thread.is_alive()


def hold_in_16_threads(
    store: Any, slot: Slot, rounds: int, while_held: Callable[[], list[str]] = list
) -> tuple[int, int, list[str]]:
    """16 threads each try *slot* *rounds* times, a token of its own each time; a thread
    granted it counts itself in, runs *while_held*, counts itself out and releases. The
    grants, the most holders at once, and the errors: each own release refused, and what
    *while_held* returned."""
    guard = threading.Lock()
    inside, most, wins, errors = [0], [0], [0], list[str]()

    def worker() -> None:
        me = f"t{threading.get_ident()}"
        for i in range(rounds):
            token = f"{me}-{i}"
            if not take(store, slot, token):
                continue
            with guard:
                inside[0] += 1
                wins[0] += 1
                most[0] = max(most[0], inside[0])
            errors.extend(while_held())
            with guard:
                inside[0] -= 1
            if store.release(slot, token, 1000) is not Status.OK:
                errors.append("own release refused")

    run_threads(16, worker)
    return wins[0], most[0], errors


def test_one_holder_at_a_time_across_16_threads(store: Any) -> None:
    """16 threads hammering one lock never find two holders, and each owner check holds."""
    slot = lock()

    def strangers_refused() -> list[str]:
        errors = []
        if store.release(slot, "not-mine", 1000) is Status.OK:
            errors.append("a stranger released it")
        if store.extend(slot, "not-mine", 1000, replace=True) is not Status.TAKEN:
            errors.append("a stranger extended it")
        return errors

    wins, most, errors = hold_in_16_threads(store, slot, 100, strangers_refused)
    assert errors == []
    assert most == 1, "two holders"
    assert wins > 16


def test_a_lease_expires_on_the_clock(store: Any) -> None:
    """A lease holds until its ttl has passed, then another owner takes it; the old owner's
    release and extend then find it taken."""
    slot = lock()
    with freeze_time("2024-01-01") as clock:
        assert take(store, slot, "a", ttl_ms=1000)
        clock.tick(timedelta(milliseconds=999))
        grant = store.acquire(slot, "b", 1000, RECORD, wait=False, fence_ttl_ms=0)
        assert not grant.acquired and grant.holder_ttl_ms == 1
        assert grant.holder == {"hostname": "here", "pid": 1}
        clock.tick(timedelta(milliseconds=2))
        assert not store.locked(slot)
        assert take(store, slot, "b")
        assert store.release(slot, "a", 1000) is Status.TAKEN
        assert store.extend(slot, "a", 1000, replace=False) is Status.TAKEN
        assert store.extend(slot, "b", 500, replace=False) == 10_500
        assert [h.token for h in store.holders(slot)] == ["b"]


def test_fences_strictly_increase_also_after_the_counter_expired(store: Any) -> None:
    """Each acquisition's fence is above the last, a re-sent acquire gets its own fence
    again, and a counter gone idle restarts above anything it had counted to."""
    slot, fences = lock(), list[int | None]()
    with freeze_time("2024-01-01") as clock:
        for i in range(5):
            first = store.acquire(slot, f"t{i}", 1000, RECORD, wait=False, fence_ttl_ms=60_000)
            again = store.acquire(slot, f"t{i}", 1000, RECORD, wait=False, fence_ttl_ms=60_000)
            assert first.acquired and again.acquired and first.fence == again.fence
            fences.append(first.fence)
            assert store.release(slot, f"t{i}", 1000) is Status.OK
        clock.tick(timedelta(seconds=61))  # the counter expires
        grant = store.acquire(slot, "late", 1000, RECORD, wait=False, fence_ttl_ms=60_000)
        fences.append(grant.fence)
        assert store.raise_fence(slot, (grant.fence or 0) + 10, 60_000) == (grant.fence or 0) + 10
        store.release(slot, "late", 1000)
        fences.append(
            store.acquire(slot, "next", 1000, RECORD, wait=False, fence_ttl_ms=60_000).fence
        )
    numbers = [f for f in fences if f is not None]
    assert len(numbers) == 7 and numbers == sorted(set(numbers))  # strictly increasing
    assert numbers[-1] == numbers[-2] + 11


def test_a_resent_release_is_ok_a_forced_or_taken_one_is_not(store: Any) -> None:
    """A re-sent copy of a release is OK while remembered; after a forced release the holder
    hears GONE, after a takeover TAKEN; a forced release remembers no token."""
    slot = lock()
    with freeze_time("2024-01-01") as clock:
        assert take(store, slot, "a")
        assert store.release(slot, "a", 1000) is Status.OK
        assert store.release(slot, "a", 1000) is Status.OK  # re-sent
        assert take(store, slot, "b")
        assert store.release(slot, "a", 1000) is Status.OK  # re-sent, b holds it now
        assert store.release(slot, "b", 1000) is Status.OK
        clock.tick(timedelta(milliseconds=1001))
        assert store.release(slot, "a", 1000) is Status.GONE  # forgotten

        assert take(store, slot, "c")
        assert store.force_release(slot, None, 1000).outcome == "released"
        assert store.release(slot, "c", 1000) is Status.GONE

        assert take(store, slot, "d", ttl_ms=100)
        clock.tick(timedelta(milliseconds=101))
        assert take(store, slot, "e")
        assert store.release(slot, "d", 1000) is Status.TAKEN
        assert store.force_release(slot, 999, 1000).outcome == "refused"


def test_wait_wakes_on_release_and_times_out_otherwise(store: Any) -> None:
    """A blocked waiter wakes within milliseconds of the release; with no release (or no
    waiter mark, so no notice) it waits out its time."""
    slot = lock()
    assert take(store, slot, "holder")
    woke: list[float] = []

    def waiter() -> None:
        grant = store.acquire(slot, "waiter", 10_000, RECORD, wait=True, fence_ttl_ms=0)
        assert not grant.acquired
        store.wait(slot, 5.0, grant)
        woke.append(time.monotonic())

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.05)
    released = time.monotonic()
    assert store.release(slot, "holder", 1000) is Status.OK
    thread.join(5.0)
    assert woke and woke[0] - released < 0.02

    started = time.monotonic()
    store.wait(slot, 0.1)  # the notice was taken: nothing to wake this one
    assert 0.1 <= time.monotonic() - started < 1.0

    other = lock("unmarked")
    assert take(store, other, "x")
    assert store.release(other, "x", 1000) is Status.OK  # nobody marked: no notice
    started = time.monotonic()
    store.wait(other, 0.05)
    assert time.monotonic() - started >= 0.05


def test_permits_never_exceed_the_limit_under_threads(store: Any) -> None:
    """16 threads taking 3 permits never hold more than 3 at once."""
    slot = Slot(permit_keys("pool"), limit=3)
    _, most, errors = hold_in_16_threads(store, slot, 100)
    assert errors == []
    assert 1 <= most <= 3, f"{most} held"
    assert store.holders(slot) == []


def test_gcra_grants_at_most_rate_plus_burst_minus_one_per_period(store: Any) -> None:
    """At 5/s with a burst of 3, any one-second window sees at most 7 grants, a refusal
    consumes nothing, and peek never writes."""
    key, interval = rate_key("api"), 200_000
    grants: list[float] = []
    with freeze_time("2024-01-01") as clock:
        start = time.monotonic()
        for _ in range(300):  # 3 s in 10 ms steps, asking until refused each time
            for _ in range(10):
                if not store.rate("api", key, interval, 3, mode="take"):
                    break
                grants.append(time.monotonic() - start)
            clock.tick(timedelta(milliseconds=10))
        assert store.rate("api", key, interval, 3, mode="peek").granted
        assert store.rate("api", key, interval, 3, mode="peek").granted
    assert grants[:3] == [0.0, 0.0, 0.0]
    for first in grants:
        assert sum(1 for t in grants if first <= t < first + 1.0) <= 5 + 3 - 1
    assert len(grants) >= 3 * 5


@settings(max_examples=25, deadline=None)  # 50-200 calls each, under freezegun
@given(
    burst=st.integers(1, 3),
    steps=st.lists(
        st.tuples(st.integers(0, 60), st.sampled_from(["take", "queue"])), min_size=50, max_size=200
    ),
)
def test_the_line_and_its_grace_never_let_more_through_than_the_rate(
    burst: int, steps: list[tuple[int, str]]
) -> None:
    """Any mix of take and queue calls, at any spacing, with promised slots claimed or
    lapsing: at 10/s with burst b, any one-second window holds at most 10 + b - 1 grants,
    and a refusal's wait is never negative."""
    store = memory("rate-property")
    key, interval = rate_key("prop"), 100_000
    grants: list[int] = []
    try:
        with freeze_time("2024-01-01") as clock:
            now_ms = 0
            for pause_ms, mode in steps:
                clock.tick(timedelta(milliseconds=pause_ms))
                now_ms += pause_ms
                grant = store.rate("prop", key, interval, burst, mode=mode, grace_us=25_000)
                assert grant.retry_after >= 0
                if grant:
                    grants.append(now_ms)
    finally:
        store.clear()
    for first in grants:
        assert sum(1 for t in grants if first <= t < first + 1000) <= 10 + burst - 1


def test_queue_mode_promises_one_slot_per_caller(store: Any) -> None:
    """Refused callers in queue mode are promised successive slots, no further than most_us."""
    key = rate_key("line")
    with freeze_time("2024-01-01"):
        assert store.rate("line", key, 100_000, 1, mode="queue").granted
        waits = [store.rate("line", key, 100_000, 1, mode="queue").retry_after for _ in range(3)]
        assert waits == pytest.approx([0.1, 0.2, 0.3])
        refused = store.rate("line", key, 100_000, 1, mode="queue", most_us=150_000)
        assert not refused.granted and refused.retry_after == pytest.approx(0.4)
        info = store.read_rate("redlock:", "line")
        assert info is not None and info.queued == 3 and info.rate == "10/s"


def test_a_promised_slot_unclaimed_past_its_grace_lapses_to_a_newcomer(
    store: Any,
) -> None:
    """A slot promised to a caller that does not come: a queue-mode newcomer is put behind
    the line until the grant has been possible for the grace, and takes it after; the
    late caller then finds its slot gone and the next one a whole interval later."""
    key = rate_key("lapse")
    step, grace = 100_000, 25_000
    with freeze_time("2024-01-01") as clock:
        assert store.rate("lapse", key, step, 1, mode="queue", grace_us=grace).granted
        promised = store.rate("lapse", key, step, 1, mode="queue", grace_us=grace)
        assert not promised.granted and promised.retry_after == pytest.approx(0.1)
        clock.tick(timedelta(milliseconds=110))  # the slot is free, for 10 ms only
        early = store.rate("lapse", key, step, 1, mode="queue", grace_us=grace)
        assert not early.granted and early.retry_after == pytest.approx(0.09)
        clock.tick(timedelta(milliseconds=20))  # free for 30 ms: past the grace
        newcomer = store.rate("lapse", key, step, 1, mode="queue", grace_us=grace)
        assert newcomer.granted
        late = store.rate("lapse", key, step, 1, mode="take", grace_us=grace)
        assert not late.granted and late.retry_after == pytest.approx(0.1)


def test_each_url_is_one_store() -> None:
    """The same URL gives the same store, another URL another one; a Lock opened on a URL
    sees what the other connect() of that URL holds."""
    a, b = memory("a"), memory("b")
    try:
        assert connect("memory://a") is a
        assert a.identity() == ("memory", "memory://a") and a.describe() == "memory://a"
        assert take(a, lock("shared"), "x")
        assert a.locked(lock("shared"))
        assert not b.locked(lock("shared"))
        assert take(b, lock("shared"), "y")
        assert [h.token for h in memory("a").holders(lock("shared"))] == ["x"]
    finally:
        a.clear()
        b.clear()


@pytest.mark.parametrize("missing", ["fakeredis", "lupa"])
def test_without_the_testing_extra_memory_urls_say_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    """With fakeredis (or lupa, its Lua engine) not importable, connect("memory://...")
    raises a ConfigError that names what is missing and gives the install line."""
    monkeypatch.setitem(sys.modules, missing, None)  # an import of it raises ImportError
    with pytest.raises(ConfigError, match=r"fakeredis.*pip install 'celery-redlock\[testing\]'"):
        connect(f"memory://no-extra-{uuid.uuid4().hex}")


def test_a_forked_child_starts_with_an_empty_store() -> None:
    """A forked child sees none of its parent's locks and takes them freely; the parent
    still holds its lock afterwards and never sees the child's."""
    backend, slot = memory("fork"), lock("forked")
    try:
        assert take(backend, slot, "parent")
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running the parent's cleanup
            try:
                report = {
                    "holders": len(memory("fork").holders(slot)),
                    "took": take(backend, slot, "child"),
                    "keys": len(backend.scan("redlock:")),
                }
                os.write(write_end, json.dumps(report).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        ready, _, _ = select.select([read_end], [], [], 10.0)
        seen = json.loads(os.read(read_end, 4096)) if ready else None
        os.close(read_end)
        deadline = time.monotonic() + 10.0
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert seen == {"holders": 0, "took": True, "keys": 1}
        assert [h.token for h in backend.holders(slot)] == ["parent"]
    finally:
        backend.clear()


def test_foreign_data_at_a_lock_key(store: Any) -> None:
    """A key of another kind than a verb expects is FOREIGN for owner-checked verbs and a
    ConfigError for the others; renew answers one status per item."""
    mine = lock("m")
    assert take(store, mine, "a")
    assert store.release_done(mine, "a", 1000, "task-1", 60_000) is Status.OK
    keys = lock_keys("m")
    # A lock whose key is where the done marks (a sorted set) are: foreign data.
    foreign = Slot(LockKeys("odd", keys.done, keys.fence + "x", keys.notify, keys.waiting))
    assert store.release(foreign, "a", 1000) is Status.FOREIGN
    assert store.extend(foreign, "a", 1000, replace=True) is Status.FOREIGN
    with pytest.raises(ConfigError):
        take(store, foreign, "a")
    with pytest.raises(ConfigError):
        store.holders(foreign)
    with pytest.raises(ConfigError):
        store.load_records(mine, "fence")  # the fence counter is a string
    assert take(store, mine, "b")
    items = [
        Renewal(mine, "b", 5000),
        Renewal(lock("none"), "b", 5000),
        Renewal(mine, "c", 5000),
        Renewal(foreign, "b", 5000),
    ]
    assert store.renew(items) == [Status.OK, Status.GONE, Status.TAKEN, Status.FOREIGN]


def test_done_marks_keep_the_16_most_recent(store: Any) -> None:
    """A release with a done mark adds it; the 16 most recent are kept."""
    slot = lock("d")
    for i in range(20):
        assert take(store, slot, f"t{i}")
        assert store.release_done(slot, f"t{i}", 1000, f"mark-{i}", 60_000) is Status.OK
    assert not store.was_done(slot, "mark-3")
    assert all(store.was_done(slot, f"mark-{i}") for i in range(4, 20))


def test_an_enqueue_time_hold_is_handed_over(store: Any) -> None:
    """A queued hold blocks another id, is handed over to its own task's run, and a run of
    another id is refused as superseded."""
    slot = lock("q")
    assert (
        store.enqueue(slot, "id1", 10_000, RECORD, replace=False, running_blocks=True).outcome
        == "queued"
    )
    dup = store.enqueue(slot, "id2", 10_000, RECORD, replace=False, running_blocks=True)
    assert (dup.outcome, dup.owner, dup.state) == ("duplicate", "id1", "queued")
    other = store.take_over(slot, "t2", 1000, RECORD, Handover("id2"), wait=False, fence_ttl_ms=0)
    assert isinstance(other, Superseded) and other.queued_owner == "id1"
    own = store.take_over(slot, "t1", 1000, RECORD, Handover("id1"), wait=False, fence_ttl_ms=0)
    assert own.acquired
    [info] = store.read("redlock:", "q")
    assert info.state == "held" and info.fence == own.fence
    running = store.enqueue(slot, "id3", 10_000, RECORD, replace=False, running_blocks=True)
    assert (running.outcome, running.owner, running.state) == ("duplicate", "id1", "running")
    assert store.dequeue(slot, "id1") is Status.GONE


def test_a_notice_waits_for_the_next_waiter_until_it_expires(store: Any) -> None:
    """A notice sent while nobody waits is kept for notice_ms; permits send one per permit
    given back."""
    slot = lock("n")
    assert take(store, slot, "a")
    assert not store.acquire(slot, "b", 1000, RECORD, wait=True, fence_ttl_ms=0).acquired
    assert store.release(slot, "a", 50) is Status.OK
    started = time.monotonic()
    store.wait(slot, 5.0)  # the kept notice: at once
    assert time.monotonic() - started < 1.0
    assert take(store, slot, "a")
    assert store.release(slot, "a", 50) is Status.OK  # the mark still stands
    time.sleep(0.06)
    started = time.monotonic()
    store.wait(slot, 0.05)  # the notice expired
    assert time.monotonic() - started >= 0.05

    permits = Slot(permit_keys("p"), limit=3)
    for token in ("x", "y", "z"):
        assert take(store, permits, token)
    assert not store.acquire(permits, "w", 1000, RECORD, wait=True, fence_ttl_ms=0).acquired
    for token in ("x", "y", "z"):
        assert store.release(permits, token, 5000) is Status.OK
    started = time.monotonic()
    for _ in range(3):
        store.wait(permits, 5.0)
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    store.wait(permits, 0.05)
    assert time.monotonic() - started >= 0.05
