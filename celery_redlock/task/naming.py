"""The lock name of one call of a locked task.

The name comes from, in order: a per-call key (``apply_async(lock_key=...)``, carried in
the :data:`KEY_HEADER` message header), the task's ``lock_key``, the app's
``redlock_default_key``, the task name. A template (``"sync:<user_id>"``) is filled from
the call's arguments bound to the task's signature (defaults applied), each value
rendered canonically (:func:`~celery_redlock.core.keys.render_value`), so every process
names one call's lock alike.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from ..app.config import TaskOptions
from ..core import ConfigError, KeyTemplate, render_value

__all__ = ["KEY_HEADER", "check_fields", "compile_key", "lock_name_for", "render_key"]

#: Message header carrying a per-call key (``apply_async(lock_key=...)``).
KEY_HEADER = "redlock_key"


def lock_name_for(
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    headers: Any = None,
    options: TaskOptions | None = None,
) -> str:
    """The rendered lock name of one call: per-call key, task key, app default, task name
    (*options*: the task's, when the caller has them at hand)."""
    if options is None:
        options = task.redlock_options
    key = headers.get(KEY_HEADER) if isinstance(headers, dict) else None
    if key is None:
        key = options.key
    elif "<" in key:
        key = KeyTemplate(key)
    if key is None:
        return str(task.name)
    if isinstance(key, (str, KeyTemplate)):
        return render_key(task, key, args, kwargs, options)
    name = key(*args, **kwargs)
    if not isinstance(name, str):
        try:
            name = render_value(name)
        except TypeError as exc:
            raise _unrenderable(task, key, exc) from None
    if not name:
        raise ConfigError(f"task {task.name!r}: lock_key callable returned an empty name")
    return str(name)


#: What rendering a key from one call's arguments raises when they do not fit it: a value
#: with no canonical text (TypeError), a missing argument (ConfigError) or a missing field
#: of one (KeyError, AttributeError for ``<a.b>``).
_RENDER_ERRORS = (ConfigError, TypeError, KeyError, AttributeError)


def render_key(
    task: Any,
    key: str | KeyTemplate,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: TaskOptions,
    *,
    what: str = "lock_key",
) -> str:
    """Key *key* (a fixed name, or a template filled from the call's arguments) for one
    call; *what* names it in the error when the arguments do not fit it."""
    if isinstance(key, str):
        return key
    arguments = _arguments(task, options, args, kwargs)
    try:
        return key.render(arguments)
    except _RENDER_ERRORS as exc:
        raise _unrenderable(task, key.template, exc, what) from None


def _unrenderable(task: Any, key: Any, exc: BaseException, what: str = "lock_key") -> ConfigError:
    """The error for a call whose arguments key *key* (option *what*) cannot be rendered
    from."""
    callable_hint = " or give lock_key a callable" if what == "lock_key" else ""
    return ConfigError(
        f"task {task.name!r}: {what} {key!r} cannot be rendered for this call "
        f"({type(exc).__name__}: {exc}); pass arguments with a canonical text (str, int, "
        f"UUID, date, list, dict ...){callable_hint}"
    )


def _arguments(
    task: Any, options: TaskOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call's arguments by name, defaults applied (``**kwargs`` entries merged in)."""
    signature = options.signature
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{task.name}(): {exc}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            arguments.update(arguments.pop(param.name, {}))
    return arguments


def compile_key(task_name: str, key: Any, signature: inspect.Signature) -> Any:
    """A ``lock_key`` ready to render: None, a callable, or a KeyTemplate whose every
    placeholder is an argument of *signature* (ConfigError with a did-you-mean if not)."""
    if key is None or callable(key):
        return key
    try:
        template = KeyTemplate(key)
    except ConfigError as exc:
        raise ConfigError(f"task {task_name!r}: {exc}") from None
    check_fields(task_name, f"lock_key {key!r}", template, signature)
    return template


def check_fields(
    task_name: str, what: str, template: KeyTemplate, signature: inspect.Signature
) -> None:
    """ConfigError (with a did-you-mean) when *template* (*what*: ``lock_key 'x:<a>'``)
    names an argument that *signature* does not take."""
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in template.fields:
        if name not in params and not takes_any:
            guess = difflib.get_close_matches(name, list(params), n=1)
            hint = f"; did you mean <{guess[0]}>?" if guess else ""
            raise ConfigError(
                f"task {task_name!r}: {what} names <{name}>, but the task takes "
                f"({', '.join(params) or 'no arguments'}){hint}"
            )
