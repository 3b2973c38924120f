"""Configuration: the ``lock_*`` task options and the ``redlock_*`` app settings, one row
each, checked in one pass each.

* :class:`Settings` holds the rows: a typed field each, made by
  :func:`~celery_redlock.app.rows.row`, which declares once its setting, its task option,
  its check, default and help, and its worker flag. :data:`SETTINGS` (setting -> row),
  :data:`OPTIONS` (task option -> row) and the worker flags
  (:mod:`celery_redlock.app.flags`) derive from them (:func:`~celery_redlock.app.rows.table_of`).
* :func:`load_settings` reads the settings from ``app.conf`` (worker flags override) and
  lists every problem in one :class:`ConfigError`.
* A task class's options are checked when the class is made (:func:`check_declared`)
  and resolved against its app's settings once (:func:`resolve`, cached per app by
  ``AppState.options_for``) into :class:`TaskOptions`: the same fields, plus its key and
  its three policies as objects (from the registries of :mod:`celery_redlock.app.policies`).

Settings belong to the app: two apps in one process keep their own values, clients and
defaults.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click

from ..core import ConfigError, KeyTemplate
from ..core.backend import FlowControl, Permits, QueuedHolds, Rates
from ..core.connect import mask_url
from ..core.lease import DEFAULT_FENCE_TTL
from .checks import (
    boolean,
    choice,
    class_or_path,
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
from .policies import CONTENDED, DUPLICATE, LOST, Policies
from .rows import Flag, Needs, Row, row, table_of
from .rules import limits_option

__all__ = [
    "LOCK_ON",
    "OPTIONS",
    "SETTINGS",
    "Settings",
    "StartupConfigError",
    "TaskOptions",
    "TaskSpec",
    "capabilities_needed",
    "check_declared",
    "check_task_option",
    "declared",
    "load_settings",
    "resolve",
]


class StartupConfigError(ConfigError, click.ClickException):
    """A bad setting or task option: ``celery worker`` (or ``beat``) prints one line,
    ``Error: <what is wrong and the fix>``, and exits 1, with no traceback.

    Still a :class:`ConfigError` for code that catches it (a ``.delay()`` on a lazily
    created task, code that starts workers itself)."""

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)


#: ``lock_on``: when the lock is held. "run": while the body runs; "enqueue": from publish
#: until the body starts (the run itself is locked as with "run"); "enqueue+run": from
#: publish until the run ends (one queued-or-running per key). See celery_redlock.task.dedup.
LOCK_ON = ("run", "enqueue", "enqueue+run")

#: The class attribute that marks the class holding the options' unset defaults (None):
#: ``LockedTask`` sets every option to None and this to True in its own namespace.
DEFAULTS_MARK = "redlock_option_defaults"


# -- the rows ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """The ``redlock_*`` settings of one app, checked (worker flags applied), and every
    task option's default: one row per field (see :mod:`celery_redlock.app.rows`). The field
    ``ttl`` is the setting ``redlock_ttl`` and the task option ``lock_ttl``; a field whose
    row is a task option only (``max_hold``) holds that option's default."""

    url: str | list[str] | None = row(
        url_option,
        None,
        "Redis URL where task locks live, or a list of them for Redlock over independent "
        "masters (default: the broker URL when it is redis://)",
        task=False,
        flag=Flag(
            multiple=True,
            env=True,
            cli=True,
            note="Repeat the flag to give a list. Also read from REDLOCK_URL (a list: "
            "URLs separated by spaces).",
        ),
    )
    ttl: float = row(
        lease(),
        30.0,
        "Default lock lease in seconds (kept alive while tasks run)",
        flag=Flag(type=float),
    )
    default_key: Any = row(
        key_option,
        None,
        "Lock key of a task that sets none (default: the task name)",
        task="lock_key",
    )
    on_contended: str = row(CONTENDED, "retry", "What a run gets when its key is held")
    on_lost: str = row(LOST, "raise", "What a running task gets when its lock is lost")
    max_retries: int = row(whole_number, 50, "Contention retries before a run fails")
    retry_backoff: float = row(seconds(0), 1.0, "First contention retry delay in seconds")
    retry_backoff_max: float = row(seconds(0), 60.0, "Longest contention retry delay in seconds")
    retry_jitter: bool = row(boolean, True, "Randomise contention retry delays")
    wait_timeout: float = row(seconds(0), 30.0, "How long lock_on_contended='wait' blocks")
    max_hold: float | None = row(
        lease(allow_none=True, minimum=0.001), None, "Cap on a run's total hold time", setting=False
    )
    limit: int | None = row(
        limit_option,
        1,
        "Runs of one key at once (1: a mutex; None: no cap)",
        none_is_value=True,
        needs=Needs(Permits, lambda limit: limit is not None and limit > 1),
    )
    rate: str | None = row(
        rate_option,
        None,
        "Run starts of one key per period ('10/m')",
        needs=Needs(Rates, lambda rate: rate is not None),
    )
    rate_burst: int = row(
        positive_number, 1, "Run starts allowed at once after an idle spell", setting=False
    )
    limits: tuple[Any, ...] = row(
        limits_option,
        (),
        "More holds per run, taken with its lock, all or nothing: a list of Limit(key, n) "
        "and Rate(key, rate, burst=, cost=)",
        setting=False,
        needs=Needs(FlowControl, bool),
    )
    lock_on: str = row(
        choice(*LOCK_ON),
        "run",
        "When locks are held, for tasks that do not set lock_on: run (default), enqueue or "
        "enqueue+run",
        task="lock_on",
        needs=Needs(QueuedHolds, lambda lock_on: lock_on != "run"),
        flag=Flag(
            note="It also sets what this worker publishes. Publishers must use the same "
            "setting to de-duplicate at publish; the worker checks messages that were sent "
            "without it."
        ),
    )
    on_duplicate: str = row(
        DUPLICATE,
        "return",
        "What a publish that finds the key queued or running does",
        setting="redlock_lock_on_duplicate",
        enqueue_only=True,
    )
    debounce: float | None = row(
        seconds(0, allow_none=True, strict=True),
        None,
        "With lock_on_duplicate='replace': seconds without a new call before the run starts",
        setting=False,
        enqueue_only=True,
    )
    enqueue_ttl: float = row(
        lease(minimum=0.001),
        3600.0,
        "Longest life of the hold of a message that never runs (+ its ETA)",
        setting="redlock_lock_enqueue_ttl",
        enqueue_only=True,
    )
    fail_open: bool = row(
        boolean, False, "Run unlocked when Redis is down (not advised)", task=False
    )
    key_prefix: str = row(text, "redlock:", "Prefix of every lock key", task=False)
    fence_ttl: float | None = row(
        lease(allow_none=True, minimum=0.001),
        DEFAULT_FENCE_TTL,
        "A lock's fence counter expires after this long unused (None: never)",
        task=False,
    )
    tasks: dict[str, Any] = row(
        mapping, {}, "Task-name patterns -> lock options, for tasks without base", task=False
    )
    disable: bool = row(
        boolean,
        False,
        "Run locked tasks WITHOUT locks (a loud warning is logged)",
        task=False,
        flag=Flag(switch=True),
    )
    beat_ttl: float | None = row(lease(allow_none=True), None, "Beat leader lease", task=False)
    beat_lock_name: str | None = row(text, None, "Name of the beat leader lock", task=False)
    beat_scheduler: Any = row(
        class_or_path,
        None,
        "The scheduler LeaderScheduler leads: a celery.beat.Scheduler subclass or its import "
        "path (default: Celery's in-memory Scheduler)",
        task=False,
    )
    client_options: dict[str, Any] = row(mapping, {}, "Extra redis-py client options", task=False)
    event_log: bool = row(
        boolean,
        True,
        "Record task runs' lock events in a capped stream the board reads",
        task=False,
    )

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


TABLE = table_of(Settings)
#: ``redlock_*`` setting -> its row.
SETTINGS: dict[str, Row] = TABLE.settings
#: ``lock_*`` task option -> its row.
OPTIONS: dict[str, Row] = TABLE.options


def load_settings(
    conf: Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
    settings_class: type[Settings] = Settings,
) -> Settings:
    """Read, check and complete the ``redlock_*`` settings from a Celery ``app.conf``
    (the rows of *settings_class*).

    Unknown ``redlock_*`` names (likely typos) and wrong types raise one
    :class:`ConfigError` that lists every problem.
    """
    table = table_of(settings_class)
    problems: list[str] = []
    values: dict[str, Any] = {}
    given: dict[str, Any] = {}
    for key, name in _our_keys(conf):
        if name not in table.settings:
            guess = difflib.get_close_matches(name, table.settings, n=1)
            hint = f" (did you mean {_spelled_as(key, name, guess[0])!r}?)" if guess else ""
            problems.append(f"unknown setting {key!r}{hint}")
        given[name] = conf.get(key)
    given.update({k: v for k, v in (overrides or {}).items() if v is not None})
    for name, spec in table.settings.items():
        raw = given.get(name)
        if raw is None:
            continue
        try:
            values[spec.name] = spec.check(raw)
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
                check_task_option(name, option, value, settings_class)
            except ConfigError as exc:
                problems.append(str(exc))
    if problems:
        raise ConfigError("celery-redlock settings: " + "; ".join(problems))
    return settings_class(**values)


def _our_keys(conf: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key as written, setting name) of each ``redlock_*`` key of *conf*, where Celery
    reads its own settings: ``app.conf.redlock_url``, and under a namespace
    (``config_from_object("django.conf:settings", namespace="CELERY")``)
    ``CELERY_REDLOCK_URL``, in either case."""
    try:
        keys = [k for k in conf if isinstance(k, str)]  # this loads a lazy app.conf
    except TypeError:
        return []
    prefix = getattr(conf, "prefix", None)  # Celery's namespace, as its Settings keep it
    prefix = prefix.lower() if isinstance(prefix, str) else ""
    found = []
    for key in keys:
        name = key.lower()
        if prefix and name.startswith(prefix):
            name = name[len(prefix) :]
        if name.startswith("redlock_"):
            found.append((key, name))
    return found


def _spelled_as(key: str, name: str, other: str) -> str:
    """Setting *other* written as *key* writes *name* (its namespace, its case)."""
    spelled = key[: len(key) - len(name)] + other
    return spelled.upper() if key.isupper() else spelled


# -- checking and resolving task options ------------------------------------------------------
def check_task_option(
    task_name: str, option: str, value: Any, settings_class: type[Settings] = Settings
) -> Any:
    """Validate one task option (a row of *settings_class*); ConfigError names the task,
    the option and the fix."""
    options = table_of(settings_class).options
    spec = options.get(option)
    if spec is None:
        guess = difflib.get_close_matches(option, options, n=1)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise ConfigError(
            f"task {task_name!r}: unknown lock option {option!r}{hint} "
            f"(known: {', '.join(sorted(options))})"
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
        if declared(cls, "lock_limit") is None and declared(cls, "lock_limits"):
            check_limits_need_a_lock(task_name)
    check_combination(
        task_name,
        declared(cls, "lock_on"),
        declared(cls, "lock_on_duplicate"),
        declared(cls, "lock_debounce"),
        given=[o for o, r in OPTIONS.items() if r.enqueue_only and declared(cls, o) is not None],
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


def check_limits_need_a_lock(task_name: str) -> None:
    """ConfigError for ``lock_limits`` on a task with ``lock_limit=None`` (no lock)."""
    raise ConfigError(
        f"task {task_name!r}: lock_limits must be used with the task's own lock "
        "(lock_limit >= 1: its rules are taken with it); it has lock_limit=None"
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


@dataclass(frozen=True, kw_only=True)
class TaskOptions(Settings):
    """A task class's lock options resolved against its app's settings: every row, with
    the task's own value where it sets one (``ttl`` is its ``lock_ttl``, else
    ``redlock_ttl``), plus its key, its body's signature and its policies as objects."""

    #: None (the task name), a fixed name, a KeyTemplate or a callable.
    key: Any
    signature: inspect.Signature
    #: ``on_contended``'s strategy (a ``contention.Strategy``).
    contended: Any
    #: ``on_duplicate``'s publish policy (a ``contention.PublishPolicy``).
    duplicate: Any
    #: ``on_lost``'s policy (an ``interrupt.LostPolicy``).
    lost: Any


def resolve(cls: type, spec: TaskSpec, settings: Settings) -> TaskOptions:
    """*cls*'s options: the value it sets, else its setting's (both checked already); each
    policy name resolved to its object (the row's check is its registry)."""
    values = {r.name: getattr(settings, r.name) for r in TABLE.rows}
    policies: dict[str, Any] = {}
    for option, r in OPTIONS.items():
        value = declared(cls, option)
        if value is not None or (r.none_is_value and is_set(cls, option)):
            values[r.name] = r.check(value)
        if isinstance(r.check, Policies):  # once here, so a run never looks a name up
            policies[r.check.attribute] = r.check[values[r.name]]
    task_name = getattr(cls, "name", None) or cls.__name__
    check_rate_needed(
        task_name,
        values["rate"],
        no_cap=values["limit"] is None,
        burst=declared(cls, "lock_rate_burst"),
    )
    check_enqueue_limit(task_name, values["lock_on"], values["limit"])
    if values["limits"] and values["limit"] is None:
        check_limits_need_a_lock(task_name)
    key = spec.key
    if key is None:
        default = values["default_key"]
        key = KeyTemplate(default) if isinstance(default, str) else default
    return TaskOptions(**values, **policies, key=key, signature=spec.signature)


def capabilities_needed(options: TaskOptions) -> list[tuple[str, type]]:
    """What the lock store must be able to keep for a task with *options* (each as the
    option and value that need it, and the capability; the rows say which): checked at
    worker start."""
    needed: list[tuple[str, type]] = []
    for name, spec in OPTIONS.items():
        value = getattr(options, spec.name)
        if spec.needs is not None and spec.needs.when(value):
            needed.append((f"{name}={value!r}", spec.needs.capability))
    return needed
