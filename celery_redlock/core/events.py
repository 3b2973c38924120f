"""Lock events for hooks: every acquire, contention, renewal failure, loss and release.

A hook is any callable taking one :class:`LockEvent`; adding a field to the event
breaks no hook. Hooks run in the thread where the event happened (the renewal
thread for ``renew_failed`` and ``lost``); an exception in a hook is logged and
never reaches the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["HOLDER_IS_OTHER", "EventKind", "LockEvent", "add_hook", "emit", "remove_hook", "wanted"]

log = logging.getLogger("celery_redlock.events")

EventKind = Literal[
    "acquired",
    "contended",
    "released",
    "renew_failed",
    "lost",
    "unavailable",
    "rate_limited",
    "granted",
    "duplicate",
    "superseded",
    "backed_off",
]

#: The kinds whose ``holder`` is the other owner (the one in the way), not ours: the
#: event's own record is its ``owner`` then.
HOLDER_IS_OTHER: frozenset[str] = frozenset({"contended", "duplicate", "superseded"})


@dataclass(frozen=True)
class LockEvent:
    """What happened to which lock.

    ``waited`` is seconds spent acquiring (``acquired``/``contended``), ``held`` seconds
    held (``released``/``lost``); ``holder`` is the other owner's record for ``contended``,
    ``duplicate`` (a call not queued because the holder's message is queued or running) and
    ``superseded`` (a queued message that a newer call replaced; ``holder`` is the newer
    one's), ours otherwise. ``owner`` is ours (the waiting task's record for ``contended``),
    where the lock knows it. ``rate_limited``: a rate limiter refused a start, and
    ``retry_after`` says in how many seconds its next slot is free; ``granted``: it granted
    one (so that a refused start that later got its slot is known to wait no more).
    ``unavailable``: Redis could not answer an acquire (``error`` says why). ``limit`` is
    the lock's permits (1: a mutex), where a lock emits the event. ``refused_by`` and
    ``refusal`` name the name and the reason (``paused``, ``limit``, ``rate``) of an
    operator control or a ``lock_limits`` rule that refused a ``contended`` acquire ("" when
    its holder was in the way). ``rules`` are the ``lock_limits`` holds an ``acquired``
    acquisition took with it, one mapping each: ``name``, ``kind`` (``limit`` or ``rate``),
    ``limit``, ``fence`` (a limit's).
    ``backed_off``: a run raised ``BackOff``, which paused ``name`` for ``retry_after``
    seconds (``error``: its reason).
    """

    kind: EventKind
    name: str
    key: str
    fence: int | None = None
    holder: Mapping[str, Any] = field(default_factory=dict)
    ttl: float | None = None
    waited: float | None = None
    held: float | None = None
    error: str | None = None
    at: float = field(default_factory=time.time)
    retry_after: float | None = None
    owner: Mapping[str, Any] = field(default_factory=dict)
    limit: int | None = None
    refused_by: str = ""
    refusal: str = ""
    rules: tuple[Mapping[str, Any], ...] = ()


Hook = Callable[[LockEvent], object]
#: Replaced, never changed in place: emit() iterates it without copying it first.
_hooks: tuple[Hook, ...] = ()
_hooks_lock = threading.Lock()
#: Name of the optional attribute by which a hook says which events it takes.
FILTER_ATTR = "lock_event_filter"
#: The hooks' filters when every hook has one (an event none of them takes is never
#: built); None when some hook takes every event.
_filters: tuple[Callable[[str], bool], ...] | None = None


def _set_hooks(hooks: tuple[Hook, ...]) -> None:
    global _hooks, _filters
    filters = tuple(getattr(hook, FILTER_ATTR, None) for hook in hooks)
    _filters = None if None in filters else filters  # type: ignore[assignment]
    _hooks = hooks


def wanted(kind: str) -> bool:
    """True if some hook takes events of *kind* (lets hot paths skip building one)."""
    filters = _filters
    if filters is None:
        return bool(_hooks)
    try:
        for want in filters:  # noqa: SIM110 - no generator: this runs twice per lock
            if want(kind):
                return True
        return False
    except Exception:  # a broken filter: say yes, and let emit() report the hook
        log.exception("celery-redlock event hook filter failed on %s", kind)
        return True


def add_hook(hook: Hook) -> Hook:
    """Register *hook* for every event in this process (idempotent); returns it.

    A hook with a ``lock_event_filter`` attribute (a callable taking the event kind)
    is asked first: an event that no hook's filter takes is not built at all.
    """
    with _hooks_lock:
        if hook not in _hooks:
            _set_hooks((*_hooks, hook))
    return hook


def remove_hook(hook: Hook) -> None:
    """Unregister *hook*; unknown hooks are ignored."""
    with _hooks_lock:
        if hook in _hooks:
            index = _hooks.index(hook)
            _set_hooks(_hooks[:index] + _hooks[index + 1 :])


def emit(event: LockEvent) -> None:
    """Hand *event* to every hook; a failing hook is logged, never raised."""
    for hook in _hooks:
        try:
            hook(event)
        except Exception:
            log.exception("celery-redlock event hook %r failed on %s", hook, event.kind)
