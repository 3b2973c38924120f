"""One exception root for everything celery-redlock raises.

Each leaf carries the context a person needs at 3 a.m.: the lock name, who
holds it, which masters answered what.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AlreadyQueued",
    "ConfigError",
    "ForeignData",
    "HeldBack",
    "LockContended",
    "LockLost",
    "NotOwned",
    "QuorumUnavailable",
    "RedlockError",
    "StoreUnavailable",
    "cost_above_burst",
    "describe_holder",
    "one_line",
]


class RedlockError(Exception):
    """Root of every error raised by celery-redlock.

    Subclasses keep their constructor arguments in ``args`` and build the message in
    ``__str__``: Celery's JSON result backend stores ``args`` and rebuilds the error as
    ``cls(*args)``, so an error read back by ``AsyncResult.get()`` keeps its context.
    """


class ConfigError(RedlockError, ValueError):
    """A bad option, setting, URL or key template.

    Raised where the mistake is made (task definition, worker start-up,
    ``Lock(...)``), never deep inside a running worker.
    """


class ForeignData(ConfigError):
    """A key where a lock (or its fence, queue, rate or control) lives holds data that
    is not ours: something else writes under the key prefix. The message names the key
    and what it holds; choose another ``redlock_key_prefix`` or remove the key."""


class LockContended(RedlockError):
    """Someone else holds the lock.

    ``holder`` is what the holder recorded about itself (``task_name``,
    ``task_id``, ``hostname``, ``pid``, ``acquired_at``) when it could be read;
    ``ttl_ms`` is the holder's remaining lease in milliseconds.
    """

    def __init__(
        self,
        name: str,
        holder: Mapping[str, Any] | None = None,
        ttl_ms: int | None = None,
        masters: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.holder: dict[str, Any] = dict(holder or {})
        self.ttl_ms = ttl_ms
        self.masters: dict[str, str] = dict(masters or {})
        super().__init__(name, self.holder, ttl_ms, self.masters)

    def __str__(self) -> str:
        return self._message()

    def _message(self) -> str:
        who = describe_holder(self.holder)
        left = f", {self.ttl_ms} ms left" if self.ttl_ms is not None and self.ttl_ms >= 0 else ""
        return f"lock {self.name!r} is held by {who}{left}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Celery pickles/serialises task exceptions; keep the context.
        return (_rebuild_contended, (self.name, self.holder, self.ttl_ms, self.masters))


class HeldBack(LockContended):
    """A run's start was refused by an operator control or a rule of the run, not by the
    holder of its own key: *name* is paused (``why="paused"``, ``holder["reason"]``), at
    its limit (``"limit"``: ``holder`` is the record of its permit that expires first)
    or at its rate (``"rate"``). ``ttl_ms`` is the longest known wait (None: unknown,
    such as a pause with no end)."""

    def __init__(
        self,
        name: str,
        why: str,
        holder: Mapping[str, Any] | None = None,
        ttl_ms: int | None = None,
    ) -> None:
        self.why = why
        super().__init__(name, holder, ttl_ms)
        self.args = (name, why, self.holder, ttl_ms)

    def _message(self) -> str:
        left = "" if self.ttl_ms is None else f"; {self.ttl_ms / 1000:.3f} s to wait"
        if self.why == "paused":
            reason = self.holder.get("reason") or "no reason given"
            until = "" if self.ttl_ms is not None else " until resumed"
            return f"{self.name!r} is paused{until} ({reason}){left}"
        if self.why == "limit":
            return f"{self.name!r} is at its limit (held by {describe_holder(self.holder)}){left}"
        return f"{self.name!r} is at its rate{left}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)


def _rebuild_contended(
    name: str, holder: dict[str, Any], ttl_ms: int | None, masters: dict[str, str]
) -> LockContended:
    return LockContended(name, holder, ttl_ms, masters=masters)


class StoreUnavailable(RedlockError):
    """The lock store cannot answer: a Redis problem, not contention. One Redis that is
    down raises this; a Redlock quorum raises its subclass :class:`QuorumUnavailable`, so
    ``except StoreUnavailable`` catches both.

    ``errors`` maps each failed server (password-free address) to what went wrong;
    ``needed`` of ``total`` had to answer (1 of 1 for one Redis).
    """

    def __init__(
        self,
        name: str,
        errors: Mapping[str, str] | None = None,
        needed: int = 1,
        total: int = 1,
    ) -> None:
        self.name = name
        self.errors: dict[str, str] = dict(errors or {})
        self.needed = needed
        self.total = total
        super().__init__(name, self.errors, needed, total)

    def __str__(self) -> str:
        return self._message()

    def _message(self) -> str:
        return f"lock {self.name!r}: {self.cause}"

    @property
    def cause(self) -> str:
        """What went wrong, without the lock's name: the same for every lock of a round
        that one server failed (``Redis unavailable (127.0.0.1:6379: ...)``)."""
        detail = "; ".join(f"{m}: {e}" for m, e in self.errors.items()) or "no answer"
        if self.total == 1:
            return f"Redis unavailable ({detail})"
        return f"quorum unavailable, need {self.needed} of {self.total} masters ({detail})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.errors, self.needed, self.total))


class QuorumUnavailable(StoreUnavailable):
    """Too many Redlock masters are unreachable to reach a majority (a quorum's
    :class:`StoreUnavailable`)."""


class NotOwned(RedlockError):
    """release()/extend() of a lock this owner does not hold."""

    def __init__(self, name: str, reason: str = "not held by this owner") -> None:
        self.name = name
        self.reason = reason
        super().__init__(name, reason)

    def __str__(self) -> str:
        return f"lock {self.name!r}: {self.reason}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.reason))


class LockLost(NotOwned):
    """The lock was held, then lost (expired, taken over, removed, or past its deadline).

    A subclass of :class:`NotOwned`: either way, this owner no longer holds it.
    """


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception on one line (for log lines and CLI output)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class RateLimited(RedlockError):
    """A rate limit refused a start: ``retry_after`` seconds until the next free slot.

    ``rate`` is the limit as written (``"20/s"``), when known.
    """

    def __init__(self, name: str, retry_after: float, rate: str | None = None) -> None:
        self.name = name
        self.retry_after = retry_after
        self.rate = rate
        super().__init__(name, retry_after, rate)

    def __str__(self) -> str:
        what = f" ({self.rate})" if self.rate else ""
        return (
            f"rate limit of {self.name!r}{what} reached: the next slot is free in "
            f"{self.retry_after:.3f} s"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.retry_after, self.rate))


class AlreadyQueued(RedlockError):
    """A call was not sent: a message of the same lock is already queued, or its run holds
    the lock (``lock_on_duplicate="raise"``).

    ``task_id`` is that message's task id, ``ttl`` the seconds left on its hold (None
    when unknown), ``state`` ``"queued"`` or ``"running"``, ``holder`` its record.
    """

    def __init__(
        self,
        name: str,
        task_id: str,
        ttl: float | None = None,
        state: str = "queued",
        holder: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.task_id = task_id
        self.ttl = ttl
        self.state = state
        self.holder: dict[str, Any] = dict(holder or {})
        super().__init__(name, task_id, ttl, state, self.holder)

    def __str__(self) -> str:
        left = f", {self.ttl:.1f} s left on its hold" if self.ttl is not None else ""
        return f"lock {self.name!r}: task {self.task_id} is already {self.state}{left}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.task_id, self.ttl, self.state, self.holder))


def describe_holder(holder: Mapping[str, Any]) -> str:
    """Render a holder record for log lines: ``task X[id] on host pid N``."""
    if not holder:
        return "another owner"
    parts: list[str] = []
    tid = holder.get("task_id")
    if holder.get("task_name"):
        parts.append(f"task {holder['task_name']}" + (f"[{tid}]" if tid else ""))
    elif tid:
        parts.append(f"task [{tid}]")
    else:
        parts.append("an owner")
    if holder.get("hostname"):
        parts.append(f"on {holder['hostname']}")
    if holder.get("pid"):
        parts.append(f"pid {holder['pid']}")
    return " ".join(parts) or "another owner"


def cost_above_burst(what: str, cost: int, burst: int) -> ConfigError:
    """The error for a run asking a rate (*what*: ``rate 'p:acme'``) for more units than
    it ever grants at once: it would wait for ever."""
    return ConfigError(
        f"{what}: a run asks for {cost} units, more than the rate ever grants at once (its "
        f"burst, {burst}); it would wait for ever: raise burst to at least {cost} or lower "
        "the cost"
    )
