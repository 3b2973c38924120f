"""Value checks shared by the ``lock_*`` task options and the ``redlock_*`` settings.

Each check returns the value to use or raises ``TypeError``/``ValueError`` whose text
completes "... must be <text>"; :mod:`celery_redlock.app.config` turns that into one
:class:`~celery_redlock.core.errors.ConfigError` naming the task or setting and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..core.errors import ConfigError
from ..core.lease import MAX_TTL_MS, MIN_TTL, ttl_to_ms
from ..core.ratelimit import parse_rate

__all__ = [
    "Choice",
    "boolean",
    "choice",
    "key_option",
    "lease",
    "limit_option",
    "mapping",
    "parse_duration",
    "positive_number",
    "rate_option",
    "seconds",
    "text",
    "url_option",
    "whole_number",
]


def seconds(
    minimum: float, *, allow_none: bool = False, strict: bool = False
) -> Callable[[Any], Any]:
    """A check for a number of seconds >= *minimum* (> with *strict*; None if allowed)."""

    def check(value: Any) -> Any:
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError("a number of seconds")
        if not math.isfinite(value):  # NaN passes every comparison below
            raise ValueError("a finite number of seconds")
        if value < minimum or (strict and value == minimum):
            raise ValueError(f"{'>' if strict else '>='} {minimum}")
        return float(value)

    return check


def lease(*, allow_none: bool = False, minimum: float = MIN_TTL) -> Callable[[Any], Any]:
    """A check for a lease Redis keeps: seconds in whole milliseconds, from *minimum* (a
    lock's TTL: ``core.lease.MIN_TTL``) up to ``core.lease.MAX_TTL_MS`` (None if allowed)."""
    number = seconds(0, allow_none=allow_none, strict=True)

    def check(value: Any) -> Any:
        checked = number(value)
        if checked is not None:
            try:
                ms = ttl_to_ms(checked)
            except ConfigError:
                ms = 0
            if not minimum * 1000 <= ms <= MAX_TTL_MS:
                raise ValueError(
                    f"from {minimum:g} to {MAX_TTL_MS // 1000} seconds (Redis keeps "
                    "milliseconds, and a lock's lease must outlast its drift allowance)"
                )
        return checked

    return check


def whole_number(value: Any) -> int:
    """A whole number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError("a whole number >= 0")
    return value


def boolean(value: Any) -> bool:
    """True or False."""
    if not isinstance(value, bool):
        raise TypeError("True or False")
    return value


class Choice:
    """A check for one of some names, listed in :attr:`names` (in order: an error lists
    them so, and a worker flag offers them)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._names = tuple(names)

    @property
    def names(self) -> tuple[str, ...]:
        """The names accepted, in order."""
        return self._names

    def __call__(self, value: Any) -> str:
        names = self.names
        if value not in names:
            raise ValueError("one of " + ", ".join(repr(c) for c in names))
        return str(value)


def choice(*choices: str) -> Choice:
    """A check for one of *choices*."""
    return Choice(choices)


def positive_number(value: Any) -> int | None:
    """A whole number >= 1 (or None: not set)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError("a whole number >= 1")
    return value


def limit_option(value: Any) -> int | None:
    """``lock_limit``: a whole number >= 1 (1 a mutex, N a semaphore), or None (no cap)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TypeError(
            "a whole number >= 1 (1: one run at a time, N: N at once), or None for no "
            "concurrency cap (a rate limit alone)"
        )
    return value


def rate_option(value: Any) -> str | None:
    """``lock_rate``: ``"N/s"``, ``"N/m"``, ``"N/h"`` or ``"N/d"`` (or None)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError('a string such as "10/m" (runs per second, minute, hour or day)')
    try:
        parse_rate(value)
    except ConfigError:
        raise ValueError(
            'like "10/s", "10/m", "10/h" or "10/d" (run starts per second, minute, hour or day)'
        ) from None
    return value.strip().replace(" ", "")


def key_option(value: Any) -> Any:
    """A lock key: a template, a callable, or None (the task name)."""
    if value is None or callable(value) or (isinstance(value, str) and value):
        return value
    raise TypeError('a template such as "sync:<user_id>", or a callable (*args, **kwargs) -> str')


def url_option(value: Any) -> Any:
    """``redlock_url``: a URL, or a list of URLs (one per independent Redlock master)."""
    if value is None:
        return None
    if isinstance(value, str) and value:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(u, str) for u in value):
        return list(value) if len(value) > 1 else value[0]
    raise TypeError("a Redis URL, or a list of URLs (one per independent master)")


def text(value: Any) -> Any:
    """A string (or None)."""
    if value is None or isinstance(value, str):
        return value
    raise TypeError("a string")


def class_or_path(value: Any) -> Any:
    """A class, or its import path (``"package.module:Class"``), resolved where it is used
    (or None)."""
    if value is None or isinstance(value, type) or (isinstance(value, str) and value):
        return value
    raise TypeError('a class, or its import path such as "package.module:Class"')


def mapping(value: Any) -> Any:
    """A dict (copied)."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError("a dict")


#: A duration's units in seconds.
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str) -> float:
    """A duration as an operator writes it: ``"90"`` or ``"90s"``, ``"10m"``, ``"1.5h"``,
    ``"2d"``, in seconds; ValueError for anything else, or for 0 or less."""
    text = value.strip().lower() if isinstance(value, str) else ""
    unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
    try:
        amount = float(text[: len(text) - len(unit)])
    except ValueError:
        raise ValueError("must be a duration such as 90s, 10m, 1h or 2d") from None
    seconds = amount * _UNITS[unit]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError("must be a duration above 0, such as 90s, 10m, 1h or 2d")
    return seconds
