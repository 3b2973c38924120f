"""``RedisBackend``: the :class:`~celery_redlock.core.backend.Backend` verbs on one Redis.

One Redis is a plain server (``redis.Redis``), a Sentinel master (``master_for()``) or a
Redis Cluster (``RedisCluster``, whose client routes each call to the node that owns the
key's slot and follows ``MOVED``/``ASK``). Every mutation is one owner-checked Lua script
(:mod:`.redis_scripts`: ``core/lua/*.lua``, run with ``evalsha``). The operator reads are
:mod:`.redis_admin`; an unclear acquire's give-back that did not get through is tried
again by :mod:`.redis_giveback`.

Nothing is held past a call: the backend keeps the client, its address and whether it is
a cluster. Each verb takes a connection from the client's pool through redis-py's own
``execute_command`` (or a pipeline), which gives it back on every path; :meth:`wait`,
which needs a read deadline of its own, takes one and gives it back itself.

Errors: see :func:`~.redis_client.cannot_decide` for what is reported as
:class:`~celery_redlock.core.errors.QuorumUnavailable`; data at a lock's keys that is not
ours is a :class:`~celery_redlock.core.errors.ConfigError`; anything else is raised as it is.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any

from redis import exceptions as rx
from redis.cluster import RedisCluster

from .. import process
from ..backend_types import (
    RECENT_BYTES,
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
    parse_holder,
    text,
)
from ..connect import address_of
from ..errors import ConfigError, QuorumUnavailable
from ..keys import LockKeys
from . import redis_admin, redis_giveback
from .redis_admin import fence_of, foreign_data_message
from .redis_client import cannot_decide, check_client, checkout, is_client, server_refused
from .redis_scripts import (
    ACQUIRE,
    CLAIM_FIELD,
    DEQUEUE,
    ENQUEUE,
    EXTEND,
    EXTEND_NODE,
    FORCE_RELEASE,
    PERMIT_ACQUIRE,
    PERMIT_EXTEND,
    PERMIT_RELEASE,
    PERMITS,
    RAISE_FENCE,
    RATE,
    RELEASE,
    Script,
    extend_many,
    grant_of,
    permit_holders,
    pool_of,
    run,
)

__all__ = ["RedisBackend", "cannot_decide", "check_client", "is_client", "server_refused"]


class RedisBackend:
    """The backend of one Redis client (every capability of the seam): :meth:`of` gives
    the one of a client object."""

    masters = 1
    holds_permits = True

    def __init__(self, client: Any) -> None:
        check_client(client)
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        #: Where a script's connection comes from (None: the client's own evalsha).
        self._pool = None if self.cluster else pool_of(client)
        self._address: str | None = None

    @classmethod
    def of(cls, client: Any) -> RedisBackend:
        """The backend of *client* in this process (one per client object, kept while used)."""
        ref = _backends.get(id(client))
        backend = None if ref is None else ref()
        if backend is None or backend.client is not client:
            with _backends_lock:
                ref = _backends.get(id(client))
                backend = None if ref is None else ref()
                if backend is None or backend.client is not client:
                    backend = cls(client)
                    _backends[id(client)] = new = weakref.ref(backend)
                    weakref.finalize(backend, _forget, id(client), new)
        return backend

    def describe(self) -> str:
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
        return isinstance(other, RedisBackend) and other.client is self.client

    def __hash__(self) -> int:
        return hash(id(self.client))

    def __repr__(self) -> str:
        return f"<RedisBackend {self.describe()}>"

    # -- errors -------------------------------------------------------------------------
    def unavailable(self, name: str, exc: BaseException, where: str = "") -> QuorumUnavailable:
        """The error for lock *name* when this Redis (or node *where*) could not decide."""
        return QuorumUnavailable(name, {where or self.describe(): f"{type(exc).__name__}: {exc}"})

    def _errors(self, name: str, foreign: Callable[[Exception], str] | None = None) -> _Errors:
        """Report what cannot be decided as unavailable and an error reply about the data
        (with *foreign*, which words it) as a ConfigError; let everything else through."""
        return _Errors(self, name, foreign)

    def _guard(self, slot: Slot) -> _Errors:
        return _Errors(self, slot.name, partial(foreign_data_message, self.client, slot.keys))

    def _run(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        return run(script, self.client, self._pool, keys, args)

    # -- an acquisition's life --------------------------------------------------------
    def acquire(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int
    ) -> Grant:
        keys = slot.keys
        args: list[Any] = [token, ttl_ms, record, "1" if wait else "0", fence_ttl_ms]
        if slot.permits:
            args.append(slot.limit)
            names = [keys.lock, keys.fence, keys.waiting]
            return self._acquire(slot, token, ttl_ms, PERMIT_ACQUIRE, args, names)
        names = [keys.lock, keys.fence, keys.waiting]
        return self._acquire(slot, token, ttl_ms, ACQUIRE, args, names)

    def take_over(
        self,
        slot: Slot,
        token: str,
        ttl_ms: int,
        record: str,
        handover: Handover,
        *,
        wait: bool,
        fence_ttl_ms: int,
    ) -> Grant:
        keys = _queued_keys(slot)
        args: list[Any] = [token, ttl_ms, record, "1" if wait else "0", fence_ttl_ms]
        args += [handover.owner, "1" if handover.strict else "0"]
        names = [keys.lock, keys.fence, keys.waiting, keys.queued]
        return self._acquire(slot, token, ttl_ms, ACQUIRE, args, names)

    def _acquire(  # noqa: PLR0917 - the attempt's slot, token and lease, and what to run
        self,
        slot: Slot,
        token: str,
        ttl_ms: int,
        script: Script,
        args: list[Any],
        names: list[str],
    ) -> Grant:
        keys = slot.keys
        try:
            reply = self._run(script, names, args)
        except Exception as exc:
            foreign = isinstance(exc, rx.ResponseError) and not server_refused(exc)
            if not foreign and not cannot_decide(exc):
                raise  # never sent, or a bug: nothing to take back
            # The script may have run (a lost reply), or stopped at foreign data after
            # writing: take back whatever this token may hold (see _abandon). A copy that
            # reaches the server after the last give-back lives out its lease.
            self._abandon(slot, token, ttl_ms)
            if foreign:
                raise ConfigError(foreign_data_message(self.client, keys, exc)) from exc
            raise self.unavailable(slot.name, exc) from exc
        return grant_of(reply, permits=slot.permits)

    def _abandon(self, slot: Slot, token: str, notice_ms: int) -> None:
        """Take back what *token* may hold, best effort, never raising: here once, and
        when that does not get through (the server still does not answer), once more a
        little later from the process's give-back thread (:func:`.redis_giveback.later`). What is
        not taken back expires with its lease."""
        try:
            self.release(slot, token, notice_ms)
        except Exception:
            redis_giveback.later(lambda: self.release(slot, token, notice_ms))

    def release(self, slot: Slot, token: str, notice_ms: int) -> Status:
        keys = slot.keys
        names = [keys.lock, keys.notify, keys.waiting, keys.released]
        if slot.permits:
            args: list[Any] = [token, notice_ms, slot.limit, RECENT_BYTES]
            with self._guard(slot):
                return Status.of(self._run(PERMIT_RELEASE, names, args))
        with self._guard(slot):
            return Status.of(self._run(RELEASE, names, [token, notice_ms, RECENT_BYTES]))

    def release_done(
        self, slot: Slot, token: str, notice_ms: int, mark: str, mark_ms: int
    ) -> Status:
        keys = _queued_keys(slot)
        names = [keys.lock, keys.notify, keys.waiting, keys.released, keys.done]
        args = [token, notice_ms, RECENT_BYTES, mark, mark_ms]
        with self._guard(slot):
            return Status.of(self._run(RELEASE, names, args))

    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        script = PERMIT_EXTEND if slot.permits else EXTEND
        with self._guard(slot):
            code = int(self._run(script, [slot.keys.lock], [token, ms, "1" if replace else "0"]))
        return code if code > 0 else Status.of(code)

    def renew(self, items: Sequence[Renewal]) -> list[Status | QuorumUnavailable]:
        """One script per node: ``extend_many.lua`` on a plain Redis; on a cluster
        ``extend_node.lua`` on each node for every item it serves, whatever their slots
        (one ``extend_many.lua`` per slot where the node refuses that: slots moving, or
        a server without script flags)."""
        if not items:
            return []
        if not self.cluster:
            with self._errors(items[0].slot.name):
                return [*extend_many(self.client, items, self._pool)]
        by_node: dict[str, list[int]] = defaultdict(list)
        nodes: dict[str, Any] = {}
        for i, item in enumerate(items):
            node = self.client.get_node_from_key(item.slot.keys.lock)
            by_node[node.name].append(i)
            nodes[node.name] = node
        out: list[Status | QuorumUnavailable] = [Status.GONE] * len(items)
        for name, indexes in by_node.items():
            part = [items[i] for i in indexes]
            found: Sequence[Status | QuorumUnavailable]
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
        failures = [o for o in out if isinstance(o, QuorumUnavailable)]
        if len(failures) == len(out):
            raise failures[0]
        return out

    def _extend_node(self, node: Any, items: Sequence[Renewal]) -> list[Status]:
        args: list[Any] = []
        for item in items:
            args += [item.slot.keys.lock, item.token, item.ms]
        try:
            reply = EXTEND_NODE(self.client.get_redis_connection(node), [], args)
            return [Status.of(code) for code in reply]
        except rx.ResponseError as exc:
            if server_refused(exc):
                raise
        by_slot: dict[int, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_slot[self.client.keyslot(item.slot.keys.lock)].append(i)
        statuses = [Status.GONE] * len(items)
        for indexes in by_slot.values():
            found = extend_many(self.client, [items[i] for i in indexes])
            for i, status in zip(indexes, found, strict=True):
                statuses[i] = status
        return statuses

    def wait(self, slot: Slot, seconds: float, refused: Grant | None = None) -> None:
        """One ``BLPOP`` on the notify list, on a connection taken from the pool with a read
        deadline of its own (a wait longer than the socket timeout is still one command,
        and the client's retry policy never re-sends it), always given back."""
        client, key = self.client, slot.keys.notify
        if self.cluster:
            client = client.get_redis_connection(client.get_node_from_key(key))
        seconds = round(max(seconds, 0.001), 3)
        pool = client.connection_pool
        with self._guard(slot):
            conn = checkout(pool)
            try:
                conn.send_command("BLPOP", key, f"{seconds:.3f}")
                if conn.can_read(timeout=seconds + 1.0):
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
            return int(RAISE_FENCE(self.client, [slot.keys.fence], [fence, fence_ttl_ms]))

    # -- reads ------------------------------------------------------------------------
    def holders(self, slot: Slot) -> list[Holder]:
        with self._guard(slot):
            if slot.permits:
                return permit_holders(PERMITS(self.client, [slot.keys.lock], []))
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
                return len(PERMITS(self.client, [slot.keys.lock], [])) // 4 >= slot.limit
            return bool(self.client.exists(slot.keys.lock))

    def was_done(self, slot: Slot, mark: str) -> bool:
        if not slot.keys.done:
            return False  # permits keep no done marks
        with self._guard(slot):
            return self.client.zscore(slot.keys.done, mark) is not None

    # -- enqueue-time holds -------------------------------------------------------------
    def enqueue(
        self,
        slot: Slot,
        owner: str,
        ttl_ms: int,
        record: str,
        *,
        replace: bool,
        running_blocks: bool,
    ) -> Queued:
        keys = _queued_keys(slot)
        args = [owner, ttl_ms, record, "1" if replace else "0", "1" if running_blocks else "0"]
        with self._guard(slot):
            reply = self._run(ENQUEUE, [keys.queued, keys.lock], args)
        code = int(reply[0])
        if code == 1:
            return Queued("queued")
        if code == 2:
            return Queued("replaced", owner=text(reply[1]), holder=parse_holder(reply[2]))
        holder = parse_holder(reply[2])
        other = text(reply[1]) or str(holder.get("task_id") or "")
        return Queued("duplicate", other, holder, ttl_ms=int(reply[3]), state=text(reply[4]))

    def dequeue(self, slot: Slot, owner: str) -> Status:
        keys = _queued_keys(slot)
        with self._guard(slot):
            return Status.of(self._run(DEQUEUE, [keys.queued], [owner]))

    # -- rate grants --------------------------------------------------------------------
    def rate(
        self,
        name: str,
        key: str,
        interval_us: int,
        burst: int,
        *,
        mode: str,
        most_us: int = 0,
        grace_us: int = 0,
    ) -> RateGrant:
        def foreign(exc: Exception) -> str:
            return (
                f"rate limiter {name!r}: Redis refused the rate script on {key!r} ({exc}): "
                "something other than celery-redlock writes under the key prefix; delete "
                "that key if it is stale, or give celery-redlock a prefix of its own"
            )

        with self._errors(name, foreign):
            args = [interval_us, burst, mode, most_us, grace_us]
            granted, wait_us, free = self._run(RATE, [key], args)
        return RateGrant(int(granted) == 1, max(0, int(wait_us)) / 1e6, int(free))

    # -- records beside a lock ------------------------------------------------------------
    def load_records(self, slot: Slot, suffix: str) -> dict[str, str]:
        key = f"{slot.keys.lock}:{suffix}"
        with self._errors(slot.name, partial(_records_message, key)):
            found = self.client.hgetall(key)
        return {text(name): text(value) for name, value in found.items()}

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
        """See :meth:`Backend.claim`; one Redis answers within its client's socket
        timeout, so *deadline* (a quorum's bound) is not needed here."""
        key = f"{slot.keys.lock}:{suffix}"
        args = [token, name, value, version[0], version[1]]
        with self._errors(slot.name, partial(_records_message, key)):
            reply = self._run(CLAIM_FIELD, [slot.keys.lock, key], args)
        code = int(reply[0])
        if code == 1:
            return Claim("claimed", value)
        if code == -1:
            return Claim("stale", text(reply[1]))
        return Claim("lost", detail="the lock is gone or held by another acquisition")

    # -- operator reads and forced release (reads: see redis_admin) ---------------------
    def scan(self, prefix: str, pattern: str = "*") -> list[LockInfo]:
        with self._errors(pattern):
            return redis_admin.scan(self.client, prefix, pattern, _node_permits)

    def read(self, prefix: str, name: str) -> list[LockInfo]:
        with self._errors(name):
            return redis_admin.read(self.client, prefix, name, _node_permits)

    def scan_rates(self, prefix: str, pattern: str = "*") -> list[RateInfo]:
        with self._errors(pattern):
            return redis_admin.scan_rates(self.client, prefix, pattern)

    def read_rate(self, prefix: str, name: str) -> RateInfo | None:
        with self._errors(name):
            return redis_admin.read_rate(self.client, prefix, name)

    def force_release(self, slot: Slot, fence: int | None, notice_ms: int) -> ForceRelease:
        if slot.permits:
            raise ConfigError(f"lock {slot.name!r}: a permit is not released by force")
        keys = slot.keys
        args = [notice_ms, "" if fence is None else str(fence)]
        with self._guard(slot):
            reply = FORCE_RELEASE(self.client, [keys.lock, keys.notify], args)
        code = int(reply[0])
        if code == 0:
            return ForceRelease("gone")
        record = parse_holder(reply[1])
        return ForceRelease("released" if code == 1 else "refused", record, fence_of(reply[2]))

    def force_dequeue(self, slot: Slot, owner: str | None) -> ForceRelease:
        keys = _queued_keys(slot)
        with self._guard(slot):
            found, info = self.client.hmget(keys.queued, "owner", "info")
            if found is None:
                return ForceRelease("gone")
            record = parse_holder(info)
            record.setdefault("task_id", text(found))
            if owner is not None and text(found) != owner:
                return ForceRelease("refused", record)
            code = Status.of(DEQUEUE(self.client, [keys.queued], [text(found)]))
        if code is Status.OK:
            return ForceRelease("released", record)
        return ForceRelease("gone" if code is Status.GONE else "refused", record)


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
            raise ConfigError(self.foreign(exc)) from exc


def _records_message(key: str, exc: Exception) -> str:
    return (
        f"{key!r} holds data that is not a hash of records ({exc}): something other than "
        "celery-redlock writes under the lock key prefix; delete that key if it is stale"
    )


def _queued_keys(slot: Slot) -> LockKeys:
    if slot.permits or not slot.keys.queued:
        raise ConfigError(f"lock {slot.name!r}: enqueue-time holds take a mutex, not permits")
    return slot.keys


#: Each client's backend, by id(client): weak, so a backend (and the client it keeps)
#: goes when nothing uses it.
_backends: dict[int, weakref.ref[RedisBackend]] = {}
#: Reentrant: a backend dropped in a reference cycle is finalized (_forget) by the cyclic
#: garbage collector, which may run at any allocation, also inside ``of()`` while this
#: thread holds the lock; a plain Lock would deadlock the thread there.
_backends_lock = threading.RLock()


def _forget(key: int, ref: weakref.ref[RedisBackend]) -> None:
    with _backends_lock:
        if _backends.get(key) is ref:
            del _backends[key]


def _after_fork() -> None:
    global _backends_lock
    _backends_lock = threading.RLock()  # a parent's thread may have held it while forking


process.on_fork(_after_fork)


def _node_permits(node: Any, slot: Slot) -> list[Holder]:
    """The permits of *slot* on one plain node's client (operator reads of a cluster)."""
    return RedisBackend.of(node).holders(slot)
