"""One run of a locked task, in one place: acquire, the body under its lock, release.

One path for a worker's run (``before_start`` takes the lock, where ``Retry`` and
``Ignore`` are honoured), an eager call (``apply()``, ``task_always_eager``) and a
direct call (``task(...)``, locked when its body starts): :func:`acquire_for_request`
takes the run's lock and rate slot or applies the contended strategy
(:mod:`celery_redlock.task.contention`); :func:`run_locked` runs the body and releases on
every exit; :func:`release_for_request` releases, logging and never raising over the
task's outcome.

Every lock a worker's run takes is in ``AppState.held`` under the task id until it is
released, so the worker's own paths (:mod:`celery_redlock.worker.bootstep`: warm shutdown, a
child that is gone, the ``task_postrun`` safety net) can tell whether there is still
something to release.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from celery import signals
from celery.exceptions import Ignore, Retry

from ..app.config import TaskOptions
from ..app.controls import control
from ..app.observability import send_task_event
from ..app.rules import BackOff
from ..app.state import AppState
from ..app.tracing import attempt_policy
from ..core import (
    Handover,
    Lock,
    LockLost,
    RateGrant,
    RateLimiter,
    RedlockError,
    RunLock,
    Semaphore,
    StoreUnavailable,
)
from ..core import events as lock_events
from ..core.errors import describe_holder
from ..core.keys import lock_keys
from ..core.lease import drift
from .contention import RATE_SLOT_HEADER, Refusal, Strategy, known_delay, requeue
from .dedup import (
    HOLD_HEADER,
    NO_DEDUP_HEADER,
    attempt_of,
    claim_at_worker,
    give_back,
    skip_superseded,
)
from .flow import first_rate_key, hold_rules
from .interrupt import LockLostInterrupt, on_lost, watch
from .naming import lock_name_for
from .next_attempt import give_back_on_loss

__all__ = [
    "acquire_for_request",
    "back_off",
    "lock_of",
    "on_postrun",
    "release_for_request",
    "run_locked",
    "use_postrun_net",
]

log = logging.getLogger("celery_redlock.task")

#: How long a run that comes back for the slot its rate limiter promised it may wait in
#: the worker for the run before it (which took its grant a little late) before it goes to
#: the end of the line instead.
RATE_SHORT_WAIT = 0.25


def lock_of(request: Any) -> Lock | None:
    """The lock held for the run of *request* (None outside a locked run)."""
    return getattr(request, "_redlock_lock", None)


def _held_by_this_task(lock: Lock, task_id: str) -> bool:
    """True if an earlier attempt of task *task_id* holds the lock (for a semaphore: one
    of its permits; read only after a refusal)."""
    if lock.holder.get("task_id") == task_id:
        return True
    return isinstance(lock, Semaphore) and any(
        record.get("task_id") == task_id for record in lock.read_holders()
    )


def _rate_grant(
    limiter: RateLimiter, request: Any, *, waits: float | None, requeues: bool
) -> RateGrant:
    """Ask the run's rate limiter for a start.

    A run that will be re-queued on refusal (``retry``) joins the limiter's line: it is
    promised the next free slot and comes back exactly then (``RATE_SLOT_HEADER``), asking
    for that slot, waiting in the worker at most ``RATE_SHORT_WAIT`` for the run ahead of
    it; if that is not enough it goes to the end of the line. ``wait`` (*waits*: the
    seconds left of ``lock_wait_timeout``) sleeps until its slot, up to that.
    """
    if waits is not None:
        return limiter.acquire(blocking=True, timeout=waits)
    headers = getattr(request, "headers", None) or {}
    promised = headers.get(RATE_SLOT_HEADER) or getattr(request, RATE_SLOT_HEADER, 0)
    if promised:
        grant = limiter.acquire(blocking=True, timeout=RATE_SHORT_WAIT, queue=False)
        if grant or not requeues:
            return grant
    return limiter.acquire(queue=requeues)


# -- acquire -------------------------------------------------------------------------------
def acquire_for_request(
    task: Any,
    task_id: str | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    request: Any = None,
) -> None:
    """Take the run's lock and rate slot, or apply the contended strategy: from
    ``before_start`` for a worker's or an eager run (*task_id*), from the body for a
    direct call (*task_id* None: no message to re-queue, mark or hand over).

    With ``lock_on="enqueue"``/``"enqueue+run"`` the lock is taken by a hand-over of the
    message's enqueue-time hold (see celery_redlock.task.dedup); a message that does not run
    (skipped, superseded, failed) gives its own hold back, a retried one keeps it.
    """
    if request is None:
        request = task.request
    state = task.redlock_state
    # The run's state and options, handed to every later step of this run (its body, its
    # release).
    request._redlock_state = state
    if state.disabled:
        return
    options = request._redlock_options = task.redlock_options
    direct = task_id is None
    eager = bool(getattr(request, "is_eager", False))
    strategy: Strategy = options.contended  # resolved with the options, never per run
    if eager and strategy.eager is not None:
        strategy = strategy.eager
    headers = None if direct else getattr(request, "headers", None)
    name = lock_name_for(task, args, kwargs, headers, options)
    attempt = (0, 0) if direct else attempt_of(request)
    handover = None
    if options.lock_on != "run" and not eager and task_id is not None:
        marks = headers if isinstance(headers, dict) else {}
        # A retry keeps its place; a chain step was sent on purpose: neither is a duplicate.
        keeps_place = attempt != (0, 0) or bool(marks.get(NO_DEDUP_HEADER))
        if not keeps_place and HOLD_HEADER not in marks:
            claim_at_worker(state, task, request, name, options)
        handover = Handover(task_id, strict=not keeps_place)
    run = _Run(
        state, task, request, task_id, name, options, strategy, eager, attempt, (args, kwargs),
        direct,
    )  # fmt: skip
    previous = attempt_policy(strategy.name)  # named on the spans of refused attempts
    try:
        _acquire(run, handover)
    except Retry:
        # Re-queued under the same task id: it keeps its hold, unless that re-queue cannot
        # be published (next_attempt publishes it once Celery stored RETRY).
        if handover is not None:
            owner = handover.owner
            give_back_on_loss(
                owner, lambda: give_back(state, name, owner, "could not be re-queued")
            )
        raise
    except BaseException:
        if handover is not None:
            give_back(state, name, handover.owner, "did not start")
        raise
    finally:
        attempt_policy(previous)
    if handover is not None and lock_of(request) is None:
        give_back(state, name, handover.owner, "did not start")  # fail-open, a skip


@dataclass(frozen=True)
class _Run:
    """One run being started: what ``_acquire`` needs to know about it."""

    #: The task's app's state, as the task holds it.
    state: AppState
    task: Any
    request: Any
    task_id: str | None
    name: str
    options: TaskOptions
    strategy: Strategy
    eager: bool
    attempt: tuple[int, int]
    #: The call's arguments (positional, keyword).
    call: tuple[tuple[Any, ...], dict[str, Any]]
    #: A direct call (``task(...)``): no message, so nothing to re-queue, mark or track.
    direct: bool = False

    def refusal(self, lock: Any, rate: RateGrant | None = None) -> Refusal:
        """The run as a contended strategy sees it (a direct call has no request)."""
        request = None if self.direct else self.request
        waited = self.strategy.waits
        return Refusal(self.task, request, lock, self.options, self.eager, waited, rate=rate)

    def new_lock(self, host: Any, handover: Handover | None, done_as: str | None) -> Lock:
        """The run's lock: ``options.ttl``, ``limit`` and ``max_hold`` handed to
        ``AppState.make_lock`` (the one place that builds locks), its rules held with it.

        Its holder record names the task id and, from the second attempt on, which
        attempt (``retries``, ``lock_retries``): a delivery that finds its own task id
        holding the lock tells an earlier attempt (a ``self.retry()`` whose body has not
        released yet) from another copy of its own message (a redelivery).
        """
        options, attempt = self.options, self.attempt
        owner: dict[str, Any] = {"task_name": self.task.name, "task_id": self.task_id}
        if host:
            owner["worker"] = host
        if attempt[0]:
            owner["retries"] = attempt[0]
        if attempt[1]:
            owner["lock_retries"] = attempt[1]
        extra: dict[str, Any] = {}
        if handover is not None:
            extra["handover"] = handover
        if done_as is not None:
            extra.update(done_as=done_as, done_ttl=options.enqueue_ttl)
        lock = self.state.make_lock(
            self.name,
            options.ttl,
            limit=options.limit or 1,
            owner_info=owner,
            max_hold=options.max_hold,
            on_lost=on_lost,
            **extra,
        )
        hold_rules(lock, self.task, options, *self.call)
        return lock


def _acquire(run: _Run, handover: Handover | None) -> None:
    """Take the run's lock (or permit) and its rate slot, or apply the contended strategy."""
    state = run.state
    task, request, task_id, name = run.task, run.request, run.task_id, run.name
    options, strategy, eager = run.options, run.strategy, run.eager
    policy = strategy.name
    host = getattr(request, "hostname", None)
    waits = strategy.waits
    lock: Lock | None = None
    began = time.monotonic()
    # A redelivered message, or a contention retry (its first delivery may have been
    # redelivered, and that copy may have run): check the done mark once it has the lock.
    redelivered = (getattr(request, "delivery_info", None) or {}).get("redelivered")
    copy = bool(redelivered) or run.attempt[1] > 0
    mutex = options.limit == 1
    # acks_late: the broker may hand this message out again while or after it runs; the
    # release then marks this task id's attempt done, so such a copy (or a contention
    # retry of a delivery whose copy ran) knows it ran (a mutex's release only).
    tracked = task_id is not None  # a worker's or an eager run: a message, an id
    queued = tracked and not eager
    done_as = f"{task_id}:{run.attempt[0]}" if task.acks_late and queued and mutex else None
    try:
        if options.limit is not None:
            lock = run.new_lock(host, handover, done_as)
            acquired = lock.acquire(blocking=False)
            superseded = isinstance(lock, RunLock) and lock.superseded
            if not acquired and not superseded:
                if lock.refused_by:  # by a control or a rule, not by this key's holder
                    if waits:
                        acquired = lock.acquire(blocking=True, timeout=options.wait_timeout)
                elif queued and mutex and lock.holder.get("task_id") == task_id:
                    copy = True
                    acquired = _own_task_holds(task, request, lock, run.attempt)
                elif waits:
                    acquired = lock.acquire(blocking=True, timeout=options.wait_timeout)
                elif tracked and _held_by_this_task(lock, str(task_id)):
                    # A semaphore's permit held by an earlier attempt of this task id (a
                    # self.retry() not released yet): wait for it, at most one TTL.
                    acquired = lock.acquire(blocking=True, timeout=lock.ttl)
            if acquired and copy and _ran_already(lock):
                release_for_request(state, task, lock, None, request)
                _drop_copy(task, task_id, name)
            if not acquired:
                if isinstance(lock, RunLock) and lock.superseded:
                    if copy and _ran_already(lock):
                        _drop_copy(task, task_id, name)  # it ran: its result stays
                    skip_superseded(state, task, request, lock)
                if tracked:
                    send_task_event(
                        state, task, "contended", lock=name, policy=policy, holder=lock.holder
                    )
                # A strategy that does not raise gives the result the run returns instead.
                request._redlock_skip = strategy.refuse(run.refusal(lock))
                return
            request._redlock_lock = lock
            if tracked:
                state.held[str(task_id)] = lock
                if state.send_events:
                    send_task_event(state, task, "acquired", lock=name, fence=lock.fence)
        if options.rate is not None:
            owner: dict[str, Any] = {"task_name": task.name}
            if tracked:
                owner["task_id"] = task_id
            limiter = state.make_limiter(name, options.rate, options.rate_burst, owner)
            requeues = strategy.requeues and queued
            # "wait": the permit and the rate share one lock_wait_timeout.
            left = max(0.0, options.wait_timeout - (time.monotonic() - began)) if waits else None
            grant = _rate_grant(limiter, request, waits=left, requeues=requeues)
            if not grant:
                if lock is not None:  # the permit goes back at once: a refusal takes nothing
                    release_for_request(state, task, lock, task_id, request)
                if tracked:
                    send_task_event(
                        state,
                        task,
                        "rate-limited",
                        lock=name,
                        policy=policy,
                        retry_after=grant.retry_after,
                    )
                request._redlock_skip = strategy.refuse(run.refusal(limiter, grant))
    except StoreUnavailable as exc:
        if lock is not None and lock_of(request) is lock:
            release_for_request(state, task, lock, task_id, request)
        if state.settings.fail_open:
            log.warning(
                "Task %s[%s] runs UNLOCKED (redlock_fail_open=True): %s", task.name, task_id, exc
            )
            return
        if not queued:  # an eager or direct call: no message to re-queue
            raise
        requeue(task, request, name, exc, options)  # logs the one line of this attempt


def _own_task_holds(task: Any, request: Any, lock: Lock, attempt: tuple[int, int]) -> bool:
    """The lock is held under this very task id. True once this delivery holds it.

    An earlier attempt (``self.retry()`` publishes the next one before the old body's
    ``finally`` releases, and a fast worker can start it first; the holder record's
    ``retries`` is lower): wait for that release, or for a dead attempt's lease to run
    out, at most one TTL; then the contended strategy applies as usual. Skipping or
    failing against ourselves would be wrong (the celery-singleton bug).

    The same ``retries``: another delivery of this message may hold the lock (the broker
    handed the message out twice: a Redis visibility timeout shorter than the task, a
    connection lost before the ack), or a contention retry's earlier delivery was
    redelivered and that copy got it; or nothing runs at all: an acquire of this task id
    whose reply was lost holds the lock until it is given back or expires. This
    delivery waits until the holder's lease would end:

    * it gets the lock: no delivery holds it any more. It runs, unless the done mark
      (``acks_late``: every release of a run leaves one) says this attempt ran; the
      caller checks that. A release alone does not prove a run: a lost acquire's
      background give-back looks the same;
    * the holder renewed its lease meanwhile: a delivery of this message runs now, this
      copy is dropped (``Ignore``);
    * still held, never renewed (another task took it meanwhile, or a slow server ended
      the wait first): nothing says that this message runs, so the contended strategy
      applies as for any holder.
    """
    holder = lock.holder
    task_id = request.id
    if _int(holder.get("retries")) < attempt[0]:
        return lock.acquire(blocking=True, timeout=lock.ttl)
    left = lock.holder_ttl_ms if lock.holder_ttl_ms and lock.holder_ttl_ms > 0 else lock.ttl_ms
    lease_end = time.monotonic() + left / 1000
    log.warning(
        "Task %s[%s]: another delivery of this message holds lock %r (%s); this copy does "
        "not start while it runs",
        task.name,
        task_id,
        lock.name,
        describe_holder(holder),
    )
    if lock.acquire(blocking=True, timeout=left / 1000 + drift(lock.ttl) + 0.05):
        return True
    if not _renewed_by(lock, task_id, lease_end):
        return False
    log.info(
        "Task %s[%s] dropped: the other delivery of this message still runs (lock %r)",
        task.name,
        task_id,
        lock.name,
    )
    raise Ignore(f"the other delivery of this message still runs (lock {lock.name!r})")


def _renewed_by(lock: Lock, task_id: str, lease_end: float) -> bool:
    """True when the lock's last refusal showed *task_id* holding it for longer than the
    lease it had at *lease_end*: a live delivery renews it."""
    ttl_ms = lock.holder_ttl_ms
    if lock.holder.get("task_id") != task_id or not ttl_ms or ttl_ms < 0:
        return False
    return time.monotonic() + ttl_ms / 1000 > lease_end + drift(lock.ttl)


def _ran_already(lock: Lock) -> bool:
    """True when the lock's done mark says this very run (task id and attempt) finished."""
    if not isinstance(lock, RunLock) or lock.done_as is None:
        return False
    try:
        return lock.ran_before()
    except RedlockError as exc:  # cannot tell: run it, as any delivery would
        log.warning("could not read the done mark of lock %r: %s", lock.name, exc)
        return False


def _drop_copy(task: Any, task_id: str | None, name: str) -> NoReturn:
    """A redelivered copy of a message whose run of this attempt ended (its done mark):
    it does not run again; raises ``Ignore`` (the result that run stored stays)."""
    log.info(
        "Task %s[%s] dropped: a redelivered copy of a message that already ran (lock %r)",
        task.name,
        task_id,
        name,
    )
    raise Ignore(f"already ran (lock {name!r})")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# -- the body ------------------------------------------------------------------------------
def run_locked(
    task: Any, fun: Callable[..., Any], bound: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run the task body under its lock and release on every exit."""
    request = task.request
    state: AppState | None = getattr(request, "_redlock_state", None)
    if state is None:
        # Called directly (``task(...)``), not through a worker or apply(): lock here.
        acquire_for_request(task, None, args, kwargs, request)
        state = request._redlock_state
    skip = getattr(request, "_redlock_skip", None)
    if skip is not None:
        return skip
    lock = lock_of(request)
    if lock is None:
        try:
            return fun(task, *args, **kwargs) if bound else fun(*args, **kwargs)
        except BackOff as exc:
            back_off(state, task, request, None, exc, (args, kwargs))
    options: TaskOptions = request._redlock_options  # set with the lock, by the acquire
    running = watch(lock, task.name, options.lost)
    try:
        try:
            return fun(task, *args, **kwargs) if bound else fun(*args, **kwargs)
        finally:
            running.stop(lock)  # after this no interrupt can reach this thread
    except LockLostInterrupt:  # raised in the body, or on the way out before stop() ran
        raise LockLost(lock.name, lock.lost_reason or "lost while the task ran") from None
    except BackOff as exc:
        back_off(state, task, request, lock, exc, (args, kwargs))
    finally:
        release_for_request(state, task, lock, getattr(request, "id", None), request)


def back_off(  # noqa: PLR0917 - the run's state, task, request, lock and call
    state: AppState,
    task: Any,
    request: Any,
    lock: Lock | None,
    exc: BackOff,
    call: tuple[tuple[Any, ...], dict[str, Any]],
) -> NoReturn:
    """The body raised :class:`~celery_redlock.app.rules.BackOff`: pause its key for every
    worker (its own key, else the task's first ``Rate`` key, else the run's lock key),
    then re-queue the run to start when the pause ends, within the lock's retry budget;
    a call with no message to re-queue (eager, direct) raises the BackOff after the pause."""
    options = task.redlock_options
    args, kwargs = call
    key = exc.key
    if key is None:
        key = first_rate_key(task, options, args, kwargs)
    if key is None:
        key = lock.name if lock is not None else lock_name_for(task, args, kwargs, None, options)
    task_id = getattr(request, "id", None)
    why = exc.reason or "BackOff raised"
    if exc.seconds > 0:
        controls = control(task.app)
        controls.pause(key, exc.seconds, reason=f"{why} in {task.name}[{task_id}]")
        if lock_events.wanted("backed_off"):
            lock_events.emit(
                lock_events.LockEvent(
                    "backed_off",
                    key,
                    lock_keys(key, controls.prefix).lock,
                    holder={"task_name": task.name, "task_id": task_id},
                    retry_after=exc.seconds,
                    error=why,
                )
            )
    log.warning("Task %s[%s] backs off: %r paused for %gs (%s)", task.name, task_id, key,
                exc.seconds, why)  # fmt: skip
    if task_id is None or getattr(request, "is_eager", False):
        raise exc
    requeue(task, request, key, exc, options, delay=known_delay(options, exc.seconds))


# -- release -------------------------------------------------------------------------------
def release_for_request(
    state: AppState, task: Any, lock: Lock, task_id: str | None, request: Any = None
) -> None:
    """Release a run's lock (*state*: its app's); problems are logged, never raised over
    the task's outcome."""
    if task_id is not None:
        state.held.pop(task_id, None)
    if request is None:
        request = task.request
    if lock_of(request) is lock:
        request._redlock_lock = None
    if not lock.valid_until:
        return  # already released
    events = state.send_events  # the Celery events below are the only use of these two
    held, fence = (lock.held_for, lock.fence) if events else (0.0, None)
    try:
        lock.release()
        if events:
            send_task_event(state, task, "released", lock=lock.name, fence=fence, held=held)
    except LockLost as exc:
        if events:
            send_task_event(state, task, "lost", lock=lock.name, reason=str(exc), held=held)
        # The lock wrote the loss's one WARNING line (naming this task) when it found it.
        log.debug("Task %s[%s]: release found the lock lost: %s", task.name, task_id, exc)
    except StoreUnavailable as exc:
        log.warning(
            "Task %s[%s]: could not release lock %r (%s); it expires within %ss",
            task.name,
            task_id,
            lock.name,
            exc,
            lock.ttl,
        )
    except Exception:
        log.exception("Task %s[%s]: releasing lock %r failed", task.name, task_id, lock.name)


# -- the task_postrun safety net -------------------------------------------------------------
_postrun_connected = False
_postrun_lock = threading.Lock()


def use_postrun_net() -> None:
    """Connect the ``task_postrun`` safety net (once per process): some LockedTask class has
    its own ``before_start``, ``__call__`` or ``after_return`` (see
    celery_redlock.task.locked_task).

    It is not connected otherwise: any receiver makes Celery send the signal, with its
    lock and keyword dict, for every task.
    """
    global _postrun_connected
    with _postrun_lock:
        if not _postrun_connected:
            signals.task_postrun.connect(on_postrun, weak=False)
            _postrun_connected = True


def on_postrun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """Safety net: a lock still registered for a finished run is released."""
    app = getattr(sender, "app", None)
    if app is None or task_id is None or getattr(sender, "redlock_spec", None) is None:
        return
    state = sender.redlock_state
    lock = state.held.get(task_id) if state.installed else None
    if lock is not None:
        release_for_request(state, sender, lock, task_id)
