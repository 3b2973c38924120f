"""De-duplication from enqueue: ``lock_on="enqueue"`` and ``lock_on="enqueue+run"``.

A publish of such a task first takes the enqueue-time hold of its lock name for the
message's task id (:class:`~celery_redlock.core.queued.QueuedHold`); a call that finds
the name held is a duplicate, and ``lock_on_duplicate`` decides what it gets:

========== ===============================================================================
return     the queued (or running) task's ``AsyncResult``; nothing is sent
raise      :class:`~celery_redlock.core.errors.AlreadyQueued` (its task id, time left)
replace    the newest call takes the queued message's place; that message, when it
           arrives, is skipped visibly (``lock_debounce``: each call is sent with that
           countdown, so a burst runs once, with the last arguments)
queue_one  while one runs, at most one more is queued; later calls return that one
========== ===============================================================================

Where the publish happens:

* ``LockedTask.apply_async`` (``delay``, signatures, canvas members, ``self.retry()``
  and beat when the task is registered in its process) calls :func:`publish`;
* ``app.send_task`` by name is wrapped by ``install(app)``: a name this process knows
  as a LockedTask goes through :func:`publish` too;
* a message published where the task class is unknown (a process that only knows the
  name) carries no hold: its worker takes the hold before the body runs
  (:func:`claim_at_worker`) and skips the message visibly if it is a duplicate.

Canvas members are never dropped at publish, whatever ``lock_on_duplicate`` says: a
caller holds a result of the member's own task id (Celery freezes each member before it
sends it, so the call carries a task id its caller chose; a link callback carries its
``parent_id``: :func:`in_canvas`). A duplicate member that feeds others (a chain step
with steps after it, a call with callbacks: :func:`feeds_others`) is sent and runs
(``NO_DEDUP_HEADER``); any other (a chain's last step, a group or chord member, a link
target) is sent without a hold (``CANVAS_HEADER``), and its worker, finding it still a
duplicate, skips it visibly (SUCCESS with the skip marker), never ``AlreadyQueued``. A
plain ``delay()``, in a task body or not, carries neither and is de-duplicated.

On the worker, the message's lock is acquired with a hand-over
(``RunLock(handover=Handover(task_id))``): the hold becomes the lock in one owner-checked
script, and a message whose hold another call has taken (replaced, or its own hold
expired and was taken) is skipped as superseded. Retries (``self.retry()``,
contention retries) re-publish under the same task id and keep their place.

Every duplicate is one log line on ``celery_redlock.dedup`` naming the holder's task
id, a ``LockEvent`` (``duplicate``; ``superseded`` for a skipped message: counted by
the Prometheus hook), and a Celery event (``redlock-duplicate`` /
``redlock-superseded``) when events are on (``-E`` on a worker,
``task_send_sent_event`` on a publisher).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, NoReturn

from ..app import tracing
from ..app.config import TaskOptions
from ..app.observability import send_publisher_event, send_task_event
from ..app.state import AppState
from ..core import ConfigError, Queued, QueuedHold, StoreUnavailable
from ..core.queued import PendingClaim
from . import claiming
from .contention import RETRIES_HEADER, Duplicate, answer_with_holder, skip_message
from .naming import lock_name_for

__all__ = [
    "CANVAS_HEADER",
    "HOLD_HEADER",
    "NO_DEDUP_HEADER",
    "attempt_of",
    "canvas_request",
    "claim_at_worker",
    "dequeue",
    "feeds_others",
    "hold_for",
    "in_canvas",
    "publish",
    "publish_held",
    "skip_superseded",
]

log = logging.getLogger("celery_redlock.dedup")

#: Message header naming the lock whose enqueue-time hold the message's task id holds
#: (set by the publish side; a message without it took no hold).
HOLD_HEADER = "redlock_hold"
#: Message header of a call sent although its key was held, on purpose (a chain step): its
#: worker neither checks it for duplicates nor refuses it as superseded.
NO_DEDUP_HEADER = "redlock_no_dedup"
#: Message header of a canvas member (or a call under a task id its caller chose) sent
#: although its key was held: its worker checks it again and, still a duplicate, skips it
#: visibly whatever ``lock_on_duplicate`` says, so the result awaited under its id exists.
CANVAS_HEADER = "redlock_canvas"
#: How long the hold of a message with ``expires=`` outlives that moment: a worker that
#: receives it later discards it (and frees the hold at once); none may ever receive it.
EXPIRED_GRACE = 5.0


def attempt_of(request: Any) -> tuple[int, int]:
    """Which attempt of its task id a request is: (``self.retry()`` count, contention
    retry count). A redelivered copy of a message has the same attempt as the original."""
    headers = getattr(request, "headers", None)
    lock_retries = headers.get(RETRIES_HEADER) if isinstance(headers, dict) else None
    if lock_retries is None:
        lock_retries = getattr(request, RETRIES_HEADER, 0)
    return int(getattr(request, "retries", 0) or 0), int(lock_retries or 0)


def hold_for(state: AppState, task: Any, name: str) -> QueuedHold:
    """The enqueue-time hold of lock *name* for *task*'s messages (its record names the
    task)."""
    return QueuedHold(
        state.backend(),
        name,
        key_prefix=state.settings.key_prefix,
        owner_info={"task_name": task.name},
    )


# -- the publish side ------------------------------------------------------------------------
def feeds_others(call: dict[str, Any]) -> bool:
    """True for a call whose outcome other tasks are sent from: a chain step with steps
    after it (``chain``), a call with callbacks (``link``, ``link_error``)."""
    return any(call.get(k) for k in ("chain", "link", "link_error"))


def in_canvas(call: dict[str, Any], *, chosen: bool) -> bool:
    """True for a call whose result something awaits under the call's own task id: a task
    id its caller chose (*chosen*: ``task_id=``, a frozen signature, as Celery sends every
    chain step, group and chord member and chord body), a link target (Celery applies
    callbacks with ``parent_id`` given; a call from a task body gets its parent later, in
    ``send_task``), a group or chord member. Not a plain ``delay()``, in a task body or
    not."""
    return chosen or any(call.get(k) for k in ("parent_id", "chord", "group_id"))


def publish_held(  # noqa: PLR0917 - the publish's state, task, name, options and call
    state: AppState,
    task: Any,
    name: str,
    options: TaskOptions,
    args: Any,
    kwargs: Any,
    *,
    call: dict[str, Any],
    send: Callable[..., Any],
) -> Any:
    """Publish one call of *task* whose lock is *name* through *send* (``send(args,
    kwargs, **call)``), unless it is a duplicate; returns what ``apply_async`` returns."""
    from celery.utils import uuid  # noqa: PLC0415 - kept out of the import-time path

    # A task id the caller chose (``task_id=``, or a frozen signature: Celery freezes every
    # canvas member before it sends it) is one the caller already holds a result of.
    chosen = bool(call.get("task_id"))
    task_id = call.get("task_id") or uuid()
    call["task_id"] = task_id
    # A re-publish of the request this process runs (self.retry(), a contention retry)
    # keeps its place under the same task id, whatever else is queued.
    republish = task_id == _running_id(task)
    if options.debounce and not republish and call.get("eta") is None:
        call["countdown"] = max(float(call.get("countdown") or 0), options.debounce)
    ttl = _hold_ttl(options.enqueue_ttl, call)
    hold = hold_for(state, task, name)
    feeds = feeds_others(call)
    member = not republish and (feeds or in_canvas(call, chosen=chosen))
    if not (republish or member) and claiming.hook(task.app):
        publish = functools.partial(send, args, kwargs)
        return _publish_overlapped(state, task, name, options, hold, ttl, call, publish)
    try:
        if republish:
            found = hold.claim(task_id, ttl, report=False)
        else:
            found = options.duplicate.claim(hold, task_id, ttl, options.lock_on)
            if found.outcome == "duplicate" and not found.owner:
                # The lock is held by something that is no task message (a direct call,
                # user code): nothing to return; this call is queued behind it.
                found = hold.claim(task_id, ttl)
    except StoreUnavailable as exc:
        _sent_anyway(task, task_id, name, exc)
        return send(args, kwargs, **call)
    if found.outcome == "duplicate" and not republish:
        if feeds:
            # A step of a chain with steps after it, or a call with callbacks: what comes
            # after needs its return value, so it is sent and runs (its run is still
            # locked); it takes no hold.
            log.info(
                "%s[%s] sent although lock %r is %s by task %s: a chain step or a call "
                "with callbacks is never dropped",
                task.name,
                task_id,
                name,
                found.state,
                found.owner,
            )
            call["headers"] = {**(call.get("headers") or {}), NO_DEDUP_HEADER: True}
            return send(args, kwargs, **call)
        if not member:
            return _duplicate(task, name, options, found, task_id)
        # A canvas member (a chain's last step, a group or chord member, a link target)
        # or a call under a task id its caller chose: that id's result is awaited, so it
        # is sent without a hold, and its worker skips it visibly as a duplicate whatever
        # lock_on_duplicate says (the skipped result counts for a chord).
        log.info(
            "%s[%s] sent although lock %r is %s by task %s: a canvas member (or a call "
            "whose caller chose its task id) is never dropped; its worker skips it if it "
            "is still a duplicate",
            task.name,
            task_id,
            name,
            found.state,
            found.owner,
        )
        call["headers"] = {**(call.get("headers") or {}), CANVAS_HEADER: True}
        return send(args, kwargs, **call)
    if found.outcome != "duplicate":
        call["headers"] = {**(call.get("headers") or {}), HOLD_HEADER: name}
    try:
        result = send(args, kwargs, **call)
    except BaseException:
        if found.outcome != "duplicate":
            dequeue(state, name, task_id, "was not published")
        raise
    _log_replaced(task, task_id, name, found)
    return result


def _publish_overlapped(  # noqa: PLR0917 - publish_held's call, with its hold and lifetime
    state: AppState, task: Any, name: str, options: TaskOptions, hold: QueuedHold, ttl: float,
    call: dict[str, Any], send: Callable[..., Any]
) -> Any:  # fmt: skip
    """A plain call's publish (``send(**call)``), its claim answered while Celery builds
    the message (see :mod:`celery_redlock.task.claiming`)."""
    task_id = call["task_id"]
    try:
        pending = hold.claim_later(task_id, ttl, **options.duplicate.terms(options.lock_on))
    except StoreUnavailable as exc:
        _sent_anyway(task, task_id, name, exc)
        return send(**call)
    headers = call["headers"] = {**(call.get("headers") or {}), HOLD_HEADER: name}

    def decide(claim: PendingClaim) -> Queued | None:
        try:
            found = claim.result()
            if found.outcome == "duplicate" and not found.owner:
                found = hold.claim(task_id, ttl)  # queued behind a holder that is no task
        except StoreUnavailable as exc:
            _sent_anyway(task, task_id, name, exc)
            headers.pop(HOLD_HEADER, None)  # no hold: its worker checks
            return None
        if found.outcome == "duplicate":
            raise claiming.NotSent(found)
        return found

    with claiming.deciding(task_id, pending, decide) as deciding:
        try:
            result = send(**call)
        except claiming.NotSent as stop:
            return _duplicate(task, name, options, stop.found, task_id)
        except BaseException:
            if deciding.decided or _claim_taken(deciding):
                dequeue(state, name, task_id, "was not published")
            raise
        found = deciding.answer()  # made while the message was built (else: now)
    if found is not None:
        _log_replaced(task, task_id, name, found)
    return result


def _claim_taken(deciding: claiming.Deciding) -> bool:
    """True unless the claim's answer says it took nothing (a duplicate); an answer that
    cannot be read counts as taken (the give-back is owner-checked)."""
    try:
        deciding.answer()
    except (claiming.NotSent, StoreUnavailable, ConfigError):
        return False
    except Exception:
        return True
    return True


def _sent_anyway(task: Any, task_id: str, name: str, exc: Exception) -> None:
    log.warning(
        "%s[%s]: could not check lock %r for a queued duplicate (%s); sent anyway, "
        "its worker checks before it runs",
        task.name,
        task_id,
        name,
        exc,
    )


def _log_replaced(task: Any, task_id: str, name: str, found: Queued) -> None:
    if found.outcome == "replaced":
        log.info(
            "%s[%s] replaces task %s queued under lock %r (lock_on_duplicate='replace'): "
            "that message will be skipped",
            task.name,
            task_id,
            found.owner,
            name,
        )


def _running_id(task: Any) -> str | None:
    """The task id of the request of *task* this thread runs, if any. Read from the
    request stack: a task object that another thread is still binding (its first use
    from several threads at once) has none yet, and ``task.request`` would fail."""
    stack = getattr(task, "request_stack", None)
    top = stack.top if stack is not None else None
    return getattr(top, "id", None)


def _duplicate(task: Any, name: str, options: TaskOptions, found: Queued, task_id: str) -> Any:
    """A call not sent: log it, tell event consumers, and let the policy answer."""
    dup = Duplicate(task, name, task_id, found)
    log.info(
        "%s[%s] not sent: lock %r is held by task %s, %s%s (lock_on_duplicate=%r)",
        task.name,
        task_id,
        name,
        found.owner,
        found.state,
        "" if dup.ttl is None else f", {dup.ttl:.1f} s left on its hold",
        options.on_duplicate,
    )
    send_publisher_event(
        task.app, "duplicate", lock=name, task_name=task.name, holder=found.owner, state=found.state
    )
    return options.duplicate.answer(dup)


def _hold_ttl(enqueue_ttl: float, call: dict[str, Any]) -> float:
    """The hold's lifetime: ``lock_enqueue_ttl`` plus the message's delay (ETA or
    countdown), never past its ``expires`` (an expired message never runs)."""
    now = datetime.now(timezone.utc)
    delay = _seconds_until(call.get("eta"), now)
    if delay is None:
        delay = float(call.get("countdown") or 0)
    ttl = enqueue_ttl + max(delay, 0.0)
    expires = _seconds_until(call.get("expires"), now)
    if expires is not None:
        ttl = min(ttl, max(expires, 0.0) + EXPIRED_GRACE)
    return max(ttl, 0.001)


def _seconds_until(when: Any, now: datetime) -> float | None:
    """Seconds from *now* to *when*: a datetime, an ISO 8601 text, or a number of seconds."""
    if when is None:
        return None
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        return float(when)
    if isinstance(when, str):
        try:
            when = datetime.fromisoformat(when)
        except ValueError:
            return None
    if not isinstance(when, datetime):
        return None
    moment: datetime = when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)
    return (moment - now).total_seconds()


# -- the worker side --------------------------------------------------------------------------
def claim_at_worker(
    state: AppState, task: Any, request: Any, name: str, options: TaskOptions
) -> None:
    """A message that took no hold when it was published (sent by name where the task
    class is unknown, or a canvas member whose key was held): take it now; a duplicate
    does not run (skipped visibly, or ``AlreadyQueued`` with ``lock_on_duplicate="raise"``
    for a plain call; a canvas member is always skipped visibly, so its result exists)."""
    hold = hold_for(state, task, name)
    found = options.duplicate.claim(hold, request.id, options.enqueue_ttl, options.lock_on)
    if found.outcome != "duplicate" or not found.owner or found.owner == request.id:
        return
    member = canvas_request(request)
    log.info(
        "Task %s[%s] not started: a duplicate, lock %r is held by task %s, %s (%s; "
        "lock_on_duplicate=%r)",
        task.name,
        request.id,
        name,
        found.owner,
        found.state,
        "a canvas member, skipped whatever the policy"
        if member
        else "this message was sent without the task class, so its worker checked",
        options.on_duplicate,
    )
    send_task_event(state, task, "duplicate", lock=name, holder=found.owner, state=found.state)
    dup = Duplicate(task, name, request.id, found, request)
    if member:
        answer_with_holder(dup)
    options.duplicate.answer(dup)


def canvas_request(request: Any) -> bool:
    """True when the result of *request*'s task id is awaited by a canvas: marked so at
    publish (:data:`CANVAS_HEADER`), or a group or chord member (a process that sent it by
    name could not mark it)."""
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict) and headers.get(CANVAS_HEADER):
        return True
    if getattr(request, CANVAS_HEADER, None):
        return True
    return bool(getattr(request, "group", None) or getattr(request, "chord", None))


def skip_superseded(state: AppState, task: Any, request: Any, lock: Any) -> NoReturn:
    """The message's hold was taken by another call (``replace``, or its own hold ran out
    and another call took the name): it does not run, and its result says which call
    superseded it; raises ``Ignore``. (A redelivered copy whose run ended is dropped before
    this, by its done mark, and keeps that run's result.)"""
    owner = lock.queued_owner or lock.holder.get("task_id") or "?"
    log.info(
        "Task %s[%s] skipped: superseded by task %s, the newer call queued under lock %r",
        task.name,
        request.id,
        owner,
        lock.name,
    )
    send_task_event(state, task, "superseded", lock=lock.name, holder=owner)
    skip_message(
        task, request, lock.name, f"superseded by task {owner}", owner=owner, holder=lock.holder
    )


def dequeue(state: AppState, name: str, task_id: str, why: str, *, later: bool = False) -> None:
    """Dequeue task *task_id*'s enqueue-time hold of *name* (give it back), because its
    message will not run (*why*: skipped, failed, revoked, expired, rejected, not
    published), so the next call can be queued. Owner-checked: another task id's hold
    is never touched. Never raises: a hold not given back ends with its lease. *later*:
    in a short thread (a worker's main process never blocks its consumer on Redis)."""
    if later:
        args = (state, name, task_id, why)
        threading.Thread(
            target=dequeue, args=args, name="celery-redlock-dequeue", daemon=True
        ).start()
        return
    if not state.installed or state.disabled:
        return
    try:
        hold = QueuedHold(state.backend(), name, key_prefix=state.settings.key_prefix)
        if hold.release(task_id):
            log.info("task %s %s: released its queued hold of %r", task_id, why, name)
    except Exception as exc:
        log.warning(
            "task %s %s: could not release its queued hold of %r (%s); it expires by itself",
            task_id,
            why,
            name,
            exc,
        )


def publish(
    task: Any, args: Any, kwargs: Any, call: dict[str, Any], send: Callable[..., Any]
) -> Any:
    """Publish one call of a locked task through *send* (``send(args, kwargs, **call)``);
    with ``lock_on="enqueue"`` or ``"enqueue+run"`` after the duplicate check of
    :mod:`celery_redlock.task.dedup`."""
    state = task.redlock_state
    if state.disabled or task.app.conf.task_always_eager:
        return send(args, kwargs, **call)
    options = task.redlock_options
    if options.lock_on == "run":
        return send(args, kwargs, **call)
    name = lock_name_for(task, tuple(args or ()), dict(kwargs or {}), call.get("headers"), options)
    if not tracing.tracing_on():
        return publish_held(state, task, name, options, args, kwargs, call=call, send=send)
    with tracing.enqueue_span(task.name, name, options.lock_on):
        return publish_held(state, task, name, options, args, kwargs, call=call, send=send)
