"""``LockedTask``: the lock around a Celery task, from acquire to every kind of exit.

Where each step happens, and why there (the steps themselves are the methods of the
run's one :class:`~celery_redlock.task.run.LockedRun`, kept on its request; every exit
below calls its ``release``):

* **acquire** in ``before_start``: the tracer runs it inside the try block where
  ``Retry``, ``Ignore`` and exceptions count, so a contended run can be
  re-queued, skipped or failed. (A ``task_prerun`` receiver cannot stop a task:
  ``Signal.send`` swallows its exceptions.)
* **release** in a wrapper around the task body, in ``finally``: before the
  result is stored, so a caller that sees the result can take the lock at once;
  it covers success, exceptions, ``self.retry()``, ``Ignore``, ``Reject``, soft
  time limits and eager runs.
* **safety net** for a run whose body wrapper never started after the acquire (an
  exception between the two): ``after_return`` releases a lock still held when a
  run ends in success or failure. Only a task class with its own ``before_start``,
  ``__call__`` or ``after_return`` can end a run any other way there (``Ignore``,
  ``Reject`` or ``Retry`` raised by its own code after the acquire, or an
  ``after_return`` that does not call ours): for those, a ``task_postrun``
  receiver is connected too (``run.use_postrun_net``).
* **the main process** releases the exact acquisition of a child that is gone
  (hard time limit, lost child, ``revoke(terminate=True)``), or keeps it for the
  redelivered copy when the message is requeued (``Request``): see
  :mod:`celery_redlock.worker.bootstep`.

``redlock_tasks`` (:func:`apply_redlock_tasks`) gives tasks that do not use the base
class the same behaviour.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from celery import Task

from ..app.config import (
    OPTIONS,
    StartupConfigError,
    TaskOptions,
    TaskSpec,
    check_declared,
    check_task_option,
    declared,
)
from ..app.rules import BackOff, limits_option
from ..app.state import AppState, state_for
from ..core import ConfigError, Lock, LockContended, LockLost, StoreUnavailable
from .contention import SKIPPED, is_skipped
from .dedup import publish
from .flow import check_limits
from .naming import compile_key, lock_name_for
from .per_call import call_options, check_call_options
from .run import RUN_ATTR, LockedRun, use_postrun_net

log = logging.getLogger("celery_redlock")

__all__ = [
    "SKIPPED",
    "LockedTask",
    "app_hooks",
    "apply_redlock_tasks",
    "is_skipped",
    "lock_name_for",
]

#: Failures that a task's lock options produce on purpose (added to ``Task.throws``): a
#: LockLost (``lock_on_lost="raise"``, or a release that found the lock lost; the
#: interrupt the body sees, LockLostInterrupt, is one) has had its one WARNING line.
_EXPECTED = (LockContended, StoreUnavailable, BackOff, LockLost)

#: Called with the app of each task class made on one. ``celery_redlock.install`` adds
#: ``install`` when it is imported (always, by ``import celery_redlock``), so defining a
#: locked task installs its app; that module uses this one, hence the list.
app_hooks: list[Callable[[Any], None]] = []


class LockedTask(Task):  # type: ignore[misc]
    """Base class: ``@app.task(base=LockedTask, lock_key="sync:<user_id>")``.

    Options: the ``lock_*`` names of :data:`celery_redlock.app.config.OPTIONS`
    (``lock_key``, ``lock_ttl``, ``lock_on_contended``, ``lock_on_lost``, ...), each
    defaulting from its ``app.conf.redlock_*`` setting; an option a task does not set
    reads as None on it. Inside the body, ``self.lock`` is the held lock (``.fence``,
    ``.owned()``, ``.lost``, ``.valid_until``).
    """

    #: What the class fixes at decoration (its body's signature, its own key); None on
    #: an abstract base.
    redlock_spec: ClassVar[TaskSpec | None] = None
    #: Marks the class whose ``lock_*`` attributes are the unset defaults (None), so that a
    #: task's own ``lock_limit=None`` (no cap) reads as set (see options.is_set).
    redlock_option_defaults: ClassVar[bool] = True
    #: The worker's request class: it sees a lost child's message requeued, so that run's
    #: lock is kept for the redelivered copy (see celery_redlock.worker.request.LockedRequest).
    Request = "celery_redlock.worker.request:LockedRequest"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        prepare_task_class(cls)

    @property
    def redlock_state(self) -> AppState:
        """This task's app's state (settings, backend, the locks held): found once per task
        class and app, and kept on the class as Celery keeps the app (``Task.bind``). A
        run, its publish and the worker's handlers take it from the task."""
        cls = type(self)
        state: AppState | None = cls.__dict__.get("_redlock_app_state")
        app = self.app
        if state is None or state.app is not app:  # first use, or bound to another app
            state = state_for(app)
            cls._redlock_app_state = state
        return state

    @property
    def redlock_options(self) -> TaskOptions:
        """This task's lock options, resolved against its app's settings on first use and
        kept by the app's state until those settings change (``AppState.reset``)."""
        return self.redlock_state.options_for(self)

    @property
    def lock(self) -> Lock | None:
        """The lock held for the running request (None outside a locked run)."""
        run: LockedRun | None = getattr(self.request, RUN_ATTR, None)
        return None if run is None else run.lock

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Start the run: take the lock before the body runs (Retry/Ignore/errors count
        here)."""
        super().before_start(task_id, args, kwargs)
        LockedRun(self, task_id, tuple(args or ()), dict(kwargs or {})).acquire()

    def after_return(  # noqa: PLR0917 - Celery's signature
        self,
        status: str,
        retval: Any,
        task_id: str,
        args: Any,
        kwargs: Any,
        einfo: Any,
    ) -> None:
        """Safety net: a lock still held when the run ends is released (see the module doc)."""
        # A run holding its lock is in state.held: most runs need no request lookup.
        if task_id in self.redlock_state.held:
            run: LockedRun | None = getattr(self.request, RUN_ATTR, None)
            if run is not None:
                run.release()
        super().after_return(status, retval, task_id, args, kwargs, einfo)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Like Celery's, plus ``lock_key=`` to lock this call under another name.

        With ``lock_on="enqueue"`` or ``"enqueue+run"``, a call whose lock is already
        queued (or running) is a duplicate: ``lock_on_duplicate`` decides what it returns
        (see :mod:`celery_redlock.task.dedup`). Any other lock option, and celery-once's
        ``once=``, is refused with a ``ConfigError`` (see :mod:`celery_redlock.task.per_call`).
        """
        if options:  # delay() passes none
            spec = type(self).redlock_spec
            signature = spec.signature if spec is not None else None
            options = call_options(self.name, signature, options, "apply_async")
        return publish(self, args, kwargs, options, super().apply_async)

    def signature(self, args: Any = None, *starargs: Any, **starkwargs: Any) -> Any:
        """Like Celery's (``s()``, ``si()``); a lock option a call cannot pass is refused
        here, where the signature is made, not when a canvas publishes it later."""
        sig = super().signature(args, *starargs, **starkwargs)
        spec = type(self).redlock_spec
        check_call_options(
            self.name, spec.signature if spec is not None else None, sig.options, "signature"
        )
        return sig

    subtask = signature


for _option in OPTIONS:
    setattr(LockedTask, _option, None)


# -- class preparation (at decoration / finalize time) -------------------------------------
def prepare_task_class(cls: type) -> None:
    """Check a task class's lock options and wrap its body; a
    :class:`~celery_redlock.app.config.StartupConfigError` (a ConfigError) names the task, the
    option and the fix. Celery makes a task when it is defined on a finalized app, else
    on first use or when a worker or beat finalizes the app: ``celery worker`` and
    ``celery beat`` then print that one line and exit 1."""
    try:
        _prepare(cls)
    except StartupConfigError:
        raise
    except ConfigError as exc:
        raise StartupConfigError(str(exc)) from None


def _prepare(cls: type) -> None:
    run = inspect.getattr_static(cls, "run", None)
    if run is None or run is Task.__dict__.get("run"):
        return  # an abstract base, not a task
    name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
    check_declared(name, cls)
    already = getattr(cls, "_redlock_prepared_run", None) is run
    if already:  # a subclass of a prepared task (e.g. redlock_tasks): same body, new options
        fun: Callable[..., Any] = cls._redlock_fun  # type: ignore[attr-defined]
        bound: bool = cls._redlock_bound  # type: ignore[attr-defined]
    else:
        bound = not isinstance(run, staticmethod)
        fun = run.__func__ if isinstance(run, staticmethod) else run
    signature = inspect.signature(fun)
    if bound:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    key = compile_key(name, declared(cls, "lock_key"), signature)
    check_limits(name, limits_option(declared(cls, "lock_limits")), signature)
    cls.redlock_spec = TaskSpec(signature=signature, key=key)  # type: ignore[attr-defined]

    # A run refused for contention, given up on because Redis stayed unreachable, or ended
    # by the loss of its lock, is an outcome the task's lock options asked for, and has
    # had its one line already (celery_redlock.task.contention, the lock's own loss line):
    # Celery logs "raised expected" at INFO, not a traceback. The task's own throws stay.
    throws = tuple(inspect.getattr_static(cls, "throws", ()) or ())
    cls.throws = throws + tuple(e for e in _EXPECTED if e not in throws)  # type: ignore[attr-defined]

    if not already:
        _wrap_run(cls, fun, bound, signature)
    if needs_postrun_net(cls):
        use_postrun_net()
    app = cls.__dict__.get("app")
    if app is not None:
        for hook in app_hooks:
            hook(app)


def needs_postrun_net(cls: type) -> bool:
    """True if the class's own code may run between the acquire and the body wrapper, or
    replace ``after_return``: then only ``task_postrun`` sees every way a run can end."""
    return (
        cls.before_start is not LockedTask.before_start  # type: ignore[attr-defined]
        or cls.after_return is not LockedTask.after_return  # type: ignore[attr-defined]
        or cls.__call__ is not Task.__call__
    )


def _wrap_run(
    cls: type, fun: Callable[..., Any], bound: bool, signature: inspect.Signature
) -> None:
    @functools.wraps(fun)
    def locked_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        run: LockedRun | None = getattr(self.request, RUN_ATTR, None)
        if run is None:  # called directly (``task(...)``), not by a worker or apply()
            run = LockedRun(self, None, args, kwargs)
            run.acquire()
        return run.call(fun, bound, args, kwargs)

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    locked_run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self_param, *signature.parameters.values()]
    )
    cls.run = locked_run  # type: ignore[attr-defined]
    cls._redlock_prepared_run = locked_run  # type: ignore[attr-defined]
    cls._redlock_fun = staticmethod(fun)  # type: ignore[attr-defined]
    cls._redlock_bound = bound  # type: ignore[attr-defined]


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
        attrs: dict[str, Any] = {**options, "name": name}
        if cls.Request != Task.Request:
            attrs["Request"] = cls.Request  # the task's own request class stays
        locked = type(cls.__name__, (LockedTask, cls), attrs)
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
