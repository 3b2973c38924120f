"""The board as a plain WSGI application (:class:`Board`): no framework, mountable under
any path (links follow ``SCRIPT_NAME``).

=========================== ===============================================================
``GET /``                   the overview (``?prefix=&kind=``)
``GET /key/<name>``         one key (``?done=<code>``: the fixed sentence of an action's end)
``GET /api/locks``          ``celery locks list --json``, a page (``?pattern=&limit=&cursor=``)
``GET /api/locks/<name>``   ``celery locks show NAME --json`` (``[]`` when nothing holds it)
``GET /api/events``         the recorded events, newest first, a page (``?name=&limit=&cursor=``)
``GET|POST /login``         paste a token (boards with one)
``POST /logout``            end the session (its CSRF token)
``POST /action``            release (a lock, a permit, a queued hold), release-set (what the
                            overview's filters match), pause, resume, set, unset (actions
                            only: session + CSRF)
=========================== ===============================================================

A page asked with the header ``X-Board-Part: live`` answers its live part only: the
page's script swaps it in every second. Every answer carries a Content-Security-Policy
that allows no inline script, so even markup that escaped escaping could not run; every
header value goes through :func:`.http.headers`, which refuses control characters.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from http.cookies import CookieError, SimpleCookie
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote

from ..app.event_log import MAXLEN, log_forced
from ..core.admin import force_dequeue, force_release, force_release_permit
from ..core.errors import ConfigError, StoreUnavailable, one_line
from . import pages, timeline
from .auth import SESSION_TTL, Session, Sessions, Token, load_tokens, pasted
from .http import HostCheck, HttpError, bad, duration, headers, local_path, whole
from .pages import e, hidden
from .rules import matching, task_rules
from .source import Source, glob_escape, public

__all__ = ["DONE", "PAGE_DEFAULT", "PAGE_MAX", "Board"]

log = logging.getLogger("celery_redlock.board")

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
#: An answer: status, extra headers, body.
Answer = tuple[str, list[tuple[str, str]], str | bytes]

_COOKIE = "redlock_board"
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_STATIC = {"board.css": "text/css; charset=utf-8", "board.js": "text/javascript; charset=utf-8"}
_VERBS = ("release", "release-set", "pause", "resume", "set", "unset")
#: The most names one release of a filtered set removes (and its confirm page lists).
SET_MAX = 1000
#: An API page: this many names (locks) or events unless ``?limit=`` says, at most PAGE_MAX.
PAGE_DEFAULT = 100
PAGE_MAX = 1000
#: The furthest an API cursor reaches (names or events skipped).
CURSOR_MAX = 1_000_000
#: What a key's page says after an action (``?done=<code>``): a fixed set, never the
#: query's text, so a link cannot put words of its own in the board's mouth.
DONE = {
    "released": "Released: the acquisition shown no longer holds this key.",
    "dequeued": "Removed the queued hold shown; its message stays queued.",
    "gone": "Nothing to release: the hold shown was already gone (expired or released).",
    "refused": "Left alone: another acquisition than the one shown holds this key now.",
    "no-master": "Nothing released: the master shown is not one of this board's.",
    "released-set": "Released what matched the filters; the board log lists each key.",
    "nothing-set": "Nothing matched the filters: nothing released.",
    "paused": "Paused.",
    "resumed": "Resumed.",
    "not-paused": "It was not paused.",
    "set": "Override set.",
    "unset": "Overrides lifted.",
    "no-override": "It had no override.",
    "unreachable": "Redis could not be reached: the action may not have been done (see "
    "the board's log).",
}


class Board:
    """The board of Celery app *app* (see :func:`celery_redlock.board.make_app`)."""

    def __init__(
        self,
        app: Any,
        *,
        actions: bool = False,
        token: Any = None,
        token_file: Any = None,
        overrides: Any = None,
        private: bool = False,
        allowed_hosts: Sequence[str] | None = None,
        secure_cookies: bool = False,
        session_ttl: float = SESSION_TTL,
    ) -> None:
        self.source = Source(app, overrides)
        self.actions = bool(actions)
        #: Every page needs a signed-in token (a board served beyond loopback).
        self.private = bool(private)
        self.tokens: list[Token] = load_tokens(token, token_file)
        if (self.actions or self.private) and not self.tokens:
            raise ConfigError(
                "the board's actions need a token: pass token=, --token-file PATH or set "
                "REDLOCK_BOARD_TOKEN (name:secret, the secret 16 characters or more)"
            )
        if isinstance(allowed_hosts, str):
            allowed_hosts = [allowed_hosts]
        #: The Host names answered (None: every one, the mounting site checks it).
        self.hosts: HostCheck | None = (
            None if allowed_hosts is None else HostCheck(list(allowed_hosts))
        )
        #: The session cookie is ``Secure`` on every answer, not only over https (a
        #: proxy that ends TLS in front of the board).
        self.secure_cookies = bool(secure_cookies)
        self.sessions = Sessions(session_ttl)

    def close(self) -> None:
        """Close the store's connections (``locks serve`` stopping)."""
        self.source.close()

    # -- WSGI ---------------------------------------------------------------------------
    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        try:
            if self.hosts is not None and not self.hosts.allows(environ):
                raise bad("this board does not answer to that Host (see --allowed-host)")
            status, extra, body = self.handle(environ)
        except HttpError as exc:
            log.debug(
                "celery-redlock board: %s %s from %s: %s %s",
                environ.get("REQUEST_METHOD"),
                _path(environ),
                _client(environ),
                exc.status,
                exc,
            )
            status, extra, body = exc.status, [], _text_page(str(exc))
        except Exception:  # a bug of ours: a short page, the traceback in the log
            log.exception(
                "celery-redlock board: %s %s failed", environ.get("REQUEST_METHOD"), _path(environ)
            )
            status, extra, body = (
                "500 Internal Server Error",
                [],
                _text_page("the board failed: see its log"),
            )
        data = body.encode("utf-8") if isinstance(body, str) else body
        base = [
            ("Content-Length", str(len(data))),
            ("Content-Security-Policy", _CSP),
            ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "same-origin"),
            ("Cache-Control", "no-store"),
        ]
        if not any(k == "Content-Type" for k, _ in extra):
            base.append(("Content-Type", "text/html; charset=utf-8"))
        try:
            written = headers(base + extra)
        except ValueError as exc:  # a header of ours would carry a control character
            log.error(
                "celery-redlock board: %s %s: %s",
                environ.get("REQUEST_METHOD"),
                _path(environ),
                exc,
            )
            data = _text_page("the board failed: see its log").encode()
            status = "500 Internal Server Error"
            written = headers([("Content-Length", str(len(data))), *base[1:]])
        start_response(status, written)
        return [data]

    def handle(self, environ: Environ) -> Answer:  # noqa: PLR0911 - one return per route
        method = environ.get("REQUEST_METHOD", "GET")
        path = _path(environ)
        base = environ.get("SCRIPT_NAME", "").rstrip("/")
        args = _query(environ)
        if path.startswith("/static/"):
            return self.static(path[len("/static/") :])
        if path == "/action":
            if method != "POST":
                raise HttpError("405 Method Not Allowed", "actions are POSTs")
            return self.act(environ, base)
        if path == "/login":
            return self.login(environ, base, method, args)
        if path == "/logout":
            if method != "POST":
                raise HttpError(
                    "405 Method Not Allowed", "sign out with the page's button (a POST)"
                )
            return self.logout(environ, base)
        if self.private and self._session(environ) is None:
            if path.startswith("/api/"):
                raise HttpError("403 Forbidden", "sign in with the board's token first")
            target = base + "/login" + pages.query(next=base + path)
            return "303 See Other", [("Location", target)], ""
        if path.startswith("/api/"):
            return self.api(path[len("/api/") :], args)
        if method not in ("GET", "HEAD"):
            raise HttpError("405 Method Not Allowed", "this page is read-only")
        live = environ.get("HTTP_X_BOARD_PART") == "live"
        if path in ("", "/"):
            return self.overview(environ, base, args, live)
        if path.startswith("/key/"):
            return self.key(environ, base, path[len("/key/") :], args, live)
        raise HttpError("404 Not Found", f"no page {path[:80]}")

    # -- pages ----------------------------------------------------------------------------
    def _where(self) -> str:
        urls = ", ".join(url for url, _ in self.source.clients())
        return f"{urls} · prefix {self.source.prefix}"

    def _layout(self, environ: Environ, base: str, title: str, body: str) -> str:
        """A whole page; signed in, with the sign-out button first."""
        session = self._session(environ) if self.tokens else None
        if session is not None:
            body = (
                f'<form class="signout" method=post action="{e(base)}/logout">'
                f"{hidden({'csrf': session.csrf})}"
                '<button type="submit" id="signout">sign out</button></form>' + body
            )
        user = session.token.name if session is not None else None
        return pages.layout(base, title, body, where=self._where(), user=user)

    def overview(self, environ: Environ, base: str, args: dict[str, str], live: bool) -> Answer:
        filters = pages.overview_filters(args)
        view = self.source.listing(
            glob_escape(filters["prefix"]) + "*",
            kind=filters["kind"],
            state=filters["state"],
            task_id=filters["task_id"],
            worker=filters["worker"],
            offset=whole(filters["offset"] or None, "offset", high=CURSOR_MAX, default=0),
            limit=pages.PAGE,
            sort=filters["sort"] or "name",
        )
        rows = pages.group(view, task_rules(self.source.app))
        picture = self._timeline(
            {r.name for r in rows}, href=lambda n: base + pages.link(n), prefix=filters["prefix"]
        )
        part = pages.overview_live(base, view, rows, filters, picture)
        if live:
            return "200 OK", [], part
        forms = _Forms(self, environ, base, "")
        message = DONE.get(args.get("done", ""), "")
        body = pages.overview_page(base, part, filters, forms.release_set(filters), message)
        return "200 OK", [], self._layout(environ, base, "locks", body)

    def _timeline(self, names: set[str], href: Any = None, prefix: str | None = None) -> str:
        """The timeline of *names* (and of the names under *prefix* that ran lately): one
        capped read of the event log (:meth:`Source.recent`)."""
        now = time.time()
        events, _ = self.source.recent(names, now - timeline.WINDOW, prefix=prefix)
        return timeline.timeline_svg(events, now=now, href=href)

    def key(
        self, environ: Environ, base: str, name: str, args: dict[str, str], live: bool
    ) -> Answer:
        view = self.source.one(name)
        events, problems = self.source.events(name, count=50)
        forms = _Forms(self, environ, base, name)
        rules = matching(task_rules(self.source.app), name)
        picture = self._timeline({name})
        part = pages.key_live(base, name, view, events, problems, forms, rules, picture)
        if live:
            return "200 OK", [], part
        body = pages.key_page(name, part, forms.controls(), DONE.get(args.get("done", ""), ""))
        return "200 OK", [], self._layout(environ, base, name, body)

    def static(self, name: str) -> Answer:
        if name not in _STATIC:
            raise HttpError("404 Not Found", "no such file")
        data = resources.files(__package__).joinpath("static").joinpath(name).read_bytes()
        return "200 OK", [("Content-Type", _STATIC[name])], data

    def api(self, path: str, args: dict[str, str]) -> Answer:
        if path == "locks":
            return self._api_locks(args)
        if path.startswith("locks/"):
            view = self.source.one(path[len("locks/") :])
            objects = public(view.objects)
            if view.problems:  # what was read, and what could not be
                return _json({"objects": objects, "problems": _problems(view.problems)})
            return _json(objects)
        if path == "events":
            return self._api_events(args)
        raise HttpError("404 Not Found", f"no API /api/{path[:80]}")

    def _api_locks(self, args: dict[str, str]) -> Answer:
        """One page of ``celery locks list --json``: every object (lock, permit, rate
        limiter, control) of *limit* names in order, from the *cursor*-th name on (the
        store's index answers the page: its cost grows with the page, not the keyspace)."""
        limit = whole(args.get("limit"), "limit", low=1, high=PAGE_MAX, default=PAGE_DEFAULT)
        offset = whole(args.get("cursor"), "cursor", high=CURSOR_MAX, default=0)
        view = self.source.listing(args.get("pattern") or "*", offset=offset, limit=limit)
        out: dict[str, Any] = {
            "locks": public(view.objects),
            "next": str(offset + limit) if view.more else None,
        }
        if view.problems:
            out["problems"] = _problems(view.problems)
        return _json(out)

    def _api_events(self, args: dict[str, str]) -> Answer:
        """One page of the recorded events, newest first (``count`` is ``limit``'s old
        name)."""
        given = args.get("limit", args.get("count"))
        limit = whole(given, "limit", low=1, high=PAGE_MAX, default=PAGE_DEFAULT)
        offset = whole(args.get("cursor"), "cursor", high=MAXLEN, default=0)
        end = offset + limit
        events, problems = self.source.events(args.get("name") or None, count=end + 1)
        out: dict[str, Any] = {
            "events": events[offset:end],
            "next": str(end) if len(events) > end and end < MAXLEN else None,
        }
        if problems:
            out["problems"] = _problems(problems)
        return _json(out)

    # -- who acts ---------------------------------------------------------------------------
    def _session(self, environ: Environ) -> Session | None:
        cookie: SimpleCookie = SimpleCookie()
        try:
            cookie.load(environ.get("HTTP_COOKIE", ""))
        except CookieError:  # a malformed cookie header is no session
            return None
        morsel = cookie.get(_COOKIE)
        return self.sessions.get(morsel.value) if morsel is not None else None

    def _cookie(self, environ: Environ, base: str, value: str, max_age: int) -> str:
        secure = self.secure_cookies or environ.get("wsgi.url_scheme") == "https"
        return (
            f"{_COOKIE}={value}; Path={base or ''}/; Max-Age={max_age}; HttpOnly; "
            "SameSite=Strict" + ("; Secure" if secure else "")
        )

    def login(self, environ: Environ, base: str, method: str, args: dict[str, str]) -> Answer:
        if not self.tokens:
            raise HttpError("404 Not Found", "this board has no token to sign in with")
        note = ""
        back = args.get("next", "")
        if method == "POST":
            form = _form(environ)
            back = form.get("next", "")
            token = pasted(self.tokens, form.get("token", ""))
            if token is not None:
                session = self.sessions.open(token)
                log.info("celery-redlock board: %r signed in from %s", token.name, _client(environ))
                cookie = self._cookie(environ, base, session.id, math.ceil(self.sessions.ttl))
                target = local_path(back, base)
                return "303 See Other", [("Set-Cookie", cookie), ("Location", target)], ""
            log.info(
                "celery-redlock board: sign-in refused from %s (not a token of this board)",
                _client(environ),
            )
            note = '<p class="problems">That is not a token of this board.</p>'
        elif method not in ("GET", "HEAD"):
            raise HttpError("405 Method Not Allowed", "sign in with GET (the form) or POST")
        body = (
            f'<h1>Sign in</h1>{note}<form method=post action="{e(base)}/login">'
            f"{hidden({'next': local_path(back, base)})}"
            '<label>token <input type="password" name="token" autocomplete="off"></label> '
            '<button type="submit">sign in</button></form>'
        )
        return "200 OK", [], pages.layout(base, "sign in", body, where=self._where(), user=None)

    def logout(self, environ: Environ, base: str) -> Answer:
        """End the session (its CSRF token in the form: another site cannot sign you out)."""
        form = _form(environ)
        session = self._session(environ)
        if session is not None:
            if not session.csrf_ok(form.get("csrf", "")):
                raise HttpError(
                    "403 Forbidden", "the form's CSRF token is missing or wrong: reload the page"
                )
            self.sessions.end(session.id)
            log.info(
                "celery-redlock board: %r signed out from %s", session.token.name, _client(environ)
            )
        gone = self._cookie(environ, base, "", 0)
        return "303 See Other", [("Set-Cookie", gone), ("Location", base + "/")], ""

    def act(self, environ: Environ, base: str) -> Answer:
        """One action: refused (403) unless actions are on, the session is live and the
        form's CSRF token is that session's; a bad value is a 400; asks for confirmation
        first."""
        who = _client(environ)
        if not self.actions:
            raise HttpError(
                "403 Forbidden", "actions are off on this board (start it with --actions)"
            )
        form = _form(environ)
        session = self._session(environ)
        if session is None:
            log.info("celery-redlock board: action refused from %s: no live session", who)
            raise HttpError(
                "403 Forbidden", "no valid session: sign in with the board's token first"
            )
        user = session.token.name
        if not session.csrf_ok(form.get("csrf", "")):
            log.info(
                "celery-redlock board: action (token %r) from %s refused: bad CSRF token", user, who
            )
            raise HttpError(
                "403 Forbidden", "the form's CSRF token is missing or wrong: reload the page"
            )
        verb, name = form.get("verb", ""), form.get("name", "")
        if verb not in _VERBS or (not name and verb != "release-set"):
            raise bad(f"unknown action {verb[:20]!r} (one of {', '.join(_VERBS)})")
        values = _values(verb, form)  # every value checked before a question is asked
        if verb == "release-set":
            return self._release_set(environ, base, form, user, who)
        back = f"{base}/key/{quote(name, safe='')}"
        if form.get("confirmed") != "yes":
            return "200 OK", [], self._confirm(environ, base, form)
        try:
            code, said = self._do(verb, name, form, values, user)
        except ConfigError as exc:
            log.info(
                "celery-redlock board: %s %r (token %r) from %s refused: %s",
                verb,
                name,
                user,
                who,
                exc,
            )
            raise bad(f"{verb} {name[:80]!r} refused: {one_line(exc)}") from None
        except StoreUnavailable as exc:
            code, said = "unreachable", f"failed: Redis unreachable ({one_line(exc)})"
        log.info("celery-redlock board: %s %r (token %r) from %s: %s", verb, name, user, who, said)
        return "303 See Other", [("Location", back + pages.query(done=code))], ""

    def _confirm(self, environ: Environ, base: str, form: dict[str, str]) -> str:
        fields = {k: v for k, v in form.items() if k != "confirmed"}
        question = _question(form)
        body = (
            f'<h1>Confirm</h1><p class="confirm">{e(question)}</p>'
            f'<form method=post action="{e(base)}/action">{hidden(fields)}'
            '<input type="hidden" name="confirmed" value="yes">'
            '<button type="submit" class="danger" id="confirm">yes, do it</button> '
            f'<a href="{e(base)}/key/{e(quote(form.get("name", ""), safe=""))}">cancel</a></form>'
        )
        return self._layout(environ, base, "confirm", body)

    def _matching(self, filters: dict[str, str]) -> Any:
        """The first :data:`SET_MAX` keys the overview's *filters* match (a View)."""
        return self.source.listing(
            glob_escape(filters["prefix"]) + "*",
            kind=filters["kind"],
            state=filters["state"],
            task_id=filters["task_id"],
            worker=filters["worker"],
            limit=SET_MAX,
        )

    def _release_set(
        self, environ: Environ, base: str, form: dict[str, str], user: str, who: str
    ) -> Answer:
        """Release every lock, permit and queued hold the overview's filters match (at
        most :data:`SET_MAX` names): a confirm page that lists them first; then each one
        read now, each released by its fence (task id, for a queued hold), so that only
        the acquisitions read are removed."""
        filters = pages.overview_filters(form)
        filters["offset"] = filters["sort"] = ""
        view = self._matching(filters)
        if view.unknown:
            raise bad(f"nothing released: {pages.unknown_text(view)}")
        # each master's own objects (a Redlock): each one's hold is released on it
        held = [o for o in view.objects if o["kind"] in ("lock", "permit")]
        back = f"{base}/" + pages.query(**filters)
        if form.get("confirmed") != "yes":
            return "200 OK", [], self._confirm_set(environ, base, form, filters, view, held)
        released = 0
        for obj in held:
            fields = {
                "state": obj["state"],
                "kind": obj["kind"],
                "fence": "" if obj["fence"] is None else str(obj["fence"]),
                "task_id": obj["holder"].get("task_id") or "",
                "master": obj.get("master") or "",
            }
            try:
                code, said = self._release(obj["name"], fields, obj["fence"], user)
            except (ConfigError, StoreUnavailable) as exc:
                code, said = "failed", f"failed: {one_line(exc)}"
            released += code in ("released", "dequeued")
            log.info(
                "celery-redlock board: release-set %r (token %r) from %s: %s",
                obj["name"],
                user,
                who,
                said,
            )
        log.info(
            "celery-redlock board: release-set of %s (token %r) from %s: %d of %d released",
            _filters_text(filters),
            user,
            who,
            released,
            len(held),
        )
        code = "released-set" if held else "nothing-set"
        return (
            "303 See Other",
            [("Location", back + ("&" if "?" in back else "?") + f"done={code}")],
            "",
        )

    def _confirm_set(  # noqa: PLR0917 - the parts of one page
        self,
        environ: Environ,
        base: str,
        form: dict[str, str],
        filters: dict[str, str],
        view: Any,
        held: list[dict[str, Any]],
    ) -> str:
        names = sorted({o["name"] for o in held})
        more = (view.total or 0) > SET_MAX
        fields = {k: v for k, v in form.items() if k != "confirmed"}
        listed = "".join(f"<li>{e(pages.label(n))}</li>" for n in names)
        note = (
            f'<p class="confirm">More than {SET_MAX:,} keys match '
            f"({e(pages.keys_text(view.total or 0))}): "
            f"only the first {SET_MAX:,} are released; release again for the rest.</p>"
            if more
            else ""
        )
        if not names:
            body = (
                '<h1>Confirm</h1><p class="empty">Nothing held matches '
                f"{e(_filters_text(filters))}.</p>"
                f'<a href="{e(base)}/{e(pages.query(**filters))}">back</a>'
            )
            return self._layout(environ, base, "confirm", body)
        question = (
            f"Release {len(held):,} hold{'' if len(held) == 1 else 's'} of "
            f"{pages.keys_text(len(names))} ({_filters_text(filters)})? Their holders keep "
            "running and may overlap with the next owners; a queued hold's message stays "
            "queued."
        )
        body = (
            f'<h1>Confirm</h1><p class="confirm">{e(question)}</p>{note}'
            f'<ul class="names" id="to-release">{listed}</ul>'
            f'<form method=post action="{e(base)}/action">{hidden(fields)}'
            '<input type="hidden" name="confirmed" value="yes">'
            '<button type="submit" class="danger" id="confirm">yes, release them</button> '
            f'<a href="{e(base)}/{e(pages.query(**filters))}">cancel</a></form>'
        )
        return self._layout(environ, base, "confirm", body)

    def _do(
        self, verb: str, name: str, form: dict[str, str], values: dict[str, Any], user: str
    ) -> tuple[str, str]:
        """The action, through the code of ``celery locks`` and ``control(app)``: the code
        of its sentence (:data:`DONE`) and what it did, for the log."""
        seconds = values.get("seconds")
        span = f" for {form.get('for', '').strip()}" if seconds else ""
        if verb == "release":
            return self._release(name, form, values.get("fence"), user)
        controls = self.source.controls()
        if verb == "pause":
            controls.pause(name, seconds, reason=form.get("reason", "")[:500])
            return "paused", "paused" + (span or " until resumed")
        if verb == "resume":
            return ("resumed", "resumed") if controls.resume(name) else ("not-paused", "not paused")
        if verb == "unset":
            if controls.unset(name):
                return "unset", "overrides lifted"
            return "no-override", "had no override"
        limit, burst = values.get("limit"), values.get("burst")
        rate = form.get("rate", "").strip() or None
        controls.override(name, limit=limit, rate=rate, burst=burst, seconds=seconds)
        parts = ([f"limit {limit}"] if limit else []) + ([f"rate {rate}"] if rate else [])
        return "set", ", ".join(parts) + (span or " until unset")

    def _release(
        self, name: str, form: dict[str, str], fence: int | None, user: str
    ) -> tuple[str, str]:
        """Remove the acquisition shown (its fence), the permit shown (its fence), or the
        queued hold shown (its task id), on the master it was shown on, as ``celery locks
        release`` does; a removed acquisition is recorded as a ``forced`` event."""
        master = form.get("master") or None
        notice_ttl = self.source.settings.ttl
        said: list[str] = []
        codes: list[str] = []
        queued = form.get("state") == "queued"
        if form.get("kind") == "permit":
            if fence is None:
                raise ConfigError("a permit is released by its fence: the form has none")
            rules = matching(task_rules(self.source.app), name)
            limit = max((r.limit or 1 for r in rules), default=2)
            done = force_release_permit(
                self.source.store(), self.source.prefix, name, fence,
                limit=limit, notice_ttl=notice_ttl,
            )  # fmt: skip
            if done.outcome == "released":
                self._record_forced(name, done.fence, done.record, user)
            return done.outcome, "permit: " + done.said(name)
        for _, backend in self.source.clients():
            if self.source.redlock and backend.describe() != master:
                continue
            prefix = self.source.prefix
            if queued:
                gone = force_dequeue(backend, prefix, name, form.get("task_id") or None)
                said.append(f"queued hold of {name!r}: {gone.outcome}")
                codes.append("dequeued" if gone.outcome == "released" else gone.outcome)
                continue
            done = force_release(backend, prefix, name, fence, notice_ttl=notice_ttl)
            said.append(done.said(name))
            codes.append(done.outcome)
            if done.outcome == "released":
                self._record_forced(name, done.fence, done.record, user, backend)
        if not codes:
            return "no-master", f"no master {master!r}"
        return codes[0], "; ".join(said)

    def _record_forced(
        self,
        name: str,
        fence: int | None,
        record: dict[str, Any],
        user: str,
        backend: Any = None,
    ) -> None:
        """Log a ``forced`` event (the timeline's force-released bar)."""
        store = backend if backend is not None else self.source.store()
        by = f"operator {user!r} through the board"
        log_forced(store, self.source.prefix, name, fence, record, by=by)


def _filters_text(filters: dict[str, str]) -> str:
    """The overview's filters in words: ``prefix 'sync:', kind 'mutex'``."""
    parts = [
        f"{k.replace('_', ' ')} {v!r}"
        for k, v in filters.items()
        if v and k not in ("offset", "sort")
    ]
    return ", ".join(parts) or "no filter: every key held"


class _Forms:
    """The action forms of one key's page (none when actions are off, a sign-in link when
    nobody is signed in)."""

    def __init__(self, board: Board, environ: Environ, base: str, name: str) -> None:
        self.board, self.base, self.name = board, base, name
        session = board._session(environ) if board.actions else None
        self.csrf = session.csrf if session is not None else None
        self.path = f"{base}/key/{quote(name, safe='')}"

    def _form(
        self, verb: str, label: str, fields: dict[str, Any], inputs: str = "", danger: bool = False
    ) -> str:
        cls = ' class="danger"' if danger else ""
        return (
            f'<form method=post action="{e(self.base)}/action" class="act">'
            f"{hidden({'csrf': self.csrf, 'verb': verb, 'name': self.name, **fields})}"
            f'{inputs}<button type="submit" name="do" value="{e(verb)}"{cls}>{e(label)}'
            "</button></form>"
        )

    def release(self, obj: dict[str, Any]) -> str:
        if self.csrf is None or (obj["kind"] == "permit" and obj["fence"] is None):
            return ""
        fields = {
            "kind": obj["kind"],
            "state": obj["state"],
            "fence": obj["fence"],
            "task_id": obj["holder"].get("task_id"),
            "master": obj.get("master"),
            "holder": pages.who(obj["holder"]),
        }
        return self._form("release", "release", fields, danger=True)

    def release_set(self, filters: dict[str, str]) -> str:
        """The overview's form that releases what its filters match (signed in only)."""
        if self.csrf is None:
            return ""
        fields = {k: v for k, v in filters.items() if v and k not in ("offset", "sort")}
        return (
            f'<form method=post action="{e(self.base)}/action" class="act actions-set">'
            f"{hidden({'csrf': self.csrf, 'verb': 'release-set', **fields})}"
            '<button type="submit" class="danger" id="release-set">release what these '
            "filters match…</button></form>"
        )

    def controls(self) -> str:
        if not self.board.actions:
            return ""
        if self.csrf is None:
            return (
                f'<p class="signin"><a href="{e(self.base)}/login{pages.query(next=self.path)}">'
                "Sign in with the board's token</a> to release, pause or change this key.</p>"
            )
        dur = '<input name="for" placeholder="for (10m; empty: until lifted)" size="14">'
        return (
            '<section class="actions"><h2>Actions</h2>'
            + self._form("pause", "pause", {}, dur + '<input name="reason" placeholder="reason">')
            + self._form("resume", "resume", {})
            + self._form(
                "set",
                "set",
                {},
                '<input name="limit" placeholder="limit" size="5" inputmode="numeric">'
                '<input name="rate" placeholder="rate (100/m)" size="10">'
                '<input name="burst" placeholder="burst" size="5" inputmode="numeric">' + dur,
            )
            + self._form("unset", "unset", {})
            + "</section>"
        )


def _question(form: dict[str, str]) -> str:
    verb, name = form.get("verb", ""), form.get("name", "")
    if verb == "release":
        who = form.get("holder") or "its holder"
        if form.get("kind") == "permit":
            return (
                f"Release one permit of semaphore {name!r} held by {who} (fence "
                f"{form.get('fence') or '?'})? The holder keeps running; another run may "
                "take the permit."
            )
        if form.get("state") == "queued":
            return f"Remove the queued hold of {name!r} ({who})? The message stays queued."
        return (
            f"Release lock {name!r} held by {who} (fence {form.get('fence') or '?'})? The holder "
            "keeps running and may overlap with the next owner."
        )
    if verb == "pause":
        span = f" for {form['for']}" if form.get("for") else " until resumed"
        return f"Pause {name!r}{span}? No new run that takes it starts on any worker."
    if verb == "set":
        parts = [f"{k} {form[k]}" for k in ("limit", "rate", "burst") if form.get(k)]
        return (
            f"Set {name!r}: {', '.join(parts) or 'nothing'}, on every worker from its next start?"
        )
    return f"{verb.capitalize()} {name!r}?"


def _values(verb: str, form: dict[str, str]) -> dict[str, Any]:
    """The numbers of an action's form, each checked (a 400 naming the field)."""
    values: dict[str, Any] = {}
    if verb in ("pause", "set"):
        values["seconds"] = duration(form.get("for"))
    if verb == "set":
        for field in ("limit", "burst"):
            if (form.get(field) or "").strip():
                values[field] = whole(form.get(field), field, low=1, high=1_000_000)
    if verb == "release" and form.get("state") != "queued" and (form.get("fence") or "").strip():
        values["fence"] = whole(form.get("fence"), "fence", high=2**63 - 1)
    return values


def _path(environ: Environ) -> str:
    """PATH_INFO as text (WSGI hands it over as latin-1 of the bytes)."""
    raw = environ.get("PATH_INFO", "") or ""
    try:
        return str(raw.encode("latin-1").decode("utf-8"))
    except (UnicodeEncodeError, UnicodeDecodeError):
        return str(raw)


def _query(environ: Environ) -> dict[str, str]:
    """The query's values (the last of each name)."""
    query = environ.get("QUERY_STRING", "") or ""
    return {k: v[-1] for k, v in parse_qs(query, max_num_fields=100).items()}


def _client(environ: Environ) -> str:
    """The client's address, for the log (a proxy's own, behind one)."""
    return str(environ.get("REMOTE_ADDR") or "?")


def _form(environ: Environ) -> dict[str, str]:
    length = str(environ.get("CONTENT_LENGTH") or "0").strip()
    size = whole(length or "0", "Content-Length", high=2**40)
    if size > 65536:
        raise HttpError("413 Content Too Large", "the form is too large")
    data = environ["wsgi.input"].read(size) if size > 0 else b""
    try:
        fields = parse_qs(data.decode("utf-8", "replace"), max_num_fields=100)
    except ValueError:
        raise bad("the form has too many fields") from None
    return {k: v[-1] for k, v in fields.items()}


def _problems(problems: Sequence[Any]) -> list[dict[str, Any]]:
    return [dict(p.__dict__) for p in problems]


def _json(data: Any) -> Answer:
    text = json.dumps(data, indent=2, default=_safe)
    return "200 OK", [("Content-Type", "application/json")], text


def _safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def _text_page(text: str) -> str:
    return f"<!doctype html><meta charset=utf-8><title>board</title><p>{e(text)}</p>"
