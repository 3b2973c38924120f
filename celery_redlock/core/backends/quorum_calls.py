"""How one call reaches every member of a quorum (:class:`~.quorum.QuorumBackend`), and
how their answers are judged (:class:`QuorumCalls`, which the quorum's verbs build on).

How a verb travels (:class:`Round`). Each member's call runs in the process's pool
(:func:`~celery_redlock.core.threads.submit`); the caller waits until the outcome is
decided, every member answered, or the timeout. A member's answer is its value, a
:class:`~.errors.QuorumUnavailable` (it is down: no answer), a
:class:`~.errors.ConfigError` (foreign data), or :class:`NoAnswer`. Any other error
(a client whose pool is exhausted, a wrong argument, a bug) is raised to the caller as
it is, never counted as a member being down. Calls to one member take turns
(:class:`Gate`): one of ours runs on a member at a time, and a member stuck in a call
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
import functools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, Protocol, TypeVar

from .. import process, threads
from ..backend import Backend, DoneMarks, Records, capability, need
from ..backend_types import Slot
from ..errors import ConfigError, QuorumUnavailable

__all__ = [
    "FIRST_CONTACT",
    "GRACE",
    "MIN_TIMEOUT",
    "READ_TIMEOUT",
    "Call",
    "Decided",
    "Gate",
    "Member",
    "NoAnswer",
    "QuorumCalls",
    "Round",
    "answered",
    "describe_failure",
    "gate_of",
    "silent",
]

#: Per-member timeout of reads and records (no lease to take 5% of) when none is set.
READ_TIMEOUT = 0.25
#: The shortest per-member timeout of a lease, whatever its TTL.
MIN_TIMEOUT = 0.05
#: How many timeouts a member this process never heard from is waited for: its first
#: call connects and shakes hands (TLS, AUTH) before it answers.
FIRST_CONTACT = 3
#: After the outcome is decided, how long answers already on their way are still taken
#: (they tell the caller which masters it holds).
GRACE = 0.002


@capability("Redlock masters (a member of a quorum)")
class Member(Backend, DoneMarks, Records, Protocol):
    """What a quorum needs of each member: the lock verbs, done marks and records, and
    two verbs only a quorum uses."""

    def identity(self) -> Hashable:
        """What makes two members the same server (a quorum refuses a master listed
        twice): finer than :meth:`describe`."""
        ...

    def raise_fence(self, slot: Slot, fence: int, fence_ttl_ms: int) -> int:
        """Lift the name's fence counter to at least *fence*; returns the counter after
        the call (a quorum writes its chosen fence back to a majority with this)."""
        ...


class NoAnswer(Exception):
    """A member did not answer in time, or was not asked (still busy with earlier calls)."""


_PENDING = NoAnswer("not heard from")
_T = TypeVar("_T")
Call = Callable[[Member], Any]
Decided = Callable[[Sequence[Any]], bool]


class Gate:
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
        self._queue: deque[tuple[Call, Member, float, cf.Future[Any]]] = deque()
        self._running = False  # a pool thread is running the queue
        self._since = 0.0  # when the running call started (0.0: between calls)
        self.heard = False  # answered once: connected, scripts loaded

    @property
    def calls(self) -> int:
        """Calls queued or running."""
        return len(self._queue) + (self._since > 0)

    def offer(self, call: Call, member: Member, timeout: float) -> cf.Future[Any] | None:
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


_gates: weakref.WeakKeyDictionary[Member, Gate] = weakref.WeakKeyDictionary()
_gates_lock = threading.Lock()


def gate_of(member: Member) -> Gate:
    """The one gate of *member* in this process (made on first use)."""
    with _gates_lock:
        gate = _gates.get(member)
        if gate is None:
            gate = _gates[member] = Gate()
        return gate


def _after_fork() -> None:
    global _gates, _gates_lock
    _gates = weakref.WeakKeyDictionary()  # a child has none of its parent's calls
    _gates_lock = threading.Lock()


process.on_fork(_after_fork)


class Round:
    """``call(member)`` on the members *where* at once (see the module docstring)."""

    def __init__(
        self, quorum: QuorumCalls, call: Call, timeout: float, where: Iterable[int] | None = None
    ) -> None:
        self.quorum = quorum
        self.where = list(range(quorum.masters) if where is None else where)
        self.results: list[Any] = [_PENDING] * len(self.where)
        self.futures: dict[cf.Future[Any], int] = {}
        first = any(not gate_of(quorum.members[i]).heard for i in self.where)
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

    def run(member: Member) -> None:
        with contextlib.suppress(Exception):
            call(member)

    return run


class QuorumCalls:
    """N member backends decided at a majority: each call to them all is a :class:`Round`,
    and what came back is judged here (enough answers or not, each member's outcome).

    *per_node_timeout* bounds the wait for each member (default: 5% of a lease, at
    least 50 ms; :data:`READ_TIMEOUT` for reads and records).
    """

    def __init__(self, members: Sequence[Backend], per_node_timeout: float | None = None) -> None:
        if isinstance(members, (str, bytes)) or not isinstance(members, Sequence) or not members:
            raise ConfigError("Redlock needs a non-empty list of backends, one per master")
        checked = [need(m, Member) for m in members]
        ids = [m.identity() for m in checked]
        twice = sorted(
            {m.describe() for m, i in zip(checked, ids, strict=True) if ids.count(i) > 1}
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
        self.members: tuple[Member, ...] = tuple(checked)
        self.masters = len(self.members)
        self.quorum = self.masters // 2 + 1
        self.per_node_timeout = per_node_timeout
        #: Each member's name in errors and ``Grant.masters``.
        self.names = [m.describe() for m in self.members]

    def _start(self, i: int, call: Call, timeout: float) -> cf.Future[Any] | None:
        """``call(member i)`` in its turn (:class:`Gate`), given up after *timeout*: its
        future, or None when the member is stuck in a call that ran longer than that.
        Follow-ups too: a follow-up not sent leaves a lease that expires by itself."""
        member = self.members[i]
        return gate_of(member).offer(call, member, timeout)

    def in_flight(self, i: int) -> int:
        """Calls to member *i* queued or running (from any quorum that has it)."""
        return gate_of(self.members[i]).calls

    def describe(self) -> str:
        """The members' addresses."""
        return ", ".join(self.names)

    def timeout(self, ttl_ms: int | None) -> float:
        """How long to wait for each member: the set per-node timeout, else 5% of the
        lease (at least 50 ms), :data:`READ_TIMEOUT` without one."""
        if self.per_node_timeout is not None:
            return self.per_node_timeout
        return READ_TIMEOUT if ttl_ms is None else max(MIN_TIMEOUT, 0.05 * ttl_ms / 1000)

    def ask(self, call: Call, timeout: float, decided: Decided = lambda _: False) -> list[Any]:
        """``call`` on every member: each one's answer (see :meth:`Round.wait`)."""
        return Round(self, call, timeout).wait(decided)

    def gather(self, name: str, call: Call, timeout: float) -> list[Any]:
        """Every member's answer; raises unless at least a quorum answered."""
        results = self.ask(call, timeout)
        answers = [v for v in results if answered(v)]
        if len(answers) < self.quorum:
            self.fail(name, results)
        return answers

    def outcomes(self, results: Sequence[Any], ok: Callable[[Any], str]) -> dict[str, str]:
        """Each member's outcome in words, by name: ``ok(answer)``, else its failure."""
        return {
            m: ok(v) if answered(v) else describe_failure(v)
            for m, v in zip(self.names, results, strict=True)
        }

    def unavailable(self, name: str, errors: Mapping[str, str]) -> QuorumUnavailable:
        """The error of lock *name* when too few members decided, with each one's outcome."""
        return QuorumUnavailable(name, errors, needed=self.quorum, total=self.masters)

    def fail(self, name: str, results: Sequence[Any]) -> NoReturn:
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
        raise self.unavailable(name, self.outcomes(results, lambda _: "answered"))


def answered(value: Any) -> bool:
    """A member's answer is a value, not a failure (an exception in its place)."""
    return not isinstance(value, BaseException)


def silent(value: Any) -> bool:
    """Sent, and no answer: down (its client gave up) or not in time."""
    return isinstance(value, (QuorumUnavailable, NoAnswer))


def describe_failure(value: Any) -> str:
    """A member's failure in words (a member's QuorumUnavailable: its own detail)."""
    if isinstance(value, QuorumUnavailable) and value.errors:
        return "; ".join(value.errors.values())
    return f"{type(value).__name__}: {value}"
