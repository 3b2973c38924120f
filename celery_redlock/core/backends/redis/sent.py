"""A script sent now, its answer read later: how a quorum reaches a Redis master without a
thread between the caller and the master (:class:`~celery_redlock.core.backend.Sent`).

:class:`RedisSent` takes a connection from the client's pool and writes ``EVALSHA`` on
it at once (redis-py's public ``pack_command`` and ``send_packed_command``); the quorum
asks :meth:`~RedisSent.ready` (``can_read``) of each master in turn and reads each answer
as it comes (``read_response``). The connection goes back to the pool once the answer is
read; an answer nobody waits for any more is read by a thread of the process's pool
(:meth:`~RedisSent.finish`), which gives the connection back then. A connection whose
answer does not come within its socket timeout is closed, never handed to another call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from redis import exceptions as rx

from ... import threads
from .client import cannot_decide, checkout
from .verbs import Call

__all__ = ["RedisSent"]


class RedisSent:
    """*call* (:class:`~.verbs.Call`) sent on a connection of *pool*; its answer is
    ``call.read(reply)``, or what ``fail(error)`` raises. ``answered(heard)`` is called
    once the connection is given back (*heard*: the server answered; False when it was
    down or silent)."""

    __slots__ = (
        "_answered",
        "_args",
        "_before",
        "_conn",
        "_error",
        "_fail",
        "_finish",
        "_keys",
        "_lock",
        "_pool",
        "_reply",
        "_script",
    )

    def __init__(
        self,
        pool: Any,
        call: Call,
        fail: Callable[[Exception], Any],
        answered: Callable[[bool], object],
        behind: RedisSent | None = None,
    ) -> None:
        script = call.script
        self._pool, self._script, self._answered = pool, script, answered
        self._keys, self._args, self._finish, self._fail = call.keys, call.args, call.read, fail
        self._reply: Any = None
        self._error: Exception | None = None
        self._conn: Any = None
        #: The ``answered`` of the call sent before this one on its connection, whose
        #: answer comes first (None when there is none, or once it is read).
        self._before: Callable[[bool], object] | None = None
        #: Held while the answer is read: the caller and a pool thread may both try.
        self._lock = threading.Lock()
        taken = None if behind is None else behind._hand_over()
        if taken is not None:  # written behind a call nobody waits for, on its connection
            self._conn, self._before = taken
            try:
                self._conn.send_packed_command(self._packed("EVALSHA", script.sha))
            except Exception as exc:
                self._close(exc)
            return
        try:
            self._conn = checkout(pool)
        except Exception as exc:  # the server cannot be reached: its answer, when read
            if not cannot_decide(exc):
                raise  # a client-side error (a pool with nothing to give): raised as it is
            self._error = exc
            answered(False)
            return
        try:
            self._conn.send_packed_command(self._packed("EVALSHA", script.sha))
        except Exception as exc:
            self._close(exc)

    def _packed(self, command: str, script: str) -> Any:
        keys = self._keys
        return self._conn.pack_command(command, script, len(keys), *keys, *self._args)

    def ready(self, timeout: float) -> bool:
        """True once the answer can be read (waits up to *timeout* for it)."""
        with self._lock:
            return self._ready(timeout)

    def _ready(self, timeout: float) -> bool:
        if self._conn is None:
            return True
        try:
            if self._before is not None:
                if not self._conn.can_read(timeout=timeout):
                    return False
                self._read_before()
            return bool(self._conn.can_read(timeout=timeout))
        except Exception as exc:
            self._close(exc)
            return True

    def _read_before(self) -> None:
        """Read (and drop) the answer of the call sent before this one on its connection."""
        with contextlib.suppress(rx.ResponseError):  # its own error: nobody waits for it
            self._conn.read_response()
        before, self._before = self._before, None
        if before is not None:
            before(True)

    def _hand_over(self) -> tuple[Any, Callable[[bool], object]] | None:
        """This call's connection, for a call written behind it, with this call's
        ``answered`` (the new call reads this answer first); None when it has none to
        give (answered already, or being read)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._conn is None or self._before is not None:
                return None
            conn, self._conn = self._conn, None
            self._error = RuntimeError("handed over to the call sent behind it")
            return conn, self._answered
        finally:
            self._lock.release()

    def result(self) -> Any:
        """The script's answer through ``finish``, or what ``fail`` makes of its error."""
        if self._conn is not None:
            self._read()
        if self._error is not None:
            return self._fail(self._error)
        return self._finish(self._reply)

    def finish(self, follow: Callable[[], object] | None = None) -> None:
        """Nobody waits for the answer: a pool thread reads it, gives the connection back,
        then runs *follow* (at once here when the answer was read already)."""
        if self._conn is None:
            if follow is not None:
                threads.submit(follow)
            return
        threads.submit(self._finish_later, follow)

    def _finish_later(self, follow: Callable[[], object] | None) -> None:
        self._read()
        if follow is not None:
            with contextlib.suppress(Exception):
                follow()

    def poll(self) -> None:
        """Read the answer if it has come (no wait), giving the connection back; nothing
        when another thread is reading it."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._conn is not None and self._ready(0) and self._conn is not None:
                self._read_now()
        finally:
            self._lock.release()

    def _read(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._read_now()

    def _read_now(self) -> None:
        conn = self._conn
        try:
            if self._before is not None:
                self._read_before()
            try:
                reply = conn.read_response()
            except rx.NoScriptError:  # an answer was read: the connection is in step
                conn.send_packed_command(self._packed("EVAL", self._script.source))
                reply = conn.read_response()
        except Exception as exc:
            self._close(exc)
            return
        self._reply, self._conn = reply, None
        self._pool.release(conn)
        self._answered(True)

    def _close(self, error: Exception) -> None:
        """The call failed on its connection: closed (its state is unknown), given back."""
        conn, self._conn, self._error = self._conn, None, error
        conn.disconnect()
        self._pool.release(conn)
        heard = not cannot_decide(error)
        before, self._before = self._before, None
        if before is not None:
            before(heard)
        self._answered(heard)
