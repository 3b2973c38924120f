"""One member's calls in this process, in turns (:class:`Gate`): how a quorum
(:mod:`.round`) keeps a slow or stopped master from tying up more than one call.

A call reaches a member in one of two ways. A member that sends (a Redis master: the
verb written on a pooled connection by the caller itself, its answer read later) is
sent to directly, once this process has heard from it; the gate counts what it has sent
that has not been answered yet. Any other call runs in the process's thread pool, one at
a time per member, queued here. Either way, a member with a call outstanding for longer
than a round's timeout is stuck (silent, paused): it is sent nothing more until that
call returns.

An answer that nobody waits for any more (the outcome was decided without it) is left
with its gate (:meth:`Gate.set_aside`): the next call to that member reads it if it has come
(:meth:`Gate.settle`), or is written behind it on its connection
(:meth:`Gate.set_aside_alone`: in order, with no new connection, the old answer read
first), and the process's one reaper thread finishes whatever is still outstanding
:data:`REAP_AFTER` seconds later (its answer read in the pool, the connection given
back). The common case, an answer a few microseconds behind the majority, so costs no
thread at all. At interpreter exit (:func:`atexit`) whatever is still set aside is read
in the exiting thread, each call for at most its round's timeout: a script that
releases a Redlock and exits does not leave the lock on a master that answered a
moment late (a release that met ``NOSCRIPT`` there is sent again as ``EVAL``).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from ... import process, threads
from ...errors import StoreUnavailable

__all__ = ["BUSY", "REAP_AFTER", "Gate", "NoAnswer", "gate_of"]

#: How long an answer nobody waits for stays with its gate before the reaper finishes it.
REAP_AFTER = 0.005


class NoAnswer(Exception):
    """A member did not answer in time, or was not asked (still busy with earlier calls)."""


#: Why a stuck member was not asked.
BUSY = "not answering: still busy with an earlier call"


class Gate:
    """One member's calls, one at a time and in order, in this process.

    A caller does not wait for every master: it goes on at a majority, and the slowest
    master may still run the last call when the next one comes. Calls to one member
    queue here behind the one running (each dropped unrun if its round gave up on it
    meanwhile), and one pool thread runs them, so a client never has more than one
    call of ours running (a pool that allows 2 connections serves a Redlock and a
    waiter) and a member that stops answering ties up one thread, not the pool. A
    member whose call has run longer than a round's timeout is stuck (silent,
    paused): it is sent nothing more until that call returns. One gate per server
    (:func:`gate_of`), shared by every quorum that has it.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._queue: deque[tuple[Callable[[Any], Any], Any, float, cf.Future[Any]]] = deque()
        self._running = False  # a pool thread is running the queue
        self._since = 0.0  # when the running call started (0.0: between calls)
        #: Calls sent directly and not answered yet: key -> (when sent, the call).
        self._sent: dict[int, tuple[float, Any]] = {}
        #: The keys of those nobody waits for any more (set aside: see :meth:`set_aside`).
        self._set_aside: set[int] = set()
        #: Answered once: connected, scripts loaded.
        self.heard = False
        #: Sent to directly (it answered the last call it was sent); False after a send
        #: went unanswered: its calls take the thread path until it answers again.
        self.sends = True

    @property
    def calls(self) -> int:
        """Calls queued, running or sent and not answered."""
        return len(self._queue) + (self._since > 0) + len(self._sent)

    def stuck(self, timeout: float) -> bool:
        """True while a call to the member has been outstanding for longer than
        *timeout* (running in the pool, or sent directly)."""
        now = time.monotonic()
        if self._since and now - self._since > timeout:
            return True
        return any(now - sent > timeout for sent, _ in list(self._sent.values()))

    def sending(self, key: int) -> None:
        """A call about to be sent directly (*key*: its id), not answered yet."""
        with self._mutex:
            self._sent[key] = (time.monotonic(), None)

    def sent(self, key: int, call: Any) -> None:
        """The call sent as *key* (its ``poll()`` reads an answer that has come)."""
        with self._mutex:
            if key in self._sent:
                self._sent[key] = (self._sent[key][0], call)

    def settle(self) -> None:
        """Read the answers that have come of the calls sent directly (no wait), so that
        a member whose last answer is there but not read yet counts as idle."""
        for _, call in list(self._sent.values()):
            if call is not None:
                call.poll()

    def forget(self, key: int) -> None:
        """The call *key* was not sent after all."""
        with self._mutex:
            self._sent.pop(key, None)

    def set_aside(self, call: Any, until: float) -> None:
        """Nobody waits for *call* (sent directly) any more: the next call to this member
        may be written behind it (:meth:`set_aside_alone`); the reaper finishes it else.
        *until* (``time.monotonic()``): how long an exit waits for its answer."""
        with self._mutex:
            for key, (_, sent) in self._sent.items():
                if sent is call:
                    self._set_aside.add(key)
        _reaper.set_aside(call, until)

    def set_aside_alone(self) -> Any:
        """The one call outstanding here when it is set aside (a call may go behind it on
        its connection); None when there are others, or it is not set aside."""
        with self._mutex:
            if self._queue or self._since or len(self._sent) != 1:
                return None
            key, (_, call) = next(iter(self._sent.items()))
            return call if key in self._set_aside else None

    def answered(self, key: int, heard: bool) -> None:
        """The call sent as *key* came back (its connection given back); *heard*: the
        member answered (else it was down or silent: its calls take the pool's path)."""
        with self._mutex:
            self._sent.pop(key, None)
            self._set_aside.discard(key)
        if heard:
            self.heard = self.sends = True
        else:
            self.sends = False

    def offer(
        self, call: Callable[[Any], Any], member: Any, timeout: float
    ) -> cf.Future[Any] | None:
        """Queue ``call(member)``, to run within *timeout* seconds or not at all: its
        future, or None when the running call has run longer than *timeout* (stuck)."""
        future: cf.Future[Any] = cf.Future()
        now = time.monotonic()
        with self._mutex:
            if self.stuck(timeout):
                return None
            self._queue.append((call, member, now + timeout, future))
            start = not self._running
            self._running = True
        if start:
            threads.submit(self._drain)
        return future

    def _drain(self) -> None:
        while True:
            with self._mutex:
                if not self._queue:
                    self._running = False
                    return
                call, member, deadline, future = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            if time.monotonic() > deadline:  # its round gave up on it: do not run it
                future.set_result(NoAnswer(BUSY))
                continue
            self._since = time.monotonic()
            try:
                value, error = call(member), None
            except BaseException as exc:  # handed to the round: raised there
                value, error = None, exc
            finally:
                # Before the future is resolved: a follow-up chained to it is offered from
                # this thread, and must not find this call still "running".
                self._since = 0.0
            if not isinstance(error, StoreUnavailable):
                self.heard = self.sends = True
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)


#: Each member's gate, by the member's identity (its server): it outlives the quorum,
#: the backend and the client objects that reach that server (a Redlock made for each
#: call, on clients made for each call, still finds its masters heard from, and a master
#: stuck in a call of ours is stuck for every client of it).
_gates: dict[Hashable, Gate] = {}
_gates_lock = process.ForkLock()


def gate_of(identity: Hashable) -> Gate:
    """The one gate in this process of the member whose ``identity()`` is *identity*
    (made on first use)."""
    return process.made_once(_gates, identity, Gate, _gates_lock)


class _Reaper:
    """The process's one thread that finishes calls set aside: every :data:`REAP_AFTER`
    while any are set aside, each set aside that long is finished (a call the next call to its
    member settled meanwhile costs nothing). It stops once nothing is set aside; at exit,
    :meth:`flush` reads what is left."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        #: (when it is due, the call, how long an exit waits for its answer)
        self._set_aside: deque[tuple[float, Any, float]] = deque()
        self._thread: threading.Thread | None = None

    def set_aside(self, call: Any, until: float) -> None:
        with self._mutex:
            self._set_aside.append((time.monotonic() + REAP_AFTER, call, until))
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, name="celery-redlock-reaper", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(REAP_AFTER)
            now, due = time.monotonic(), []
            with self._mutex:
                while self._set_aside and self._set_aside[0][0] <= now:
                    due.append(self._set_aside.popleft()[1])
                if not due and not self._set_aside:
                    self._thread = None
                    return
            for call in due:
                call.finish()

    def flush(self) -> None:
        """Read every answer set aside here, each waited for until its *until* at most, and
        let the reaper end the ones it has taken (the process is exiting: the reaper is
        a daemon thread, and the pool takes no new work)."""
        with self._mutex:
            left, self._set_aside = list(self._set_aside), deque()
            thread = self._thread
        last = time.monotonic()
        for _, call, until in left:
            last = max(last, until)
            if call.ready(max(0.0, until - time.monotonic())):
                call.poll()
        if thread is not None:
            thread.join(max(0.0, last - time.monotonic()))


_reaper = _Reaper()


def _after_fork() -> None:
    global _gates, _reaper
    _gates = {}  # a child has none of its parent's calls
    _reaper = _Reaper()


@atexit.register
def _flush_at_exit() -> None:
    _reaper.flush()


process.on_fork(_after_fork)
