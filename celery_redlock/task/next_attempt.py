"""The next attempt of a run re-queued by its lock, published once Celery has stored this
attempt's state, so that nothing this attempt stores can land over the next one's outcome.

A run refused by its lock or rate limit (``lock_on_contended="retry"``), refused while the
lock Redis is unreachable, or ending in :class:`~celery_redlock.app.rules.BackOff` is re-queued
under its task id (:func:`celery_redlock.task.contention.requeue`): it raises ``Retry``, and
Celery's tracer stores RETRY (``backend.mark_as_retry``). Celery's guard against a late
write reads the stored state, then writes, and skips the write only when it read SUCCESS:
not atomic. Published before that store (as ``Task.retry()`` does), the next attempt can
store its outcome in between::

    attempt 2 (worker A)                   attempt 3 (worker B)           stored state
    publish attempt 3, countdown 10 ms                                    STARTED
    raise Retry
    tracer: read state (STARTED)
             ... a loaded machine ...     runs, succeeds, stores          SUCCESS
    tracer: write RETRY                                                   RETRY, for ever

So :func:`defer` keeps the next attempt's message here, and it is published after the
store, from one of these signals, which Celery sends in the thread that ran the attempt:

* ``task_retry``: Celery sends it after storing RETRY and calling ``task.on_retry``. The
  usual path. A publish that fails then leaves RETRY stored with nothing to follow, so
  FAILURE (the publish error) is stored over it: ``result.get()`` raises that error.
* ``task_internal_error``: the RETRY store failed (the result backend is down or refused
  it) or the task's own ``on_retry`` raised; Celery then skips ``task_retry``, reports an
  internal error and stores FAILURE instead. Here this attempt writes that same FAILURE
  itself first: if the backend takes it, Celery's own write will follow, and the next
  attempt waits for it (``task_failure``, sent after that store); if not, the backend is
  down, Celery's write will fail as well and nothing runs after it in a pool child, so the
  next attempt is published at once (while the backend refuses writes, no order of ours
  can make what it stores true; once it answers, the next attempt's outcome is the last).
* ``task_failure``: after Celery stored that FAILURE; the next attempt's outcome replaces it.
  Should Celery's write fail after ours succeeded (or the task's ``on_failure`` raise),
  nothing follows in a prefork child (a solo or threads pool reports a second internal
  error, which publishes it): the next run this thread re-queues publishes it first, logged.

A task that stores no errors (``ignore_result`` without ``store_errors_even_if_ignored``)
has nothing stored to order: its next attempt is published at ``task_retry`` or at once
on an internal error. An eager run is never re-queued (it waits or raises instead); one
given to :func:`defer` all the same is published at once.

The message is built when the run is refused and keeps its due time: published later, its
countdown is what is left of the delay, so a run promised a rate slot still comes back
for it.

Until one of these runs, the next attempt exists only in this process: a pool child killed
between the refusal and the store (a few milliseconds) takes it along, as it takes a run
whose message was acknowledged before it ran (``acks_late`` redelivers either).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import signals, states
from celery.utils.serialization import get_pickleable_exception

__all__ = ["defer", "when_not_requeued"]

log = logging.getLogger("celery_redlock.task")


@dataclass
class _Next:
    """The next attempt of one re-queued run, not published yet."""

    task: Any
    #: The attempt's request (Celery's ``Context``): its task id, chord and errbacks.
    request: Any
    #: The message, built when the run was refused (``task.signature_from_request``).
    sig: Any
    #: ``time.monotonic()`` at which the next attempt is due.
    due: float
    #: Publish once Celery has stored FAILURE (``task_failure``), not before.
    after_failure: bool = False
    #: Called when the next attempt cannot be published (gives the enqueue-time hold back).
    on_loss: Callable[[], None] | None = None
    #: Why the publish failed.
    error: BaseException | None = None

    @property
    def task_id(self) -> str:
        return str(self.request.id)


_local = threading.local()
_connect_lock = threading.Lock()
_connected = False


def defer(task: Any, request: Any, sig: Any, delay: float) -> None:
    """Keep *sig*, the next attempt of *request*'s run, due in *delay* seconds, until Celery
    has stored this attempt's state (see the module doc); the caller raises ``Retry``."""
    _connect()
    nxt = _Next(task, request, sig, time.monotonic() + delay)
    if getattr(request, "is_eager", False):
        _publish(nxt, "an eager run")
        return
    left = getattr(_local, "next", None)
    if left is not None:
        # A hook Celery did not run (it gave up on a run's internal error): publish that
        # run's next attempt now rather than never.
        log.warning(
            "Task %s[%s]: its lock retry was still unpublished; publishing it now",
            left.task.name,
            left.task_id,
        )
        _local.next = None
        _publish(left, "a later run")
    _local.next = nxt


def when_not_requeued(task_id: str, on_loss: Callable[[], None]) -> None:
    """Call *on_loss* if the deferred next attempt of *task_id* cannot be published."""
    nxt = _current(task_id)
    if nxt is not None:
        nxt.on_loss = on_loss


def _current(task_id: Any) -> _Next | None:
    nxt: _Next | None = getattr(_local, "next", None)
    if nxt is None or task_id is None or nxt.task_id != str(task_id):
        return None
    return nxt


def _take(task_id: Any) -> _Next | None:
    nxt = _current(task_id)
    if nxt is not None:
        _local.next = None
    return nxt


# -- Celery's hooks, in the order the tracer runs them -----------------------------------------
def _on_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_retry``: Celery stored RETRY (and ran ``on_retry``): publish."""
    nxt = _take(getattr(request, "id", None))
    if nxt is not None and not _publish(nxt, "its RETRY was stored"):
        _store_failure(nxt)


def _on_internal_error(
    sender: Any = None, task_id: Any = None, exception: BaseException | None = None, **_: Any
) -> None:
    """``task_internal_error``: Celery could not store RETRY or ``on_retry`` raised; it will
    store FAILURE next. Publish after that store if the backend takes writes, else now."""
    nxt = _current(task_id)
    if nxt is None:
        return
    if nxt.after_failure or not _stores_errors(nxt) or not _fail_first(nxt, exception):
        _take(task_id)
        _publish(nxt, "the result backend refused its state")
        return
    nxt.after_failure = True


def _on_failure(sender: Any = None, task_id: Any = None, **_: Any) -> None:
    """``task_failure``: Celery stored the internal error's FAILURE: publish."""
    nxt = _current(task_id)
    if nxt is not None and nxt.after_failure:
        _take(task_id)
        _publish(nxt, "Celery stored FAILURE for its internal error")


def _connect() -> None:
    global _connected
    if _connected:
        return
    with _connect_lock:
        if not _connected:
            signals.task_retry.connect(_on_retry, weak=False)
            signals.task_internal_error.connect(_on_internal_error, weak=False)
            signals.task_failure.connect(_on_failure, weak=False)
            _connected = True


# -- the steps -----------------------------------------------------------------------------
def _publish(nxt: _Next, after: str) -> bool:
    """Publish the next attempt with what is left of its delay; False if it failed (logged,
    the hold given back)."""
    task, request = nxt.task, nxt.request
    stack = task.request_stack
    # Published as from inside the run (as Task.retry() does): a re-queue keeps its place.
    pushed = stack.top is not request
    if pushed:
        stack.push(request)
    try:
        nxt.sig.apply_async(countdown=max(0.0, nxt.due - time.monotonic()))
    except Exception as exc:
        log.error(
            "Task %s[%s]: its lock retry could not be published (%s: %s); the run ends here",
            task.name,
            nxt.task_id,
            type(exc).__name__,
            exc,
        )
        nxt.error = exc
        if nxt.on_loss is not None:
            nxt.on_loss()
        return False
    finally:
        if pushed:
            stack.pop()
    log.debug("Task %s[%s]: lock retry published (%s)", task.name, nxt.task_id, after)
    return True


def _stores_errors(nxt: _Next) -> bool:
    """Whether Celery stores this run's failures (``ignore_result``, per task or per call,
    with ``store_errors_even_if_ignored``)."""
    task = nxt.task
    ignored = bool(task.ignore_result) or getattr(nxt.request, "ignore_result", None) is True
    return not ignored or bool(task.store_errors_even_if_ignored)


def _fail_first(nxt: _Next, exception: BaseException | None) -> bool:
    """Store the FAILURE Celery is about to store for its internal error; True if the
    result backend took it (Celery's own write then follows, and ``task_failure``)."""
    exc = get_pickleable_exception(exception or RuntimeError("internal error"))
    try:
        nxt.task.backend.store_result(nxt.task_id, exc, states.FAILURE, request=nxt.request)
    except Exception as error:
        log.warning(
            "Task %s[%s]: the result backend refuses writes (%s); its lock retry is published now",
            nxt.task.name,
            nxt.task_id,
            error,
        )
        return False
    return True


def _store_failure(nxt: _Next) -> None:
    """The next attempt was not published after RETRY was stored: store FAILURE over that
    RETRY (with the chord and errbacks Celery runs for a failure), or it would wait for ever."""
    if not _stores_errors(nxt):
        return
    try:
        nxt.task.backend.mark_as_failure(nxt.task_id, nxt.error, request=nxt.request)
    except Exception as exc:
        log.error(
            "Task %s[%s]: could not store its FAILURE either (%s); its state says RETRY",
            nxt.task.name,
            nxt.task_id,
            exc,
        )
