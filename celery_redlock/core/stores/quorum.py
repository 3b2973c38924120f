"""``QuorumStore``: one lock over N independent Redis masters, held by a majority (Redlock).

How one acquire attempt goes (``n`` masters, quorum ``q = n // 2 + 1``)::

    ACQUIRE on every master at once     the wait ends when q granted or every master
                                        answered, at the latest after the per-node
                                        timeout
    >= q granted -> fence = max(fences); raise the lower counters to it until a quorum
                    holds >= fence (RAISE_FENCE)
    otherwise    -> RELEASE wherever this token may hold (masters that did not answer
                    included: queued behind the unanswered acquire), then
                    fewer than q answered -> QuorumUnavailable
                    one holder may own q  -> the caller waits for its release notice
                                             (BLPOP on one of its masters), capped at its lease
                    split vote            -> the caller retries after a short random delay

The caller (:class:`~celery_redlock.core.lock.Lock`) measures validity from
before the first request: ``ttl - elapsed - drift``.

Why fences keep increasing across different quorums (a timeline)::

    counters  m0=100  m1=5   m2=50
    A takes m1, m2 (m0 down): fences 6, 51 -> A's fence is 51; m1 is raised to 51
    B takes m0, m1 (m2 down): fences 101, 52 -> B's fence is 101; m1 is raised to 101
    C takes m1, m2 (m0 down): fences 102, 52 -> C's fence is 102
    Two majorities always share a master, and that master's counter already holds
    the previous holder's fence, so the next INCR there is larger. Without the
    write-back C would get 52 < 101. (This needs counters that survive restarts:
    see docs/redlock.md.)

A grant that reaches a slow master after the release (both were sent, the
release behind the acquire on the same connection where possible) lives on that
minority until its lease ends: it can delay the next holder there, never let two
hold a majority.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError, QuorumUnavailable, describe_holder
from ..fanout import FanOut, answered
from ..keys import LockKeys
from ..scripts import EXTEND, RAISE_FENCE, Status
from ..send import Plain
from ..store import Grant, Holder, Queued, node_timeout, parse_holder, text
from .redis import RedisStore, acquire_command, is_foreign, release_command

__all__ = ["QuorumStore", "no_queued_holds"]

#: Per-node timeout of reads that carry no lease (holder, locked) when none is set.
READ_TIMEOUT = 0.25


class QuorumStore:
    """Locks on a majority of independent masters."""

    def __init__(self, clients: Sequence[Any], per_node_timeout: float | None = None) -> None:
        if isinstance(clients, (str, bytes)) or not isinstance(clients, Sequence) or not clients:
            raise ConfigError("Redlock needs a non-empty list of Redis clients, one per master")
        stores = [RedisStore.of(c) for c in clients]
        identities = [_identity(s.client) for s in stores]
        twice = sorted(
            {s.address for s, i in zip(stores, identities, strict=True) if identities.count(i) > 1}
        )
        if twice:
            raise ConfigError(
                "Redlock masters must be distinct servers; listed more than once: "
                + ", ".join(twice)
            )
        if per_node_timeout is not None and (
            isinstance(per_node_timeout, bool) or not per_node_timeout > 0
        ):
            raise ConfigError(f"per_node_timeout must be > 0 seconds, got {per_node_timeout!r}")
        self._members = tuple(stores)
        self.quorum = len(stores) // 2 + 1
        self.per_node_timeout = per_node_timeout

    @property
    def members(self) -> Sequence[RedisStore]:
        return self._members

    @property
    def clients(self) -> list[Any]:
        """The masters' clients, in the order given."""
        return [m.client for m in self._members]

    def describe(self) -> str:
        return ", ".join(m.address for m in self._members)

    def timeout(self, ttl_ms: int | None) -> float:
        """How long to wait for each master: the set per-node timeout, else 5% of the lease."""
        if self.per_node_timeout is not None:
            return self.per_node_timeout
        return READ_TIMEOUT if ttl_ms is None else node_timeout(ttl_ms / 1000)

    def unavailable(self, name: str, outcomes: Mapping[str, str]) -> QuorumUnavailable:
        return QuorumUnavailable(name, outcomes, needed=self.quorum, total=len(self._members))

    def _outcomes(self, results: Sequence[Any], ok: Callable[[Any], str]) -> dict[str, str]:
        return {
            m.address: ok(v) if answered(v) else f"{type(v).__name__}: {v}"
            for m, v in zip(self._members, results, strict=True)
        }

    # -- acquire ------------------------------------------------------------------------
    def acquire(
        self, keys: LockKeys, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int
    ) -> Grant:
        n, q = len(self._members), self.quorum
        timeout = self.timeout(ttl_ms)
        command = acquire_command(keys, token, ttl_ms, record, wait=wait, fence_ttl_ms=fence_ttl_ms)
        fan = FanOut(self._members, command, timeout)

        def decided(results: Sequence[Any]) -> bool:
            # A refusal waits for every answer (up to the timeout): who holds what on
            # each master tells a holder with a majority from a split vote.
            replies = [v for v in results if answered(v)]
            return len(replies) == n or sum(1 for v in replies if int(v[0]) == 1) >= q

        results = fan.wait(decided)
        fences = {i: int(v[1]) for i, v in enumerate(results) if answered(v) and int(v[0]) == 1}
        outcomes = self._outcomes(results, _describe_acquire)
        if len(fences) >= q:
            fan.finish()
            fence = self._settle_fence(keys, fences, fence_ttl_ms, timeout, outcomes)
            if fence is not None:
                return Grant(True, fence=fence, masters=outcomes)
            self._give_back(keys, token, ttl_ms, fences, timeout)
            raise self.unavailable(keys.name, outcomes)
        release = release_command(keys, token, ttl_ms)
        fan.finish(then=release)  # behind every acquire not answered
        self._give_back(keys, token, ttl_ms, fences, timeout)
        for i in fences:
            outcomes[self._members[i].address] += ", given back"
        held = {
            i: (text(v[1]), int(v[2]))
            for i, v in enumerate(results)
            if answered(v) and int(v[0]) != 1
        }
        foreign = [v for v in results if is_foreign(v)]
        if foreign:  # e.g. WRONGTYPE: data under our keys, not a Redis outage
            raise ConfigError(
                f"lock {keys.name!r}: {len(foreign)} of {n} masters refused the acquire "
                f"script on the data at {keys.lock!r} "
                f"({'; '.join(f'{m}: {o}' for m, o in outcomes.items())}): something other "
                "than celery-redlock writes under the lock key prefix"
            )
        if len(fences) + len(held) < q:
            # Too few masters answered to decide anything: Redis trouble, not contention.
            raise self.unavailable(keys.name, outcomes)
        unknown = n - len(fences) - len(held)
        # Contention. Group the refusals by holder record (one per acquisition).
        groups = Counter(record for record, _ in held.values())
        top, top_count = groups.most_common(1)[0]
        top_ttls = [ms for record, ms in held.values() if record == top and ms >= 0]
        wait_on = next(i for i, (record, _) in held.items() if record == top)
        if top_count + unknown >= q and top_ttls:
            wait_ms = max(1, min(top_ttls))  # that holder may own a majority: wait for it
        else:
            # A split vote: nobody has a majority. Retry after a short random delay
            # (or sooner, on a release notice from one of the other contenders).
            wait_ms = max(1, int(random.uniform(0.2, 1.0) * max(timeout, 0.01) * 1000))
            if top_ttls:
                wait_ms = min(wait_ms, max(1, min(top_ttls)))
        return Grant(
            False,
            holder=parse_holder(top),
            holder_ttl_ms=min(top_ttls) if top_ttls else None,
            wait_ms=wait_ms,
            wait_on=wait_on,
            masters=outcomes,
        )

    def _give_back(
        self, keys: LockKeys, token: str, ttl_ms: int, granted: Mapping[int, int], timeout: float
    ) -> None:
        """Release where the attempt was granted, waiting up to *timeout* for it."""
        if not granted:
            return
        members = [self._members[i] for i in granted]
        fan = FanOut(members, release_command(keys, token, ttl_ms), timeout)
        fan.wait(lambda results: all(answered(v) for v in results))
        fan.finish()

    def _settle_fence(
        self,
        keys: LockKeys,
        fences: Mapping[int, int],
        fence_ttl_ms: int,
        timeout: float,
        outcomes: dict[str, str],
    ) -> int | None:
        """Make a quorum hold a counter >= the chosen fence; return it, or None if it could not."""
        fence = max(fences.values())
        have = sum(1 for f in fences.values() if f == fence)
        if have >= self.quorum:
            return fence
        lower = [i for i, f in fences.items() if f < fence]
        need = self.quorum - have
        raise_fence = RAISE_FENCE([keys.fence], [fence, fence_ttl_ms])
        fan = FanOut([self._members[i] for i in lower], raise_fence, timeout)

        def raised(results: Sequence[Any]) -> int:
            return sum(1 for v in results if answered(v) and int(v) >= fence)

        results = fan.wait(lambda r: raised(r) >= need)
        fan.finish()
        if raised(results) >= need:
            return fence
        for i, value in zip(lower, results, strict=True):
            if not answered(value):
                outcomes[self._members[i].address] = (
                    f"acquired, but writing fence {fence} back failed ({value})"
                )
        return None

    # -- release, extend ------------------------------------------------------------------
    def release(
        self, keys: LockKeys, token: str, notice_ms: int, done: tuple[str, int] | None = None
    ) -> Status:
        fan = FanOut(
            self._members, release_command(keys, token, notice_ms, done), self.timeout(notice_ms)
        )
        q = self.quorum
        results = fan.wait(lambda r: _count(r, Status.OK) >= q)
        fan.finish()
        codes = [Status.of(v) for v in results if answered(v)]
        ok = codes.count(Status.OK)
        if ok >= q:
            return Status.OK
        unknown = len(self._members) - len(codes)
        if min(codes, default=Status.OK) < Status.GONE and ok + unknown < q:
            return min(codes)  # another owner (TAKEN), or foreign data (FOREIGN)
        if len(codes) < q:
            raise self.unavailable(keys.name, self._outcomes(results, _describe_code))
        return Status.GONE

    # -- the enqueue-time hold: not over a quorum ---------------------------------------
    def handover(
        self,
        keys: LockKeys,
        token: str,
        ttl_ms: int,
        record: str,
        *,
        owner: str,
        strict: bool,
        wait: bool,
        fence_ttl_ms: int,
    ) -> Grant:
        raise ConfigError(no_queued_holds(keys.name, len(self._members)))

    def enqueue(
        self,
        keys: LockKeys,
        owner: str,
        ttl_ms: int,
        record: str,
        *,
        replace: bool,
        running_blocks: bool,
    ) -> Queued:
        raise ConfigError(no_queued_holds(keys.name, len(self._members)))

    def dequeue(self, keys: LockKeys, owner: str) -> Status:
        raise ConfigError(no_queued_holds(keys.name, len(self._members)))

    def was_done(self, keys: LockKeys, mark: str) -> bool:
        """True when any master that answers has *mark* (a mark is written only where a
        run holding the lock finished, so one master's is enough to know it ran)."""
        fan = FanOut(self._members, Plain("ZSCORE", keys.done, mark), self.timeout(None))
        results = fan.wait(lambda r: any(answered(v) and v is not None for v in r))
        fan.finish()
        if any(answered(v) and v is not None for v in results):
            return True
        if sum(1 for v in results if answered(v)) < self.quorum:
            raise self.unavailable(keys.name, self._outcomes(results, lambda v: "answered"))
        return False

    def abandon(self, keys: LockKeys, token: str, notice_ms: int) -> None:
        fan = FanOut(
            self._members, release_command(keys, token, notice_ms), self.timeout(notice_ms)
        )
        fan.finish()

    def extend(self, keys: LockKeys, token: str, ms: int, *, replace: bool) -> int | Status:
        extend = EXTEND([keys.lock], [token, ms, "1" if replace else "0"])
        fan = FanOut(self._members, extend, self.timeout(ms))
        q = self.quorum
        results = fan.wait(lambda r: sum(1 for v in r if _lease(v) > 0) >= q)
        fan.finish()
        codes = [int(v) for v in results if answered(v)]
        leases = sorted((c for c in codes if c > 0), reverse=True)
        if len(leases) >= q:
            # The lock lives while a majority holds it: until the q-th longest lease ends.
            return leases[q - 1]
        unknown = len(self._members) - len(codes)
        if len(leases) + unknown >= q:
            raise self.unavailable(keys.name, self._outcomes(results, _describe_code))
        return min(Status.of(min(codes, default=0)), Status.GONE)

    # -- reads ----------------------------------------------------------------------------
    def holder(self, keys: LockKeys) -> Holder | None:
        """The acquisition a majority holds, None when a majority is free (or split)."""
        fan = FanOut(self._members, Plain("HMGET", keys.lock, "token", "info"), self.timeout(None))
        results = fan.wait(lambda r: all(answered(v) for v in r))
        fan.finish()
        replies = [v for v in results if answered(v)]
        if len(replies) < self.quorum:
            raise self.unavailable(keys.name, self._outcomes(results, lambda v: "answered"))
        tokens = Counter(text(v[0]) for v in replies if v[0] is not None)
        for token, count in tokens.most_common(1):
            if count >= self.quorum:
                info = next(v[1] for v in replies if text(v[0]) == token)
                return Holder(token, parse_holder(info))
        return None

    def locked(self, keys: LockKeys) -> bool:
        fan = FanOut(self._members, Plain("EXISTS", keys.lock), self.timeout(None))
        q = self.quorum
        n = len(self._members)
        results = fan.wait(
            lambda r: _count(r, 1) >= q or sum(1 for v in r if answered(v) and not v) > n - q
        )
        fan.finish()
        yes = _count(results, 1)
        if yes >= q:
            return True
        if sum(1 for v in results if answered(v) and not v) > n - q:
            return False
        raise self.unavailable(keys.name, self._outcomes(results, lambda v: "yes" if v else "no"))

    def wait(self, keys: LockKeys, seconds: float, refused: Grant | None = None) -> None:
        """One BLPOP on a master that holds the other owner's key, woken by its release.

        Capped at a quarter of the per-node timeout's lease (at least 1 s): if that
        master goes silent mid-wait, the waiter looks at the others again soon,
        instead of sleeping out the holder's whole lease.
        """
        index = 0 if refused is None else refused.wait_on
        seconds = min(seconds, max(1.0, 5 * self.timeout(None)))
        try:
            self._members[index].wait(keys, seconds)
        except QuorumUnavailable:
            return  # that master just failed: the next attempt finds out about the others

    def settle(
        self, name: str, outcomes: Sequence[Status | BaseException]
    ) -> Status | QuorumUnavailable:
        codes = [o for o in outcomes if not isinstance(o, BaseException)]
        ok = codes.count(Status.OK)
        if ok >= self.quorum:
            return Status.OK
        unknown = len(outcomes) - len(codes)
        if ok + unknown >= self.quorum:  # undecided: a later round may get through
            errors = {
                m.address: f"{type(o).__name__}: {o}"
                for m, o in zip(self._members, outcomes, strict=True)
                if isinstance(o, BaseException)
            }
            return self.unavailable(name, errors)
        return min(min(codes, default=Status.GONE), Status.GONE)

    def __repr__(self) -> str:
        return f"<QuorumStore {self.quorum}/{len(self._members)}: {self.describe()}>"


def _identity(client: Any) -> tuple[Any, ...]:
    """What makes two clients the same server (finer than the address shown to people)."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a RedisCluster: its nodes
        return ("cluster", *sorted((n.host, n.port) for n in client.get_nodes()))
    kwargs = getattr(pool, "connection_kwargs", {})
    manager = getattr(pool, "sentinel_manager", None)
    if manager is not None:  # a Sentinel-managed master: its name *and* its sentinels
        sentinels = sorted(
            tuple(s.connection_pool.connection_kwargs.get(k) for k in ("host", "port"))
            for s in manager.sentinels
        )
        return ("sentinel", pool.service_name, *sentinels, kwargs.get("db", 0))
    return (
        "redis",
        kwargs.get("path") or kwargs.get("host"),
        kwargs.get("port"),
        kwargs.get("db", 0),
    )


def no_queued_holds(name: str, masters: int) -> str:
    """Why a quorum of masters refuses enqueue-time holds."""
    return (
        f"lock {name!r}: enqueue-time holds (lock_on='enqueue' or 'enqueue+run') need one "
        f"Redis (a plain server, a Sentinel master or a Cluster), not a Redlock quorum of "
        f"{masters} masters: the hand-over from the queued hold to the lock could not be one "
        "atomic step on a majority. Use lock_on='run' with these masters, or point "
        "redlock_url at one Redis"
    )


def _count(results: Sequence[Any], code: int) -> int:
    return sum(1 for v in results if answered(v) and int(v) == code)


def _lease(value: Any) -> int:
    return int(value) if answered(value) else 0


def _describe_acquire(value: Any) -> str:
    if int(value[0]) == 1:
        return f"acquired (fence {int(value[1])})"
    return f"held ({describe_holder(parse_holder(value[1]))}, {int(value[2])} ms left)"


def _describe_code(value: Any) -> str:
    code = int(value)
    if code > 1:
        return f"ok ({code} ms)"
    return Status.of(code).describe()
