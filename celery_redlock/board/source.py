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
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..app.config import Settings, load_settings
from ..app.controls import Controls
from ..app.event_log import MAXLEN, log_key
from ..cli.render import LockRow, control_json, rate_json
from ..core import STORE_ERRORS, Backend, connect, mask_url, open_backend
from ..core.admin import list_keys, read_lock, read_rate
from ..core.backend import EventLog, FlowControl, given, has
from ..core.errors import ConfigError, one_line
from ..core.keys import lock_keys
from ..core.listing import COUNTED, MAX_LIMIT, Listing, ListQuery

__all__ = [
    "PAGE",
    "TIMELINE_READ",
    "Problem",
    "Source",
    "View",
    "glob_escape",
    "merge_masters",
    "merged",
]

#: What a master that cannot be asked raises (as ``celery locks`` catches it).
_UNREACHABLE = STORE_ERRORS
#: Events read from a log to find one key's (the log holds every key's).
EVENTS_READ = MAXLEN
#: Keys a page of the overview shows unless told otherwise.
PAGE = 50
#: Events the timeline reads from a log at most, newest first: what a refresh costs the
#: log is bounded by this, not by how many keys or events there are.
TIMELINE_READ = 2000


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
    #: More keys match than this page shows (see :meth:`Source.listing`).
    more: bool = False
    #: Keys matching every filter, on every page; None when no master answered.
    total: int | None = None
    #: Keys by kind and state (:data:`~celery_redlock.core.listing.COUNTED`).
    counts: dict[str, int] = field(default_factory=dict)
    #: Where this page starts, and how many it shows at most.
    offset: int = 0
    limit: int | None = None
    #: Masters configured, and how many answered.
    masters: int = 1
    answered: int = 0
    #: When the store last answered a read of this board (epoch s; None: not since the
    #: board started), so that a page that knows nothing says since when.
    last_answer: float | None = None

    @property
    def unknown(self) -> bool:
        """Nothing can be said of what is held: no master answered, or (Redlock) fewer
        than a majority did, so what the others hold is not the lock's state."""
        return self.answered == 0 or self.quorum_lost

    @property
    def quorum_lost(self) -> bool:
        """A Redlock read on which fewer than a majority of the masters answered."""
        return self.redlock and 0 < self.answered <= self.masters // 2


def merge_masters(
    pages: Sequence[tuple[str | None, list[dict[str, Any]]]], masters: int
) -> list[dict[str, Any]]:
    """The objects of each master of a Redlock as one object a name and kind: the holder
    most masters agree on, with ``masters`` (how many agree), ``answered`` and ``of``
    (how many masters there are), in name order. A queued hold or permit counts apart."""
    found: dict[tuple[str, str, str], list[tuple[str | None, dict[str, Any]]]] = {}
    for master, objects in pages:
        for obj in objects:
            part = obj.get("state", "") if obj["kind"] != "permit" else json.dumps(obj["holder"])
            found.setdefault((obj["name"], obj["kind"], part), []).append((master, obj))
    out = []
    for _, held in sorted(found.items(), key=lambda item: item[0]):
        votes = Counter(json.dumps(obj.get("holder"), sort_keys=True) for _, obj in held)
        winner, agree = votes.most_common(1)[0]
        master, obj = next(
            (m, o) for m, o in held if json.dumps(o.get("holder"), sort_keys=True) == winner
        )
        out.append({**obj, "master": master, "masters": agree, "of": masters})
    return out


def merged(view: View) -> list[dict[str, Any]]:
    """*view*'s objects, one a name and kind (and holder, for permits) on a Redlock, each
    with how many masters agree (:func:`merge_masters`); as they are elsewhere."""
    if not view.redlock:
        return view.objects
    pages: dict[str | None, list[dict[str, Any]]] = {}
    for obj in view.objects:
        pages.setdefault(obj.get("master"), []).append(obj)
    return merge_masters(list(pages.items()), view.masters)


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
        self._last_answer: float | None = None

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

    def listing(
        self,
        pattern: str = "*",
        *,
        kind: str = "",
        state: str = "",
        task_id: str = "",
        worker: str = "",
        offset: int = 0,
        limit: int | None = PAGE,
        sort: str = "name",
    ) -> View:
        """One page of the keys whose name matches *pattern* and the filters (kind, state,
        task id, worker; see :class:`~celery_redlock.core.listing.ListQuery`): the objects
        of ``celery locks list --json`` of each key of the page, in page order, with
        :attr:`View.total` (keys matching every filter) and :attr:`View.counts` (by kind
        and state, of every key matching the pattern, task id and worker). *limit* None:
        every key. On a Redlock, each master's objects of the page's names
        (:func:`merge_masters`). ConfigError for a bad filter."""
        view = View(redlock=self.redlock, offset=offset)
        if limit is None:  # every key, page after page
            while True:
                part = self.listing(
                    pattern, kind=kind, state=state, task_id=task_id, worker=worker,
                    offset=offset, limit=MAX_LIMIT, sort=sort,
                )  # fmt: skip
                view.objects += part.objects
                view.problems += [p for p in part.problems if p not in view.problems]
                view.total, view.counts, view.answered = part.total, part.counts, part.answered
                view.masters, view.last_answer = part.masters, part.last_answer
                offset += MAX_LIMIT
                if part.total is None or offset >= part.total:
                    return view
        query = ListQuery(
            pattern, kind, state, task_id, worker, offset=offset, limit=limit, sort=sort
        )
        view.limit = limit
        found = self._each(view, lambda b: [list_keys(b, self.prefix, query)])
        view.masters = len(self.clients())
        view.answered = len(found)
        self._stamp(view)
        if not found:
            return view  # unknown: the problems say why
        pages = [(master, self._objects(listing, master)) for master, listing in found]
        if self.redlock:  # each master's page of names, the first *limit* of them all
            held = {obj["name"] for _, objects in pages for obj in objects}
            names = sorted(
                held, key=lambda n: lock_keys(n, self.prefix).lock, reverse=sort == "-name"
            )[:limit]
            rank = {name: i for i, name in enumerate(names)}
            view.objects = sorted(
                (o for _, objects in pages for o in objects if o["name"] in rank),
                key=lambda o: (rank[o["name"]], o.get("master") or ""),
            )
            view.total = max(listing.total for _, listing in found)
            view.counts = {
                k: max(listing.counts.get(k, 0) for _, listing in found) for k in COUNTED
            }
        else:
            view.objects = pages[0][1]
            view.total, view.counts = found[0][1].total, found[0][1].counts
        view.more = view.total > offset + limit
        return view

    def _objects(self, listing: Listing, master: str | None) -> list[dict[str, Any]]:
        """The ``--json`` objects of a page, in page order (a name's lock, permits and
        queued hold, its rate limiter, its controls)."""
        by_key: dict[str, list[dict[str, Any]]] = {}
        for info in listing.locks:
            row = with_worker(LockRow.of(info, master).as_json(self.redlock), info.record)
            by_key.setdefault(info.key, []).append(row)
        for rate in listing.rates:
            by_key.setdefault(rate.key, []).append(rate_json(rate))
        for control in listing.controls:
            key = lock_keys(control.name, self.prefix).control
            by_key.setdefault(key, []).append(control_json(control))
        return [obj for entry in listing.entries for obj in by_key.get(entry.key, [])]

    def one(self, name: str) -> View:
        """Lock *name*: the objects of ``celery locks show NAME --json``."""
        view = View(redlock=self.redlock)
        prefix = self.prefix
        found = self._each(view, lambda b: [read_lock(b, prefix, name)])
        view.masters, view.answered = len(self.clients()), len(found)
        self._stamp(view)
        view.objects = [
            with_worker(LockRow.of(info, master).as_json(self.redlock), info.record)
            for master, infos in found
            for info in infos
        ]
        rates = self._each(view, lambda b: [i for i in [read_rate(b, prefix, name)] if i])
        view.objects += [rate_json(i) for _, i in rates]
        controls = self._controls_of(view, glob_escape(name))
        view.objects += [control_json(c) for c in controls if c.name == name]
        return view

    def _stamp(self, view: View) -> None:
        """Note when the store last answered: now, when *view* knows what is held."""
        if not view.unknown:
            self._last_answer = time.time()
        view.last_answer = self._last_answer

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
        seen: dict[str, dict[str, Any]] = {}
        for master, text in self._each(
            view, lambda b: _read_log(b, key, count if name is None else EVENTS_READ)
        ):
            if quoted not in text:
                continue
            if text in seen:  # the same event, written to each master of a Redlock
                seen[text]["masters"] = seen[text].get("masters", 1) + 1
                continue
            event = _parse_event(text)
            if name is not None and event.get("name") != name:
                continue
            if master is not None:
                event["master"] = master
            seen[text] = event
            out.append(event)
        out.sort(key=_at, reverse=True)
        return out[:count], view.problems

    def recent(
        self,
        names: Iterable[str],
        since: float,
        read: int = TIMELINE_READ,
        prefix: str | None = None,
    ) -> tuple[list[dict[str, Any]], list[Problem]]:
        """The events of *names* (and, with *prefix*, of every name that starts with it)
        at or after *since* (epoch s) among the newest *read* of the log, newest first:
        one read of the log however many names (the timeline of a page of keys)."""
        wanted = set(names)
        view = View()
        out: list[dict[str, Any]] = []
        seen: set[str] = set()
        if not wanted and prefix is None:
            return out, []
        for master, text in self._each(view, lambda b: _read_log(b, log_key(self.prefix), read)):
            if text in seen:  # the same event, written to each master of a Redlock
                continue
            seen.add(text)
            event = _parse_event(text)
            name = event.get("name")
            if name not in wanted and not (
                prefix is not None and isinstance(name, str) and name.startswith(prefix)
            ):
                continue
            if _at(event) < since and event.get("kind") != "acquired":
                continue  # an acquire before the window still starts a bar in it
            if master is not None:
                event["master"] = master
            out.append(event)
        out.sort(key=_at, reverse=True)
        return out, view.problems


def with_worker(obj: dict[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
    """*obj* with its holder's worker node (``w1@host``, the record's ``worker``, which a
    task's run writes; ``celery locks show`` prints it) as ``holder["worker"]``, for the
    pages; the API leaves it out (:func:`public`), as ``--json`` does."""
    worker = record.get("worker")
    if isinstance(worker, str) and worker and isinstance(obj.get("holder"), dict):
        obj["holder"] = {**obj["holder"], "worker": worker}
    return obj


def public(objects: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """*objects* as ``celery locks list --json`` prints them (no ``holder["worker"]``)."""
    out = []
    for obj in objects:
        holder = obj.get("holder")
        if isinstance(holder, dict) and "worker" in holder:
            holder = {k: v for k, v in holder.items() if k != "worker"}
            out.append({**obj, "holder": holder})
        else:
            out.append(obj)
    return out


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
