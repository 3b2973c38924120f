"""How one call reaches every member of a quorum (:class:`~.backend.QuorumBackend`): a
:class:`Round`, over what the quorum offers it (:class:`Reach`), and what a member's
answer is (:func:`answered`, :func:`silent`, ...).

How a verb travels (:class:`Round`). To a member that sends (:class:`Sends`: a Redis
master), the caller writes the verb itself, on a connection of that member's pool, and
reads the answers as they come: no thread between the caller and the masters. Any other
member's call (a memory store, a master this process has not heard from yet, or one
whose last call went unanswered) runs in the process's pool
(:func:`~celery_redlock.core.threads.submit`). The caller waits until the outcome is
decided, every member answered, or the timeout; it never waits for a member the outcome
no longer needs (an answer still on its way is read in the background, its connection
given back). A member's answer is its value, a :class:`~.errors.StoreUnavailable` (it
is down: no answer), a :class:`~.errors.ConfigError` (foreign data), or
:class:`NoAnswer`. Any other error (a client whose pool is exhausted, a wrong argument,
a bug) is raised to the caller as it is, never counted as a member being down. A member
with a call outstanding for longer than a round's timeout is sent nothing more until it
returns (:class:`~.gate.Gate`), so a stalled member ties up one call.

A release that undoes an acquire never overtakes it: where the acquire has not answered
yet, the release is sent once it has (:meth:`Round.then`). A grant that outlives its
release on a slow member (the release did not get through in time) lives on that
minority until its lease ends: it can delay the next holder there, never let two hold a
majority.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...backend import Backend, DoneMarks, Records, Sendable, Sent, capability
from ...backend_types import Grant, Slot
from ...errors import ConfigError, StoreUnavailable
from .gate import BUSY, Gate, NoAnswer

__all__ = [
    "CUT",
    "FIRST_CONTACT",
    "MIN_TIMEOUT",
    "READ_TIMEOUT",
    "SLICE",
    "Call",
    "Decided",
    "Member",
    "NoAnswer",
    "Reach",
    "Round",
    "Verb",
    "answered",
    "cut_off",
    "describe_failure",
    "silent",
]

#: Per-member timeout of reads and records (no lease to take 5% of) when none is set.
READ_TIMEOUT = 0.25
#: The shortest per-member timeout of a lease, whatever its TTL.
MIN_TIMEOUT = 0.05
#: How many timeouts a member this process never heard from is waited for: its first
#: call connects and shakes hands (TLS, AUTH) before it answers.
FIRST_CONTACT = 3
#: Why a member was not waited for: the caller's own deadline came first.
CUT = "not heard from before the caller's deadline"
#: The longest the caller blocks on one member's answer before it looks at the others'
#: again: a stopped member delays a decided outcome by at most this.
SLICE = 0.0005


@capability("Redlock masters (a member of a quorum)")
class Member(Backend, DoneMarks, Records, Protocol):
    """What a quorum needs of each member: the lock verbs, done marks and records, and
    two verbs only a quorum uses."""

    def acquire(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int,
        deadline: float | None = None, fence_step_ms: int = 0
    ) -> Grant:  # fmt: skip
        """:meth:`Backend.acquire`, a counter restart rounded up to *fence_step_ms* (see
        acquire.lua's ARGV[6]): a quorum's members restart a new name's counter alike."""
        ...

    def identity(self) -> Hashable:
        """What makes two members the same server (a quorum refuses a master listed
        twice): finer than :meth:`describe`."""
        ...

    def raise_fence(self, slot: Slot, fence: int, fence_ttl_ms: int) -> int:
        """Lift the name's fence counter to at least *fence*; returns the counter after
        the call (a quorum writes its chosen fence back to a majority with this)."""
        ...


_PENDING = NoAnswer("not heard from")
Call = Callable[[Member], Any]
Decided = Callable[[Sequence[Any]], bool]


class Reach(Protocol):
    """What a :class:`Round` needs of its quorum: the members, their gates, and the two
    ways a call reaches member *i* (:class:`~.backend.QuorumBackend` has them)."""

    masters: int
    members: tuple[Member, ...]
    gates: list[Gate]

    def send_to(self, i: int, call: Call, timeout: float) -> Sent | None:
        """*call* written to member *i* by the caller, or None where it is not."""
        ...

    def run_on(self, i: int, call: Call, timeout: float) -> cf.Future[Any] | None:
        """*call* on member *i* in the pool, in its turn; None when the member is stuck."""
        ...


@dataclass(frozen=True)
class Verb:
    """A member's verb and its arguments: sent by a member that :class:`Sends`, else
    called (``verb(member)``) in the pool."""

    kind: Sendable
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, member: Member) -> Any:
        return self.kind.on(member)(*self.args, **self.kwargs)


class Round:
    """``call(member)`` on the members *where* at once (see the module docstring).

    The caller then :meth:`wait`s, may send follow-ups (:meth:`then`), and ends with
    :meth:`close` (in a ``finally``): what was sent and not answered is read in the
    background and its connection given back.
    """

    def __init__(
        self, quorum: Reach, call: Call, timeout: float, where: Iterable[int] | None = None
    ) -> None:
        self.quorum = quorum
        self.where = list(range(quorum.masters) if where is None else where)
        self.results: list[Any] = [_PENDING] * len(self.where)
        self.futures: dict[cf.Future[Any], int] = {}
        #: Position -> what a member that sends sent (until its answer is read).
        self.sent: dict[int, Sent] = {}
        #: The positions sent to (answered or not).
        self.sent_to: set[int] = set()
        first = any(not quorum.gates[i].heard for i in self.where)
        self.timeout = timeout * (FIRST_CONTACT if first else 1)
        try:
            for pos, i in enumerate(self.where):
                sent = quorum.send_to(i, call, self.timeout)
                if sent is not None:
                    self.sent[pos] = sent
                    self.sent_to.add(pos)
                    continue
                future = quorum.run_on(i, call, self.timeout)
                if future is None:
                    self.results[pos] = NoAnswer(BUSY)
                else:
                    self.futures[future] = pos
        except BaseException:  # a member's client-side error: nothing left outstanding
            self.close()
            raise

    def wait(self, decided: Decided, until: float | None = None) -> list[Any]:
        """Each member's answer once *decided(results)*, all answered, or the timeout
        (or *until*, a ``time.monotonic()`` of the caller's, when that comes first: a
        member not heard from by then is :data:`CUT`, not late).

        The caller blocks on one sent call at a time, for at most :data:`SLICE` while
        others are outstanding: an answer that comes is read at once; a slice without one
        moves on to the next member (after taking whatever the others have answered), so
        a stopped member costs a decided outcome at most a slice.
        """
        deadline = time.monotonic() + self.timeout
        cut = until is not None and until < deadline
        if until is not None and cut:
            deadline = until
        pending = set(self.futures)
        turn = 0
        while (pending or self.sent) and not decided(self.results):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self.sent:
                positions = list(self.sent)
                pos = positions[turn % len(positions)]
                many = len(positions) > 1 or bool(pending)
                if self.sent[pos].ready(min(left, SLICE) if many else left):
                    self.results[pos] = _answer(self.sent.pop(pos))
                else:  # no answer in a slice: take what the others have, then the next
                    turn += 1
                    self._collect(pending)
                if pending:
                    self._collect_futures(pending)
            else:
                done, pending = cf.wait(pending, timeout=left, return_when=cf.FIRST_COMPLETED)
                for future in done:
                    self.results[self.futures[future]] = _outcome(future)
        self._collect(pending)  # decided: take what has come, wait for nothing more
        late = time.monotonic() >= deadline
        for pos, value in enumerate(self.results):
            if value is _PENDING:
                if not late:
                    self.results[pos] = NoAnswer("not waited for")
                elif cut:
                    self.results[pos] = NoAnswer(CUT)
                else:
                    self.results[pos] = NoAnswer(f"no answer within {self.timeout * 1000:.0f} ms")
        return self.results

    def _collect(self, pending: set[cf.Future[Any]]) -> None:
        """Take every answer that has come (sent calls, then calls in the pool)."""
        for pos, sent in list(self.sent.items()):
            if sent.ready(0):
                del self.sent[pos]
                self.results[pos] = _answer(sent)
        self._collect_futures(pending)

    def _collect_futures(self, pending: set[cf.Future[Any]]) -> None:
        for future in [f for f in pending if f.done()]:
            pending.discard(future)
            self.results[self.futures[future]] = _outcome(future)

    def then(self, follow: Call, positions: Iterable[int]) -> None:
        """*follow* (best effort) on those members after this round's call: once a call
        not answered yet has answered (in the background), else at once (waited for up
        to the timeout)."""
        now: list[int] = []  # positions whose call has ended: follow-ups sent at once
        futures = {pos: future for future, pos in self.futures.items()}
        quiet = _quietly(follow)
        for pos in positions:
            i = self.where[pos]
            sent = self.sent.pop(pos, None)
            future = futures.get(pos)
            if sent is not None:
                sent.finish(functools.partial(quiet, self.quorum.members[i]))
            elif future is not None and not future.done():
                future.add_done_callback(functools.partial(self._follow, i, quiet))
            elif future is not None or pos in self.sent_to:  # (a member not asked: nothing)
                now.append(i)
        if now:
            with contextlib.suppress(Exception):
                Round(self.quorum, quiet, self.timeout, now).close(wait=True)

    def _follow(self, i: int, call: Call, _: object) -> None:
        self.quorum.run_on(i, call, self.timeout)

    def close(self, *, wait: bool = False) -> None:
        """Done with this round: what was sent and not answered is set aside with its
        member's gate, finished by the next call there or the reaper
        (:meth:`~.gate.Gate.set_aside`; *wait*: first wait for the answers, up to the
        timeout)."""
        if wait:
            self.wait(lambda _: False)
        sent, self.sent = self.sent, {}
        until = time.monotonic() + self.timeout
        for pos, pending in sent.items():
            self.quorum.gates[self.where[pos]].set_aside(pending, until)


def _answer(sent: Sent) -> Any:
    """A sent verb's answer, or its StoreUnavailable / ConfigError; anything else is
    raised."""
    try:
        return sent.result()
    except (StoreUnavailable, ConfigError) as exc:
        return exc


def _outcome(future: cf.Future[Any]) -> Any:
    """A member's value, or its StoreUnavailable / ConfigError; anything else is raised."""
    try:
        return future.result()
    except (StoreUnavailable, ConfigError) as exc:
        return exc


def _quietly(call: Call) -> Call:
    """*call* as a follow-up: where it fails, the lease it was meant to end expires."""

    def run(member: Member) -> None:
        with contextlib.suppress(Exception):
            call(member)

    return run


def answered(value: Any) -> bool:
    """A member's answer is a value, not a failure (an exception in its place)."""
    return not isinstance(value, BaseException)


def cut_off(value: Any) -> bool:
    """Not waited for past the caller's deadline (:data:`CUT`): it may still answer."""
    return isinstance(value, NoAnswer) and str(value) == CUT


def silent(value: Any) -> bool:
    """Sent, and no answer: down (its client gave up) or not in time."""
    return isinstance(value, (StoreUnavailable, NoAnswer))


def describe_failure(value: Any) -> str:
    """A member's failure in words (a member's StoreUnavailable: its own detail)."""
    if isinstance(value, StoreUnavailable) and value.errors:
        return "; ".join(value.errors.values())
    return f"{type(value).__name__}: {value}"
