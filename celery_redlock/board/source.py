"""What the board reads: the app's lock store, master by master, through the same reads
and the same JSON objects as ``celery locks list --json`` (:mod:`celery_redlock.core.admin`,
:mod:`celery_redlock.render`), and the recent lock events (:mod:`celery_redlock.app.event_log`).

A master that cannot be asked, or whose data under the prefix is not ours, is a
:class:`Problem` shown on the page ("unreachable", "unreadable"), never an error page.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..app.config import Settings, load_settings
from ..app.controls import Controls
from ..app.event_log import MAXLEN, log_key
from ..cli.render import LockRow, control_json, rate_json
from ..core import Backend, connect, mask_url, open_backend
from ..core.admin import read_lock, read_rate, scan_locks, scan_rates
from ..core.backend import EventLog, FlowControl, given, has
from ..core.backends import STORE_ERRORS
from ..core.errors import ConfigError, one_line

__all__ = ["Problem", "Source", "View", "glob_escape"]

#: What a master that cannot be asked raises (as ``celery locks`` catches it).
_UNREACHABLE = STORE_ERRORS
#: Events read from a log to find one key's (the log holds every key's).
EVENTS_READ = MAXLEN


@dataclass(frozen=True)
class Problem:
    """A master the board could not read: ``unreachable`` or ``unreadable``."""

    master: str
    what: str
    detail: str


@dataclass
class View:
    """What one read found: the ``celery locks list --json`` objects and the problems."""

    objects: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    redlock: bool = False
    #: More locks match than were read (a page: see :meth:`Source.listing`).
    more: bool = False


def glob_escape(text: str) -> str:
    """*text* as a glob that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in text)


class Source:
    """The lock store of *app* as the board reads it; clients are made once, on first use."""

    def __init__(self, app: Any, overrides: Mapping[str, Any] | None = None) -> None:
        self.app = app
        #: Setting overrides of this board (``celery locks serve --redlock-url``).
        self.overrides = dict(overrides or {})
        self._lock = threading.Lock()
        self._clients: list[tuple[str, Backend]] | None = None
        self._settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = load_settings(self.app.conf, self.overrides)
        return self._settings

    @property
    def prefix(self) -> str:
        return self.settings.key_prefix

    @property
    def redlock(self) -> bool:
        return isinstance(self.settings.urls, list)

    def clients(self) -> list[tuple[str, Backend]]:
        """(masked URL, backend) per master: one for a single Redis, N for Redlock."""
        with self._lock:
            if self._clients is None:
                urls = self.settings.urls
                options = self.settings.client_options
                self._clients = [
                    (mask_url(u), open_backend(connect(u, **options)))
                    for u in (urls if isinstance(urls, list) else [urls])
                ]
            return self._clients

    def store(self) -> Backend:
        """The lock store as the workers see it: its one Redis, or the quorum of masters."""
        backends = [backend for _, backend in self.clients()]
        return open_backend(backends) if self.redlock else backends[0]

    def controls(self) -> Controls:
        """The operator controls (``celery locks pause/set``); ConfigError on a quorum."""
        store = self.store()
        if not has(store, FlowControl):
            raise ConfigError(f"pause and set are not available on {store.describe()}")
        return Controls(self.app, backend=store, prefix=self.prefix)

    def close(self) -> None:
        """Close the connections of the clients this source made (the board stops)."""
        with self._lock:
            made, self._clients = self._clients or [], None
        for _, backend in made:
            close = getattr(getattr(backend, "given", None), "close", None)
            if callable(close):
                with contextlib.suppress(Exception):  # a client half gone is closed enough
                    close()

    # -- reads ------------------------------------------------------------------------
    def _each(
        self, view: View, read: Callable[[Backend], Sequence[Any]]
    ) -> list[tuple[str | None, Any]]:
        """*read* on every master: (master or None, item) pairs; problems noted in *view*."""
        found: list[tuple[str | None, Any]] = []
        for url, backend in self.clients():
            try:
                items = read(backend)
            except _UNREACHABLE as exc:
                view.problems.append(Problem(url, "unreachable", one_line(exc)))
                continue
            except ConfigError as exc:  # foreign data where a lock should be
                view.problems.append(Problem(url, "unreadable", str(exc)))
                continue
            master = backend.describe() if self.redlock else None
            found += [(master, item) for item in items]
        return found

    def listing(self, pattern: str = "*", limit: int | None = None) -> View:
        """Every lock, permit, queued hold, rate limiter and control matching *pattern*: the
        objects of ``celery locks list --json PATTERN``, in its order. With *limit*, the
        locks of the first *limit* names only (:attr:`View.more`: there are others)."""
        view = View(redlock=self.redlock)
        prefix = self.prefix
        ask = None if limit is None else limit + 1
        rows = [
            LockRow.of(info, master)
            for master, info in self._each(view, lambda b: scan_locks(b, prefix, pattern, ask))
        ]
        if limit is not None:
            names = sorted({r.name for r in rows})
            view.more = len(names) > limit
            first = set(names[:limit])
            rows = [r for r in rows if r.name in first]
        rows.sort(key=lambda r: (r.name, r.master or ""))
        locks = [r for r in rows if r.kind != "permit"]
        permits = [r for r in rows if r.kind == "permit"]
        view.objects = [r.as_json(self.redlock) for r in (*locks, *permits)]
        if not any(p.what == "unreachable" for p in view.problems):
            rates = [i for _, i in self._each(view, lambda b: scan_rates(b, prefix, pattern))]
            view.objects += [rate_json(i) for i in sorted(rates, key=lambda i: i.name)]
        view.objects += [control_json(c) for c in self._controls_of(view, pattern)]
        return view

    def one(self, name: str) -> View:
        """Lock *name*: the objects of ``celery locks show NAME --json``."""
        view = View(redlock=self.redlock)
        prefix = self.prefix
        rows = [
            LockRow.of(info, master)
            for master, info in self._each(view, lambda b: read_lock(b, prefix, name))
        ]
        view.objects = [r.as_json(self.redlock) for r in rows]
        rates = self._each(view, lambda b: [i for i in [read_rate(b, prefix, name)] if i])
        view.objects += [rate_json(i) for _, i in rates]
        controls = self._controls_of(view, glob_escape(name))
        view.objects += [control_json(c) for c in controls if c.name == name]
        return view

    def _controls_of(self, view: View, pattern: str) -> list[Any]:
        store = self.store()
        if not has(store, FlowControl):
            return []
        try:
            return Controls(self.app, backend=store, prefix=self.prefix).overrides(pattern)
        except _UNREACHABLE:
            return []  # the lock reads have reported it
        except ConfigError as exc:
            view.problems.append(Problem(store.describe(), "unreadable", str(exc)))
            return []

    def events(
        self, name: str | None = None, count: int = 50
    ) -> tuple[list[dict[str, Any]], list[Problem]]:
        """The newest *count* recorded events (of lock *name* only, when given), newest
        first, each with its ``master`` on a Redlock; events that are not ours are shown as
        ``{"kind": "unreadable"}``."""
        out: list[dict[str, Any]] = []
        view = View()
        key = log_key(self.prefix)
        #: A key's events name it as JSON does: others are skipped before parsing.
        quoted = json.dumps(name)[1:-1] if name is not None else ""
        for master, text in self._each(
            view, lambda b: _read_log(b, key, count if name is None else EVENTS_READ)
        ):
            if quoted not in text:
                continue
            event = _parse_event(text)
            if name is not None and event.get("name") != name:
                continue
            if master is not None:
                event["master"] = master
            out.append(event)
        out.sort(key=_at, reverse=True)
        return out[:count], view.problems


def _at(event: dict[str, Any]) -> float:
    at = event.get("at")
    return float(at) if isinstance(at, (int, float)) else 0.0


def _read_log(backend: Backend, key: str, count: int) -> list[str]:
    log = given(backend, EventLog)
    return [] if log is None else log.read_events(key, count)


def _parse_event(text: str) -> dict[str, Any]:
    try:
        event = json.loads(text)
    except ValueError:
        return {"kind": "unreadable", "detail": text[:200]}
    if not isinstance(event, dict):
        return {"kind": "unreadable", "detail": text[:200]}
    return event
