"""What ``celery locks`` (and any operator tool) reads and removes, by lock name.

Each function takes one store (or what :func:`~celery_redlock.core.backends.open_backend`
takes: a client) and a key prefix, turns names into slots and calls the store's
operator verbs (the :class:`~celery_redlock.core.backend.Admin` capability). For
Redlock, call them once per master to see each master's view, as the CLI does: a
quorum has no operator verbs of its own (a ConfigError says so).

Errors are the backend's: :class:`~celery_redlock.core.errors.StoreUnavailable` when it
cannot answer, :class:`~celery_redlock.core.errors.ConfigError` for a name no lock can
have or a key holding data that is not ours.
"""

from __future__ import annotations

from typing import Any

from .backend import Admin, need
from .backend_types import ForceRelease, LockInfo, RateInfo, Slot, Status
from .backends import open_backend
from .keys import lock_keys, permit_keys
from .listing import Listing, ListQuery

__all__ = [
    "ForceRelease",
    "LockInfo",
    "RateInfo",
    "force_dequeue",
    "force_release",
    "force_release_permit",
    "list_keys",
    "read_lock",
    "read_rate",
    "scan_locks",
    "scan_rates",
]


def scan_locks(
    target: Any, prefix: str, pattern: str = "*", limit: int | None = None
) -> list[LockInfo]:
    """Every held lock, live permit and queued hold whose rendered name matches the glob
    *pattern* (``sync:*``; ``*``, ``?`` and ``[abc]``), sorted by name; with *limit*,
    those of the first *limit* names (a page)."""
    if limit is None:
        return _admin(target).scan(prefix, pattern)
    return _admin(target).scan(prefix, pattern, limit)


def list_keys(target: Any, prefix: str, query: ListQuery) -> Listing:
    """One page of *query*: the keys that match it in page order, what they hold, how
    many match, and the counts by kind and state (see :mod:`~.listing`)."""
    return _admin(target).listing(prefix, query)


def read_lock(target: Any, prefix: str, name: str) -> list[LockInfo]:
    """Lock *name*'s holder, queued hold and live permits (empty when there are none)."""
    return _admin(target).read(prefix, name)


def scan_rates(target: Any, prefix: str, pattern: str = "*") -> list[RateInfo]:
    """The state of every rate limiter whose name matches *pattern*."""
    return _admin(target).scan_rates(prefix, pattern)


def read_rate(target: Any, prefix: str, name: str) -> RateInfo | None:
    """The state of rate limiter *name*, or None when it is idle."""
    return _admin(target).read_rate(prefix, name)


def force_release(
    target: Any,
    prefix: str,
    name: str,
    fence: int | str | None = None,
    *,
    notice_ttl: float = 30.0,
) -> ForceRelease:
    """Remove lock *name* whoever holds it, and wake one waiter.

    With *fence*, only the acquisition with that fence is removed (the one an operator
    confirmed); another one is left alone (``"refused"``). The wake-up notice lives
    *notice_ttl* seconds if no waiter takes it. The holder is not told: its next renewal
    finds the lock gone, and its own ``release()`` raises ``LockLost``.
    """
    confirmed = None if fence is None else int(fence)
    notice_ms = max(1, round(notice_ttl * 1000))
    return _admin(target).force_release(Slot(lock_keys(name, prefix)), confirmed, notice_ms)


def force_release_permit(
    target: Any,
    prefix: str,
    name: str,
    fence: int | str,
    *,
    limit: int = 2,
    notice_ttl: float = 30.0,
) -> ForceRelease:
    """Give back the one permit of semaphore *name* whose acquisition has *fence* (the
    one an operator confirmed) and wake one waiter; ``"gone"`` when no live permit has
    that fence. It is the permit's own release by its token (read just before, so only
    that acquisition can be removed): the holder is not told; its next renewal finds the
    permit gone. *limit* bounds the wake-up notices kept (the semaphore's permits)."""
    backend = open_backend(target)
    confirmed = int(fence)
    slot = Slot(permit_keys(name, prefix), limit=max(2, limit))
    found = next((h for h in backend.holders(slot) if h.fence == confirmed), None)
    if found is None:
        return ForceRelease("gone")
    notice_ms = max(1, round(notice_ttl * 1000))
    status = backend.release(slot, found.token, notice_ms)
    record = dict(found.record)
    if status is Status.OK:
        return ForceRelease("released", record, found.fence)
    if status is Status.FOREIGN:
        return ForceRelease("refused", record, found.fence)
    return ForceRelease("gone", record, found.fence)


def force_dequeue(target: Any, prefix: str, name: str, task_id: str | None = None) -> ForceRelease:
    """Remove the enqueue-time hold of lock *name*: the one of *task_id* only
    (``"refused"`` when another task id holds it now), or whoever's with None. The
    message itself stays queued; when it starts, it takes the lock as usual."""
    return _admin(target).force_dequeue(Slot(lock_keys(name, prefix)), task_id)


def _admin(target: Any) -> Admin:
    return need(open_backend(target), Admin)
