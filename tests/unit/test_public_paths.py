"""The paths users type keep working, and every module the CHANGELOG lists as moved is at
its new path and gone from its old one."""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points
from pathlib import Path

import click
from celery.beat import Scheduler
from celery.utils.imports import symbol_by_name

import celery_redlock
from celery_redlock import worker
from celery_redlock.app.config import StartupConfigError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(celery_redlock.__file__).parent
MOVED = re.compile(r"^- `(celery_redlock[\w.]*)` -> `(celery_redlock[\w.]*)`", re.MULTILINE)


def _moved() -> list[tuple[str, str]]:
    """(old, new) for each line of the CHANGELOG's "Moved (issue 39)" list."""
    text = (ROOT / "CHANGELOG.md").read_text()
    section = text.split("### Moved (issue 39)", 1)[1].split("\n### ", 1)[0]
    return MOVED.findall(section)


def test_every_name_in_all_is_importable_from_the_package() -> None:
    """``from celery_redlock import X`` works for each X of ``__all__``."""
    assert len(celery_redlock.__all__) >= 28
    for name in celery_redlock.__all__:
        assert getattr(celery_redlock, name, None) is not None, name


def test_paths_users_put_in_configuration_resolve() -> None:
    """Beat's ``-S celery_redlock.beat:LeaderScheduler``, the test-mode module, the task
    class's ``Request`` and the worker's ``StartupConfigError`` resolve by their strings."""
    scheduler = symbol_by_name("celery_redlock.beat:LeaderScheduler")
    assert issubclass(scheduler, Scheduler)
    testing = importlib.import_module("celery_redlock.testing")
    for name in testing.__all__:
        assert getattr(testing, name, None) is not None, name
    request = symbol_by_name(celery_redlock.LockedTask.Request)
    assert request.__name__ == "LockedRequest"
    assert worker.StartupConfigError is StartupConfigError


def test_entry_points_load() -> None:
    """``celery locks`` (celery.commands) and the pytest plugin (pytest11) load from the
    installed metadata: the command is a click command, the plugin is the testing module."""
    (command,) = [ep for ep in entry_points(group="celery.commands") if ep.name == "locks"]
    assert command.value == "celery_redlock.cli:locks"
    assert isinstance(command.load(), click.Command)
    (plugin,) = [ep for ep in entry_points(group="pytest11") if ep.name == "celery_redlock"]
    assert plugin.value == "celery_redlock.testing"
    assert plugin.load() is importlib.import_module("celery_redlock.testing")


def test_each_moved_module_is_at_its_new_path_and_not_at_its_old() -> None:
    """The CHANGELOG's list of moved modules: each new path imports; no old module file
    is left (an old name that is now a folder is a package, not the old module)."""
    moved = _moved()
    assert len(moved) >= 25
    for old, new in moved:
        module = importlib.import_module(new)
        assert Path(str(module.__file__)).is_relative_to(PACKAGE), new
        relative = Path(*old.split(".")[1:])
        assert not (PACKAGE / relative).with_suffix(".py").exists(), f"{old} still exists"
