"""``celery locks``: see who holds which lock, and release one by hand.

::

    celery -A proj locks list [PATTERN] [--json]
    celery -A proj locks show NAME [--json]
    celery -A proj locks release NAME [--force]

Names are the rendered lock names (``sync:42``), not Redis keys. Locks are found
with ``SCAN`` (never ``KEYS``), on every primary of a Redis Cluster; with a list of
URLs (Redlock) each master is shown on its own row.

Exit codes: 0 done; 1 the lock is not held, or the release was refused or
aborted; 2 usage or configuration error; 3 Redis unreachable.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NoReturn

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options
from celery.exceptions import CeleryCommandException
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from .beat import LockStore, lock_store
from .core.errors import ConfigError, describe_holder
from .core.keys import lock_keys
from .core.lock import address_of, parse_holder
from .core.scripts import FORCE_RELEASE

__all__ = ["EXIT_NOT_HELD", "EXIT_UNREACHABLE", "LockRow", "locks"]

EXIT_NOT_HELD = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

_SCAN_COUNT = 500
_BATCH = 200
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


@dataclass
class LockRow:
    """One held lock on one master."""

    name: str
    key: str
    fence: int | None
    ttl_ms: int
    record: dict[str, Any] = field(default_factory=dict)
    master: str | None = None

    @property
    def acquired_at(self) -> float | None:
        """Wall-clock time of the acquisition, as the holder recorded it."""
        value = self.record.get("acquired_at")
        return float(value) if isinstance(value, (int, float)) else None

    @property
    def holder(self) -> dict[str, Any]:
        """The documented holder fields."""
        return {k: self.record.get(k) for k in ("task_name", "task_id", "hostname", "pid")}

    def as_json(self, with_master: bool) -> dict[str, Any]:
        """The documented ``--json`` object."""
        out: dict[str, Any] = {
            "name": self.name,
            "key": self.key,
            "holder": self.holder,
            "acquired_at": self.acquired_at,
            "ttl_ms": self.ttl_ms,
            "fence": self.fence,
        }
        if with_master:
            out["master"] = self.master
        return out


class _Unreachable(Exception):
    def __init__(self, url: str, exc: BaseException) -> None:
        self.url = url
        super().__init__(f"cannot reach Redis at {url}: {_one_line(exc)}")


# -- reading -------------------------------------------------------------------------
def _nodes(client: Any) -> list[Any]:
    """Plain clients to scan: the client itself, or every primary of a cluster."""
    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(n) for n in client.get_primaries()]  # type: ignore[no-untyped-call]
    return [client]


def _scan(node: Any, match: str) -> Iterator[Any]:
    try:
        yield from node.scan_iter(match=match, count=_SCAN_COUNT, _type="hash")
    except RedisError as exc:
        if "syntax" not in str(exc).lower():  # Redis < 6 has no SCAN ... TYPE
            raise
        yield from node.scan_iter(match=match, count=_SCAN_COUNT)


def _read(node: Any, keys: Sequence[str], prefix: str, master: str | None) -> list[LockRow]:
    rows: list[LockRow] = []
    for start in range(0, len(keys), _BATCH):
        chunk = keys[start : start + _BATCH]
        pipe = node.pipeline(transaction=False)
        for key in chunk:
            pipe.hmget(key, "token", "fence", "info")
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)
        for i, key in enumerate(chunk):
            fields, pttl = replies[2 * i], replies[2 * i + 1]
            if isinstance(fields, Exception) or not isinstance(fields, list) or not fields[0]:
                continue  # not a lock hash, or it went away between SCAN and read
            fence = _text(fields[1])
            rows.append(
                LockRow(
                    name=key[len(prefix) + 1 : -1],
                    key=key,
                    fence=int(fence) if fence and fence.isdigit() else None,
                    ttl_ms=int(pttl) if isinstance(pttl, int) else -2,
                    record=parse_holder(fields[2]),
                    master=master,
                )
            )
    return rows


def _list_on(client: Any, prefix: str, pattern: str, master: str | None) -> list[LockRow]:
    match = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "{" + pattern + "}"
    rows: list[LockRow] = []
    for node in _nodes(client):
        keys = sorted(
            {
                key
                for key in (_text(k) for k in _scan(node, match))
                if key.startswith(prefix + "{")
                and key.endswith("}")
                and not key.endswith((":fence", ":notify"))
            }
        )
        rows += _read(node, keys, prefix, master)
    return rows


def _one_lock(client: Any, key: str, prefix: str, master: str | None) -> list[LockRow]:
    node = (
        client.get_redis_connection(client.get_node_from_key(key)) if _cluster(client) else client
    )
    return _read(node, [key], prefix, master)


def _cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


class _Session:
    """The app's lock store and its clients, with errors mapped to exit codes."""

    def __init__(self, ctx: click.Context) -> None:
        self.ctx = ctx
        try:
            self.store: LockStore = lock_store(ctx.obj.app)
            self.clients = self.store.clients()
        except ConfigError as exc:
            raise CeleryCommandException(str(exc), EXIT_USAGE) from None
        self.unreachable: list[_Unreachable] = []

    def master_of(self, client: Any) -> str | None:
        return address_of(client) if self.store.is_redlock else None

    def collect(self, read: Any) -> list[LockRow]:
        rows: list[LockRow] = []
        for url, client in self.clients:
            try:
                rows += read(client)
            except (RedisError, RedisClusterException) as exc:
                self.unreachable.append(_Unreachable(url, exc))
        if self.unreachable and len(self.unreachable) == len(self.clients):
            self.fail_unreachable()
        return sorted(rows, key=lambda r: (r.name, r.master or ""))

    def warn_unreachable(self) -> None:
        for problem in self.unreachable:
            self.ctx.obj.error(f"celery locks: {problem}")

    def fail_unreachable(self) -> NoReturn:
        first, *rest = self.unreachable
        for problem in rest:
            self.ctx.obj.error(f"celery locks: {problem}")
        raise CeleryCommandException(str(first), EXIT_UNREACHABLE)

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

    Exit codes: 0 done, 1 not held / refused / aborted, 2 usage error, 3 Redis unreachable.
    """


_json_option = click.option(
    "--json",
    "as_json",
    cls=CeleryOption,
    is_flag=True,
    help_group="Output Options",
    help="Print a JSON array of lock objects.",
)


@locks.command(name="list", cls=CeleryCommand)
@click.argument("pattern", required=False, default="*")
@_json_option
@click.pass_context
def list_(ctx: click.Context, pattern: str, as_json: bool) -> None:
    """List held locks whose name matches PATTERN (a glob, default "*")."""
    session = _Session(ctx)
    prefix = session.store.key_prefix
    rows = session.collect(lambda c: _list_on(c, prefix, pattern, session.master_of(c)))
    if as_json:
        click.echo(json.dumps([r.as_json(session.store.is_redlock) for r in rows], indent=2))
    elif rows:
        click.echo(_table(rows, session.store.is_redlock))
    else:
        click.echo("no locks held")
    session.finish()


@locks.command(cls=CeleryCommand)
@click.argument("name")
@_json_option
@click.pass_context
def show(ctx: click.Context, name: str, as_json: bool) -> None:
    """Show who holds lock NAME (the rendered name, e.g. sync:42); exit 1 if not held."""
    session = _Session(ctx)
    rows = _held(session, name)
    if as_json:
        click.echo(json.dumps([r.as_json(session.store.is_redlock) for r in rows], indent=2))
    else:
        click.echo("\n\n".join(_details(r) for r in rows))
    session.finish()


@locks.command(cls=CeleryCommand)
@click.argument("name")
@click.option(
    "-f",
    "--force",
    cls=CeleryOption,
    is_flag=True,
    help_group="Release Options",
    help="Don't ask for confirmation.",
)
@click.pass_context
def release(ctx: click.Context, name: str, force: bool) -> None:
    """Remove lock NAME whoever holds it, and wake one waiter.

    The holder is not stopped: its next renewal finds the lock gone and it is told
    the lock was lost. Without --force, asks first and removes only the
    acquisition it showed (not one taken meanwhile).
    """
    session = _Session(ctx)
    rows = _held(session, name)
    session.warn_unreachable()  # the release below tries every master again
    session.unreachable.clear()
    expected = {r.master: str(r.fence) for r in rows}
    if not force:
        click.echo("\n\n".join(_details(r) for r in rows))
        click.confirm(
            f"\nRelease lock {name!r}? The holder keeps running and may overlap with the "
            "next owner",
            abort=True,
        )
    keys = lock_keys(name, session.store.key_prefix)
    notice_ms = max(1, round(session.store.ttl * 1000))
    released = 0
    for url, client in session.clients:
        master = session.master_of(client)
        if master not in expected:
            continue
        try:
            reply = FORCE_RELEASE(
                client,
                [keys.lock, keys.notify],
                [notice_ms, "" if force else expected[master]],
            )
        except (RedisError, RedisClusterException) as exc:
            session.unreachable.append(_Unreachable(url, exc))
            continue
        where = f" on {master}" if master else ""
        code = int(reply[0])
        if code == 1:
            released += 1
            holder = describe_holder(parse_holder(reply[1]))
            click.echo(f"released {name!r}{where}: was held by {holder}, fence {_text(reply[2])}")
        elif code == 0:
            click.echo(f"{name!r}{where} was already gone (expired or released)")
        else:
            holder = describe_holder(parse_holder(reply[1]))
            click.echo(
                f"{name!r}{where} is now held by {holder} (fence {_text(reply[2])}), not by "
                "the acquisition shown; left alone"
            )
    if session.unreachable:
        session.fail_unreachable()
    if not released:
        raise CeleryCommandException(f"lock {name!r} was not released", EXIT_NOT_HELD)


def _held(session: _Session, name: str) -> list[LockRow]:
    """The rows of lock *name*, or exit 1 (3 if Redis could not be asked)."""
    try:
        keys = lock_keys(name, session.store.key_prefix)
    except ConfigError as exc:
        raise CeleryCommandException(str(exc), EXIT_USAGE) from None
    prefix = session.store.key_prefix
    rows = session.collect(lambda c: _one_lock(c, keys.lock, prefix, session.master_of(c)))
    if not rows:
        if session.unreachable:
            session.fail_unreachable()
        raise CeleryCommandException(f"lock {name!r} is not held", EXIT_NOT_HELD)
    return rows


# -- rendering -------------------------------------------------------------------------
def _table(rows: Sequence[LockRow], with_master: bool) -> str:
    now = time.time()
    header = ["NAME", "HOLDER", "HOST", "PID", "HELD FOR", "TTL", "FENCE"]
    if with_master:
        header.append("MASTER")
    lines = [header]
    for r in rows:
        line = [
            r.name,
            _who(r.record),
            str(r.record.get("hostname") or "-"),
            str(r.record.get("pid") or "-"),
            _duration(now - r.acquired_at) if r.acquired_at else "-",
            _ttl(r.ttl_ms),
            "-" if r.fence is None else str(r.fence),
        ]
        if with_master:
            line.append(r.master or "-")
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _details(r: LockRow) -> str:
    now = time.time()
    pairs: list[tuple[str, str]] = [("name", r.name), ("key", r.key)]
    if r.master:
        pairs.append(("master", r.master))
    pairs.append(("holder", _who(r.record)))
    for field_name in ("task_name", "task_id", "hostname", "pid"):
        pairs.append((field_name, str(r.record.get(field_name) or "-")))
    if r.acquired_at:
        stamp = datetime.fromtimestamp(r.acquired_at).isoformat(sep=" ", timespec="seconds")
        pairs.append(("acquired_at", f"{stamp} ({_duration(now - r.acquired_at)} ago)"))
    pairs += [("ttl left", _ttl(r.ttl_ms)), ("fence", "-" if r.fence is None else str(r.fence))]
    shown = {"task_name", "task_id", "hostname", "pid", "acquired_at"}
    pairs += [(k, str(v)) for k, v in sorted(r.record.items()) if k not in shown]
    width = max(len(k) for k, _ in pairs) + 1
    return "\n".join(f"{(k + ':').ljust(width)} {v}" for k, v in pairs)


def _who(record: dict[str, Any]) -> str:
    if record.get("task_name"):
        tid = record.get("task_id")
        return f"{record['task_name']}[{tid}]" if tid else str(record["task_name"])
    return str(record.get("role") or "-")


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _ttl(ms: int) -> str:
    if ms == -1:
        return "no expiry"
    if ms < 0:
        return "gone"
    return _duration(ms / 1000)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
