"""The board as a plain WSGI application (:class:`Board`): no framework, mountable under
any path (links follow ``SCRIPT_NAME``).

=========================== ===============================================================
``GET /``                   the overview (``?prefix=&kind=``)
``GET /key/<name>``         one key
``GET /api/locks``          ``celery locks list --json`` (``?pattern=``)
``GET /api/locks/<name>``   ``celery locks show NAME --json`` (``[]`` when nothing holds it)
``GET /api/events``         the recorded events, newest first (``?name=&count=``)
``GET|POST /login``         paste a token (actions only)
``POST /action``            release, pause, resume, set, unset (actions only: token + CSRF)
=========================== ===============================================================

A page asked with the header ``X-Board-Part: live`` answers its live part only: the
page's script swaps it in every second. Every answer carries a Content-Security-Policy
that allows no inline script, so even markup that escaped escaping could not run.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable
from http.cookies import SimpleCookie
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote

from ..app.checks import parse_duration
from ..app.event_log import MAXLEN
from ..core.admin import force_dequeue, force_release
from ..core.errors import ConfigError, QuorumUnavailable, one_line
from . import pages
from .auth import Token, load_tokens, pasted, token_of
from .pages import e, hidden
from .rules import matching, task_rules
from .source import Source, glob_escape

__all__ = ["Board"]

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
_VERBS = ("release", "pause", "resume", "set", "unset")


class _Refused(Exception):
    def __init__(self, status: str, text: str) -> None:
        super().__init__(text)
        self.status = status


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

    # -- WSGI ---------------------------------------------------------------------------
    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        try:
            status, headers, body = self.handle(environ)
        except _Refused as exc:
            status, headers, body = exc.status, [], _text_page(str(exc))
        except Exception:  # a bug of ours: a short page, the traceback in the log
            log.exception(
                "celery-redlock board: %s %s failed", environ.get("REQUEST_METHOD"), _path(environ)
            )
            status, headers, body = (
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
        if not any(k == "Content-Type" for k, _ in headers):
            base.append(("Content-Type", "text/html; charset=utf-8"))
        start_response(status, base + headers)
        return [data]

    def handle(self, environ: Environ) -> Answer:  # noqa: PLR0911 - one return per route
        method = environ.get("REQUEST_METHOD", "GET")
        path = _path(environ)
        base = environ.get("SCRIPT_NAME", "").rstrip("/")
        args = {k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        if path.startswith("/static/"):
            return self.static(path[len("/static/") :])
        if path == "/action":
            if method != "POST":
                raise _Refused("405 Method Not Allowed", "actions are POSTs")
            return self.act(environ, base)
        if path == "/login":
            return self.login(environ, base, method)
        if self.private and self._session(environ) is None:
            if path.startswith("/api/"):
                raise _Refused("403 Forbidden", "sign in with the board's token first")
            target = base + "/login" + pages.query(next=base + path)
            return "303 See Other", [("Location", target)], ""
        if path.startswith("/api/"):
            return self.api(path[len("/api/") :], args)
        if method not in ("GET", "HEAD"):
            raise _Refused("405 Method Not Allowed", "this page is read-only")
        live = environ.get("HTTP_X_BOARD_PART") == "live"
        if path in ("", "/"):
            return self.overview(environ, base, args, live)
        if path.startswith("/key/"):
            return self.key(environ, base, path[len("/key/") :], args, live)
        raise _Refused("404 Not Found", f"no page {path}")

    # -- pages ----------------------------------------------------------------------------
    def _where(self) -> str:
        urls = ", ".join(url for url, _ in self.source.clients())
        return f"{urls} · prefix {self.source.prefix}"

    def overview(self, environ: Environ, base: str, args: dict[str, str], live: bool) -> Answer:
        filters = pages.overview_filters(args)
        view = self.source.listing(
            glob_escape(filters["prefix"]) + "*",
            kind=filters["kind"],
            state=filters["state"],
            task_id=filters["task_id"],
            worker=filters["worker"],
            offset=int(filters["offset"] or 0),
            limit=pages.PAGE,
            sort=filters["sort"] or "name",
        )
        rows = pages.group(view, task_rules(self.source.app))
        part = pages.overview_live(base, view, rows, filters)
        if live:
            return "200 OK", [], part
        body = pages.overview_page(base, part, filters)
        return (
            "200 OK",
            [],
            pages.layout(base, "locks", body, where=self._where(), user=self._user(environ)),
        )

    def key(
        self, environ: Environ, base: str, name: str, args: dict[str, str], live: bool
    ) -> Answer:
        view = self.source.one(name)
        events, problems = self.source.events(name, count=50)
        forms = _Forms(self, environ, base, name)
        rules = matching(task_rules(self.source.app), name)
        part = pages.key_live(base, name, view, events, problems, forms, rules)
        if live:
            return "200 OK", [], part
        body = pages.key_page(name, part, forms.controls(), args.get("done", ""))
        return (
            "200 OK",
            [],
            pages.layout(base, name, body, where=self._where(), user=self._user(environ)),
        )

    def static(self, name: str) -> Answer:
        if name not in _STATIC:
            raise _Refused("404 Not Found", "no such file")
        data = resources.files(__package__).joinpath("static").joinpath(name).read_bytes()
        return "200 OK", [("Content-Type", _STATIC[name])], data

    def api(self, path: str, args: dict[str, str]) -> Answer:
        if path == "locks":
            view = self.source.listing(args.get("pattern", "*"), limit=None)
            out: Any = view.objects
        elif path.startswith("locks/"):
            view = self.source.one(path[len("locks/") :])
            out = view.objects
        elif path == "events":
            count = args.get("count", "100")
            wanted = min(int(count), MAXLEN) if count.isdigit() else 100
            events, problems = self.source.events(args.get("name") or None, count=wanted)
            out, view = events, None
            if problems:
                return _json({"events": events, "problems": [p.__dict__ for p in problems]})
        else:
            raise _Refused("404 Not Found", f"no API /api/{path}")
        if view is not None and view.problems:  # what was read, and what could not be
            return _json({"objects": out, "problems": [p.__dict__ for p in view.problems]})
        return _json(out)

    # -- who acts ---------------------------------------------------------------------------
    def _session(self, environ: Environ) -> tuple[Token, str] | None:
        cookie = SimpleCookie()
        try:
            cookie.load(environ.get("HTTP_COOKIE", ""))
        except Exception:  # a malformed cookie header is no session
            return None
        morsel = cookie.get(_COOKIE)
        session = morsel.value if morsel is not None else ""
        token = token_of(self.tokens, session)
        return (token, session) if token is not None else None

    def _user(self, environ: Environ) -> str | None:
        found = self._session(environ) if self.tokens else None
        return found[0].name if found else None

    def login(self, environ: Environ, base: str, method: str) -> Answer:
        if not self.tokens:
            raise _Refused("404 Not Found", "this board has no token to sign in with")
        note = ""
        if method == "POST":
            form = _form(environ)
            token = pasted(self.tokens, form.get("token", ""))
            if token is not None:
                log.info("celery-redlock board: %r signed in", token.name)
                path = (base or "") + "/"
                cookie = f"{_COOKIE}={token.session()}; Path={path}; HttpOnly; SameSite=Strict"
                back = form.get("next", "")
                target = back if _local(back, base) else path
                return "303 See Other", [("Set-Cookie", cookie), ("Location", target)], ""
            note = '<p class="problems">That is not a token of this board.</p>'
        args = {k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        body = (
            f'<h1>Sign in to act</h1>{note}<form method=post action="{e(base)}/login">'
            f"{hidden({'next': args.get('next', '')})}"
            '<label>token <input type="password" name="token" autocomplete="off"></label> '
            '<button type="submit">sign in</button></form>'
        )
        return "200 OK", [], pages.layout(base, "sign in", body, where=self._where(), user=None)

    def act(self, environ: Environ, base: str) -> Answer:
        """One action: refused (403) unless actions are on, the session's token is valid
        and the form's CSRF token is that session's; asks for confirmation first."""
        if not self.actions:
            raise _Refused(
                "403 Forbidden", "actions are off on this board (start it with --actions)"
            )
        form = _form(environ)
        found = self._session(environ)
        if found is None:
            raise _Refused("403 Forbidden", "no valid token: sign in with the board's token first")
        token, session = found
        if not _same(form.get("csrf", ""), token.csrf(session)):
            raise _Refused(
                "403 Forbidden", "the form's CSRF token is missing or wrong: reload the page"
            )
        verb, name = form.get("verb", ""), form.get("name", "")
        if verb not in _VERBS or not name:
            raise _Refused(
                "400 Bad Request", f"unknown action {verb!r} (one of {', '.join(_VERBS)})"
            )
        back = f"{base}/key/{quote(name, safe='')}"
        if form.get("confirmed") != "yes":
            return "200 OK", [], self._confirm(base, token.name, form)
        try:
            done = self._do(verb, name, form)
        except ConfigError as exc:
            done = f"{verb} {name!r} refused: {exc}"
        except QuorumUnavailable as exc:
            done = f"{verb} {name!r} failed: Redis unreachable ({one_line(exc)})"
        log.info("celery-redlock board: %s (token %r): %s", verb, token.name, done)
        return "303 See Other", [("Location", back + pages.query(done=done))], ""

    def _confirm(self, base: str, user: str, form: dict[str, str]) -> str:
        fields = {k: v for k, v in form.items() if k != "confirmed"}
        question = _question(form)
        body = (
            f'<h1>Confirm</h1><p class="confirm">{e(question)}</p>'
            f'<form method=post action="{e(base)}/action">{hidden(fields)}'
            '<input type="hidden" name="confirmed" value="yes">'
            '<button type="submit" class="danger" id="confirm">yes, do it</button> '
            f'<a href="{e(base)}/key/{e(quote(form.get("name", ""), safe=""))}">cancel</a></form>'
        )
        return pages.layout(base, "confirm", body, where=self._where(), user=user)

    def _do(self, verb: str, name: str, form: dict[str, str]) -> str:
        """The action, through the code of ``celery locks`` and ``control(app)``."""
        seconds = _seconds(form.get("for", ""))
        if verb == "release":
            return self._release(name, form)
        controls = self.source.controls()
        if verb == "pause":
            controls.pause(name, seconds, reason=form.get("reason", ""))
            return f"paused {name!r}" + (f" for {form['for']}" if seconds else " until resumed")
        if verb == "resume":
            return f"resumed {name!r}" if controls.resume(name) else f"{name!r} was not paused"
        if verb == "unset":
            return (
                f"{name!r}: overrides lifted"
                if controls.unset(name)
                else f"{name!r} had no override"
            )
        limit = _int(form.get("limit", ""), "limit")
        burst = _int(form.get("burst", ""), "burst")
        rate = form.get("rate", "").strip() or None
        controls.override(name, limit=limit, rate=rate, burst=burst, seconds=seconds)
        parts = ([f"limit {limit}"] if limit else []) + ([f"rate {rate}"] if rate else [])
        return (
            f"{name!r}: "
            + ", ".join(parts)
            + (f" for {form['for']}" if seconds else " until unset")
        )

    def _release(self, name: str, form: dict[str, str]) -> str:
        """Remove the acquisition shown (its fence), or the queued hold shown (its task id),
        on the master it was shown on, as ``celery locks release`` does."""
        master = form.get("master") or None
        notice_ttl = self.source.settings.ttl
        said = []
        for _, backend in self.source.clients():
            if self.source.redlock and backend.describe() != master:
                continue
            prefix = self.source.prefix
            if form.get("state") == "queued":
                gone = force_dequeue(backend, prefix, name, form.get("task_id") or None)
                said.append(f"queued hold of {name!r}: {gone.outcome}")
                continue
            fence = form.get("fence") or None
            done = force_release(backend, prefix, name, fence, notice_ttl=notice_ttl)
            said.append(done.said(name))
        return "; ".join(said) or f"{name!r}: no master {master!r}"


class _Forms:
    """The action forms of one key's page (none when actions are off, a sign-in link when
    nobody is signed in)."""

    def __init__(self, board: Board, environ: Environ, base: str, name: str) -> None:
        self.board, self.base, self.name = board, base, name
        found = board._session(environ) if board.actions else None
        self.csrf = found[0].csrf(found[1]) if found else None
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
        if self.csrf is None or obj["kind"] == "permit":
            return ""
        fields = {
            "state": obj["state"],
            "fence": obj["fence"],
            "task_id": obj["holder"].get("task_id"),
            "master": obj.get("master"),
            "holder": pages.who(obj["holder"]),
        }
        return self._form("release", "release", fields, danger=True)

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


def _local(target: str, base: str) -> bool:
    """True for a path of this board (never another site: ``//host``, ``/\\host``)."""
    return target.startswith(base + "/") and not target.startswith(("//", "/\\"))


def _path(environ: Environ) -> str:
    """PATH_INFO as text (WSGI hands it over as latin-1 of the bytes)."""
    raw = environ.get("PATH_INFO", "") or ""
    try:
        return str(raw.encode("latin-1").decode("utf-8"))
    except (UnicodeEncodeError, UnicodeDecodeError):
        return str(raw)


def _form(environ: Environ) -> dict[str, str]:
    try:
        size = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        size = 0
    if size > 65536:
        raise _Refused("413 Content Too Large", "the form is too large")
    data = environ["wsgi.input"].read(size) if size > 0 else b""
    return {k: v[-1] for k, v in parse_qs(data.decode("utf-8", "replace")).items()}


def _same(given: str, expected: str) -> bool:
    import hmac  # noqa: PLC0415 - only actions compare secrets

    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def _seconds(value: str) -> float | None:
    value = value.strip()
    if not value:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ConfigError(f"for {value!r}: {exc}") from None


def _int(value: str, what: str) -> int | None:
    value = value.strip()
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"{what} must be a whole number, got {value!r}")
    return int(value)


def _json(data: Any) -> Answer:
    text = json.dumps(data, indent=2, default=_safe)
    return "200 OK", [("Content-Type", "application/json")], text


def _safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def _text_page(text: str) -> str:
    return f"<!doctype html><meta charset=utf-8><title>board</title><p>{e(text)}</p>"
