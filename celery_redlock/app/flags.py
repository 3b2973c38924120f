"""The worker flags, made from the rows whose :class:`~celery_redlock.app.rows.Flag` is set
(``--redlock-url``, ``--redlock-ttl``, ``--redlock-lock-on``, ``--redlock-disable``).

Each flag is ``--`` and its row's setting with dashes, so click hands its value to the
bootstep under the setting's own name (``redlock_ttl``): :func:`flag_overrides` turns
what the bootstep got into that worker's setting overrides, with no code per flag. Its
help is the row's, plus what the flag overrides; its type is the flag's, or the names
the row's check accepts (a :class:`~celery_redlock.app.checks.Choice`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from .checks import Choice
from .config import Settings
from .rows import Flag, Row, table_of

__all__ = ["flag_overrides", "locks_flags", "register_flags", "worker_flags"]


def worker_flags(settings_class: type[Settings] = Settings) -> list[click.Option]:
    """The click options of the rows of *settings_class* that are worker flags."""
    rows = table_of(settings_class).flags
    return [_option(r, r.flag, "this worker") for r in rows if r.flag is not None]


def locks_flags(settings_class: type[Settings] = Settings) -> list[click.Option]:
    """The worker flags that ``celery locks`` takes too (``--redlock-url``), made from the
    same rows: the command then looks where a worker started with them keeps its locks."""
    rows = table_of(settings_class).flags
    return [_option(r, r.flag, "this command") for r in rows if r.flag is not None and r.flag.cli]


def _option(r: Row, spec: Flag, who: str) -> click.Option:
    help_text = f"{r.help}; overrides app.conf.{r.setting} for {who}."
    if spec.note:
        help_text += " " + spec.note
    envvar = r.setting.upper() if spec.env and r.setting else None
    if spec.switch:
        return click.Option(
            [r.flag_name], is_flag=True, default=False, help=help_text, envvar=envvar
        )
    kind: Any = spec.type
    if kind is None and isinstance(r.check, Choice):
        kind = click.Choice(r.check.names)
    return click.Option(
        [r.flag_name],
        type=kind,
        multiple=spec.multiple,
        default=None,
        help=help_text,
        envvar=envvar,
    )


def flag_overrides(
    given: Mapping[str, Any], settings_class: type[Settings] = Settings
) -> dict[str, Any]:
    """The setting overrides of the worker flags in *given* (what the bootstep got, by
    setting name): a repeated flag gives a list, one given once its value, a switch only
    "on"; a flag not given overrides nothing."""
    overrides: dict[str, Any] = {}
    for r in table_of(settings_class).flags:
        spec, setting = r.flag, r.setting
        if spec is None or setting is None:
            continue  # not a flag (table_of lists only flags, each with a setting)
        value = given.get(setting)
        if spec.switch:
            if value:
                overrides[setting] = True
        elif spec.multiple:
            values = [value] if isinstance(value, str) else list(value or ())
            if values:
                overrides[setting] = values if len(values) > 1 else values[0]
        elif value is not None:
            overrides[setting] = value
    return overrides


def register_flags() -> None:
    """Put the worker flags on Celery's ``worker`` command (once; see the end of
    :mod:`celery_redlock.install` for why there)."""
    from celery.bin.worker import worker as worker_command  # noqa: PLC0415 - CLI only

    names = {p.name for p in worker_command.params}
    for flag in worker_flags():
        if flag.name not in names:
            worker_command.params.append(flag)
