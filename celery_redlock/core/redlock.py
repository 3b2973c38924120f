"""``Redlock``: one lock over N independent Redis masters, held by a majority.

The state machine (waiting, reentrancy, the local deadline, renewal by the
per-process thread, events, ``with``) is :class:`BaseLock`'s; this module only
does the I/O, on every master in parallel, and counts votes.

How one acquire attempt goes (``n`` masters, quorum ``q = n // 2 + 1``)::

    t0 = monotonic()                    read before the first request
    ACQUIRE on every master at once     the wait ends as soon as the outcome is decided,
                                        at the latest after per_node_timeout; a master
                                        that has not answered by then counts as an error
    >= q acquired  -> fence = max(fences); raise the lower counters to it until a quorum
                      holds >= fence (RAISE_FENCE); validity = ttl - (now - t0) - drift
    otherwise      -> RELEASE on every master this token may hold (errored ones too),
                      then: fewer than q answered  -> QuorumUnavailable
                            someone may hold q     -> wait for its release notice (BLPOP on
                                                      one of its masters), capped at its lease
                            split vote             -> retry after a short random delay

Why fences keep increasing across different quorums (a timeline)::

    counters  m0=100  m1=5   m2=50
    A takes m1, m2 (m0 down): fences 6, 51 -> A's fence is 51; m1 is raised to 51
    B takes m0, m1 (m2 down): fences 101, 52 -> B's fence is 101; m1 is raised to 101
    C takes m1, m2 (m0 down): fences 102, 52 -> C's fence is 102
    Two majorities always share a master, and that master's counter already holds
    the previous holder's fence, so the next INCR there is larger. Without the
    write-back C would get 52 < 101. (This needs counters that survive restarts:
    see docs/redlock.md.)

How the requests travel. Sending the same small script to three servers is cheap;
waking three pool threads to do it costs more than the round trip itself. So the
calling thread writes each request on a connection it already has open to that
master and then waits on all the sockets at once (``poll``), reading replies as
they come. Everything that might block goes to the shared, long-lived I/O pool
(``_pool.executor()``; never a pool per call): opening a first connection (the
handshake blocks on a stalled server), a retry after a stale connection, and
draining a connection whose master did not answer in time. A master that stops
answering (SIGSTOP, a dead link) therefore costs one ``per_node_timeout``, not the
socket timeout; while a call to it is outstanding past that, new calls to it count
as errors at once (``MAX_LAGGING``), and at most ``MAX_POOL_WORK`` pool threads
wait on it, so it can neither slow every attempt nor starve the shared pool.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import logging
import os
import random
import select
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from . import _pool
from ._wire import resp
from .base import Attempt, BaseLock
from .errors import ConfigError, LockContended, QuorumUnavailable, RedlockError, describe_holder
from .lock import address_of, check_client, parse_holder, server_refused, wait_for_notice
from .scripts import ACQUIRE, EXTEND, RAISE_FENCE, RELEASE, Script, describe_code

__all__ = ["MAX_LAGGING", "MIN_NODE_TIMEOUT", "Redlock", "node_timeout"]

log = logging.getLogger("celery_redlock.acquire")
log_release = logging.getLogger("celery_redlock.release")

#: The shortest per-node timeout, whatever the TTL: below this, a first connection's
#: handshake or a busy host's thread scheduling alone makes healthy masters look
#: unreachable.
MIN_NODE_TIMEOUT = 0.05
#: Calls to one master still running past the per-node timeout before new calls to
#: it count as errors at once, without being sent or waited for: a silent master
#: costs one per-node timeout, then one probe at a time until it answers again.
MAX_LAGGING = 1
#: Pool threads one master may hold with calls stuck for longer than ``STUCK_AFTER``;
#: past that, new blocking calls to it are refused, so one silent master cannot
#: starve the shared pool (and the renewal thread that uses it).
MAX_POOL_WORK = 4
#: A pool call to a master counts as stuck once its fan-out ended without its answer,
#: or after this long (a healthy master answers far sooner).
STUCK_AFTER = 0.01
#: Open connections kept per master for sending from the calling thread.
MAX_IDLE = 16
#: How long a release first waits for a request of the same acquisition still out on
#: a master, so it can release there too instead of queueing behind it.
_BEHIND_WAIT = 0.005
#: While pool calls are also outstanding, the socket wait wakes this often to look.
_POLL_SLICE = 0.001
#: After the outcome is decided, how long to keep reading replies already on their way.
_GRACE = 0.0005

_R = TypeVar("_R", bound="Redlock")


def node_timeout(ttl: float) -> float:
    """The default per-node timeout for a lease of *ttl* seconds: 5% of it, >= 50 ms."""
    return max(MIN_NODE_TIMEOUT, 0.05 * ttl)


# -- one command, sent the fast way or the plain way -------------------------------------
@dataclass(frozen=True)
class _Op:
    """A command for every master: a script (EVALSHA) or a plain command."""

    keys: tuple[str, ...]
    args: tuple[Any, ...]
    script: Script | None = None
    command: str = ""

    def packable(self) -> tuple[Any, ...]:
        if self.script is not None:
            return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)
        return (self.command, *self.keys, *self.args)

    def with_source(self) -> tuple[Any, ...]:
        """The script sent whole (EVAL): runs it, and the server caches it for EVALSHA."""
        assert self.script is not None
        return ("EVAL", self.script.source, len(self.keys), *self.keys, *self.args)

    def call(self, client: Any) -> Any:
        """The plain redis-py way (any client, e.g. a RedisCluster used as one master)."""
        if self.script is not None:
            return self.script(client, self.keys, self.args)
        return client.execute_command(self.command, *self.keys, *self.args)


def _run_on(conn: Any, op: _Op) -> Any:
    """Send *op* on *conn* and read its reply (loading the script on NOSCRIPT)."""
    conn.send_packed_command(conn.pack_command(*op.packable()), check_health=False)
    try:
        return conn.read_response()
    except NoScriptError:
        if op.script is None:
            raise
        conn.send_command("SCRIPT", "LOAD", op.script.source, check_health=False)
        conn.read_response()
        conn.send_packed_command(conn.pack_command(*op.packable()), check_health=False)
        return conn.read_response()


class _Skipped(Exception):
    """A call that was not sent because the master is not answering earlier ones."""


class _Pending:
    def __repr__(self) -> str:
        return "<no answer>"


#: No answer (yet), or not asked.
PENDING: Any = _Pending()


class _Node:
    """Per master client, shared by every Redlock on that client.

    Keeps the connections used for sending from the calling thread (borrowed from
    the client's own connection pool, given back when broken or surplus) and counts
    the calls still running, to stop sending to a master that does not answer.
    """

    def __init__(self, client: Any) -> None:
        pool = getattr(client, "connection_pool", None)
        self.pool: Any = pool if hasattr(pool, "get_connection") else None
        self._client = weakref.ref(client)  # the registry must not keep clients alive
        self.lock = threading.Lock()
        # ticket -> (start, in a pool thread, outlived its fan-out)
        self.running: dict[int, tuple[float, bool, bool]] = {}
        self.idle: list[Any] = []
        self.pid = os.getpid()
        self._tickets = itertools.count()

    def _check_fork(self) -> None:
        if self.pid != os.getpid():  # forked: the parent's calls and sockets are not ours
            self.running.clear()
            self.idle.clear()
            self.pid = os.getpid()

    def lagging(self, now: float, limit: float) -> int:
        """How many calls to this master have been running longer than *limit* seconds."""
        if not self.running:  # the common case, without taking the lock
            return 0
        with self.lock:
            self._check_fork()
            return sum(1 for started, _, _ in self.running.values() if now - started > limit)

    def pool_full(self, now: float) -> bool:
        """True when ``MAX_POOL_WORK`` pool threads are already stuck on this master."""
        if not self.running:
            return False
        with self.lock:
            stuck = sum(
                1
                for started, pooled, late in self.running.values()
                if pooled and (late or now - started > STUCK_AFTER)
            )
        return stuck >= MAX_POOL_WORK

    def start(self, now: float, pooled: bool = False) -> int:
        with self.lock:
            ticket = next(self._tickets)
            self.running[ticket] = (now, pooled, False)
            return ticket

    def mark_late(self, ticket: int) -> None:
        """The fan-out that sent this request ended without its answer; a pool thread has it."""
        with self.lock:
            if ticket in self.running:
                self.running[ticket] = (self.running[ticket][0], True, True)

    def finish(self, ticket: int, _future: object = None) -> None:
        with self.lock:
            self.running.pop(ticket, None)

    def take_idle(self) -> Any:
        """An open connection to send on, or None (never blocks).

        No liveness probe here: a connection the server closed meanwhile fails on
        the read, and that request is redone on a fresh connection in the pool.
        """
        with self.lock:
            self._check_fork()
            while self.idle:
                conn = self.idle.pop()
                if _socket_of(conn) is not None:
                    return conn
                self.pool.release(conn)
            return None

    def put_back(self, conn: Any) -> None:
        with self.lock:
            if self.pid == os.getpid() and len(self.idle) < MAX_IDLE and _socket_of(conn):
                self.idle.append(conn)
                return
        self.pool.release(conn)

    def discard(self, conn: Any) -> None:
        try:
            conn.disconnect()
        finally:
            self.pool.release(conn)

    @property
    def client(self) -> Any:
        """The master's client (None once it was garbage-collected)."""
        return self._client()

    def call(self, op: _Op) -> Any:
        """Run *op* on this master, blocking (in a pool thread)."""
        if self.pool is None:
            client = self.client
            if client is None:
                raise RuntimeError("the Redis client of this master was garbage-collected")
            return op.call(client)
        conn = self.take_idle()
        fresh = conn is None
        if conn is None:
            conn = self.pool.get_connection()
        try:
            reply = _run_on(conn, op)
        except RedisConnectionError:
            self.discard(conn)
            if fresh:
                raise
            # A connection left idle may be stale (server restarted): one retry on a new one.
            conn = self.pool.get_connection()
            try:
                reply = _run_on(conn, op)
            except BaseException:
                self.discard(conn)
                raise
        except BaseException as exc:
            if _is_error_reply(exc):
                self.put_back(conn)
            else:
                self.discard(conn)
            raise
        self.put_back(conn)
        return reply

    def drain(self, conn: Any, replies: int, ticket: int) -> list[Any]:
        """Read *replies* late answers on *conn* (in a pool thread), then free it."""
        out: list[Any] = []
        try:
            for _ in range(replies):
                try:
                    out.append(conn.read_response())
                except BaseException as exc:
                    if not _is_error_reply(exc):
                        raise
                    out.append(exc)
        except BaseException:
            self.discard(conn)
            raise
        finally:
            self.finish(ticket)
        self.put_back(conn)
        return out


def _encoding_of(conn: Any) -> tuple[str, str]:
    encoder = getattr(conn, "encoder", None)
    return (getattr(encoder, "encoding", "utf-8"), getattr(encoder, "encoding_errors", "strict"))


def _pack(conn: Any, op: _Op, cache: dict[tuple[str, str], Any]) -> Any:
    """*op* in RESP bytes for *conn*, packed once per distinct client encoding."""
    key = _encoding_of(conn)
    data = cache.get(key)
    if data is None:
        data = cache[key] = [resp(op.packable(), *key)]
    return data


def _socket_of(conn: Any) -> Any:
    return getattr(conn, "_sock", None)


def _is_error_reply(exc: BaseException) -> bool:
    """An error *reply* (the connection is fine), not a broken connection."""
    return isinstance(exc, ResponseError)


#: Pool calls still running: id(future) -> (node, ticket).
_pool_calls: dict[int, tuple[_Node, int]] = {}


def _pool_call_done(node: _Node, ticket: int, future: cf.Future[Any]) -> None:
    node.finish(ticket)
    _pool_calls.pop(id(future), None)


_nodes: dict[int, _Node] = {}
_nodes_lock = threading.Lock()


def _node_for(client: Any) -> _Node:
    key = id(client)
    with _nodes_lock:
        node = _nodes.get(key)
        if node is None or node.client is not client:
            node = _nodes[key] = _Node(client)
            weakref.finalize(client, _nodes.pop, key, None)
        return node


class _Master:
    __slots__ = ("address", "client", "identity", "node")

    def __init__(self, client: Any) -> None:
        self.client = client
        self.address = address_of(client)
        self.identity = _identity(client)
        self.node = _node_for(client)


def _identity(client: Any) -> tuple[Any, ...]:
    """What makes two clients the same server (finer than the address shown to people)."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # a RedisCluster: its nodes
        nodes = client.get_nodes()
        return ("cluster", *sorted((n.host, n.port) for n in nodes))
    kwargs = getattr(pool, "connection_kwargs", {})
    manager = getattr(pool, "sentinel_manager", None)
    if manager is not None:  # a Sentinel-managed master: its name *and* its sentinels
        sentinels = sorted(
            (
                s.connection_pool.connection_kwargs.get("host"),
                s.connection_pool.connection_kwargs.get("port"),
            )
            for s in manager.sentinels
        )
        return ("sentinel", pool.service_name, *sentinels, kwargs.get("db", 0))
    return (kwargs.get("path") or kwargs.get("host"), kwargs.get("port"), kwargs.get("db", 0))


class _Gather:
    """Per-master answers of one fan-out; ``done`` is set once the outcome is decided."""

    def __init__(self, n: int, asked: int, decided: Callable[[list[Any]], bool]) -> None:
        self.results: list[Any] = [PENDING] * n
        self._left = asked
        self._decided = decided
        self._lock = threading.Lock()
        self.done = threading.Event()
        if asked <= 0:
            self.done.set()

    def record(self, index: int, value: Any) -> None:
        with self._lock:
            if self.results[index] is not PENDING:
                return
            self.results[index] = value
            self._left -= 1
            if self._left <= 0 or self._decided(self.results):
                self.done.set()

    def record_future(self, index: int, future: cf.Future[Any]) -> None:
        try:
            value: Any = future.result()
        except BaseException as exc:
            value = exc
        self.record(index, value)

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self.results)


@dataclass
class _Late:
    """A request sent from the calling thread (``conn`` None once answered)."""

    node: _Node
    conn: Any


@dataclass
class _FanOut:
    """What one fan-out found: one answer per master, and the calls still running."""

    results: list[Any]
    running: dict[int, cf.Future[Any]]  # pool calls, by master index
    late: dict[int, _Late]  # inline requests without an answer yet, by master index
    timed_out: bool
    started: float = 0.0


class Redlock(BaseLock):
    """A lease held by a majority of N independent Redis masters.

    >>> lock = Redlock(connect(["redis://a:6379", "redis://b:6379", "redis://c:6379"]),
    ...                "report:2024-06", ttl=30)
    >>> with lock:        # LockContended if another owner holds it,
    ...     write(fence=lock.fence)   # QuorumUnavailable if 2 of the 3 are down

    Same interface and options as :class:`Lock`; *per_node_timeout* (seconds,
    default 5% of the TTL, at least 50 ms) bounds how long any one call waits for
    a master. ``masters`` holds what each master answered last time (password-free
    address -> outcome).
    """

    def __init__(
        self,
        clients: Sequence[Any],
        name: str,
        ttl: float = 30.0,
        *,
        key_prefix: str = "redlock:",
        auto_renew: bool = True,
        reentrant: bool = False,
        max_hold: float | None = None,
        owner_info: Mapping[str, Any] | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        on_lost: Callable[[Any], object] | None = None,
        per_node_timeout: float | None = None,
        fence_ttl: float | None = None,
    ) -> None:
        if isinstance(clients, (str, bytes)) or not isinstance(clients, Sequence):
            raise ConfigError(
                "Redlock needs a list of Redis clients (one per independent master), got "
                f"{type(clients).__name__}; build them with celery_redlock.connect([url, ...])"
            )
        if not clients:
            raise ConfigError("Redlock needs at least one Redis master, got an empty list")
        for client in clients:
            check_client(client)
        super().__init__(
            name,
            ttl,
            key_prefix=key_prefix,
            auto_renew=auto_renew,
            reentrant=reentrant,
            max_hold=max_hold,
            owner_info=owner_info,
            blocking=blocking,
            timeout=timeout,
            on_lost=on_lost,
            fence_ttl=fence_ttl,
        )
        self._masters = [_Master(c) for c in clients]
        seen = Counter(m.identity for m in self._masters)
        twice = sorted({m.address for m in self._masters if seen[m.identity] > 1})
        if twice:
            raise ConfigError(
                f"Redlock masters must be distinct servers; listed more than once: "
                f"{', '.join(twice)} (a master counted twice breaks the majority)"
            )
        shown = Counter(m.address for m in self._masters)
        for i, master in enumerate(self._masters):  # e.g. two Sentinel groups "mymaster"
            if shown[master.address] > 1:
                master.address = f"{master.address}#{i}"
        if per_node_timeout is None:
            per_node_timeout = node_timeout(self.ttl)
        elif isinstance(per_node_timeout, bool) or not per_node_timeout > 0:
            raise ConfigError(f"per_node_timeout must be > 0 seconds, got {per_node_timeout!r}")
        self.per_node_timeout = float(per_node_timeout)
        self.quorum = len(self._masters) // 2 + 1
        self._last: tuple[_FanOut, Callable[[Any], str]] | None = None
        self._outcomes_cache: dict[str, str] | None = None
        self._holder_ttl_ms: int | None = None
        self._wait_client: Any = None
        self._in_flight: tuple[str, dict[int, cf.Future[Any]]] = ("", {})

    @property
    def masters(self) -> dict[str, str]:
        """What each master answered to the last call: password-free address -> outcome."""
        return dict(self._outcomes())

    def _remember(self, fan: _FanOut, describe: Callable[[Any], str]) -> None:
        self._last = (fan, describe)
        self._outcomes_cache = None

    def _outcomes(self) -> dict[str, str]:
        """The last call's per-master outcome texts (built when first asked for)."""
        if self._outcomes_cache is None:
            self._outcomes_cache = self._describe(*self._last) if self._last else {}
        return self._outcomes_cache

    @property
    def clients(self) -> list[Any]:
        """The master clients, in the order given."""
        return [m.client for m in self._masters]

    # -- fan-out ----------------------------------------------------------------------
    def _fan_out(
        self,
        op: _Op,
        kind: Callable[[Any], int],
        indexes: Sequence[int] | None = None,
        need: int | None = None,
        *,
        settle: bool = True,
        early_no: bool = True,
    ) -> _FanOut:
        """Send *op* to the masters (all, or *indexes*) in parallel and collect answers.

        *kind* sorts an answer: 1 yes, 0 no. The wait ends when *need* (default: a
        quorum) said yes, when so many said no, or so many failed, that *need* is out
        of reach (unless *early_no* is false), when all answered, or after
        ``per_node_timeout``. Answers are
        ``PENDING`` (none came, or not asked), an exception (the call failed), or
        the reply. Requests still out are handed to the pool to finish, unless
        *settle* is false: then the caller must pass the result to ``_settle_late``.
        """
        masters = self._masters
        picked = range(len(masters)) if indexes is None else indexes
        n = len(masters)
        q = self.quorum if need is None else need
        slack = len(picked) - q

        def decided(results: list[Any]) -> bool:
            yes = no = err = 0
            for value in results:
                if value is PENDING:
                    continue
                if isinstance(value, BaseException):
                    err += 1
                elif kind(value) > 0:
                    yes += 1
                else:
                    no += 1
            return yes >= q or (early_no and (no > slack or err > slack))

        started = time.monotonic()
        deadline = started + self.per_node_timeout
        gather = _Gather(n, len(picked), decided)
        running: dict[int, cf.Future[Any]] = {}
        inline: dict[int, _Late] = {}
        packed: dict[tuple[str, str], Any] = {}  # the same bytes go to every master
        for i in picked:
            node = masters[i].node
            lagging = node.lagging(started, self.per_node_timeout)
            if lagging >= MAX_LAGGING:
                gather.record(i, _Skipped(f"not answering ({lagging} earlier calls pending)"))
                continue
            conn = node.take_idle() if node.pool is not None else None
            if conn is not None:
                try:
                    conn.send_packed_command(_pack(conn, op, packed), check_health=False)
                except Exception:  # a stale connection (it is disconnected now): redo below
                    node.pool.release(conn)
                    conn = None
                else:
                    inline[i] = _Late(node, conn)
            if conn is None:
                future = self._submit(node, op)
                if future is None:
                    gather.record(i, _Skipped("not answering (its calls are stuck)"))
                else:
                    future.add_done_callback(partial(gather.record_future, i))
                    running[i] = future
        self._read_inline(op, inline, running, gather, deadline)
        timed_out = not gather.done.wait(max(0.0, deadline - time.monotonic()))
        results = gather.snapshot()
        late = {i: lt for i, lt in inline.items() if results[i] is PENDING}
        still = {i: f for i, f in running.items() if results[i] is PENDING}
        fan = _FanOut(results, still, late, timed_out, started)
        if settle:
            self._settle_late(fan)
        return fan

    def _read_inline(
        self,
        op: _Op,
        inline: dict[int, _Late],
        running: dict[int, cf.Future[Any]],
        gather: _Gather,
        deadline: float,
    ) -> None:
        """Wait on the sockets of the requests sent from this thread, reading replies."""
        if not inline:
            return
        by_fd: dict[int, int] = {}
        poller = select.poll() if hasattr(select, "poll") else None
        for i, late in inline.items():
            fd = _socket_of(late.conn).fileno()
            by_fd[fd] = i
            if poller is not None:
                poller.register(fd, select.POLLIN)
        grace_until = 0.0
        resent: set[int] = set()  # sent again whole after NOSCRIPT, on the same connection
        while by_fd:
            now = time.monotonic()
            if gather.done.is_set():
                # Decided. Replies still in flight are usually microseconds away: a
                # short grace reads them here instead of in a pool thread.
                grace_until = grace_until or min(deadline, now + _GRACE)
                left = grace_until - now
            else:
                left = deadline - now
            if left <= 0:
                return
            if running and any(not f.done() for f in running.values()):
                left = min(left, _POLL_SLICE)  # also keep an eye on the pool calls
            if poller is not None:
                ready = [fd for fd, _ in poller.poll(left * 1000)]
            else:  # pragma: no cover - platforms without poll()
                ready = select.select(list(by_fd), [], [], left)[0]
            for fd in ready:
                i = by_fd.pop(fd)
                if poller is not None:
                    poller.unregister(fd)
                late = inline[i]
                try:
                    value: Any = late.conn.read_response()
                except BaseException as exc:
                    value = exc
                if isinstance(value, NoScriptError) and op.script is not None and i not in resent:
                    # First use of the script on this master: send it whole on the same
                    # connection and keep reading here. No pool thread is needed, so a
                    # master whose pool calls are slow (a first TLS handshake) still
                    # gets it.
                    resent.add(i)
                    try:
                        late.conn.send_packed_command(
                            [resp(op.with_source(), *_encoding_of(late.conn))], check_health=False
                        )
                    except Exception as exc:  # disconnected meanwhile: the pool redoes it
                        value = RedisConnectionError(str(exc))
                    else:
                        by_fd[fd] = i
                        if poller is not None:
                            poller.register(fd, select.POLLIN)
                        continue
                if isinstance(value, NoScriptError) or (
                    isinstance(value, RedisConnectionError) and not _is_error_reply(value)
                ):
                    # Script not loaded there yet, or a stale connection: redo it the
                    # plain way on the pool (it loads the script / reconnects).
                    if isinstance(value, NoScriptError):
                        late.node.put_back(late.conn)
                    else:
                        late.node.pool.release(late.conn)
                    future = self._submit(late.node, op)
                    if future is not None:
                        future.add_done_callback(partial(gather.record_future, i))
                        running[i] = future
                        inline[i] = _Late(late.node, None)  # answered through the pool
                        continue
                elif _is_error_reply(value) or not isinstance(value, BaseException):
                    late.node.put_back(late.conn)
                else:
                    late.node.pool.release(late.conn)  # read_response disconnected it
                inline[i] = _Late(late.node, None)
                gather.record(i, value)

    def _submit(self, node: _Node, op: _Op) -> cf.Future[Any] | None:
        """Run *op* on *node* in a pool thread (tracked, so a stuck master is noticed).

        None when it was not sent: the master already has too many stuck calls, or
        the interpreter is shutting down.
        """
        now = time.monotonic()
        if node.pool_full(now):
            return None
        ticket = node.start(now, pooled=True)
        try:
            future = _pool.executor().submit(node.call, op)
        except RuntimeError:  # interpreter shutting down
            node.finish(ticket)
            return None
        _pool_calls[id(future)] = (node, ticket)
        future.add_done_callback(partial(_pool_call_done, node, ticket))
        return future

    def _settle_late(self, fan: _FanOut, then: _Op | None = None) -> dict[int, cf.Future[Any]]:
        """Deal with requests still out after a fan-out; return what still runs, by master.

        Requests sent from this thread are handed to a pool thread that reads the late
        replies and frees the connection; *then* (a release) is first written on the
        same connection, so the server runs it after the request, never before. Pool
        calls still running get *then* queued behind them.
        """
        pool = _pool.executor()
        still: dict[int, cf.Future[Any]] = dict(fan.running)
        for future in fan.running.values():
            node_ticket = _pool_calls.get(id(future))
            if node_ticket is not None:
                node_ticket[0].mark_late(node_ticket[1])
        for i, late in fan.late.items():
            if late.conn is None:
                continue
            node = late.node
            replies = 1
            if then is not None:
                try:
                    late.conn.send_packed_command(
                        late.conn.pack_command(*then.packable()), check_health=False
                    )
                    replies = 2
                except Exception:  # disconnected: nothing more can be sent on it
                    node.pool.release(late.conn)
                    continue
            if node.pool_full(time.monotonic()):
                # No thread to spare for this master: close the connection instead (the
                # server still runs what was written on it, in order, if it ever reads it).
                node.discard(late.conn)
                continue
            ticket = node.start(fan.started, pooled=True)  # counts as lagging from now on
            node.mark_late(ticket)
            try:
                still[i] = pool.submit(node.drain, late.conn, replies, ticket)
            except RuntimeError:
                node.finish(ticket)
                node.discard(late.conn)
        if then is not None:
            for i, future in fan.running.items():
                future.add_done_callback(partial(self._submit_later, i, then))
        return still

    def _submit_later(self, index: int, op: _Op, _future: object) -> None:
        self._submit(self._masters[index].node, op)

    # -- outcome texts ------------------------------------------------------------------
    def _describe(self, fan: _FanOut, ok: Callable[[Any], str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for master, value in zip(self._masters, fan.results, strict=True):
            if value is PENDING:
                if fan.timed_out:
                    text = f"no answer within {self.per_node_timeout * 1000:.0f} ms"
                else:
                    text = "not waited for (decided without it)"
            elif isinstance(value, _Skipped):
                text = str(value)
            elif isinstance(value, BaseException):
                text = f"{type(value).__name__}: {value}"
            else:
                text = ok(value)
            out[master.address] = text
        return out

    def _unavailable(self, what: str, outcomes: Mapping[str, str]) -> QuorumUnavailable:
        exc = QuorumUnavailable(self.name, outcomes, needed=self.quorum, total=len(self._masters))
        log.warning("%s of %r failed: %s", what, self.name, exc)
        return exc

    def _release_op(self, token: str) -> _Op:
        keys = self.keys
        return _Op((keys.lock, keys.notify, keys.waiting), (token, self.ttl_ms), RELEASE)

    # -- I/O for BaseLock -------------------------------------------------------------
    def _do_acquire(self, token: str, info: str, wait: bool) -> Attempt:
        started = time.monotonic()
        keys = self.keys
        op = _Op(
            (keys.lock, keys.fence, keys.waiting),
            (token, self.ttl_ms, info, "1" if wait else "0", self.fence_ttl_ms),
            ACQUIRE,
        )
        # A failed attempt waits for every answer (up to the per-node timeout): each
        # master that granted it is then given back before acquire() returns.
        fan = self._fan_out(op, _acquire_kind, settle=False, early_no=False)
        results = fan.results
        self._remember(fan, _describe_acquire)
        fences = {i: int(v[1]) for i, v in enumerate(results) if _is_reply(v) and int(v[0]) == 1}
        if len(fences) >= self.quorum:
            fence = self._settle_fence(fences)
            if fence is not None:
                # Requests of this acquisition still out must not be overtaken by its
                # release (it would miss them and leave the key for a whole TTL).
                self._in_flight = (token, self._settle_late(fan))
                return Attempt(True, started, fence=fence)
            self._give_back(token, fan)  # granted, but the fence could not be settled
            self._event("unavailable", error="fence write-back failed")
            raise self._unavailable("acquire", self._outcomes())
        self._give_back(token, fan)
        outcomes = self._outcomes()
        for i in fences:
            address = self._masters[i].address
            outcomes[address] += ", given back"
        held = {
            i: (_text(v[1]), int(v[2]))
            for i, v in enumerate(results)
            if _is_reply(v) and int(v[0]) != 1
        }
        answered = len(fences) + len(held)
        if answered < self.quorum:
            foreign = [v for v in results if isinstance(v, ResponseError) and not server_refused(v)]
            if foreign:  # e.g. WRONGTYPE: data under our keys, not a Redis outage
                raise ConfigError(
                    f"lock {self.name!r}: {len(foreign)} of {len(self._masters)} masters "
                    f"refused the acquire script on the data at {self.keys.lock!r} "
                    f"({'; '.join(f'{m}: {o}' for m, o in outcomes.items())}): something other "
                    f"than celery-redlock writes under the key prefix {self.key_prefix!r}"
                )
            # Too few masters answered to decide anything: Redis trouble, not contention.
            self._event("unavailable", error="quorum unavailable")
            raise self._unavailable("acquire", outcomes)
        unknown = len(self._masters) - answered
        # Contention. Group the other answers by holder record (one per acquisition).
        groups = Counter(text for text, _ in held.values())
        top, top_count = groups.most_common(1)[0] if groups else ("", 0)
        top_ttls = [ms for text, ms in held.values() if text == top and ms >= 0]
        self._wait_client = next(
            (self._masters[i].client for i, (t, _) in held.items() if t == top),
            self._masters[0].client,
        )
        if top_count + unknown >= self.quorum and top_ttls:
            ttl_ms = max(1, min(top_ttls))  # that holder may own a majority: wait for it
        else:
            # A split vote: nobody has a majority. Retry after a short random delay
            # (or sooner, on a release notice from one of the other contenders).
            jitter = random.uniform(0.2, 1.0) * max(self.per_node_timeout, 0.01)
            ttl_ms = max(1, int(jitter * 1000))
            if top_ttls:
                ttl_ms = min(ttl_ms, max(1, min(top_ttls)))
        self._holder_ttl_ms = min(top_ttls) if top_ttls else None
        return Attempt(False, started, holder=parse_holder(top), ttl_ms=ttl_ms, masters=outcomes)

    def _give_back(self, token: str, fan: _FanOut) -> None:
        """Release whatever *token* may hold after a failed attempt, errored masters included.

        Masters that answered "held by another owner" hold nothing of ours and are
        left alone; requests still out get the release queued right behind them, so
        it can never overtake them. Releases where the lock was granted are waited
        for (one per-node timeout at most); the others are fire-and-forget.
        """
        release = self._release_op(token)
        self._settle_late(fan, then=release)
        granted: list[int] = []
        for i, value in enumerate(fan.results):
            if value is PENDING or isinstance(value, _Skipped):
                continue  # never sent, or settled above
            if isinstance(value, BaseException):
                self._submit(self._masters[i].node, release)
            elif int(value[0]) == 1:
                granted.append(i)
        if granted:
            self._fan_out(release, lambda v: 1, granted, need=len(granted))

    def _settle_fence(self, fences: Mapping[int, int]) -> int | None:
        """Make a quorum hold a counter >= the chosen fence; return it, or None if it could not."""
        fence = max(fences.values())
        have = sum(1 for f in fences.values() if f == fence)
        if have >= self.quorum:
            return fence
        lower = [i for i, f in fences.items() if f < fence]
        need = self.quorum - have
        op = _Op((self.keys.fence,), (fence, self.fence_ttl_ms), RAISE_FENCE)
        fan = self._fan_out(op, lambda v: 1 if int(v) >= fence else 0, lower, need)
        raised = sum(1 for i in lower if _is_reply(fan.results[i]) and int(fan.results[i]) >= fence)
        if raised >= need:
            return fence
        outcomes = self._outcomes()
        for i in lower:
            value = fan.results[i]
            if not _is_reply(value):
                what = "no answer" if value is PENDING else f"{type(value).__name__}: {value}"
                address = self._masters[i].address
                outcomes[address] = f"acquired, but writing fence {fence} back failed ({what})"
        log.warning(
            "acquire of %r: could not write fence %s back to a quorum; giving it back",
            self.name,
            fence,
        )
        return None

    def _do_release(self, token: str) -> int:
        release = self._release_op(token)
        kind: Callable[[Any], int] = lambda v: 1 if int(v) == 1 else 0  # noqa: E731
        behind: dict[int, cf.Future[Any]] = {}
        if self._in_flight[0] == token:
            behind = {i: f for i, f in self._in_flight[1].items() if not f.done()}
            self._in_flight = ("", {})
            if behind:  # usually done within a millisecond (e.g. a first connection)
                cf.wait(behind.values(), timeout=min(self.per_node_timeout, _BEHIND_WAIT))
                behind = {i: f for i, f in behind.items() if not f.done()}
        # Where a request of this acquisition is still out, the release must come after
        # it: first release everywhere else, which is usually a majority already.
        asked = [i for i in range(len(self._masters)) if i not in behind]
        fan = self._fan_out(release, kind, asked, need=min(self.quorum, len(asked)))
        if behind and sum(1 for v in fan.results if _is_reply(v) and kind(v)) < self.quorum:
            cf.wait(behind.values(), timeout=self.per_node_timeout)
            done = [i for i, f in behind.items() if f.done()]
            if done:
                more = self._fan_out(release, kind, done, need=len(done))
                for i in done:
                    fan.results[i] = more.results[i]
                behind = {i: f for i, f in behind.items() if i not in done}
        for i, future in behind.items():  # queue the release behind the request still out
            future.add_done_callback(partial(self._submit_later, i, release))
        self._remember(fan, _describe_code)
        codes = [int(v) for v in fan.results if _is_reply(v)]
        ok = codes.count(1)
        if ok >= self.quorum:
            return 1
        unknown = len(self._masters) - len(codes)
        if min(codes, default=0) < 0 and ok + unknown < self.quorum:
            return min(codes)  # -1 another owner, -2 foreign data (see release.lua)
        if len(codes) < self.quorum:
            log_release.warning(
                "release of %r: too few masters answered; it expires within %ss",
                self.name,
                self.ttl,
            )
            raise self._unavailable("release", self._outcomes())
        return 0

    def _do_abandon(self, token: str) -> None:
        # Through release: requests of this acquisition still out get it queued behind.
        # Where it does not get through, the lease expires by itself.
        with contextlib.suppress(RedlockError):
            self._do_release(token)

    def _do_extend(self, token: str, ms: int, replace: bool) -> int:
        op = _Op((self.keys.lock,), (token, ms, "1" if replace else "0"), EXTEND)
        fan = self._fan_out(op, lambda v: 1 if int(v) > 0 else 0)
        self._remember(fan, _describe_code)
        codes = [int(v) for v in fan.results if _is_reply(v)]
        leases = sorted((c for c in codes if c > 0), reverse=True)
        if len(leases) >= self.quorum:
            # The lock lives while a majority holds it: until the q-th longest lease ends.
            return leases[self.quorum - 1]
        unknown = len(self._masters) - len(codes)
        if len(leases) + unknown >= self.quorum:
            raise self._unavailable("extend", self._outcomes())
        return min(min(codes, default=0), 0)

    def _do_owned(self, token: str) -> bool:
        op = _Op((self.keys.lock,), ("token",), command="HGET")
        return self._majority(op, lambda v: _text(v) == token)

    def _do_locked(self) -> bool:
        return self._majority(_Op((self.keys.lock,), (), command="EXISTS"), bool)

    def _majority(self, op: _Op, yes: Callable[[Any], bool]) -> bool:
        fan = self._fan_out(op, lambda v: 1 if yes(v) else 0)
        answers = [bool(yes(v)) for v in fan.results if _is_reply(v)]
        if answers.count(True) >= self.quorum:
            return True
        if answers.count(False) > len(self._masters) - self.quorum:
            return False
        outcomes = self._describe(fan, lambda v: "yes" if yes(v) else "no")
        raise QuorumUnavailable(self.name, outcomes, needed=self.quorum, total=len(self._masters))

    def _do_wait(self, seconds: float) -> None:
        """One BLPOP on a master that holds the other owner's key, woken by its release.

        Capped at a quarter of the TTL (at least 1 s): if that master goes silent
        mid-wait, the waiter looks again at the others after at most that long,
        instead of sleeping out the holder's whole lease.
        """
        client = self._wait_client or self._masters[0].client
        seconds = min(seconds, max(1.0, self.ttl / 4))
        try:
            wait_for_notice(client, self.keys.notify, seconds)
        except RedlockError:
            # That master just failed; the next attempt finds out about the others.
            time.sleep(min(seconds, self.per_node_timeout))

    def _targets(self, token: str) -> Sequence[tuple[Any, str, str, int]]:
        return [(m.client, self.keys.lock, token, self.ttl_ms) for m in self._masters]

    def _combine_renewal(self, outcomes: Sequence[int | BaseException]) -> int | BaseException:
        codes = [int(o) for o in outcomes if not isinstance(o, BaseException)]
        ok = codes.count(1)
        if ok >= self.quorum:
            return 1
        unknown = len(outcomes) - len(codes)
        if ok + unknown >= self.quorum:  # undecided: a later round may get through
            errors = {
                m.address: f"{type(o).__name__}: {o}"
                for m, o in zip(self._masters, outcomes, strict=False)
                if isinstance(o, BaseException)
            }
            return QuorumUnavailable(
                self.name, errors, needed=self.quorum, total=len(self._masters)
            )
        return min(min(codes, default=0), 0)

    # -- context manager and repr -----------------------------------------------------
    def __enter__(self: _R) -> _R:
        if not self.acquire():
            raise LockContended(
                self.name, self.holder, self._holder_ttl_ms, masters=self._outcomes()
            )
        return self

    def __repr__(self) -> str:
        base = super().__repr__()[:-1]
        return f"{base} quorum={self.quorum}/{len(self._masters)}>"


def _is_reply(value: Any) -> bool:
    return value is not PENDING and not isinstance(value, BaseException)


def _acquire_kind(value: Any) -> int:
    return 1 if int(value[0]) == 1 else 0


def _describe_acquire(value: Any) -> str:
    if int(value[0]) == 1:
        return f"acquired (fence {int(value[1])})"
    who = describe_holder(parse_holder(value[1]))
    return f"held ({who}, {int(value[2])} ms left)"


def _describe_code(value: Any) -> str:
    code = int(value)
    if code == 1:
        return "ok"
    if code > 1:
        return f"ok ({code} ms)"
    if code == 0:
        return "the key is gone (expired or removed)"
    if code == -1:
        return "another owner holds it"
    return describe_code(code)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
