"""Wiring into Celery: ``install(app)``, the worker bootstep and flags, signal receivers.

No explicit call is needed: defining a task with ``base=LockedTask`` or
setting ``redlock_tasks`` installs everything for that app; ``install(app)``
does it explicitly and is idempotent.

The worker flags are added to Celery's ``worker`` command when this module is
imported, not through ``app.user_options``: Celery reads ``user_options`` right
after importing the ``-A`` module, before lazily defined tasks are evaluated,
so a flag registered on first task evaluation would come too late to parse.
The flags only act through the bootstep, which exists on installed apps.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import threading
import weakref
from typing import Any

import click
from celery import bootsteps, signals
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from redis.cluster import RedisCluster
from redis.exceptions import AuthenticationError, BusyLoadingError

from . import task as task_module
from .core import renewal
from .core.connect import mask_url
from .core.errors import ConfigError, no_queued_holds
from .core.events import add_hook
from .dedup import HOLD_HEADER, release_hold_later
from .observability import drop_unscrapable_metrics, enable_prometheus_by_default, logging_hook
from .options import check_store, check_task_option
from .policies import LOCK_ON
from .runtime import KEY_HEADER, publish, release_all_held, release_for_gone_child
from .state import AppState, state_for
from .task import LockedTask

__all__ = ["RedlockStep", "apply_redlock_tasks", "install", "wrap_send_task"]

log = logging.getLogger("celery_redlock")

_states: weakref.WeakSet[AppState] = weakref.WeakSet()
_receivers_connected = False
_install_lock = threading.RLock()


def install(app: Any) -> None:
    """Install the bootstep, signal receivers and ``redlock_tasks`` for *app* (idempotent)."""
    state = state_for(app)
    with _install_lock:
        if state.installed:
            return
        state.installed = True
        _states.add(state)
        app.steps["worker"].add(RedlockStep)
        wrap_send_task(app)
        _connect_receivers()
        add_hook(logging_hook)
        enable_prometheus_by_default()
        app.on_after_finalize.connect(apply_redlock_tasks, weak=False)
        if app.finalized:
            apply_redlock_tasks(app)


# -- worker flags and bootstep ---------------------------------------------------------------
_FLAGS = [
    click.Option(
        ["--redlock-url"],
        multiple=True,
        help="Redis URL where task locks live (repeat for Redlock over independent "
        "masters); overrides app.conf.redlock_url for this worker.",
    ),
    click.Option(
        ["--redlock-ttl"],
        type=float,
        default=None,
        help="Default lock lease in seconds (kept alive while tasks run); overrides "
        "app.conf.redlock_ttl for this worker.",
    ),
    click.Option(
        ["--redlock-lock-on"],
        type=click.Choice(LOCK_ON),
        default=None,
        help="When locks are held, for tasks that do not set lock_on: run (default), "
        "enqueue or enqueue+run; overrides app.conf.redlock_lock_on for this worker "
        "(and what it publishes). Publishers must use the same setting to de-duplicate "
        "at publish; the worker checks messages that were sent without it.",
    ),
    click.Option(
        ["--redlock-disable"],
        is_flag=True,
        default=False,
        help="Run locked tasks WITHOUT locks on this worker (a loud warning is logged).",
    ),
]


def _register_flags() -> None:
    from celery.bin.worker import worker as worker_command  # noqa: PLC0415 - CLI only

    names = {p.name for p in worker_command.params}
    for flag in _FLAGS:
        if flag.name not in names:
            worker_command.params.append(flag)


_register_flags()


def _install_configured(sender: Any = None, **_: Any) -> None:
    """``worker_init``: an app that sets ``redlock_tasks`` but never imported us is installed.

    Celery loads this package through the ``celery.commands`` entry point, and
    ``worker_init`` fires before the worker builds its bootsteps, so the step
    and the flags still apply to an app configured by settings alone.
    """
    app = getattr(sender, "app", None)
    if app is not None and app.conf.get("redlock_tasks"):
        install(app)


signals.worker_init.connect(_install_configured, weak=False)


class StartupConfigError(ConfigError, click.ClickException):
    """A bad setting found at worker start: ``celery worker`` prints one line and exits 1.

    Still a :class:`ConfigError` for code that starts workers itself.
    """

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)


class RedlockStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Applies worker flags, checks settings at start-up, releases on warm shutdown."""

    label = "celery-redlock"

    def __init__(
        self,
        parent: Any,
        redlock_url: tuple[str, ...] | list[str] | str | None = None,
        redlock_ttl: float | None = None,
        redlock_disable: bool = False,
        redlock_lock_on: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(parent, **kwargs)
        app = parent.app
        self.state = state = state_for(app)
        overrides: dict[str, Any] = {}
        if redlock_url:
            urls = [redlock_url] if isinstance(redlock_url, str) else list(redlock_url)
            overrides["redlock_url"] = urls if len(urls) > 1 else urls[0]
        if redlock_ttl is not None:
            overrides["redlock_ttl"] = redlock_ttl
        if redlock_disable:
            overrides["redlock_disable"] = True
        if redlock_lock_on is not None:
            overrides["redlock_lock_on"] = redlock_lock_on
        state.overrides.update(overrides)
        state.send_events = bool(getattr(parent, "task_events", False))
        state.reset()
        try:
            apply_redlock_tasks(app)
            if not state.disabled:
                settings = state.settings  # check now: a bad setting stops the worker here
                if _forks_children(parent):
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
        if state.settings.in_process:
            return  # memory://: nothing to reach
        clients = state.clients()
        url = state.settings.url
        urls = url if isinstance(url, list) else [url]
        per_url = clients if isinstance(clients, list) else [clients]
        for where, client in zip(urls, per_url, strict=True):
            check_lock_redis(mask_url(where), client)

    def stop(self, parent: Any) -> None:
        release_all_held(self.state)

    def shutdown(self, parent: Any) -> None:
        renewal.shutdown(timeout=2.0)


def _forks_children(worker: Any) -> bool:
    """True when *worker*'s pool runs tasks in forked child processes (prefork)."""
    from celery.concurrency import prefork  # noqa: PLC0415 - a worker's start only

    pool = getattr(worker, "pool_cls", None)
    return isinstance(pool, type) and issubclass(pool, prefork.TaskPool)


def check_locked_tasks(app: Any, state: AppState) -> None:
    """Resolve every locked task's options against the settings now, so a bad combination
    (``lock_limit=None`` without a rate, a limit or a rate on Redlock masters, enqueue-time
    holds on Redlock masters) stops the worker at start-up with one ConfigError naming
    every such task (by name) and its option, never deep in a run."""
    url = state.settings.url
    masters = len(url) if isinstance(url, list) else 1
    problems: list[str] = []
    for name, task in sorted(app.tasks.items()):
        if not (isinstance(task, LockedTask) and type(task).redlock_spec is not None):
            continue
        try:
            options = state.options_for(task)
            check_store(task.name, options, masters)
            if masters > 1 and options.lock_on != "run":
                raise ConfigError(f"task {name!r}: " + no_queued_holds(name, masters))
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems))


def check_lock_redis(where: str, client: Any) -> None:
    """Ping one lock Redis at start-up; say clearly (naming *where*, a masked URL) what is
    wrong. Never raises: tasks whose lock cannot be taken are retried, never run unlocked.

    A refused password and a replica are configuration errors (ERROR); a server still
    loading its data set is transient (WARNING); anything else is "unreachable" (ERROR),
    with a hint when the URL asks for TLS, since a TLS client talking to a plain server
    sees only a connect timeout.
    """
    try:
        client.ping()
    except AuthenticationError as exc:
        log.error(
            "celery-redlock: lock Redis %s refused the credentials (%s): check the user "
            "name and password in redlock_url; locked tasks will be retried until it "
            "accepts them",
            where,
            exc,
        )
        return
    except BusyLoadingError as exc:
        log.warning(
            "celery-redlock: lock Redis %s is loading its data set (%s); locked tasks "
            "will be retried until it is ready",
            where,
            exc,
        )
        return
    except Exception as exc:
        tls = " (the URL asks for TLS: does that server accept TLS?)"
        log.error(
            "celery-redlock: lock Redis %s is unreachable (%s)%s; locked tasks will be "
            "retried until it answers",
            where,
            exc,
            tls if where.lower().startswith("rediss://") else "",
        )
        return
    if isinstance(client, RedisCluster):
        return
    try:
        role = client.execute_command("ROLE")
    except Exception:  # an ACL may refuse ROLE: nothing to learn from that
        return
    kind = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
    if kind in ("slave", "replica"):
        log.error(
            "celery-redlock: lock Redis %s is a read-only replica: no lock can be taken "
            "there; point redlock_url at its master. Locked tasks will be retried",
            where,
        )


# -- app.send_task by name --------------------------------------------------------------------
def wrap_send_task(app: Any) -> None:
    """Make ``app.send_task(name, ...)`` de-duplicate like ``apply_async`` when *name* is a
    LockedTask this process knows (beat publishes by name when its process lacks the
    task's class; then the worker checks instead, see celery_redlock.dedup).

    ``Task.apply_async`` calls ``send_task`` with ``task_type``: a LockedTask's calls
    passed ``LockedTask.apply_async`` already and go straight through. Another task's
    call on an app not finalized yet finalizes it first when ``redlock_tasks`` is set:
    that is when matching tasks become LockedTasks (in place), and a task that just
    became one is published as one.
    """
    current = app.send_task
    if getattr(current, "redlock_wrapped", False):
        return

    @functools.wraps(current)
    def send_task(
        name: Any, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any
    ) -> Any:
        if rest:
            return current(name, args, kwargs, *rest, **options)
        task = options.get("task_type")
        if task is None:
            task = _locked_task(app, name)
        elif isinstance(task, LockedTask) or not _finalizes_redlock_tasks(app):
            task = None
        if not isinstance(task, LockedTask):
            return current(name, args, kwargs, **options)
        return publish(task, args, kwargs, options, functools.partial(current, name))

    send_task.redlock_wrapped = True  # type: ignore[attr-defined]
    app.send_task = send_task


def _finalizes_redlock_tasks(app: Any) -> bool:
    """Finalize *app* now if that applies ``redlock_tasks``; True if it did."""
    if app.finalized or not app.autofinalize or not app.conf.get("redlock_tasks"):
        return False
    app.finalize(auto=True)
    return True


def _locked_task(app: Any, name: Any) -> Any:
    """The LockedTask registered as *name* in this process, or None."""
    if not isinstance(name, str) or not (app.finalized or app.autofinalize):
        return None
    task = app.tasks.get(name)
    return task if isinstance(task, LockedTask) else None


# -- redlock_tasks: lock tasks that do not use the base class ---------------------------------
def apply_redlock_tasks(app: Any = None, sender: Any = None, **_: Any) -> None:
    """Give tasks matched by ``app.conf.redlock_tasks`` the LockedTask behaviour."""
    app = app if app is not None else sender
    patterns = app.conf.get("redlock_tasks") or {}
    if not patterns:
        return
    for name, task in list(app.tasks.items()):
        if isinstance(task, LockedTask):
            continue
        options = _match(patterns, name)
        if options is None:
            continue
        for key, value in options.items():
            check_task_option(name, key, value)
        cls = type(task)
        locked = type(cls.__name__, (LockedTask, cls), {**options, "name": name})
        task.__class__ = locked
        task.__dict__.pop("__trace__", None)
        log.debug("redlock_tasks: %s is now locked with %s", name, options)


def _match(patterns: dict[str, Any], name: str) -> dict[str, Any] | None:
    if name in patterns:
        return dict(patterns[name])
    if name.startswith("celery."):
        return None  # Celery's own tasks only when named exactly
    for pattern, options in patterns.items():
        if fnmatch.fnmatchcase(name, pattern):
            return dict(options)
    return None


# -- signal receivers ----------------------------------------------------------------------------
def _connect_receivers() -> None:
    global _receivers_connected
    if _receivers_connected:
        return
    signals.task_failure.connect(_on_failure, weak=False)
    signals.task_revoked.connect(_on_revoked, weak=False)
    signals.task_rejected.connect(_on_rejected, weak=False)
    signals.task_unknown.connect(_on_rejected, weak=False)
    signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
    signals.worker_process_init.connect(_on_process_init, weak=False)
    _receivers_connected = True


def _installed(task: Any) -> AppState | None:
    app = getattr(task, "app", None)
    if app is None or not isinstance(task, LockedTask):
        return None
    state = state_for(app)
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
    state = _installed(sender)
    if state is None or task_id is None or task_id in state.held:
        return
    headers = getattr(getattr(sender, "request", None), "headers", None)
    release_for_gone_child(sender, task_id, args, kwargs, headers, why=type(exception).__name__)


def _on_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **_: Any,
) -> None:
    """In the worker's main process: ``revoke(terminate=True)`` frees the lock now; a
    message discarded before it ran (revoked, or past its ``expires``) frees its hold."""
    if request is None:
        return
    if not terminated:
        hold = _hold_of(request)
        task_id = getattr(request, "id", None)
        app = getattr(sender, "app", None)
        if hold and task_id and app is not None:
            release_hold_later(app, hold, task_id, "expired" if expired else "revoked")
        return
    state = _installed(sender)
    task_id = getattr(request, "id", None)
    if state is None or task_id is None or task_id in state.held:
        return
    headers = {}
    raw_headers = getattr(request, "request_dict", None) or {}  # the message headers
    if KEY_HEADER in raw_headers:
        headers[KEY_HEADER] = raw_headers[KEY_HEADER]
    release_for_gone_child(
        sender, task_id, request.args, request.kwargs, headers, why="revoked (terminated)"
    )


def _hold_of(request: Any) -> str | None:
    """The lock name whose enqueue-time hold a request's message took (its header)."""
    headers = getattr(request, "headers", None)
    value = headers.get(HOLD_HEADER) if isinstance(headers, dict) else None
    if value is None:
        value = getattr(request, HOLD_HEADER, None)
    return value if isinstance(value, str) and value else None


def _on_rejected(sender: Any = None, message: Any = None, **_: Any) -> None:
    """In the worker's main process: a message rejected unread (unknown task, bad message)
    frees its hold, read from its headers: this worker may not know the task."""
    headers = getattr(message, "headers", None)
    if not isinstance(headers, dict):
        return
    hold, task_id, app = headers.get(HOLD_HEADER), headers.get("id"), getattr(sender, "app", None)
    if isinstance(hold, str) and hold and isinstance(task_id, str) and app is not None:
        release_hold_later(app, hold, task_id, "rejected")


def _on_process_init(**_: Any) -> None:
    """A new prefork pool child: no metrics that nothing can scrape (see observability)."""
    drop_unscrapable_metrics()


def _on_process_shutdown(**_: Any) -> None:
    """A pool child going away releases what it still holds and stops its renewal thread."""
    for state in list(_states):
        release_all_held(state)
    renewal.shutdown(timeout=1.0)


# Defining a task class on an app (base=LockedTask) installs that app.
task_module.app_hooks.append(install)
