"""Configuration: the ``lock_*`` task options, the ``redlock_*`` app settings, and the
policy tables they accept, checked in one pass each.

* :data:`OPTIONS` is the one table of task options: what each accepts and which setting
  gives its default. A task class's options are checked when the class is made
  (:func:`check_declared`) and resolved against its app's settings once
  (:func:`resolve`, cached per app by ``AppState.options_for``).
* :class:`Settings` is the one table of settings: a field each, whose metadata holds its
  check and its meaning. :func:`load_settings` reads them from ``app.conf`` (worker flags
  override), and lists every problem in one :class:`ConfigError`.

Settings belong to the app: two apps in one process keep their own values, clients and
defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .checks import (
    boolean,
    choice,
    key_option,
    lease,
    limit_option,
    mapping,
    positive_number,
    rate_option,
    seconds,
    text,
    url_option,
    whole_number,
)
from .contention import DUPLICATE_POLICIES, STRATEGIES, PublishPolicy
from .core import ConfigError, KeyTemplate
from .core.connect import mask_url
from .core.lease import DEFAULT_FENCE_TTL

__all__ = [
    "LOCK_ON",
    "LOST_POLICIES",
    "OPTIONS",
    "Option",
    "Settings",
    "TaskOptions",
    "TaskSpec",
    "check_declared",
    "check_task_option",
    "declared",
    "load_settings",
    "resolve",
]


#: ``lock_on_lost``: "raise" interrupts the body with LockLost, "warn" only logs.
LOST_POLICIES = ("raise", "warn")
#: ``lock_on``: when the lock is held. "run": while the body runs; "enqueue": from publish
#: until the body starts (the run itself is locked as with "run"); "enqueue+run": from
#: publish until the run ends (one queued-or-running per key). See celery_redlock.dedup.
LOCK_ON = ("run", "enqueue", "enqueue+run")


# -- task options -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One task option."""

    check: Callable[[Any], Any]
    #: The :class:`Settings` field that gives its default (None: no default).
    setting: str | None


#: task option -> what it accepts and the setting it defaults from.
OPTIONS: dict[str, Option] = {
    "lock_key": Option(key_option, "default_key"),
    "lock_ttl": Option(lease(), "ttl"),
    "lock_on_contended": Option(choice(*STRATEGIES), "on_contended"),
    "lock_on_lost": Option(choice(*LOST_POLICIES), "on_lost"),
    "lock_max_retries": Option(whole_number, "max_retries"),
    "lock_retry_backoff": Option(seconds(0), "retry_backoff"),
    "lock_retry_backoff_max": Option(seconds(0), "retry_backoff_max"),
    "lock_retry_jitter": Option(boolean, "retry_jitter"),
    "lock_wait_timeout": Option(seconds(0), "wait_timeout"),
    "lock_max_hold": Option(lease(allow_none=True, minimum=0.001), None),
    "lock_limit": Option(limit_option, "limit"),
    "lock_rate": Option(rate_option, "rate"),
    "lock_rate_burst": Option(positive_number, None),
    "lock_on": Option(choice(*LOCK_ON), "lock_on"),
    "lock_on_duplicate": Option(choice(*DUPLICATE_POLICIES), "lock_on_duplicate"),
    "lock_debounce": Option(seconds(0, allow_none=True, strict=True), None),
    "lock_enqueue_ttl": Option(lease(minimum=0.001), "lock_enqueue_ttl"),
}

#: Options for which None, set by the task, means something (no cap), not "not set".
NONE_MEANS_SOMETHING = frozenset({"lock_limit"})
#: The class attribute that marks the class holding the options' unset defaults (None):
#: ``LockedTask`` sets every option to None and this to True in its own namespace.
DEFAULTS_MARK = "redlock_option_defaults"
#: Options that only mean something with lock_on "enqueue" or "enqueue+run".
ENQUEUE_OPTIONS = ("lock_on_duplicate", "lock_debounce", "lock_enqueue_ttl")


# -- app settings -----------------------------------------------------------------------------
def _setting(check: Callable[[Any], Any], default: Any, doc: str) -> Any:
    """A :class:`Settings` field: its check and meaning ride in its metadata."""
    meta = {"check": check, "doc": doc}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


def _like(option: str) -> Callable[[Any], Any]:
    """The check of the setting that gives task option *option* its default: the option's."""
    return OPTIONS[option].check


@dataclass(frozen=True)
class Settings:
    """The ``redlock_*`` settings of one app, checked (worker flags applied): the field
    ``ttl`` is the setting ``redlock_ttl``. A new setting is one field here."""

    url: str | list[str] | None = _setting(
        url_option, None, "where locks live; default: the broker URL when it is redis://"
    )
    ttl: float = _setting(_like("lock_ttl"), 30.0, "lease length in seconds")
    default_key: Any = _setting(_like("lock_key"), None, "key when a task sets none (task name)")
    on_contended: str = _setting(_like("lock_on_contended"), "retry", "policy when held")
    on_lost: str = _setting(_like("lock_on_lost"), "raise", "what a task gets on loss")
    max_retries: int = _setting(_like("lock_max_retries"), 50, "contention retries before failing")
    retry_backoff: float = _setting(
        _like("lock_retry_backoff"), 1.0, "first contention retry delay"
    )
    retry_backoff_max: float = _setting(
        _like("lock_retry_backoff_max"), 60.0, "longest contention retry delay"
    )
    retry_jitter: bool = _setting(
        _like("lock_retry_jitter"), True, "randomise contention retry delays"
    )
    wait_timeout: float = _setting(_like("lock_wait_timeout"), 30.0, "how long 'wait' blocks")
    limit: int | None = _setting(_like("lock_limit"), 1, "runs of one key at once (1: a mutex)")
    rate: str | None = _setting(_like("lock_rate"), None, "run starts of one key per period")
    lock_on: str = _setting(_like("lock_on"), "run", "when the lock is held (run, enqueue, ...)")
    lock_on_duplicate: str = _setting(
        _like("lock_on_duplicate"),
        "return",
        "what a publish that finds the key queued or running does",
    )
    lock_enqueue_ttl: float = _setting(
        _like("lock_enqueue_ttl"),
        3600.0,
        "longest life of the hold of a message that never runs (+ its ETA)",
    )
    fail_open: bool = _setting(boolean, False, "run unlocked when Redis is down (not advised)")
    key_prefix: str = _setting(text, "redlock:", "prefix of every lock key")
    fence_ttl: float | None = _setting(
        lease(allow_none=True, minimum=0.001),
        DEFAULT_FENCE_TTL,
        "a lock's fence counter expires after this long unused (None: never)",
    )
    tasks: dict[str, Any] = _setting(
        mapping, {}, "task-name patterns -> lock options, for tasks without base"
    )
    disable: bool = _setting(boolean, False, "run every task unlocked (tests)")
    beat_ttl: float | None = _setting(lease(allow_none=True), None, "beat leader lease")
    beat_lock_name: str | None = _setting(text, None, "name of the beat leader lock")
    client_options: dict[str, Any] = _setting(mapping, {}, "extra redis-py client options")

    @property
    def urls(self) -> str | list[str]:
        """Where locks live: a URL, or a list of URLs for Redlock (ConfigError if unset:
        only a disabled app may leave it unset)."""
        if self.url is None:
            raise ConfigError(
                "redlock_url is not set and the broker is not Redis: set "
                "app.conf.redlock_url = 'redis://host:6379/1' (or pass --redlock-url)"
            )
        return self.url

    @property
    def in_process(self) -> bool:
        """True when every lock lives in this process (``memory://``): for tests and
        single-process tools, never shared with a forked child or another process."""
        url = self.urls
        return all(
            u.lower().startswith("memory://") for u in (url if isinstance(url, list) else [url])
        )

    def check_single_process(self, who: str) -> None:
        """A ConfigError when locks live in this process (``memory://``) but *who* (a
        prefork worker, a beat) runs in several processes that would not share them."""
        if self.in_process:
            raise ConfigError(
                f"redlock_url={self.url!r} keeps locks in this process, "
                f"but {who}: its locks would not be shared, so two runs of one key could "
                "overlap. memory:// is for tests and single-process tools (eager calls, "
                "direct calls, a solo or threads worker); point redlock_url at Redis"
            )

    def describe(self) -> str:
        """One line for the worker's start-up log (passwords masked)."""
        url = self.urls
        where = ", ".join(mask_url(u) for u in url) if isinstance(url, list) else mask_url(url)
        return (
            f"locks at {where} (ttl={self.ttl}s, on_contended={self.on_contended}, "
            f"on_lost={self.on_lost}, max_retries={self.max_retries}, "
            f"prefix={self.key_prefix!r})"
        )


#: ``redlock_*`` setting name -> its :class:`Settings` field.
SETTINGS: dict[str, dataclasses.Field[Any]] = {
    f"redlock_{f.name}": f for f in dataclasses.fields(Settings)
}


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
    for name, spec in SETTINGS.items():
        raw = given.get(name)
        if raw is None:
            continue
        try:
            values[spec.name] = spec.metadata["check"](raw)
        except (TypeError, ValueError) as exc:
            shown = mask_url(str(raw)) if name == "redlock_url" else repr(raw)
            problems.append(f"{name}={shown} must be {exc}")
    if values.get("url") is None:
        broker = conf.get("broker_url") or ""
        if isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss", "unix"):
            values["url"] = broker.split(";", 1)[0]
        elif not values.get("disable"):
            problems.append(
                "redlock_url is not set and the broker is not Redis: set "
                "app.conf.redlock_url = 'redis://host:6379/1' (or pass --redlock-url)"
            )
    for name, options in (values.get("tasks") or {}).items():
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
    return Settings(**values)


def _conf_keys(conf: Mapping[str, Any]) -> list[str]:
    try:
        return [k for k in conf if isinstance(k, str)]
    except TypeError:
        return []


# -- checking and resolving task options ------------------------------------------------------
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
    duplicate: PublishPolicy = DUPLICATE_POLICIES["return"]
    #: With "replace": seconds without a new call before the newest one runs.
    debounce: float | None = None
    #: How long the hold of a message that never runs may live (+ its ETA/countdown).
    enqueue_ttl: float = 3600.0


def resolve(cls: type, spec: TaskSpec, settings: Settings) -> TaskOptions:
    """*cls*'s options: the value it sets, else its setting's (both checked already)."""
    values: dict[str, Any] = {}
    for name, option in OPTIONS.items():
        value = declared(cls, name)
        unset = value is None and not (name in NONE_MEANS_SOMETHING and is_set(cls, name))
        if unset and option.setting is not None:
            value = getattr(settings, option.setting)
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
