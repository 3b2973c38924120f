"""What a call does when its key is held: the ``lock_on_contended`` strategies of a run,
and the ``lock_on_duplicate`` policies of a publish. Each is registered in its kind's
registry (:mod:`celery_redlock.app.policies`); the option accepts every registered name, so a
new one is one registration and its functions.

* a :class:`Strategy` (``policies.CONTENDED``) names a function that decides the fate of
  a refused run (:class:`Refusal`) and says whether the run first waits for the holder's
  release. It either raises (``Retry``, ``Ignore``, ``LockContended``: the tracer
  records the outcome) or returns the result the run gets instead of its body (a skip
  in an eager or direct call).
* a :class:`PublishPolicy` (``policies.DUPLICATE``) names how a call takes its key's
  enqueue-time hold (``claim``) and what a call that finds it taken gets (``answer``,
  given a :class:`Duplicate`): it raises, or returns what ``apply_async`` returns.

A task's policies are resolved once, with its options (``options.contended``,
``options.duplicate``): a run never looks one up by name.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from celery.exceptions import Ignore, Retry
from celery.utils.saferepr import saferepr

from ..app.policies import CONTENDED, DUPLICATE
from ..app.rules import BackOff
from ..core.backend_types import Queued, RateGrant
from ..core.errors import (
    AlreadyQueued,
    HeldBack,
    LockContended,
    RateLimited,
    StoreUnavailable,
    describe_holder,
)
from ..core.queued import QueuedHold
from ..core.ratelimit import slot_lead
from .next_attempt import defer

__all__ = [
    "RATE_SLOT_HEADER",
    "RETRIES_HEADER",
    "SKIPPED",
    "Duplicate",
    "PublishPolicy",
    "Refusal",
    "RetryOptions",
    "Skipped",
    "Strategy",
    "backoff_delay",
    "held_back",
    "is_skipped",
    "known_delay",
    "rate_delay",
    "requeue",
    "skip_message",
]

log = logging.getLogger("celery_redlock.task")

#: Marker in the result of a run skipped because another run held the lock.
SKIPPED = "celery_redlock.skipped"
#: Message header carrying the number of contention retries so far.
RETRIES_HEADER = "redlock_retries"
#: Message header of a run re-queued for its rate limit: it was promised a slot (joined
#: the limiter's line) and asks for it when it comes back, instead of joining again.
RATE_SLOT_HEADER = "redlock_rate_slot"


class RetryOptions(Protocol):
    """The task options a strategy reads (``TaskOptions`` has them)."""

    @property
    def max_retries(self) -> int: ...
    @property
    def retry_backoff(self) -> float: ...
    @property
    def retry_backoff_max(self) -> float: ...
    @property
    def retry_jitter(self) -> bool: ...


class Skipped(Ignore):  # type: ignore[misc]  # celery is untyped
    """How a skipped run ends in a worker: ``Ignore``, its result (a skip marker) stored
    already, carrying that result as Celery's worker shows one (``shown``).

    Celery's worker sends no event for an ignored run, so Flower and ``celery events``
    would keep it STARTED while its result says SUCCESS: the worker's request
    (:class:`~celery_redlock.worker.request.LockedRequest`) sends Celery's
    ``task-succeeded`` with ``shown`` for it, where the worker sends task events.
    """

    def __init__(self, reason: str, shown: str = "") -> None:
        super().__init__(reason)
        #: The stored result, as ``task-succeeded`` shows a result (``saferepr``).
        self.shown = shown


def _skipped(task: Any, request: Any, marker: dict[str, Any], reason: str) -> NoReturn:
    """Store *marker* as the run's result (SUCCESS) and end the run with :class:`Skipped`."""
    task.backend.mark_as_done(request.id, marker, request=request)
    raise Skipped(reason, saferepr(marker, getattr(task, "resultrepr_maxsize", 1024)))


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
    options: RetryOptions
    #: An eager run (``apply()``, ``task_always_eager``): it cannot be re-queued.
    eager: bool
    #: The run waited for the holder's release (up to ``lock_wait_timeout``) first.
    waited: bool
    #: Refused by the key's rate limit (``lock_rate``), not a held lock: the limiter's
    #: answer (``retry_after``); ``lock`` is then the limiter (``.name``, ``.rate``).
    rate: RateGrant | None = None


@dataclass(frozen=True)
class Strategy:
    """One ``lock_on_contended`` value."""

    #: Its name, the option's value.
    name: str
    #: Decides a refused run: raises, or returns what the run gets instead of its body.
    refuse: Callable[[Refusal], Any]
    #: Block for the holder's release, up to ``lock_wait_timeout``, before refusing.
    waits: bool = False
    #: The strategy an eager run uses instead (it cannot be re-queued), if not this one.
    eager: Strategy | None = None
    #: A refused run is re-queued: refused by its rate limit, it joins the limiter's line
    #: (promised the next free slot, it comes back then).
    requeues: bool = False


def held_back(lock: Any) -> HeldBack | None:
    """The error of a run refused by an operator control or a rule (``lock_limits``), not
    by its key's holder; None otherwise."""
    name = getattr(lock, "refused_by", "")
    if not name:
        return None
    return HeldBack(name, lock.refusal, lock.holder, lock.holder_ttl_ms)


def fail(refusal: Refusal) -> NoReturn:
    """The run fails with LockContended (RateLimited when its rate limit refused it,
    HeldBack when a control or a rule did)."""
    lock, request = refusal.lock, refusal.request
    held = held_back(lock)
    if held is not None:
        if request is not None:
            log.info("Task %s[%s] failed: %s", refusal.task.name, request.id, held)
        raise held
    if refusal.rate is not None:
        retry_after = refusal.rate.retry_after
        why = "rate limit %s of %r reached, next slot in %.3fs"
        _log_failed(refusal, why, lock.rate, lock.name, retry_after)
        raise RateLimited(lock.name, retry_after, lock.rate)
    _log_failed(refusal, "lock %r is held by %s", lock.name, describe_holder(lock.holder))
    raise LockContended(lock.name, lock.holder)


def _log_failed(refusal: Refusal, why: str, *args: Any) -> None:
    """The INFO line of a run that fails as refused (a worker's or an eager run: not a
    direct call, which has no request), *why* formatted with *args*."""
    if refusal.request is not None:
        waited = " after waiting" if refusal.waited else ""
        task, task_id = refusal.task.name, refusal.request.id
        log.info("Task %s[%s] failed%s: " + why, task, task_id, waited, *args)


def skip(refusal: Refusal) -> Any:
    """The run does not run: its result is a marker naming the holder, logged."""
    task, request, lock = refusal.task, refusal.request, refusal.lock
    held = held_back(lock)
    if held is not None:
        who = str(held)
        marker = {SKIPPED: True, "reason": "held back", "lock": held.name, "detail": who}
    elif refusal.rate is not None:
        holder: Any = {}
        who = f"its rate limit ({lock.rate}; next slot in {refusal.rate.retry_after:.3f}s)"
        marker = {
            SKIPPED: True,
            "reason": "rate limited",
            "lock": lock.name,
            "rate": lock.rate,
            "retry_after": refusal.rate.retry_after,
        }
    else:
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
    if held is not None:
        log.info("Task %s[%s] skipped: %s", task.name, request.id, who)
    elif refusal.rate is not None:
        log.info(
            "Task %s[%s] skipped: %r is held back by %s", task.name, request.id, lock.name, who
        )
    else:
        log.info(
            "Task %s[%s] skipped: lock %r is held by %s", task.name, request.id, lock.name, who
        )
    if refusal.eager:
        return marker
    if held is not None:
        _skipped(task, request, marker, f"skipped: {who}")
    if refusal.rate is not None:
        _skipped(task, request, marker, f"skipped: {lock.name!r} is held back by {who}")
    _skipped(task, request, marker, f"skipped: lock {lock.name!r} is held by {who}")


def retry(refusal: Refusal) -> NoReturn:
    """The run is re-queued after a backoff, within its own budget (``lock_max_retries``);
    a direct call, which has no message to re-queue, fails with LockContended."""
    if refusal.request is None:
        fail(refusal)
    lock = refusal.lock
    held = held_back(lock)
    if held is not None:
        # The longest known wait (a pause's end, a rate's slot), plus jitter; none known
        # (a full Limit frees when a holder ends; a pause with no end): the backoff.
        wait = None if held.ttl_ms is None else held.ttl_ms / 1000
        requeue(
            refusal.task,
            refusal.request,
            held.name,
            held,
            refusal.options,
            delay=None if wait is None else known_delay(refusal.options, wait),
        )
    if refusal.rate is not None:
        requeue(
            refusal.task,
            refusal.request,
            lock.name,
            RateLimited(lock.name, refusal.rate.retry_after, lock.rate),
            refusal.options,
            delay=rate_delay(refusal.options, refusal.rate, lock.interval),
            rate_slot=True,
        )
    requeue(
        refusal.task,
        refusal.request,
        lock.name,
        LockContended(lock.name, lock.holder),
        refusal.options,
    )


# The ``lock_on_contended`` strategies, in the order error messages list them.
_WAIT = Strategy("wait", fail, waits=True)
CONTENDED.register(Strategy("retry", retry, eager=_WAIT, requeues=True))
CONTENDED.register(Strategy("skip", skip))
CONTENDED.register(_WAIT)
CONTENDED.register(Strategy("raise", fail))


def backoff_delay(options: RetryOptions, attempt: int) -> float:
    """Exponential backoff for contention retry *attempt* (0-based), jittered if enabled."""
    delay: float = min(options.retry_backoff_max, options.retry_backoff * (2**attempt))
    if options.retry_jitter:
        delay = delay / 2 + random.uniform(0, delay / 2)
    return delay


def known_delay(options: RetryOptions, wait: float) -> float:
    """The countdown of a run that knows how long it must wait: that long, plus up to a
    tenth of it (at most a second) of jitter, so that runs held back together do not all
    come back in the same instant (``lock_retry_jitter``)."""
    if options.retry_jitter:
        wait += random.uniform(0, min(1.0, wait / 10))
    return max(0.0, wait)


def rate_delay(options: RetryOptions, grant: RateGrant, interval: float) -> float:
    """The countdown of a run refused by its rate limit: the time until its slot, less a
    small lead (:func:`~celery_redlock.core.ratelimit.slot_lead`), jittered within the first
    half of that lead (``lock_retry_jitter``). The run is back in a worker just before its slot
    and waits the last milliseconds there, so it starts at its slot: with the limiter's
    strict spacing, a run that came back after its slot would push every later slot back.
    """
    lead = slot_lead(interval)
    delay = grant.retry_after - lead
    if options.retry_jitter:
        delay += random.uniform(0, lead / 2)
    return max(0.0, delay)


def requeue(
    task: Any,
    request: Any,
    name: str,
    exc: Exception,
    options: RetryOptions,
    *,
    delay: float | None = None,
    rate_slot: bool = False,
) -> NoReturn:
    """Re-queue the run with its own contention budget; the task's max_retries is untouched.

    *delay*: the countdown (default: the backoff for this retry); *rate_slot*: the run was
    promised a slot by its rate limiter and asks for it when it comes back.

    Raises ``Retry`` (re-queued: the new message is published after Celery stored this
    attempt's RETRY, see :mod:`celery_redlock.task.next_attempt`) or *exc* (the budget is spent).
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
    if delay is None:
        delay = backoff_delay(options, done)
    headers[RETRIES_HEADER] = done + 1
    headers[RATE_SLOT_HEADER] = 1 if rate_slot else 0
    sig = task.signature_from_request(
        request, countdown=delay, retries=request.retries, headers=headers
    )
    # One line of ours per attempt (Celery adds its own "retry:" line with the reason).
    if isinstance(exc, StoreUnavailable):
        reason = f"lock {name!r} unavailable"
        log.warning(
            "Task %s[%s] not started, lock %r unavailable: %s (lock retry %d/%d in %.2fs)",
            task.name,
            request.id,
            name,
            exc,
            done + 1,
            budget,
            delay,
        )
    else:
        reason = f"{name!r} rate limited" if rate_slot else f"lock {name!r} busy"
        if isinstance(exc, HeldBack):
            reason = f"{name!r} held back ({exc.why})"
        elif isinstance(exc, BackOff):
            reason = f"{name!r} backed off"
        log.info(
            "Task %s[%s] lock retry %d/%d in %.2fs: %s",
            task.name,
            request.id,
            done + 1,
            budget,
            delay,
            exc,
        )
    # Published once Celery has stored this attempt's RETRY, never before: see next_attempt.
    defer(task, request, sig, delay)
    raise Retry(reason, exc=exc, when=delay, sig=sig)


# -- lock_on_duplicate: a publish that finds its key queued or running -----------------------
@dataclass(frozen=True)
class Duplicate:
    """A call that found its key's enqueue-time hold taken, as a publish policy sees it."""

    task: Any
    #: The lock name.
    name: str
    #: The call's task id.
    task_id: str
    #: What the hold said: the holder's task id (``owner``), ``state`` ("queued" or
    #: "running"), ``ttl_ms`` left on its hold and its record (``holder``).
    found: Queued
    #: At a worker, the request of a message sent without a hold (by name, where the
    #: task class is unknown); None at publish.
    request: Any = None

    @property
    def ttl(self) -> float | None:
        """Seconds left on the holder's hold (None when unknown)."""
        ms = self.found.ttl_ms
        return None if ms is None or ms < 0 else ms / 1000


@dataclass(frozen=True)
class PublishPolicy:
    """One ``lock_on_duplicate`` value."""

    #: Its name, the option's value.
    name: str
    #: How a new call takes the hold: ``terms(lock_on)`` are the keyword arguments of
    #: :meth:`~celery_redlock.core.queued.QueuedHold.claim` (``replace``,
    #: ``running_blocks``); a call that finds the hold taken (and not given to it) is a
    #: duplicate.
    terms: Callable[[str], Mapping[str, bool]]
    #: Decides a duplicate: raises, or returns what the call gets instead of being sent.
    answer: Callable[[Duplicate], Any]

    def claim(self, hold: QueuedHold, task_id: str, ttl: float, lock_on: str) -> Queued:
        """Take *hold* for *task_id* on this policy's terms."""
        return hold.claim(task_id, ttl, **self.terms(lock_on))


def keep_first(lock_on: str) -> Mapping[str, bool]:
    """The call already queued keeps the key; under ``"enqueue+run"`` so does a running
    run: the new call is a duplicate of either."""
    return {"running_blocks": lock_on == "enqueue+run"}


def take_place(lock_on: str) -> Mapping[str, bool]:
    """The newest call takes the queued call's place (that message is skipped when it
    arrives); while a run holds the lock, the call is queued behind it."""
    return {"replace": True}


def one_behind(lock_on: str) -> Mapping[str, bool]:
    """While one runs, one more call is queued behind it; later calls are duplicates of
    that one."""
    return {}


def answer_with_holder(dup: Duplicate) -> Any:
    """The call gets the holder's ``AsyncResult`` and nothing is sent; a message that
    reached its worker without a hold is skipped visibly, naming the holder."""
    if dup.request is None:
        return dup.task.AsyncResult(dup.found.owner)
    found = dup.found
    skip_message(
        dup.task,
        dup.request,
        dup.name,
        f"duplicate of task {found.owner} ({found.state})",
        owner=found.owner,
        holder=found.holder,
    )


def refuse_duplicate(dup: Duplicate) -> NoReturn:
    """The call raises :class:`AlreadyQueued` naming the holder and its time left."""
    found = dup.found
    raise AlreadyQueued(dup.name, found.owner, dup.ttl, found.state, found.holder)


# The ``lock_on_duplicate`` policies, in the order error messages list them.
DUPLICATE.register(PublishPolicy("return", keep_first, answer_with_holder))
DUPLICATE.register(PublishPolicy("raise", keep_first, refuse_duplicate))
DUPLICATE.register(PublishPolicy("replace", take_place, answer_with_holder))
DUPLICATE.register(PublishPolicy("queue_one", one_behind, answer_with_holder))


def skip_message(
    task: Any, request: Any, name: str, reason: str, *, owner: str, holder: Any
) -> NoReturn:
    """The message does not run: its result is a skip marker naming *owner*; raises
    :class:`Skipped` (an ``Ignore``)."""
    marker = {SKIPPED: True, "reason": reason, "lock": name, "task_id": owner, "holder": holder}
    _skipped(task, request, marker, f"skipped: {reason}")
