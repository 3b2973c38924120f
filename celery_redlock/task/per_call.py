"""The lock options one call may pass: ``apply_async``, a signature's options, ``send_task``.

``lock_key`` is the one lock option a call may pass: it names this call's lock, and
travels to the worker in the :data:`~celery_redlock.task.naming.KEY_HEADER` message header.
Every other lock option (``lock_on_duplicate``, ``lock_ttl``, ...) belongs to the task
(or, as a ``redlock_*`` setting, to the app): the publish side and the worker both read
it from there, so a value that only this call carried would hold at one end and not the
other. Celery would carry such an option in the message's properties, where nothing
reads it; it is refused here instead, with the fix. So is celery-once's per-call
``once={...}``, which a task moved from ``QueueOnce`` may still pass.

``delay()`` takes no options: everything it gets is an argument of the task.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from ..app.config import OPTIONS
from ..core import ConfigError
from .naming import KEY_HEADER, compile_key

__all__ = ["PER_CALL", "call_options", "check_call_options"]

#: The lock options a call may pass.
PER_CALL = ("lock_key",)

#: Where a user reads what became of celery-once's per-call ``once={...}``.
_MIGRATING = 'docs/migrating.md, "Options passed per call"'


def call_options(
    task_name: str, signature: inspect.Signature | None, options: dict[str, Any], where: str
) -> dict[str, Any]:
    """*options* of one publish of task *task_name* (*where*: ``"apply_async"``,
    ``"send_task"``), with ``lock_key`` moved into the message headers; ConfigError for
    any other lock option and for ``once``. Options without a lock option are returned
    as they are (the same dict)."""
    if not _has_lock_option(options):
        return options
    check_call_options(task_name, signature, options, where)
    key = options.pop("lock_key", None)
    if key is not None:
        options["headers"] = {**(options.get("headers") or {}), KEY_HEADER: key}
    return options


def check_call_options(
    task_name: str, signature: inspect.Signature | None, options: dict[str, Any], where: str
) -> None:
    """ConfigError, naming the task, the option and the fix, for a lock option that a call
    cannot pass (or a ``lock_key`` that is not a name or a template of the task's
    arguments); the options are left as they are."""
    if not _has_lock_option(options):
        return
    for option, value in options.items():
        if value is None:  # dropped, as Celery's Signature.apply_async drops None options
            continue
        if option == "once":
            raise _once_refused(task_name, value, where)
        if not option.startswith("lock_"):
            continue
        if option == "lock_key":
            _check_key(task_name, signature, value, where)
        elif option in OPTIONS:
            raise _task_option_refused(task_name, option, value, where)
        else:
            guess = difflib.get_close_matches(option, [*PER_CALL, *OPTIONS], n=1)
            hint = f" (did you mean {guess[0]}?)" if guess else ""
            raise ConfigError(
                f"task {task_name!r}: {where}({option}={value!r}) is not an option of "
                f"celery-redlock{hint}; lock_key is the one lock option a call may pass"
            )


def _has_lock_option(options: dict[str, Any]) -> bool:
    return "once" in options or any(option.startswith("lock_") for option in options)


def _check_key(task_name: str, signature: inspect.Signature | None, key: Any, where: str) -> None:
    if not isinstance(key, str) or not key:
        raise ConfigError(
            f"task {task_name!r}: {where}(lock_key={key!r}) must be a non-empty string (a "
            "name like 'sync:42' or a template like 'sync:<user_id>')"
        )
    if "<" in key and signature is not None:
        # A wrong placeholder is the caller's mistake: say so here, not in the worker.
        compile_key(task_name, key, signature)


def _task_option_refused(task_name: str, option: str, value: Any, where: str) -> ConfigError:
    setting = OPTIONS[option].setting
    app_wide = f", or for every task in app.conf.{setting}" if setting else ""
    return ConfigError(
        f"task {task_name!r}: {option} cannot be passed per call ({where}({option}="
        f"{value!r}) would be ignored): set it on the task, @app.task(base=LockedTask, "
        f"{option}={value!r}){app_wide}; lock_key is the one lock option a call may pass"
    )


def _once_refused(task_name: str, value: Any, where: str) -> ConfigError:
    return ConfigError(
        f"task {task_name!r}: {where}(once={value!r}) is celery-once's per-call option, "
        "which celery-redlock does not read: set the task's own options instead "
        "(graceful is lock_on_duplicate='return', the default; timeout is "
        f"lock_enqueue_ttl); see {_MIGRATING}"
    )
