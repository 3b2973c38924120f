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
import logging
import os
import threading
import time
import weakref
from typing import Any

import click
from celery import bootsteps, signals
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from redis.cluster import RedisCluster
from redis.exceptions import AuthenticationError, BusyLoadingError

from .core import renewal
from .core.connect import mask_url
from .core.errors import ConfigError, RedlockError
from .core.events import add_hook
from .observability import drop_unscrapable_metrics, enable_prometheus_by_default, logging_hook
from .settings import check_task_option
from .state import AppState, state_for
from .task import KEY_HEADER, LockedTask, lock_name_for, option, release_for_request

__all__ = ["RedlockStep", "apply_redlock_tasks", "install"]

log = logging.getLogger("celery_redlock")
log_release = logging.getLogger("celery_redlock.release")

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
        state.overrides.update(overrides)
        state.send_events = bool(getattr(parent, "task_events", False))
        state.reset()
        try:
            apply_redlock_tasks(app)
            if not state.disabled:
                state.settings  # noqa: B018 - check now: a bad setting stops the worker here
                state.clients()  # and a URL no client can be made of (nothing connects yet)
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


def release_all_held(state: AppState) -> None:
    """Release every lock this process holds for *state*'s app (warm shutdown)."""
    for task_id, lock in list(state.held.items()):
        state.held.pop(task_id, None)
        try:
            lock.release()
            log_release.info("released %r held by task %s at shutdown", lock.name, task_id)
        except RedlockError as exc:
            log_release.warning("could not release %r at shutdown: %s", lock.name, exc)


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
    signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
    signals.worker_process_init.connect(_on_process_init, weak=False)
    _receivers_connected = True


_postrun_connected = False


def use_postrun_net() -> None:
    """Connect the ``task_postrun`` safety net (once per process): some LockedTask class has
    its own ``before_start``, ``__call__`` or ``after_return`` (see celery_redlock.task)."""
    global _postrun_connected
    with _install_lock:
        if not _postrun_connected:
            signals.task_postrun.connect(_on_postrun, weak=False)
            _postrun_connected = True


def _installed(task: Any) -> AppState | None:
    app = getattr(task, "app", None)
    if app is None or not isinstance(task, LockedTask):
        return None
    state = state_for(app)
    return state if state.installed else None


def _on_postrun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    """Safety net: a lock still registered for a finished request is released (connected
    by use_postrun_net)."""
    state = _installed(sender)
    if state is None or task_id is None:
        return
    lock = state.held.get(task_id)
    if lock is not None:
        release_for_request(sender, lock, task_id)


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
    _release_for_gone_child(sender, task_id, args, kwargs, headers, why=type(exception).__name__)


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    """In the worker's main process: ``revoke(terminate=True)`` frees the lock now."""
    if not terminated or request is None:
        return
    state = _installed(sender)
    task_id = getattr(request, "id", None)
    if state is None or task_id is None or task_id in state.held:
        return
    headers = {}
    raw_headers = getattr(request, "_request_dict", {}) or {}
    if KEY_HEADER in raw_headers:
        headers[KEY_HEADER] = raw_headers[KEY_HEADER]
    _release_for_gone_child(
        sender, task_id, request.args, request.kwargs, headers, why="revoked (terminated)"
    )


def _release_for_gone_child(
    task: Any, task_id: str, args: Any, kwargs: Any, headers: Any, *, why: str
) -> None:
    """Release the acquisition of *task_id* once its process is gone (in a short thread).

    Timeline that makes the wait necessary: billiard calls the hard-time-limit
    callback (which fires task_failure here) *before* it kills the child, and
    revoke(terminate=True) only sends the signal. Releasing at once would let
    the next run start while the old one may still be writing. So: read the
    holder record, wait (bounded by the TTL) until its pid has exited, then
    release exactly the acquisition whose record names this task id.
    """
    try:
        name = lock_name_for(task, tuple(args or ()), dict(kwargs or {}), headers)
        ttl = float(option(task, "lock_ttl"))
        lock = state_for(task.app).make_lock(name, ttl, auto_renew=False)
    except Exception as exc:
        log_release.warning(
            "task %s[%s] %s: cannot find its lock (%s)", task.name, task_id, why, exc
        )
        return

    def release() -> None:
        try:
            holder = lock.read_holder()
            if not holder or holder.get("task_id") != task_id:
                return
            pid = holder.get("pid")
            deadline = time.monotonic() + ttl
            while isinstance(pid, int) and _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if isinstance(pid, int) and _alive(pid):
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
            match = {"task_id": task_id} if pid is None else {"task_id": task_id, "pid": pid}
            if lock.release_matching(**match):
                log_release.warning(
                    "task %s[%s] %s: released its lock %r at once (holder pid %s is gone)",
                    task.name,
                    task_id,
                    why,
                    name,
                    pid,
                )
        except Exception as exc:
            log_release.warning(
                "task %s[%s] %s: could not release %r (%s); it expires within %ss",
                task.name,
                task_id,
                why,
                name,
                exc,
                ttl,
            )

    threading.Thread(target=release, name="celery-redlock-release", daemon=True).start()


def _alive(pid: int) -> bool:
    """True while *pid* runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _on_process_init(**_: Any) -> None:
    """A new prefork pool child: no metrics that nothing can scrape (see observability)."""
    drop_unscrapable_metrics()


def _on_process_shutdown(**_: Any) -> None:
    """A pool child going away releases what it still holds and stops its renewal thread."""
    for state in list(_states):
        release_all_held(state)
    renewal.shutdown(timeout=1.0)


def describe_url(url: Any) -> str:
    """Password-free rendering of a URL or list of URLs."""
    if isinstance(url, list):
        return ", ".join(mask_url(u) for u in url)
    return mask_url(str(url))
