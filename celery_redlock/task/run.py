"""One run of a locked task, in one object: acquire, the body under its lock, release.

A :class:`LockedRun` is made once per run and kept on its Celery request
(:data:`RUN_ATTR`); every later step of the run finds it there. Its kind
(:class:`RunKind`) says what the run has: a worker's run a message (re-queued, marked
done, handed over), an eager call (``apply()``, ``task_always_eager``) a task id but no
message to re-queue, a direct call (``task(...)``, locked when its body starts) neither.

* :meth:`LockedRun.acquire` (from ``before_start`` for a worker's or an eager run, where
  ``Retry`` and ``Ignore`` are honoured; from the body for a direct call) takes the
  run's lock and rate slot, or applies the contended strategy
  (:mod:`celery_redlock.task.contention`); a redelivered copy whose attempt ran is
  dropped there (:meth:`LockedRun._drop_if_ran`);
* :meth:`LockedRun.call` runs the body under the lock and releases on every exit;
* :meth:`LockedRun.release` is the one release of a run: the body's exit, a refusal by
  the rate limiter, ``after_return``, the ``task_postrun`` net and a warm shutdown all
  call it. It logs, never raising over the task's outcome.

Every run with a task id that holds a lock is in ``AppState.held`` under that id until it
is released, so the worker's own paths (:mod:`celery_redlock.worker.bootstep`: warm
shutdown, a child that is gone, the ``task_postrun`` safety net) can tell whether there
is still something to release.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
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
    dequeue,
    skip_superseded,
)
from .flow import first_rate_key, hold_rules
from .interrupt import LockLostInterrupt, on_lost, watch
from .naming import lock_name_for
from .next_attempt import when_not_requeued

__all__ = [
    "RUN_ATTR",
    "LockedRun",
    "RunKind",
    "log_release_failed",
    "on_postrun",
    "run_of",
    "use_postrun_net",
]

log = logging.getLogger("celery_redlock.task")

#: The request attribute that keeps a run's :class:`LockedRun`.
RUN_ATTR = "_redlock_run"

#: How long a run that comes back for the slot its rate limiter promised it may wait in
#: the worker for the run before it (which took its grant a little late) before it goes to
#: the end of the line instead.
RATE_SHORT_WAIT = 0.25


class RunKind(enum.Enum):
    """What a run has, which decides what its acquire and release may do."""

    #: A message delivered to a worker: a task id, re-queued on refusal, marked done,
    #: handed over from its enqueue-time hold, tracked in ``AppState.held``.
    WORKER = "worker"
    #: ``apply()`` or ``task_always_eager``: a task id, tracked, but no message to
    #: re-queue (the strategy's eager variant applies).
    EAGER = "eager"
    #: ``task(...)``: no message and no task id; locked when its body starts.
    DIRECT = "direct"


def run_of(request: Any) -> LockedRun | None:
    """The run of *request* (None before its start, or outside a locked task)."""
    return getattr(request, RUN_ATTR, None)


class LockedRun:
    """One run of a locked task: what it is, what it holds, and its steps in order."""

    __slots__ = (
        "args",
        "attempt",
        "done_as",
        "kind",
        "kwargs",
        "lock",
        "name",
        "options",
        "request",
        "skip",
        "state",
        "strategy",
        "task",
        "task_id",
    )

    def __init__(
        self,
        task: Any,
        task_id: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        request: Any = None,
    ) -> None:
        """The run of *request* (default: the task's current one), kept on the request
        for its later steps. A *task_id* of None is a direct call."""
        if request is None:
            request = task.request
        if task_id is None:
            self.kind = RunKind.DIRECT
        elif getattr(request, "is_eager", False):
            self.kind = RunKind.EAGER
        else:
            self.kind = RunKind.WORKER
        self.task = task
        self.request = request
        self.task_id = task_id
        self.args = args
        self.kwargs = kwargs
        #: The task's app's state, as the task holds it.
        self.state: AppState = task.redlock_state
        #: The task's options (None while locking is disabled: nothing reads them).
        self.options: TaskOptions | None = None
        self.strategy: Strategy | None = None
        self.name = ""
        #: (``self.retry()`` count, contention retry count).
        self.attempt = (0, 0)
        #: The done mark the release leaves (``acks_late`` worker runs of a mutex).
        self.done_as: str | None = None
        #: The lock held now (None before the acquire, after the release, or unlocked).
        self.lock: Lock | None = None
        #: What the run returns instead of its body (a refused run's strategy said so).
        self.skip: Any = None
        setattr(request, RUN_ATTR, self)

    # -- acquire -----------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the run's lock and rate slot, or apply the contended strategy.

        With ``lock_on="enqueue"``/``"enqueue+run"`` a worker's run takes its lock by a
        hand-over of the message's enqueue-time hold (see celery_redlock.task.dedup); a
        message that does not run (skipped, superseded, failed) gives its own hold back,
        a retried one keeps it.
        """
        if self.state.disabled:
            return
        task, request, kind = self.task, self.request, self.kind
        options = self.options = self.state.options_for(task)  # resolved once per class
        strategy: Strategy = options.contended  # resolved with the options, never per run
        if kind is RunKind.EAGER and strategy.eager is not None:
            strategy = strategy.eager
        self.strategy = strategy
        headers = None if kind is RunKind.DIRECT else getattr(request, "headers", None)
        name = self.name = lock_name_for(task, self.args, self.kwargs, headers, options)
        handover = None
        if kind is not RunKind.DIRECT:
            attempt = self.attempt = attempt_of(request)
            if kind is RunKind.WORKER:
                if task.acks_late and options.limit == 1:
                    # The broker may hand this message out again while or after it runs:
                    # the release marks this attempt done, so such a copy knows it ran.
                    self.done_as = f"{self.task_id}:{attempt[0]}"
                if options.lock_on != "run":
                    handover = self._handover(headers, name, options)
        previous = attempt_policy(strategy.name)  # named on the spans of refused attempts
        try:
            try:
                began = time.monotonic()
                took = options.limit is None or self._take_lock(handover)
                if took and options.rate is not None:  # a refused lock takes no rate slot
                    self._take_rate(options.rate, began)
            except StoreUnavailable as exc:
                self._unavailable(exc)
        except Retry:
            # Re-queued under the same task id: it keeps its hold, unless that re-queue
            # cannot be published (next_attempt publishes it once Celery stored RETRY).
            if handover is not None:
                owner, state = handover.owner, self.state
                when_not_requeued(
                    owner, lambda: dequeue(state, name, owner, "could not be re-queued")
                )
            raise
        except BaseException:
            if handover is not None:
                dequeue(self.state, name, handover.owner, "did not start")
            raise
        finally:
            attempt_policy(previous)
        if handover is not None and self.lock is None:
            dequeue(self.state, name, handover.owner, "did not start")  # fail-open, a skip

    def _handover(self, headers: Any, name: str, options: TaskOptions) -> Handover:
        """The hand-over of this message's enqueue-time hold to its run's lock; a message
        published without one (by a client that took none) claims it here first."""
        marks = headers if isinstance(headers, dict) else {}
        # A retry keeps its place; a chain step was sent on purpose: neither is a duplicate.
        keeps_place = self.attempt != (0, 0) or bool(marks.get(NO_DEDUP_HEADER))
        if not keeps_place and HOLD_HEADER not in marks:
            claim_at_worker(self.state, self.task, self.request, name, options)
        return Handover(str(self.task_id), strict=not keeps_place)

    def _unavailable(self, exc: StoreUnavailable) -> None:
        """The lock store did not answer: the run fails open (``redlock_fail_open``), or
        an eager or direct call raises, or a worker's run is re-queued."""
        self.release()
        state, task, options = self.state, self.task, self.options
        assert options is not None  # set by acquire()
        if state.settings.fail_open:
            log.warning(
                "Task %s[%s] runs UNLOCKED (redlock_fail_open=True): %s",
                task.name,
                self.task_id,
                exc,
            )
            return
        if self.kind is not RunKind.WORKER:  # an eager or direct call: no message
            raise exc
        requeue(task, self.request, self.name, exc, options)  # logs this attempt's line

    def _take_lock(self, handover: Handover | None) -> bool:
        """Take the run's lock (or permit); False: refused, the strategy applied."""
        state, task, options = self.state, self.task, self.options
        strategy = self.strategy
        assert options is not None and strategy is not None  # set by acquire()
        tracked = self.kind is not RunKind.DIRECT
        lock = self._new_lock(handover)
        acquired = lock.acquire(blocking=False)
        own_task = False
        if not acquired and not (isinstance(lock, RunLock) and lock.superseded):
            if lock.refused_by:  # by a control or a rule, not by this key's holder
                if strategy.waits:
                    acquired = lock.acquire(blocking=True, timeout=options.wait_timeout)
            elif (
                self.kind is RunKind.WORKER
                and options.limit == 1
                and lock.holder.get("task_id") == self.task_id
            ):
                own_task = True
                acquired = self._own_task_holds(lock)
            elif strategy.waits:
                acquired = lock.acquire(blocking=True, timeout=options.wait_timeout)
            elif tracked and _held_by_this_task(lock, str(self.task_id)):
                # A semaphore's permit held by an earlier attempt of this task id (a
                # self.retry() not released yet): wait for it, at most one TTL.
                acquired = lock.acquire(blocking=True, timeout=lock.ttl)
        if self.done_as is not None and (own_task or self._may_be_copy()):
            self._drop_if_ran(lock, acquired)
        if not acquired:
            if isinstance(lock, RunLock) and lock.superseded:
                skip_superseded(state, task, self.request, lock)
            if tracked:
                send_task_event(
                    state,
                    task,
                    "contended",
                    lock=self.name,
                    policy=strategy.name,
                    holder=lock.holder,
                )
            # A strategy that does not raise gives the result the run returns instead.
            self.skip = strategy.refuse(self._refusal(lock))
            return False
        self.lock = lock
        if tracked:
            state.held[str(self.task_id)] = self
            if state.send_events:
                send_task_event(state, task, "acquired", lock=self.name, fence=lock.fence)
        return True

    def _take_rate(self, rate: str, began: float) -> None:
        """Take the run's rate slot; refused, the permit goes back and the strategy
        applies (the rate and a ``wait`` for the permit share one lock_wait_timeout)."""
        state, task, options, strategy = self.state, self.task, self.options, self.strategy
        assert options is not None and strategy is not None  # set by acquire()
        owner: dict[str, Any] = {"task_name": task.name}
        if self.kind is not RunKind.DIRECT:
            owner["task_id"] = self.task_id
        limiter = state.make_limiter(self.name, rate, options.rate_burst, owner)
        waits = strategy.waits
        left = max(0.0, options.wait_timeout - (time.monotonic() - began)) if waits else None
        requeues = strategy.requeues and self.kind is RunKind.WORKER
        grant = _rate_grant(limiter, self.request, waits=left, requeues=requeues)
        if grant:
            return
        self.release()  # a refusal takes nothing
        if self.kind is not RunKind.DIRECT:
            send_task_event(
                state,
                task,
                "rate-limited",
                lock=self.name,
                policy=strategy.name,
                retry_after=grant.retry_after,
            )
        self.skip = strategy.refuse(self._refusal(limiter, grant))

    def _new_lock(self, handover: Handover | None) -> Lock:
        """The run's lock: ``options.ttl``, ``limit`` and ``max_hold`` handed to
        ``AppState.make_lock`` (the one place that builds locks), its rules held with it.

        Its holder record names the task id and, from the second attempt on, which
        attempt (``retries``, ``lock_retries``): a delivery that finds its own task id
        holding the lock tells an earlier attempt (a ``self.retry()`` whose body has not
        released yet) from another copy of its own message (a redelivery).
        """
        options, attempt = self.options, self.attempt
        assert options is not None  # set by acquire()
        owner: dict[str, Any] = {"task_name": self.task.name, "task_id": self.task_id}
        host = getattr(self.request, "hostname", None)
        if host:
            owner["worker"] = host
        if attempt[0]:
            owner["retries"] = attempt[0]
        if attempt[1]:
            owner["lock_retries"] = attempt[1]
        extra: dict[str, Any] = {}
        if handover is not None:
            extra["handover"] = handover
        if self.done_as is not None:
            extra.update(done_as=self.done_as, done_ttl=options.enqueue_ttl)
        lock = self.state.make_lock(
            self.name,
            options.ttl,
            limit=options.limit or 1,
            owner_info=owner,
            max_hold=options.max_hold,
            on_lost=on_lost,
            **extra,
        )
        hold_rules(lock, self.task, options, self.args, self.kwargs)
        return lock

    def _refusal(self, lock: Any, rate: RateGrant | None = None) -> Refusal:
        """The run as a contended strategy sees it (a direct call has no request)."""
        strategy, options = self.strategy, self.options
        assert strategy is not None and options is not None  # set by acquire()
        request = None if self.kind is RunKind.DIRECT else self.request
        eager = self.kind is RunKind.EAGER
        return Refusal(self.task, request, lock, options, eager, strategy.waits, rate=rate)

    # -- redelivered copies and done marks (acks_late worker runs of a mutex) ------------------
    def _may_be_copy(self) -> bool:
        """True when this delivery may be a copy of one that ran: a redelivered message,
        or a contention retry (its first delivery may have been redelivered, and that
        copy may have run)."""
        redelivered = (getattr(self.request, "delivery_info", None) or {}).get("redelivered")
        return bool(redelivered) or self.attempt[1] > 0

    def _drop_if_ran(self, lock: Lock, acquired: bool) -> None:
        """Drop this copy (``Ignore``; the result the run stored stays) when the done mark
        says its attempt ran: read once it holds the lock, or when a newer message's
        hold superseded it."""
        superseded = isinstance(lock, RunLock) and lock.superseded
        if not (acquired or superseded) or not _ran_already(lock):
            return
        if acquired:
            self.lock = lock
            self.release()
        log.info(
            "Task %s[%s] dropped: a redelivered copy of a message that already ran (lock %r)",
            self.task.name,
            self.task_id,
            self.name,
        )
        raise Ignore(f"already ran (lock {self.name!r})")

    def _own_task_holds(self, lock: Lock) -> bool:
        """The lock is held under this very task id. True once this delivery holds it.

        An earlier attempt (``self.retry()`` publishes the next one before the old body's
        ``finally`` releases, and a fast worker can start it first; the holder record's
        ``retries`` is lower): wait for that release, or for a dead attempt's lease to run
        out, at most one TTL; then the contended strategy applies as usual. Skipping or
        failing against ourselves would be wrong (the celery-singleton bug).

        The same ``retries``: another delivery of this message may hold the lock (the
        broker handed the message out twice: a Redis visibility timeout shorter than the
        task, a connection lost before the ack), or a contention retry's earlier delivery
        was redelivered and that copy got it; or nothing runs at all: an acquire of this
        task id whose reply was lost holds the lock until it is given back or expires.
        This delivery waits until the holder's lease would end:

        * it gets the lock: no delivery holds it any more. It runs, unless the done mark
          (``acks_late``: every release of a run leaves one) says this attempt ran; the
          caller checks that. A release alone does not prove a run: a lost acquire's
          background give-back looks the same;
        * the holder renewed its lease meanwhile: a delivery of this message runs now,
          this copy is dropped (``Ignore``);
        * still held, never renewed (another task took it meanwhile, or a slow server
          ended the wait first): nothing says that this message runs, so the contended
          strategy applies as for any holder.
        """
        task = self.task
        holder = lock.holder
        task_id = str(self.task_id)
        if _int(holder.get("retries")) < self.attempt[0]:
            return lock.acquire(blocking=True, timeout=lock.ttl)
        left = lock.holder_ttl_ms if lock.holder_ttl_ms and lock.holder_ttl_ms > 0 else lock.ttl_ms
        lease_end = time.monotonic() + left / 1000
        log.warning(
            "Task %s[%s]: another delivery of this message holds lock %r (%s); this copy "
            "does not start while it runs",
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

    # -- the body ------------------------------------------------------------------------------
    def call(
        self, fun: Callable[..., Any], bound: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run the task body under the run's lock and release on every exit (a refused
        run returns what its strategy gave instead)."""
        if self.skip is not None:
            return self.skip
        task = self.task
        lock = self.lock
        if lock is None:
            try:
                return fun(task, *args, **kwargs) if bound else fun(*args, **kwargs)
            except BackOff as exc:
                self.back_off(exc, args, kwargs)
        options = self.options
        assert options is not None  # a lock is taken with its options
        running = watch(lock, task.name, options.lost)
        try:
            try:
                return fun(task, *args, **kwargs) if bound else fun(*args, **kwargs)
            finally:
                running.stop(lock)  # after this no interrupt can reach this thread
        except LockLostInterrupt:  # raised in the body, or on the way out before stop() ran
            raise LockLost(lock.name, lock.lost_reason or "lost while the task ran") from None
        except BackOff as exc:
            self.back_off(exc, args, kwargs)
        finally:
            self.release()

    def back_off(self, exc: BackOff, args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
        """The body raised :class:`~celery_redlock.app.rules.BackOff`: pause its key for
        every worker (its own key, else the task's first ``Rate`` key, else the run's lock
        key), then re-queue the run to start when the pause ends, within the lock's retry
        budget; a call with no message to re-queue (eager, direct) raises the BackOff
        after the pause."""
        task, request = self.task, self.request
        options = self.options if self.options is not None else task.redlock_options
        key = exc.key
        if key is None:
            key = first_rate_key(task, options, args, kwargs)
        if key is None:
            key = self.name or lock_name_for(task, args, kwargs, None, options)
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
        if self.kind is not RunKind.WORKER:
            raise exc
        requeue(task, request, key, exc, options, delay=known_delay(options, exc.seconds))

    # -- release -------------------------------------------------------------------------------
    def release(self) -> bool:
        """Release the run's lock, once, whichever exit comes first (the body's end, a
        refused rate slot, a copy that ran already, ``after_return``, the ``task_postrun``
        net, a warm shutdown). True when this call released it; problems are logged
        (:func:`log_release_failed`), never raised over the task's outcome."""
        lock = self.lock
        if lock is None:
            return False
        self.lock = None
        state, task_id = self.state, self.task_id
        if task_id is not None and state.held.get(task_id) is self:
            del state.held[task_id]
        if not lock.valid_until:
            return False  # released already (a loss, or the worker's main process)
        events = state.send_events  # the Celery events below are the only use of these two
        held, fence = (lock.held_for, lock.fence) if events else (0.0, None)
        try:
            lock.release()
        except Exception as exc:
            if events and isinstance(exc, LockLost):
                send_task_event(
                    state, self.task, "lost", lock=lock.name, reason=str(exc), held=held
                )
            log_release_failed(log, self.task.name, task_id, lock.name, exc, lock.ttl)
            return False
        if events:
            send_task_event(state, self.task, "released", lock=lock.name, fence=fence, held=held)
        return True


def log_release_failed(  # noqa: PLR0917 - who logs, the run, its lock and what went wrong
    logger: logging.Logger,
    task_name: str,
    task_id: str | None,
    name: str,
    exc: BaseException,
    ttl: float,
    why: str | None = None,
) -> None:
    """The one line a release of a run's lock that did not happen writes: a run's own
    release, or (*why*: what became of its child) the worker's main process releasing
    for a child that is gone.

    A loss has had its one WARNING line from the lock (naming the task) when it was
    found: DEBUG here. A store that did not answer is a WARNING with the lease left; any
    other error of a run's own release is logged with its traceback."""
    if isinstance(exc, LockLost):
        logger.debug("Task %s[%s]: release found the lock lost: %s", task_name, task_id, exc)
    elif why is not None:
        logger.warning(
            "task %s[%s] %s: could not release %r (%s); it expires within %ss",
            task_name,
            task_id,
            why,
            name,
            exc,
            ttl,
        )
    elif isinstance(exc, StoreUnavailable):
        logger.warning(
            "Task %s[%s]: could not release lock %r (%s); it expires within %ss",
            task_name,
            task_id,
            name,
            exc,
            ttl,
        )
    else:
        logger.error(
            "Task %s[%s]: releasing lock %r failed", task_name, task_id, name, exc_info=exc
        )


# -- helpers of the acquire ------------------------------------------------------------------
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


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


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
    """Safety net: a run still holding its lock when it has finished is released."""
    app = getattr(sender, "app", None)
    if app is None or task_id is None or getattr(sender, "redlock_spec", None) is None:
        return
    state = sender.redlock_state
    run = state.held.get(task_id) if state.installed else None
    if run is not None:
        run.release()
