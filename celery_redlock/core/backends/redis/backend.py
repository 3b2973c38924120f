"""``RedisBackend``: every capability of the seam (:mod:`celery_redlock.core.backend`) on
one Redis.

One Redis is a plain server (``redis.Redis``), a Sentinel master (``master_for()``) or a
Redis Cluster (``RedisCluster``, whose client routes each call to the node that owns the
key's slot and follows ``MOVED``/``ASK``). Every mutation is one owner-checked Lua script
(``lua/*.lua``); each verb's script, keys, arguments and reply reading are written once in
:mod:`.verbs`, and run here (:meth:`RedisBackend._run`, the one way a script runs: through
the :class:`~.sentinel.MasterWatch` of a Sentinel-managed master, else
:func:`~.scripts.run`) or sent now and answered later (:meth:`RedisBackend.send`,
:class:`~.sent.RedisSent`: a quorum's fan-out, a publish's claim). Flow control's
``hold_all.lua`` and ``release_all.lua`` calls are built by :mod:`.flow`; the operator
reads are :mod:`.admin`'s; an unclear acquire's give-back that did not get through is
tried again by :mod:`.giveback`; what redis-py's errors mean is :mod:`.client`'s.

A Redis Cluster runs a script on one node, on the keys of one hash slot; a name's keys
share its slot (:mod:`~celery_redlock.core.keys`), so a name's controls are read in its
own acquire there too. A run whose rules name keys in other slots sends one
``hold_all.lua`` per slot: the primary's (with the rules that share its slot) and one with
no primary (``'none'``) for each other slot, all written to their nodes before any answer
is read (:class:`~.sent.RedisSent`, on the connection pool of each slot's node), so the
run costs one round trip whatever the slots. When any slot refuses, what the others
granted is given back before the call returns (permits released, Rate units returned), so
the run holds all or nothing once the call returns. Its release goes to each slot the same
way; extend and renewal go to each slot too. A slot that moved to another node since the
client last looked answers MOVED: its script is sent again through the cluster client,
which finds the slot's node.

Errors: see :func:`~.client.cannot_decide` for what is reported as
:class:`~celery_redlock.core.errors.StoreUnavailable`; an error reply about the data at a
lock's keys is a :class:`~celery_redlock.core.errors.ConfigError` (foreign data);
anything else is raised as it is.

Nothing is held past a call: the backend keeps the client, its address and whether it is
a cluster. Each verb takes a connection from the client's pool and gives it back on every
path (:func:`~.scripts.run`, or redis-py's own commands); :meth:`RedisBackend.wait`,
which needs a read deadline of its own, takes one and gives it back itself.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import partial
from typing import Any, NoReturn

from redis import exceptions as rx
from redis.cluster import RedisCluster

from ... import process
from ...backend import Sendable
from ...backend_types import (
    Claim,
    Control,
    ForceRelease,
    Grant,
    Handover,
    Health,
    Holder,
    LockInfo,
    Queued,
    RateGrant,
    RateInfo,
    Renewal,
    Rule,
    Slot,
    Status,
    mutex_keys,
    parse_holder,
    text,
)
from ...connect import address_of
from ...errors import ConfigError, ForeignData, StoreUnavailable
from ...keys import name_of_key
from ...listing import Listing, ListQuery, select
from . import admin, giveback, verbs
from .admin import fence_of, foreign_data_message, node_of, primaries
from .client import (
    MasterChanging,
    cannot_decide,
    check_client,
    checkout,
    lock_client,
    plain_pool,
    probe,
    server_refused,
)
from .flow import (
    RULE_ARGS,
    deciding_reply,
    hold_call,
    moved,
    primary_args,
    release_call,
    rule_items,
    rule_renewals,
)
from .scripts import HOLD_ALL, LOG_EVENTS, RELEASE_ALL, Script, pool_of, run
from .sent import RedisSent
from .sentinel import is_sentinel_master, watch_of
from .verbs import Call

__all__ = ["RedisBackend"]


#: How long after its time a wait's ``BLPOP`` may answer before the wait ends without it.
WAIT_SLACK = 0.002
#: The most events one ``log_events.lua`` call appends.
EVENTS_PER_CALL = 500


class RedisBackend:
    """The backend of one Redis client (every capability of the seam): :meth:`of` gives
    the one of a client object.

    ``client`` is the one its calls go through (:func:`~.client.lock_client`: the same
    server, the lock clients' policy), ``given`` what the backend is the backend of: the
    user's client when its calls go through it, else the lock client (which holds nothing
    of the user's, so the backend can live as long as the user's pool without keeping it
    alive)."""

    masters = 1
    holds_permits = True

    def __init__(self, client: Any) -> None:
        check_client(client)
        self.client = lock_client(client)
        self.given = self.client
        self.cluster = isinstance(client, RedisCluster)
        #: Where a script's connection comes from (None: the client's own evalsha).
        self._pool = None if self.cluster else pool_of(self.client)
        #: The pool of a Sentinel-managed master (its scripts go through its watch).
        self._sentinel = self._pool if is_sentinel_master(self._pool) else None
        #: Whether its scripts keep the operator's index (index.lua): not on a cluster,
        #: where a script reaches one hash slot only.
        self.indexed = not self.cluster
        self._address: str | None = None

    @classmethod
    def of(cls, client: Any) -> RedisBackend:
        """The backend of *client* in this process: one per plain pool, living as long as
        the pool (a Lock made per call finds it made); one per client object for any other
        client, kept while used."""
        pool = plain_pool(client)
        if pool is not None:
            return process.made_once(_pool_backends, pool, lambda: cls(client), _backends_lock)
        ref = _backends.get(id(client))
        backend = None if ref is None else ref()
        if backend is None or backend.given is not client:
            with _backends_lock:
                ref = _backends.get(id(client))
                backend = None if ref is None else ref()
                if backend is None or backend.given is not client:
                    backend = cls(client)
                    _backends[id(client)] = new = weakref.ref(backend)
                    weakref.finalize(backend, _forget, id(client), new)
        return backend

    def on_node(self, node: Any) -> RedisBackend:
        """The backend of one node's client (the operator reads of a cluster)."""
        return RedisBackend.of(node)

    def describe(self) -> str:
        """The password-free address, for log lines and errors."""
        if self._address is None:
            self._address = address_of(self.client)
        return self._address

    def identity(self) -> Hashable:
        client = self.client
        if self.cluster:  # its nodes
            return ("cluster", *sorted((n.host, n.port) for n in client.get_nodes()))
        pool = client.connection_pool
        kwargs = getattr(pool, "connection_kwargs", {})
        manager = getattr(pool, "sentinel_manager", None)
        if manager is not None:  # a Sentinel-managed master: its name *and* its sentinels
            sentinels = sorted(
                tuple(s.connection_pool.connection_kwargs.get(k) for k in ("host", "port"))
                for s in manager.sentinels
            )
            return ("sentinel", pool.service_name, *sentinels, kwargs.get("db", 0))
        host = kwargs.get("path") or kwargs.get("host")
        return ("redis", host, kwargs.get("port"), kwargs.get("db", 0))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RedisBackend) and other.given is self.given

    def __hash__(self) -> int:
        return hash(id(self.given))

    def __repr__(self) -> str:
        return f"<RedisBackend {self.describe()}>"

    def check(self) -> list[Health]:
        """The server's health (:func:`~.client.probe`): PING, then ROLE."""
        return [probe(self.describe(), self.client, cluster=self.cluster)]

    # -- how a verb calls the server ------------------------------------------------------
    def _run(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """*script* on this Redis: the one way a script runs (a Sentinel-managed master's
        behind its watch's guard, see :mod:`.sentinel`), the variant that keeps the
        operator's index where there is one (:attr:`~.scripts.Script.indexed`)."""
        if self.indexed:
            script = script.indexed
        if self._sentinel is None:
            return run(script, self.client, self._pool, keys, args)
        return watch_of(self._sentinel).run(self._sentinel, script, keys, args)

    def _call(self, call: Call) -> Any:
        """*call* run (:meth:`_run`), its reply read."""
        return call.read(self._run(call.script, call.keys, call.args))

    def unavailable(self, name: str, exc: BaseException, where: str = "") -> StoreUnavailable:
        """The error for lock *name* when this Redis (or node *where*) could not decide."""
        return StoreUnavailable(name, {where or self.describe(): f"{type(exc).__name__}: {exc}"})

    def _errors(self, name: str, foreign: Callable[[Exception], str] | None = None) -> _Errors:
        """Report what cannot be decided as unavailable and an error reply about the data
        (with *foreign*, which words it) as ForeignData; let everything else through."""
        return _Errors(self, name, foreign)

    def _guard(self, slot: Slot) -> _Errors:
        """:meth:`_errors` for a verb of *slot*: foreign data worded from its keys."""
        return _Errors(self, slot.name, partial(foreign_data_message, self.client, slot.keys))

    # -- an acquisition's life ------------------------------------------------------------
    def acquire(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int,
        deadline: float | None = None, fence_step_ms: int = 0
    ) -> Grant:  # fmt: skip
        """*fence_step_ms*: a mutex's counter restart rounds up to that step (a quorum's
        member: acquire.lua's ARGV[6])."""
        call = verbs.acquire(
            slot, token, ttl_ms, record, wait=wait, fence_ttl_ms=fence_ttl_ms,
            fence_step_ms=fence_step_ms,
        )  # fmt: skip
        return self._acquire(slot, token, ttl_ms, call)

    def take_over(
        self, slot: Slot, token: str, ttl_ms: int, record: str, handover: Handover, *,
        wait: bool, fence_ttl_ms: int
    ) -> Grant:  # fmt: skip
        call = verbs.take_over(
            slot, token, ttl_ms, record, handover, wait=wait, fence_ttl_ms=fence_ttl_ms
        )
        return self._acquire(slot, token, ttl_ms, call)

    def _acquire(self, slot: Slot, token: str, ttl_ms: int, call: Call) -> Grant:
        try:
            if slot.flow:
                return verbs.grant_of(self._hold_all(slot, call.keys, call.args), slot)
            reply = self._run(call.script, call.keys, call.args)
        except Exception as exc:
            self._acquire_failed(slot, token, ttl_ms, exc)
        return call.read(reply)  # type: ignore[no-any-return]

    def _acquire_failed(self, slot: Slot, token: str, ttl_ms: int, exc: Exception) -> NoReturn:
        """Raise what an acquire that met *exc* raises, after taking back what its token
        may hold when the script may have run."""
        if isinstance(exc, MasterChanging):  # refused before the script did anything
            raise self.unavailable(slot.name, exc) from exc
        foreign = isinstance(exc, rx.ResponseError) and not server_refused(exc)
        if not foreign and not cannot_decide(exc):
            raise exc  # never sent, or a bug: nothing to take back
        # The script may have run (a lost reply), or stopped at foreign data after
        # writing: take back whatever this token may hold (see _abandon). A copy that
        # reaches the server after the last give-back lives out its lease.
        self._abandon(slot, token, ttl_ms, here=not _timed_out(exc))
        if foreign:
            raise ForeignData(foreign_data_message(self.client, slot.keys, exc)) from exc
        raise self.unavailable(slot.name, exc) from exc

    def _failed(self, slot: Slot, exc: Exception) -> NoReturn:
        """Raise what a verb of *slot* that met *exc* raises (as :meth:`_guard` does)."""
        with self._guard(slot):
            raise exc
        raise AssertionError("unreachable")  # pragma: no cover - the guard raised

    def _abandon(self, slot: Slot, token: str, notice_ms: int, *, here: bool = True) -> None:
        """Take back what *token* may hold of *slot* and its rules, best effort, never
        raising: here once (not after the server timed out: the caller does not wait a
        second socket timeout), and when that does not get through, once more a little
        later from the process's give-back thread (:func:`.giveback.later`). What is not
        taken back expires with its lease."""
        if here:
            with contextlib.suppress(Exception):
                self.release(slot, token, notice_ms)
                return
        giveback.later(lambda: self.release(slot, token, notice_ms))

    # -- sent now, answered later ---------------------------------------------------------
    def send(
        self, verb: Sendable, args: tuple[Any, ...], kwargs: Mapping[str, Any],
        answered: Callable[[bool], object], behind: Any = None
    ) -> RedisSent | None:  # fmt: skip
        """An acquire, release, release_done, extend, enqueue or raise_fence of a mutex
        written now on a connection of the client's pool, its answer read later (a
        quorum's fan-out, a publish's claim: see :mod:`.sent`); None for anything else (a
        cluster, a Sentinel-managed master, a permit, another verb)."""
        slot = args[0] if args else None
        build = verbs.SENDABLE.get(verb)
        if build is None or self._pool is None or not isinstance(slot, Slot) or slot.permits:
            return None
        if self._sentinel is not None:  # each script checks where it lands (sentinel)
            return None
        call = build(*args, **kwargs)
        fail: Callable[[Exception], Any]
        if verb is Sendable.ACQUIRE:
            fail = partial(self._acquire_failed, slot, args[1], args[2])
        else:
            fail = partial(self._failed, slot)
        before = behind if isinstance(behind, RedisSent) else None
        call = call._replace(script=call.script.indexed)  # never a cluster's (no pool)
        return RedisSent(self._pool, call, fail, answered, before)

    def release(self, slot: Slot, token: str, notice_ms: int) -> Status:
        return self._give_back(slot, verbs.release(slot, token, notice_ms))

    def release_done(
        self, slot: Slot, token: str, notice_ms: int, mark: str, mark_ms: int
    ) -> Status:
        return self._give_back(slot, verbs.release_done(slot, token, notice_ms, mark, mark_ms))

    def _give_back(self, slot: Slot, call: Call) -> Status:
        try:  # not the guard's context manager: a release is on every run's path
            if slot.held_rules:
                return self._release_all(slot, call.keys, call.args)
            return call.read(self._run(call.script, call.keys, call.args))  # type: ignore[no-any-return]
        except Exception as exc:
            self._failed(slot, exc)

    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        with self._guard(slot):
            lease: int | Status = self._call(verbs.extend(slot, token, ms, replace=replace))
            if not isinstance(lease, Status) and slot.held_rules:
                rules = self._extend_rules(slot, token, lease)
                if rules is not Status.OK:
                    return rules
        return lease

    def renew(self, items: Sequence[Renewal]) -> list[Status | StoreUnavailable]:
        """One script per node: ``extend_many.lua`` on a plain Redis; on a cluster
        ``extend_node.lua`` on each node for every item it serves, whatever their slots
        (one ``extend_many.lua`` per slot where the node refuses that: slots moving, or
        a server without script flags)."""
        if not items:
            return []
        if not any(item.slot.held_rules for item in items):
            return self._renew_flat(items)
        flat, where = rule_renewals(items)  # each item's Limits renewed beside it
        outcomes = self._renew_flat(flat)
        return [_first_failure([outcomes[i] for i in own]) for own in where]

    def _renew_flat(self, items: Sequence[Renewal]) -> list[Status | StoreUnavailable]:
        """*items* renewed as they are: one ``extend_many.lua`` on a plain Redis, else
        :meth:`_renew_nodes`."""
        if self.cluster:
            return self._renew_nodes(items)
        with self._errors(items[0].slot.name):
            return [*self._call(verbs.extend_many(items))]

    def _renew_nodes(self, items: Sequence[Renewal]) -> list[Status | StoreUnavailable]:
        """A cluster's renewal: ``extend_node.lua`` on each node for the items it serves."""
        by_node: dict[str, list[int]] = defaultdict(list)
        nodes: dict[str, Any] = {}
        for i, item in enumerate(items):
            node = self.client.get_node_from_key(item.slot.keys.lock)
            by_node[node.name].append(i)
            nodes[node.name] = node
        out: list[Status | StoreUnavailable] = [Status.GONE] * len(items)
        for name, indexes in by_node.items():
            part = [items[i] for i in indexes]
            found: Sequence[Status | StoreUnavailable]
            try:
                found = self._extend_node(nodes[name], part)
            except Exception as exc:
                if not cannot_decide(exc):
                    raise
                failed = self.unavailable(part[0].slot.name, exc, where=name)
                failed.__cause__ = exc
                found = [failed] * len(part)
            for i, status in zip(indexes, found, strict=True):
                out[i] = status
        failures = [o for o in out if isinstance(o, StoreUnavailable)]
        if len(failures) == len(out):
            raise failures[0]
        return out

    def _extend_node(self, node: Any, items: Sequence[Renewal]) -> list[Status]:
        call = verbs.extend_node(items)
        try:
            node_client = self.client.get_redis_connection(node)
            return call.read(run(call.script, node_client, None, call.keys, call.args))  # type: ignore[no-any-return]
        except rx.ResponseError as exc:
            if server_refused(exc):
                raise
        by_slot: dict[int, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_slot[self.client.keyslot(item.slot.keys.lock)].append(i)
        statuses = [Status.GONE] * len(items)
        for indexes in by_slot.values():
            found = self._call(verbs.extend_many([items[i] for i in indexes]))
            for i, status in zip(indexes, found, strict=True):
                statuses[i] = status
        return statuses

    def wait(self, slot: Slot, seconds: float, refused: Grant | None = None) -> None:
        """One ``BLPOP`` on the notify list, on a connection taken from the pool with a read
        deadline of its own (a wait longer than the socket timeout is still one command,
        and the client's retry policy never re-sends it), always given back.

        The deadline is the caller's, not the server's: Redis ends a blocked command on
        its timer (``hz``: up to 100 ms late). A wait not answered :data:`WAIT_SLACK`
        after its time closes its connection (the server then drops the ``BLPOP`` and no
        notice is taken)."""
        client, key = self.client, slot.keys.notify
        if self.cluster:
            client = client.get_redis_connection(client.get_node_from_key(key))
        seconds = round(max(seconds, 0.001), 3)
        pool = client.connection_pool
        with self._guard(slot):
            conn = checkout(pool)
            try:
                conn.send_command("BLPOP", key, f"{seconds:.3f}")
                if conn.can_read(timeout=seconds + WAIT_SLACK):
                    conn.read_response()
                else:  # no reply in time: the connection is in an unknown state
                    conn.disconnect()
            except BaseException:
                conn.disconnect()
                raise
            finally:
                pool.release(conn)

    def raise_fence(self, slot: Slot, fence: int, fence_ttl_ms: int) -> int:
        with self._guard(slot):
            return self._call(verbs.raise_fence(slot, fence, fence_ttl_ms))  # type: ignore[no-any-return]

    # -- reads ----------------------------------------------------------------------------
    def holders(self, slot: Slot) -> list[Holder]:
        with self._guard(slot):
            if slot.permits:
                return self._call(verbs.permits(slot))  # type: ignore[no-any-return]
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(slot.keys.lock, "token", "fence", "info")
            pipe.pttl(slot.keys.lock)
            (token, fence, info), ttl = pipe.execute()
        if token is None:
            return []
        return [Holder(text(token), parse_holder(info), fence=fence_of(fence), ttl_ms=int(ttl))]

    def locked(self, slot: Slot) -> bool:
        with self._guard(slot):
            if slot.permits:
                return len(self._call(verbs.permits(slot))) >= slot.limit
            return bool(self.client.exists(slot.keys.lock))

    def was_done(self, slot: Slot, mark: str) -> bool:
        if not slot.keys.done:
            return False  # permits keep no done marks
        with self._guard(slot):
            return self.client.zscore(slot.keys.done, mark) is not None

    # -- queued holds -----------------------------------------------------------------------
    def enqueue(
        self, slot: Slot, owner: str, ttl_ms: int, record: str, *, replace: bool,
        running_blocks: bool
    ) -> Queued:  # fmt: skip
        call = verbs.enqueue(
            slot, owner, ttl_ms, record, replace=replace, running_blocks=running_blocks
        )
        with self._guard(slot):
            return self._call(call)  # type: ignore[no-any-return]

    def dequeue(self, slot: Slot, owner: str) -> Status:
        call = verbs.dequeue(slot, owner)
        with self._guard(slot):
            return self._call(call)  # type: ignore[no-any-return]

    def park(
        self, slot: Slot, token: str, owner: str, ttl_ms: int, *, record: str, notice_ms: int
    ) -> Status:
        call = verbs.park(slot, token, owner, ttl_ms, record=record, notice_ms=notice_ms)
        with self._guard(slot):
            return self._call(call)  # type: ignore[no-any-return]

    # -- rates and records ------------------------------------------------------------------
    def rate(
        self, name: str, key: str, interval_us: int, burst: int, *, mode: str,
        most_us: int = 0, grace_us: int = 0
    ) -> RateGrant:  # fmt: skip
        def foreign(exc: Exception) -> str:
            return (
                f"rate limiter {name!r}: Redis refused the rate script on {key!r} ({exc}): "
                "something other than celery-redlock writes under the key prefix; delete "
                "that key if it is stale, or give celery-redlock a prefix of its own"
            )

        call = verbs.rate(key, interval_us, burst, mode=mode, most_us=most_us, grace_us=grace_us)
        with self._errors(name, foreign):
            return self._call(call)  # type: ignore[no-any-return]

    def load_records(self, slot: Slot, suffix: str) -> dict[str, str]:
        key = f"{slot.keys.lock}:{suffix}"
        with self._errors(slot.name, partial(_records_message, key)):
            found = self.client.hgetall(key)
        return {text(name): text(value) for name, value in found.items()}

    def claim(  # noqa: PLR0917 - the Records protocol's signature
        self, slot: Slot, suffix: str, token: str, name: str, value: str,
        version: tuple[int, int], deadline: float | None = None
    ) -> Claim:  # fmt: skip
        """See :meth:`~celery_redlock.core.backend.Records.claim`; one Redis answers
        within its client's socket timeout, so *deadline* (a quorum's bound) is not
        needed here."""
        key = f"{slot.keys.lock}:{suffix}"
        call = verbs.claim(slot, key, token, name, value, version=version)
        with self._errors(slot.name, partial(_records_message, key)):
            return self._call(call)  # type: ignore[no-any-return]

    # -- operator reads and forced removals -----------------------------------------------
    def _node_permits(self, node: Any, slot: Slot) -> list[Holder]:
        return self.on_node(node).holders(slot)

    def scan(self, prefix: str, pattern: str = "*", limit: int | None = None) -> list[LockInfo]:
        with self._errors(pattern):
            return admin.scan(self.client, prefix, pattern, self._node_permits, limit)

    def read(self, prefix: str, name: str) -> list[LockInfo]:
        with self._errors(name):
            return admin.read(self.client, prefix, name, self._node_permits)

    def listing(self, prefix: str, query: ListQuery) -> Listing:
        """*query*'s page from the index (:func:`.admin.listing`); on a cluster, which has
        none, from a walk of every primary (``SCAN``)."""
        with self._errors(query.pattern):
            if self.indexed:
                return admin.listing(
                    self.client, prefix, query, self._node_permits, self._controls_at
                )
            locks = admin.scan(self.client, prefix, query.pattern, self._node_permits)
            rates = admin.scan_rates(self.client, prefix, query.pattern)
        return select(prefix, locks, rates, self.controls(prefix, query.pattern), query)

    def scan_rates(self, prefix: str, pattern: str = "*") -> list[RateInfo]:
        with self._errors(pattern):
            return admin.scan_rates(self.client, prefix, pattern)

    def read_rate(self, prefix: str, name: str) -> RateInfo | None:
        with self._errors(name):
            return admin.read_rate(self.client, prefix, name)

    def force_release(self, slot: Slot, fence: int | None, notice_ms: int) -> ForceRelease:
        if slot.permits:
            raise ConfigError(f"lock {slot.name!r}: a permit is not released by force")
        with self._guard(slot):
            return self._call(verbs.force_release(slot, fence, notice_ms))  # type: ignore[no-any-return]

    def force_dequeue(self, slot: Slot, owner: str | None) -> ForceRelease:
        keys = mutex_keys(slot)
        with self._guard(slot):
            found, info = self.client.hmget(keys.queued, "owner", "info")
            if found is None:
                return ForceRelease("gone")
            record = parse_holder(info)
            record.setdefault("task_id", text(found))
            if owner is not None and text(found) != owner:
                return ForceRelease("refused", record)
            code = self._call(verbs.dequeue(slot, text(found)))
        if code is Status.OK:
            return ForceRelease("released", record)
        return ForceRelease("gone" if code is Status.GONE else "refused", record)

    # -- the lock event log (the board's) ----------------------------------------------------
    def log_events(self, log_key: str, events: Sequence[str], maxlen: int, ttl_ms: int) -> None:
        """``log_events.lua``: ``XADD <log_key> MAXLEN ~ <maxlen>`` per event, then
        ``PEXPIRE``, one script call per :data:`EVENTS_PER_CALL` events (a bounded time
        inside the server)."""
        with self._errors(log_key, partial(_not_a_log, log_key)):
            for start in range(0, len(events), EVENTS_PER_CALL):
                chunk = events[start : start + EVENTS_PER_CALL]
                self._run(LOG_EVENTS, [log_key], [maxlen, ttl_ms, *chunk])

    def read_events(self, log_key: str, count: int) -> list[str]:
        """``XREVRANGE <log_key> + - COUNT <count>``: the newest first."""
        with self._errors(log_key, partial(_not_a_log, log_key)):
            entries = self.client.xrevrange(log_key, count=count)
        return [text(fields.get(b"e", fields.get("e", b""))) for _, fields in entries]

    # -- flow control: a slot with rules or controls ----------------------------------------
    def set_control(self, control_key: str, kind: str, value: str | None, ttl_ms: int) -> bool:
        with self._errors(control_key):
            return self._call(verbs.control(control_key, kind, value, ttl_ms))  # type: ignore[no-any-return]

    def controls(self, prefix: str, pattern: str = "*") -> list[Control]:
        """Every control in force whose name matches *pattern*: from the index's control
        keys under the pattern's literal head (:func:`.admin.controls_under`), or, on a
        cluster, from a walk of every primary (``SCAN``)."""
        found: list[Control] = []
        with self._errors(prefix):
            if self.indexed:
                keys = admin.controls_under(self.client, prefix, pattern)
            else:
                keys = [
                    text(key)
                    for node in primaries(self.client)
                    for key in node.scan_iter(match=f"{prefix}{{{pattern}}}:control", count=500)
                ]
            for key in keys:
                found += self._controls_at(key, prefix)
        return sorted(found, key=lambda c: (c.name, c.kind))

    def _controls_at(self, key: str, prefix: str) -> list[Control]:
        pipe = node_of(self.client, key).pipeline(transaction=False)
        pipe.hgetall(key)
        pipe.execute_command("TIME")
        fields, (secs, micros) = pipe.execute()
        now = int(secs) * 1000 + int(micros) // 1000
        name = name_of_key(key, prefix)
        out = []
        for kind, raw in fields.items():
            until, _, value = text(raw).partition("|")
            try:
                end = int(until or 0)
            except ValueError:  # not a control celery-redlock wrote: left alone
                continue
            if end and end <= now:
                continue
            out.append(Control(name, text(kind), value, end - now if end else None))
        return out

    def _hold_all(self, slot: Slot, names: list[str], args: list[Any]) -> Any:
        """``hold_all.lua``: the slot's own acquire script (*names*, *args*) with its controls
        and rules (on a cluster, one call per hash slot: see the module)."""
        if self.cluster and slot.rules:
            near, far = self._by_slot(slot, slot.rules)
            if far:
                return self._hold_by_slot(slot, near, far, names, args)
        return self._run(HOLD_ALL, *hold_call(slot, slot.rules, names, args))

    def _hold_by_slot(
        self,
        slot: Slot,
        near: list[int],
        far: dict[int, list[int]],
        names: list[str],
        args: list[Any],
    ) -> Any:
        """The run's holds on a cluster whose rules span several hash slots, one script per
        slot, all written before any answer is read: a reply as one ``hold_all.lua`` would
        give (the fences in the order of ``slot.rules``). When any slot refuses, what the
        others granted is given back first."""
        groups = [near, *(far[where] for where in sorted(far))]
        calls = [hold_call(slot, [slot.rules[i] for i in near], names, args)]
        calls += [
            hold_call(slot, [slot.rules[i] for i in group], [], args[:RULE_ARGS])
            for group in groups[1:]
        ]
        replies = self._at_once(HOLD_ALL, calls)
        granted = [not isinstance(r, Exception) and int(r[0]) == 1 for r in replies]
        if all(granted):
            fences: dict[int, Any] = {}
            for group, reply in zip(groups, replies, strict=True):
                fences.update(zip(group, reply[2:], strict=True))
            return [1, replies[0][1], *(fences[i] for i in range(len(slot.rules)))]
        taken = [i for group, ok in zip(groups, granted, strict=True) if ok for i in group]
        self._give_back_taken(slot, taken, str(args[0]), int(args[1]))
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return deciding_reply(replies)

    def _at_once(self, script: Script, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """*script* with each call's keys and arguments, each written on a connection of
        the cluster node that serves its keys' slot before any answer is read: each call's
        reply, or the error it met (a call not sent because an earlier one could not be
        sent: that error). Every answer sent for is read, every connection given back."""
        sent: list[RedisSent] = []
        failed: Exception | None = None
        for keys, argv in calls:
            try:
                sent.append(self._send_now(script, keys, argv))
            except Exception as exc:  # a client-side error: read what was sent, then say so
                failed = exc
                break
        replies: list[Any] = []
        for each in sent:
            try:
                replies.append(each.result())
            except Exception as exc:
                replies.append(exc)
        return replies + [failed] * (len(calls) - len(sent))

    def _send_now(self, script: Script, keys: list[str], argv: list[Any]) -> RedisSent:
        """*script* written now on a connection of the node that serves its keys' slot,
        its answer read later (``result()``); a slot that moved meanwhile is asked again
        through the cluster client, which finds its node."""

        def elsewhere(exc: Exception) -> Any:
            if moved(exc):
                return self._run(script, keys, argv)
            raise exc

        pool = node_of(self.client, keys[0]).connection_pool
        return RedisSent(pool, Call(script, keys, argv, _same), elsewhere, _nothing)

    def _give_back_taken(self, slot: Slot, taken: list[int], token: str, ttl_ms: int) -> None:
        """Give back a cluster's run that a slot refused (or failed in): its primary and
        Limits (:meth:`_abandon`), and the units of the Rates in *taken* (indexes of
        ``slot.rules``), best effort: what is not given back expires with its lease."""
        self._abandon(slot, token, ttl_ms)
        rates = [i for i in taken if slot.rules[i].is_rate]
        groups: dict[int, list[Rule]] = {}
        for i in rates:
            rule = slot.rules[i]
            groups.setdefault(self.client.keyslot(rule.key), []).append(rule)
        for rules in groups.values():
            keys: list[str] = []
            argv = primary_args(slot, [], [token, ttl_ms])
            for rule in rules:
                keys += [rule.key] * 4
                argv += ["rate", rule.interval_us, rule.cost]
            with contextlib.suppress(Exception):
                self._run(RELEASE_ALL, keys, argv)

    def _by_slot(self, slot: Slot, rules: Sequence[Rule]) -> tuple[list[int], dict[int, list[int]]]:
        """The indexes of *rules* whose keys share *slot*'s cluster hash slot, and the
        others' by their hash slot."""
        here = self.client.keyslot(slot.keys.lock)
        near: list[int] = []
        far: dict[int, list[int]] = {}
        for i, rule in enumerate(rules):
            where = self.client.keyslot(rule.key)
            if where == here:
                near.append(i)
            else:
                far.setdefault(where, []).append(i)
        return near, far

    def _release_all(self, slot: Slot, names: list[str], args: list[Any]) -> Status:
        """``release_all.lua``: the slot's own release (*names*, *args*) and its Limits'
        (on a cluster, one call per hash slot, sent at once: see :meth:`_at_once`)."""
        held = slot.held_rules
        near: list[int] = list(range(len(held)))
        far: dict[int, list[int]] = {}
        if self.cluster:
            near, far = self._by_slot(slot, held)
        if not far:
            codes = self._run(RELEASE_ALL, *release_call(slot, held, names, args))
            return Status.first_failure([Status.of(code) for code in codes])
        calls = [release_call(slot, [held[i] for i in near], names, args)]
        calls += [release_call(slot, [held[i] for i in far[w]], [], args[:2]) for w in sorted(far)]
        replies = self._at_once(RELEASE_ALL, calls)  # each given back whatever the others say
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return Status.first_failure([Status.of(code) for reply in replies for code in reply])

    def _extend_rules(self, slot: Slot, token: str, ms: int) -> Status:
        """Set the lease of *slot*'s Limits held by *token* to *ms*: one script (on a
        cluster, one per hash slot)."""
        groups: dict[int, list[Renewal]] = {}
        for item in rule_items(Renewal(slot, token, ms)):
            where = self.client.keyslot(item.slot.keys.lock) if self.cluster else 0
            groups.setdefault(where, []).append(item)
        codes: list[Status] = []
        for group in groups.values():
            codes += self._call(verbs.extend_many(group))
        return Status.first_failure(codes) if codes else Status.OK


class _Errors:
    """:meth:`RedisBackend._errors` as a plain context manager (one per verb call)."""

    __slots__ = ("backend", "foreign", "name")

    def __init__(
        self, backend: RedisBackend, name: str, foreign: Callable[[Exception], str] | None
    ) -> None:
        self.backend, self.name, self.foreign = backend, name, foreign

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: Any, exc: BaseException | None, _tb: Any) -> None:
        if not isinstance(exc, Exception):
            return
        if cannot_decide(exc):
            raise self.backend.unavailable(self.name, exc) from exc
        if self.foreign is not None and isinstance(exc, rx.ResponseError):
            raise ForeignData(self.foreign(exc)) from exc


def _timed_out(exc: BaseException) -> bool:
    """The server did not answer within the socket timeout (a slow or stopped server)."""
    return isinstance(exc, (rx.TimeoutError, TimeoutError))


def _first_failure(found: Sequence[Status | StoreUnavailable]) -> Status | StoreUnavailable:
    """The outcome of an item renewed with its Limits: the first that did not answer (a
    cluster node), else the first failure (:meth:`~...backend_types.Status.first_failure`)."""
    for each in found:
        if isinstance(each, StoreUnavailable):
            return each
    return Status.first_failure([s for s in found if isinstance(s, Status)])


def _records_message(key: str, exc: Exception) -> str:
    return (
        f"{key!r} holds data that is not a hash of records ({exc}): something other than "
        "celery-redlock writes under the lock key prefix; delete that key if it is stale"
    )


def _same(reply: Any) -> Any:
    return reply


def _nothing(_heard: bool) -> None:
    return None


#: The backend of each plain pool, while the pool lives (it holds none of the user's
#: objects: see RedisBackend).
_pool_backends: weakref.WeakKeyDictionary[Any, RedisBackend] = weakref.WeakKeyDictionary()
#: Any other client's backend, by id(client): weak, so a backend (and the client it
#: keeps) goes when nothing uses it.
_backends: dict[int, weakref.ref[RedisBackend]] = {}
#: Reentrant: a backend dropped in a reference cycle is finalized (_forget) by the cyclic
#: garbage collector, which may run at any allocation, also inside ``of()`` while this
#: thread holds the lock; a plain Lock would deadlock the thread there.
_backends_lock = process.ForkLock(threading.RLock)


def _forget(key: int, ref: weakref.ref[RedisBackend]) -> None:
    with _backends_lock:
        if _backends.get(key) is ref:
            del _backends[key]


def _not_a_log(key: str, exc: Exception) -> str:
    return (
        f"{key!r} is not a stream of lock events ({exc}): something else writes under the "
        "lock key prefix; celery-redlock leaves it alone"
    )
