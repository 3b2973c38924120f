"""Settings of one Celery app (``app.conf.redlock_*``), checked once and early.

Settings belong to the app: two apps in one process keep their own values,
clients and defaults. Worker flags override them for that worker only.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .core.connect import mask_url
from .core.errors import ConfigError

__all__ = [
    "CONTENDED_POLICIES",
    "LOST_POLICIES",
    "SETTINGS",
    "TASK_OPTIONS",
    "Settings",
    "check_task_option",
    "load_settings",
]

CONTENDED_POLICIES = ("retry", "skip", "wait", "raise")
LOST_POLICIES = ("raise", "warn")


def _number(
    minimum: float, *, allow_none: bool = False, strict: bool = False
) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError("a number of seconds")
        if value < minimum or (strict and value == minimum):
            raise ValueError(f"{'>' if strict else '>='} {minimum}")
        return float(value)

    return check


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError("a whole number >= 0")
    return value


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("True or False")
    return value


def _choice(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError("one of " + ", ".join(repr(c) for c in choices))
        return str(value)

    return check


def _url(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(u, str) for u in value):
        return list(value) if len(value) > 1 else value[0]
    raise TypeError("a Redis URL, or a list of URLs (one per independent master)")


def _string(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    raise TypeError("a string")


def _key_option(value: Any) -> Any:
    if value is None or callable(value) or (isinstance(value, str) and value):
        return value
    raise TypeError('a template such as "sync:<user_id>", or a callable (*args, **kwargs) -> str')


def _mapping(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError("a dict")


#: app setting -> (checker, default, what it means)
SETTINGS: dict[str, tuple[Callable[[Any], Any], Any, str]] = {
    "redlock_url": (_url, None, "where locks live; default: the broker URL when it is redis://"),
    "redlock_ttl": (_number(0, strict=True), 30.0, "lease length in seconds"),
    "redlock_default_key": (_key_option, None, "key when a task sets none (default: task name)"),
    "redlock_on_contended": (_choice(*CONTENDED_POLICIES), "retry", "policy when held"),
    "redlock_on_lost": (_choice(*LOST_POLICIES), "raise", "what a task gets on loss"),
    "redlock_max_retries": (_integer, 50, "contention retries before failing"),
    "redlock_retry_backoff": (_number(0), 1.0, "first contention retry delay"),
    "redlock_retry_backoff_max": (_number(0), 60.0, "longest contention retry delay"),
    "redlock_retry_jitter": (_boolean, True, "randomise contention retry delays"),
    "redlock_wait_timeout": (_number(0), 30.0, "how long 'wait' blocks"),
    "redlock_fail_open": (_boolean, False, "run unlocked when Redis is down (not advised)"),
    "redlock_key_prefix": (_string, "redlock:", "prefix of every lock key"),
    "redlock_fence_ttl": (
        _number(0, allow_none=True, strict=True),
        None,
        "let a lock's fence counter expire after this long unused (None: never)",
    ),
    "redlock_tasks": (_mapping, {}, "task-name patterns -> lock options, for tasks without base"),
    "redlock_disable": (_boolean, False, "run every task unlocked (tests)"),
    "redlock_beat_ttl": (_number(0, allow_none=True, strict=True), None, "beat leader lease"),
    "redlock_beat_lock_name": (_string, None, "name of the beat leader lock"),
    "redlock_client_options": (_mapping, {}, "extra redis-py client options"),
}

#: task option -> the app setting that gives its default
TASK_OPTIONS: dict[str, str] = {
    "lock_key": "redlock_default_key",
    "lock_ttl": "redlock_ttl",
    "lock_on_contended": "redlock_on_contended",
    "lock_on_lost": "redlock_on_lost",
    "lock_max_retries": "redlock_max_retries",
    "lock_retry_backoff": "redlock_retry_backoff",
    "lock_retry_backoff_max": "redlock_retry_backoff_max",
    "lock_retry_jitter": "redlock_retry_jitter",
    "lock_wait_timeout": "redlock_wait_timeout",
    "lock_max_hold": "",
}
_TASK_CHECKS: dict[str, Callable[[Any], Any]] = {
    "lock_key": _key_option,
    "lock_max_hold": _number(0, allow_none=True, strict=True),
}


def check_task_option(task_name: str, option: str, value: Any) -> Any:
    """Validate one task option; ConfigError names the task, the option and the fix."""
    if option not in TASK_OPTIONS:
        guess = difflib.get_close_matches(option, TASK_OPTIONS, n=1)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise ConfigError(
            f"task {task_name!r}: unknown lock option {option!r}{hint} "
            f"(known: {', '.join(sorted(TASK_OPTIONS))})"
        )
    checker = _TASK_CHECKS.get(option) or SETTINGS[TASK_OPTIONS[option]][0]
    try:
        return checker(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"task {task_name!r}: {option}={value!r} is not valid; it must be {exc}"
        ) from None


@dataclass(frozen=True)
class Settings:
    """The resolved ``redlock_*`` settings of one app (worker flags applied)."""

    values: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    @property
    def url(self) -> str | list[str]:
        """Where locks live: a URL, or a list of URLs for Redlock."""
        url = self.values["redlock_url"]
        assert url is not None
        return url  # type: ignore[no-any-return]

    def describe(self) -> str:
        """One line for the worker's start-up log (passwords masked)."""
        url = self.values["redlock_url"]
        where = ", ".join(mask_url(u) for u in url) if isinstance(url, list) else mask_url(url)
        return (
            f"locks at {where} (ttl={self['redlock_ttl']}s, "
            f"on_contended={self['redlock_on_contended']}, on_lost={self['redlock_on_lost']}, "
            f"max_retries={self['redlock_max_retries']}, prefix={self['redlock_key_prefix']!r})"
        )


def load_settings(conf: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> Settings:
    """Read, check and complete the ``redlock_*`` settings from a Celery ``app.conf``.

    Unknown ``redlock_*`` names (likely typos) and wrong types raise one
    :class:`ConfigError` that lists every problem.
    """
    problems: list[str] = []
    values: dict[str, Any] = {}
    given = {k: conf.get(k) for k in _conf_keys(conf) if k.lower().startswith("redlock_")}
    given.update({k: v for k, v in (overrides or {}).items() if v is not None})
    for name in given:
        if name not in SETTINGS:
            guess = difflib.get_close_matches(name, SETTINGS, n=1)
            problems.append(
                f"unknown setting {name!r}" + (f" (did you mean {guess[0]!r}?)" if guess else "")
            )
    for name, (check, default, _) in SETTINGS.items():
        raw = given.get(name, default)
        if raw is None:
            values[name] = default
            continue
        try:
            values[name] = check(raw)
        except (TypeError, ValueError) as exc:
            shown = mask_url(str(raw)) if name == "redlock_url" else repr(raw)
            problems.append(f"{name}={shown} must be {exc}")
    if values.get("redlock_url") is None:
        broker = conf.get("broker_url") or ""
        if isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss", "unix"):
            values["redlock_url"] = broker.split(";", 1)[0]
        elif not values.get("redlock_disable"):
            problems.append(
                "redlock_url is not set and the broker is not Redis: set "
                "app.conf.redlock_url = 'redis://host:6379/1' (or pass --redlock-url)"
            )
    for name, options in (values.get("redlock_tasks") or {}).items():
        if not isinstance(options, Mapping):
            problems.append(f"redlock_tasks[{name!r}] must be a dict of lock options")
            continue
        for option, value in options.items():
            try:
                check_task_option(name, option, value)
            except ConfigError as exc:
                problems.append(str(exc))
    if problems:
        raise ConfigError("celery-redlock settings: " + "; ".join(problems))
    return Settings(values)


def _conf_keys(conf: Mapping[str, Any]) -> list[str]:
    try:
        return [k for k in conf if isinstance(k, str)]
    except TypeError:
        return []
