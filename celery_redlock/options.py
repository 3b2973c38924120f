"""The ``lock_*`` task options: what each accepts and which app setting gives its default.

:data:`OPTIONS` is the one table of them. A task class's options are checked when the
class is made (:func:`check_declared`: an unknown ``lock_*`` name or a bad value is a
:class:`ConfigError` naming the task and the fix), and resolved against its app's
``redlock_*`` settings once (:func:`resolve`, cached per app by
``AppState.options_for`` until the settings are reloaded).
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .contention import DUPLICATE_POLICIES, STRATEGIES, Duplicate
from .core import ConfigError, KeyTemplate
from .core.lock import MAX_TTL_MS, MIN_TTL, ttl_to_ms
from .core.ratelimit import parse_rate
from .core.semaphore import REDLOCK_REFUSAL

__all__ = [
    "LOCK_ON",
    "LOST_POLICIES",
    "OPTIONS",
    "Option",
    "TaskOptions",
    "TaskSpec",
    "boolean",
    "check_combination",
    "check_declared",
    "check_enqueue_limit",
    "check_rate_needed",
    "check_store",
    "check_task_option",
    "choice",
    "compile_key",
    "declared",
    "field_of",
    "is_set",
    "key_option",
    "lease",
    "limit_option",
    "positive_number",
    "rate_option",
    "resolve",
    "seconds",
    "whole_number",
]


#: ``lock_on_lost``: "raise" interrupts the body with LockLost, "warn" only logs.
LOST_POLICIES = ("raise", "warn")
#: ``lock_on``: when the lock is held. "run": while the body runs; "enqueue": from publish
#: until the body starts (the run itself is locked as with "run"); "enqueue+run": from
#: publish until the run ends (one queued-or-running per key). See celery_redlock.dedup.
LOCK_ON = ("run", "enqueue", "enqueue+run")


# -- value checks (shared with the redlock_* settings): each returns the value to use or
# -- raises TypeError/ValueError whose text completes "... must be <text>"
def seconds(
    minimum: float, *, allow_none: bool = False, strict: bool = False
) -> Callable[[Any], Any]:
    """A check for a number of seconds >= *minimum* (> with *strict*; None if allowed)."""

    def check(value: Any) -> Any:
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError("a number of seconds")
        if not math.isfinite(value):  # NaN passes every comparison below
            raise ValueError("a finite number of seconds")
        if value < minimum or (strict and value == minimum):
            raise ValueError(f"{'>' if strict else '>='} {minimum}")
        return float(value)

    return check


def lease(*, allow_none: bool = False, minimum: float = MIN_TTL) -> Callable[[Any], Any]:
    """A check for a lease Redis keeps: seconds in whole milliseconds, from *minimum* (a
    lock's TTL: ``core.lock.MIN_TTL``) up to ``core.lock.MAX_TTL_MS`` (None if allowed)."""
    number = seconds(0, allow_none=allow_none, strict=True)

    def check(value: Any) -> Any:
        checked = number(value)
        if checked is not None:
            try:
                ms = ttl_to_ms(checked)
            except ConfigError:
                ms = 0
            if not minimum * 1000 <= ms <= MAX_TTL_MS:
                raise ValueError(
                    f"from {minimum:g} to {MAX_TTL_MS // 1000} seconds (Redis keeps "
                    "milliseconds, and a lock's lease must outlast its drift allowance)"
                )
        return checked

    return check


def whole_number(value: Any) -> int:
    """A whole number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError("a whole number >= 0")
    return value


def boolean(value: Any) -> bool:
    """True or False."""
    if not isinstance(value, bool):
        raise TypeError("True or False")
    return value


def choice(*choices: str) -> Callable[[Any], str]:
    """A check for one of *choices*."""

    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError("one of " + ", ".join(repr(c) for c in choices))
        return str(value)

    return check


def positive_number(value: Any) -> int | None:
    """A whole number >= 1 (or None: not set)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError("a whole number >= 1")
    return value


def limit_option(value: Any) -> int | None:
    """``lock_limit``: a whole number >= 1 (1 a mutex, N a semaphore), or None (no cap)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError(
            "a whole number >= 1 (1: one run at a time, N: N at once), or None for no "
            "concurrency cap (a rate limit alone)"
        )
    return value


def rate_option(value: Any) -> str | None:
    """``lock_rate``: ``"N/s"``, ``"N/m"``, ``"N/h"`` or ``"N/d"`` (or None)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError('a string such as "10/m" (runs per second, minute, hour or day)')
    try:
        parse_rate(value)
    except ConfigError:
        raise ValueError(
            'like "10/s", "10/m", "10/h" or "10/d" (run starts per second, minute, hour or day)'
        ) from None
    return value.strip().replace(" ", "")


def key_option(value: Any) -> Any:
    """A lock key: a template, a callable, or None (the task name)."""
    if value is None or callable(value) or (isinstance(value, str) and value):
        return value
    raise TypeError('a template such as "sync:<user_id>", or a callable (*args, **kwargs) -> str')


@dataclass(frozen=True)
class Option:
    """One task option."""

    check: Callable[[Any], Any]
    #: The app setting that gives its default (None: no default).
    setting: str | None


#: task option -> what it accepts and the setting it defaults from.
OPTIONS: dict[str, Option] = {
    "lock_key": Option(key_option, "redlock_default_key"),
    "lock_ttl": Option(lease(), "redlock_ttl"),
    "lock_on_contended": Option(choice(*STRATEGIES), "redlock_on_contended"),
    "lock_on_lost": Option(choice(*LOST_POLICIES), "redlock_on_lost"),
    "lock_max_retries": Option(whole_number, "redlock_max_retries"),
    "lock_retry_backoff": Option(seconds(0), "redlock_retry_backoff"),
    "lock_retry_backoff_max": Option(seconds(0), "redlock_retry_backoff_max"),
    "lock_retry_jitter": Option(boolean, "redlock_retry_jitter"),
    "lock_wait_timeout": Option(seconds(0), "redlock_wait_timeout"),
    "lock_max_hold": Option(lease(allow_none=True, minimum=0.001), None),
    "lock_limit": Option(limit_option, "redlock_limit"),
    "lock_rate": Option(rate_option, "redlock_rate"),
    "lock_rate_burst": Option(positive_number, None),
    "lock_on": Option(choice(*LOCK_ON), "redlock_lock_on"),
    "lock_on_duplicate": Option(choice(*DUPLICATE_POLICIES), "redlock_lock_on_duplicate"),
    "lock_debounce": Option(seconds(0, allow_none=True, strict=True), None),
    "lock_enqueue_ttl": Option(lease(minimum=0.001), "redlock_lock_enqueue_ttl"),
}

#: Options for which None, set by the task, means something (no cap), not "not set".
NONE_MEANS_SOMETHING = frozenset({"lock_limit"})
#: The class attribute that marks the class holding the options' unset defaults (None):
#: ``LockedTask`` sets every option to None and this to True in its own namespace.
DEFAULTS_MARK = "redlock_option_defaults"
#: Options that only mean something with lock_on "enqueue" or "enqueue+run".
ENQUEUE_OPTIONS = ("lock_on_duplicate", "lock_debounce", "lock_enqueue_ttl")


def check_task_option(task_name: str, option: str, value: Any) -> Any:
    """Validate one task option; ConfigError names the task, the option and the fix."""
    spec = OPTIONS.get(option)
    if spec is None:
        guess = difflib.get_close_matches(option, OPTIONS, n=1)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise ConfigError(
            f"task {task_name!r}: unknown lock option {option!r}{hint} "
            f"(known: {', '.join(sorted(OPTIONS))})"
        )
    try:
        return spec.check(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"task {task_name!r}: {option}={value!r} is not valid; it must be {exc}"
        ) from None


def declared(cls: type, option: str) -> Any:
    """The value of *option* that task class *cls* (or a base) sets; None if none does.

    Read without binding: a callable ``lock_key`` stays the plain function.
    """
    value = inspect.getattr_static(cls, option, None)
    return value.__func__ if isinstance(value, staticmethod) else value


def is_set(cls: type, option: str) -> bool:
    """True if *cls* or a base below the one holding the defaults sets *option*, even to
    None (``lock_limit=None``: no cap)."""
    for klass in cls.__mro__:
        if option in vars(klass):
            return DEFAULTS_MARK not in vars(klass)
    return False


def check_declared(task_name: str, cls: type) -> None:
    """Check every ``lock_*`` attribute that task class *cls* itself sets, and the options
    that only make sense together (a rate limit alone, a burst, a debounce)."""
    for attr in list(vars(cls)):
        if attr.startswith("lock_"):
            check_task_option(task_name, attr, declared(cls, attr))
    check_rate_needed(
        task_name,
        declared(cls, "lock_rate"),
        no_cap=is_set(cls, "lock_limit") and declared(cls, "lock_limit") is None,
        burst=declared(cls, "lock_rate_burst"),
    )
    if is_set(cls, "lock_limit"):
        check_enqueue_limit(task_name, declared(cls, "lock_on"), declared(cls, "lock_limit"))
    check_combination(
        task_name,
        declared(cls, "lock_on"),
        declared(cls, "lock_on_duplicate"),
        declared(cls, "lock_debounce"),
        given=[o for o in ENQUEUE_OPTIONS if declared(cls, o) is not None],
    )


def check_rate_needed(task_name: str, rate: Any, *, no_cap: bool, burst: Any) -> None:
    """ConfigError for what only a ``lock_rate`` makes meaningful, set without one:
    ``lock_limit=None`` (no cap: nothing would be limited) or a ``lock_rate_burst``.
    Checked on the task class (its own options) and again once settings fill the rest."""
    if rate is not None:
        return
    if no_cap:
        raise ConfigError(
            f"task {task_name!r}: lock_limit=None is not valid without a lock_rate; it must "
            "be a whole number >= 1 (runs at once), or None together with lock_rate (e.g. "
            "lock_rate='10/m'): otherwise nothing is limited"
        )
    if burst is not None:
        raise ConfigError(
            f"task {task_name!r}: lock_rate_burst={burst!r} is not valid without a "
            "lock_rate; it must be set together with lock_rate (e.g. lock_rate='10/m')"
        )


def check_enqueue_limit(task_name: str, lock_on: Any, limit: Any) -> None:
    """ConfigError for an enqueue-time hold on a task whose runs are not one at a time:
    the queued message is handed over to the run's lock (a mutex) in one step."""
    if lock_on in ("enqueue", "enqueue+run") and limit != 1:
        raise ConfigError(
            f"task {task_name!r}: lock_on={lock_on!r} must be used with lock_limit=1 (the "
            f"queued message becomes the run's lock in one step); it has lock_limit={limit!r}"
        )


def check_combination(
    task_name: str, lock_on: Any, on_duplicate: Any, debounce: Any, given: list[str]
) -> None:
    """ConfigError for de-duplication options of one task class that cannot work together.

    ``lock_debounce`` only means something with ``lock_on_duplicate="replace"`` set on
    the same task (a setting could change under it); the other enqueue options may be
    set while ``lock_on`` is left to ``redlock_lock_on``.
    """
    if lock_on == "run" and given:
        raise ConfigError(
            f"task {task_name!r}: {', '.join(given)} must be used with lock_on='enqueue' or "
            "'enqueue+run' (the lock is taken at publish); this task sets lock_on='run'"
        )
    if debounce is not None and on_duplicate != "replace":
        raise ConfigError(
            f"task {task_name!r}: lock_debounce={debounce!r} must be used with "
            f"lock_on_duplicate='replace' on the same task (the newest call's arguments run "
            "once the calls stop); "
            + ("it sets none" if on_duplicate is None else f"it sets {on_duplicate!r}")
        )


def compile_key(task_name: str, key: Any, signature: inspect.Signature) -> Any:
    """A ``lock_key`` ready to render: None, a callable, or a KeyTemplate whose every
    placeholder is an argument of *signature* (ConfigError with a did-you-mean if not)."""
    if key is None or callable(key):
        return key
    try:
        template = KeyTemplate(key)
    except ConfigError as exc:
        raise ConfigError(f"task {task_name!r}: {exc}") from None
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for field in template.fields:
        if field not in params and not takes_any:
            guess = difflib.get_close_matches(field, list(params), n=1)
            hint = f"; did you mean <{guess[0]}>?" if guess else ""
            raise ConfigError(
                f"task {task_name!r}: lock_key {key!r} names <{field}>, but the task takes "
                f"({', '.join(params) or 'no arguments'}){hint}"
            )
    return template


@dataclass(frozen=True)
class TaskSpec:
    """What a task class fixes at decoration: its body's signature and its own key."""

    #: The body's parameters (``self`` left out for a bound task).
    signature: inspect.Signature
    #: The class's ``lock_key``, compiled (None: it sets none).
    key: Any


@dataclass(frozen=True)
class TaskOptions:
    """A task class's lock options resolved against its app's settings."""

    #: None (the task name), a fixed name, a KeyTemplate or a callable.
    key: Any
    signature: inspect.Signature
    ttl: float
    on_contended: str
    on_lost: str
    max_retries: int
    retry_backoff: float
    retry_backoff_max: float
    retry_jitter: bool
    wait_timeout: float
    max_hold: float | None
    #: Runs of one key at once: 1 a mutex, N a semaphore, None no cap.
    limit: int | None = 1
    #: Run starts of one key per period (``"10/m"``), or None.
    rate: str | None = None
    rate_burst: int = 1
    #: "run", "enqueue" or "enqueue+run".
    lock_on: str = "run"
    on_duplicate: str = "return"
    duplicate: Duplicate = DUPLICATE_POLICIES["return"]
    #: With "replace": seconds without a new call before the newest one runs.
    debounce: float | None = None
    #: How long the hold of a message that never runs may live (+ its ETA/countdown).
    enqueue_ttl: float = 3600.0


def resolve(cls: type, spec: TaskSpec, settings: Mapping[str, Any]) -> TaskOptions:
    """*cls*'s options: the value it sets, else its setting's (both checked already)."""
    values: dict[str, Any] = {}
    for name, option in OPTIONS.items():
        value = declared(cls, name)
        unset = value is None and not (name in NONE_MEANS_SOMETHING and is_set(cls, name))
        if unset and option.setting is not None:
            value = settings[option.setting]
        values[name] = None if value is None else option.check(value)
    task_name = getattr(cls, "name", None) or cls.__name__
    check_rate_needed(
        task_name,
        values["lock_rate"],
        no_cap=values["lock_limit"] is None,
        burst=values["lock_rate_burst"],
    )
    check_enqueue_limit(task_name, values["lock_on"], values["lock_limit"])
    key = spec.key
    if key is None:
        default = values["lock_key"]
        key = KeyTemplate(default) if isinstance(default, str) else default
    fields = {field_of(name): value for name, value in values.items() if name != "lock_key"}
    fields["rate_burst"] = fields["rate_burst"] or 1
    return TaskOptions(
        key=key,
        signature=spec.signature,
        duplicate=DUPLICATE_POLICIES[values["lock_on_duplicate"]],
        **fields,
    )


def field_of(option: str) -> str:
    """The :class:`TaskOptions` field of task option *option*: its name without ``lock_``
    (``lock_on`` keeps its name)."""
    return option if option == "lock_on" else option.removeprefix("lock_")


def check_store(task_name: str, options: TaskOptions, masters: int) -> None:
    """Refuse a limit above one or a rate on a list of Redlock masters (*masters* > 1):
    a ConfigError naming the task, the option and why (see docs/limits.md)."""
    if masters <= 1:
        return
    if options.limit is not None and options.limit > 1:
        raise ConfigError(
            f"task {task_name!r}: lock_limit={options.limit} with redlock_url a list of "
            f"{masters} Redlock masters: {REDLOCK_REFUSAL}"
        )
    if options.rate is not None:
        raise ConfigError(
            f"task {task_name!r}: lock_rate={options.rate!r} with redlock_url a list of "
            f"{masters} Redlock masters: majorities count different grants (3 masters: "
            "grants counted on masters 1 and 2, 2 and 3, 1 and 3 are three grants while "
            "each master counted two), so a rate cannot be kept there; point redlock_url "
            "at one Redis (a plain server, a Sentinel-managed master or a Cluster)"
        )
