"""``LockedTask``: the lock around a Celery task, from acquire to every kind of exit.

Where each step happens, and why there:

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
  receiver is connected too. It is not connected otherwise, since any receiver
  makes Celery send the signal, with its lock and keyword dict, for every task.
* **the main process** releases the exact acquisition of a child that is gone
  (hard time limit, lost child, ``revoke(terminate=True)``): see
  :mod:`celery_redlock.install`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from .core import process
from .core.errors import ConfigError, LockContended, LockLost, QuorumUnavailable, describe_holder
from .core.keys import KeyTemplate, render_value
from .core.lock import Lock
from .interrupt import LockLostInterrupt, Watch, on_lost, watch
from .observability import send_task_event
from .settings import TASK_OPTIONS, check_task_option
from .state import AppState, state_for

__all__ = ["SKIPPED", "LockedTask", "is_skipped", "lock_name_for", "option"]

log = logging.getLogger("celery_redlock.task")

#: Marker in the result of a run skipped because another run held the lock.
SKIPPED = "celery_redlock.skipped"
#: Message header carrying the number of contention retries so far.
RETRIES_HEADER = "redlock_retries"
#: Message header carrying a per-call key (``apply_async(lock_key=...)``).
KEY_HEADER = "redlock_key"
#: Failures that a task's lock options produce on purpose (added to ``Task.throws``).
_EXPECTED = (LockContended, QuorumUnavailable)


def is_skipped(result: Any) -> bool:
    """True if *result* is what a run skipped for contention returned."""
    return isinstance(result, dict) and result.get(SKIPPED) is True


def _skipped(name: str, holder: dict[str, Any]) -> dict[str, Any]:
    return {SKIPPED: True, "reason": "lock held by another run", "lock": name, "holder": holder}


class LockedTask(Task):  # type: ignore[misc]
    """Base class: ``@app.task(base=LockedTask, lock_key="sync:<user_id>")``.

    Options (each defaults from ``app.conf.redlock_*``): ``lock_key``,
    ``lock_ttl``, ``lock_on_contended`` (retry/skip/wait/raise),
    ``lock_on_lost`` (raise/warn), ``lock_max_retries``, ``lock_retry_backoff``,
    ``lock_retry_backoff_max``, ``lock_retry_jitter``, ``lock_wait_timeout``,
    ``lock_max_hold``. Inside the body, ``self.lock`` is the held lock
    (``.fence``, ``.owned()``, ``.lost``, ``.valid_until``).
    """

    lock_key: Any = None
    lock_ttl: float | None = None
    lock_on_contended: str | None = None
    lock_on_lost: str | None = None
    lock_max_retries: int | None = None
    lock_retry_backoff: float | None = None
    lock_retry_backoff_max: float | None = None
    lock_retry_jitter: bool | None = None
    lock_wait_timeout: float | None = None
    lock_max_hold: float | None = None

    _redlock_key: ClassVar[Any] = None
    _redlock_signature: ClassVar[inspect.Signature | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        prepare_task_class(cls)

    @property
    def lock(self) -> Lock | None:
        """The lock held for the running request (None outside a locked run)."""
        return getattr(self.request, "_redlock_lock", None)

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Take the lock before the body runs (Retry/Ignore/errors count here)."""
        super().before_start(task_id, args, kwargs)
        request = self.request
        acquire_for_request(self, task_id, tuple(args or ()), dict(kwargs or {}), request)
        cls = type(self)
        if cls.before_start is LockedTask.before_start and cls.__call__ is Task.__call__:
            # Celery's tracer calls the body right after this returns, with nothing in
            # between: hand it the request, which saves it Celery's lookup (see _Handoff).
            _handoff.request = request

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
        # Every lock taken for a request is in state.held under its task id until
        # release_for_request takes it out, so a run whose lock was released already (all
        # but the rare ones) is told apart without Celery's request lookup (about 2 us).
        if task_id in state_for(self.app).held:
            request = self.request
            lock = getattr(request, "_redlock_lock", None)
            if lock is not None:
                release_for_request(self, lock, task_id, request)
        super().after_return(status, retval, task_id, args, kwargs, einfo)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Like Celery's, plus ``lock_key=`` to lock this call under another name."""
        key = options.pop("lock_key", None)
        if key is not None:
            if not isinstance(key, str) or not key:
                raise ConfigError(
                    f"task {self.name!r}: apply_async(lock_key={key!r}) must be a non-empty "
                    "string (a name like 'sync:42' or a template like 'sync:<user_id>')"
                )
            signature = type(self)._redlock_signature
            if "<" in key and signature is not None:
                # A wrong placeholder is the caller's mistake: say so here, not in the worker.
                _compile_key(self.name, key, signature)
            options["headers"] = {**(options.get("headers") or {}), KEY_HEADER: key}
        return super().apply_async(args, kwargs, **options)


# -- class preparation (at decoration / finalize time) -------------------------------------
def prepare_task_class(cls: type) -> None:
    """Check a task class's lock options and wrap its body; ConfigError names the task."""
    run = inspect.getattr_static(cls, "run", None)
    if run is None or run is Task.__dict__.get("run"):
        return  # an abstract base, not a task
    name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
    for attr in list(vars(cls)):
        if attr.startswith("lock_"):
            value = inspect.getattr_static(cls, attr)
            check_task_option(
                name, attr, value.__func__ if isinstance(value, staticmethod) else value
            )
    already = getattr(cls, "_redlock_prepared_run", None) is run
    if already:  # a subclass of a prepared task (e.g. redlock_tasks): same body, new options
        fun: Callable[..., Any] = cls._redlock_fun  # type: ignore[attr-defined]
        bound: bool = cls._redlock_bound  # type: ignore[attr-defined]
    else:
        bound = not isinstance(run, staticmethod)
        fun = run.__func__ if isinstance(run, staticmethod) else run
    signature = inspect.signature(fun)
    if bound:
        params = list(signature.parameters.values())[1:]
        signature = signature.replace(parameters=params)
    key = inspect.getattr_static(cls, "lock_key", None)
    if isinstance(key, staticmethod):
        key = key.__func__
    cls._redlock_key = _compile_key(name, key, signature)  # type: ignore[attr-defined]
    cls._redlock_signature = signature  # type: ignore[attr-defined]
    cls._redlock_binder = (  # type: ignore[attr-defined]
        _make_binder(signature, cls._redlock_key.fields)  # type: ignore[attr-defined]
        if isinstance(cls._redlock_key, KeyTemplate)  # type: ignore[attr-defined]
        else None
    )

    # A run refused for contention, or given up on because Redis stayed unreachable, is
    # an outcome the task's lock options asked for, and celery_redlock.task has already
    # logged why in one line: Celery logs "raised expected" at INFO, not a traceback.
    throws = tuple(inspect.getattr_static(cls, "throws", ()) or ())
    cls.throws = throws + tuple(e for e in _EXPECTED if e not in throws)  # type: ignore[attr-defined]

    app = cls.__dict__.get("app")
    if not already:
        _wrap_run(cls, fun, bound, signature)
    net = needs_postrun_net(cls)
    if app is not None or net:
        from .install import install, use_postrun_net  # noqa: PLC0415 - it imports this module

        if net:
            use_postrun_net()
        if app is not None:
            install(app)


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
        return run_locked(self, fun, bound, args, kwargs)

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    locked_run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[self_param, *signature.parameters.values()]
    )
    cls.run = locked_run  # type: ignore[attr-defined]
    cls._redlock_prepared_run = locked_run  # type: ignore[attr-defined]
    cls._redlock_fun = staticmethod(fun)  # type: ignore[attr-defined]
    cls._redlock_bound = bound  # type: ignore[attr-defined]


def _compile_key(task_name: str, key: Any, signature: inspect.Signature) -> Any:
    if key is None or callable(key):
        return key
    template = KeyTemplate(key)
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for field in template.fields:
        if field not in params and not takes_any:
            import difflib  # noqa: PLC0415 - only on the error path

            guess = difflib.get_close_matches(field, list(params), n=1)
            hint = f"; did you mean <{guess[0]}>?" if guess else ""
            raise ConfigError(
                f"task {task_name!r}: lock_key {key!r} names <{field}>, but the task takes "
                f"({', '.join(params) or 'no arguments'}){hint}"
            )
    return template


_EMPTY = inspect.Parameter.empty
_Binder = Callable[[tuple[Any, ...], dict[str, Any]], "dict[str, Any] | None"]


def _make_binder(signature: inspect.Signature, fields: tuple[str, ...]) -> _Binder | None:
    """A fast ``signature.bind`` for the common signature: the template's fields from a call.

    It returns exactly what ``bind`` + ``apply_defaults`` would give for those fields,
    or None when the call is one ``bind`` would refuse, so the caller falls back to
    ``bind`` and its precise TypeError. Signatures with ``*args``, ``**kwargs`` or
    positional-only parameters get no fast binder.
    """
    params = list(signature.parameters.values())
    if any(
        p.kind
        in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
            inspect.Parameter.POSITIONAL_ONLY,
        )
        for p in params
    ):
        return None
    index: dict[str, int] = {}  # name -> position; keyword-only parameters get len(params)
    for i, p in enumerate(params):
        index[p.name] = i if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else len(params)
    positional = sum(1 for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = tuple((p.name, index[p.name]) for p in params if p.default is _EMPTY)
    plan = tuple((p.name, index[p.name], p.default) for p in params if p.name in set(fields))

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        given = len(args)
        if given > positional:
            return None
        for name in kwargs:
            at = index.get(name)
            if at is None or at < given:  # unknown, or given twice
                return None
        for name, at in required:
            if at >= given and name not in kwargs:
                return None
        out: dict[str, Any] = {}
        for name, at, default in plan:
            if at < given:
                out[name] = args[at]
            elif name in kwargs:
                out[name] = kwargs[name]
            else:
                out[name] = default
        return out

    return bind


# -- options and key ----------------------------------------------------------------
def option(task: Any, name: str, state: AppState | None = None) -> Any:
    """A task's lock option, or the app's default for it (*state*: the app's, if at hand)."""
    value = getattr(task, name, None)
    if value is not None:
        return value
    setting = TASK_OPTIONS[name]
    if not setting:
        return None
    return (state_for(task.app) if state is None else state).settings[setting]


def lock_name_for(
    task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], headers: Any = None
) -> str:
    """The rendered lock name of one call: per-call key, task key, app default, task name."""
    key = (headers or {}).get(KEY_HEADER) if isinstance(headers, dict) else None
    if key is not None:
        key = KeyTemplate(key) if "<" in key else key
    else:
        key = getattr(type(task), "_redlock_key", None)
        if key is None:
            default = state_for(task.app).settings["redlock_default_key"]
            key = KeyTemplate(default) if isinstance(default, str) else default
    if key is None:
        return str(task.name)
    if isinstance(key, str):
        return key
    if isinstance(key, KeyTemplate):
        cls = type(task)
        template: KeyTemplate = key
        if getattr(cls, "_redlock_key", None) is template:  # the fast binder fits this key
            binder = getattr(cls, "_redlock_binder", None)
            fields = binder(args, kwargs) if binder is not None else None
            if fields is not None:
                rendered: str = template.render(fields)
                return rendered
        signature = getattr(cls, "_redlock_signature", None)
        arguments: dict[str, Any] = dict(kwargs)
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{task.name}(): {exc}") from None
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            for param in signature.parameters.values():
                if param.kind is inspect.Parameter.VAR_KEYWORD:
                    arguments.update(arguments.pop(param.name, {}))
        return key.render(arguments)
    name = key(*args, **kwargs)
    name = name if isinstance(name, str) else render_value(name)
    if not name:
        raise ConfigError(f"task {task.name!r}: lock_key callable returned an empty name")
    return name


class _Plan:
    """A task class's lock options resolved against its app's settings, in one process.

    Options come from the task class or, when it leaves one unset, from ``redlock_*``
    settings; both are fixed once the app's settings are loaded (``AppState.reset()``
    drops this with them). Each run builds its lock with these options.
    """

    __slots__ = ("max_hold", "on_contended", "pid", "ttl", "wait_timeout")

    def __init__(self, task: Any, state: AppState) -> None:
        self.pid = process.pid()  # a forked child makes its own (clients are per process)
        self.on_contended: str = option(task, "lock_on_contended", state)
        self.wait_timeout: float | None = option(task, "lock_wait_timeout", state)
        self.ttl: float = option(task, "lock_ttl", state)
        self.max_hold: float | None = option(task, "lock_max_hold", state)

    def new_lock(self, task: Any, state: AppState, name: str, owner: dict[str, Any]) -> Lock:
        return state.make_lock(
            name, self.ttl, owner_info=owner, max_hold=self.max_hold, on_lost=on_lost
        )


def _plan_for(task: Any, state: AppState) -> _Plan:
    plan: _Plan | None = state.plans.get(type(task))
    if plan is None or plan.pid != process.pid():
        plan = state.plans[type(task)] = _Plan(task, state)
    return plan


# -- acquire ----------------------------------------------------------------------------
def acquire_for_request(
    task: Any,
    task_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    request: Any = None,
) -> None:
    """before_start: take the lock or apply the contention policy."""
    if request is None:
        request = task.request
    request._redlock_checked = True
    state = state_for(task.app)
    if state.disabled:
        return
    eager = bool(getattr(request, "is_eager", False))
    plan = _plan_for(task, state)
    policy = plan.on_contended
    if eager and policy == "retry":
        policy = "wait"  # an eager call cannot be re-queued: wait, then raise
    headers = getattr(request, "headers", None)
    name = lock_name_for(task, args, kwargs, headers)
    lock = _new_lock(task, state, name, task_id, request, plan=plan)
    try:
        acquired = lock.acquire(
            blocking=policy == "wait",
            timeout=plan.wait_timeout if policy == "wait" else None,
        )
        if not acquired and policy != "wait" and lock.holder.get("task_id") == task_id:
            # The holder is an earlier attempt of this very task id: self.retry() publishes
            # the new message before the old body's finally releases, and a fast worker can
            # start it first. Skipping or failing against ourselves is wrong (the
            # celery-singleton bug): wait for that release, or for a dead attempt's lease to
            # run out, at most one TTL; then the policy applies as usual.
            acquired = lock.acquire(blocking=True, timeout=lock.ttl)
    except QuorumUnavailable as exc:
        if state.settings["redlock_fail_open"]:
            log.warning(
                "Task %s[%s] runs UNLOCKED (redlock_fail_open=True): %s", task.name, task_id, exc
            )
            return
        if eager:
            raise
        log.warning(
            "Task %s[%s] not started, lock %r unavailable: %s", task.name, task_id, name, exc
        )
        _retry_later(task, request, name, exc)
        return
    if acquired:
        request._redlock_lock = lock
        state.held[task_id] = lock
        if state.send_events:
            send_task_event(task, "acquired", lock=name, fence=lock.fence)
        return
    holder = lock.holder
    who = describe_holder(holder)
    send_task_event(task, "contended", lock=name, policy=policy, holder=holder)
    if policy == "skip":
        log.info("Task %s[%s] skipped: lock %r is held by %s", task.name, task_id, name, who)
        marker = _skipped(name, holder)
        if eager:
            request._redlock_skip = marker
            return
        task.backend.mark_as_done(task_id, marker, request=request)
        raise Ignore(f"skipped: lock {name!r} is held by {who}")
    if policy in ("raise", "wait"):
        waited = " after waiting" if policy == "wait" else ""
        log.info(
            "Task %s[%s] failed%s: lock %r is held by %s", task.name, task_id, waited, name, who
        )
        raise LockContended(name, holder)
    _retry_later(task, request, name, LockContended(name, holder))


def _new_lock(
    task: Any,
    state: AppState,
    name: str,
    task_id: str | None,
    request: Any = None,
    *,
    plan: _Plan | None = None,
) -> Lock:
    owner = {"task_name": task.name, "task_id": task_id}
    hostname = getattr(task.request if request is None else request, "hostname", None)
    if hostname:
        owner["worker"] = hostname
    return (plan or _plan_for(task, state)).new_lock(task, state, name, owner)


def backoff_delay(task: Any, attempt: int) -> float:
    """Exponential backoff for contention retry *attempt* (0-based), jittered if enabled."""
    base = float(option(task, "lock_retry_backoff"))
    cap = float(option(task, "lock_retry_backoff_max"))
    delay: float = min(cap, base * (2**attempt))
    if option(task, "lock_retry_jitter"):
        delay = delay / 2 + random.uniform(0, delay / 2)
    return delay


def _retry_later(task: Any, request: Any, name: str, exc: Exception) -> None:
    """Re-queue with this task's own contention budget; the task's max_retries is untouched."""
    headers = dict(getattr(request, "headers", None) or {})
    done = int(headers.get(RETRIES_HEADER) or getattr(request, RETRIES_HEADER, 0) or 0)
    budget = int(option(task, "lock_max_retries"))
    if done >= budget:
        log.error(
            "Task %s[%s] gave up after %d lock retries (lock_max_retries=%d): %s",
            task.name,
            request.id,
            done,
            budget,
            exc,
        )
        raise exc
    delay = backoff_delay(task, done)
    headers[RETRIES_HEADER] = done + 1
    sig = task.signature_from_request(
        request, countdown=delay, retries=request.retries, headers=headers
    )
    log.info(
        "Task %s[%s] lock retry %d/%d in %.2fs: %s",
        task.name,
        request.id,
        done + 1,
        budget,
        delay,
        exc,
    )
    try:
        sig.apply_async()
    except Exception as publish_error:
        raise Reject(publish_error, requeue=False) from publish_error
    raise Retry(f"lock {name!r} busy", exc=exc, when=delay, sig=sig)


# -- the body -----------------------------------------------------------------------------
class _Handoff(threading.local):
    """The request whose ``before_start`` just returned, for the body that runs next.

    Celery's tracer runs ``before_start`` and then, with no code in between, the task
    body (``run``); Celery's own request lookup costs about 2 µs. ``before_start`` sets
    this only when the task class has neither its own ``before_start`` nor its own
    ``__call__``, so nothing else can run between the two; the body takes it at once
    and clears it. A body called any other way (``task(...)``) finds None and asks
    Celery.
    """

    request: Any = None


_handoff = _Handoff()


def run_locked(
    task: Any, fun: Callable[..., Any], bound: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run the task body under its lock and release on every exit."""
    request = _handoff.request
    if request is None:
        request = task.request
    else:
        _handoff.request = None
    skip = getattr(request, "_redlock_skip", None)
    if skip is not None:
        return skip
    lock: Lock | None = getattr(request, "_redlock_lock", None)
    if lock is None and not getattr(request, "_redlock_checked", False):
        # Called directly (``task(...)``), not through a worker or apply(): lock here.
        direct = _acquire_direct(task, args, kwargs)
        if isinstance(direct, dict):
            return direct
        lock = direct
        if lock is not None:
            request._redlock_lock = lock
    running: Watch | None = None
    try:
        try:
            if lock is not None:
                running = watch(lock, task.name, option(task, "lock_on_lost"))
            return fun(task, *args, **kwargs) if bound else fun(*args, **kwargs)
        finally:
            if running is not None:
                running.stop(lock)  # after this no interrupt can reach this thread
    except LockLostInterrupt:  # raised in the body, or on the way out before stop() ran
        assert lock is not None
        raise LockLost(lock.name, lock.lost_reason or "lost while the task ran") from None
    finally:
        if lock is not None:
            release_for_request(task, lock, getattr(request, "id", None), request)


def _acquire_direct(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    state = state_for(task.app)
    if state.disabled:
        return None
    plan = _plan_for(task, state)
    policy = plan.on_contended
    name = lock_name_for(task, args, kwargs)
    lock = _new_lock(task, state, name, None, plan=plan)
    wait = policy == "wait"
    if lock.acquire(blocking=wait, timeout=plan.wait_timeout if wait else None):
        return lock
    if policy == "skip":
        log.info(
            "%s() skipped: lock %r is held by %s", task.name, name, describe_holder(lock.holder)
        )
        return _skipped(name, lock.holder)
    raise LockContended(name, lock.holder)


def release_for_request(task: Any, lock: Lock, task_id: str | None, request: Any = None) -> None:
    """Release a task's lock; problems are logged, never raised over the task's outcome."""
    state = state_for(task.app)
    if task_id is not None:
        state.held.pop(task_id, None)
    if request is None:
        request = task.request
    if getattr(request, "_redlock_lock", None) is lock:
        request._redlock_lock = None
    if not lock.valid_until:
        return  # already released
    events = state.send_events  # the Celery events below are the only use of these two
    held, fence = (lock.held_for, lock.fence) if events else (0.0, None)
    try:
        lock.release()
        if events:
            send_task_event(task, "released", lock=lock.name, fence=fence, held=held)
    except LockLost as exc:
        if events:
            send_task_event(task, "lost", lock=lock.name, reason=str(exc), held=held)
        policy = option(task, "lock_on_lost")
        log.warning("Task %s[%s]: %s (lock_on_lost=%s)", task.name, task_id, exc, policy)
    except QuorumUnavailable as exc:
        log.warning(
            "Task %s[%s]: could not release lock %r (%s); it expires within %ss",
            task.name,
            task_id,
            lock.name,
            exc,
            lock.ttl,
        )
    except Exception:
        log.exception("Task %s[%s]: releasing lock %r failed", task.name, task_id, lock.name)
