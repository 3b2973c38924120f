"""The lock events of task runs, written to a capped log per key prefix that the board
reads (:class:`~celery_redlock.core.backend.EventLog`): the board needs no event receiver.

``install(app)`` registers the app (:func:`record`) and the one process-wide hook
(:func:`recorder_hook`). The hook only appends the event to a bounded queue; a
background thread (``celery-redlock-events``, started on the first event after start or
fork, gone after :data:`IDLE` seconds without events) writes each app's events in one
round trip every :data:`FLUSH_EVERY` seconds. A run pays no round trip for its events.

``redlock_event_log = False`` turns it off for an app; when no app records, the hook
takes no event and none is built. A log write that fails is logged at DEBUG and dropped:
the events are for people, never for the locks.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

from ..core.backend import EventLog, given
from ..core.events import HOLDER_IS_OTHER, LockEvent, add_hook
from ..core.process import on_fork
from .tracing import current_policy

__all__ = [
    "FLUSH_EVERY",
    "KINDS",
    "MAXLEN",
    "event_json",
    "log_forced",
    "log_key",
    "record",
    "recorder_hook",
]

log = logging.getLogger("celery_redlock.board")

#: The events recorded: a run's lock taken, refused, given back or lost.
KINDS = frozenset(
    {
        "acquired",
        "contended",
        "released",
        "lost",
        "rate_limited",
        "granted",
        "duplicate",
        "superseded",
        "unavailable",
        "backed_off",
    }
)
#: The refusals whose event names the policy the run then applies.
_REFUSED = frozenset({"contended", "rate_limited"})
#: About how many events each log keeps (``XADD ... MAXLEN ~``).
MAXLEN = 10_000
#: A log nobody writes to goes after this long (ms): a week.
LOG_TTL_MS = 7 * 24 * 3600 * 1000
#: Seconds between two writes of the queued events.
FLUSH_EVERY = 0.25
#: Seconds without events after which the writing thread ends.
IDLE = 5.0
#: Events kept in this process while the log cannot be written (the oldest dropped).
_BACKLOG = 10_000


#: One encoder for every event (``json.dumps`` with an option builds one per call).
_encode = json.JSONEncoder(default=str).encode


def log_key(prefix: str) -> str:
    """The key of the event log of the locks under *prefix* (outside every lock's braces,
    so ``celery locks`` never takes it for a lock)."""
    return f"{prefix}events"


def log_forced(
    store: Any, prefix: str, name: str, fence: int | None, record: Any, *, by: str
) -> None:
    """Write a ``forced`` event (an operator's release of the acquisition with *fence*,
    whose holder *record* it was) to the log under *prefix*, at once: the board's timeline
    then draws that run as force-released. *by* says who (``operator 'ops' through the
    board``). A log that cannot be written is logged at DEBUG: the release is done anyway."""
    log_ = given(store, EventLog)
    if log_ is None:
        return
    record = record if isinstance(record, dict) else {}
    info = record.get("owner_info")
    owner: dict[str, Any] = info if isinstance(info, dict) else {}
    event = {
        "kind": "forced",
        "name": name,
        "at": time.time(),
        "fence": fence,
        "task_name": record.get("task_name", owner.get("task_name")),
        "task_id": record.get("task_id", owner.get("task_id")),
        "hostname": record.get("hostname"),
        "pid": record.get("pid"),
        "error": f"released by {by}",
    }
    try:
        log_.log_events(log_key(prefix), [_encode(event)], MAXLEN, LOG_TTL_MS)
    except Exception as exc:  # the events are for people, never for the locks
        log.debug("celery-redlock: the forced release of %r was not logged: %s", name, exc)


def event_json(event: LockEvent, policy: str | None = None) -> str:
    """*event* as the log stores it: the run's task and the other holder, when there is one;
    for a refusal, the *policy* that then applies (``lock_on_contended``: the board tells a
    skipped run from one re-queued or waiting by it)."""
    other = event.kind in ("contended", "duplicate", "superseded")
    ours = event.owner if other else event.holder
    out: dict[str, Any] = {
        "kind": event.kind,
        "name": event.name,
        "at": event.at,
        "fence": event.fence,
        "task_name": ours.get("task_name"),
        "task_id": ours.get("task_id"),
        "hostname": ours.get("hostname"),
        "pid": ours.get("pid"),
    }
    for field in ("waited", "held", "retry_after", "error"):
        value = getattr(event, field)
        if value is not None:
            out[field] = value
    if other and event.holder:
        out["holder"] = {
            k: event.holder.get(k) for k in ("task_name", "task_id", "hostname", "pid")
        }
    if policy:
        out["policy"] = policy
    return _encode(out)


class _Recorder:
    """The queue of events and the thread that writes them (one per process)."""

    def __init__(self) -> None:
        #: The states of the apps that record (weakly: an app that goes stops recording);
        #: a forked child keeps them.
        self.apps: list[weakref.ref[Any]] = []
        #: False once no registered app records: the hook then takes no event.
        self.enabled = True
        self._reset()
        on_fork(self._reset)

    def _reset(self) -> None:
        """A new lock, an empty queue and no thread (in a forked child: the parent's
        thread is not there, and its queue was the parent's to write)."""
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        #: Each event with the policy its run applies on a refusal (read where it was sent).
        self.queue: collections.deque[tuple[LockEvent, str | None]] = collections.deque(
            maxlen=_BACKLOG
        )
        self.thread: threading.Thread | None = None

    def add(self, state: Any) -> None:
        with self.lock:
            if not any(ref() is state for ref in self.apps):
                self.apps.append(weakref.ref(state))
            self.enabled = True

    def put(self, event: LockEvent, policy: str | None = None) -> None:
        with self.lock:
            self.queue.append((event, policy))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="celery-redlock-events", daemon=True
                )
                self.thread.start()

    def _run(self) -> None:
        idle = 0.0
        while True:
            with self.lock:
                self.wake.wait(FLUSH_EVERY)  # gathers a batch; notified by nothing
                if not self.queue:
                    idle += FLUSH_EVERY
                    if idle >= IDLE:
                        self.thread = None
                        return
                    continue
                events = list(self.queue)
                self.queue.clear()
            idle = 0.0
            try:
                self.write(events)
            except Exception:  # the loop never dies of one batch
                log.exception("celery-redlock: writing lock events failed")

    def write(self, events: Iterable[tuple[LockEvent, str | None]]) -> None:
        """Write *events* to the log of each recording app whose prefix they are under."""
        events = list(events)
        recording = 0
        #: (store, prefix) already written: apps of one process sharing a store and a
        #: prefix (tests, several apps of one project) write each event once.
        written: set[tuple[Any, str]] = set()
        for ref in list(self.apps):
            state = ref()
            if state is None:
                continue
            try:
                settings = state.settings
            except Exception:  # noqa: S112 - a bad setting is reported where the app runs tasks
                continue
            if not settings.event_log:
                continue
            recording += 1
            start = settings.key_prefix + "{"
            mine = [event_json(e, p) for e, p in events if e.key.startswith(start)]
            if not mine:
                continue
            try:
                store = given(state.backend(), EventLog)
            except Exception as exc:  # this app's store cannot be opened: the others still write
                log.debug("celery-redlock: lock events not recorded: %s", exc)
                continue
            if store is None:
                continue
            where = (_identity(store), settings.key_prefix)
            if where in written:
                continue
            written.add(where)
            try:
                store.log_events(log_key(settings.key_prefix), mine, MAXLEN, LOG_TTL_MS)
            except Exception as exc:  # unavailable, or foreign data at the log's key
                log.debug("celery-redlock: lock events not recorded: %s", exc)
        if not recording:
            self.enabled = False


def _identity(store: Any) -> Any:
    """What tells two stores apart: the server (or servers) they keep their keys on."""
    identity = getattr(store, "identity", None)
    if callable(identity):
        try:
            return identity()
        except Exception:
            return id(store)
    members = getattr(store, "members", None)
    if isinstance(members, tuple):
        return tuple(_identity(m) for m in members)
    return id(store)


_recorder = _Recorder()


def recorder_hook(event: LockEvent) -> None:
    """Queue a task run's lock *event* for its app's event log: one whose run's own record
    names its task (the owner's for an event whose holder is the other one)."""
    kind = event.kind
    if kind not in KINDS:
        return
    refused = kind in _REFUSED
    ours = event.owner if kind in HOLDER_IS_OTHER else event.holder
    if ours.get("task_name"):
        _recorder.put(event, current_policy() if refused else None)


def _wants(kind: str) -> bool:
    return _recorder.enabled and kind in KINDS


recorder_hook.lock_event_filter = _wants  # type: ignore[attr-defined]


def record(state: Any) -> None:
    """Record the task runs' lock events of the app whose state (an ``AppState``) is
    *state*, unless its ``redlock_event_log`` is off."""
    _recorder.add(state)
    add_hook(recorder_hook)


def flush() -> None:
    """Write the queued events now (for tests and tools)."""
    with _recorder.lock:
        events = list(_recorder.queue)
        _recorder.queue.clear()
    _recorder.write(events)
