"""Each option is one row, and everything else derives from the rows: an option added as
one row is a setting, a task option and a worker flag; each policy kind's names are the
ones its registry holds, resolved to their objects once per task; settings come back
typed. No server (the one run below is a direct call on the memory backend)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from celery import Celery

from celery_redlock import LockedTask
from celery_redlock.app.checks import seconds
from celery_redlock.app.config import (
    OPTIONS,
    SETTINGS,
    Settings,
    TaskSpec,
    check_task_option,
    load_settings,
    resolve,
)
from celery_redlock.app.flags import flag_overrides, worker_flags
from celery_redlock.app.policies import CONTENDED, DUPLICATE, LOST, POLICIES, Policies
from celery_redlock.app.rows import Flag, row, table_of
from celery_redlock.app.state import state_for
from celery_redlock.core import ConfigError
from celery_redlock.task.contention import PublishPolicy, Strategy
from celery_redlock.task.interrupt import LostPolicy

URL = {"redlock_url": "memory://config"}
PACKAGE = Path(__file__).resolve().parents[2] / "celery_redlock"


@dataclasses.dataclass(frozen=True)
class WithGrace(Settings):
    """The settings with one row more: a setting, a task option and a worker flag."""

    grace: float = row(
        seconds(0), 5.0, "Seconds a run may overrun its lease", flag=Flag(type=float)
    )


def _parse(flags: list[click.Option], argv: list[str]) -> dict[str, Any]:
    """What the bootstep gets for *argv* on a command with *flags* (as Celery's worker)."""
    command = click.Command("worker", params=flags, callback=lambda **given: given)
    given: dict[str, Any] = command.main(argv, standalone_mode=False)
    return given


# -- one row: a setting, a task option, a worker flag -------------------------------------
def test_a_row_added_to_settings_is_a_setting_that_loading_checks() -> None:
    """One field made by row() is the setting redlock_<field>: read, typed, checked with
    its rule, its default when unset, and unknown to the settings without that row."""
    assert table_of(WithGrace).settings["redlock_grace"].name == "grace"
    loaded = load_settings({**URL, "redlock_grace": 2}, settings_class=WithGrace)
    assert isinstance(loaded, WithGrace) and loaded.grace == 2.0
    assert isinstance(loaded.grace, float)
    assert load_settings(URL, settings_class=WithGrace).grace == 5.0
    with pytest.raises(ConfigError, match=r"redlock_grace=-1 must be >= 0"):
        load_settings({**URL, "redlock_grace": -1}, settings_class=WithGrace)
    with pytest.raises(ConfigError, match=r"unknown setting 'redlock_grace'"):
        load_settings({**URL, "redlock_grace": 2})


def test_a_row_added_to_settings_is_a_task_option_that_the_option_check_knows() -> None:
    """The same row is the task option lock_<field>: accepted and normalised by its
    check, refused with its rule (on a task and in redlock_tasks), and unknown to the
    settings without that row."""
    assert check_task_option("t", "lock_grace", 1, WithGrace) == 1.0
    with pytest.raises(ConfigError, match=r"'t': lock_grace='x' is not valid; it must be a number"):
        check_task_option("t", "lock_grace", "x", WithGrace)
    with pytest.raises(ConfigError, match=r"'t': unknown lock option 'lock_grace'"):
        check_task_option("t", "lock_grace", 1)
    tasks = {"proj.*": {"lock_grace": -2}}
    with pytest.raises(ConfigError, match=r"'proj\.\*': lock_grace=-2 is not valid"):
        load_settings({**URL, "redlock_tasks": tasks}, settings_class=WithGrace)


def test_a_row_added_to_settings_is_a_worker_flag_that_overrides_its_setting() -> None:
    """The same row with a Flag is --redlock-<field>, of the flag's type, its help the
    row's plus what it overrides; given on the command line it overrides the setting."""
    flags = {f.name: f for f in worker_flags(WithGrace)}
    assert "redlock_grace" not in {f.name for f in worker_flags()}
    flag = flags["redlock_grace"]
    assert flag.opts == ["--redlock-grace"]
    assert flag.type is click.FLOAT and not flag.multiple and not flag.is_flag
    assert flag.help is not None
    assert flag.help.startswith("Seconds a run may overrun its lease; ")
    assert "overrides app.conf.redlock_grace for this worker" in flag.help
    given = _parse(list(flags.values()), ["--redlock-grace", "2.5"])
    overrides = flag_overrides(given, WithGrace)
    assert overrides == {"redlock_grace": 2.5}
    assert load_settings(URL, overrides, WithGrace).grace == 2.5
    assert flag_overrides(_parse(list(flags.values()), []), WithGrace) == {}
    with pytest.raises(click.BadParameter):
        _parse(list(flags.values()), ["--redlock-grace", "soon"])


def test_a_field_that_is_not_a_row_or_names_a_taken_option_is_refused() -> None:
    """Every field of a settings class is a row, and no two rows share a name: a plain
    field, or a row whose task option another row has, is a TypeError when derived."""

    @dataclasses.dataclass(frozen=True)
    class Plain(Settings):
        grace: float = 5.0

    @dataclasses.dataclass(frozen=True)
    class Twice(Settings):
        grace: float = row(seconds(0), 5.0, "Another lease", task="lock_ttl")

    with pytest.raises(TypeError, match=r"Plain\.grace is not a row"):
        table_of(Plain)
    with pytest.raises(TypeError, match="two rows name the same"):
        table_of(Twice)


def test_the_public_names_are_the_ones_the_rows_give() -> None:
    """The rows give exactly the settings and task options users type (DESIGN.md), the
    three older names included (redlock_lock_on, lock_key for redlock_default_key, ...)."""
    assert set(SETTINGS) == {
        *(f"redlock_{n}" for n in ("url", "ttl", "default_key", "on_contended", "on_lost")),
        *(f"redlock_{n}" for n in ("max_retries", "retry_backoff", "retry_backoff_max")),
        *(f"redlock_{n}" for n in ("retry_jitter", "wait_timeout", "limit", "rate")),
        *(f"redlock_{n}" for n in ("lock_on", "lock_on_duplicate", "lock_enqueue_ttl")),
        *(f"redlock_{n}" for n in ("fail_open", "key_prefix", "fence_ttl", "tasks")),
        *(f"redlock_{n}" for n in ("disable", "beat_ttl", "beat_lock_name", "client_options")),
        "redlock_beat_scheduler",  # DESIGN.md, Beat: the scheduler LeaderScheduler leads
        "redlock_event_log",  # DESIGN.md, The board: the events workers record for it
    }
    assert set(OPTIONS) == {
        *(f"lock_{n}" for n in ("key", "ttl", "on_contended", "on_lost", "max_retries")),
        *(f"lock_{n}" for n in ("retry_backoff", "retry_backoff_max", "retry_jitter")),
        *(f"lock_{n}" for n in ("wait_timeout", "max_hold", "limit", "rate", "rate_burst")),
        *(f"lock_{n}" for n in ("on", "on_duplicate", "debounce", "enqueue_ttl")),
        "lock_limits",  # DESIGN.md, Flow control
    }
    assert OPTIONS["lock_key"] is SETTINGS["redlock_default_key"]
    assert OPTIONS["lock_on_duplicate"] is SETTINGS["redlock_lock_on_duplicate"]


def test_the_worker_flags_keep_their_names_types_and_values() -> None:
    """--redlock-url repeated gives a list (Redlock) and once a string; --redlock-ttl is a
    float; --redlock-lock-on offers lock_on's values; --redlock-disable is a switch; a
    flag not given overrides nothing. They are on Celery's worker command."""
    from celery.bin.worker import worker as worker_command  # noqa: PLC0415

    flags = worker_flags()
    assert [f.opts for f in flags] == [
        ["--redlock-url"],
        ["--redlock-ttl"],
        ["--redlock-lock-on"],
        ["--redlock-disable"],
    ]
    assert {f.name for f in flags} <= {p.name for p in worker_command.params}
    many = _parse(flags, ["--redlock-url", "redis://a/1", "--redlock-url", "redis://b/1"])
    assert flag_overrides(many) == {"redlock_url": ["redis://a/1", "redis://b/1"]}
    once = _parse(flags, ["--redlock-url", "redis://a/1", "--redlock-ttl", "7"])
    assert flag_overrides(once) == {"redlock_url": "redis://a/1", "redlock_ttl": 7.0}
    assert flag_overrides(_parse(flags, ["--redlock-disable", "--redlock-lock-on", "enqueue"])) == {
        "redlock_disable": True,
        "redlock_lock_on": "enqueue",
    }
    assert flag_overrides(_parse(flags, [])) == {}
    with pytest.raises(click.BadParameter, match="run"):
        _parse(flags, ["--redlock-lock-on", "later"])


# -- policies: registered once, resolved once ----------------------------------------------
@pytest.mark.parametrize("option", sorted(POLICIES))
def test_a_policy_option_accepts_exactly_the_names_in_its_registry(option: str) -> None:
    """A new strategy or policy is one registration: the option and its setting accept
    every registered name, and refuse any other, listing them in registration order."""
    registry = POLICIES[option]
    assert OPTIONS[option].check is registry
    for name in registry.names:
        assert check_task_option("t", option, name) == name
    with pytest.raises(ConfigError) as caught:
        check_task_option("t", option, "no-such-policy")
    assert "one of " + ", ".join(repr(n) for n in registry.names) in str(caught.value)
    row_of = OPTIONS[option]
    assert row_of.default in registry.names
    for name in registry.names:
        assert getattr(load_settings({**URL, row_of.setting: name}), row_of.name) == name


def test_a_registered_policy_is_accepted_by_its_row_with_no_other_change() -> None:
    """A registry is its row's check: registering one more name is all a row needs to
    accept it; a name registered twice is refused."""

    @dataclasses.dataclass(frozen=True)
    class Speed:
        name: str

    speeds: Policies[Speed] = Policies("lock_speed", "speed")

    @dataclasses.dataclass(frozen=True)
    class WithSpeed(Settings):
        speed: str = row(speeds, "slow", "How fast", setting=False)

    speeds.register(Speed("slow"))
    with pytest.raises(
        ConfigError, match=r"lock_speed='fast' is not valid; it must be one of 'slow'$"
    ):
        check_task_option("t", "lock_speed", "fast", WithSpeed)
    fast = speeds.register(Speed("fast"))
    assert check_task_option("t", "lock_speed", "fast", WithSpeed) == "fast"
    assert speeds["fast"] is fast and speeds.names == ("slow", "fast")
    with pytest.raises(ValueError, match="registered already"):
        speeds.register(Speed("fast"))


class _Defaults:
    """A task class's unset options, as LockedTask holds them."""

    redlock_option_defaults = True
    name = "proj.job"


for _option in OPTIONS:
    setattr(_Defaults, _option, None)


def test_each_policy_kind_resolves_to_its_object_once_with_the_options() -> None:
    """resolve() gives options.contended, .duplicate and .lost: the registered objects of
    the task's names, or of the settings' when the task sets none."""

    class Job(_Defaults):
        lock_on_contended = "skip"
        lock_on_lost = "warn"
        lock_on_duplicate = "replace"
        lock_on = "enqueue"

    spec = TaskSpec(signature=inspect.Signature(), key=None)
    options = resolve(Job, spec, load_settings(URL))
    assert isinstance(options.contended, Strategy) and options.contended is CONTENDED["skip"]
    assert (
        isinstance(options.duplicate, PublishPolicy) and options.duplicate is DUPLICATE["replace"]
    )
    assert isinstance(options.lost, LostPolicy) and options.lost is LOST["warn"]
    assert not options.lost.interrupts
    assert (options.on_contended, options.on_lost, options.on_duplicate) == (
        "skip",
        "warn",
        "replace",
    )
    settings = load_settings(
        {**URL, "redlock_on_contended": "wait", "redlock_lock_on_duplicate": "queue_one"}
    )
    defaults = resolve(_Defaults, spec, settings)
    assert defaults.contended is CONTENDED["wait"] and defaults.contended.waits
    assert defaults.duplicate is DUPLICATE["queue_one"]
    assert defaults.lost is LOST["raise"] and defaults.lost.interrupts
    assert CONTENDED["retry"].eager is CONTENDED["wait"], "an eager retry waits instead"


def test_a_run_uses_the_strategy_resolved_with_its_options_not_a_name() -> None:
    """A refused run applies options.contended itself: a strategy put there (its name
    unchanged) decides the run; nothing looks the name up again."""
    app = Celery("policy-run", broker="memory://", set_as_current=False)
    app.conf.redlock_url = "memory://policy-run"
    app.finalize()

    @app.task(base=LockedTask, shared=False, name="policy.job", lock_key="k")
    def job() -> str:
        return "ran"

    state = state_for(app)
    refused: list[str] = []

    def refuse(refusal: Any) -> str:
        refused.append(refusal.lock.name)
        return "refused"

    options = state.options_for(job)
    assert options.contended is CONTENDED["retry"]
    state.task_options[type(job)] = dataclasses.replace(
        options, contended=Strategy("retry", refuse)
    )
    holder = state.make_lock("k", 30.0, auto_renew=False)
    assert holder.acquire(blocking=False)
    try:
        assert job() == "refused"
    finally:
        holder.release()
        app.close()
    assert refused == ["k"]
    assert job() == "ran"


def test_a_fresh_interpreter_importing_only_config_checks_every_policy_name() -> None:
    """Importing celery_redlock.app.config alone still fills the registries (the package's
    __init__ imports the run side): every kind accepts its names and lists them."""
    code = (
        "from celery_redlock.app.config import check_task_option as check\n"
        "print(check('t', 'lock_on_contended', 'skip'), check('t', 'lock_on_lost', 'warn'),"
        " check('t', 'lock_on_duplicate', 'queue_one'))\n"
        "for option in ('lock_on_contended', 'lock_on_lost', 'lock_on_duplicate'):\n"
        "    try:\n"
        "        check('t', option, 'nope')\n"
        "    except Exception as exc:\n"
        "        print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "skip warn queue_one"
    assert lines[1].endswith("must be one of 'retry', 'skip', 'wait', 'raise'")
    assert lines[2].endswith("must be one of 'raise', 'warn'")
    assert lines[3].endswith("must be one of 'return', 'raise', 'replace', 'queue_one'")


def test_the_configuration_side_imports_nothing_from_the_run_side() -> None:
    """config.py, rows.py, policies.py, checks.py and flags.py import no module that runs
    tasks (task/, worker/, install, app/state.py): the run side fills the
    registries, never the other way round."""
    run_side = ("task", "worker", "install", "app.state")
    for module in ("config", "rows", "policies", "checks", "flags"):
        tree = ast.parse((PACKAGE / "app" / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                # the import's target inside celery_redlock/, from app/<module>.py
                base = ["app"][: 2 - node.level]
                targets = [
                    ".".join([*base, *filter(None, [node.module, a.name])]) for a in node.names
                ]
                for target in targets:
                    assert not target.startswith(run_side), f"{module}.py imports {target}"


# -- settings ---------------------------------------------------------------------------------
def test_settings_are_typed_attributes_with_their_defaults_and_checked_values() -> None:
    """Code reads settings.key_prefix, never settings["redlock_key_prefix"]: the values
    are the checked ones (a tuple of one URL becomes the URL, ints become floats)."""
    settings = load_settings(
        {"redlock_url": ("memory://one",), "redlock_ttl": 5, "redlock_key_prefix": "p:"}
    )
    assert settings.url == "memory://one"
    assert settings.ttl == 5.0 and isinstance(settings.ttl, float)
    assert settings.key_prefix == "p:"
    assert settings.max_retries == 50 and settings.lock_on == "run"
    assert settings.tasks == {} and settings.tasks is not Settings().tasks


def test_every_problem_in_the_settings_is_listed_in_one_error() -> None:
    """A typo gets a did-you-mean and a bad value its rule, in one ConfigError."""
    with pytest.raises(ConfigError) as caught:
        load_settings({**URL, "redlock_ttll": 5, "redlock_max_retries": -1})
    text = str(caught.value)
    assert "unknown setting 'redlock_ttll' (did you mean 'redlock_ttl'?)" in text
    assert "redlock_max_retries=-1 must be a whole number >= 0" in text


def test_a_disabled_app_needs_no_url_but_asking_for_it_says_how_to_set_one() -> None:
    """redlock_disable lets an app without a Redis broker start; code that still asks
    where locks live gets the fix, not an AttributeError or None."""
    settings = load_settings({"broker_url": "amqp://", "redlock_disable": True})
    assert settings.url is None
    with pytest.raises(ConfigError, match="redlock_url = 'redis://host:6379/1'"):
        _ = settings.urls


def _namespaced(**settings: Any) -> Celery:
    """An app configured as a Django project is: a settings object under "CELERY_"."""
    source = type("DjangoSettings", (), settings)
    app = Celery("namespaced", set_as_current=False)
    app.config_from_object(source, namespace="CELERY")
    return app


def test_settings_under_celerys_namespace_are_read_as_celery_reads_its_own() -> None:
    """config_from_object(..., namespace="CELERY"): CELERY_REDLOCK_URL and
    CELERY_REDLOCK_TTL are the settings redlock_url and redlock_ttl, not the broker's URL
    and the default; lower-case app.conf keys still count beside them."""
    app = _namespaced(
        CELERY_BROKER_URL="redis://broker:6379/0",
        CELERY_REDLOCK_URL="redis://locks:6379/6",
        CELERY_REDLOCK_TTL=12,
    )
    settings = load_settings(app.conf)
    assert (settings.url, settings.ttl) == ("redis://locks:6379/6", 12.0)
    app.conf.redlock_max_retries = 3
    assert load_settings(app.conf).max_retries == 3


def test_a_misspelt_namespaced_setting_is_named_as_written_with_a_suggestion() -> None:
    """CELERY_REDLOCK_TLL is refused in one error naming it as the user wrote it and
    suggesting CELERY_REDLOCK_TTL; a misspelt plain key keeps its own form."""
    app = _namespaced(CELERY_REDLOCK_URL="memory://ns", CELERY_REDLOCK_TLL=3)
    with pytest.raises(ConfigError) as caught:
        load_settings(app.conf)
    assert "unknown setting 'CELERY_REDLOCK_TLL' (did you mean 'CELERY_REDLOCK_TTL'?)" in str(
        caught.value
    )
    with pytest.raises(ConfigError, match="'redlock_tll' \\(did you mean 'redlock_ttl'"):
        load_settings({**URL, "redlock_tll": 3})


def test_the_readme_names_every_setting() -> None:
    """Each redlock_* setting is named in the README (a row added without its line there
    fails here)."""
    readme = (PACKAGE.parent / "README.md").read_text()
    assert [name for name in SETTINGS if f"`{name}`" not in readme] == []


def test_a_bad_lock_key_is_refused_where_celery_makes_the_task() -> None:
    """On a finalized app Celery makes the task when it is defined: a lock_key naming an
    argument the task does not take raises there, one ConfigError naming the task, the
    option and the fix (a StartupConfigError, so a worker or beat prints just that line)."""
    app = Celery("badkey-unit", set_as_current=False)
    app.conf.redlock_url = "memory://badkey-unit"
    app.finalize()
    with pytest.raises(ConfigError) as caught:

        @app.task(name="proj.sync_user", base=LockedTask, lock_key="sync:<usr_id>", shared=False)
        def sync_user(user_id: int) -> None: ...

    assert isinstance(caught.value, click.ClickException)
    assert str(caught.value) == (
        "task 'proj.sync_user': lock_key 'sync:<usr_id>' names <usr_id>, but the "
        "task takes (user_id); did you mean <user_id>?"
    )


def test_leader_of_leads_any_scheduler_and_refuses_what_it_cannot_lead() -> None:
    """leader_of(cls) is a LeaderScheduler over cls (the same class each time); a path
    that does not resolve, a class that is not a Scheduler, or a leader are refused with
    the fix; LeaderScheduler made under redlock_beat_scheduler is that class's leader."""
    from celery.beat import PersistentScheduler, Scheduler  # noqa: PLC0415

    from celery_redlock.beat import LeaderScheduler, leader_of  # noqa: PLC0415

    led = leader_of(PersistentScheduler)
    assert led is leader_of("celery.beat:PersistentScheduler")
    assert issubclass(led, LeaderScheduler) and issubclass(led, PersistentScheduler)
    assert led.__name__ == "LeaderPersistentScheduler"
    assert leader_of(Scheduler) is LeaderScheduler
    for bad, said in (
        ("nowhere.at_all:Scheduler", "does not resolve"),
        (dict, "is not a celery.beat.Scheduler subclass"),
        (LeaderScheduler, "is a leader itself"),
    ):
        with pytest.raises(ConfigError, match=said) as caught:
            leader_of(bad)
        assert "django_celery_beat.schedulers:DatabaseScheduler" in str(caught.value)
    app = Celery("leads", set_as_current=False)
    app.conf.update(redlock_url="redis://127.0.0.1:1/0", redlock_beat_scheduler=str)
    with pytest.raises(ConfigError, match="redlock_beat_scheduler: <class 'str'> is not"):
        LeaderScheduler(app=app, lazy=True)
