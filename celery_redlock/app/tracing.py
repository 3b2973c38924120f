"""OpenTelemetry spans for locked runs: ``redlock.acquire``, ``redlock.hold``, ``redlock.enqueue``.

Built on the lock events (:mod:`celery_redlock.core.events`): one hook turns each
event into spans of the thread's current span, which in a worker's run is the task's
span (opentelemetry-instrumentation-celery makes it current in ``task_prerun``, before
the lock is taken in ``before_start``); where no span is current, none is made:

* ``redlock.acquire``: one per attempt that ended (``acquired``, ``granted`` (a rate
  limiter's slot), ``contended``, ``paused``, ``rate_limited``, ``superseded``,
  ``unavailable``), started when the attempt began (the event knows how long it waited)
  and ended at the event; a refused one names the run's ``lock_on_contended`` policy
  that then applies (``redlock.policy``, from :func:`attempt_policy`); a
  ``lock_limits`` hold it took, or the rule that refused it, is a ``redlock.rule``
  span event on it;
* ``redlock.hold``: from the acquire to the release (``released``) or the loss
  (``lost``). A loss may be seen by the renewal thread: the span was started under the
  task's span at the acquire, and ending it needs no context, so it stays there;
* ``redlock.enqueue``: a publish with ``lock_on="enqueue"``/``"enqueue+run"``
  (``queued``, or ``duplicate`` with the holder's task id); a worker that checks a
  message sent without a hold makes one for a duplicate it finds.

Nothing here imports OpenTelemetry until tracing is on, and nothing costs while it is
off. ``install(app)`` registers the hook only where the ``opentelemetry`` package is
installed (looked up, not imported); the hook then decides on the first lock event of
the process (and again in each prefork pool child, after ``worker_process_init``):
on if a tracer provider was set (``opentelemetry.trace`` imported and its global
provider not the default proxy), else it removes itself. :func:`enable_tracing` turns
it on explicitly (with a given provider, or the global one whenever it is set);
:func:`disable_tracing` turns it off. The attributes are listed in docs/tracing.md.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from celery import signals

from ..core.events import LockEvent, add_hook, remove_hook

__all__ = [
    "MAX_OPEN_HOLDS",
    "TRACER_NAME",
    "attempt_policy",
    "current_policy",
    "disable_tracing",
    "enable_tracing",
    "enable_tracing_by_default",
    "enqueue_span",
    "tracing_hook",
    "tracing_on",
]

log = logging.getLogger("celery_redlock.tracing")

#: The instrumentation scope of every span this module makes.
TRACER_NAME = "celery_redlock"
#: The most hold spans kept open at once in a process: a lock that is dropped without a
#: release or a loss leaves its span open; past this, the oldest is ended (``untracked``).
MAX_OPEN_HOLDS = 10_000

#: The event kinds that make spans.
_KINDS = frozenset(
    {
        "acquired",
        "granted",
        "contended",
        "superseded",
        "rate_limited",
        "unavailable",
        "released",
        "lost",
        "duplicate",
    }
)

#: "off" (no hook), "auto" (the hook decides on its first event), "on" (explicit),
#: "disabled" (explicit: no hook, and ``install()`` adds none).
_mode = "off"
#: The tracer while tracing is on; None while off or not decided yet.
_tracer: Any = None
_state_lock = threading.Lock()
_receiver_connected = False

#: (Redis key, fence, id of the lock's owner record) -> its open ``redlock.hold`` span.
_open: dict[tuple[str, int | None, int], Any] = {}
_open_lock = threading.Lock()
#: The ``redlock.enqueue`` span of the publish this thread makes, with its outcome
#: (``enqueue``); the contended policy of the run this thread is starting (``policy``).
_local = threading.local()
#: The outcomes of a refused attempt, after which the run's contended policy applies.
_REFUSED = frozenset({"contended", "paused", "rate_limited"})


def attempt_policy(policy: str | None) -> str | None:
    """Name *policy* (a ``lock_on_contended`` value) on this thread's refused
    ``redlock.acquire`` spans from now on (None: none); returns the one named before, to
    put back when the run's start is over. Two attribute writes: made with tracing off
    too, since spans may be switched on at the run's first event."""
    previous = getattr(_local, "policy", None)
    _local.policy = policy
    return previous


def current_policy() -> str | None:
    """The policy :func:`attempt_policy` named on this thread (None outside a run's start):
    what a refused attempt of this run leads to."""
    return getattr(_local, "policy", None)


# -- switching it on and off -------------------------------------------------------------------
def enable_tracing(tracer_provider: Any = None) -> bool:
    """Make spans for every lock event of this process from now on, with *tracer_provider*
    (default: OpenTelemetry's global one, also when it is set later). False when
    ``opentelemetry-api`` is not installed (``pip install celery-redlock[otel]``)."""
    global _mode, _tracer
    try:
        from opentelemetry import trace  # noqa: PLC0415 - optional dependency
    except ImportError:
        return False
    with _state_lock:
        _mode = "on"
        _tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
    add_hook(tracing_hook)
    return True


def disable_tracing() -> None:
    """Make no more spans in this process; hold spans still open end as ``untracked``."""
    global _mode, _tracer
    with _state_lock:
        _mode = "disabled"
        _tracer = None
    remove_hook(tracing_hook)
    with _open_lock:
        spans = list(_open.values())
        _open.clear()
    for span in spans:
        span.set_attribute("redlock.outcome", "untracked")
        span.end()


def enable_tracing_by_default() -> None:
    """What ``install()`` does: where the ``opentelemetry`` package is installed, let the
    first lock event of each process decide whether a tracer provider is set. Without the
    package nothing is registered, so nothing is looked at per event."""
    global _mode, _receiver_connected
    with _state_lock:
        if _mode != "off" or _receiver_connected:
            return  # on already, or deciding, or decided and told what to do after a fork
        if not _package_installed():
            return
        _mode = "auto"
        _receiver_connected = True
    signals.worker_process_init.connect(_decide_again, weak=False)
    add_hook(tracing_hook)


def _package_installed() -> bool:
    """True when ``opentelemetry`` can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("opentelemetry") is not None
    except (ImportError, ValueError):  # a finder that refuses it, a broken entry
        return False


def _decide_again(**_: Any) -> None:
    """``worker_process_init``: a prefork pool child decides for itself (its provider is
    often set up in a ``worker_process_init`` receiver of its own)."""
    global _mode, _tracer
    with _state_lock:
        if _mode in ("on", "disabled"):
            return
        _mode, _tracer = "auto", None
    add_hook(tracing_hook)


def tracing_on() -> bool:
    """True when this process makes spans (deciding now if it has not yet)."""
    return _tracer is not None or (_mode == "auto" and _decide())


def _decide() -> bool:
    """Auto mode, first event: on when a tracer provider was set; else the hook goes."""
    global _mode, _tracer
    with _state_lock:
        if _tracer is not None:
            return True
        if _mode != "auto":
            return False
        tracer = _configured_tracer()
        if tracer is None:
            _mode = "off"
        else:
            _tracer = tracer
    if tracer is None:
        remove_hook(tracing_hook)
        log.debug("no OpenTelemetry tracer provider set in this process: no lock spans")
        return False
    log.debug("OpenTelemetry tracer provider found: lock spans on")
    return True


def _configured_tracer() -> Any:
    """The tracer of OpenTelemetry's global provider, or None when none was set (never
    imports OpenTelemetry: a process that set a provider has imported it)."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import trace  # noqa: PLC0415 - imported already

    defaults = tuple(
        kind
        for kind in (
            getattr(trace, "ProxyTracerProvider", None),
            getattr(trace, "NoOpTracerProvider", None),
        )
        if isinstance(kind, type)
    )
    provider = trace.get_tracer_provider()
    if isinstance(provider, defaults):
        return None
    return trace.get_tracer(TRACER_NAME, tracer_provider=provider)


def _wants(kind: str) -> bool:
    """The hook's event filter: the kinds that make spans, while tracing is on."""
    if _tracer is None and not (_mode == "auto" and _decide()):
        return False
    return kind in _KINDS


# -- events to spans ---------------------------------------------------------------------------
def tracing_hook(event: LockEvent) -> None:
    """Turn one lock event into spans (see the module docstring)."""
    tracer = _tracer
    if tracer is None:
        # Undecided yet: another hook without a filter made the event without asking ours.
        if _mode != "auto" or not _decide():
            return
        tracer = _tracer
    handler = _HANDLERS.get(event.kind)
    if handler is None:
        return
    if event.kind in _ENDS or _in_trace() or getattr(_local, "enqueue", None) is not None:
        handler(tracer, event)


#: The events that end a span started earlier (they need no current span).
_ENDS = frozenset({"released", "lost"})


def _in_trace() -> bool:
    """True when this thread has a current span to make children of. Outside any (a
    beat's leader lock, a script with no span) no span is made: a root span per
    acquire would be noise."""
    from opentelemetry import trace  # noqa: PLC0415 - imported once tracing is on

    return bool(trace.get_current_span().get_span_context().is_valid)


tracing_hook.lock_event_filter = _wants  # type: ignore[attr-defined]


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


def _kind(event: LockEvent) -> str:
    if event.limit is None:
        return "rate"
    return "mutex" if event.limit == 1 else "semaphore"


def _base(event: LockEvent) -> dict[str, Any]:
    """The attributes every span of *event*'s lock has."""
    attributes: dict[str, Any] = {
        "redlock.key": event.name,
        "redlock.redis_key": event.key,
        "redlock.kind": _kind(event),
    }
    if event.limit is not None and event.limit > 1:
        attributes["redlock.limit"] = event.limit
    return attributes


def _holder(attributes: dict[str, Any], record: Mapping[str, Any]) -> None:
    """The other owner (the one in the way) as ``redlock.holder.*`` attributes."""
    for field, name in (
        ("task_id", "redlock.holder.task_id"),
        ("task_name", "redlock.holder.task_name"),
        ("worker", "redlock.holder.worker"),
        ("hostname", "redlock.holder.hostname"),
        ("pid", "redlock.holder.pid"),
    ):
        value = record.get(field)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            attributes[name] = value


def _acquire_span(
    tracer: Any, event: LockEvent, outcome: str, error: str = "", **extra: Any
) -> None:
    """A ``redlock.acquire`` span from the attempt's start to *event* (failed with
    *error* when given), ended."""
    end = _ns(event.at)
    waited = event.waited or 0.0
    attributes = _base(event)
    attributes["redlock.outcome"] = outcome
    attributes["redlock.wait_ms"] = round(waited * 1000, 3)
    if event.fence is not None and outcome == "acquired":
        attributes["redlock.fence"] = event.fence
    if event.refused_by:
        attributes["redlock.refused_by"] = event.refused_by
        attributes["redlock.refusal"] = event.refusal
    if outcome in _REFUSED:
        policy = getattr(_local, "policy", None)
        if policy:
            attributes["redlock.policy"] = policy
    attributes.update(extra)
    span = tracer.start_span("redlock.acquire", start_time=end - _ns(waited), attributes=attributes)
    for rule in event.rules:
        rule_attributes: dict[str, Any] = {
            "redlock.rule.name": str(rule.get("name")),
            "redlock.rule.kind": str(rule.get("kind")),
            "redlock.rule.outcome": "held" if rule.get("kind") == "limit" else "taken",
        }
        if rule.get("kind") == "limit":
            rule_attributes["redlock.rule.limit"] = int(rule.get("limit") or 0)
        if rule.get("fence") is not None:
            rule_attributes["redlock.rule.fence"] = int(rule["fence"])
        span.add_event("redlock.rule", attributes=rule_attributes, timestamp=end)
    if event.refused_by and event.refused_by != event.name:
        span.add_event(
            "redlock.rule",
            attributes={
                "redlock.rule.name": event.refused_by,
                "redlock.rule.outcome": "refused",
                "redlock.rule.refusal": event.refusal,
            },
            timestamp=end,
        )
    if error:
        _error(span, error)
    span.end(end_time=end)


def _on_acquired(tracer: Any, event: LockEvent) -> None:
    _acquire_span(tracer, event, "acquired")
    attributes = _base(event)
    if event.fence is not None:
        attributes["redlock.fence"] = event.fence
    hold = tracer.start_span("redlock.hold", start_time=_ns(event.at), attributes=attributes)
    evicted = None
    with _open_lock:
        _open[(event.key, event.fence, id(event.holder))] = hold
        if len(_open) > MAX_OPEN_HOLDS:
            evicted = _open.pop(next(iter(_open)))
    if evicted is not None:
        evicted.set_attribute("redlock.outcome", "untracked")
        evicted.end()


def _on_granted(tracer: Any, event: LockEvent) -> None:
    """A rate limiter's slot: the attempt's span, and no hold (a slot is never given back)."""
    _acquire_span(tracer, event, "granted")


_REFUSALS = {"paused": "paused", "rate": "rate_limited"}


def _on_refused(tracer: Any, event: LockEvent) -> None:
    extra: dict[str, Any] = {}
    _holder(extra, event.holder if event.kind != "rate_limited" else {})
    if event.kind == "superseded":
        outcome = "superseded"
    elif event.kind == "rate_limited":
        outcome = "rate_limited"
    else:
        outcome = _REFUSALS.get(event.refusal, "contended")
    if event.refusal == "paused" and event.holder.get("reason"):
        extra["redlock.pause_reason"] = str(event.holder["reason"])
    if event.retry_after is not None:
        extra["redlock.retry_after_ms"] = round(event.retry_after * 1000, 3)
    _acquire_span(tracer, event, outcome, **extra)


def _on_unavailable(tracer: Any, event: LockEvent) -> None:
    error = event.error or "Redis unavailable"
    _acquire_span(tracer, event, "unavailable", error, **{"redlock.error": error})


def _on_hold_end(tracer: Any, event: LockEvent) -> None:
    with _open_lock:
        span = _open.pop((event.key, event.fence, id(event.holder)), None)
    if span is None:
        return  # acquired before tracing was on
    span.set_attribute("redlock.outcome", event.kind)
    if event.held is not None:
        span.set_attribute("redlock.held_ms", round(event.held * 1000, 3))
    if event.kind == "lost":
        span.set_attribute("redlock.lost_reason", event.error or "")
        _error(span, event.error or "lock lost")
    span.end(end_time=_ns(event.at))


def _error(span: Any, description: str) -> None:
    """Mark *span* failed (before it ends: the SDK ignores a status set after)."""
    from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415 - on with tracing

    span.set_status(Status(StatusCode.ERROR, description))


def _on_duplicate(tracer: Any, event: LockEvent) -> None:
    if not event.holder.get("task_id"):
        return  # held by no task message: the call is queued behind it
    current = getattr(_local, "enqueue", None)
    if current is not None:
        span = current[0]
        current[1] = "duplicate"
        attributes: dict[str, Any] = {"redlock.outcome": "duplicate"}
        _holder(attributes, event.holder)
        span.set_attributes(attributes)
        return
    # A worker checking a message sent without a hold: the duplicate is found there.
    attributes = {"redlock.key": event.name, "redlock.redis_key": event.key}
    attributes["redlock.outcome"] = "duplicate"
    _holder(attributes, event.holder)
    at = _ns(event.at)
    tracer.start_span("redlock.enqueue", start_time=at, attributes=attributes).end(end_time=at)


_HANDLERS = {
    "acquired": _on_acquired,
    "granted": _on_granted,
    "contended": _on_refused,
    "superseded": _on_refused,
    "rate_limited": _on_refused,
    "unavailable": _on_unavailable,
    "released": _on_hold_end,
    "lost": _on_hold_end,
    "duplicate": _on_duplicate,
}


@contextmanager
def enqueue_span(task_name: str, name: str, lock_on: str) -> Iterator[None]:
    """A ``redlock.enqueue`` span around one publish of a ``lock_on="enqueue*"`` task.

    Not made current: Celery's own publish span stays where it would be. Its outcome is
    ``duplicate`` when the claim met a queued or running message of the same name (the
    ``duplicate`` event of this thread says so), else ``queued``.
    """
    tracer = _tracer
    if tracer is None or not _in_trace():
        yield
        return
    span = tracer.start_span(
        "redlock.enqueue",
        attributes={"redlock.key": name, "redlock.task": task_name, "redlock.lock_on": lock_on},
    )
    outer = getattr(_local, "enqueue", None)
    current = [span, ""]
    _local.enqueue = current
    try:
        yield
    except BaseException as exc:
        span.record_exception(exc)
        if current[1] != "duplicate":  # AlreadyQueued is how "raise" reports a duplicate
            _error(span, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        _local.enqueue = outer
        if not current[1]:
            span.set_attribute("redlock.outcome", "queued")
        span.end(end_time=time.time_ns())
