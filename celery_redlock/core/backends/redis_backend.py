"""``RedisBackend``: the :class:`~celery_redlock.core.backend.Backend` verbs on one Redis.

One Redis is a plain server (``redis.Redis``), a Sentinel master (``master_for()``) or a
Redis Cluster (``RedisCluster``, whose client routes each call to the node that owns the
key's slot and follows ``MOVED``/``ASK``). Every mutation is one owner-checked Lua script
(:mod:`.redis_scripts`: ``core/lua/*.lua``). The lock verbs are here; queued holds, done
marks, rates and records are :mod:`.redis_holds`, the operator verbs
:mod:`.redis_operator`, and what they share (the client, errors) :mod:`.redis_calls`. An
unclear acquire's give-back that did not get through is tried again by
:mod:`.redis_giveback`. A quorum sends this backend's verbs without waiting for their
answers (:meth:`RedisBackend.send`, :mod:`.redis_sent`).

Nothing is held past a call: the backend keeps the client, its address and whether it is
a cluster. Each verb takes a connection from the client's pool and gives it back on every
path (:func:`~.redis_scripts.run`, or redis-py's own commands); :meth:`wait`, which needs
a read deadline of its own, takes one and gives it back itself.
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

from .. import process
from ..backend_types import (
    RECENT_BYTES,
    Grant,
    Handover,
    Holder,
    Renewal,
    Slot,
    Status,
    parse_holder,
    text,
)
from ..errors import ConfigError, QuorumUnavailable
from . import redis_giveback
from .redis_admin import fence_of, foreign_data_message
from .redis_calls import mutex_keys
from .redis_client import (
    MasterChanging,
    cannot_decide,
    check_client,
    checkout,
    is_client,
    plain_pool,
    server_refused,
)
from .redis_flow import RedisFlow, flow_grant, rule_renewals
from .redis_holds import RedisHolds, queued_of
from .redis_operator import RedisOperator
from .redis_scripts import (
    ACQUIRE,
    ENQUEUE,
    EXTEND,
    EXTEND_NODE,
    PERMIT_ACQUIRE,
    PERMIT_EXTEND,
    PERMIT_RELEASE,
    PERMITS,
    RAISE_FENCE,
    RELEASE,
    Script,
    extend_many,
    grant_of,
    permit_holders,
)
from .redis_sent import RedisSent

__all__ = ["RedisBackend", "cannot_decide", "check_client", "is_client", "server_refused"]


#: How long after its time a wait's ``BLPOP`` may answer before the wait ends without it.
WAIT_SLACK = 0.002


class RedisBackend(RedisHolds, RedisOperator, RedisFlow):
    """The backend of one Redis client (every capability of the seam): :meth:`of` gives
    the one of a client object. The lock verbs are here, the other capabilities'
    verbs in :class:`~.redis_holds.RedisHolds` and :class:`~.redis_operator.RedisOperator`."""

    masters = 1
    holds_permits = True

    @classmethod
    def of(cls, client: Any) -> RedisBackend:
        """The backend of *client* in this process: one per plain pool, living as long as
        the pool (a Lock made per call finds it made); one per client object for any other
        client, kept while used."""
        pool = plain_pool(client)
        if pool is not None:
            backend = _pool_backends.get(pool)
            if backend is None:
                with _backends_lock:
                    backend = _pool_backends.get(pool)
                    if backend is None:
                        backend = _pool_backends[pool] = cls(client)
            return backend
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
        return RedisBackend.of(node)

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

    # -- an acquisition's life --------------------------------------------------------
    def acquire(
        self, slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int,
        deadline: float | None = None, fence_step_ms: int = 0
    ) -> Grant:  # fmt: skip
        """*fence_step_ms*: a mutex's counter restart rounds up to that step (a quorum's
        member: acquire.lua's ARGV[6])."""
        keys = slot.keys
        names = [keys.lock, keys.fence, keys.waiting]
        if slot.permits:
            args: list[Any] = [token, ttl_ms, record, "1" if wait else "0", fence_ttl_ms]
            args.append(slot.limit)
            return self._acquire(slot, token, ttl_ms, PERMIT_ACQUIRE, args, names)
        args = _acquire_argv(token, ttl_ms, record, wait, fence_ttl_ms, fence_step_ms)
        return self._acquire(slot, token, ttl_ms, ACQUIRE, args, names)

    def take_over(
        self, slot: Slot, token: str, ttl_ms: int, record: str, handover: Handover, *,
        wait: bool, fence_ttl_ms: int
    ) -> Grant:  # fmt: skip
        keys = mutex_keys(slot)
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
        try:
            if slot.flow:
                return flow_grant(self._hold_all(slot, names, args), slot)
            reply = self._run(script, names, args)
        except Exception as exc:
            self._acquire_failed(slot, token, ttl_ms, exc)
        return grant_of(reply, permits=slot.permits)

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
            raise ConfigError(foreign_data_message(self.client, slot.keys, exc)) from exc
        raise self.unavailable(slot.name, exc) from exc

    def _failed(self, slot: Slot, exc: Exception) -> NoReturn:
        """Raise what a verb of *slot* that met *exc* raises (as :meth:`_guard` does)."""
        with self._guard(slot):
            raise exc
        raise AssertionError("unreachable")  # pragma: no cover - the guard raised

    # -- sent now, answered later -------------------------------------------------------
    def send(
        self, verb: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
        answered: Callable[[bool], object], behind: Any = None
    ) -> RedisSent | None:  # fmt: skip
        """An acquire, release, release_done, extend or enqueue of a mutex written now on
        a connection of the client's pool, its answer read later (a quorum's fan-out, a
        publish's claim: see :mod:`.redis_sent`); None for anything else (a cluster, a
        Sentinel-managed master, a permit, another verb)."""
        slot = args[0] if args else None
        build = _SENDS.get(verb)
        if build is None or self._pool is None or not isinstance(slot, Slot) or slot.permits:
            return None
        if self._sentinel is not None:  # each script checks where it lands (sentinel_watch)
            return None
        script, names, argv, finish, fail = build(self, *args, **kwargs)
        before = behind if isinstance(behind, RedisSent) else None
        return RedisSent(self._pool, script, names, argv, finish, fail, answered, before)

    def _abandon(self, slot: Slot, token: str, notice_ms: int, *, here: bool = True) -> None:
        """Take back what *token* may hold, best effort, never raising: here once (not
        after the server timed out: the caller does not wait a second socket timeout),
        and when that does not get through, once more a little later from the process's
        give-back thread (:func:`.redis_giveback.later`). What is not taken back expires
        with its lease."""
        if here:
            with contextlib.suppress(Exception):
                self.release(slot, token, notice_ms)
                return
        redis_giveback.later(lambda: self.release(slot, token, notice_ms))

    def release(self, slot: Slot, token: str, notice_ms: int) -> Status:
        keys = slot.keys
        names = [keys.lock, keys.notify, keys.waiting, keys.released]
        if slot.permits:
            args: list[Any] = [token, notice_ms, slot.limit, RECENT_BYTES]
            return self._give_back(slot, PERMIT_RELEASE, names, args)
        return self._give_back(slot, RELEASE, names, [token, notice_ms, RECENT_BYTES])

    def release_done(
        self, slot: Slot, token: str, notice_ms: int, mark: str, mark_ms: int
    ) -> Status:
        keys = mutex_keys(slot)
        names = [keys.lock, keys.notify, keys.waiting, keys.released, keys.done]
        args = [token, notice_ms, RECENT_BYTES, mark, mark_ms]
        return self._give_back(slot, RELEASE, names, args)

    def _give_back(self, slot: Slot, script: Script, names: list[str], args: list[Any]) -> Status:
        with self._guard(slot):
            if slot.held_rules:
                return self._release_all(slot, names, args)
            return Status.of(self._run(script, names, args))

    def extend(self, slot: Slot, token: str, ms: int, *, replace: bool) -> int | Status:
        script = PERMIT_EXTEND if slot.permits else EXTEND
        with self._guard(slot):
            code = int(self._run(script, [slot.keys.lock], [token, ms, "1" if replace else "0"]))
            if code > 0 and slot.held_rules:
                rules = self._extend_rules(slot, token, code)
                if rules is not Status.OK:
                    return rules
        return code if code > 0 else Status.of(code)

    def renew(self, items: Sequence[Renewal]) -> list[Status | QuorumUnavailable]:
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

    def _renew_flat(self, items: Sequence[Renewal]) -> list[Status | QuorumUnavailable]:
        """*items* renewed as they are: one ``extend_many.lua`` on a plain Redis, else
        :meth:`_renew_nodes`."""
        if self.cluster:
            return self._renew_nodes(items)
        with self._errors(items[0].slot.name):
            return [*extend_many(self.client, items, self._pool, self._run)]

    def _renew_nodes(self, items: Sequence[Renewal]) -> list[Status | QuorumUnavailable]:
        """A cluster's renewal: ``extend_node.lua`` on each node for the items it serves."""
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
            return int(self._run(RAISE_FENCE, [slot.keys.fence], [fence, fence_ttl_ms]))

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


def _timed_out(exc: BaseException) -> bool:
    """The server did not answer within the socket timeout (a slow or stopped server)."""
    return isinstance(exc, (rx.TimeoutError, TimeoutError))


#: What a sent verb writes: the script, its keys and arguments, how its answer reads, and
#: what its error raises.
_Sending = tuple[Script, list[str], list[Any], Callable[[Any], Any], Callable[[Exception], Any]]


def _acquire_argv(  # noqa: PLR0917 - acquire.lua's arguments, in its order
    token: str, ttl_ms: int, record: str, wait: bool, fence_ttl_ms: int, fence_step_ms: int
) -> list[Any]:
    """acquire.lua's ARGV for a mutex without a hand-over."""
    argv: list[Any] = [token, ttl_ms, record, "1" if wait else "0", fence_ttl_ms]
    if fence_step_ms:
        argv.append(fence_step_ms)
    return argv


def _send_acquire(
    backend: RedisBackend, slot: Slot, token: str, ttl_ms: int, record: str, *,
    wait: bool, fence_ttl_ms: int, fence_step_ms: int = 0
) -> _Sending:  # fmt: skip
    keys = slot.keys
    argv = _acquire_argv(token, ttl_ms, record, wait, fence_ttl_ms, fence_step_ms)
    taken = partial(backend._acquire_failed, slot, token, ttl_ms)
    return ACQUIRE, [keys.lock, keys.fence, keys.waiting], argv, _granted, taken


def _send_release(backend: RedisBackend, slot: Slot, token: str, notice_ms: int) -> _Sending:
    keys = slot.keys
    names = [keys.lock, keys.notify, keys.waiting, keys.released]
    return (
        RELEASE,
        names,
        [token, notice_ms, RECENT_BYTES],
        Status.of,
        partial(backend._failed, slot),
    )


def _send_release_done(  # noqa: PLR0917 - the release_done verb's arguments
    backend: RedisBackend, slot: Slot, token: str, notice_ms: int, mark: str, mark_ms: int
) -> _Sending:
    keys = mutex_keys(slot)
    names = [keys.lock, keys.notify, keys.waiting, keys.released, keys.done]
    argv = [token, notice_ms, RECENT_BYTES, mark, mark_ms]
    return RELEASE, names, argv, Status.of, partial(backend._failed, slot)


def _send_extend(
    backend: RedisBackend, slot: Slot, token: str, ms: int, *, replace: bool
) -> _Sending:
    argv = [token, ms, "1" if replace else "0"]
    return EXTEND, [slot.keys.lock], argv, _lease, partial(backend._failed, slot)


def _send_enqueue(
    backend: RedisBackend, slot: Slot, owner: str, ttl_ms: int, record: str, *,
    replace: bool, running_blocks: bool
) -> _Sending:  # fmt: skip
    keys = mutex_keys(slot)
    argv = [owner, ttl_ms, record, "1" if replace else "0", "1" if running_blocks else "0"]
    return ENQUEUE, [keys.queued, keys.lock], argv, queued_of, partial(backend._failed, slot)


def _send_raise_fence(backend: RedisBackend, slot: Slot, fence: int, fence_ttl_ms: int) -> _Sending:
    argv = [fence, fence_ttl_ms]
    return RAISE_FENCE, [slot.keys.fence], argv, int, partial(backend._failed, slot)


#: The verbs :meth:`RedisBackend.send` sends, and what each writes.
_SENDS: dict[str, Callable[..., _Sending]] = {
    "acquire": _send_acquire,
    "release": _send_release,
    "release_done": _send_release_done,
    "extend": _send_extend,
    "enqueue": _send_enqueue,
    "raise_fence": _send_raise_fence,
}


def _first_failure(found: Sequence[Status | QuorumUnavailable]) -> Status | QuorumUnavailable:
    """The outcome of an item renewed with its Limits: the first that did not answer (a
    cluster node), else the first failure (:meth:`~..backend_types.Status.first_failure`)."""
    for each in found:
        if isinstance(each, QuorumUnavailable):
            return each
    return Status.first_failure([s for s in found if isinstance(s, Status)])


def _granted(reply: Any) -> Grant:
    return grant_of(reply, permits=False)


def _lease(reply: Any) -> int | Status:
    code = int(reply)
    return code if code > 0 else Status.of(code)


#: The backend of each plain pool, while the pool lives (it holds none of the user's
#: objects: see RedisCalls).
_pool_backends: weakref.WeakKeyDictionary[Any, RedisBackend] = weakref.WeakKeyDictionary()
#: Any other client's backend, by id(client): weak, so a backend (and the client it
#: keeps) goes when nothing uses it.
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
