"""``install(app)``: what makes an app's locked tasks work, and ``app.send_task`` by name.

No explicit call is needed: defining a task with ``base=LockedTask`` or setting
``redlock_tasks`` installs everything for that app; ``install(app)`` does it
explicitly and is idempotent. It adds the worker bootstep and signal receivers
(:mod:`celery_redlock.worker.bootstep`), the logging, metrics and tracing hooks, applies
``redlock_tasks`` (:func:`celery_redlock.task.locked_task.apply_redlock_tasks`) and makes
``app.send_task`` de-duplicate like ``apply_async``.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import signals

from .app.event_log import record
from .app.flags import register_flags
from .app.observability import enable_prometheus_by_default, logging_hook
from .app.state import state_for
from .app.tracing import enable_tracing_by_default
from .cli import command as cli_command
from .core.events import add_hook
from .task import locked_task as task_module
from .task.dedup import publish
from .task.locked_task import LockedTask, apply_redlock_tasks
from .task.per_call import call_options
from .worker.bootstep import (
    RedlockStep,
    check_locked_tasks,
    connect_receivers,
    warn_statedb_scheduler,
    watch_app,
)

__all__ = ["apply_redlock_tasks", "check_locked_tasks", "install", "wrap_send_task"]

log = logging.getLogger("celery_redlock")

_install_lock = threading.RLock()


def install(app: Any) -> None:
    """Install the bootstep, signal receivers and ``redlock_tasks`` for *app* (idempotent)."""
    state = state_for(app)
    with _install_lock:
        if state.installed:
            return
        state.installed = True
        watch_app(state)
        app.steps["worker"].add(RedlockStep)
        wrap_send_task(app)
        connect_receivers()
        add_hook(logging_hook)
        record(state)
        enable_prometheus_by_default()
        enable_tracing_by_default()
        app.on_after_finalize.connect(apply_redlock_tasks, weak=False)
        if app.finalized:
            apply_redlock_tasks(app)


# -- app.send_task by name --------------------------------------------------------------------
def wrap_send_task(app: Any) -> None:
    """Make ``app.send_task(name, ...)`` de-duplicate like ``apply_async`` when *name* is a
    LockedTask this process knows (beat publishes by name when its process lacks the
    task's class; then the worker checks instead, see celery_redlock.task.dedup).

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
            if task is None and _unknown(app, name):
                # A task this process does not know (a publisher without the task
                # modules): its lock_key still goes to the worker, in the header.
                options = call_options(str(name), None, options, "send_task")
        elif isinstance(task, LockedTask) or not _finalizes_redlock_tasks(app):
            task = None
        if not isinstance(task, LockedTask):
            return current(name, args, kwargs, **options)
        spec = type(task).redlock_spec
        signature = spec.signature if spec is not None else None
        options = call_options(task.name, signature, options, "send_task")
        return publish(task, args, kwargs, options, functools.partial(current, name))

    send_task.redlock_wrapped = True  # type: ignore[attr-defined]
    app.send_task = send_task


def _finalizes_redlock_tasks(app: Any) -> bool:
    """Finalize *app* now if that applies ``redlock_tasks``; True if it did."""
    if app.finalized or not app.autofinalize or not app.conf.get("redlock_tasks"):
        return False
    app.finalize(auto=True)
    return True


def _unknown(app: Any, name: Any) -> bool:
    """True when no task *name* is registered in this process (of a finalized app)."""
    return isinstance(name, str) and app.finalized and name not in app.tasks


def _locked_task(app: Any, name: Any) -> Any:
    """The LockedTask registered as *name* in this process, or None."""
    if not isinstance(name, str) or not (app.finalized or app.autofinalize):
        return None
    task = app.tasks.get(name)
    return task if isinstance(task, LockedTask) else None


# -- what installs an app without a call -------------------------------------------------
# The one place that changes Celery when this package is imported, and why each is needed:
#
# * the worker flags go on Celery's ``worker`` command itself, not on
#   ``app.user_options["worker"]``: Celery reads ``user_options`` once, right after
#   importing the ``-A`` module, and at that moment an app whose tasks are defined the
#   usual way (``@app.task(base=LockedTask)``, evaluated lazily at finalize) or only by
#   ``redlock_tasks`` is not installed yet. ``user_options`` would reach only an app that
#   calls ``install(app)`` at import, and the flags cannot be on the command twice, so
#   this is their one place. The flags act only through the bootstep, which installed
#   apps have;
# * ``worker_init`` installs an app that sets ``redlock_tasks`` but never imported this
#   package itself (Celery loads it through the ``celery.commands`` entry point, and
#   ``worker_init`` fires before the worker builds its bootsteps);
# * ``celeryd_init`` warns when a worker's ``-S`` (its state file) names LeaderScheduler,
#   on any worker: an app that only uses the scheduler installs nothing;
# * defining a task class on an app (``base=LockedTask``) installs that app: the class
#   is made in :mod:`celery_redlock.task.locked_task`, which cannot import this module (this module
#   imports it), so it calls what is registered in ``task.app_hooks``.
register_flags()


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
signals.celeryd_init.connect(warn_statedb_scheduler, weak=False)
task_module.app_hooks.append(install)


def _serve_board(
    app: Any, *, echo: Callable[[str], object], log_level: str = "INFO", **options: Any
) -> None:
    """``celery locks serve``: the board, imported when the command runs; its log
    (sign-ins, actions) on stderr at *log_level*."""
    from .board import serve  # noqa: PLC0415 - only the command serves

    level = serve.log.level
    handler = serve.show_log(log_level)  # a bad level is refused before the port is bound
    try:
        serve.serve_board(serve.make_board_server(app, **options), echo=echo)
    finally:
        serve.log.removeHandler(handler)
        serve.log.setLevel(level)
        # The command ends here: the interpreter's last collection would walk every object
        # of Celery and its imports (0.3-0.7 s on a busy machine, most of a stop's time);
        # frozen, they are left to the process's end.
        gc.freeze()


cli_command.board_servers.append(_serve_board)
