"""One row per option, as Celery's ``celery/app/defaults.py`` declares each of its
settings once as an ``Option``.

A row is a field of the frozen ``Settings`` dataclass (:mod:`celery_redlock.app.config`),
made by :func:`row`: the field gives its name and type (checked by mypy), the row
everything else: its ``redlock_*`` setting (or none), its ``lock_*`` task option (or
none), its check, default and help, and how it is a worker flag (:class:`Flag`, or
none). The names follow the field: the setting is ``redlock_`` + the field's name and
the task option ``lock_`` + it, unless the row names them itself (an older public name).

:func:`table_of` derives the tables from a settings class: setting name -> row, task
option -> row, the rows that are worker flags. It is a function of the class, so a
class with one row more derives tables with that row in each (the tests do that).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Flag", "Needs", "Row", "Table", "row", "table_of"]

#: The key of a row in its field's metadata.
ROW = "celery_redlock.row"


@dataclass(frozen=True)
class Flag:
    """How a row is also a worker flag: ``--`` and its setting's name with dashes
    (``--redlock-ttl``), overriding that setting for that worker."""

    #: The value's type (``float``); None: the names the row's check accepts when it is a
    #: ``checks.Choice``, else text.
    type: type | None = None
    #: Repeatable: repeated, its values as a list; given once, the value.
    multiple: bool = False
    #: A switch, with no value: only "on" overrides the setting.
    switch: bool = False
    #: What only the flag's help says, after the row's help.
    note: str = ""
    #: Also read from the environment variable named as the setting, in upper case
    #: (``REDLOCK_URL``), where the flag is not given.
    env: bool = False
    #: Also an option of ``celery locks``, so that it looks where a worker so started
    #: keeps its locks.
    cli: bool = False


@dataclass(frozen=True)
class Needs:
    """What a value of a row asks of the lock store: a capability of the backend seam
    (:mod:`celery_redlock.core.backend`), when ``when(value)`` is true. A worker whose
    store lacks it stops at start-up naming the task and the option."""

    capability: type
    when: Callable[[Any], bool]


@dataclass(frozen=True)
class Row:
    """One option, declared once."""

    #: The ``Settings`` (and ``TaskOptions``) field.
    name: str
    #: The app setting (``"redlock_ttl"``), or None: a task option only.
    setting: str | None
    #: The task option (``"lock_ttl"``), or None: a setting only.
    option: str | None
    #: Returns the value to use, or raises TypeError/ValueError whose text completes
    #: "... must be <text>" (see :mod:`celery_redlock.app.checks`).
    check: Callable[[Any], Any]
    #: The value when neither the app nor the task sets it.
    default: Any
    #: What it means, one line (a worker flag's help starts with it).
    help: str
    #: How it is a worker flag, or None.
    flag: Flag | None = None
    #: A task that sets it to None means something (``lock_limit=None``: no cap), rather
    #: than "not set, use the setting".
    none_is_value: bool = False
    #: Only means something with ``lock_on="enqueue"`` or ``"enqueue+run"``.
    enqueue_only: bool = False
    #: What some of its values ask of the lock store, or None.
    needs: Needs | None = None

    @property
    def flag_name(self) -> str:
        """The worker flag's name (``--redlock-ttl``)."""
        return "--" + str(self.setting).replace("_", "-")


def _named(given: bool | str, prefix: str, name: str) -> str | None:
    if given is False:
        return None
    return given if isinstance(given, str) else prefix + name


def row(
    check: Callable[[Any], Any],
    default: Any,
    help: str,
    *,
    task: bool | str = True,
    setting: bool | str = True,
    flag: Flag | None = None,
    none_is_value: bool = False,
    enqueue_only: bool = False,
    needs: Needs | None = None,
) -> Any:
    """A ``Settings`` field that is one row: *task* and *setting* say whether it is a
    task option and an app setting (True: ``lock_`` / ``redlock_`` + the field's name; a
    string: that name; False: not one); *flag* makes it a worker flag; *needs* says which
    of its values need a capability of the lock store."""

    def named(name: str) -> Row:
        return Row(
            name=name,
            setting=_named(setting, "redlock_", name),
            option=_named(task, "lock_", name),
            check=check,
            default=default,
            help=help,
            flag=flag,
            none_is_value=none_is_value,
            enqueue_only=enqueue_only,
            needs=needs,
        )

    meta = {ROW: named}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Table:
    """The rows of one settings class, and what derives from them."""

    #: Every row, in field order.
    rows: tuple[Row, ...]
    #: ``redlock_*`` setting -> its row.
    settings: dict[str, Row]
    #: ``lock_*`` task option -> its row.
    options: dict[str, Row]
    #: The rows that are worker flags.
    flags: tuple[Row, ...]


#: Settings class -> its tables, derived on first use.
_tables: dict[type, Table] = {}


def table_of(cls: type) -> Table:
    """The tables of settings class *cls* (a dataclass whose every field is a :func:`row`);
    TypeError for a field that is not a row, a name used twice or a flag without a setting."""
    found = _tables.get(cls)
    if found is None:
        found = _tables[cls] = _derive(cls)
    return found


def _derive(cls: type) -> Table:
    rows: list[Row] = []
    for f in dataclasses.fields(cls):
        if ROW not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not a row: declare it with row()")
        made = f.metadata[ROW](f.name)
        if made.flag is not None and made.setting is None:
            raise TypeError(f"{cls.__name__}.{f.name}: a worker flag overrides a setting")
        rows.append(made)
    names = [n for r in rows for n in (r.setting, r.option) if n is not None]
    if len(set(names)) != len(names):
        raise TypeError(f"{cls.__name__}: two rows name the same setting or task option")
    settings = {r.setting: r for r in rows if r.setting is not None}
    options = {r.option: r for r in rows if r.option is not None}
    return Table(
        rows=tuple(rows),
        settings=settings,
        options=options,
        flags=tuple(r for r in rows if r.flag is not None),
    )
