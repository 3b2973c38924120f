"""The enqueue-time hold: at most one queued message per lock name.

A publisher takes the hold for the task id of the message it is about to send
(:meth:`QueuedHold.claim`); a second call finds it and is a duplicate, unless it
replaces the hold (the newest call wins). The worker that starts the message turns
the hold into the lock itself in one atomic, owner-checked step: a :class:`RunLock`
made with ``handover=Handover(task_id)`` (on Redis ``acquire.lua`` with the hold's key).
A ``RunLock`` may also leave a *done mark* when it is released (``done_as``): a
redelivered copy of a message that already ran then knows it ran. The hold lives at
``<lock key>:queued`` (same hash tag), a hash of ``owner`` (the task id) and ``info``
(its record), with a lease of its own: a message that never runs (lost, purged) frees
its name when it ends.

Why the hand-over is one step (a timeline, ``lock_on="enqueue+run"``)::

    t=0  publisher A: hold 'sync:42' for task a; sends a
    t=1  worker: a starts. Were it to release the hold, then acquire the lock:
    t=1+ publisher B finds neither hold nor lock, holds for b and sends it: two runs
         of sync:42 at once (a's and, soon, b's). In one script the hold becomes
         the lock, and B finds the lock held by a: a duplicate of a running task.

A hold belongs to a task id, not to a process, so any process can give it back
for that id (:meth:`QueuedHold.release`: a message revoked, expired or rejected
before it ran) and nobody can give back another id's hold.

Queued holds need one Redis (a plain server, a Sentinel master or a Cluster) or the
memory backend (the :class:`~.backend.QueuedHolds` capability): on a quorum, building
one raises :class:`~celery_redlock.core.errors.ConfigError`. Done marks
(:class:`~.backend.DoneMarks`) work on a quorum too.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from typing import Any

from . import events, process
from .backend import Backend, DoneMarks, QueuedHolds, Sendable, Sends, Sent, given, need
from .backend_types import Grant, Handover, Held, Queued, Slot, Status, Superseded
from .backends import open_backend
from .errors import ConfigError
from .keys import LockKeys, lock_keys
from .lease import ttl_to_ms
from .lock import Lock

__all__ = ["Handover", "PendingClaim", "QueuedHold", "RunLock"]

_HOSTNAME = socket.gethostname()
#: How long the wake-up notice of a kept run lives: a copy already waiting takes it now.
_NOTICE_MS = 60_000


class QueuedHold:
    """The enqueue-time hold of lock *name* on *target* (a client or a backend).

    >>> hold = QueuedHold(client, "sync:42")
    >>> hold.claim("task-id-1", ttl=3600).outcome
    'queued'
    >>> hold.claim("task-id-2", ttl=3600).owner        # a duplicate of task-id-1
    'task-id-1'
    """

    def __init__(
        self,
        target: Any,
        name: str,
        *,
        key_prefix: str = "redlock:",
        owner_info: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"lock name must be a non-empty string, got {name!r}")
        self._locks: Backend = open_backend(target)
        self.backend: QueuedHolds = need(self._locks, QueuedHolds)
        #: The backend as one that sends a claim now and reads its answer later.
        self._sender: Sends | None = given(self.backend, Sends)
        self.keys: LockKeys = lock_keys(name, key_prefix)
        self.slot = Slot(self.keys)
        self.name = self.keys.name
        self.owner_info: dict[str, Any] = dict(owner_info or {})

    def claim(
        self,
        owner: str,
        ttl: float,
        *,
        replace: bool = False,
        running_blocks: bool = False,
        report: bool = True,
    ) -> Queued:
        """Hold the name for task *owner* for *ttl* seconds, or say whose it is.

        *replace*: a hold of another task id is taken over (that message is then
        superseded: its worker skips it). *running_blocks*: while the lock itself is
        held by another task id's run, the call is a duplicate of that run. A task id
        that holds the name already renews its hold (a retry keeps its place).
        A duplicate emits a ``duplicate`` LockEvent unless *report* is False.
        Raises :class:`StoreUnavailable` when Redis cannot answer.
        """
        ttl_ms, record = self._terms(owner, ttl)
        found = self.backend.enqueue(
            self.slot, owner, ttl_ms, record, replace=replace, running_blocks=running_blocks
        )
        if report:
            self._report(found)
        return found

    def claim_later(self, owner: str, ttl: float, **terms: bool) -> PendingClaim:
        """:meth:`claim` (*terms*: its ``replace`` and ``running_blocks``), sent now and
        answered when :meth:`PendingClaim.result` is asked (on a backend that
        :class:`~.backend.Sends`; elsewhere claimed at once): a publish sends its claim
        before Celery builds the message, and reads the answer once the message is built.
        The caller ends with :meth:`PendingClaim.close`."""
        ttl_ms, record = self._terms(owner, ttl)
        replace, blocks = terms.get("replace", False), terms.get("running_blocks", False)
        flags = {"replace": replace, "running_blocks": blocks}
        args = (self.slot, owner, ttl_ms, record)
        sender = self._sender
        sent = None if sender is None else sender.send(Sendable.ENQUEUE, args, flags, _quiet)
        if sent is None:
            found = self.backend.enqueue(*args, replace=replace, running_blocks=blocks)
            return PendingClaim(self, found=found)
        return PendingClaim(self, sent=sent)

    def _terms(self, owner: str, ttl: float) -> tuple[int, str]:
        """(lease in ms, holder record) of a claim for task *owner*."""
        if not isinstance(owner, str) or not owner:
            raise ConfigError(f"a queued hold's owner must be a task id, got {owner!r}")
        at = round(time.time(), 3)
        record = {"hostname": _HOSTNAME, "pid": process.this.pid, "queued_at": at}
        record.update(self.owner_info)
        record["task_id"] = owner
        ttl_ms = ttl_to_ms(ttl, "the queued hold's ttl")
        return ttl_ms, json.dumps(record, separators=(",", ":"), default=str)

    def _report(self, found: Queued) -> None:
        if found.outcome == "duplicate" and events.wanted("duplicate"):
            events.emit(
                events.LockEvent(
                    "duplicate",
                    self.name,
                    self.keys.queued if found.state == "queued" else self.keys.lock,
                    holder=found.holder,
                    ttl=None if found.ttl_ms is None else found.ttl_ms / 1000,
                )
            )

    def release(self, owner: str) -> bool:
        """Give up task *owner*'s hold; True if it was there (never another id's)."""
        return self.backend.dequeue(self.slot, owner) is Status.OK

    def keep_for_redelivery(self, owner: str, ttl: float, **match: Any) -> bool:
        """Keep the run of task *owner* whose holder record also matches *match* (its
        ``pid``) for the redelivered copy of its message, *ttl* seconds: for the worker's
        main process when that run's child is gone and the message comes back
        (requeued). The name stays taken by *owner*, shown as queued: a new call is its
        duplicate, or is queued behind it; the copy's :class:`RunLock` takes it over and
        runs. True when kept; False when no such run holds the name (its lease ran out,
        it was released, or it is kept already): the caller may :meth:`claim` the hold
        for *owner* instead.
        """
        want = {**match, "task_id": owner}
        for holder in self._locks.holders(self.slot):
            if "kept_for" in holder.record:
                continue  # kept already: not a run any more
            if all(holder.record.get(k) == v for k, v in want.items()):
                record = {**holder.record, "kept_for": "redelivery", "queued_at": time.time()}
                text = json.dumps(record, separators=(",", ":"), default=str)
                ttl_ms = ttl_to_ms(ttl, "the kept hold's ttl")
                notice_ms = min(ttl_ms, _NOTICE_MS)
                found = self.backend.park(
                    self.slot, holder.token, owner, ttl_ms, record=text, notice_ms=notice_ms
                )
                return found is Status.OK
        return False

    def __repr__(self) -> str:
        return f"<QueuedHold {self.name!r}>"


class PendingClaim:
    """A claim of a queued hold sent now (:meth:`QueuedHold.claim_later`): :meth:`result`
    reads its answer, :meth:`close` lets it go unread (read in the background)."""

    def __init__(
        self, hold: QueuedHold, *, sent: Sent | None = None, found: Queued | None = None
    ) -> None:
        self._hold, self._sent, self._found = hold, sent, found
        if found is not None:
            hold._report(found)

    def result(self) -> Queued:
        """The claim's answer (a duplicate reported as :meth:`QueuedHold.claim` does);
        raises :class:`~.errors.StoreUnavailable` when Redis cannot answer."""
        if self._found is None:
            assert self._sent is not None
            sent, self._sent = self._sent, None
            found: Queued = sent.result()
            self._found = found
            self._hold._report(found)
        return self._found

    def close(self) -> None:
        """Done with the claim: an answer not read yet is read in the background."""
        sent, self._sent = self._sent, None
        if sent is not None:
            sent.finish()


def _quiet(_heard: bool) -> None:
    """A claim's answer needs no bookkeeping once read."""


class RunLock(Lock):
    """The lock of one run of a queued message: a :class:`Lock` that takes over the
    message's enqueue-time hold in its acquire, and leaves a done mark when released.

    *handover*: the task id whose queued hold becomes this lock in the same step (a
    hold of another task id refuses it: :attr:`superseded`, unless not ``strict``).
    *done_as*: the mark a release adds to the name's done marks, kept *done_ttl* seconds
    (a run's task id and attempt): a redelivered copy of the message that gets the lock
    afterwards asks :meth:`ran_before`. The rest is :class:`Lock`'s.
    """

    def __init__(
        self,
        target: Any,
        name: str,
        ttl: float = 30.0,
        *,
        handover: Handover | None = None,
        done_as: str | None = None,
        done_ttl: float = 3600.0,
        **options: Any,
    ) -> None:
        super().__init__(target, name, ttl, **options)
        self.handover = handover
        self._holds = None if handover is None else need(self.backend, QueuedHolds)
        self.done_as = done_as
        self.done_ms = ttl_to_ms(done_ttl, "done_ttl")
        self._marks = None if done_as is None else need(self.backend, DoneMarks)
        #: The last attempt was a hand-over refused because the queued hold belongs to
        #: another task id (``queued_owner``); ``holder`` is then that hold's record.
        self.superseded = False
        #: Owner of the queued hold as the last hand-over saw it ("" none; None: no
        #: hand-over was refused).
        self.queued_owner: str | None = None

    def _attempt(self, token: str, record: str, wait: bool, deadline: float | None) -> Grant:
        if self._holds is None or self.handover is None:
            return super()._attempt(token, record, wait, deadline)
        grant = self._holds.take_over(
            self.slot,
            token,
            self.ttl_ms,
            record,
            self.handover,
            wait=wait,
            fence_ttl_ms=self.fence_ttl_ms,
        )
        self.superseded = isinstance(grant, Superseded)
        self.queued_owner = grant.queued_owner if isinstance(grant, Held | Superseded) else None
        return grant

    def _give_back(self, token: str) -> Status:
        if self._marks is None or self.done_as is None:
            return super()._give_back(token)
        return self._marks.release_done(
            self.slot, token, self._notice_ms, self.done_as, self.done_ms
        )

    def ran_before(self) -> bool:
        """True when an earlier release of this name carried this lock's ``done_as`` mark
        (among the 16 most recent, within ``done_ttl`` of the last one)."""
        if self._marks is None or self.done_as is None:
            return False
        return self._marks.was_done(self.slot, self.done_as)
