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
from .core.lock import DEFAULT_FENCE_TTL
from .options import OPTIONS, boolean, check_task_option, lease

__all__ = ["SETTINGS", "Settings", "load_settings"]


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


def _mapping(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError("a dict")


def _like(option: str) -> Callable[[Any], Any]:
    """The check of the setting that gives task option *option* its default: the option's."""
    return OPTIONS[option].check


#: app setting -> (checker, default, what it means)
SETTINGS: dict[str, tuple[Callable[[Any], Any], Any, str]] = {
    "redlock_url": (_url, None, "where locks live; default: the broker URL when it is redis://"),
    "redlock_ttl": (_like("lock_ttl"), 30.0, "lease length in seconds"),
    "redlock_default_key": (_like("lock_key"), None, "key when a task sets none (task name)"),
    "redlock_on_contended": (_like("lock_on_contended"), "retry", "policy when held"),
    "redlock_on_lost": (_like("lock_on_lost"), "raise", "what a task gets on loss"),
    "redlock_max_retries": (_like("lock_max_retries"), 50, "contention retries before failing"),
    "redlock_retry_backoff": (_like("lock_retry_backoff"), 1.0, "first contention retry delay"),
    "redlock_retry_backoff_max": (
        _like("lock_retry_backoff_max"),
        60.0,
        "longest contention retry delay",
    ),
    "redlock_retry_jitter": (_like("lock_retry_jitter"), True, "randomise contention retry delays"),
    "redlock_wait_timeout": (_like("lock_wait_timeout"), 30.0, "how long 'wait' blocks"),
    "redlock_limit": (_like("lock_limit"), 1, "runs of one key at once (1: a mutex)"),
    "redlock_rate": (_like("lock_rate"), None, "run starts of one key per period ('10/m')"),
    "redlock_lock_on": (_like("lock_on"), "run", "when the lock is held (run, enqueue, ...)"),
    "redlock_lock_on_duplicate": (
        _like("lock_on_duplicate"),
        "return",
        "what a publish that finds the key queued or running does",
    ),
    "redlock_lock_enqueue_ttl": (
        _like("lock_enqueue_ttl"),
        3600.0,
        "longest life of the hold of a message that never runs (+ its ETA)",
    ),
    "redlock_fail_open": (boolean, False, "run unlocked when Redis is down (not advised)"),
    "redlock_key_prefix": (_string, "redlock:", "prefix of every lock key"),
    "redlock_fence_ttl": (
        lease(allow_none=True, minimum=0.001),
        DEFAULT_FENCE_TTL,
        "a lock's fence counter expires after this long unused (None: never)",
    ),
    "redlock_tasks": (_mapping, {}, "task-name patterns -> lock options, for tasks without base"),
    "redlock_disable": (boolean, False, "run every task unlocked (tests)"),
    "redlock_beat_ttl": (lease(allow_none=True), None, "beat leader lease"),
    "redlock_beat_lock_name": (_string, None, "name of the beat leader lock"),
    "redlock_client_options": (_mapping, {}, "extra redis-py client options"),
}


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

    @property
    def in_process(self) -> bool:
        """True when every lock lives in this process (``memory://``): for tests and
        single-process tools, never shared with a forked child or another process."""
        url = self.url
        urls = url if isinstance(url, list) else [url]
        return all(u.lower().startswith("memory://") for u in urls)

    def check_single_process(self, who: str) -> None:
        """A ConfigError when locks live in this process (``memory://``) but *who* (a
        prefork worker, a beat) runs in several processes that would not share them."""
        if self.in_process:
            raise ConfigError(
                f"redlock_url={self.values['redlock_url']!r} keeps locks in this process, "
                f"but {who}: its locks would not be shared, so two runs of one key could "
                "overlap. memory:// is for tests and single-process tools (eager calls, "
                "direct calls, a solo or threads worker); point redlock_url at Redis"
            )

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
