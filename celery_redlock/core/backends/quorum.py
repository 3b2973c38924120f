"""``QuorumBackend``: one lock over N independent backends, held by a majority (Redlock).

It speaks only the members' verbs (:class:`~celery_redlock.core.backend.Backend`):
Redis backends in production, memory backends in tests. How one acquire goes (``n``
members, quorum ``q = n // 2 + 1``)::

    acquire on every member at once     the wait ends when q granted or every member
                                        answered, at the latest after the per-node
                                        timeout
    >= q granted -> fence = max(fences); raise the lower counters to it until a quorum
                    holds >= fence (raise_fence)
    otherwise    -> release wherever this token may hold (members that did not answer
                    included: chained behind their unanswered acquire), then
                    fewer than q answered -> QuorumUnavailable
                    one holder may own q  -> the caller waits for its release notice
                                             (on one of its members), capped at its lease
                    split vote            -> the caller retries after a short random delay

The caller (:class:`~celery_redlock.core.lock.Lock`) measures validity from before
the first request: ``ttl - elapsed - drift``.

Why fences keep increasing across different quorums (a timeline)::

    counters  m0=100  m1=5   m2=50
    A takes m1, m2 (m0 down): fences 6, 51 -> A's fence is 51; m1 is raised to 51
    B takes m0, m1 (m2 down): fences 101, 52 -> B's fence is 101; m1 is raised to 101
    C takes m1, m2 (m0 down): fences 102, 52 -> C's fence is 102
    Two majorities always share a member, and that member's counter already holds
    the previous holder's fence, so the next increment there is larger. Without the
    write-back C would get 52 < 101. (This needs counters that survive restarts:
    see docs/redlock.md.)

How a verb travels (:class:`_Round`). Each member's call runs in the process's pool
(:func:`~celery_redlock.core.threads.submit`); the caller waits until the outcome is
decided, every member answered, or the timeout. A member's answer is its value, a
:class:`~.errors.QuorumUnavailable` (it is down: no answer), a
:class:`~.errors.ConfigError` (foreign data), or :class:`NoAnswer`. Any other error
(a client whose pool is exhausted, a wrong argument, a bug) is raised to the caller as
it is, never counted as a member being down. Calls to one member take turns
(:class:`_Gate`): one of ours runs on a member at a time, and a member stuck in a call
longer than a round's timeout is not sent more until it returns (it counts as not
answering), so a stalled member ties up one thread.

A release that undoes an acquire never overtakes it: where the acquire still runs,
the release is chained behind it. A grant that outlives its release on a slow member
(the release did not get through in time) lives on that minority until its lease
ends: it can delay the next holder there, never let two hold a majority.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import json
import random
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from .. import process, threads
from ..backend import (
    Backend,
    Claim,
    ForceRelease,
    Grant,
    Handover,
    Holder,
    LockInfo,
    Queued,
    RateGrant,
    RateInfo,
    Renewal,
    Slot,
    Status,
    newest_records,
    record_version,
)
from ..errors import (
    RATE_ON_QUORUM,
    SEMAPHORE_ON_QUORUM,
    ConfigError,
    QuorumUnavailable,
    describe_holder,
    no_queued_holds,
)

__all__ = [
    "ADMIN_TIMEOUT",
    "FIRST_CONTACT",
    "GRACE",
    "MIN_TIMEOUT",
    "READ_TIMEOUT",
    "NoAnswer",
    "QuorumBackend",
]

#: Per-member timeout of reads and records (no lease to take 5% of) when none is set.
READ_TIMEOUT = 0.25
#: Per-member timeout of operator reads and forced releases (a scan walks every key).
ADMIN_TIMEOUT = 10.0
#: The shortest per-member timeout of a lease, whatever its TTL.
MIN_TIMEOUT = 0.05
#: How many timeouts a member this process never heard from is waited for: its first
#: call connects and shakes hands (TLS, AUTH) before it answers.
FIRST_CONTACT = 3
#: After the outcome is decided, how long answers already on their way are still taken
#: (they tell the caller which masters it holds).
GRACE = 0.002


class NoAnswer(Exception):
    """A member did not answer in time, or was not asked (still busy with earlier calls)."""


_PENDING = NoAnswer("not heard from")
_T = TypeVar("_T")
Call = Callable[[Backend], Any]
Decided = Callable[[Sequence[Any]], bool]


class _Gate:
    """One member's calls, one at a time and in order, in this process.

    A caller does not wait for every master: it goes on at a majority, and the slowest
    master may still run the last call when the next one comes. Calls to one member
    queue here behind the one running (each dropped unrun if its round gave up on it
    meanwhile), and one pool thread runs them, so a client never has more than one
    call of ours running (a pool that allows 2 connections serves a Redlock and a
    waiter) and a member that stops answering ties up one thread, not the pool. A
    member whose call has run longer than a round's timeout is stuck (silent,
    paused): it is sent nothing more until that call returns. One gate per member
    backend, shared by every quorum that has it (a Redlock made for each call builds
    a new quorum over the same masters, whose backends are shared per client).
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._queue: deque[tuple[Call, Backend, float, cf.Future[Any]]] = deque()
        self._running = False  # a pool thread is running the queue
        self._since = 0.0  # when the running call started (0.0: between calls)
        self.heard = False  # answered once: connected, scripts loaded

    @property
    def calls(self) -> int:
        """Calls queued or running."""
        return len(self._queue) + (self._since > 0)

    def offer(self, call: Call, member: Backend, timeout: float) -> cf.Future[Any] | None:
        """Queue ``call(member)``, to run within *timeout* seconds or not at all: its
        future, or None when the running call has run longer than *timeout* (stuck)."""
        future: cf.Future[Any] = cf.Future()
        now = time.monotonic()
        with self._mutex:
            if self._since and now - self._since > timeout:
                return None
            self._queue.append((call, member, now + timeout, future))
            start = not self._running
            self._running = True
        if start:
            threads.submit(self._drain)
        return future

    def _drain(self) -> None:
        while True:
            with self._mutex:
                if not self._queue:
                    self._running = False
                    return
                call, member, deadline, future = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            if time.monotonic() > deadline:  # its round gave up on it: do not run it
                future.set_result(NoAnswer("not answering: still busy with an earlier call"))
                continue
            self._since = time.monotonic()
            try:
                value, error = call(member), None
            except BaseException as exc:  # handed to the round: raised there
                value, error = None, exc
            finally:
                # Before the future is resolved: a follow-up chained to it is offered from
                # this thread, and must not find this call still "running".
                self._since = 0.0
            if not isinstance(error, QuorumUnavailable):
                self.heard = True
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)


_gates: weakref.WeakKeyDictionary[Backend, _Gate] = weakref.WeakKeyDictionary()
_gates_lock = threading.Lock()


def _gate(member: Backend) -> _Gate:
    with _gates_lock:
        gate = _gates.get(member)
        if gate is None:
            gate = _gates[member] = _Gate()
        return gate


def _after_fork() -> None:
    global _gates, _gates_lock
    _gates = weakref.WeakKeyDictionary()  # a child has none of its parent's calls
    _gates_lock = threading.Lock()


process.on_fork(_after_fork)


class _Round:
    """``call(member)`` on the members *where* at once (see the module docstring)."""

    def __init__(
        self, quorum: QuorumBackend, call: Call, timeout: float, where: Iterable[int] | None = None
    ) -> None:
        self.quorum = quorum
        self.where = list(range(quorum.masters) if where is None else where)
        self.results: list[Any] = [_PENDING] * len(self.where)
        self.futures: dict[cf.Future[Any], int] = {}
        first = any(not _gate(quorum.members[i]).heard for i in self.where)
        self.timeout = timeout * (FIRST_CONTACT if first else 1)
        for pos, i in enumerate(self.where):
            future = quorum._start(i, call, self.timeout)
            if future is None:
                self.results[pos] = NoAnswer("not answering: still busy with an earlier call")
            else:
                self.futures[future] = pos

    def wait(self, decided: Decided) -> list[Any]:
        """Each member's answer once *decided(results)*, all answered, or the timeout."""
        deadline = time.monotonic() + self.timeout
        pending = set(self.futures)
        while pending and not decided(self.results):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done, pending = cf.wait(pending, timeout=left, return_when=cf.FIRST_COMPLETED)
            for future in done:
                self.results[self.futures[future]] = _outcome(future)
        if pending and time.monotonic() < deadline:  # decided: answers on their way still count
            done, pending = cf.wait(pending, timeout=GRACE)
            for future in done:
                self.results[self.futures[future]] = _outcome(future)
        late = time.monotonic() >= deadline
        for pos, value in enumerate(self.results):
            if value is _PENDING:
                why = f"no answer within {self.timeout * 1000:.0f} ms"
                self.results[pos] = NoAnswer(why if late else "not waited for")
        return self.results

    def then(self, follow: Call, positions: Iterable[int]) -> None:
        """*follow* (best effort) on those members after this round's call: chained
        behind a call still running, else at once (waited for up to the timeout)."""
        now: list[cf.Future[Any]] = []  # follow-ups started at once (the call had ended)
        sent = {pos: future for future, pos in self.futures.items()}
        for pos in positions:
            if pos in sent:  # (a member never asked, being busy, has nothing to follow)
                after = functools.partial(self._follow, self.where[pos], _quietly(follow), now)
                sent[pos].add_done_callback(after)  # runs at once if the call has ended
        cf.wait(list(now), timeout=self.timeout)

    def _follow(self, i: int, call: Call, started: list[cf.Future[Any]], _: object) -> None:
        future = self.quorum._start(i, call, self.timeout)
        if future is not None:
            started.append(future)


def _outcome(future: cf.Future[_T]) -> _T | Exception:
    """A member's value, or its QuorumUnavailable / ConfigError; anything else is raised."""
    try:
        return future.result()
    except (QuorumUnavailable, ConfigError) as exc:
        return exc


def _quietly(call: Call) -> Call:
    """*call* as a follow-up: where it fails, the lease it was meant to end expires."""

    def run(member: Backend) -> None:
        with contextlib.suppress(Exception):
            call(member)

    return run


class QuorumBackend:
    """Locks on a majority of independent member backends (Redlock).

    *per_node_timeout* bounds the wait for each member (default: 5% of a lease, at
    least 50 ms; :data:`READ_TIMEOUT` for reads and records). Quorums of equal members
    are equal (they share one renewal batch).
    """

    def __init__(self, members: Sequence[Backend], per_node_timeout: float | None = None) -> None:
        if isinstance(members, (str, bytes)) or not isinstance(members, Sequence) or not members:
            raise ConfigError("Redlock needs a non-empty list of backends, one per master")
        ids = [m.identity() for m in members]
        twice = sorted(
            {m.describe() for m, i in zip(members, ids, strict=True) if ids.count(i) > 1}
        )
        if twice:
            raise ConfigError(
                "Redlock masters must be distinct servers; listed more than once: "
                + ", ".join(twice)
            )
        if per_node_timeout is not None and (
            isinstance(per_node_timeout, bool)
            or not isinstance(per_node_timeout, (int, float))
            or not per_node_timeout > 0
        ):
            raise ConfigError(f"per_node_timeout must be > 0 seconds, got {per_node_timeout!r}")
        self.members: tuple[Backend, ...] = tuple(members)
        self.masters = len(self.members)
        self.quorum = self.masters // 2 + 1
        self.per_node_timeout = per_node_timeout
        #: Each member's name in errors and ``Grant.masters``.
        self.names = [m.describe() for m in self.members]

    def _start(self, i: int, call: Call, timeout: float) -> cf.Future[Any] | None:
        """``call(member i)`` in its turn (:class:`_Gate`), given up after *timeout*: its
        future, or None when the member is stuck in a call that ran longer than that.
        Follow-ups too: a follow-up not sent leaves a lease that expires by itself."""
        member = self.members[i]
        return _gate(member).offer(call, member, timeout)

    def in_flight(self, i: int) -> int:
        """Calls to member *i* queued or running (from any quorum that has it)."""
        return _gate(self.members[i]).calls

    def describe(self) -> str:
        """The members' addresses."""
        return ", ".join(self.names)

    def identity(self) -> tuple[Any, ...]:
        """The members' identities."""
        return tuple(m.identity() for m in self.members)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuorumBackend) and self.members == other.members

    def __hash__(self) -> int:
        return hash(self.members)

    def __repr__(self) -> str:
        return f"<QuorumBackend {self.quorum}/{self.masters}: {self.describe()}>"

    def timeout(self, ttl_ms: int | None) -> float:
        """How long to wait for each member: the set per-node timeout, else 5% of the
        lease (at least 50 ms), :data:`READ_TIMEOUT` without one."""
        if self.per_node_timeout is not None:
            return self.per_node_timeout
        return READ_TIMEOUT if ttl_ms is None else max(MIN_TIMEOUT, 0.05 * ttl_ms / 1000)

    # -- helpers ------------------------------------------------------------------------
    def _ask(self, call: Call, timeout: float, decided: Decided = lambda _: False) -> list[Any]:
        return _Round(self, call, timeout).wait(decided)

    def _gather(self, name: str, call: Call, timeout: float) -> list[Any]:
        """Every member's answer; raises unless at least a quorum answered."""
        results = self._ask(call, timeout)
        answers = [v for v in results if _answered(v)]
        if len(answers) < self.quorum:
            self._fail(name, results)
        return answers

    def _outcomes(self, results: Sequence[Any], ok: Callable[[Any], str]) -> dict[str, str]:
        return {
            m: ok(v) if _answered(v) else _said(v) for m, v in zip(self.names, results, strict=True)
        }

    def _unavailable(self, name: str, errors: Mapping[str, str]) -> QuorumUnavailable:
        return QuorumUnavailable(name, errors, needed=self.quorum, total=self.masters)

    def _fail(self, name: str, results: Sequence[Any]) -> NoReturn:
        """Too few answered: ConfigError naming the masters that found foreign data,
        else QuorumUnavailable."""
        foreign = [
            f"{m}: {v}"
            for m, v in zip(self.names, results, strict=True)
            if isinstance(v, ConfigError)
        ]
        if foreign:
            raise ConfigError(
                f"lock {name!r}: {len(foreign)} of {self.masters} masters refused: "
                + "; ".join(foreign)
            )
        raise self._unavailable(name, self._outcomes(results, lambda _: "answered"))

    # -- an acquisition's life --------------------------------------------------------
    def acquire(
        self,
        slot: Slot,
        token: str,
        ttl_ms: int,
        record: str,
        *,
        wait: bool,
        fence_ttl_ms: int,
        handover: Handover | None = None,
    ) -> Grant:
        """One Redlock attempt (see the module docstring)."""
        n, q, name = self.masters, self.quorum, slot.name
        if handover is not None:
            raise ConfigError(no_queued_holds(name, n))
        if slot.permits:
            raise ConfigError(f"semaphore {name!r}: {SEMAPHORE_ON_QUORUM}")
        timeout = self.timeout(ttl_ms)
        sent = _Round(
            self,
            lambda m: m.acquire(slot, token, ttl_ms, record, wait=wait, fence_ttl_ms=fence_ttl_ms),
            timeout,
        )

        def give_back(where: Iterable[int]) -> None:  # never before the acquire there
            sent.then(lambda m: m.release(slot, token, ttl_ms), where)

        try:
            # A refusal waits for every answer (up to the timeout): who holds what on
            # each member tells a holder with a majority from a split vote.
            results = sent.wait(lambda r: sum(1 for v in r if _granted(v)) >= q)
        except BaseException:  # a member's client-side error: raised, after a give-back
            give_back(range(n))
            raise
        fences = {i: v.fence or 0 for i, v in enumerate(results) if _granted(v)}
        outcomes = self._outcomes(results, _describe_grant)
        # Where this token may hold: granted, or sent without an answer (down, silent).
        maybe = [i for i, v in enumerate(results) if _granted(v) or _silent(v)]
        if len(fences) >= q:
            try:
                fence = self._settle_fence(slot, fences, fence_ttl_ms, timeout, outcomes)
            except BaseException:
                give_back(maybe)
                raise
            if fence is not None:
                return Grant(True, fence=fence, masters=outcomes)
            give_back(maybe)
            raise self._unavailable(name, outcomes)
        give_back(maybe)
        for i in fences:
            outcomes[self.names[i]] += ", given back"
        held = {i: v for i, v in enumerate(results) if isinstance(v, Grant) and not v.acquired}
        foreign = sum(1 for v in results if isinstance(v, ConfigError))
        if foreign:  # data under our keys that is not a lock: no retry mends it
            raise ConfigError(
                f"lock {name!r}: {foreign} of {n} masters refused the acquire on the data at "
                f"{slot.keys.lock!r} ({'; '.join(f'{m}: {o}' for m, o in outcomes.items())}): "
                "something other than celery-redlock writes under the lock key prefix"
            )
        if len(fences) + len(held) < q:
            # Too few members answered to decide anything: an outage, not contention.
            raise self._unavailable(name, outcomes)
        unknown = n - len(fences) - len(held)
        # Contention. Group the refusals by holder record (one per acquisition).
        groups = Counter(_record_key(g) for g in held.values())
        top, top_count = groups.most_common(1)[0]
        tops = [(i, g) for i, g in held.items() if _record_key(g) == top]
        top_ttls = [ms for _, g in tops if (ms := g.holder_ttl_ms) is not None and ms >= 0]
        if top_count + unknown >= q and top_ttls:
            wait_ms = max(1, min(top_ttls))  # that holder may own a majority: wait for it
        else:
            # A split vote: nobody has a majority. Retry after a short random delay (or
            # sooner, on a release notice from one of the other contenders).
            wait_ms = max(1, int(random.uniform(0.2, 1.0) * max(timeout, 0.01) * 1000))
            if top_ttls:
                wait_ms = min(wait_ms, max(1, min(top_ttls)))
        return Grant(
            False,
            holder=dict(tops[0][1].holder),
            holder_ttl_ms=min(top_ttls) if top_ttls else None,
            wait_ms=wait_ms,
            wait_on=tops[0][0],
            masters=outcomes,
        )

    def _settle_fence(
        self,
        slot: Slot,
        fences: Mapping[int, int],
        fence_ttl_ms: int,
        timeout: float,
        outcomes: dict[str, str],
    ) -> int | None:
        """Make a quorum hold a counter >= the chosen fence; return it, or None."""
        fence = max(fences.values())
        need = self.quorum - sum(1 for f in fences.values() if f == fence)
        if need <= 0:
            return fence
        lower = [i for i, f in fences.items() if f < fence]

        def raised(results: Sequence[Any]) -> int:
            return sum(1 for v in results if _answered(v) and v >= fence)

        call: Call = lambda m: m.raise_fence(slot, fence, fence_ttl_ms)  # noqa: E731
        results = _Round(self, call, timeout, lower).wait(lambda r: raised(r) >= need)
        if raised(results) >= need:
            return fence
        for i, value in zip(lower, results, strict=True):
            if not _answered(value):
                outcomes[self.names[i]] = f"acquired, but writing fence {fence} back failed "
                outcomes[self.names[i]] += f"({_said(value)})"
        return None

    def release(
        self, slot: Slot, token: str, notice_ms: int, done: tuple[str, int] | None = None
    ) -> Status:
        """OK when a quorum released; TAKEN/FOREIGN when no majority can be OK."""
        q = self.quorum
        results = self._ask(
            lambda m: m.release(slot, token, notice_ms, done),
            self.timeout(notice_ms),
            lambda r: r.count(Status.OK) >= q,
        )
        codes = [v for v in results if isinstance(v, Status)]
        ok = codes.count(Status.OK)
        if ok >= q:
            return Status.OK
        if min(codes, default=Status.OK) < Status.GONE and ok + self.masters - len(codes) < q:
            return min(codes)  # another owner (TAKEN), or foreign data (FOREIGN)
        if len(codes) < q:
            self._fail(slot.name, results)
        return Status.GONE

    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        """The q-th longest new lease: the lock lives while a majority holds it."""
        q = self.quorum
        results = self._ask(
            lambda m: m.extend(slot, token, ms, replace=replace),
            self.timeout(ms),
            lambda r: len(_leases(r)) >= q,
        )
        leases = _leases(results)
        if len(leases) >= q:
            return leases[q - 1]
        codes = [v for v in results if isinstance(v, Status)]
        if self.masters - len(codes) >= q:  # the unanswered could still make a quorum
            self._fail(slot.name, results)
        return min(min(codes, default=Status.GONE), Status.GONE)

    def renew(self, items: Sequence[Renewal]) -> list[Status | QuorumUnavailable]:
        """Every member renews the batch at once; each item settles by its own majority."""
        q, batch = self.quorum, list(items)
        if not batch:
            return []

        def settled(results: Sequence[Any]) -> bool:
            lists = [r for r in results if _answered(r)]
            return all(sum(1 for r in lists if r[k] is Status.OK) >= q for k in range(len(batch)))

        timeout = self.timeout(min(item.ms for item in batch))
        results = self._ask(lambda m: m.renew(batch), timeout, settled)
        if not any(_answered(r) for r in results):
            self._fail(batch[0].slot.name, results)
        outcomes: list[Status | QuorumUnavailable] = []
        for k, item in enumerate(batch):
            said = [r[k] if _answered(r) else r for r in results]
            codes = [v for v in said if isinstance(v, Status)]
            ok = codes.count(Status.OK)
            if ok >= q:
                outcomes.append(Status.OK)
            elif ok + len(said) - len(codes) >= q:  # undecided: a later round may get through
                errors = self._outcomes(said, Status.describe)
                outcomes.append(self._unavailable(item.slot.name, errors))
            else:
                outcomes.append(min(min(codes, default=Status.GONE), Status.GONE))
        return outcomes

    def wait(self, slot: Slot, seconds: float, refused: Grant | None = None) -> None:
        """Wait for a release notice on a member the holder has (``refused.wait_on``).

        Capped at five read timeouts (at least 1 s): if that member goes silent
        mid-wait, the waiter looks at the others again soon, instead of sleeping out
        the holder's whole lease.
        """
        index = 0 if refused is None else refused.wait_on
        seconds = min(seconds, max(1.0, 5 * self.timeout(None)))
        own = None if refused is None else dataclasses.replace(refused, wait_on=0, masters={})
        try:
            self.members[index].wait(slot, seconds, own)
        except QuorumUnavailable:
            return  # that member just failed: the next attempt finds out about the others

    def raise_fence(self, slot: Slot, fence: int, fence_ttl_ms: int) -> int:
        """Lift every member's counter; the highest counter after the call."""
        call: Call = lambda m: m.raise_fence(slot, fence, fence_ttl_ms)  # noqa: E731
        return int(max(self._gather(slot.name, call, self.timeout(None))))

    # -- reads ------------------------------------------------------------------------
    def holders(self, slot: Slot) -> list[Holder]:
        """The acquisitions a majority holds (matched by token), with the highest fence
        a member reports for it and the q-th longest lease."""
        q = self.quorum
        copies: dict[str, list[Holder]] = {}
        for answer in self._gather(slot.name, lambda m: m.holders(slot), self.timeout(None)):
            for holder in {h.token: h for h in answer}.values():  # once per member
                copies.setdefault(holder.token, []).append(holder)
        held = []
        for token, found in copies.items():
            if len(found) >= q:
                ttls = sorted((h.ttl_ms for h in found if h.ttl_ms is not None), reverse=True)
                fence = max((h.fence for h in found if h.fence is not None), default=None)
                ttl_ms = ttls[q - 1] if len(ttls) >= q else None
                held.append(Holder(token, found[0].record, fence=fence, ttl_ms=ttl_ms))
        return sorted(held, key=lambda h: (h.ttl_ms is None, h.ttl_ms or 0))

    def locked(self, slot: Slot) -> bool:
        """True when a majority says locked, False when a majority cannot."""
        n, q = self.masters, self.quorum
        results = self._ask(
            lambda m: m.locked(slot),
            self.timeout(None),
            lambda r: r.count(True) >= q or r.count(False) > n - q,
        )
        if results.count(True) >= q or results.count(False) > n - q:
            return results.count(True) >= q
        self._fail(slot.name, results)

    def was_done(self, slot: Slot, mark: str) -> bool:
        """True when any member that answers has *mark* (a mark is written only where a
        run holding the lock finished, so one member's is enough to know it ran)."""
        results = self._ask(
            lambda m: m.was_done(slot, mark), self.timeout(None), lambda r: True in r
        )
        if True not in results and sum(1 for v in results if _answered(v)) < self.quorum:
            self._fail(slot.name, results)
        return True in results

    # -- refused on a quorum ------------------------------------------------------------
    def enqueue(self, slot: Slot, *args: Any, **kwargs: Any) -> Queued:
        """Refused: no enqueue-time holds on a quorum (:func:`no_queued_holds`)."""
        raise ConfigError(no_queued_holds(slot.name, self.masters))

    def dequeue(self, slot: Slot, *args: Any, **kwargs: Any) -> Status:
        """Refused: no enqueue-time holds on a quorum (:func:`no_queued_holds`)."""
        raise ConfigError(no_queued_holds(slot.name, self.masters))

    def rate(self, name: str, *args: Any, **kwargs: Any) -> RateGrant:
        """Refused: no rate limits on a quorum (:data:`RATE_ON_QUORUM`)."""
        raise ConfigError(f"rate limiter {name!r}: {RATE_ON_QUORUM}")

    # -- records ------------------------------------------------------------------------
    def load_records(self, slot: Slot, suffix: str) -> dict[str, str]:
        """The newest record of each field on at least a majority (a minority could miss
        what the last holder claimed)."""
        call: Call = lambda m: m.load_records(slot, suffix)  # noqa: E731
        return newest_records(self._gather(slot.name, call, self.timeout(None)))

    def claim(  # noqa: PLR0917 - the Backend protocol's signature
        self,
        slot: Slot,
        suffix: str,
        token: str,
        name: str,
        value: str,
        version: tuple[int, int],
        deadline: float | None = None,
    ) -> Claim:
        """Claimed on a majority before *deadline*; lost on too many; else stale, or
        QuorumUnavailable (see :mod:`~celery_redlock.core.records`)."""
        n, q = self.masters, self.quorum
        if deadline is not None and time.monotonic() >= deadline:
            return Claim("lost", detail="the lease ran out before the claim")
        sent = _Round(
            self,
            lambda m: m.claim(slot, suffix, token, name, value, version, deadline),
            self.timeout(None),
        )
        if deadline is not None:  # the wait (a first contact's too) ends at the deadline
            sent.timeout = min(sent.timeout, max(deadline - time.monotonic(), 0.0))
        results = sent.wait(lambda r: _claims(r, "claimed") >= q)
        outcomes = self._outcomes(results, lambda c: f"{c.outcome} {c.detail}".strip())
        if _claims(results, "claimed") >= q:
            if deadline is None or time.monotonic() < deadline:
                return Claim("claimed", value)
            return Claim("lost", detail="the lease ran out before the claim was confirmed")
        if _claims(results, "lost") > n - q:
            detail = "; ".join(f"{m}: {o}" for m, o in outcomes.items())
            return Claim(
                "lost", detail=f"the lock is gone or held by another acquisition ({detail})"
            )
        stored = [c.record for c in results if isinstance(c, Claim) and c.outcome == "stale"]
        if stored:
            return Claim("stale", max(stored, key=record_version))
        if any(isinstance(v, ConfigError) for v in results):
            self._fail(slot.name, results)
        raise self._unavailable(slot.name, outcomes)

    # -- operator reads and forced release: each member's copy ---------------------------
    def scan(self, prefix: str, pattern: str = "*") -> list[LockInfo]:
        """Every member's locks, sorted by name."""
        answers = self._gather(prefix, lambda m: m.scan(prefix, pattern), ADMIN_TIMEOUT)
        return sorted((info for answer in answers for info in answer), key=lambda x: x.name)

    def read(self, prefix: str, name: str) -> list[LockInfo]:
        """Lock *name* as each member stores it."""
        answers = self._gather(name, lambda m: m.read(prefix, name), ADMIN_TIMEOUT)
        return [info for answer in answers for info in answer]

    def scan_rates(self, prefix: str, pattern: str = "*") -> list[RateInfo]:
        """Every member's rate limiter states, sorted by name."""
        answers = self._gather(prefix, lambda m: m.scan_rates(prefix, pattern), ADMIN_TIMEOUT)
        return sorted((info for answer in answers for info in answer), key=lambda x: x.name)

    def read_rate(self, prefix: str, name: str) -> RateInfo | None:
        """The first member's state of rate limiter *name* (None: idle everywhere)."""
        answers = self._gather(name, lambda m: m.read_rate(prefix, name), ADMIN_TIMEOUT)
        return next((a for a in answers if a is not None), None)

    def force_release(self, slot: Slot, fence: int | None, notice_ms: int) -> ForceRelease:
        """Remove the lock on every member. With *fence* (as :meth:`holders` reports
        it), only the acquisition that has it on some member: each member keeps its own
        counter, so each is given the fence that acquisition has there."""
        where: dict[Hashable, int | None] = {}
        if fence is not None:
            held = self._ask(lambda m: m.holders(slot), ADMIN_TIMEOUT)
            copies = [
                (m, h) for m, v in zip(self.members, held, strict=True) if _answered(v) for h in v
            ]
            token = next((h.token for _, h in copies if h.fence == fence), None)
            where = {m.identity(): h.fence for m, h in copies if h.token == token}
        call: Call = lambda m: m.force_release(slot, where.get(m.identity(), fence), notice_ms)  # noqa: E731
        return _merge(self._gather(slot.name, call, ADMIN_TIMEOUT), fence)

    def force_dequeue(self, slot: Slot, owner: str | None) -> ForceRelease:
        """Remove the enqueue-time hold on every member (a quorum never takes one)."""
        call: Call = lambda m: m.force_dequeue(slot, owner)  # noqa: E731
        return _merge(self._gather(slot.name, call, ADMIN_TIMEOUT), None)


def _answered(value: Any) -> bool:
    return not isinstance(value, BaseException)


def _granted(value: Any) -> bool:
    return isinstance(value, Grant) and value.acquired


def _silent(value: Any) -> bool:
    """Sent, and no answer: down (its client gave up) or not in time."""
    return isinstance(value, (QuorumUnavailable, NoAnswer))


def _said(value: Any) -> str:
    """A member's failure in words (a member's QuorumUnavailable: its own detail)."""
    if isinstance(value, QuorumUnavailable) and value.errors:
        return "; ".join(value.errors.values())
    return f"{type(value).__name__}: {value}"


def _record_key(grant: Grant) -> str:
    """One acquisition's holder record as comparable text."""
    return json.dumps(dict(grant.holder), sort_keys=True, default=str)


def _describe_grant(grant: Grant) -> str:
    if grant.acquired:
        return f"acquired (fence {grant.fence})"
    left = "" if grant.holder_ttl_ms is None else f", {grant.holder_ttl_ms} ms left"
    return f"held ({describe_holder(grant.holder)}{left})"


def _leases(results: Sequence[Any]) -> list[int]:
    """The new leases of an extend, longest first (a Status is no lease)."""
    found = (v for v in results if isinstance(v, int) and not isinstance(v, Status))
    return sorted((v for v in found if v > 0), reverse=True)


def _claims(results: Sequence[Any], outcome: str) -> int:
    return sum(1 for c in results if isinstance(c, Claim) and c.outcome == outcome)


def _merge(answers: Sequence[ForceRelease], fence: int | None) -> ForceRelease:
    """Released when any member released; else refused when any refused; else gone."""
    for outcome in ("released", "refused"):
        found = [a for a in answers if a.outcome == outcome]
        if found:
            if fence is None:  # without one asked for: the highest a member removed
                fence = max((a.fence for a in found if a.fence is not None), default=None)
            return ForceRelease(found[0].outcome, found[0].record, fence)
    return ForceRelease("gone")
