"""What celery-redlock tells the outside world: log lines, Celery events, metrics.

* :func:`logging_hook` logs every :class:`~celery_redlock.core.events.LockEvent`
  as one structured line on ``celery_redlock.events`` (DEBUG for the routine
  acquire/release and for what is logged in words elsewhere: duplicates, Redis
  unavailable, which is raised, and losses and renewal failures, which the core logs
  as one WARNING line each, naming the task, on ``celery_redlock.renew`` or
  ``.release``; INFO for the rest). ``install(app)`` registers it.
* Celery events in a group of their own, ``redlock-<kind>`` for each kind of
  :data:`CELERY_EVENT_KINDS`: ``redlock-acquired``, ``redlock-contended``,
  ``redlock-released``, ``redlock-lost``, ``redlock-rate-limited`` (with
  ``retry_after``), and ``redlock-duplicate`` and ``redlock-superseded`` for
  de-duplication, are sent from the task when the worker sends task events (``-E``
  or ``worker_send_task_events``), for Flower and other event consumers; they carry
  the task's id as ``uuid``. A semaphore's permits are locks here: the same events,
  one per permit. A publisher whose app sets ``task_send_sent_event`` sends
  ``redlock-duplicate`` for each call it does not send, and ``redlock-control`` for
  each operator change (:mod:`celery_redlock.app.controls`); those have no ``uuid``.
  Not ``task-*``: Celery's ``State`` (behind ``celery events`` and Flower) makes the
  subject of every ``task-*`` event the task's state, so a running task showed
  ``LOCK-ACQUIRED``, and it reads the ``uuid`` of each one, so a publisher's event
  without one raised ``KeyError``. An event of another group it counts and leaves be.
* A skipped run (its result a skip marker, stored before ``Ignore`` ends it) gets
  Celery's own ``task-succeeded`` from the worker's request
  (:class:`~celery_redlock.task.contention.Skipped`): Celery's worker sends no event for
  an ignored run, so ``State`` and Flower would show it STARTED for ever while the
  result backend says SUCCESS.
* With ``prometheus_client`` installed, :func:`prometheus_hook` counts events by
  kind and task, and records wait and hold times in histograms, in every
  registry passed to :func:`enable_prometheus` (``install(app)`` enables the
  default one, except in prefork pool children without multiprocess mode, where
  nothing could read it: :func:`drop_unscrapable_metrics`). Lock names are not
  labels: per-argument keys would explode the cardinality.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, Literal, get_args

from ..core.events import HOLDER_IS_OTHER, LockEvent, add_hook, remove_hook
from .state import AppState

__all__ = [
    "BEAT_ROLE",
    "CELERY_EVENT_GROUP",
    "CELERY_EVENT_KINDS",
    "CeleryEventKind",
    "celery_event_type",
    "disable_prometheus",
    "enable_prometheus",
    "logging_hook",
    "prometheus_hook",
    "send_publisher_event",
    "send_task_event",
]

log = logging.getLogger("celery_redlock.events")

_LEVELS = {
    "acquired": logging.DEBUG,
    "released": logging.DEBUG,
    "granted": logging.DEBUG,  # a rate limiter's slot: as routine as an acquire
    "contended": logging.INFO,
    # the core logs each as one WARNING line, in words, naming the run's task
    "renew_failed": logging.DEBUG,
    "lost": logging.DEBUG,
    "rate_limited": logging.INFO,
    # raised to the caller as StoreUnavailable, which a run logs once, in words
    "unavailable": logging.DEBUG,
    # celery_redlock.dedup logs each of these once, in words, at INFO
    "duplicate": logging.DEBUG,
    "superseded": logging.DEBUG,
}


def logging_hook(event: LockEvent) -> None:
    """Log one line per lock event, with the fields a person needs."""
    level = _LEVELS.get(event.kind, logging.INFO)
    if event.kind == "contended" and event.owner.get("role") in _ROUTINE_WAITERS:
        level = logging.DEBUG
    if not log.isEnabledFor(level):
        return
    parts = [f"lock-{event.kind}", f"name={event.name!r}"]
    other = event.kind in HOLDER_IS_OTHER
    ours = event.owner if other else event.holder
    if ours.get("task_name"):
        parts.append(f"task={ours['task_name']}[{ours.get('task_id')}]")
    if other and event.holder:
        parts.append(f"holder={_who(event.holder)}")
    if event.fence is not None:
        parts.append(f"fence={event.fence}")
    if event.waited is not None:
        parts.append(f"waited={event.waited * 1000:.1f}ms")
    if event.held is not None:
        parts.append(f"held={event.held:.3f}s")
    if event.error:
        parts.append(f"error={event.error!r}")
    if event.retry_after is not None:
        parts.append(f"retry_after={event.retry_after:.3f}s")
    log.log(level, " ".join(parts))


#: The ``role`` in the holder record of beat's leader lock (``LeaderScheduler``).
BEAT_ROLE = "beat-leader"
#: Owners (their record's ``role``) for whom waiting is the normal state: a standby beat
#: asks for the leader lock every few seconds while another beat leads.
_ROUTINE_WAITERS = frozenset({BEAT_ROLE})


def _who(record: Mapping[str, Any]) -> str:
    """A holder in a log line: its task and id, else its host and pid."""
    if record.get("task_name"):
        return f"{record['task_name']}[{record.get('task_id')}]"
    return f"{record.get('hostname', '?')}:{record.get('pid', '?')}"


def _logging_wants(kind: str) -> bool:
    return log.isEnabledFor(_LEVELS.get(kind, logging.INFO))


# The routine acquire/release lines are DEBUG: while that level is off, those two events
# per task are not even built for this hook.
logging_hook.lock_event_filter = _logging_wants  # type: ignore[attr-defined]


#: id(registry) -> (registry, its metrics); the registry is kept so its id is never reused.
_metrics: dict[int, tuple[Any, dict[str, Any]]] = {}
_metrics_lock = threading.Lock()


def enable_prometheus(registry: Any = None) -> bool:
    """Count lock events into *registry* (default: prometheus_client's global one).

    Idempotent per registry; each registry gets its own counters and histograms,
    so a test can pass a fresh ``CollectorRegistry`` even after ``install(app)``
    enabled the default one. False when ``prometheus_client`` is not installed.
    """
    try:
        import prometheus_client as prom  # noqa: PLC0415 - optional dependency
    except ImportError:
        return False
    target = prom.REGISTRY if registry is None else registry
    with _metrics_lock:
        _auto.discard(id(target))  # asked for by name: kept in pool children too
        if id(target) in _metrics:
            return True
        _metrics[id(target)] = (
            target,
            {
                "events": prom.Counter(
                    "celery_redlock_events_total",
                    "Lock events by kind (acquired, contended, released, renew_failed, lost, "
                    "rate_limited, duplicate, superseded)",
                    ["kind", "task"],
                    registry=target,
                ),
                "wait": prom.Histogram(
                    "celery_redlock_wait_seconds",
                    "Time spent acquiring a lock (acquired or contended)",
                    ["task"],
                    registry=target,
                ),
                "hold": prom.Histogram(
                    "celery_redlock_hold_seconds",
                    "Time a lock was held (released or lost)",
                    ["task"],
                    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600),
                    registry=target,
                ),
            },
        )
        _actions.clear()
    add_hook(prometheus_hook)
    return True


def disable_prometheus(registry: Any = None) -> None:
    """Stop counting into *registry* and unregister its collectors (unknown: no-op)."""
    try:
        import prometheus_client as prom  # noqa: PLC0415 - optional dependency
    except ImportError:
        return
    target = prom.REGISTRY if registry is None else registry
    with _metrics_lock:
        entry = _metrics.pop(id(target), None)
        _auto.discard(id(target))
        _actions.clear()
        if not _metrics:
            remove_hook(prometheus_hook)  # nothing to count into: no call per event
    if entry is not None:
        for collector in entry[1].values():
            target.unregister(collector)


#: ids of registries counted into only because ``install()`` enabled them by default.
_auto: set[int] = set()


def enable_prometheus_by_default() -> None:
    """What ``install()`` does: count into the default registry, unless told otherwise.

    Not marked as asked for, so :func:`drop_unscrapable_metrics` may switch it off again
    in a prefork pool child (an explicit :func:`enable_prometheus` is never undone).
    """
    try:
        import prometheus_client as prom  # noqa: PLC0415 - optional dependency
    except ImportError:
        return
    with _metrics_lock:
        known = id(prom.REGISTRY) in _metrics
    if not known and enable_prometheus():
        with _metrics_lock:
            _auto.add(id(prom.REGISTRY))


def multiprocess_mode() -> bool:
    """True when prometheus_client's multiprocess mode is on (its directory is set)."""
    return bool(
        os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        # the older name, which prometheus_client still reads
        or os.environ.get("prometheus_multiproc_dir")  # noqa: SIM112
    )


def drop_unscrapable_metrics() -> None:
    """In a prefork pool child: stop counting into a default registry nobody can read.

    Without prometheus_client's multiprocess mode, what a pool child counts goes into
    its own private copy of the registry, which no exporter of the worker can see: a
    cost on every task for nothing. The default registry that ``install()`` enabled is
    switched off in the child then; with ``PROMETHEUS_MULTIPROC_DIR`` set, or after an
    explicit :func:`enable_prometheus` (say, in the user's own ``worker_process_init``
    receiver, next to a per-child exporter), counting goes on.
    """
    if multiprocess_mode():
        return
    try:
        import prometheus_client as prom  # noqa: PLC0415 - optional dependency
    except ImportError:
        return
    with _metrics_lock:
        auto = id(prom.REGISTRY) in _auto
    if auto:
        disable_prometheus()
        log.debug(
            "pid %d: Prometheus lock metrics off in this pool child (no "
            "PROMETHEUS_MULTIPROC_DIR: nothing could scrape them)",
            os.getpid(),
        )


def prometheus_hook(event: LockEvent) -> None:
    """Count the event and record wait/hold times in every enabled registry."""
    if not _metrics:
        return
    task = str(event.holder.get("task_name") or "")
    key = (event.kind, task)
    actions = _actions.get(key)
    if actions is None:
        actions = _actions_for(key)
    for inc, observe_wait, observe_hold in actions:
        inc()
        if event.waited is not None:
            observe_wait(event.waited)
        if event.held is not None:
            observe_hold(event.held)


#: (kind, task) -> per registry: (counter.inc, wait.observe, hold.observe) for those
#: labels; ``labels()`` costs a lock and a dict build, so each label set is resolved once.
_actions: dict[tuple[str, str], list[tuple[Any, Any, Any]]] = {}


def _actions_for(key: tuple[str, str]) -> list[tuple[Any, Any, Any]]:
    kind, task = key
    with _metrics_lock:
        actions = [
            (
                metrics["events"].labels(kind, task).inc,
                metrics["wait"].labels(task).observe,
                metrics["hold"].labels(task).observe,
            )
            for _, metrics in _metrics.values()
        ]
        _actions[key] = actions
    return actions


#: The group (the type's first word) of every Celery event celery-redlock sends. Not
#: ``task``: Celery's ``State`` takes a ``task-*`` event's subject for the task's state.
CELERY_EVENT_GROUP = "redlock"

#: A kind of Celery event celery-redlock sends; its type is ``redlock-<kind>``.
CeleryEventKind = Literal[
    "acquired",
    "contended",
    "released",
    "lost",
    "rate-limited",
    "duplicate",
    "superseded",
    "control",
]
#: Every kind of Celery event celery-redlock sends, in the order docs/observability.md
#: lists them.
CELERY_EVENT_KINDS: tuple[CeleryEventKind, ...] = get_args(CeleryEventKind)


def celery_event_type(kind: CeleryEventKind) -> str:
    """The Celery event type of *kind*: ``redlock-<kind>``."""
    return f"{CELERY_EVENT_GROUP}-{kind}"


def send_task_event(state: AppState, task: Any, kind: CeleryEventKind, /, **fields: Any) -> None:
    """Send ``redlock-<kind>`` from a running task (with its id as ``uuid``) when this
    worker sends task events (*state*: the task's app's)."""
    if not state.send_events:
        return
    try:
        task.send_event(celery_event_type(kind), retry=False, **fields)
    except Exception as exc:  # monitoring must never break a task
        log.debug("could not send %s: %s", celery_event_type(kind), exc)


def send_publisher_event(app: Any, kind: CeleryEventKind, **fields: Any) -> None:
    """Send ``redlock-<kind>`` from a publishing process, when its app sends task events
    (``task_send_sent_event``); never raises."""
    if not app.conf.get("task_send_sent_event"):
        return
    try:
        with app.events.default_dispatcher() as dispatcher:
            dispatcher.send(celery_event_type(kind), **fields)
    except Exception as exc:  # monitoring must never break a publish
        log.debug("could not send %s: %s", celery_event_type(kind), exc)
