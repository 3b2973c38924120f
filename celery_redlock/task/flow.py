"""The rules of one run of a task (its ``lock_limits``: :mod:`celery_redlock.app.rules`): each
key rendered from the call's arguments as ``lock_key`` is, each cost computed, as the
:class:`~celery_redlock.core.backend_types.Rule` values its lock takes with it; and the
check, at decoration, that every template names an argument the task takes.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from ..app.rules import Limit, Rate, check_cost
from ..core import ConfigError, KeyTemplate
from ..core.backend_types import Rule
from ..core.keys import lock_keys, permit_keys
from .naming import check_fields, render_key

__all__ = ["check_limits", "first_rate_key", "hold_rules", "rules_for"]


def check_limits(task_name: str, limits: Sequence[Limit | Rate], sig: inspect.Signature) -> None:
    """ConfigError when a rule's key or cost names an argument the task does not take."""
    for rule in limits:
        if isinstance(rule.template, KeyTemplate):
            check_fields(task_name, f"lock_limits key {rule.key!r}", rule.template, sig)
        if isinstance(rule, Rate) and isinstance(rule.units, KeyTemplate):
            check_fields(task_name, f"lock_limits cost {rule.cost!r}", rule.units, sig)


def rules_for(
    task: Any, options: Any, args: tuple[Any, ...], kwargs: dict[str, Any], prefix: str
) -> tuple[Rule, ...]:
    """The rules of one run of *task*: each key rendered from the call's arguments, each
    cost computed, in one canonical order (by name, then kind)."""
    out = []
    for rule in options.limits:
        name = render_key(task, rule.template, args, kwargs, options, what="lock_limits key")
        if isinstance(rule, Limit):
            # A Limit of one is the mutex of its name, as Semaphore(limit=1) is.
            keys = lock_keys(name, prefix) if rule.limit == 1 else permit_keys(name, prefix)
            out.append(Rule(keys, limit=rule.limit))
            continue
        cost = _cost_of(task, rule, args, kwargs, options)
        out.append(
            Rule(lock_keys(name, prefix), interval_us=rule.interval_us, burst=rule.burst, cost=cost)
        )
    rates = [r.name for r in out if r.is_rate]
    if len(set(rates)) < len(rates):
        twice = sorted({n for n in rates if rates.count(n) > 1})
        raise ConfigError(
            f"task {task.name!r}: two Rate rules of lock_limits name {twice[0]!r} for this "
            "call; one Rate per key (give it the sum of the costs)"
        )
    return tuple(sorted(out, key=lambda r: (r.name, r.is_rate)))


def _cost_of(
    task: Any, rule: Rate, args: tuple[Any, ...], kwargs: dict[str, Any], options: Any
) -> int:
    cost = rule.units
    what = f"task {task.name!r}: Rate({rule.key!r}, {rule.rate!r})"
    if isinstance(cost, int):
        return cost
    if isinstance(cost, KeyTemplate):
        value: Any = render_key(task, cost, args, kwargs, options, what="lock_limits cost")
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(
                f"{what}: cost {rule.cost!r} is {value!r} for this call, not a whole number"
            ) from None
    else:
        value = cost(*args, **kwargs)
    return check_cost(what, value, rule.burst)


def hold_rules(
    lock: Any, task: Any, options: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Make *lock* (a run's lock of *task*) take the run's rules with it and obey the
    operator controls of its names (where its backend has FlowControl)."""
    rules = rules_for(task, options, args, kwargs, lock.key_prefix) if options.limits else ()
    lock.hold_with(rules, controlled=True)


def first_rate_key(
    task: Any, options: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """The key of the task's first ``Rate`` rule for this call (None: it has none)."""
    for rule in options.limits:
        if isinstance(rule, Rate):
            return render_key(task, rule.template, args, kwargs, options, what="lock_limits key")
    return None
