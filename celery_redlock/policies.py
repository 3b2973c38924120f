"""What a run does when its lock is held by another: the ``lock_on_contended`` strategies.

:data:`STRATEGIES` is the one table of them. An entry names a function that decides
the fate of a refused run (:class:`Refusal`) and says whether the run first waits for
the holder's release. ``lock_on_contended`` accepts every name in the table, so a new
strategy is one entry and one function.

A strategy's function either raises (``Retry``, ``Ignore``, ``LockContended``: the
tracer records the outcome) or returns the result the run gets instead of running its
body (a skip in an eager or direct call).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry

from .core.errors import LockContended, describe_holder

if TYPE_CHECKING:
    from .options import TaskOptions

__all__ = [
    "LOST_POLICIES",
    "RETRIES_HEADER",
    "SKIPPED",
    "STRATEGIES",
    "Refusal",
    "Strategy",
    "backoff_delay",
    "is_skipped",
    "requeue",
]

log = logging.getLogger("celery_redlock.task")

#: Marker in the result of a run skipped because another run held the lock.
SKIPPED = "celery_redlock.skipped"
#: Message header carrying the number of contention retries so far.
RETRIES_HEADER = "redlock_retries"
#: ``lock_on_lost``: "raise" interrupts the body with LockLost, "warn" only logs.
LOST_POLICIES = ("raise", "warn")


def is_skipped(result: Any) -> bool:
    """True if *result* is what a run skipped for contention returned."""
    return isinstance(result, dict) and result.get(SKIPPED) is True


@dataclass(frozen=True)
class Refusal:
    """A run that did not get its lock, as a strategy sees it."""

    task: Any
    #: The run's Celery request; None for a direct call (``task(...)``).
    request: Any
    #: The lock not taken: ``.name``, and ``.holder`` (the other owner's record).
    lock: Any
    options: TaskOptions
    #: An eager run (``apply()``, ``task_always_eager``): it cannot be re-queued.
    eager: bool
    #: The run waited for the holder's release (up to ``lock_wait_timeout``) first.
    waited: bool


@dataclass(frozen=True)
class Strategy:
    """One ``lock_on_contended`` value."""

    #: Decides a refused run: raises, or returns what the run gets instead of its body.
    refuse: Callable[[Refusal], Any]
    #: Block for the holder's release, up to ``lock_wait_timeout``, before refusing.
    waits: bool = False
    #: The strategy an eager run uses instead (it cannot be re-queued), if not this one.
    eager: str | None = None


def fail(refusal: Refusal) -> NoReturn:
    """The run fails with LockContended."""
    lock, request = refusal.lock, refusal.request
    if request is not None:
        log.info(
            "Task %s[%s] failed%s: lock %r is held by %s",
            refusal.task.name,
            request.id,
            " after waiting" if refusal.waited else "",
            lock.name,
            describe_holder(lock.holder),
        )
    raise LockContended(lock.name, lock.holder)


def skip(refusal: Refusal) -> Any:
    """The run does not run: its result is a marker naming the holder, logged."""
    task, request, lock = refusal.task, refusal.request, refusal.lock
    holder = lock.holder
    who = describe_holder(holder)
    marker = {
        SKIPPED: True,
        "reason": "lock held by another run",
        "lock": lock.name,
        "holder": holder,
    }
    if request is None:
        log.info("%s() skipped: lock %r is held by %s", task.name, lock.name, who)
        return marker
    log.info("Task %s[%s] skipped: lock %r is held by %s", task.name, request.id, lock.name, who)
    if refusal.eager:
        return marker
    task.backend.mark_as_done(request.id, marker, request=request)
    raise Ignore(f"skipped: lock {lock.name!r} is held by {who}")


def retry(refusal: Refusal) -> NoReturn:
    """The run is re-queued after a backoff, within its own budget (``lock_max_retries``);
    a direct call, which has no message to re-queue, fails with LockContended."""
    if refusal.request is None:
        fail(refusal)
    lock = refusal.lock
    requeue(
        refusal.task,
        refusal.request,
        lock.name,
        LockContended(lock.name, lock.holder),
        refusal.options,
    )


#: ``lock_on_contended`` name -> strategy (the order is the one error messages list).
STRATEGIES: dict[str, Strategy] = {
    "retry": Strategy(retry, eager="wait"),
    "skip": Strategy(skip),
    "wait": Strategy(fail, waits=True),
    "raise": Strategy(fail),
}


def backoff_delay(options: TaskOptions, attempt: int) -> float:
    """Exponential backoff for contention retry *attempt* (0-based), jittered if enabled."""
    delay: float = min(options.retry_backoff_max, options.retry_backoff * (2**attempt))
    if options.retry_jitter:
        delay = delay / 2 + random.uniform(0, delay / 2)
    return delay


def requeue(task: Any, request: Any, name: str, exc: Exception, options: TaskOptions) -> NoReturn:
    """Re-queue the run with its own contention budget; the task's max_retries is untouched.

    Raises ``Retry`` (re-queued), *exc* (the budget is spent) or ``Reject`` (the new
    message could not be published).
    """
    headers = dict(getattr(request, "headers", None) or {})
    done = int(headers.get(RETRIES_HEADER) or getattr(request, RETRIES_HEADER, 0) or 0)
    budget = options.max_retries
    if done >= budget:
        log.error(
            "Task %s[%s] gave up after %d lock retries (lock_max_retries=%d): %s",
            task.name,
            request.id,
            done,
            budget,
            exc,
        )
        raise exc
    delay = backoff_delay(options, done)
    headers[RETRIES_HEADER] = done + 1
    sig = task.signature_from_request(
        request, countdown=delay, retries=request.retries, headers=headers
    )
    log.info(
        "Task %s[%s] lock retry %d/%d in %.2fs: %s",
        task.name,
        request.id,
        done + 1,
        budget,
        delay,
        exc,
    )
    try:
        sig.apply_async()
    except Exception as publish_error:
        raise Reject(publish_error, requeue=False) from publish_error
    raise Retry(f"lock {name!r} busy", exc=exc, when=delay, sig=sig)
