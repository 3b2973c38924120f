"""One command to several Redis nodes at once, decided as soon as enough answered.

Everything that talks to several masters (Redlock's acquire, release, extend and
reads, beat's records) goes through :class:`FanOut`::

    fan = FanOut(members, command, timeout)  # written to every node now
    results = fan.wait(decided)              # each node's reply or error, as far as known
    fan.finish(then=release)              # what is still due is read in the background,
                                          # and *then* runs after it on each node

How a command travels. To a node whose held connection is free and connected,
and which has no earlier work still queued, the calling thread writes it at once
(a thread hand-off costs more than the round trip) and reads the reply with a
deadline. Anything that might block goes to the node's :class:`~.send.Lane`: a
node not connected yet (the handshake blocks on a stalled server), one whose
connection is busy, one with earlier work still queued. A lane runs its calls
one at a time, in order, in the process's long-lived I/O pool, so

- a node that stops answering costs the caller one *timeout*, never a socket
  timeout, and ties up one pool thread; while a call in its lane is stuck for
  longer than a timeout, it is not sent more: it counts as not answering;
- a later call never overtakes an earlier one: a reply that did not come in time
  is read in the lane (the connection comes back in step, or is dropped), and
  ``then`` is written behind the unanswered command on its connection, or queued
  behind it in the lane. A release can never reach a server before the acquire it
  undoes.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Sequence
from typing import Any

from .send import Command, Sent
from .stores.redis import REDIS_ERRORS, RedisStore

__all__ = ["FIRST_CONTACT", "GRACE", "SLICE", "FanOut", "NoAnswer", "answered"]

#: While several nodes may answer, a wait on one wakes this often to look at the others.
SLICE = 0.001
#: After the outcome is decided, how long replies already on their way are still read.
GRACE = 0.002
#: How many timeouts a node this process never heard from is waited for: a first
#: contact connects, shakes hands (TLS, AUTH) and loads scripts before it answers.
FIRST_CONTACT = 3


class NoAnswer(Exception):
    """A node did not answer in time, or was not asked (it is still busy)."""


#: The result of a node not heard from (yet).
PENDING: Any = NoAnswer("not heard from")


def answered(value: Any) -> bool:
    """True for a reply (not an error, not :data:`PENDING`)."""
    return not isinstance(value, BaseException)


class FanOut:
    """*command* sent to every member; see the module docstring."""

    def __init__(self, members: Sequence[RedisStore], command: Command, timeout: float) -> None:
        self.members = members
        self.command = command
        self.timeout = timeout
        self.results: list[Any] = [PENDING] * len(members)
        self._sent: dict[int, Sent] = {}
        self._jobs: dict[cf.Future[Any], int] = {}
        self._refused: set[int] = set()  # not sent: the node is still busy
        for i, member in enumerate(members):
            sent = None
            if member.lane.idle():
                try:
                    sent = member.send(command)
                except REDIS_ERRORS:
                    sent = None  # a stale connection: the lane's call reconnects
            if sent is not None:
                self._sent[i] = sent
                continue
            if member.first_contact:
                self.timeout = FIRST_CONTACT * timeout
            job = member.lane.offer(member.call, command, refuse_after=timeout)
            if job is None:
                self.results[i] = NoAnswer("not answering: still busy with earlier calls")
                self._refused.add(i)
            else:
                self._jobs[job] = i

    def wait(self, decided: Callable[[Sequence[Any]], bool]) -> list[Any]:
        """Collect replies until *decided(results)*, every node answered, or the timeout.

        Each result is a reply, a Redis error, or :class:`NoAnswer`. An error that is
        not a Redis error (a bug, a version mismatch) is raised, never counted as a
        node being down. Replies arriving right after the outcome is decided (within
        :data:`GRACE`) are still read, so their connections need no draining.
        """
        timeout = self.timeout
        deadline = time.monotonic() + timeout
        results = self.results
        # Replies are taken in the order the commands went out, each waited for at most a
        # SLICE while others are pending: the usual reply is in well within a slice, and a
        # node that is late goes to the back of the queue instead of holding up the rest.
        while (self._sent or self._jobs) and not decided(results):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._collect_jobs()
            if self._sent:
                i, sent = next(iter(self._sent.items()))
                several = len(self._sent) + len(self._jobs) > 1
                if sent.ready(min(left, SLICE) if several else left):
                    self._read(i, sent)
                else:
                    del self._sent[i]
                    self._sent[i] = sent  # to the back
            elif not decided(results):
                cf.wait(self._jobs, timeout=left, return_when=cf.FIRST_COMPLETED)
        self._collect_jobs()
        grace = time.monotonic() + GRACE
        for i, sent in list(self._sent.items()):
            if sent.ready(max(grace - time.monotonic(), 0.0)):
                self._read(i, sent)
        ms = max(timeout, 0) * 1000
        for i, value in enumerate(results):
            if value is PENDING:
                results[i] = NoAnswer(f"no answer within {ms:.0f} ms")
        return results

    def _read(self, i: int, sent: Sent) -> None:
        del self._sent[i]
        try:
            self.results[i] = sent.read()
        except REDIS_ERRORS as exc:
            self.results[i] = exc

    def _collect_jobs(self) -> None:
        for job in [j for j in self._jobs if j.done()]:
            self.results[self._jobs.pop(job)] = _outcome(job)

    def finish(self, then: Command | None = None) -> None:
        """Read what is still due in the background; with *then*, also run it after the
        command on every node that may have run it without answering (best effort: where
        it does not get through, the lease it was meant to end expires by itself)."""
        for i, sent in self._sent.items():
            if then is not None:
                try:
                    sent.then(then)
                except REDIS_ERRORS:
                    continue  # dropped: the lease expires by itself
            self.members[i].lane.submit(sent.drain)
        if then is not None:
            for i, value in enumerate(self.results):
                if i not in self._sent and i not in self._refused and not answered(value):
                    self.members[i].lane.submit(_quietly, self.members[i], then)
        self._sent = {}
        self._jobs = {}


def _quietly(member: RedisStore, command: Command) -> None:
    try:
        member.call(command)
    except REDIS_ERRORS:
        return  # best effort: where it does not get through, the lease expires by itself


def _outcome(job: cf.Future[Any]) -> Any:
    """A lane call's reply, or its Redis error; any other error is a bug and is raised."""
    try:
        return job.result()
    except REDIS_ERRORS as exc:
        return exc
