"""Operator control of keys at run time: ``celery_redlock.control(app)`` and
``celery locks pause / resume / set / unset``.

A control lives in Redis beside the key's lock (``<prefix>{<name>}:control``), and the
acquire of every task's run reads it in the same round trip as the run's holds
(:class:`~celery_redlock.core.backend.FlowControl`): no restart, no extra round trip,
effective at the next start on every worker.

* A pause refuses new starts of runs that take the key (their own ``lock_key``, or one of
  their ``lock_limits``); running ones finish. A refused run follows its
  ``lock_on_contended``: ``retry`` comes back when the pause ends.
* ``set_limit`` changes the permits of a semaphore (a ``Limit`` rule, or ``lock_limit``
  above 1): a lower limit lets the holders above it finish and admits no new one until
  below. ``set_rate`` changes a ``Rate`` rule's rate (and burst).
* ``seconds`` makes a change lapse by itself; without it, it holds until lifted.

Each change is logged (``celery_redlock.control``) and sent as the Celery event
``redlock-control`` where the app sends task events.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ..core import ConfigError
from ..core.backend import FlowControl, need
from ..core.backend_types import Control
from ..core.keys import lock_keys
from ..core.ratelimit import parse_rate
from .observability import send_publisher_event
from .state import AppState, state_for

__all__ = ["Controls", "control"]

log = logging.getLogger("celery_redlock.control")


def control(app: Any) -> Controls:
    """The operator controls of *app*'s keys."""
    return Controls(app)


class Controls:
    """Pause, resume and change the limits of keys, for every worker of *app*."""

    def __init__(self, app: Any, *, backend: Any = None, prefix: str | None = None) -> None:
        self.app = app
        #: Where the controls are written (default: the app's lock store), under which
        #: key prefix (default: the app's): ``celery locks`` passes its own.
        self._store = backend
        self._prefix = prefix

    @property
    def prefix(self) -> str:
        """The key prefix of the controlled keys."""
        return self._prefix or self._state().settings.key_prefix

    def _backend(self) -> FlowControl:
        store = self._store if self._store is not None else self._state().backend()
        return need(store, FlowControl)

    def _state(self) -> AppState:
        """The app's state, for what was not given (``celery locks`` gives both)."""
        return state_for(self.app)

    def _key(self, name: str) -> str:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a key name must be a non-empty string, got {name!r}")
        return lock_keys(name, self.prefix).control

    def _set(self, name: str, kind: str, value: str | None, seconds: float | None) -> bool:
        ms = _ms(seconds)
        changed = self._backend().set_control(self._key(name), kind, value, ms)
        if changed:
            what = f"{kind} {value!r}" if value is not None else f"{kind} lifted"
            span = f" for {seconds:g}s" if seconds else ""
            log.info("celery-redlock control: %r %s%s", name, what, span)
            send_publisher_event(
                self.app, "control", name=name, control=kind, value=value, seconds=seconds
            )
        return changed

    def pause(self, key: str, seconds: float | None = None, reason: str = "") -> None:
        """Pause *key*: no new start of a run that takes it, on any worker, for *seconds*
        (None: until :meth:`resume`); *reason* shows in ``celery locks`` and in refusals."""
        if not isinstance(reason, str):
            raise ConfigError(f"reason must be text, got {reason!r}")
        self._set(key, "pause", reason or "paused by an operator", seconds)

    def resume(self, key: str) -> bool:
        """Lift *key*'s pause; False when it was not paused."""
        return self._set(key, "pause", None, None)

    def set_limit(self, key: str, limit: int, seconds: float | None = None) -> None:
        """Runs at once of semaphore *key* (a ``Limit`` rule or a ``lock_limit``)."""
        self.override(key, limit=limit, seconds=seconds)

    def set_rate(
        self, key: str, rate: str, burst: int | None = None, seconds: float | None = None
    ) -> None:
        """The rate of a ``Rate`` rule on *key* (``"100/m"``), and its burst (None: the
        rule's own)."""
        self.override(key, rate=rate, burst=burst, seconds=seconds)

    def override(
        self,
        key: str,
        *,
        limit: int | None = None,
        rate: str | None = None,
        burst: int | None = None,
        seconds: float | None = None,
    ) -> None:
        """Set *key*'s limit and/or rate (and burst) at once: every value is checked
        before anything is written, so a bad one changes nothing."""
        values: list[tuple[str, str]] = []
        if limit is not None:
            values.append(("limit", _limit_value(limit)))
        if rate is not None:
            values.append(("rate", _rate_value(rate, burst)))
        elif burst is not None:
            raise ConfigError("burst goes with a rate (set_rate, or --rate)")
        if not values:
            raise ConfigError("give a limit or a rate (or both)")
        _ms(seconds)
        self._key(key)
        for kind, value in values:
            self._set(key, kind, value, seconds)

    def unset(self, key: str) -> bool:
        """Lift *key*'s limit and rate overrides (not a pause); False when there were none."""
        lifted = self._set(key, "limit", None, None)
        return self._set(key, "rate", None, None) or lifted

    def overrides(self, pattern: str = "*") -> list[Control]:
        """Every pause and override in force whose key matches the glob *pattern*."""
        return self._backend().controls(self.prefix, pattern)


def _limit_value(limit: Any) -> str:
    if not _whole(limit):
        raise ConfigError(
            f"limit must be a whole number >= 1 (runs at once), got {limit!r}; pause the "
            "key to admit none"
        )
    return str(limit)


def _rate_value(rate: Any, burst: Any) -> str:
    """``"<interval us>|<burst, 0: the rule's own>|<rate as written>"``, as stored."""
    grants, period, text = parse_rate(rate)
    if burst is not None and not _whole(burst):
        raise ConfigError(f"burst must be a whole number >= 1, got {burst!r}")
    interval = max(1, round(period * 1e6 / grants))
    return f"{interval}|{burst or 0}|{text}"


def _whole(value: Any) -> bool:
    """True for a whole number >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _ms(seconds: float | None) -> int:
    if seconds is None:
        return 0
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ConfigError(f"seconds must be a number, got {seconds!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(
            f"seconds must be above 0 (how long the change holds), got {seconds!r}; leave it "
            "out for a change that holds until lifted"
        )
    return max(1, math.ceil(seconds * 1000))
