"""The one way lock traffic reaches a Redis node: a held connection per process.

Every script and command of the core goes through a :class:`Channel`, one per
Redis client per process (each single-node store owns one). It keeps one
connection out of the client's own pool for lock traffic (TLS, unix sockets,
AUTH, Sentinel master discovery and health checks stay redis-py's) and uses only
redis-py's public connection API:
``pack_command``, ``send_packed_command``, ``can_read``, ``read_response``,
``connect``, ``disconnect`` and the connection's ``retry`` policy.

Two ways to use it:

- :meth:`Channel.call` sends and waits, on the calling thread, and re-sends on
  the errors the client's ``retry`` policy names, exactly as redis-py does (every
  lock script is written so that a re-sent copy is harmless: see the scripts'
  headers). A thread that finds the held connection in use takes one from the pool.
- :meth:`Channel.send` writes a command and returns at once with a :class:`Sent`
  to read later, so a caller can write to several nodes before waiting for any
  (see :mod:`celery_redlock.core.fanout`). It never blocks on connecting: when
  the held connection is in use or not connected, it returns None and the caller
  uses :meth:`call` in a pool thread instead.

``NOSCRIPT`` is answered in one place (:func:`_read_reply`): the script is sent
whole with ``EVAL`` on the same connection, which runs it and caches it.

Any exception between a send and its read (a timeout, a ``LockLost`` raised into
the thread, Ctrl-C) drops the connection, so a late reply is never read as the
answer to the next command.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import redis
from redis.exceptions import NoScriptError, RedisError

from . import process

__all__ = [
    "MAX_QUEUED",
    "Channel",
    "Command",
    "Lane",
    "Packed",
    "Plain",
    "Sent",
    "checkout",
    "executor",
    "pack",
]


class Command(Protocol):
    """What a channel can send: a plain command or a script, with its keys and arguments."""

    def args(self) -> tuple[Any, ...]:
        """The command as redis-py's ``execute_command`` takes it (``EVALSHA sha n ...``)."""
        ...

    def fallback(self) -> tuple[Any, ...] | None:
        """What to send instead after ``NOSCRIPT`` (``EVAL source n ...``), or None."""
        ...

    def packed(self, conn: Any) -> Any:
        """The command packed for *conn* (see :class:`Packed`)."""
        ...


class Packed:
    """Packs a command once per client encoding (:func:`pack`): a fan-out sends the
    same bytes to every master, and a queued follow-up is packed once for all of them."""

    __slots__ = ("_packed",)

    def __init__(self) -> None:
        self._packed: tuple[tuple[str, str], Any] | None = None

    def args(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def packed(self, conn: Any) -> Any:
        key = text_encoding(conn)
        cached = self._packed
        if cached is not None and cached[0] == key:
            return cached[1]
        data = [pack(self.args(), *key)]
        self._packed = (key, data)
        return data


_PROBE = "\u00e9"
_text_encodings: dict[tuple[type, str, str], tuple[str, str]] = {}


def text_encoding(conn: Any) -> tuple[str, str]:
    """The encoding (and its error handler) in which *conn*'s own packer writes ``str``
    arguments: the client's, except where redis-py packs with hiredis, which writes
    UTF-8 whatever the client's encoding. Found once per connection class and encoding
    by packing one probe with the connection's public ``pack_command``."""
    encoder = conn.encoder
    key = (type(conn), encoder.encoding, encoder.encoding_errors)
    found = _text_encodings.get(key)
    if found is None:
        found = (encoder.encoding, encoder.encoding_errors)
        try:
            probe = b"".join(conn.pack_command("ECHO", _PROBE))
        except (UnicodeError, LookupError):  # cannot encode the probe: nothing to tell
            probe = b""
        utf8 = _PROBE.encode("utf-8")
        if utf8 in probe and utf8 != _encoded(_PROBE, found):
            found = ("utf-8", "strict")
        _text_encodings[key] = found
    return found


def _encoded(text: str, encoding: tuple[str, str]) -> bytes | None:
    try:
        return text.encode(*encoding)
    except (UnicodeError, LookupError):
        return None


def pack(args: tuple[Any, ...], encoding: str, errors: str) -> bytes:
    """*args* as one RESP array of bulk strings, encoded as redis-py's encoder encodes
    them (``str`` in the client's encoding, ``bytes`` as they are, ``int`` and ``float``
    as their text). redis-py's ``pack_command`` does the same for any command, with
    checks and buffering a lock script's handful of short arguments does not need: it
    costs several times as much (docs/benchmarks.md); ``tests/test_send.py`` checks
    that both give the same bytes."""
    out = [b"*%d\r\n" % len(args)]
    for value in args:
        if isinstance(value, str):
            data = value.encode(encoding, errors)
        elif isinstance(value, bytes):
            data = value
        elif isinstance(value, int) and not isinstance(value, bool):
            data = b"%d" % value
        elif isinstance(value, float):
            data = repr(value).encode()
        else:
            raise TypeError(f"cannot send {type(value).__name__} {value!r} to Redis")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class Plain(Packed):
    """A plain command (``HGET key token``): sent as it is."""

    __slots__ = ("_args",)

    def __init__(self, *args: Any) -> None:
        super().__init__()
        self._args = args

    def args(self) -> tuple[Any, ...]:
        return self._args

    def fallback(self) -> tuple[Any, ...] | None:
        return None

    def __repr__(self) -> str:
        return f"Plain{self._args[:2]!r}"


#: Pool classes whose ``get_connection`` needs a command name (redis-py < 5.3), by type.
_needs_name: dict[type, bool] = {}


def checkout(pool: Any) -> Any:
    """A connection from *pool*, connected (redis-py's pools connect what they hand out).

    redis-py < 5.3 requires a command name (unused since); newer versions take none
    and warn when given one. Which one a pool class wants is read once from its
    signature.
    """
    kind = type(pool)
    needs = _needs_name.get(kind)
    if needs is None:
        try:
            params = inspect.signature(pool.get_connection).parameters
        except (TypeError, ValueError):  # a callable without a signature: assume the new API
            params = {}  # type: ignore[assignment]
        first = next(iter(params.values()), None)
        needs = _needs_name[kind] = (
            first is not None
            and first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD)
            and first.default is first.empty
        )
    return pool.get_connection("EVALSHA") if needs else pool.get_connection()


class Sent:
    """A command written on a channel's held connection, its reply not read yet."""

    __slots__ = ("_channel", "_command", "_conn", "_error", "_pending")

    def __init__(self, channel: Channel, conn: Any, command: Command) -> None:
        self._channel = channel
        self._conn = conn
        self._command = command
        self._pending = 1  # replies still to read on this connection
        self._error: RedisError | None = None  # the connection broke while waiting

    def ready(self, timeout: float) -> bool:
        """True when the reply (or the news that the connection broke) can be read now,
        waiting up to *timeout* seconds for it."""
        if self._error is not None:
            return True
        try:
            return bool(self._conn.can_read(timeout=max(timeout, 0.0)))
        except RedisError as exc:  # redis-py disconnected it: read() reports this
            self._error = exc
            return True

    def read(self) -> Any:
        """The reply (an error reply is raised), then the connection goes back.

        Call :meth:`ready` first to read without blocking past a deadline.
        """
        if self._error is not None:
            self._channel.drop(self._conn)
            raise self._error
        try:
            reply = _read_reply(self._conn, self._command)
        except redis.exceptions.ResponseError:
            self._done_one()  # an error reply: the connection is in step
            raise
        except BaseException:
            self._channel.drop(self._conn)
            raise
        self._done_one()
        return reply

    def _done_one(self) -> None:
        self._pending -= 1
        if not self._pending:
            self._channel.give_back(self._conn)

    def then(self, command: Command) -> Sent:
        """Write *command* behind this one on the same connection: it runs after it, in
        order, whatever became of the first reply. Read it (and this one's) later."""
        if self._error is not None:
            self._channel.drop(self._conn)
            raise self._error
        try:
            self._conn.send_packed_command(command.packed(self._conn))
        except BaseException:
            self._channel.drop(self._conn)
            raise
        self._pending += 1
        self._command = command
        return self

    def drain(self) -> None:
        """Read and discard what is still due on this connection (in a pool thread),
        then give the connection back; on any error it is dropped instead."""
        if self._error is not None:
            self._channel.drop(self._conn)
            return
        try:
            while self._pending:
                self._pending -= 1
                try:
                    self._conn.read_response()
                except redis.exceptions.ResponseError:
                    continue  # an error reply (NOSCRIPT too): the connection is in step
        except BaseException:
            self._channel.drop(self._conn)
            return
        self._channel.give_back(self._conn)


class Channel:
    """One Redis client's held connection for lock traffic, in this process."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pool: Any = client.connection_pool
        self._busy = threading.Lock()
        self._conn: Any = None  # taken from the pool on first use, then kept
        #: True once _conn may be disconnected: connect() again before the next send
        #: (a Sentinel connection must ask for the current master: send alone would
        #: reconnect to the address it had).
        self._stale = True
        #: True until a call on this channel got an answer: the first contact connects,
        #: shakes hands (TLS, AUTH, HELLO) and loads scripts, and may take longer.
        self.first_contact = True

    def call(self, command: Command) -> Any:
        """Send *command* and return its reply (an error reply is raised), blocking.

        Re-sent on the errors the client's ``retry`` policy names, as redis-py does.
        """
        held = self._busy.acquire(blocking=False)
        if held:
            if self._conn is None:
                try:
                    self._conn = checkout(self.pool)
                except BaseException:
                    self._busy.release()
                    raise
                self._stale = False
            conn = self._conn
        else:
            conn = checkout(self.pool)
        try:
            reply = conn.retry.call_with_retry(
                lambda: self._roundtrip(conn, command, held), lambda _error: conn.disconnect()
            )
            self.first_contact = False
            return reply
        finally:
            if held:
                self._busy.release()
            else:
                self.pool.release(conn)

    def _roundtrip(self, conn: Any, command: Command, held: bool) -> Any:
        if held and self._stale:
            conn.connect()
            self._stale = False
        try:
            conn.send_packed_command(command.packed(conn))
            return _read_reply(conn, command)
        except redis.exceptions.ResponseError:
            raise  # an error reply: the connection is in step
        except BaseException:
            conn.disconnect()
            if held:
                self._stale = True
            raise

    def send(self, command: Command) -> Sent | None:
        """Write *command* on the held connection and return at once, or return None
        when that would block (the connection is in use or not connected yet)."""
        if self._conn is None or self._stale or not self._busy.acquire(blocking=False):
            return None
        conn = self._conn
        try:
            conn.send_packed_command(command.packed(conn))
        except BaseException:
            self.drop(conn)
            raise
        return Sent(self, conn, command)

    # -- used by Sent -------------------------------------------------------------------
    def give_back(self, conn: Any) -> None:
        """A connection whose replies were all read is free again."""
        if conn is self._conn:
            self._busy.release()

    def drop(self, conn: Any) -> None:
        """A connection in an unknown state: disconnect it; it reconnects on next use."""
        conn.disconnect()
        if conn is self._conn:
            self._stale = True
            self._busy.release()

    def forget(self) -> None:
        """After fork: the parent's connection is the parent's; take a new one on next use."""
        self._conn = None
        self._stale = True
        self._busy = threading.Lock()


def _read_reply(conn: Any, command: Command) -> Any:
    """The reply to *command*; for a script the server has not cached (``NOSCRIPT``),
    the reply of the script sent whole (``EVAL`` runs it and caches it)."""
    try:
        return conn.read_response()
    except NoScriptError:
        whole = command.fallback()
        if whole is None:
            raise
    conn.send_packed_command(conn.pack_command(*whole))
    return conn.read_response()


#: Calls that may wait in one node's lane before it takes no more (see Lane.submit).
MAX_QUEUED = 8


class Lane:
    """Blocking work for one node, run in the process's I/O pool one call at a time, in
    the order it was queued.

    Calls that may block (connecting, a reply that did not come in time) go through
    their node's lane, so a later call never overtakes an earlier one on another
    connection (a release can never reach the server before the acquire it undoes),
    and a node that stops answering ties up one pool thread, not the pool.
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...], cf.Future[Any]]] = deque()
        self._mutex = threading.Lock()
        self._active = False
        self._since = 0.0  # when the running call started

    def idle(self) -> bool:
        """True when nothing is queued or running (a call may go out inline)."""
        return not self._active and not self._queue

    def pending(self) -> int:
        """Calls queued or running."""
        return len(self._queue) + self._active

    def stuck(self, longer_than: float) -> bool:
        """True when the running call started more than *longer_than* seconds ago."""
        return self._active and time.monotonic() - self._since > longer_than

    def offer(
        self, fn: Callable[..., Any], *args: Any, refuse_after: float
    ) -> cf.Future[Any] | None:
        """Queue new work ``fn(*args)``, unless the node looks gone: None (nothing queued)
        when the running call has been stuck for longer than *refuse_after* seconds, or
        :data:`MAX_QUEUED` calls wait already."""
        with self._mutex:
            if len(self._queue) >= MAX_QUEUED or self.stuck(refuse_after):
                return None
        return self.submit(fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        """Queue ``fn(*args)`` whatever the node's state (reading a reply that is due, a
        follow-up that must run after work already queued)."""
        future: cf.Future[Any] = cf.Future()
        with self._mutex:
            self._queue.append((fn, args, future))
            start = not self._active
            self._active = True
        if start:
            try:
                executor().submit(self._run)
            except RuntimeError:  # the pool is shutting down (interpreter exit)
                self._run()
        return future

    def _run(self) -> None:
        while True:
            with self._mutex:
                if not self._queue:
                    self._active = False
                    return
                fn, args, future = self._queue.popleft()
                self._since = time.monotonic()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


#: Threads in the I/O pool: one per node at a time (see Lane), plus the renewal rounds.
MAX_WORKERS = 32
_executor: cf.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def executor() -> cf.ThreadPoolExecutor:
    """The process's long-lived pool for Redis calls that may block (made on first use)."""
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = cf.ThreadPoolExecutor(
                    max_workers=MAX_WORKERS, thread_name_prefix="celery-redlock-io"
                )
    return _executor


def _after_fork() -> None:
    global _executor, _executor_lock
    _executor = None  # the parent's threads do not exist in the child
    _executor_lock = threading.Lock()


process.on_fork(_after_fork)
