"""``RedisBackend``: the :class:`~celery_redlock.core.backend.Backend` verbs on one Redis.

One Redis is a plain server (``redis.Redis``), a Sentinel master (``master_for()``) or a
Redis Cluster (``RedisCluster``, whose client routes each call to the node that owns the
key's slot and follows ``MOVED``/``ASK``). Every mutation is one owner-checked Lua script
(``core/lua/*.lua``, one per file, each with a header saying its KEYS, ARGV and replies),
run with redis-py's public ``evalsha`` (``eval`` once, after ``NOSCRIPT``).

Nothing is held past a call: the backend keeps the client, its address and whether it is
a cluster. Each verb takes a connection from the client's pool through redis-py's own
``execute_command`` (or a pipeline), which gives it back on every path; :meth:`wait`,
which needs a read deadline of its own, takes one and gives it back itself.

Errors: see :func:`cannot_decide` for what is reported as
:class:`~celery_redlock.core.errors.QuorumUnavailable`; data at a lock's keys that is not
ours is a :class:`~celery_redlock.core.errors.ConfigError`; anything else is raised as it is.
"""

from __future__ import annotations

import hashlib
import inspect
import queue
import re
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import partial
from importlib import resources
from typing import Any

import redis
from redis import exceptions as rx
from redis.cluster import RedisCluster

from .. import process
from ..backend import (
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
from . import redis_admin
from .redis_admin import fence_of, foreign_data_message

__all__ = ["RedisBackend", "cannot_decide", "check_client", "is_client", "server_refused"]


class _GiveBacks:
    """One thread per process for the give-backs that did not get through at once: each
    is tried again :data:`GIVE_BACK_AFTER` seconds later, in order, and dropped when it
    fails again (its lease ends by itself). At most :data:`GIVE_BACK_QUEUE` wait; more
    are dropped. One thread however many fail: a silent server delays the others, never
    multiplies threads."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[float, Callable[[], object]]] = queue.Queue(GIVE_BACK_QUEUE)
        self._started = False
        self._mutex = threading.Lock()

    def later(self, give_back: Callable[[], object]) -> None:
        with self._mutex:
            if not self._started:
                self._started = True
                threading.Thread(
                    target=self._run, name="celery-redlock-giveback", daemon=True
                ).start()
        with suppress(queue.Full):
            self._queue.put_nowait((time.monotonic() + GIVE_BACK_AFTER, give_back))

    def _run(self) -> None:
        while True:
            when, give_back = self._queue.get()
            time.sleep(max(when - time.monotonic(), 0.0))
            with suppress(Exception):
                give_back()


#: How long after a failed give-back of an unclear acquire it is tried once more.
GIVE_BACK_AFTER = 0.5
#: Give-backs waiting for their second try at most (more are dropped).
GIVE_BACK_QUEUE = 256
_give_backs = _GiveBacks()


@process.on_fork
def _new_give_backs() -> None:
    global _give_backs
    _give_backs = _GiveBacks()  # the parent's thread does not exist in a child


class _Script:
    """A Lua script of this package (the file, then any shared parts appended to it)."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, filename: str, *parts: str) -> None:
        folder = resources.files("celery_redlock.core").joinpath("lua")
        self.name = filename
        self.source = "".join(folder.joinpath(f).read_text("utf-8") for f in (filename, *parts))
        self.sha = hashlib.sha1(self.source.encode("utf-8"), usedforsecurity=False).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run on *client* (``EVALSHA``; ``EVAL`` when the server has not cached it yet)."""
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except rx.NoScriptError:
            return client.eval(self.source, len(keys), *keys, *args)


_ACQUIRE = _Script("acquire.lua")
_RELEASE = _Script("release.lua")
_EXTEND = _Script("extend.lua")
_EXTEND_MANY = _Script("extend_many.lua", "extend_items.lua")
_EXTEND_NODE = _Script("extend_node.lua", "extend_items.lua")  # a cluster node, across slots
_RAISE_FENCE = _Script("raise_fence.lua")
_FORCE_RELEASE = _Script("force_release.lua")
_CLAIM_FIELD = _Script("claim_field.lua")
_PERMIT_ACQUIRE = _Script("permit_acquire.lua")
_PERMIT_RELEASE = _Script("permit_release.lua")
_PERMIT_EXTEND = _Script("permit_extend.lua")
_PERMITS = _Script("permits.lua")
_RATE = _Script("rate.lua")
_ENQUEUE = _Script("enqueue.lua")
_DEQUEUE = _Script("dequeue.lua")


class RedisBackend:
    """The backend of one Redis client: :meth:`of` gives the one of a client object."""

    masters = 1

    def __init__(self, client: Any) -> None:
        check_client(client)
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
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

    @contextmanager
    def _errors(
        self, name: str, foreign: Callable[[Exception], str] | None = None
    ) -> Iterator[None]:
        """Report what cannot be decided as unavailable and an error reply about the data
        (with *foreign*, which words it) as a ConfigError; let everything else through."""
        try:
            yield
        except Exception as exc:
            if cannot_decide(exc):
                raise self.unavailable(name, exc) from exc
            if foreign is not None and isinstance(exc, rx.ResponseError):
                raise ConfigError(foreign(exc)) from exc
            raise

    def _guard(self, slot: Slot) -> Any:
        return self._errors(slot.name, partial(foreign_data_message, self.client, slot.keys))

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
        keys, flag = slot.keys, "1" if wait else "0"
        args: list[Any] = [token, ttl_ms, record, flag, fence_ttl_ms]
        if slot.permits:
            if handover is not None:
                raise ConfigError(f"lock {slot.name!r}: a hand-over takes a mutex, not a permit")
            script, names = _PERMIT_ACQUIRE, [keys.lock, keys.fence, keys.waiting]
            args.append(slot.limit)
        elif handover is None:
            script, names = _ACQUIRE, [keys.lock, keys.fence, keys.waiting]
        else:
            script, names = _ACQUIRE, [keys.lock, keys.fence, keys.waiting, keys.queued]
            args += [handover.owner, "1" if handover.strict else "0"]
        try:
            reply = script(self.client, names, args)
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
        return _grant(reply, permits=slot.permits)

    def _abandon(self, slot: Slot, token: str, notice_ms: int) -> None:
        """Take back what *token* may hold, best effort, never raising: here once, and
        when that does not get through (the server still does not answer), once more a
        little later from the process's give-back thread (:class:`_GiveBacks`). What is
        not taken back expires with its lease."""
        try:
            self.release(slot, token, notice_ms)
        except Exception:
            _give_backs.later(lambda: self.release(slot, token, notice_ms))

    def release(
        self, slot: Slot, token: str, notice_ms: int, done: tuple[str, int] | None = None
    ) -> Status:
        keys = slot.keys
        names = [keys.lock, keys.notify, keys.waiting, keys.released]
        args: list[Any] = [token, notice_ms]
        if slot.permits:
            script = _PERMIT_RELEASE
            args.append(slot.limit)
        else:
            script = _RELEASE
            if done is not None:
                names.append(keys.done)
                args += [done[0], done[1]]
        with self._guard(slot):
            return Status.of(script(self.client, names, args))

    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        script = _PERMIT_EXTEND if slot.permits else _EXTEND
        with self._guard(slot):
            code = int(script(self.client, [slot.keys.lock], [token, ms, "1" if replace else "0"]))
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
                return [*_extend_many(self.client, items)]
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
            reply = _EXTEND_NODE(self.client.get_redis_connection(node), [], args)
            return [Status.of(code) for code in reply]
        except rx.ResponseError as exc:
            if server_refused(exc):
                raise
        by_slot: dict[int, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_slot[self.client.keyslot(item.slot.keys.lock)].append(i)
        statuses = [Status.GONE] * len(items)
        for indexes in by_slot.values():
            found = _extend_many(self.client, [items[i] for i in indexes])
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
            conn = _checkout(pool)
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
            return int(_RAISE_FENCE(self.client, [slot.keys.fence], [fence, fence_ttl_ms]))

    # -- reads ------------------------------------------------------------------------
    def holders(self, slot: Slot) -> list[Holder]:
        with self._guard(slot):
            if slot.permits:
                return _permit_holders(_PERMITS(self.client, [slot.keys.lock], []))
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
                return len(_PERMITS(self.client, [slot.keys.lock], [])) // 4 >= slot.limit
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
            reply = _ENQUEUE(self.client, [keys.queued, keys.lock], args)
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
            return Status.of(_DEQUEUE(self.client, [keys.queued], [owner]))

    # -- rate grants --------------------------------------------------------------------
    def rate(
        self, name: str, key: str, interval_us: int, burst: int, *, mode: str, most_us: int = 0
    ) -> RateGrant:
        def foreign(exc: Exception) -> str:
            return (
                f"rate limiter {name!r}: Redis refused the rate script on {key!r} ({exc}): "
                "something other than celery-redlock writes under the key prefix; delete "
                "that key if it is stale, or give celery-redlock a prefix of its own"
            )

        with self._errors(name, foreign):
            granted, wait_us, free = _RATE(self.client, [key], [interval_us, burst, mode, most_us])
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
            reply = _CLAIM_FIELD(self.client, [slot.keys.lock, key], args)
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
            reply = _FORCE_RELEASE(self.client, [keys.lock, keys.notify], args)
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
            code = Status.of(_DEQUEUE(self.client, [keys.queued], [text(found)]))
        if code is Status.OK:
            return ForceRelease("released", record)
        return ForceRelease("gone" if code is Status.GONE else "refused", record)


# -- what a failure means ---------------------------------------------------------------
#: What redis-py's pools say when they have no connection to give: ``ConnectionPool`` on
#: redis-py < 5.3 (later ones raise ``MaxConnectionsError``), ``BlockingConnectionPool``.
_POOL_EXHAUSTED = frozenset(("Too many connections", "No connection available."))
#: Words of a cluster client's own errors that mean it cannot reach or route to the nodes
#: (the others, "Missing key", "all keys must map to the same key slot", are bugs).
_CLUSTER_TROUBLE = ("cannot be connected", "not covered", "could not agree", "No targets")
#: Error codes of a server that cannot serve right now, whatever the data: out of memory,
#: a read-only replica, a busy script, a failed save, no replicas, a master down, loading,
#: a cluster slot moving.
_SERVER_STATE = re.compile(
    r"(?:^|-|caused error: )(?:OOM|READONLY|BUSY|MISCONF|NOREPLICAS|MASTERDOWN|LOADING|TRYAGAIN)"
    r"(?: |$)"
)
_SERVER_STATE_ERRORS = (
    rx.OutOfMemoryError,
    rx.ReadOnlyError,
    rx.BusyLoadingError,
    rx.TryAgainError,
)


def cannot_decide(exc: BaseException) -> bool:
    """True when *exc* means the server could not decide the call (report it as
    unavailable: a later attempt may succeed), False for what a retry cannot mend.

    - A connection error or timeout (redis-py's, or an ``OSError`` from the socket):
      the server is down or did not answer in time, and may have run the call. A failed
      ``AUTH`` is one too (as the server is, for this client, unusable right now).
    - A pool with no connection to give (``MaxConnectionsError``; redis-py < 5.3 and
      ``BlockingConnectionPool`` raise a plain ``ConnectionError`` that says so) is not:
      the client is exhausted, nothing was sent, and the server was never asked.
    - A cluster that is down, a slot moving (``TRYAGAIN``), or a cluster client that
      cannot reach or agree on its nodes: unavailable. Its usage errors are bugs: not.
    - An error reply is unavailable only when it is about the server's state
      (:func:`server_refused`); one about the data is foreign data (a ConfigError).
    - ``DataError`` (an argument of a wrong type), any other Redis error and any other
      exception are bugs: raised as they are.
    """
    if isinstance(exc, rx.MaxConnectionsError):
        return False
    if isinstance(exc, rx.ConnectionError):
        return str(exc) not in _POOL_EXHAUSTED
    if isinstance(exc, (rx.TimeoutError, OSError, rx.ClusterError, rx.SlotNotCoveredError)):
        return True
    if isinstance(exc, rx.RedisClusterException):
        return any(words in str(exc) for words in _CLUSTER_TROUBLE)
    return isinstance(exc, rx.ResponseError) and server_refused(exc)


def server_refused(exc: BaseException) -> bool:
    """True when a Redis error reply says the server cannot serve now (see _SERVER_STATE).

    redis-py strips the code of the replies it has a class for (``OutOfMemoryError``,
    ``ReadOnlyError``, ...) and keeps the others' (``MISCONF ...``); Redis < 7 reports an
    error inside a script as ``Error running script ...: -OOM ...``, and a pipeline puts
    ``Command # n (...) of pipeline caused error:`` before it.
    """
    if isinstance(exc, (*_SERVER_STATE_ERRORS, rx.ClusterError)):
        return True
    return isinstance(exc, rx.RedisError) and _SERVER_STATE.search(str(exc)) is not None


def _records_message(key: str, exc: Exception) -> str:
    return (
        f"{key!r} holds data that is not a hash of records ({exc}): something other than "
        "celery-redlock writes under the lock key prefix; delete that key if it is stale"
    )


def is_client(value: Any) -> bool:
    """True for a redis-py client: a ``redis.Redis`` (plain or Sentinel) or a cluster."""
    return isinstance(value, (redis.Redis, RedisCluster))


def check_client(client: Any) -> None:
    """Refuse anything that is not a redis-py client, naming what was given."""
    if not is_client(client):
        raise ConfigError(
            f"expected a redis.Redis, a Sentinel master_for() client or a RedisCluster, "
            f"got {type(client).__module__}.{type(client).__name__}; build one with "
            "celery_redlock.connect(url)"
        )


# -- replies ------------------------------------------------------------------------------
def _grant(reply: Any, *, permits: bool) -> Grant:
    """An acquire script's reply (acquire.lua, or permit_acquire.lua) as a Grant."""
    code = int(reply[0])
    if code == 1:
        return Grant(True, fence=int(reply[1]))
    holder, left = parse_holder(reply[1]), int(reply[2])
    # A hand-over (acquire.lua with KEYS[4]) adds the queued hold's owner.
    queued = text(reply[3]) if len(reply) > 3 and not permits else None
    if code == -1:  # a hand-over whose queued hold belongs to another task id
        return Grant(False, holder=holder, holder_ttl_ms=left, superseded=True, queued_owner=queued)
    return Grant(False, holder=holder, holder_ttl_ms=left, wait_ms=left, queued_owner=queued)


def _permit_holders(reply: Any) -> list[Holder]:
    """A ``permits.lua`` reply (four entries per live permit), first to expire first."""
    found = [
        Holder(
            text(reply[i]), parse_holder(reply[i + 3]), fence_of(reply[i + 2]), int(reply[i + 1])
        )
        for i in range(0, len(reply) - 3, 4)
    ]
    return sorted(found, key=lambda h: h.ttl_ms or 0)


def _extend_many(client: Any, items: Sequence[Renewal]) -> list[Status]:
    args: list[Any] = []
    for item in items:
        args += [item.token, item.ms]
    reply = _EXTEND_MANY(client, [item.slot.keys.lock for item in items], args)
    return [Status.of(code) for code in reply]


def _queued_keys(slot: Slot) -> LockKeys:
    if slot.permits or not slot.keys.queued:
        raise ConfigError(f"lock {slot.name!r}: enqueue-time holds take a mutex, not permits")
    return slot.keys


#: Pool classes whose ``get_connection`` needs a command name (redis-py < 5.3), by type.
_needs_name: dict[type, bool] = {}


def _checkout(pool: Any) -> Any:
    """A connection from *pool*, connected (redis-py's pools connect what they hand out).
    redis-py < 5.3 requires a command name (unused since); newer versions warn when given
    one. Which one a pool class wants is read once from its signature."""
    kind = type(pool)
    needs = _needs_name.get(kind)
    if needs is None:
        try:
            params = list(inspect.signature(pool.get_connection).parameters.values())
        except (TypeError, ValueError):  # no signature: assume the new API
            params = []
        first = params[0] if params else None
        needs = _needs_name[kind] = (
            first is not None
            and first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD)
            and first.default is first.empty
        )
    return pool.get_connection("BLPOP") if needs else pool.get_connection()


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
