"""The configuration tables are wired to each other: every task option's default names a
setting that exists, every policy name a table holds is accepted (and nothing else), and
settings come back typed. No server: these are the checks a new option, setting or
policy relies on to need one place only."""

from __future__ import annotations

import dataclasses

import pytest

from celery_redlock.config import OPTIONS, SETTINGS, Settings, check_task_option, load_settings
from celery_redlock.contention import DUPLICATE_POLICIES, STRATEGIES
from celery_redlock.core import ConfigError

URL = {"redlock_url": "memory://config"}


def test_every_option_with_a_default_names_a_settings_field_whose_check_is_the_options() -> None:
    """resolve() reads an option's default with getattr(settings, option.setting): a name
    that is no field would fail only when a task first runs."""
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    for name, option in OPTIONS.items():
        if option.setting is None:
            continue
        assert option.setting in fields, f"{name} defaults from unknown setting {option.setting}"
        assert fields[option.setting].metadata["check"] is option.check, name
    assert set(SETTINGS) == {f"redlock_{name}" for name in fields}


@pytest.mark.parametrize(
    ("option", "table"),
    [("lock_on_contended", STRATEGIES), ("lock_on_duplicate", DUPLICATE_POLICIES)],
)
def test_a_policy_option_accepts_exactly_the_names_in_its_table(option: str, table: dict) -> None:
    """A new strategy or publish policy is one table entry: the option and its setting
    accept it with no other change, and refuse a name not in the table, listing them."""
    for name in table:
        assert check_task_option("t", option, name) == name
    with pytest.raises(ConfigError) as caught:
        check_task_option("t", option, "no-such-policy")
    for name in table:
        assert repr(name) in str(caught.value)
    setting = f"redlock_{OPTIONS[option].setting}"
    for name in table:
        assert getattr(load_settings({**URL, setting: name}), OPTIONS[option].setting) == name


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
