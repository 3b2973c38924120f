"""The lean path for lock scripts: pre-packed EVALSHA on one held connection per pool.

redis-py spends about as much client CPU per command on its general machinery
(pool checkout with a readability poll, argument packing, callbacks, metrics)
as on the network round trip itself. A lock pays that twice per cycle, and a
Celery task twice per run. Here each process keeps one connection per
connection pool for lock scripts and packs EVALSHA itself, while keeping what
matters from redis-py:

- the connection comes from the client's own pool (TLS, unix sockets, AUTH,
  Sentinel master discovery and health checks are redis-py's);
- the client's ``retry`` policy is applied exactly as redis-py applies it
  (``conn.retry.call_with_retry``, disconnecting before each re-send), so a
  command is re-sent when and only when redis-py itself would re-send it;
- any exception between send and read, including an asynchronous one such as
  ``LockLost`` raised into a task thread, drops the connection, so a late
  reply is never read as the answer to the next command;
- after ``fork`` the child takes its own connection (the parent's is left to
  the parent), and a thread that finds the held connection busy (the renewal
  thread, another task thread) takes one from the pool as usual.

Clients this does not fit (Cluster, ``Redis`` subclasses, single-connection
clients, pools with a client-side cache or a single connection) go through
redis-py's normal ``evalsha``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

__all__ = ["evalsha", "resp"]


class _Held:
    """One process's held connection to one pool, and who may use it now."""

    __slots__ = ("busy", "conn", "encoding", "errors", "pid", "pool")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.pid = os.getpid()
        self.busy = threading.Lock()
        self.conn: Any = None  # taken from the pool on first use, then kept
        kwargs = getattr(pool, "connection_kwargs", {})
        self.encoding: str = kwargs.get("encoding", "utf-8")
        self.errors: str = kwargs.get("encoding_errors", "strict")


_held: weakref.WeakKeyDictionary[Any, _Held] = weakref.WeakKeyDictionary()
_held_lock = threading.Lock()


def _held_for(client: Any) -> _Held | None:
    """The held-connection record for *client*'s pool, or None when the lean path does not fit."""
    if type(client) is not redis.Redis or client.connection is not None:
        return None  # a subclass may wrap execute_command; single-connection clients share one
    pool = client.connection_pool
    held = _held.get(pool)
    if held is not None and held.pid == os.getpid():
        return held
    if getattr(pool, "cache", None) is not None or getattr(pool, "max_connections", 2) < 2:
        return None  # a client-side cache; a one-connection pool the held one would starve
    with _held_lock:
        held = _held.get(pool)
        if held is None or held.pid != os.getpid():
            held = _Held(pool)  # a forked child never touches its parent's connection
            _held[pool] = held
        return held


def resp(args: Sequence[Any], encoding: str, errors: str) -> bytes:
    """A RESP array of bulk strings, encoded as redis-py's encoder would (str, bytes, int,
    float); TypeError for any other type."""
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


def _roundtrip(conn: Any, packed: bytes) -> Any:
    try:
        # connect() is a no-op while connected; after a drop it is what makes a Sentinel
        # connection ask for the current master (send_packed_command would reconnect to
        # the address it had before the failover).
        conn.connect()
        conn.send_packed_command((packed,))
        return conn.read_response()
    except BaseException:
        # Whatever stopped us (a timeout, LockLost raised into this thread, Ctrl-C), the
        # reply may still arrive: this connection must not answer the next command with it.
        # A plain Connection's read_response drops itself on errors; a Sentinel connection's
        # does not, and nothing does for an exception landing between send and read.
        conn.disconnect()
        raise


def _run(conn: Any, packed: bytes) -> Any:
    return conn.retry.call_with_retry(
        lambda: _roundtrip(conn, packed), lambda _e: conn.disconnect()
    )


def _call(held: _Held, packed: bytes) -> Any:
    if held.busy.acquire(blocking=False):
        try:
            conn = held.conn
            if conn is None:
                try:
                    conn = held.pool.get_connection()
                except TypeError:  # redis-py < 5.3 requires a command name
                    conn = held.pool.get_connection("EVALSHA")
                held.conn = conn
            return _run(conn, packed)
        finally:
            held.busy.release()
    pool = held.pool
    try:
        conn = pool.get_connection()
    except TypeError:
        conn = pool.get_connection("EVALSHA")
    try:
        return _run(conn, packed)
    finally:
        pool.release(conn)


def evalsha(client: Any, sha: str, source: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """Run the script *sha* (loading *source* on NOSCRIPT) with *keys* and *args* on *client*."""
    held = _held_for(client)
    packed = None
    if held is not None:
        try:
            packed = resp(("EVALSHA", sha, len(keys), *keys, *args), held.encoding, held.errors)
        except TypeError:
            packed = None  # a type only redis-py's encoder knows (or refuses, clearly)
    if held is None or packed is None:
        try:
            return client.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(source)
            return client.evalsha(sha, len(keys), *keys, *args)
    try:
        return _call(held, packed)
    except NoScriptError:
        client.script_load(source)
        return _call(held, packed)
