"""``celery locks``: see who holds which lock, and release one by hand.

::

    celery -A proj locks list [PATTERN] [--json]
    celery -A proj locks show NAME [--json]
    celery -A proj locks release NAME|PATTERN [--force] [--yes] [--queued]

Names are the rendered lock names (``sync:42``), not Redis keys. Locks are found
with ``SCAN`` (never ``KEYS``), on every primary of a Redis Cluster; with a list of
URLs (Redlock) each master is shown on its own row.

``--redlock-url`` (or ``REDLOCK_URL`` in the environment) points the command where a
worker started with that flag keeps its locks, as the worker flag does.

Exit codes: 0 done; 1 the lock is not held, or the release was refused or
aborted; 2 usage or configuration error; 3 Redis unreachable, or refusing the
credentials.

Settings come from ``celery_redlock.app.config.load_settings`` (the checks and the
broker fallback the worker uses); every read and removal is a backend's operator
verb, called through ``celery_redlock.core.admin``. This module only picks the
masters and maps errors to exit codes; :mod:`celery_redlock.cli.render` shows the rows.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options
from celery.exceptions import CeleryCommandException

from ..app.checks import parse_duration
from ..app.config import Settings, load_settings
from ..app.controls import Controls
from ..app.event_log import log_forced
from ..app.flags import flag_overrides, locks_flags
from ..core import STORE_ERRORS, Backend, access_denied, connect, mask_url, open_backend
from ..core.admin import (
    LockInfo,
    RateInfo,
    force_dequeue,
    force_release,
    read_lock,
    read_rate,
    scan_locks,
    scan_rates,
)
from ..core.backend import FlowControl, has, lacks
from ..core.backend_types import Control
from ..core.errors import ConfigError, one_line
from ..core.keys import lock_keys
from .render import (
    LockRow,
    control_json,
    control_table,
    dequeue_said,
    lock_details,
    lock_table,
    rate_details,
    rate_json,
    rate_table,
    release_notes,
)

__all__ = ["EXIT_NOT_HELD", "EXIT_UNREACHABLE", "LockRow", "locks"]

EXIT_NOT_HELD = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
#: Where the group keeps its flags' setting overrides for its commands (``ctx.meta``).
_OVERRIDES = "celery_redlock.overrides"
#: Marks a master without a queued hold of the name (its owner may be None: forced).
_NONE = object()


class _Unreachable(Exception):
    """A master that could not be asked: unreachable (exit 3), or it refused (exit 2)."""

    def __init__(self, url: str, exc: BaseException) -> None:
        self.url = url
        #: A refusal that no retry mends (a wrong password, missing ACL rights, foreign
        #: data under the prefix) is a configuration error, not an outage.
        self.refused = _refused(exc)
        self.exit_code = EXIT_USAGE if self.refused else EXIT_UNREACHABLE
        if _bad_credentials(exc):  # exit 3, worded as the worker's start-up line
            super().__init__(
                f"Redis at {url} refused the credentials ({one_line(exc)}): check the user "
                "name and password in redlock_url"
            )
        elif self.refused:
            super().__init__(f"Redis at {url} refused the request: {one_line(exc)}")
        else:
            super().__init__(f"cannot reach Redis at {url}: {one_line(exc)}")


#: What a master that cannot be asked raises: the backend's StoreUnavailable, or a
#: client-side Redis error it passes on as it is.
_UNREACHABLE = STORE_ERRORS


def _refused(exc: BaseException) -> bool:
    """True for a refusal that no retry mends and that is a usage error (missing ACL
    rights)."""
    return access_denied(exc) == "permissions"


def _bad_credentials(exc: BaseException) -> bool:
    """True when Redis refused the user name or password (exit 3: the Redis side)."""
    return access_denied(exc) == "credentials"


def _conf_url(conf: Any) -> Any:
    """``redlock_url`` as Celery reads it (``CELERY_REDLOCK_URL`` under a namespace too)."""
    try:
        return conf.get("redlock_url")
    except Exception:
        return None


class _Session:
    """The app's lock settings and one client per master, with errors mapped to exit codes.

    Settings are read afresh for each command from ``app.conf`` and this command's flags
    (``load_settings``: the same checks and broker fallback as the worker), so a changed
    ``app.conf`` is never served stale. A worker's flags are that worker's own: ``celery
    locks`` runs in a process of its own and keeps no state of the app.
    """

    def __init__(self, ctx: click.Context) -> None:
        self.ctx = ctx
        app = ctx.obj.app
        overrides: dict[str, Any] = dict(ctx.meta.get(_OVERRIDES, {}))
        #: The locks' URL is the broker's (no redlock_url, no --redlock-url).
        self.from_broker = overrides.get("redlock_url") is None and not _conf_url(app.conf)
        try:
            self.settings: Settings = load_settings(app.conf, overrides)
            options = self.settings.client_options
            url = self.settings.urls
            self.is_redlock = isinstance(url, list)
            urls = url if isinstance(url, list) else [url]
            #: (masked url, backend) per master: one for a single Redis, N for Redlock.
            self.clients: list[tuple[str, Backend]] = [
                (mask_url(u), open_backend(connect(u, **options))) for u in urls
            ]
        except ConfigError as exc:
            raise CeleryCommandException(str(exc), EXIT_USAGE) from None
        self.prefix: str = self.settings.key_prefix
        self.unreachable: list[_Unreachable] = []

    def where(self) -> str:
        """Where the locks were looked for, for a reader who found none there."""
        where = ", ".join(url for url, _ in self.clients)
        if self.from_broker:
            return (
                f"{where} (the broker's Redis: a worker started with --redlock-url keeps "
                "its locks there; pass the same --redlock-url, or set REDLOCK_URL)"
            )
        return where

    def master_of(self, backend: Backend) -> str | None:
        return backend.describe() if self.is_redlock else None

    def collect(self, read: Callable[[Any], Sequence[LockInfo]]) -> list[LockRow]:
        """*read* on every master; rows sorted by name, then master."""
        rows: list[LockRow] = []
        for url, client in self.clients:
            try:
                infos = read(client)
            except _UNREACHABLE as exc:
                self.unreachable.append(_Unreachable(url, exc))
                continue
            except ConfigError as exc:  # foreign data where the lock should be
                raise CeleryCommandException(f"{url}: {exc}", EXIT_USAGE) from None
            master = self.master_of(client)
            rows += [LockRow.of(info, master) for info in infos]
        if self.unreachable and len(self.unreachable) == len(self.clients):
            self.fail_unreachable()
        return sorted(rows, key=lambda r: (r.name, r.master or ""))

    def limiters(self, read: Callable[[Any], Sequence[RateInfo]]) -> list[RateInfo]:
        """*read* (rate limiters' state) on every master that answered so far."""
        found: list[RateInfo] = []
        failed = {problem.url for problem in self.unreachable}
        for url, client in self.clients:
            if url in failed:
                continue
            try:
                found += read(client)
            except _UNREACHABLE as exc:
                self.unreachable.append(_Unreachable(url, exc))
        return sorted(found, key=lambda info: info.name)

    def warn_unreachable(self) -> None:
        for problem in self.unreachable:
            self.ctx.obj.error(f"celery locks: {problem}")

    def fail_unreachable(self) -> NoReturn:
        first, *rest = self.unreachable
        for problem in rest:
            self.ctx.obj.error(f"celery locks: {problem}")
        code = min(problem.exit_code for problem in self.unreachable)  # a refusal says more
        raise CeleryCommandException(str(first), code)

    def finish(self) -> None:
        """Exit 3 when some master could not be reached (after showing what was read)."""
        if self.unreachable:
            self.fail_unreachable()


# -- the commands ----------------------------------------------------------------------
@click.group(name="locks")
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]  # celery is untyped
def locks(ctx: click.Context) -> None:
    """Inspect and release celery-redlock locks.

    Exit codes: 0 done, 1 not held / refused / aborted, 2 usage error, 3 Redis unreachable
    or refusing the credentials.
    """


def _takes_flags(command: click.Command) -> click.Command:
    """Give *command* the worker flags ``celery locks`` takes (``--redlock-url``), before
    or after the subcommand's name: each stores its setting override for the command."""
    for option in locks_flags():
        option.expose_value = False
        option.callback = _store_flag
        command.params.append(option)
    return command


def _store_flag(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if param.name:
        ctx.meta.setdefault(_OVERRIDES, {}).update(flag_overrides({param.name: value}))
    return value


_takes_flags(locks)


_json_option = click.option(
    "--json",
    "as_json",
    cls=CeleryOption,
    is_flag=True,
    help_group="Output Options",
    help="Print a JSON array of lock objects.",
)


@_takes_flags
@locks.command(name="list", cls=CeleryCommand)
@click.argument("pattern", required=False, default="*")
@_json_option
@click.pass_context
def list_(ctx: click.Context, pattern: str, as_json: bool) -> None:
    """List held locks, semaphore permits and rate limiters whose name matches PATTERN
    (a glob, default "*").

    STATE says whether a task's run holds the lock (running), a message not started
    yet holds it from its publish (queued: lock_on="enqueue"), or another holder (held).
    """
    session = _Session(ctx)
    prefix = session.prefix
    found = session.collect(lambda backend: scan_locks(backend, prefix, pattern))
    rows = [row for row in found if row.kind != "permit"]
    permits = [row for row in found if row.kind == "permit"]
    rates = session.limiters(lambda backend: scan_rates(backend, prefix, pattern))
    controls = _controls_of(session, pattern)
    if as_json:
        out = [r.as_json(session.is_redlock) for r in (*rows, *permits)]
        out += [rate_json(info) for info in rates]
        out += [control_json(c) for c in controls]
        click.echo(json.dumps(out, indent=2))
    elif rows or permits or rates or controls:
        parts = [lock_table(rows, session.is_redlock)] if rows else []
        if permits:
            parts.append("PERMITS\n" + lock_table(permits, session.is_redlock))
        if rates:
            parts.append("RATE LIMITERS\n" + rate_table(rates))
        if controls:
            parts.append("CONTROLS\n" + control_table(controls))
        click.echo("\n\n".join(parts))
    else:
        click.echo(f"no locks held at {session.where()}")
    session.finish()


@_takes_flags
@locks.command(cls=CeleryCommand)
@click.argument("name")
@_json_option
@click.pass_context
def show(ctx: click.Context, name: str, as_json: bool) -> None:
    """Show who holds lock NAME (the rendered name, e.g. sync:42): the lock, the queued
    message's hold, each permit of a semaphore, and the state of its rate limiter; exit 1
    if none of them is held."""
    session = _Session(ctx)
    prefix = session.prefix
    try:
        lock_keys(name, prefix)  # a name no lock can have is a usage error
    except ConfigError as exc:
        raise CeleryCommandException(str(exc), EXIT_USAGE) from None

    rows = session.collect(lambda backend: read_lock(backend, prefix, name))
    rates = session.limiters(lambda backend: _listed(read_rate(backend, prefix, name)))
    controls = [c for c in _controls_of(session, _glob_escape(name)) if c.name == name]
    if not rows and not rates and not controls:
        if session.unreachable:
            session.fail_unreachable()
        raise CeleryCommandException(f"lock {name!r} is not held", EXIT_NOT_HELD)
    if as_json:
        out = [r.as_json(session.is_redlock) for r in rows] + [rate_json(i) for i in rates]
        out += [control_json(c) for c in controls]
        click.echo(json.dumps(out, indent=2))
    else:
        parts = [*(lock_details(r) for r in rows), *(rate_details(i) for i in rates)]
        if controls:
            parts.append("CONTROLS\n" + control_table(controls))
        click.echo("\n\n".join(parts))
    session.finish()


def _glob_escape(name: str) -> str:
    """*name* as a glob that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _listed(info: RateInfo | None) -> list[RateInfo]:
    return [] if info is None else [info]


#: The characters that make release's argument a glob (a name holding one is released
#: by escaping it in brackets: ``[*]``).
_GLOB = frozenset("*?[")


@_takes_flags
@locks.command(cls=CeleryCommand)
@click.argument("pattern")
@click.option(
    "-f",
    "--force",
    cls=CeleryOption,
    is_flag=True,
    help_group="Release Options",
    help="Remove whoever holds it now, not only the acquisition shown; for a NAME, also don't ask.",
)
@click.option(
    "-y",
    "--yes",
    cls=CeleryOption,
    is_flag=True,
    help_group="Release Options",
    help="Don't ask for confirmation (a PATTERN without a terminal needs it).",
)
@click.option(
    "--queued",
    cls=CeleryOption,
    is_flag=True,
    help_group="Release Options",
    help="Release only queued holds (lock_on='enqueue': taken at publish for a message "
    "that has not started), e.g. after `celery purge`; running locks stay.",
)
@click.pass_context
def release(ctx: click.Context, pattern: str, force: bool, yes: bool, queued: bool) -> None:
    """Remove lock PATTERN whoever holds it, and wake one waiter.

    PATTERN is a rendered lock name (sync:42) or a glob (sync:*, '*'): a glob lists
    what it matches and asks before releasing each (--yes skips that; without a
    terminal it is needed). A running holder is not stopped: its next renewal finds
    the lock gone and it is told the lock was lost. A queued hold (lock_on="enqueue")
    was taken at publish for a message that has not started: releasing it lets the
    next call publish again. Without --force only the acquisitions shown are removed
    (not one taken meanwhile).
    """
    session = _Session(ctx)
    glob = bool(_GLOB & set(pattern))
    rows = _matching(session, pattern) if glob else _held(session, pattern)
    if queued:
        rows = [r for r in rows if r.state == "queued"]
    session.warn_unreachable()  # the release below tries every master again
    session.unreachable.clear()
    if not rows:
        what = "queued hold" if queued else "lock"
        raise CeleryCommandException(
            f"no {what} matches {pattern!r} at {session.where()}"
            if glob
            else f"lock {pattern!r} has no queued hold",
            EXIT_NOT_HELD,
        )
    if glob:
        click.echo(lock_table(rows, session.is_redlock))
        if not yes:
            if not _at_terminal():
                raise CeleryCommandException(
                    f"not released: {pattern!r} is a pattern, and releasing what it "
                    "matches is confirmed at a terminal; pass --yes to release the "
                    "holds listed above without asking",
                    EXIT_NOT_HELD,
                )
            names = len({r.name for r in rows})
            click.confirm(
                f"\nRelease these {len(rows)} holds of {names} locks? {release_notes(rows)}",
                abort=True,
            )
    elif not (force or yes):
        click.echo("\n\n".join(lock_details(r) for r in rows))
        click.confirm(f"\nRelease lock {pattern!r}? {release_notes(rows)}", abort=True)
    released = 0
    for name in sorted({r.name for r in rows}):
        released += _release_one(session, name, [r for r in rows if r.name == name], force)
    if session.unreachable:
        session.fail_unreachable()
    if not released:
        what = f"nothing matching {pattern!r}" if glob else f"lock {pattern!r}"
        raise CeleryCommandException(f"{what} was released", EXIT_NOT_HELD)


def _at_terminal() -> bool:
    """True when a person can answer a prompt: standard input is a terminal."""
    stdin = sys.stdin
    return stdin is not None and stdin.isatty()


def _release_one(session: _Session, name: str, rows: list[LockRow], force: bool) -> int:
    """Release lock *name*'s *rows* (as listed) on every master; how many went."""
    expected = {r.master: r.fence for r in rows if r.state != "queued"}
    queued_ids = {r.master: r.record.get("task_id") for r in rows if r.state == "queued"}
    notice_ttl: float = session.settings.ttl
    released = 0
    for url, client in session.clients:
        master = session.master_of(client)
        if master not in expected and master not in queued_ids:
            continue
        try:
            if queued_ids.get(master, _NONE) is not _NONE:
                owner = None if force else queued_ids[master]
                gone = force_dequeue(client, session.prefix, name, owner)
                if gone.outcome == "released":
                    released += 1
                click.echo(dequeue_said(gone, name, master or ""))
            if master not in expected:
                continue
            fence = None if force else expected[master]
            done = force_release(client, session.prefix, name, fence, notice_ttl=notice_ttl)
        except _UNREACHABLE as exc:
            session.unreachable.append(_Unreachable(url, exc))
            continue
        if done.outcome == "released":
            released += 1
            log_forced(
                client, session.prefix, name, done.fence, done.record, by="celery locks release"
            )
        click.echo(done.said(name, master or ""))
    return released


def _held(session: _Session, name: str) -> list[LockRow]:
    """The rows of lock *name*, or exit 1 (3 if Redis could not be asked)."""
    try:
        lock_keys(name, session.prefix)  # a name no lock can have is a usage error
    except ConfigError as exc:
        raise CeleryCommandException(str(exc), EXIT_USAGE) from None

    def read(backend: Backend) -> list[LockInfo]:
        return [info for info in read_lock(backend, session.prefix, name) if info.kind != "permit"]

    rows = session.collect(read)
    if not rows:
        if session.unreachable:
            session.fail_unreachable()
        raise CeleryCommandException(f"lock {name!r} is not held", EXIT_NOT_HELD)
    return rows


def _matching(session: _Session, pattern: str) -> list[LockRow]:
    """The rows (locks and queued holds, not permits) whose name matches glob *pattern*,
    found with SCAN on every master."""
    prefix = session.prefix
    found = session.collect(lambda backend: scan_locks(backend, prefix, pattern))
    if not found and session.unreachable:
        session.fail_unreachable()
    return [row for row in found if row.kind != "permit"]


# -- operator controls -----------------------------------------------------------------
def _controls(session: _Session) -> Controls:
    """The controls of the session's lock store; a usage error, in the seam's words, where
    it keeps none (a Redlock quorum)."""
    store = _control_store(session)
    if not has(store, FlowControl):
        raise CeleryCommandException(lacks(store, FlowControl), EXIT_USAGE)
    return Controls(session.ctx.obj.app, backend=store, prefix=session.prefix)


def _control_store(session: _Session) -> Backend:
    """The session's lock store as the workers see it: its one Redis, or the quorum of
    its masters."""
    backends = [backend for _, backend in session.clients]
    return open_backend(backends) if session.is_redlock else backends[0]


def _control_call(session: _Session, change: Callable[[Controls], Any]) -> Any:
    """*change* on the session's controls: bad input exits 2, Redis unreachable 3."""
    controls = _controls(session)
    try:
        return change(controls)
    except ConfigError as exc:
        raise CeleryCommandException(str(exc), EXIT_USAGE) from None
    except _UNREACHABLE as exc:
        session.unreachable.append(_Unreachable(session.clients[0][0], exc))
        session.fail_unreachable()


def _duration(value: str | None) -> float | None:
    """``--for``: "90" or "90s", "10m", "1h", "2d" in seconds; None when not given."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise CeleryCommandException(f"--for {value!r}: {exc}", EXIT_USAGE) from None


_for_option = click.option(
    "--for",
    "for_",
    cls=CeleryOption,
    default=None,
    metavar="DURATION",
    help_group="Control Options",
    help="How long it holds (90s, 10m, 1h, 2d); without it, until lifted.",
)


@_takes_flags
@locks.command(cls=CeleryCommand)
@click.argument("key")
@_for_option
@click.option(
    "--reason",
    cls=CeleryOption,
    default="",
    help_group="Control Options",
    help="Why, shown in `celery locks list` and in the runs it refuses.",
)
@click.pass_context
def pause(ctx: click.Context, key: str, for_: str | None, reason: str) -> None:
    """Pause KEY (a lock key or a lock_limits key, e.g. partner:acme): no new run that
    takes it starts on any worker; running ones finish."""
    session = _Session(ctx)
    seconds = _duration(for_)
    _control_call(session, lambda c: c.pause(key, seconds, reason=reason))
    span = f" for {for_}" if for_ else " until resumed"
    click.echo(f"paused {key!r}{span}" + (f": {reason}" if reason else ""))


@_takes_flags
@locks.command(name="set", cls=CeleryCommand)
@click.argument("key")
@click.option(
    "--limit",
    cls=CeleryOption,
    type=int,
    default=None,
    help_group="Control Options",
    help="Runs at once of a semaphore key (a Limit rule, or lock_limit above 1).",
)
@click.option(
    "--rate",
    cls=CeleryOption,
    default=None,
    help_group="Control Options",
    help="The rate of a Rate rule's key (100/m).",
)
@click.option(
    "--burst",
    cls=CeleryOption,
    type=int,
    default=None,
    help_group="Control Options",
    help="With --rate: the burst (default: the rule's own).",
)
@_for_option
@click.pass_context
def set_(  # noqa: PLR0917 - one parameter per option
    ctx: click.Context,
    key: str,
    limit: int | None,
    rate: str | None,
    burst: int | None,
    for_: str | None,
) -> None:
    """Override KEY's limit or rate on every worker, from its next start."""
    if limit is None and rate is None:
        raise CeleryCommandException("give --limit N, --rate R (or both)", EXIT_USAGE)
    if burst is not None and rate is None:
        raise CeleryCommandException("--burst goes with --rate", EXIT_USAGE)
    session = _Session(ctx)
    seconds = _duration(for_)
    _control_call(
        session, lambda c: c.override(key, limit=limit, rate=rate, burst=burst, seconds=seconds)
    )
    span = f" for {for_}" if for_ else " until unset"
    if limit is not None:
        click.echo(f"{key!r}: limit {limit}{span}")
    if rate is not None:
        more = f", burst {burst}" if burst else ""
        click.echo(f"{key!r}: rate {rate}{more}{span}")


def _lifting(
    name: str, help: str, lift: Callable[[Controls, str], bool], missing: str, done: str
) -> click.Command:
    """The command *name* KEY that lifts a control of KEY with *lift*: exit 1, saying KEY
    *missing*, when it had none, else print *done* (``{key}`` in it: KEY quoted)."""

    @click.argument("key")
    @click.pass_context
    def lifts(ctx: click.Context, key: str) -> None:
        if not _control_call(_Session(ctx), lambda c: lift(c, key)):
            raise CeleryCommandException(f"{key!r} {missing}", EXIT_NOT_HELD)
        click.echo(done.format(key=repr(key)))

    return _takes_flags(locks.command(name=name, cls=CeleryCommand, help=help)(lifts))


resume = _lifting(
    "resume", "Lift KEY's pause; exit 1 if it was not paused.", Controls.resume,
    "is not paused", "resumed {key}",
)  # fmt: skip
unset = _lifting(
    "unset", "Lift KEY's limit and rate overrides (not a pause); exit 1 if it had none.",
    Controls.unset, "has no override", "{key}: overrides lifted",
)  # fmt: skip


def _controls_of(session: _Session, pattern: str) -> list[Control]:
    """The controls in force matching *pattern* (none on a Redlock quorum)."""
    store = _control_store(session)
    if not has(store, FlowControl):
        return []
    try:
        return Controls(session.ctx.obj.app, backend=store, prefix=session.prefix).overrides(
            pattern
        )
    except _UNREACHABLE:
        return []  # the lock reads have reported it


# -- the board -------------------------------------------------------------------------
#: What serves the board: ``celery_redlock.board`` sits above this folder, so
#: ``install`` (at the top) hands its server in here, as ``task.app_hooks`` is filled.
board_servers: list[Callable[..., None]] = []


@_takes_flags
@locks.command(cls=CeleryCommand)
@click.option(
    "--host",
    cls=CeleryOption,
    default="127.0.0.1",
    help_group="Board Options",
    help="Address to listen on (default 127.0.0.1; another needs a token).",
)
@click.option(
    "--port",
    cls=CeleryOption,
    type=int,
    default=5566,
    help_group="Board Options",
    help="Port to listen on (default 5566; 0: any free port).",
)
@click.option(
    "--actions",
    cls=CeleryOption,
    is_flag=True,
    help_group="Board Options",
    help="Offer release, pause/resume and set/unset (needs a token).",
)
@click.option(
    "--token-file",
    cls=CeleryOption,
    default=None,
    metavar="PATH",
    help_group="Board Options",
    help="The tokens that may act, one name:secret a line (else REDLOCK_BOARD_TOKEN).",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    cls=CeleryOption,
    multiple=True,
    metavar="NAME[:PORT]",
    help_group="Board Options",
    help="A Host the board answers besides the served address (a reverse proxy's name); "
    "repeatable.",
)
@click.option(
    "--secure-cookie",
    cls=CeleryOption,
    is_flag=True,
    help_group="Board Options",
    help="Mark the session cookie Secure (behind a proxy that serves https).",
)
@click.option(
    "--loglevel",
    "log_level",
    cls=CeleryOption,
    default="INFO",
    metavar="LEVEL",
    help_group="Board Options",
    help="What the board logs on stderr: INFO (default) shows sign-ins and actions.",
)
@click.pass_context
def serve(  # noqa: PLR0917 - one argument per option
    ctx: click.Context,
    host: str,
    port: int,
    actions: bool,
    token_file: str | None,
    allowed_hosts: tuple[str, ...],
    secure_cookie: bool,
    log_level: str,
) -> None:
    """Serve the lock board (see docs/board.md) until interrupted (SIGINT or SIGTERM)."""
    if not board_servers:
        raise CeleryCommandException(
            "the board is not installed in this process (import celery_redlock)", EXIT_USAGE
        )
    try:
        board_servers[0](
            ctx.obj.app,
            host=host,
            port=port,
            actions=actions,
            token_file=token_file,
            overrides=ctx.meta.get(_OVERRIDES, {}),
            allowed_hosts=list(allowed_hosts),
            secure_cookies=secure_cookie,
            log_level=log_level,
            echo=click.echo,
        )
    except ConfigError as exc:
        raise CeleryCommandException(str(exc), EXIT_USAGE) from None
