"""Flow control of a task's runs: more holds per run than its own key (``lock_limits``),
weighted rates, and a body's back-off from an upstream that says "not now".

```python
@app.task(base=LockedTask, lock_key="import:<account_id>",
          lock_limits=[Limit("imports", 3), Rate("partner:<partner>", "600/m", cost="<rows>")])
def import_rows(account_id, partner, rows): ...
```

Each rule has its own key template, filled from the call's arguments like ``lock_key``.
A run takes its own lock and every rule in one step, all or nothing
(:class:`~celery_redlock.core.backend.FlowControl`): a refusal holds nothing and applies
the task's ``lock_on_contended``. A :class:`Limit` is a semaphore of its name (its
permits live beside the name's lock, as a ``Semaphore``'s): held, renewed and released
with the run's lock, fenced by its name's counter (``self.lock.fences``). A :class:`Rate`
takes ``cost`` units of a GCRA rate of its name (the state a ``RateLimiter`` of that
name keeps) and gives nothing back.
"""

from __future__ import annotations

import datetime as _dt
import email.utils
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core import ConfigError, KeyTemplate
from ..core.errors import cost_above_burst
from ..core.ratelimit import parse_rate

#: A cost template: one placeholder and nothing else.
_ONE_FIELD = re.compile(r"^<[^<>]+>$")

__all__ = [
    "BackOff",
    "Limit",
    "Rate",
    "check_cost",
    "limits_option",
]


def _key(value: Any, what: str) -> str | KeyTemplate:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what}: the key must be a non-empty string, got {value!r}")
    return KeyTemplate(value) if "<" in value else value


@dataclass(frozen=True)
class Limit:
    """At most *limit* runs hold key *key* at once (a template such as ``"imports"`` or
    ``"tenant:<tenant_id>"``): a semaphore of that name; ``Limit(key, 1)`` one at a time."""

    key: str
    limit: int
    #: The key, compiled (a KeyTemplate when it has placeholders).
    template: str | KeyTemplate = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        what = f"Limit({self.key!r}, {self.limit!r})"
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise ConfigError(f"{what}: the limit must be a whole number >= 1 (runs at once)")
        object.__setattr__(self, "template", _key(self.key, what))


@dataclass(frozen=True)
class Rate:
    """At most *rate* units (``"600/m"``) start per period under key *key*, *burst* at
    once after an idle spell; each run takes *cost* units: an int, an argument template
    (``"<rows>"``) or a callable of the task's arguments returning an int."""

    key: str
    rate: str
    burst: int = 1
    cost: int | str | Callable[..., int] = 1
    #: The key, compiled (a KeyTemplate when it has placeholders).
    template: str | KeyTemplate = field(init=False, repr=False, compare=False, default="")
    #: The cost, compiled: an int, a KeyTemplate of one argument, or the callable.
    units: Any = field(init=False, repr=False, compare=False, default=1)
    #: Microseconds between units at the steady rate.
    interval_us: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        what = f"Rate({self.key!r}, {self.rate!r})"
        try:
            grants, period, _ = parse_rate(self.rate)
        except ConfigError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ConfigError(f"{what}: burst must be a whole number >= 1, got {self.burst!r}")
        cost: Any = self.cost
        if isinstance(cost, str):
            if not _ONE_FIELD.match(cost) or cost == "<*>":
                raise ConfigError(f"{what}: cost {cost!r} must name one argument, like '<rows>'")
            cost = KeyTemplate(cost)
        elif isinstance(cost, int) and not isinstance(cost, bool):
            check_cost(what, cost, self.burst)
        elif not callable(cost):
            raise ConfigError(
                f"{what}: cost must be an int, an argument template such as '<rows>' or a "
                f"callable of the task's arguments, got {cost!r}"
            )
        object.__setattr__(self, "template", _key(self.key, what))
        object.__setattr__(self, "units", cost)
        object.__setattr__(self, "interval_us", max(1, round(period * 1e6 / grants)))


def check_cost(what: str, cost: Any, burst: int) -> int:
    """*cost* as a run's units of a rate of *burst*, or a ConfigError that starts with
    *what*."""
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ConfigError(f"{what}: the cost of a run must be a whole number >= 1, got {cost!r}")
    if cost > burst:
        raise cost_above_burst(what, cost, burst)
    return cost


def limits_option(value: Any) -> tuple[Limit | Rate, ...]:
    """``lock_limits``: a list of :class:`Limit` and :class:`Rate` rules (or None)."""
    if value is None:
        return ()
    if isinstance(value, (Limit, Rate)) or not isinstance(value, (list, tuple)):
        raise TypeError("a list of Limit(key, n) and Rate(key, rate) rules")
    for rule in value:
        if not isinstance(rule, (Limit, Rate)):
            raise TypeError(
                f"a list of Limit(key, n) and Rate(key, rate) rules; {rule!r} is neither "
                "(from celery_redlock import Limit, Rate)"
            )
    return tuple(value)


class BackOff(Exception):
    """Raised in a task body: the upstream said "not now". Pauses *key* for every worker
    for *seconds* (default key: the task's first ``Rate`` key, else its lock key) and
    re-queues this run to start when the pause ends, within the lock's retry budget
    (``lock_max_retries``), not the task's ``max_retries``."""

    def __init__(self, seconds: float, *, key: str | None = None, reason: str = "") -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"BackOff(seconds): a number of seconds, got {seconds!r}")
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"BackOff(seconds): a number of seconds >= 0, got {seconds!r}")
        if key is not None and (not isinstance(key, str) or not key):
            raise TypeError(f"BackOff(key=...): a key name, got {key!r}")
        self.seconds = float(seconds)
        self.key = key
        self.reason = reason
        super().__init__(self.seconds, key, reason)

    def __str__(self) -> str:
        where = f" on {self.key!r}" if self.key else ""
        why = f" ({self.reason})" if self.reason else ""
        return f"back-off{where} for {self.seconds:g}s{why}"

    @classmethod
    def from_header(
        cls, value: Any, *, key: str | None = None, default: float = 1.0, now: float | None = None
    ) -> BackOff:
        """A back-off for a ``Retry-After`` header *value*: seconds (``"30"``) or an HTTP
        date (``"Wed, 21 Oct 2026 07:28:00 GMT"``); *default* seconds when it is missing
        or unreadable (a date in the past: 0)."""
        seconds = _retry_after(value, now)
        if seconds is None:
            seconds = default
        return cls(seconds, key=key, reason=f"Retry-After: {value}" if value else "")


def _retry_after(value: Any, now: float | None) -> float | None:
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=_dt.timezone.utc)
        current = _dt.datetime.now(_dt.timezone.utc).timestamp() if now is None else now
        return max(0.0, when.timestamp() - current)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
