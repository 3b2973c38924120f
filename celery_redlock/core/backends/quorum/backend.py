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
                    fewer than q answered -> StoreUnavailable
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

How a verb reaches the members (in turns, in rounds, a give-back chained behind the
acquire it undoes): :mod:`~.round`; one member's calls in this process: :mod:`~.gate`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeGuard

from ...backend import (
    Backend,
    EventLog,
    FlowControl,
    Permits,
    Probe,
    QueuedHolds,
    Rates,
    Sendable,
    Sends,
    Sent,
    given,
    need,
)
from ...backend_types import (
    Acquired,
    Claim,
    Grant,
    Health,
    Held,
    Holder,
    Refused,
    Renewal,
    Slot,
    Status,
    Superseded,
    newest_records,
    record_version,
)
from ...errors import (
    ConfigError,
    ForeignData,
    QuorumUnavailable,
    StoreUnavailable,
    describe_holder,
)
from .gate import NoAnswer, gate_of
from .round import (
    FIRST_CONTACT,
    MIN_TIMEOUT,
    READ_TIMEOUT,
    Call,
    Decided,
    Member,
    Round,
    Verb,
    answered,
    cut_off,
    describe_failure,
    silent,
)

__all__ = [
    "FIRST_CONTACT",
    "MIN_TIMEOUT",
    "READ_TIMEOUT",
    "Member",
    "NoAnswer",
    "QuorumBackend",
]

#: The step a member's fence counter restart rounds up to (acquire.lua's ARGV[6]): the
#: masters of a new name restart alike when their clocks agree to it, so their fences
#: agree and no write-back round is needed.
FENCE_STEP_MS = 1000
#: Keys of calls sent directly, for their member's gate.
_keys = itertools.count()
_ONE_REDIS = "use one Redis (a plain server, a Sentinel-managed master or a Cluster) for it"
#: Why a quorum lacks each capability it lacks (what :func:`~..backend.need` says).
_WHY_NOT: dict[type, str] = {
    Permits: (
        "a permit held on a majority of Redlock masters does not bound the holders (3 "
        "masters, limit 2: A holds permits on masters 1 and 2, B on 2 and 3, C on 1 and 3; "
        "each holds a majority and no master holds more than 2 permits, yet three run at "
        f"once); {_ONE_REDIS}, or a limit of 1 (a Redlock mutex)"
    ),
    Rates: (
        "a grant counted on a majority of Redlock masters does not bound the grants (3 "
        "masters: grants counted on masters 1 and 2, 2 and 3, 1 and 3 are three grants "
        f"while each master counted two); {_ONE_REDIS}"
    ),
    QueuedHolds: (
        "the hand-over from a queued hold to the run's lock could not be one atomic step "
        f"on a majority of Redlock masters; use lock_on='run' with them, or {_ONE_REDIS}"
    ),
    FlowControl: (
        "several holds taken all or nothing, semaphores and rates among them, could not be "
        "one step on a majority of Redlock masters; use one Redis (a plain server or a "
        "Sentinel-managed master) for it"
    ),
}


class QuorumBackend:
    """Locks on a majority of independent member backends (Redlock): each call to them all
    is a :class:`~.round.Round`, and what came back is judged here (enough answers or not,
    each member's outcome, what a verb decides from them).

    *per_node_timeout* bounds the wait for each member (default: 5% of a lease, at
    least 50 ms; :data:`READ_TIMEOUT` for reads and records). Quorums of equal members
    are equal (they share one renewal batch).
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
        #: Each member's gate (shared with every quorum that has the member).
        self.gates = [gate_of(i) for i in ids]
        #: Each member as one that sends (None: its calls go through the pool).
        self.senders: list[Sends | None] = [given(m, Sends) for m in self.members]
        self.masters = len(self.members)
        self.quorum = self.masters // 2 + 1
        self.per_node_timeout = per_node_timeout
        #: Each member's name in errors and ``Grant.masters``.
        self.names = [m.describe() for m in self.members]

    def send_to(self, i: int, call: Call, timeout: float) -> Sent | None:
        """*call* (a :class:`Verb`) sent to member *i* by the caller: None when the member
        does not send (or not this verb), has not answered yet in this process (its first
        call connects in the pool), its last sent call went unanswered, or a call of ours
        is still outstanding there, unless that one is set aside (nobody waits for it): then
        the call goes behind it on its connection. The caller never waits for a
        connection to be made, and calls to one member keep their order."""
        sender = self.senders[i]
        if sender is None or not isinstance(call, Verb):
            return None
        gate = self.gates[i]
        behind = None
        if gate.calls:
            gate.settle()
            if gate.calls:
                behind = gate.set_aside_alone()
                if behind is None:
                    return None
        if not (gate.heard and gate.sends):
            return None
        key = next(_keys)
        gate.sending(key)
        sent: Sent | None = None
        try:
            answered = functools.partial(gate.answered, key)
            sent = sender.send(call.kind, call.args, call.kwargs, answered, behind)
        finally:
            if sent is None:  # not sent (or it raised): nothing outstanding
                gate.forget(key)
        gate.sent(key, sent)
        return sent

    def run_on(self, i: int, call: Call, timeout: float) -> cf.Future[Any] | None:
        """``call(member i)`` in its turn (:class:`Gate`), given up after *timeout*: its
        future, or None when the member is stuck in a call that ran longer than that.
        Follow-ups too: a follow-up not sent leaves a lease that expires by itself."""
        member = self.members[i]
        return self.gates[i].offer(call, member, timeout)

    def in_flight(self, i: int) -> int:
        """Calls to member *i* queued or running (from any quorum that has it)."""
        return self.gates[i].calls

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
        sent = Round(self, call, timeout)
        try:
            return sent.wait(decided)
        finally:
            sent.close()

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
        """Too few answered: ForeignData naming the masters that found foreign data,
        else QuorumUnavailable."""
        foreign = [
            f"{m}: {v}"
            for m, v in zip(self.names, results, strict=True)
            if isinstance(v, ConfigError)
        ]
        if foreign:
            raise ForeignData(
                f"lock {name!r}: {len(foreign)} of {self.masters} masters refused: "
                + "; ".join(foreign)
            )
        raise self.unavailable(name, self.outcomes(results, lambda _: "answered"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuorumBackend) and self.members == other.members

    def __hash__(self) -> int:
        return hash(self.members)

    def __repr__(self) -> str:
        return f"<QuorumBackend {self.quorum}/{self.masters}: {self.describe()}>"

    # -- an acquisition's life --------------------------------------------------------
    def acquire(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int,
        deadline: float | None = None
    ) -> Grant:  # fmt: skip
        """One Redlock attempt (see the module docstring)."""
        n, q, name = self.masters, self.quorum, slot.name
        timeout = self.timeout(ttl_ms)
        options = {"wait": wait, "fence_ttl_ms": fence_ttl_ms, "fence_step_ms": FENCE_STEP_MS}
        verb = Verb(Sendable.ACQUIRE, (slot, token, ttl_ms, record), options)
        sent = Round(self, verb, timeout)

        try:

            def give_back(where: Iterable[int]) -> None:  # never before the acquire there
                sent.then(Verb(Sendable.RELEASE, (slot, token, ttl_ms)), where)

            try:
                # A refusal waits for every answer (up to the timeout, or the caller's
                # deadline): who holds what on each member tells a holder with a majority
                # from a split vote. One holder refusing on a quorum decides it at once.
                results = sent.wait(lambda r: _decided(r, q), until=deadline)
            except BaseException:  # a member's client-side error: raised, after a give-back
                give_back(range(n))
                raise
            fences = {i: v.fence or 0 for i, v in enumerate(results) if _granted(v)}
            outcomes = self.outcomes(results, _describe_grant)
            # Where this token may hold: granted, or sent without an answer (down, silent).
            maybe = [i for i, v in enumerate(results) if _granted(v) or silent(v)]
            if len(fences) >= q:
                try:
                    fence = self._settle_fence(slot, fences, fence_ttl_ms, timeout, outcomes)
                except BaseException:
                    give_back(maybe)
                    raise
                if fence is not None:
                    return Acquired(fence=fence, masters=outcomes)
                give_back(maybe)
                raise self.unavailable(name, outcomes)
            give_back(maybe)
            for i in fences:
                outcomes[self.names[i]] += ", given back"
            refusals = (Held, Superseded, Refused)
            held = {i: v for i, v in enumerate(results) if isinstance(v, refusals)}
            foreign = sum(1 for v in results if isinstance(v, ConfigError))
            if foreign:  # data under our keys that is not a lock: no retry mends it
                raise ConfigError(
                    f"lock {name!r}: {foreign} of {n} masters refused the acquire on the data at "
                    f"{slot.keys.lock!r} ({'; '.join(f'{m}: {o}' for m, o in outcomes.items())}): "
                    "something other than celery-redlock writes under the lock key prefix"
                )
            heard = len(fences) + len(held)
            if heard < q:
                if heard + sum(1 for v in results if cut_off(v)) < q:
                    # Too few members answered to decide anything: an outage, not contention.
                    raise self.unavailable(name, outcomes)
                if not held:  # the caller's deadline came first: out of time, not an outage
                    return Held(masters=outcomes)
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
            return Held(
                holder=dict(tops[0][1].holder),
                holder_ttl_ms=min(top_ttls) if top_ttls else None,
                wait_ms=wait_ms,
                wait_on=tops[0][0],
                masters=outcomes,
            )
        finally:
            sent.close()

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
            return sum(1 for v in results if answered(v) and v >= fence)

        verb = Verb(Sendable.RAISE_FENCE, (slot, fence, fence_ttl_ms))
        round_ = Round(self, verb, timeout, lower)
        try:
            results = round_.wait(lambda r: raised(r) >= need)
        finally:
            round_.close()
        if raised(results) >= need:
            return fence
        for i, value in zip(lower, results, strict=True):
            if not answered(value):
                outcomes[self.names[i]] = f"acquired, but writing fence {fence} back failed "
                outcomes[self.names[i]] += f"({describe_failure(value)})"
        return None

    def release(self, slot: Slot, token: str, notice_ms: int) -> Status:
        """OK when a quorum released, or when the members that did not answer complete
        one; TAKEN/FOREIGN/GONE when no majority can have held it to the end.

        Redlock's model lets a minority fail: with a member down, another that says
        "gone" is one that never granted this token (a split vote's leftover), so the
        OKs plus the silent members may still be the majority that held it.
        """
        return self._release(slot, notice_ms, Verb(Sendable.RELEASE, (slot, token, notice_ms)))

    def release_done(
        self, slot: Slot, token: str, notice_ms: int, mark: str, mark_ms: int
    ) -> Status:
        """:meth:`release`, each member adding *mark* to its done marks."""
        verb = Verb(Sendable.RELEASE_DONE, (slot, token, notice_ms, mark, mark_ms))
        return self._release(slot, notice_ms, verb)

    def _release(self, slot: Slot, notice_ms: int, call: Call) -> Status:
        q = self.quorum
        results = self.ask(call, self.timeout(notice_ms), lambda r: r.count(Status.OK) >= q)
        codes = [v for v in results if isinstance(v, Status)]
        ok = codes.count(Status.OK)
        if ok >= q:
            return Status.OK
        possible = ok + self.masters - len(codes) >= q  # counting the silent as OK
        if min(codes, default=Status.OK) < Status.GONE and not possible:
            return min(codes)  # another owner (TAKEN), or foreign data (FOREIGN)
        if len(codes) < q:
            self.fail(slot.name, results)
        return Status.OK if possible and ok else Status.GONE

    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        """The q-th longest new lease: the lock lives while a majority holds it."""
        q = self.quorum
        results = self.ask(
            Verb(Sendable.EXTEND, (slot, token, ms), {"replace": replace}),
            self.timeout(ms),
            lambda r: len(_leases(r)) >= q,
        )
        leases = _leases(results)
        if len(leases) >= q:
            return leases[q - 1]
        codes = [v for v in results if isinstance(v, Status)]
        if self.masters - len(codes) >= q:  # the unanswered could still make a quorum
            self.fail(slot.name, results)
        return min(min(codes, default=Status.GONE), Status.GONE)

    def renew(self, items: Sequence[Renewal]) -> list[Status | StoreUnavailable]:
        """Every member renews the batch at once; each item settles by its own majority."""
        q, batch = self.quorum, list(items)
        if not batch:
            return []

        def settled(results: Sequence[Any]) -> bool:
            lists = [r for r in results if answered(r)]
            return all(sum(1 for r in lists if r[k] is Status.OK) >= q for k in range(len(batch)))

        timeout = self.timeout(min(item.ms for item in batch))
        results = self.ask(lambda m: m.renew(batch), timeout, settled)
        if not any(answered(r) for r in results):
            self.fail(batch[0].slot.name, results)
        outcomes: list[Status | StoreUnavailable] = []
        for k, item in enumerate(batch):
            said = [r[k] if answered(r) else r for r in results]
            codes = [v for v in said if isinstance(v, Status)]
            ok = codes.count(Status.OK)
            if ok >= q:
                outcomes.append(Status.OK)
            elif ok + len(said) - len(codes) >= q:  # undecided: a later round may get through
                errors = self.outcomes(said, Status.describe)
                outcomes.append(self.unavailable(item.slot.name, errors))
            else:
                outcomes.append(min(min(codes, default=Status.GONE), Status.GONE))
        return outcomes

    def wait(self, slot: Slot, seconds: float, refused: Grant | None = None) -> None:
        """Wait for a release notice on a member the holder has (``refused.wait_on``).

        Capped at five read timeouts (at least 1 s): if that member goes silent
        mid-wait, the waiter looks at the others again soon, instead of sleeping out
        the holder's whole lease.
        """
        index = refused.wait_on if isinstance(refused, Held) else 0
        seconds = min(seconds, max(1.0, 5 * self.timeout(None)))
        own: Grant | None = None
        if isinstance(refused, Held):
            own = dataclasses.replace(refused, wait_on=0, masters={})
        elif refused is not None:
            own = dataclasses.replace(refused, masters={})
        try:
            self.members[index].wait(slot, seconds, own)
        except StoreUnavailable:
            return  # that member just failed: the next attempt finds out about the others

    # -- reads ------------------------------------------------------------------------
    def holders(self, slot: Slot) -> list[Holder]:
        """The acquisitions a majority holds (matched by token), with the highest fence
        a member reports for it and the q-th longest lease."""
        q = self.quorum
        copies: dict[str, list[Holder]] = {}
        for answer in self.gather(slot.name, lambda m: m.holders(slot), self.timeout(None)):
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
        results = self.ask(
            lambda m: m.locked(slot),
            self.timeout(None),
            lambda r: r.count(True) >= q or r.count(False) > n - q,
        )
        if results.count(True) >= q or results.count(False) > n - q:
            return results.count(True) >= q
        self.fail(slot.name, results)

    def was_done(self, slot: Slot, mark: str) -> bool:
        """True when any member that answers has *mark* (a mark is written only where a
        run holding the lock finished, so one member's is enough to know it ran)."""
        results = self.ask(
            lambda m: m.was_done(slot, mark), self.timeout(None), lambda r: True in r
        )
        if True not in results and sum(1 for v in results if answered(v)) < self.quorum:
            self.fail(slot.name, results)
        return True in results

    # -- records ------------------------------------------------------------------------
    def load_records(self, slot: Slot, suffix: str) -> dict[str, str]:
        """The newest record of each field on at least a majority (a minority could miss
        what the last holder claimed)."""
        call: Call = lambda m: m.load_records(slot, suffix)  # noqa: E731
        return newest_records(self.gather(slot.name, call, self.timeout(None)))

    def claim(  # noqa: PLR0917 - the Records protocol's signature
        self, slot: Slot, suffix: str, token: str, name: str, value: str,
        version: tuple[int, int], deadline: float | None = None
    ) -> Claim:  # fmt: skip
        """Claimed on a majority before *deadline*; lost on too many; else stale, or
        StoreUnavailable (see :mod:`~celery_redlock.core.records`)."""
        n, q = self.masters, self.quorum
        if deadline is not None and time.monotonic() >= deadline:
            return Claim("lost", detail="the lease ran out before the claim")
        sent = Round(
            self,
            lambda m: m.claim(slot, suffix, token, name, value, version, deadline),
            self.timeout(None),
        )
        if deadline is not None:  # the wait (a first contact's too) ends at the deadline
            sent.timeout = min(sent.timeout, max(deadline - time.monotonic(), 0.0))
        try:
            results = sent.wait(lambda r: _claims(r, "claimed") >= q)
        finally:
            sent.close()
        outcomes = self.outcomes(results, lambda c: f"{c.outcome} {c.detail}".strip())
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
            self.fail(slot.name, results)
        raise self.unavailable(slot.name, outcomes)

    # -- the lock event log: each master keeps its own ------------------------------------
    def log_events(self, log_key: str, events: Sequence[str], maxlen: int, ttl_ms: int) -> None:
        """Append *events* to the log of every master that answers (a log is what each
        master saw happen, not a decision: a master down misses its copy)."""
        for member in self.members:
            log = given(member, EventLog)
            if log is not None:
                with contextlib.suppress(StoreUnavailable):
                    log.log_events(log_key, events, maxlen, ttl_ms)

    def read_events(self, log_key: str, count: int) -> list[str]:
        """The log of the first master that answers (the board reads each master's)."""
        for member in self.members:
            log = given(member, EventLog)
            if log is not None:
                with contextlib.suppress(StoreUnavailable):
                    return log.read_events(log_key, count)
        return []

    # -- what a quorum cannot do --------------------------------------------------------
    def check(self) -> list[Health]:
        """Each master's health, in the order of the members (``unknown`` for a member
        without a probe)."""
        found: list[Health] = []
        for member in self.members:
            probe = given(member, Probe)
            found += [Health(member.describe(), "unknown")] if probe is None else probe.check()
        return found

    def why_not(self, capability: type) -> str:
        """Why a quorum lacks *capability* (the reason in :func:`~..backend.lacks`)."""
        return _WHY_NOT.get(capability, f"a Redlock quorum of {self.masters} masters")


def _decided(results: Sequence[Any], quorum: int) -> bool:
    """An acquire's round can end: a quorum granted, or one holder refused on a quorum
    (it holds the lock, whatever the others say)."""
    granted = 0
    refused: dict[Any, int] = {}
    for value in results:
        if isinstance(value, Grant):
            if isinstance(value, Acquired):
                granted += 1
            else:
                key = _record_key(value)
                refused[key] = refused.get(key, 0) + 1
    return granted >= quorum or any(count >= quorum for count in refused.values())


def _granted(value: Any) -> TypeGuard[Acquired]:
    return isinstance(value, Acquired)


def _record_key(grant: Held | Superseded | Refused) -> str:
    """One acquisition's holder record as comparable text."""
    return json.dumps(dict(grant.holder), sort_keys=True, default=str)


def _describe_grant(grant: Grant) -> str:
    if isinstance(grant, Acquired):
        return f"acquired (fence {grant.fence})"
    left = "" if grant.holder_ttl_ms is None else f", {grant.holder_ttl_ms} ms left"
    return f"held ({describe_holder(grant.holder)}{left})"


def _leases(results: Sequence[Any]) -> list[int]:
    """The new leases of an extend, longest first (a Status is no lease)."""
    found = (v for v in results if isinstance(v, int) and not isinstance(v, Status))
    return sorted((v for v in found if v > 0), reverse=True)


def _claims(results: Sequence[Any], outcome: str) -> int:
    return sum(1 for c in results if isinstance(c, Claim) and c.outcome == outcome)
