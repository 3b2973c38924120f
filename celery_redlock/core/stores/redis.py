"""``RedisStore``: locks on one Redis (a plain server, a Sentinel master, or a Cluster).

One store per client object (:meth:`RedisStore.of`), shared by every lock on that
client in this process: the renewal thread batches by store, and a quorum store
counts the calls still running on each of its members.

Every mutation is one owner-checked script; commands go through the client's
:class:`~celery_redlock.core.send.Channel`, except on a ``RedisCluster``, whose
own client routes each script to the node that owns the key's slot (and follows
``MOVED``/``ASK`` while slots move).
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

from .. import process
from ..connect import address_of
from ..errors import ConfigError, QuorumUnavailable, RedlockError
from ..keys import LockKeys
from ..scripts import (
    ACQUIRE,
    DEQUEUE,
    ENQUEUE,
    EXTEND,
    EXTEND_MANY,
    EXTEND_NODE,
    PERMIT_ACQUIRE,
    PERMIT_EXTEND,
    PERMIT_RELEASE,
    PERMITS,
    RATE,
    RELEASE,
    Status,
)
from ..send import Channel, Command, Lane, Plain, Sent, checkout
from ..store import Grant, Holder, Permit, Queued, RateGrant, node_timeout, parse_holder, text

__all__ = [
    "REDIS_ERRORS",
    "RedisStore",
    "check_client",
    "foreign_data_message",
    "is_foreign",
    "permit_release_command",
    "permits_of",
    "refused",
    "server_refused",
]

#: What a call raises when its node cannot be reached or refuses the command.
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException)


class RedisStore:
    """Locks on one Redis."""

    quorum = 1

    def __init__(self, client: Any) -> None:
        check_client(client)
        self.client = client
        self._cluster = isinstance(client, RedisCluster)
        #: The held connection for lock traffic (a cluster routes each call itself).
        self.channel: Channel | None = None if self._cluster else Channel(client)
        self._address: str | None = None
        #: Calls to this node that may block, run in order (see core.fanout).
        self.lane = Lane()

    @classmethod
    def of(cls, client: Any) -> RedisStore:
        """The store of *client* in this process (one per client object)."""
        ref = _stores.get(id(client))
        store = None if ref is None else ref()
        if store is None or store.client is not client:
            with _stores_lock:
                ref = _stores.get(id(client))
                store = None if ref is None else ref()
                if store is None or store.client is not client:
                    store = cls(client)
                    _stores[id(client)] = weakref.ref(store)
                    weakref.finalize(store, _forget_store, id(client), _stores[id(client)])
        return store

    @property
    def members(self) -> Sequence[RedisStore]:
        return (self,)

    @property
    def first_contact(self) -> bool:
        """True until a call to this node got an answer in this process."""
        return self.channel is not None and self.channel.first_contact

    @property
    def running(self) -> int:
        """Calls to this node queued or running in its lane."""
        return self.lane.pending()

    @property
    def address(self) -> str:
        """``host:port/db`` (or the socket path, or the Sentinel service), never a password."""
        if self._address is None:
            self._address = address_of(self.client)
        return self._address

    def describe(self) -> str:
        return self.address

    def timeout(self, ttl_ms: int | None) -> float:
        return node_timeout(30.0 if ttl_ms is None else ttl_ms / 1000)

    # -- sending ------------------------------------------------------------------------
    def call(self, command: Command) -> Any:
        """Run *command* on this node and return its reply (errors raised as they come)."""
        if self.channel is not None:
            return self.channel.call(command)
        try:
            return self.client.execute_command(*command.args())
        except NoScriptError:
            whole = command.fallback()
            if whole is None:
                raise
            return self.client.execute_command(*whole)

    def send(self, command: Command) -> Sent | None:
        """Write *command* without waiting for the reply, when that cannot block."""
        return None if self.channel is None else self.channel.send(command)

    def unavailable(self, name: str, exc: BaseException) -> QuorumUnavailable:
        """The error for a lock whose one Redis did not answer."""
        return QuorumUnavailable(name, {self.address: f"{type(exc).__name__}: {exc}"})

    # -- the Store protocol -------------------------------------------------------------
    def acquire(
        self, keys: LockKeys, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int
    ) -> Grant:
        command = acquire_command(keys, token, ttl_ms, record, wait=wait, fence_ttl_ms=fence_ttl_ms)
        return grant_of(self._attempt(command, keys, self.abandon, token, ttl_ms))

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
        command = acquire_command(
            keys,
            token,
            ttl_ms,
            record,
            wait=wait,
            fence_ttl_ms=fence_ttl_ms,
            owner=owner,
            strict=strict,
        )
        return grant_of(self._attempt(command, keys, self.abandon, token, ttl_ms))

    def _attempt(
        self,
        command: Command,
        keys: LockKeys,
        abandon: Callable[..., None],
        *abandon_args: Any,
    ) -> Any:
        """Run an acquire script; after an unclear or refused run, *abandon* takes back
        whatever the token may hold."""
        try:
            return self.call(command)
        except ResponseError as exc:
            if not server_refused(exc):
                # Foreign data at one of the lock's keys. A script stops at its first error
                # but keeps what it wrote before it: take back whatever this token may hold.
                abandon(keys, *abandon_args)
            raise refused(self, keys, exc) from exc
        except REDIS_ERRORS as exc:
            # The script may have run before the reply was lost: take back what this
            # token may hold, in this node's lane (after any call still due there), so
            # an unclear attempt leaves nothing behind and the caller hears at once.
            self.lane.submit(abandon, keys, *abandon_args)
            raise self.unavailable(keys.name, exc) from exc

    def release(
        self, keys: LockKeys, token: str, notice_ms: int, done: tuple[str, int] | None = None
    ) -> Status:
        try:
            return Status.of(self.call(release_command(keys, token, notice_ms, done)))
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc

    def was_done(self, keys: LockKeys, mark: str) -> bool:
        try:
            return self.call(Plain("ZSCORE", keys.done, mark)) is not None
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc

    def abandon(self, keys: LockKeys, token: str, notice_ms: int) -> None:
        try:
            self.call(release_command(keys, token, notice_ms))
        except REDIS_ERRORS:
            return  # the lease expires by itself within one TTL

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
        args = (owner, ttl_ms, record, "1" if replace else "0", "1" if running_blocks else "0")
        try:
            reply = self.call(ENQUEUE([keys.queued, keys.lock], args))
        except ResponseError as exc:
            raise refused(self, keys, exc) from exc
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc
        return queued_of(reply)

    def dequeue(self, keys: LockKeys, owner: str) -> Status:
        try:
            return Status.of(self.call(DEQUEUE([keys.queued], [owner])))
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc

    def extend(self, keys: LockKeys, token: str, ms: int, *, replace: bool) -> int | Status:
        try:
            code = int(self.call(EXTEND([keys.lock], [token, ms, "1" if replace else "0"])))
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc
        return code if code > 0 else Status.of(code)

    def holder(self, keys: LockKeys) -> Holder | None:
        try:
            token, info = self.call(Plain("HMGET", keys.lock, "token", "info"))
        except ResponseError as exc:
            raise refused(self, keys, exc) from exc
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc
        return None if token is None else Holder(text(token), parse_holder(info))

    def locked(self, keys: LockKeys) -> bool:
        try:
            return bool(self.call(Plain("EXISTS", keys.lock)))
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc

    def wait(self, keys: LockKeys, seconds: float, refused: Grant | None = None) -> None:
        """One ``BLPOP`` on the notify list, on a connection of its own with its own read
        deadline: a wait longer than the socket timeout is still one command, and the
        client's retry policy never re-sends it."""
        client = self.client
        if self._cluster:
            client = client.get_redis_connection(client.get_node_from_key(keys.notify))
        seconds = round(max(seconds, 0.001), 3)
        pool = client.connection_pool
        try:
            conn = checkout(pool)
        except REDIS_ERRORS as exc:  # connecting (or its handshake) failed
            raise self.unavailable(keys.name, exc) from exc
        try:
            conn.send_command("BLPOP", keys.notify, f"{seconds:.3f}")
            if conn.can_read(timeout=seconds + 1.0):
                conn.read_response()
            else:  # no reply in time: the connection is in an unknown state
                conn.disconnect()
        except REDIS_ERRORS as exc:
            conn.disconnect()
            raise self.unavailable(keys.name, exc) from exc
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def settle(
        self, name: str, outcomes: Sequence[Status | BaseException]
    ) -> Status | QuorumUnavailable:
        outcome = outcomes[0]
        if isinstance(outcome, BaseException):
            return self.unavailable(name, outcome)
        return outcome

    # -- a semaphore's permits (core/semaphore.py; one Redis only) ------------------------
    def acquire_permit(
        self,
        keys: LockKeys,
        token: str,
        ttl_ms: int,
        record: str,
        limit: int,
        *,
        wait: bool,
        fence_ttl_ms: int,
    ) -> Grant:
        """One attempt to take one of *limit* permits of *keys* for *token*."""
        command = PERMIT_ACQUIRE(
            [keys.lock, keys.fence, keys.waiting],
            [token, ttl_ms, record, "1" if wait else "0", fence_ttl_ms, limit],
        )
        reply = self._attempt(command, keys, self.abandon_permit, token, ttl_ms, limit)
        if int(reply[0]) == 1:
            return Grant(True, fence=int(reply[1]))
        left = int(reply[2])
        return Grant(False, holder=parse_holder(reply[1]), holder_ttl_ms=left, wait_ms=left)

    def release_permit(self, keys: LockKeys, token: str, notice_ms: int, limit: int) -> Status:
        """Give back *token*'s permit and wake a waiter."""
        try:
            return Status.of(self.call(permit_release_command(keys, token, notice_ms, limit)))
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc

    def abandon_permit(self, keys: LockKeys, token: str, notice_ms: int, limit: int) -> None:
        """Best-effort :meth:`release_permit` (never raises for Redis errors)."""
        try:
            self.call(permit_release_command(keys, token, notice_ms, limit))
        except REDIS_ERRORS:
            return  # the permit expires by itself within one TTL

    def extend_permit(self, keys: LockKeys, token: str, ms: int, *, replace: bool) -> int | Status:
        """Lengthen *token*'s permit: the new lease in ms, or GONE / FOREIGN."""
        try:
            code = int(self.call(PERMIT_EXTEND([keys.lock], [token, ms, "1" if replace else "0"])))
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc
        return code if code > 0 else Status.of(code)

    def permits(self, keys: LockKeys) -> list[Permit]:
        """The live permits of *keys*, first to expire first."""
        try:
            reply = self.call(PERMITS([keys.lock], []))
        except ResponseError as exc:
            raise refused(self, keys, exc) from exc
        except REDIS_ERRORS as exc:
            raise self.unavailable(keys.name, exc) from exc
        return permits_of(reply)

    # -- a rate limiter (core/ratelimit.py; one Redis only) --------------------------------
    def rate(
        self, name: str, key: str, interval_us: int, burst: int, *, mode: str, most_us: int = 0
    ) -> RateGrant:
        """One decision of the rate limiter *name* at *key* (see rate.lua for *mode*)."""
        try:
            granted, wait_us, free = self.call(RATE([key], [interval_us, burst, mode, most_us]))
        except ResponseError as exc:
            if server_refused(exc):
                raise self.unavailable(name, exc) from exc
            raise ConfigError(
                f"rate limiter {name!r}: Redis refused the rate script on {key!r} ({exc}): "
                "something other than celery-redlock writes under the key prefix; delete "
                "that key if it is stale, or give celery-redlock a prefix of its own"
            ) from exc
        except REDIS_ERRORS as exc:
            raise self.unavailable(name, exc) from exc
        return RateGrant(int(granted) == 1, max(0, int(wait_us)) / 1e6, int(free))

    # -- renewal ------------------------------------------------------------------------
    def renew_many(self, items: Sequence[tuple[str, str, int]]) -> list[Status]:
        """Renew (key, token, lease ms) items: one script for all of them, or on a Redis
        Cluster one per node (:func:`_extend_node`), a status each."""
        if not self._cluster:
            return _extend_many(self, items)
        by_node: dict[str, list[int]] = defaultdict(list)
        nodes: dict[str, Any] = {}
        for i, (key, _, _) in enumerate(items):
            node = self.client.get_node_from_key(key)
            by_node[node.name].append(i)
            nodes[node.name] = node
        statuses = [Status.GONE] * len(items)
        for name, indexes in by_node.items():
            part = [items[i] for i in indexes]
            for i, status in zip(indexes, _extend_node(self, nodes[name], part), strict=True):
                statuses[i] = status
        return statuses

    def __repr__(self) -> str:
        return f"<RedisStore {self.address}>"


def _extend_many(store: RedisStore, items: Sequence[tuple[str, str, int]]) -> list[Status]:
    args: list[Any] = []
    for _, token, ms in items:
        args += [token, ms]
    reply = store.call(EXTEND_MANY([key for key, _, _ in items], args))
    return [Status.of(code) for code in reply]


def _extend_node(
    cluster: RedisStore, node: Any, items: Sequence[tuple[str, str, int]]
) -> list[Status]:
    """Renew *items* held on one cluster *node* with one script across their slots; where
    the node refuses that (slots moving, a server without script flags), one script per
    slot through the cluster client, which follows ``MOVED``."""
    args: list[Any] = []
    for key, token, ms in items:
        args += [key, token, ms]
    try:
        reply = RedisStore.of(cluster.client.get_redis_connection(node)).call(EXTEND_NODE([], args))
        return [Status.of(code) for code in reply]
    except ResponseError:
        pass  # each slot on its own below
    by_slot: dict[int, list[int]] = defaultdict(list)
    for i, (key, _, _) in enumerate(items):
        by_slot[cluster.client.keyslot(key)].append(i)
    statuses = [Status.GONE] * len(items)
    for indexes in by_slot.values():
        part = [items[i] for i in indexes]
        for i, status in zip(indexes, _extend_many(cluster, part), strict=True):
            statuses[i] = status
    return statuses


# -- commands and replies, shared with the quorum store ------------------------------------
def acquire_command(
    keys: LockKeys,
    token: str,
    ttl_ms: int,
    record: str,
    *,
    wait: bool,
    fence_ttl_ms: int,
    owner: str | None = None,
    strict: bool = True,
) -> Command:
    """The acquire script for *token* (see acquire.lua for what each argument does); with
    *owner*, the hand-over of that task id's enqueue-time hold."""
    if owner is None:
        return ACQUIRE(
            [keys.lock, keys.fence, keys.waiting],
            [token, ttl_ms, record, "1" if wait else "0", fence_ttl_ms],
        )
    return ACQUIRE(
        [keys.lock, keys.fence, keys.waiting, keys.queued],
        [token, ttl_ms, record, "1" if wait else "0", fence_ttl_ms, owner, "1" if strict else "0"],
    )


def release_command(
    keys: LockKeys, token: str, notice_ms: int, done: tuple[str, int] | None = None
) -> Command:
    """The release script for *token*: owner-checked, wakes one waiter; with *done*
    (value, ms), sets the lock's done mark in the same step."""
    if done is None:
        return RELEASE([keys.lock, keys.notify, keys.waiting], [token, notice_ms])
    return RELEASE(
        [keys.lock, keys.notify, keys.waiting, keys.done], [token, notice_ms, done[0], done[1]]
    )


def permit_release_command(keys: LockKeys, token: str, notice_ms: int, limit: int) -> Command:
    """The permit release script for *token*: owner-checked, wakes a waiter."""
    return PERMIT_RELEASE([keys.lock, keys.notify, keys.waiting], [token, notice_ms, limit])


def permits_of(reply: Any) -> list[Permit]:
    """A permits script's reply (four entries per live permit), first to expire first."""
    found = [
        Permit(
            text(reply[i]),
            parse_holder(reply[i + 3]),
            fence=int(reply[i + 2]) if text(reply[i + 2]).isdigit() else None,
            ttl_ms=int(reply[i + 1]),
        )
        for i in range(0, len(reply) - 3, 4)
    ]
    return sorted(found, key=lambda p: p.ttl_ms)


def grant_of(reply: Any) -> Grant:
    """An acquire script's reply as a :class:`Grant`."""
    code = int(reply[0])
    if code == 1:
        return Grant(True, fence=int(reply[1]))
    left = int(reply[2])
    queued_owner = text(reply[3]) if len(reply) > 3 else None
    if code == -1:  # a hand-over whose queued hold belongs to another task id
        return Grant(
            False,
            holder=parse_holder(reply[1]),
            holder_ttl_ms=left,
            superseded=True,
            queued_owner=queued_owner,
        )
    return Grant(
        False,
        holder=parse_holder(reply[1]),
        holder_ttl_ms=left,
        wait_ms=left,
        queued_owner=queued_owner,
    )


def queued_of(reply: Any) -> Queued:
    """An enqueue script's reply as a :class:`Queued`."""
    code = int(reply[0])
    if code == 1:
        return Queued("queued")
    if code == 2:
        return Queued("replaced", owner=text(reply[1]), holder=parse_holder(reply[2]))
    holder = parse_holder(reply[2])
    owner = text(reply[1]) or str(holder.get("task_id") or "")
    return Queued(
        "duplicate", owner=owner, holder=holder, ttl_ms=int(reply[3]), state=text(reply[4])
    )


def refused(store: RedisStore, keys: LockKeys, exc: ResponseError) -> RedlockError:
    """The error for a lock command the server answered with an error reply: the server
    cannot serve now (see :func:`server_refused`: unavailable, retry later), or the data
    at the lock's keys is not ours (a ConfigError saying which key holds what)."""
    if server_refused(exc):
        return store.unavailable(keys.name, exc)
    return ConfigError(foreign_data_message(store.client, keys, exc))


#: Error codes of a server that cannot serve a lock right now, whatever the data: out of
#: memory, a read-only replica, a busy script, a failed save, no replicas, a node loading
#: or down. A lock refused with one is unavailable (retry later), not bad input.
_SERVER_STATES = frozenset(
    ("OOM", "READONLY", "BUSY", "MISCONF", "NOREPLICAS", "MASTERDOWN", "LOADING", "TRYAGAIN")
)
_SERVER_STATE_ERRORS = (
    OutOfMemoryError,
    ReadOnlyError,
    BusyLoadingError,
    ClusterDownError,  # MasterDownError is one
    TryAgainError,
)


def server_refused(exc: BaseException) -> bool:
    """True when a Redis error reply says the server cannot serve now (see _SERVER_STATES).

    redis-py strips the code of the replies it has a class for (``OutOfMemoryError``,
    ``ReadOnlyError``, ...) and keeps the others' (``MISCONF ...``); Redis < 7 reports an
    error inside a script as ``Error running script ...: -OOM ...``.
    """
    if isinstance(exc, _SERVER_STATE_ERRORS):
        return True
    message = str(exc)
    if message.split(" ", 1)[0] in _SERVER_STATES:
        return True
    return any(f"-{state} " in message for state in _SERVER_STATES)


def is_foreign(value: Any) -> bool:
    """True for an error reply about the data (``WRONGTYPE``, not an integer, ...)."""
    return isinstance(value, ResponseError) and not server_refused(value)


def foreign_data_message(client: Any, keys: LockKeys, exc: BaseException) -> str:
    """Say which of a lock's keys holds data celery-redlock did not write, and what to do.

    Called after Redis refused a lock script on the data (``WRONGTYPE``, a counter that
    is not an integer): looks at the keys (a few reads, on this error path only).
    """
    detail = ""
    prefix = keys.lock[: keys.lock.index("{")]
    try:
        kind = text(client.type(keys.lock))
        queued = text(client.type(keys.queued))
        if kind not in ("hash", "none"):
            detail = f"{keys.lock!r} holds a {kind}, not a lock hash"
        elif queued not in ("hash", "none"):
            detail = f"its queued hold {keys.queued!r} holds a {queued}, not a hash"
        else:
            kind = text(client.type(keys.fence))
            value = text(client.get(keys.fence)) if kind == "string" else None
            if kind not in ("string", "none"):
                detail = f"its fence counter {keys.fence!r} holds a {kind}, not an integer"
            elif value is not None and not _is_int64(value):
                detail = f"its fence counter {keys.fence!r} holds {value[:40]!r}, not an integer"
            elif value is not None and int(value) >= 2**63 - 1:
                detail = f"its fence counter {keys.fence!r} is at the largest integer Redis keeps"
    except REDIS_ERRORS:
        detail = ""  # the refusal itself is reported below
    if not detail:
        return f"lock {keys.name!r}: Redis refused the lock script on {keys.lock!r} ({exc})"
    return (
        f"lock {keys.name!r}: {detail}. Something other than celery-redlock writes under the "
        f"key prefix {prefix!r}: delete that key if it is stale, or give celery-redlock a "
        "prefix of its own (key_prefix=, or the redlock_key_prefix setting)"
    )


def _is_int64(value: str) -> bool:
    try:
        return -(2**63) <= int(value) < 2**63 and value.strip() == value
    except ValueError:
        return False


def check_client(client: Any) -> None:
    """Refuse anything that is not a redis-py client, naming what was given."""
    if not isinstance(client, (redis.Redis, RedisCluster)):
        raise ConfigError(
            f"expected a redis.Redis, a Sentinel master_for() client or a RedisCluster, "
            f"got {type(client).__module__}.{type(client).__name__}; build one with "
            "celery_redlock.connect(url)"
        )


#: Each client's store, by id(client): weak, so a store (and the client it keeps)
#: goes when no lock uses it.
_stores: dict[int, weakref.ref[RedisStore]] = {}
#: Reentrant: a store dropped in a reference cycle is finalized (_forget_store) by the
#: cyclic garbage collector, which may run at any allocation, also inside ``of()`` while
#: this thread holds the lock; a plain Lock deadlocked the thread there.
_stores_lock = threading.RLock()


def _forget_store(key: int, ref: weakref.ref[RedisStore]) -> None:
    with _stores_lock:
        if _stores.get(key) is ref:
            del _stores[key]


def _after_fork() -> None:
    global _stores_lock
    _stores_lock = threading.RLock()
    for ref in list(_stores.values()):
        store = ref()
        if store is None:
            continue
        store.lane = Lane()  # the parent's pool threads do not exist here
        if store.channel is not None:
            store.channel.forget()  # the parent's connection is the parent's


process.on_fork(_after_fork)
