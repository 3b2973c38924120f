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

import codecs
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from . import _pid

try:  # redis-py's pure-Python RESP parsers: the replies our own reader may take over
    from redis._parsers import _RESP2Parser, _RESP3Parser

    _PARSERS: tuple[type, ...] = (_RESP2Parser, _RESP3Parser)
except ImportError:  # pragma: no cover - a redis-py without them: its own reader always
    _PARSERS = ()

__all__ = ["evalsha", "resp"]


class _Held:
    """One process's held connection to one pool, and who may use it now."""

    __slots__ = ("ascii", "busy", "conn", "encoding", "errors", "pid", "pool", "sock")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.pid = _pid.current
        self.busy = threading.Lock()
        self.conn: Any = None  # taken from the pool on first use, then kept
        self.sock: Any = None  # the socket of conn our own reader was checked to fit
        kwargs = getattr(pool, "connection_kwargs", {})
        self.encoding: str = kwargs.get("encoding", "utf-8")
        self.errors: str = kwargs.get("encoding_errors", "strict")
        #: ASCII text encodes to the same bytes in this encoding (see _bulk_ascii).
        self.ascii = _ascii_superset(self.encoding)


#: Attribute on a connection pool holding this process's _Held for it. On the pool itself
#: (not in a weak-keyed table, whose values would keep their pool alive): it goes with the
#: pool, and finding it costs one attribute lookup on every script call.
_ATTR = "_celery_redlock_held"
_held_lock = threading.Lock()


def _held_for(client: Any) -> _Held | None:
    """The held-connection record for *client*'s pool, or None when the lean path does not fit."""
    if type(client) is not redis.Redis or client.connection is not None:
        return None  # a subclass may wrap execute_command; single-connection clients share one
    pool = client.connection_pool
    held: _Held | None = getattr(pool, _ATTR, None)
    if held is not None and held.pid == _pid.current:
        return held
    if getattr(pool, "cache", None) is not None or getattr(pool, "max_connections", 2) < 2:
        return None  # a client-side cache; a one-connection pool the held one would starve
    with _held_lock:
        held = getattr(pool, _ATTR, None)
        if held is None or held.pid != _pid.current:
            held = _Held(pool)  # a forked child never touches its parent's connection
            try:
                setattr(pool, _ATTR, held)
            except (AttributeError, TypeError):
                return None  # a pool that takes no attributes: redis-py's own path
        return held


def resp(args: Sequence[Any], encoding: str, errors: str) -> bytes:
    """A RESP array of bulk strings, encoded as redis-py's encoder would (str, bytes, int,
    float); TypeError for any other type."""
    return b"*%d\r\n%s" % (len(args), _bulk(args, encoding, errors))


def _bulk(args: Sequence[Any], encoding: str, errors: str) -> bytes:
    """The bulk strings of *args* (the part of a RESP array after its ``*N`` header)."""
    out = []
    for value in args:
        kind = type(value)
        if kind is str:
            data = value.encode(encoding, errors)
        elif kind is int:
            data = b"%d" % value
        elif isinstance(value, str):
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


def _ascii_superset(encoding: str) -> bool:
    """True if *encoding* writes ASCII text as ASCII bytes (UTF-8, Latin-1, ...)."""
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        return False  # redis-py's encoder will say what is wrong with it
    return name in _ASCII_SUPERSETS


_ASCII_SUPERSETS = frozenset(("utf-8", "ascii", "iso8859-1", "cp1252"))


def _bulk_ascii(args: Sequence[Any]) -> bytes | None:
    """What :func:`_bulk` gives for *args* of ASCII ``str`` and ``int`` only, in an
    encoding where ASCII text is ASCII bytes; None for anything else.

    Lock names, tokens, holder records and TTLs are nearly always just that: the bulk
    strings are built as one text and encoded once, instead of one encode and one
    bytes format per argument.
    """
    parts = []
    for value in args:
        kind = type(value)
        if kind is str:
            if not value.isascii():
                return None
            text = value
        elif kind is int:
            text = str(value)
        else:
            return None
        parts.append(f"${len(text)}\r\n{text}\r\n")
    return "".join(parts).encode("ascii")


#: (sha, number of keys, number of arguments) -> the packed ``EVALSHA sha numkeys`` head
_heads: dict[tuple[str, int, int], bytes] = {}


def _evalsha_head(sha: str, nkeys: int, nargs: int) -> bytes:
    head = _heads.get((sha, nkeys, nargs))
    if head is None:
        head = b"*%d\r\n%s" % (3 + nkeys + nargs, _bulk(("EVALSHA", sha, nkeys), "ascii", "strict"))
        if len(_heads) < 1024:  # a handful of scripts and call shapes; bounded all the same
            _heads[(sha, nkeys, nargs)] = head
    return head


def _roundtrip(conn: Any, packed: bytes, held: _Held | None = None) -> Any:
    try:
        # Connecting is what makes a Sentinel connection ask for the current master after a
        # drop (send_packed_command would reconnect to the address it had before the
        # failover). redis-py's connect() is a no-op while connected, but only after a
        # retry wrapper and two calls: asked only when there is no socket.
        if getattr(conn, "_sock", None) is None:
            conn.connect()
        conn.send_packed_command((packed,))
        if held is not None and (held.sock is conn._sock or _reader_fits(held, conn)):
            return _read_reply(conn)
        return conn.read_response()
    except BaseException:
        # Whatever stopped us (a timeout, LockLost raised into this thread, Ctrl-C), the
        # reply may still arrive: this connection must not answer the next command with it.
        # A plain Connection's read_response drops itself on errors; a Sentinel connection's
        # does not, and nothing does for an exception landing between send and read.
        conn.disconnect()
        raise


def _as_send_error(error: Exception) -> Exception:
    """A socket error from ``sendall`` as redis-py's send_packed_command reports it (the
    retry policy chooses by these types); anything else as it is."""
    if isinstance(error, (TimeoutError, BlockingIOError)):  # socket.timeout; SO_SNDTIMEO
        return RedisTimeoutError("Timeout writing to socket")
    if isinstance(error, OSError):
        if len(error.args) >= 2:
            errno, errmsg = error.args[:2]
        else:
            errno, errmsg = "UNKNOWN", (error.args or (error,))[0]
        return RedisConnectionError(f"Error {errno} while writing to socket. {errmsg}.")
    return error


# -- our own reader for script replies ------------------------------------------------------
# redis-py reads a reply through read_response, its RESP parser and that parser's socket
# buffer: about a dozen Python-level calls per reply, twice per lock cycle. On the held
# connection, where nothing else reads and every reply is read whole, the reply is read
# from the socket and parsed here instead, into exactly what redis-py's parser returns
# (tests/test_wire.py compares the two for every reply shape). It is used only over
# redis-py's pure-Python parsers (hiredis reads fast enough and buffers on its own), and
# only on a socket whose parser buffer was checked to hold nothing unread.

_READ_SIZE = 65536


def _reader_fits(held: _Held, conn: Any) -> bool:
    """True if our reader may read this connection's replies (checked once per socket)."""
    parser = getattr(conn, "_parser", None)
    buffer = getattr(parser, "_buffer", None)
    if type(parser) not in _PARSERS or buffer is None or buffer.unread_bytes():
        return False
    held.sock = conn._sock
    _kernel_timeouts(held.sock)
    return True


#: Where SO_RCVTIMEO/SO_SNDTIMEO take a ``struct timeval`` of two C longs.
_KERNEL_TIMEOUTS = sys.platform.startswith("linux") and hasattr(socket, "SO_RCVTIMEO")


def _kernel_timeouts(sock: Any) -> None:
    """Let the kernel enforce a held socket's timeout instead of Python.

    A Python socket with a timeout is non-blocking underneath and calls ``poll`` before
    every ``send`` and ``recv``: four system calls per round trip instead of two. The
    same limit set as SO_RCVTIMEO/SO_SNDTIMEO on a blocking socket holds each call to it
    just the same, and a call that runs out raises ``BlockingIOError``, which our reader
    and ``_as_send_error`` report as redis-py reports a timeout. Plain TCP and unix
    sockets only (not TLS); a socket without a positive timeout is left as it is. If
    redis-py later sets a Python timeout on it again, both limits apply, which is still
    correct.
    """
    timeout = sock.gettimeout()
    if not _KERNEL_TIMEOUTS or type(sock) is not socket.socket or not timeout or timeout < 0:
        return
    seconds, micros = divmod(max(round(timeout * 1_000_000), 1), 1_000_000)
    limit = struct.pack("ll", seconds, micros)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    except OSError:
        return  # keep Python's timeout
    sock.settimeout(None)


class _Incomplete(Exception):
    """The bytes so far end inside the reply: read more."""


class _Push:
    """A RESP3 push frame: out of band, handed to redis-py's push handler."""

    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items


def _read_reply(conn: Any) -> Any:
    sock = conn._sock
    parser = conn._parser
    encoder = conn.encoder
    decode = encoder.decode if encoder.decode_responses else None
    data = b""
    while True:
        try:
            chunk = sock.recv(_READ_SIZE)
        except (TimeoutError, BlockingIOError):  # socket.timeout; SO_RCVTIMEO (see above)
            raise RedisTimeoutError("Timeout reading from socket") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error while reading from socket: {exc.args}") from None
        if not chunk:
            raise RedisConnectionError("Connection closed by server.")
        data += chunk
        value = _integers(data)  # a lock script's usual reply, whole: no parser needed
        if value is not None:
            end = len(data)
            break
        try:
            value, end = _parse(data, 0, parser, decode)
            while type(value) is _Push:  # out of band: hand it on, the reply follows
                handle = getattr(parser, "handle_push_response", None)
                if handle is not None:
                    handle(value.items)
                data = data[end:]
                value, end = _parse(data, 0, parser, decode)
        except _Incomplete:
            continue
        break
    if end != len(data):
        # More than one reply for one command: this connection is out of step. The reply
        # is complete and ours; the connection is dropped so nothing else is read from it.
        conn.disconnect()
    if conn.health_check_interval:
        conn.next_health_check = time.monotonic() + conn.health_check_interval
    if isinstance(value, Exception):
        raise value
    return value


def _integers(data: bytes) -> Any:
    """The reply in *data* if it is exactly one integer (``:1``) or an array of two integers
    (``*2 :1 :7``, an acquire's answer); None for anything else, which _parse then reads.

    Gives what _parse gives for these, with a few C calls instead of three Python calls.
    """
    if data[:1] == b":":
        end = len(data) - 2
        if end > 1 and data.find(b"\r\n") == end:
            return int(data[1:end])
        return None
    if data[:5] == b"*2\r\n:":
        parts = data.split(b"\r\n")
        if len(parts) == 4 and not parts[3] and parts[2][:1] == b":":
            return [int(parts[1][1:]), int(parts[2][1:])]
    return None


def _parse(  # noqa: PLR0911 - one return per RESP type
    data: bytes, pos: int, parser: Any, decode: Callable[[bytes], Any] | None
) -> tuple[Any, int]:
    """One RESP2/RESP3 value at *pos*: (value as redis-py's parser gives it, next position)."""
    eol = data.find(b"\r\n", pos)
    if eol < 0:
        raise _Incomplete
    kind = data[pos]
    line = data[pos + 1 : eol]
    pos = eol + 2
    if kind in (58, 40):  # ':' integer, '(' big number
        return int(line), pos
    if kind in (36, 61, 33):  # '$' bulk, '=' verbatim, '!' blob error
        size = int(line)
        if size < 0:
            return None, pos
        stop = pos + size
        if stop + 2 > len(data):
            raise _Incomplete
        blob = data[pos:stop]
        if kind == 33:
            return _error(parser, blob), stop + 2
        if kind == 61:
            blob = blob[4:]  # "txt:" / "mkd:"
        return (decode(blob) if decode is not None else blob), stop + 2
    if kind in (42, 126, 62):  # '*' array, '~' set, '>' push
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = _parse(data, pos, parser, decode)
            if isinstance(item, RedisConnectionError):
                raise item  # as redis-py does: a connection-level error is never a value
            items.append(item)
        return (_Push(items) if kind == 62 else items), pos
    if kind == 43:  # '+' simple string
        return (decode(line) if decode is not None else line), pos
    if kind == 45:  # '-' error
        return _error(parser, line), pos
    if kind == 95:  # '_' null
        return None, pos
    if kind == 35:  # '#' boolean
        return line == b"t", pos
    if kind == 44:  # ',' double
        return float(line), pos
    if kind == 37:  # '%' map
        mapping = {}
        for _ in range(int(line)):
            key, pos = _parse(data, pos, parser, decode)
            mapping[key], pos = _parse(data, pos, parser, decode)
        return mapping, pos
    raise InvalidResponse(f"Protocol Error: {data[pos - len(line) - 3 : pos]!r}")


def _error(parser: Any, text: bytes) -> Exception:
    """The exception redis-py makes of an error reply (NOSCRIPT -> NoScriptError, ...)."""
    error: Exception = parser.parse_error(text.decode("utf-8", errors="replace"))
    if isinstance(error, RedisConnectionError):
        raise error
    return error


def _run(
    conn: Any, packed: bytes, held: _Held | None = None, failed: Exception | None = None
) -> Any:
    """One round trip under the connection's retry policy, exactly as redis-py applies it.

    With redis-py's own ``Retry`` the first attempt runs outside ``call_with_retry`` (the
    policy has nothing to do until something fails); a failure is then replayed as the
    policy's first attempt, so it counts, backs off and re-sends as it always would.
    *failed*: the first attempt was already made (by ``_call``'s fast path) and failed so.
    """
    retry = conn.retry
    if type(retry) is not Retry:  # a custom policy sees every attempt itself
        return retry.call_with_retry(
            lambda: _roundtrip(conn, packed, held), lambda _e: conn.disconnect()
        )
    first: Exception | None = failed
    if first is None:
        try:
            return _roundtrip(conn, packed, held)
        except Exception as error:
            first = error

    def attempt() -> Any:
        nonlocal first
        if first is not None:
            replay, first = first, None
            raise replay
        return _roundtrip(conn, packed, held)

    return retry.call_with_retry(attempt, lambda _e: conn.disconnect())


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
            sock = conn._sock
            if (
                sock is not None
                and sock is held.sock
                and type(conn.retry) is Retry
                and (not conn.health_check_interval or time.monotonic() <= conn.next_health_check)
            ):
                # The usual case, with _run, _roundtrip and send_packed_command inlined: a
                # connected socket our reader was checked to fit, no health check due and
                # redis-py's own retry policy. Failures take the same way as in _roundtrip.
                try:
                    sock.sendall(packed)
                    return _read_reply(conn)
                except Exception as error:
                    conn.disconnect()
                    return _run(conn, packed, held, _as_send_error(error))
                except BaseException:
                    conn.disconnect()
                    raise
            return _run(conn, packed, held)
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
        values = (*keys, *args)
        body = _bulk_ascii(values) if held.ascii else None
        try:
            if body is None:
                body = _bulk(values, held.encoding, held.errors)
            packed = _evalsha_head(sha, len(keys), len(args)) + body
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
