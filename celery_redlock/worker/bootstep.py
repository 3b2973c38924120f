"""The worker side: the bootstep and its flags, start-up checks, signal receivers, and the
release of a run whose child process is gone.

Everything here runs in a worker: :class:`RedlockStep` applies the worker flags
(``--redlock-url``, ``--redlock-ttl``, ``--redlock-lock-on``, ``--redlock-disable``, made
from the rows by :mod:`celery_redlock.app.flags`), checks the settings and every locked
task's options at start-up (a bad one stops the worker with one line), refuses
``memory://`` under a prefork pool, pings the lock Redis, and releases everything held
at warm shutdown. The receivers release in the worker's main process what a run can no
longer release itself (a hard time limit, a lost child, ``revoke(terminate=True)``) and
give back the queued hold of a message that never runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from celery import bootsteps, signals
from celery.exceptions import TimeLimitExceeded, WorkerLostError

from ..app.config import StartupConfigError, capabilities_needed
from ..app.flags import flag_overrides
from ..app.observability import drop_unscrapable_metrics
from ..app.state import AppState, state_for
from ..core import process, renewal
from ..core.backend import Probe, QueuedHolds, given, has, lacks
from ..core.backend_types import Health
from ..core.connect import mask_url
from ..core.errors import ConfigError
from ..core.queued import QueuedHold
from ..task.dedup import HOLD_HEADER, dequeue, hold_for
from ..task.flow import hold_rules
from ..task.locked_task import LockedTask, apply_redlock_tasks
from ..task.naming import KEY_HEADER, lock_name_for
from ..task.run import log_release_failed
from .child_watch import alive
from .pools import pool_of

__all__ = [
    "RedlockStep",
    "StartupConfigError",
    "check_locked_tasks",
    "connect_receivers",
    "gone_child_handled",
    "installed_state",
    "key_headers",
    "release_all_held",
    "release_for_gone_child",
    "report_lock_health",
    "warn_pool_limits",
    "warn_statedb_scheduler",
    "watch_app",
]

log = logging.getLogger("celery_redlock")
log_release = logging.getLogger("celery_redlock.release")

#: The installed apps' states: a pool child going away releases what each still holds.
_states: weakref.WeakSet[AppState] = weakref.WeakSet()
_receivers_connected = False
_receivers_lock = threading.Lock()
#: Task ids whose gone child a LockedRequest is handling now (in the main thread): the
#: task_failure receiver leaves them to it (see gone_child_handled).
_handling: set[str] = set()
#: The pid of this worker's main process (set by its bootstep, before the pool is made);
#: a forked pool child inherits it and has another pid.
_worker_pid: int | None = None


def watch_app(state: AppState) -> None:
    """Count *state*'s app among those whose held locks a going child releases."""
    _states.add(state)


# -- the bootstep ----------------------------------------------------------------------------
class RedlockStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Applies worker flags, checks settings at start-up, releases on warm shutdown.

    It finds its app's state once and hands it to what needs it: the start-up checks,
    the release at shutdown, and the receivers that give back the queued hold of a
    message that never runs (:meth:`on_revoked`, :meth:`on_rejected`), which may name a
    task this worker does not know, so no task can hand them the state.
    """

    label = "celery-redlock"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        """*kwargs*: the worker's options, the flags among them by setting name."""
        super().__init__(parent, **kwargs)
        global _worker_pid
        _worker_pid = os.getpid()
        app = parent.app
        self.state = state = state_for(app)
        # Held weakly: they go with this step (an in-process test worker's too).
        signals.task_revoked.connect(self.on_revoked)
        signals.task_rejected.connect(self.on_rejected)
        signals.task_unknown.connect(self.on_rejected)
        state.overrides.update(flag_overrides(kwargs))
        state.send_events = bool(getattr(parent, "task_events", False))
        state.pool = pool_of(getattr(parent, "pool_cls", None))
        state.reset()
        try:
            apply_redlock_tasks(app)
            if not state.disabled:
                settings = state.settings  # check now: a bad setting stops the worker here
                if state.pool.children:
                    settings.check_single_process(
                        "this worker's prefork pool runs tasks in child processes"
                    )
                state.clients()  # and a URL no client can be made of (nothing connects yet)
                check_locked_tasks(app, state)  # and a task's options against them
        except ConfigError as exc:
            raise StartupConfigError(str(exc)) from None

    def start(self, parent: Any) -> None:
        state = self.state
        if state.disabled:
            log.warning(
                "celery-redlock is DISABLED on this worker (--redlock-disable or "
                "redlock_disable=True): locked tasks run WITHOUT locks and may overlap"
            )
            return
        log.info("celery-redlock: %s", state.settings.describe())
        warn_pool_limits(parent.app, state)
        if state.settings.in_process:
            return  # memory://: nothing to reach
        probe = given(state.backend(), Probe)
        if probe is None:
            return
        url = state.settings.urls
        urls = url if isinstance(url, list) else [url]
        found = probe.check()  # one per URL: a quorum's members are in the URLs' order
        wheres = [mask_url(u) for u in urls] if len(urls) == len(found) else []
        for where, health in zip(wheres or [h.where for h in found], found, strict=True):
            report_lock_health(where, health)

    def stop(self, parent: Any) -> None:
        release_all_held(self.state)

    def shutdown(self, parent: Any) -> None:
        renewal.shutdown(timeout=2.0)

    def on_revoked(
        self,
        sender: Any = None,
        request: Any = None,
        terminated: bool = False,
        expired: bool = False,
        **_: Any,
    ) -> None:
        """In the worker's main process: a message of this app discarded before it ran
        (revoked, or past its ``expires``) frees its hold. (A terminated run's lock is
        released by ``_on_revoked``.)"""
        if request is None or terminated or getattr(sender, "app", None) is not self.state.app:
            return
        hold = _hold_of(request)
        task_id = getattr(request, "id", None)
        if hold and task_id:
            why = "expired" if expired else "revoked"
            dequeue(self.state, hold, task_id, why, later=True)

    def on_rejected(self, sender: Any = None, message: Any = None, **_: Any) -> None:
        """In the worker's main process: a message of this app rejected unread (unknown
        task, bad message) frees its hold, read from its headers: this worker may not know
        the task."""
        headers = getattr(message, "headers", None)
        if not isinstance(headers, dict) or getattr(sender, "app", None) is not self.state.app:
            return
        hold, task_id = headers.get(HOLD_HEADER), headers.get("id")
        if isinstance(hold, str) and hold and isinstance(task_id, str):
            dequeue(self.state, hold, task_id, "rejected", later=True)


def warn_statedb_scheduler(options: Any = None, **_: Any) -> None:
    """``celeryd_init`` (any worker, whether its app uses locked tasks or not): with
    ``celery worker -B -S celery_redlock.beat:LeaderScheduler``, ``-S`` is ``--statedb`` (a
    file), so the embedded beat runs a plain scheduler, which publishes on every such
    worker. Say so, and which flag was meant."""
    statedb = options.get("statedb") if isinstance(options, dict) else None
    if isinstance(statedb, str) and ("LeaderScheduler" in statedb or "celery_redlock" in statedb):
        log.warning(
            "celery-redlock: this worker's -S/--statedb is %r, but for `celery worker` -S "
            "names the state database file, not beat's scheduler: the embedded beat (-B) "
            "does not lead and every such worker publishes the schedule. Pass --scheduler "
            "celery_redlock.beat:LeaderScheduler (or set app.conf.beat_scheduler) instead",
            statedb,
        )


def warn_pool_limits(app: Any, state: AppState) -> None:
    """Say once, at start-up, what this worker's pool cannot do for a locked run (one
    INFO line; see :mod:`celery_redlock.worker.pools`), and warn of tasks whose
    ``lock_on_contended="wait"`` would block a solo worker whole."""
    pool = state.pool
    if pool is None:
        return
    line = pool.limits()
    if line is not None:
        log.info("%s", line)
    if not pool.solo:
        return
    waiting = []
    for name, task in sorted(app.tasks.items()):
        if not (isinstance(task, LockedTask) and type(task).redlock_spec is not None):
            continue
        with contextlib.suppress(ConfigError):  # check_locked_tasks said so already
            if state.options_for(task).contended.name == "wait":
                waiting.append(repr(name))
    if waiting:
        who = f"task {waiting[0]} has" if len(waiting) == 1 else f"tasks {', '.join(waiting)} have"
        log.warning(
            "celery-redlock: %s lock_on_contended='wait', but this worker's pool is solo: "
            "a run waiting for its key blocks the whole worker (no other task starts) for up "
            "to lock_wait_timeout; use lock_on_contended='retry' (re-queued with backoff) or "
            "a pool that runs several tasks at once (-P threads, prefork or gevent)",
            who,
        )


def check_locked_tasks(app: Any, state: AppState) -> None:
    """Resolve every locked task's options against the settings now, so a bad combination
    (``lock_limit=None`` without a rate) or an option the lock store cannot keep (a limit
    above one, a rate or enqueue-time holds on Redlock masters: see
    :func:`~celery_redlock.app.config.capabilities_needed`) stops the worker at start-up with one
    ConfigError naming every such task (by name) and its option, never deep in a run."""
    backend = state.backend()
    problems: list[str] = []
    for name, task in sorted(app.tasks.items()):
        if not (isinstance(task, LockedTask) and type(task).redlock_spec is not None):
            continue
        try:
            options = state.options_for(task)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        for option, capability in capabilities_needed(options):
            if not has(backend, capability):
                problems.append(f"task {name!r}: {option}: {lacks(backend, capability)}")
    if problems:
        raise ConfigError("; ".join(problems))


def report_lock_health(where: str, health: Health) -> None:
    """Say clearly (naming *where*, a masked URL) what the start-up probe of one lock
    Redis found wrong (:meth:`~celery_redlock.core.backend.Probe.check`). Never raises:
    tasks whose lock cannot be taken are retried, never run unlocked.

    A refused password and a replica are configuration errors (ERROR); a server still
    loading its data set is transient (WARNING); anything else is "unreachable" (ERROR),
    with a hint when the URL asks for TLS, since a TLS client talking to a plain server
    sees only a connect timeout.
    """
    if health.state == "credentials":
        log.error(
            "celery-redlock: lock Redis %s refused the credentials (%s): check the user "
            "name and password in redlock_url; locked tasks will be retried until it "
            "accepts them",
            where,
            health.detail,
        )
    elif health.state == "loading":
        log.warning(
            "celery-redlock: lock Redis %s is loading its data set (%s); locked tasks "
            "will be retried until it is ready",
            where,
            health.detail,
        )
    elif health.state == "unreachable":
        tls = " (the URL asks for TLS: does that server accept TLS?)"
        log.error(
            "celery-redlock: lock Redis %s is unreachable (%s)%s; locked tasks will be "
            "retried until it answers",
            where,
            health.detail,
            tls if where.lower().startswith("rediss://") else "",
        )
    elif health.state == "replica":
        log.error(
            "celery-redlock: lock Redis %s is a read-only replica: no lock can be taken "
            "there; point redlock_url at its master. Locked tasks will be retried",
            where,
        )


# -- signal receivers ----------------------------------------------------------------------------
def connect_receivers() -> None:
    """Connect the worker's signal receivers (once per process)."""
    global _receivers_connected
    with _receivers_lock:
        if _receivers_connected:
            return
        signals.task_failure.connect(_on_failure, weak=False)
        signals.task_revoked.connect(_on_revoked, weak=False)
        signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
        signals.worker_process_init.connect(_on_process_init, weak=False)
        _receivers_connected = True


def installed_state(task: Any) -> AppState | None:
    """*task*'s app's state, if *task* is a LockedTask of an installed app."""
    if not isinstance(task, LockedTask):
        return None
    state = task.redlock_state
    return state if state.installed else None


def _on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    """In the worker's main process: a hard time limit or a lost child frees the lock now."""
    if not isinstance(exception, (TimeLimitExceeded, WorkerLostError)):
        return
    state = installed_state(sender)
    if state is None or task_id is None or task_id in state.held or task_id in _handling:
        return
    headers = getattr(getattr(sender, "request", None), "headers", None)
    release_for_gone_child(sender, task_id, args, kwargs, headers, why=type(exception).__name__)


@contextlib.contextmanager
def gone_child_handled(task_id: str) -> Iterator[None]:
    """While a LockedRequest (:mod:`celery_redlock.worker.request`) hands Celery a lost child's
    failure of *task_id*: the task_failure receiver leaves it to that request."""
    _handling.add(task_id)
    try:
        yield
    finally:
        _handling.discard(task_id)


def key_headers(request: Any) -> dict[str, Any]:
    """The message headers a lock name may come from (a key given at publish)."""
    raw = getattr(request, "request_dict", None) or {}
    return {KEY_HEADER: raw[KEY_HEADER]} if KEY_HEADER in raw else {}


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    """In the worker's main process: ``revoke(terminate=True)`` frees the lock now (a
    message discarded before it ran frees its hold: ``RedlockStep.on_revoked``)."""
    if request is None or not terminated:
        return
    state = installed_state(sender)
    task_id = getattr(request, "id", None)
    if state is None or task_id is None or task_id in state.held:
        return
    release_for_gone_child(
        sender,
        task_id,
        request.args,
        request.kwargs,
        key_headers(request),
        why="revoked (terminated)",
    )


def _hold_of(request: Any) -> str | None:
    """The lock name whose enqueue-time hold a request's message took (its header)."""
    headers = getattr(request, "headers", None)
    value = headers.get(HOLD_HEADER) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, HOLD_HEADER, None)
    return value if isinstance(value, str) and value else None


def _on_process_init(**_: Any) -> None:
    """A new prefork pool child: no metrics that nothing can scrape (see observability).
    The solo pool sends this signal in the worker's own process, whose metrics its
    exporter does scrape: they stay on there."""
    if os.getpid() == _worker_pid:
        return
    drop_unscrapable_metrics()


def _on_process_shutdown(**_: Any) -> None:
    """A pool child going away releases what it still holds and stops its renewal thread."""
    for state in list(_states):
        release_all_held(state)
    renewal.shutdown(timeout=1.0)


# -- releases from outside a run ------------------------------------------------------------
def release_all_held(state: AppState) -> None:
    """Release every lock this process holds for *state*'s app (warm shutdown), each by
    its run's one release (which logs a release that fails)."""
    for task_id, run in list(state.held.items()):
        lock = run.lock
        if lock is not None and run.release():
            log_release.info("released %r held by task %s at shutdown", lock.name, task_id)


def release_for_gone_child(
    task: Any,
    task_id: str,
    args: Any,
    kwargs: Any,
    headers: Any,
    *,
    why: str,
    comes_back: bool = False,
    early: bool = False,
) -> None:
    """In the worker's main process: release the acquisition of *task_id*, whose child
    process is gone or going (in a short thread).

    Timeline that makes the wait necessary: billiard calls the hard-time-limit
    callback (which fires task_failure) *before* it kills the child, and
    revoke(terminate=True) only sends the signal. Releasing at once would let
    the next run start while the old one may still be writing. So: read the
    holder record, wait (bounded by the TTL) until its pid has exited, then
    release exactly the acquisition whose record names this task id.

    *comes_back*: the message was requeued and will be delivered again. With
    ``lock_on="enqueue"`` or ``"enqueue+run"`` the key is then not freed: the run's lock
    is kept for the redelivered copy (:meth:`~.core.queued.QueuedHold.keep_for_redelivery`,
    for ``lock_enqueue_ttl`` plus the broker's visibility timeout), so the task id every
    caller was given still runs; a lock already gone leaves the queued hold to that id
    instead, unless another call holds it. Without *comes_back*, a lock kept for that
    id's copy is released (the message does not come after all).

    *early*: the main process saw the child exit before Celery said what becomes of the
    message (:mod:`celery_redlock.worker.child_watch`); *comes_back* is then its forecast, from
    the task's ``acks_late`` and ``reject_on_worker_lost``. It releases or keeps a run it
    finds and nothing else; Celery's word, when it comes, settles the rest.
    """
    try:
        state = task.redlock_state
        options = task.redlock_options
        if options.limit is None:
            return  # a rate limit alone: nothing is held while the task runs
        name = lock_name_for(task, tuple(args or ()), dict(kwargs or {}), headers, options)
        ttl = options.ttl
        lock = state.make_lock(name, ttl, limit=options.limit, auto_renew=False)
        if options.limits:  # the run's Limits are released with its lock
            hold_rules(lock, task, options, tuple(args or ()), dict(kwargs or {}))
        keep = comes_back and options.lock_on != "run" and has(state.backend(), QueuedHolds)
        hold = hold_for(state, task, name) if keep else None
        keep_for = options.enqueue_ttl + redelivery_wait(task.app) if keep else 0.0
    except Exception as exc:
        log_release.warning(
            "task %s[%s] %s: cannot find its lock (%s)", task.name, task_id, why, exc
        )
        return

    def release() -> None:
        try:
            # A semaphore has one holder per permit: find this task's.
            ours = [h for h in lock.read_holders() if h.get("task_id") == task_id]
            running = [h for h in ours if "kept_for" not in h]
            if not running:
                if early:
                    return  # the run ended, or Celery's own word on it came first
                if hold is None and ours:  # kept for a copy that does not come after all
                    if lock.release_matching(task_id=task_id, kept_for="redelivery"):
                        log_release.warning(
                            "task %s[%s] %s: released its lock %r, kept for a redelivery "
                            "that does not come",
                            task.name,
                            task_id,
                            why,
                            name,
                        )
                elif hold is not None and not ours:
                    _queue_for_redelivery(task, task_id, why, hold, keep_for)
                return
            holder = running[0]
            pid = holder.get("pid")
            if pid == process.this.pid:
                # The run is in this process (a pool without children: threads, solo,
                # gevent, eventlet): it releases its own lock as it ends.
                return
            deadline = time.monotonic() + ttl
            while isinstance(pid, int) and alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if isinstance(pid, int) and alive(pid):
                log_release.warning(
                    "task %s[%s] %s but pid %s still runs: its lock %r expires within %ss",
                    task.name,
                    task_id,
                    why,
                    pid,
                    name,
                    ttl,
                )
                return
            match = {} if pid is None else {"pid": pid}
            if hold is not None:
                if hold.keep_for_redelivery(task_id, keep_for, **match):
                    log_release.warning(
                        "task %s[%s] %s: lock %r kept for its redelivered copy (holder pid "
                        "%s is gone; kept up to %.0fs)",
                        task.name,
                        task_id,
                        why,
                        name,
                        pid,
                        keep_for,
                    )
                elif not early and not any("kept_for" in h for h in lock.read_holders()):
                    _queue_for_redelivery(task, task_id, why, hold, keep_for)
            elif lock.release_matching(task_id=task_id, **match):
                log_release.warning(
                    "task %s[%s] %s: released its lock %r at once (holder pid %s is gone)",
                    task.name,
                    task_id,
                    why,
                    name,
                    pid,
                )
        except Exception as exc:
            log_release_failed(log_release, task.name, task_id, name, exc, ttl, why)

    threading.Thread(target=release, name="celery-redlock-release", daemon=True).start()


def _queue_for_redelivery(task: Any, task_id: str, why: str, hold: QueuedHold, ttl: float) -> None:
    """The gone run's lock is not there any more (its lease ran out, or the copy took it
    already): its requeued message still gets the queued hold, unless another call has it."""
    found = hold.claim(task_id, ttl, report=False)
    if found.outcome == "queued":
        log_release.warning(
            "task %s[%s] %s: its lock %r was gone; queued hold taken for its redelivered copy",
            task.name,
            task_id,
            why,
            hold.name,
        )


def redelivery_wait(app: Any) -> float:
    """Seconds a broker may take to hand out again a message that was not acknowledged:
    ``visibility_timeout`` of ``broker_transport_options``, else the transport's own
    default (Redis and SQS: an hour), else 0 (AMQP returns it when the channel closes)."""
    options = app.conf.broker_transport_options or {}
    value: Any = options.get("visibility_timeout")
    if value is None:
        try:
            with app.connection_for_write() as conn:  # the transport's class: no network
                value = getattr(getattr(conn.transport, "Channel", None), "visibility_timeout", 0)
        except Exception:
            value = 0
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return 0.0
