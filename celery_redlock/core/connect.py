"""Build redis-py clients for lock traffic from URLs.

``redis://``, ``rediss://`` (TLS), ``unix://`` and ``sentinel://`` URLs, or a
list of them (independent masters, for Redlock); ``memory://`` gives the in-process
memory backend instead of a client (the Lua scripts on an in-process server, for tests and
single-process tools; the ``testing`` extra). Timeouts and
the retry policy are set on purpose (:func:`lock_retry`): a broken connection (a restarted server,
a reset) is retried once at once on a new one, which is safe because every lock
script is idempotent; a timeout is not retried, so a Redis that stopped answering
is reported after one socket timeout, not after the several that redis-py's
default retries (reconnect, handshake, re-send) add up to.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, overload
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry
from redis.sentinel import Sentinel

from .backend import Backend
from .errors import ConfigError

__all__ = ["LOCK_CLIENT_DEFAULTS", "address_of", "connect", "lock_retry", "mask_url"]

#: Defaults for clients that carry lock traffic; every one can be overridden.
LOCK_CLIENT_DEFAULTS: dict[str, Any] = {
    "socket_timeout": 2.0,
    "socket_connect_timeout": 1.0,
    "socket_keepalive": True,
}
_SCHEMES = ("redis", "rediss", "unix", "sentinel", "memory")
#: Where one URL of a ``;``-joined list (Sentinel) ends: before the next ``scheme://``.
_NEXT_URL = re.compile(r";(?=\s*[a-z][a-z0-9+.-]*://)", re.IGNORECASE)
#: Query parameters that carry a secret: ``password=``, ``sentinel_password=`` ...
_SECRET_PARAM = re.compile(r"(?P<key>(?:^|&)[^=&]*password[^=&]*=)[^&#]*", re.IGNORECASE)


def mask_url(url: str) -> str:
    """The URL with every password replaced by ``***`` (safe for logs and errors).

    Covers the userinfo part (also when the password holds a raw ``@`` or ``/``),
    ``password``-like query parameters, and each part of a ``;``-joined Sentinel URL.
    """
    return ";".join(_mask_one(part) for part in _NEXT_URL.split(str(url)))


def _mask_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:  # no scheme (a mistake the error will be about): still hide "user:secret@"
        at = url.rfind("@")
        if at < 0:
            return url
        user, colon, _ = url[:at].partition(":")
        return f"{user}:***{url[at:]}" if colon else f"***{url[at:]}"
    # The host follows the *last* @: a raw "@", "/", "?" or "#" may be in the password
    # (a URL that needs percent-encoding, and the very one an error will print). An "@" in
    # the query would hide the host too: masking too much is the safe side.
    at = rest.rfind("@")
    if at >= 0 and ":" in rest[:at]:
        rest = rest[:at].split(":", 1)[0] + ":***" + rest[at:]
    head, qmark, query = rest.partition("?")
    if qmark:
        query = _SECRET_PARAM.sub(lambda m: m.group("key") + "***", query)
    return f"{scheme}{sep}{head}{qmark}{query}"


Client = redis.Redis | RedisCluster | Backend


@overload
def connect(url_or_urls: str, **options: Any) -> Client: ...
@overload
def connect(url_or_urls: Sequence[str], **options: Any) -> list[Client]: ...
def connect(url_or_urls: str | Sequence[str], **options: Any) -> Client | list[Client]:
    """A client (or a list of clients, one per URL) for lock traffic.

    ``memory://`` (or ``memory://<name>``) gives this process's in-memory backend of
    that URL: the same URL is the same store everywhere in the process, as Celery's
    ``memory://`` broker; other processes (a forked child too) never see it. It runs the
    Redis backend's scripts on fakeredis: without ``pip install 'celery-redlock[testing]'``
    it raises a ConfigError that says so.

    ``cluster=True`` makes a ``RedisCluster`` from a ``redis://``/``rediss://`` URL.
    Sentinel: ``sentinel://h1:26379;sentinel://h2:26379/0?master=mymaster``
    (``master_name=`` works too, as in kombu's transport options); a password in
    the URL is the master's, ``sentinel_password=`` the sentinels'. Other
    keyword options go to redis-py.
    """
    if isinstance(url_or_urls, (list, tuple)):
        if not url_or_urls:
            raise ConfigError("connect() needs at least one Redis URL, got an empty list")
        return [_connect_one(u, dict(options)) for u in url_or_urls]
    if not isinstance(url_or_urls, str):
        raise ConfigError(
            f"connect() takes a Redis URL or a list of them, got {type(url_or_urls).__name__}"
        )
    return _connect_one(url_or_urls, dict(options))


def _connect_one(url: str, options: dict[str, Any]) -> Client:
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"not a Redis URL: {mask_url(str(url))!r}")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _SCHEMES:
        raise ConfigError(
            f"unknown Redis URL scheme {scheme!r} in {mask_url(url)!r}; "
            f"use one of {', '.join(s + '://' for s in _SCHEMES)}"
        )
    if scheme == "memory":
        from .backends.memory import MemoryBackend  # noqa: PLC0415 - only memory URLs need it

        return MemoryBackend.for_url(url)
    cluster = bool(options.pop("cluster", False))
    for key, value in LOCK_CLIENT_DEFAULTS.items():
        if scheme == "unix" and key == "socket_keepalive":
            continue  # a TCP option: UnixDomainSocketConnection refuses it
        options.setdefault(key, value)
    options.setdefault("retry", lock_retry())
    # redis-py < 6 re-sends only the errors named here (the Retry object alone does
    # nothing there); newer ones add them to the Retry object's own.
    options.setdefault("retry_on_error", [RedisConnectionError])
    if scheme == "sentinel":
        return _sentinel(url, options)
    if scheme in ("redis", "rediss"):
        _check_db(url)
    if cluster:
        options.pop("health_check_interval", None)
        options.pop("retry_on_error", None)  # a cluster client retries by its own rules
        return RedisCluster.from_url(url, **options)
    try:
        return redis.Redis.from_url(url, **options)
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL {mask_url(url)!r}: {exc}") from exc


def lock_retry() -> Retry:
    """The retry policy of lock clients: one immediate re-send after a broken connection
    (``ConnectionError``), none after a timeout."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def _check_db(url: str) -> None:
    """redis-py reads ``redis://host/x`` as db 0; a lock in the wrong database is a silent
    split brain (two apps that think they share locks do not), so refuse it."""
    try:
        path = urlsplit(url).path.strip("/")
    except ValueError as exc:  # e.g. a raw "[" in the password: "Invalid IPv6 URL"
        raise ConfigError(
            f"bad Redis URL {mask_url(url)!r}: {exc} (percent-encode special characters "
            "in the user name and password)"
        ) from None
    if path and not path.isdigit():
        raise ConfigError(
            f"bad database number {path!r} in Redis URL {mask_url(url)!r}: use "
            "redis://host:port/<number>"
        )


def _sentinel(url: str, options: dict[str, Any]) -> redis.Redis:
    hosts: list[tuple[str, int]] = []
    password: str | None = None
    username: str | None = None
    query: dict[str, list[str]] = {}
    db = 0
    for raw_part in url.split(";"):
        part = raw_part.strip()
        if not part:
            continue
        if not part.lower().startswith("sentinel://"):
            raise ConfigError(f"mixed schemes in a Sentinel URL: {mask_url(url)!r}")
        try:
            split = urlsplit(part)
            hosts.append((split.hostname or "127.0.0.1", split.port or 26379))
        except ValueError as exc:  # a port that is not a number, a raw "[" ...
            raise ConfigError(f"bad Sentinel URL {mask_url(part)!r}: {exc}") from None
        password = unquote(split.password) if split.password else password
        username = unquote(split.username) if split.username else username
        if split.path.strip("/"):
            try:
                db = int(split.path.strip("/"))
            except ValueError:
                raise ConfigError(f"bad database number in {mask_url(part)!r}") from None
        for k, v in parse_qs(split.query).items():
            query.setdefault(k, v)
    names = query.get("master") or query.get("master_name") or []
    master = options.pop("master_name", None) or (names[0] if names else None)
    if not master:
        raise ConfigError(
            f"Sentinel URL {mask_url(url)!r} names no master: add ?master=NAME "
            "(or pass master_name=...)"
        )
    sentinel_kwargs: dict[str, Any] = dict(options.pop("sentinel_kwargs", None) or {})
    sentinel_passwords = query.get("sentinel_password") or []
    sentinel_password = options.pop("sentinel_password", None) or (
        sentinel_passwords[0] if sentinel_passwords else None
    )
    if sentinel_password:
        sentinel_kwargs.setdefault("password", sentinel_password)
    for k in ("socket_timeout", "socket_connect_timeout"):
        sentinel_kwargs.setdefault(k, options[k])
    if password:
        options.setdefault("password", password)
    if username:
        options.setdefault("username", username)
    options.setdefault("db", db)
    options.pop("health_check_interval", None)
    # Sentinel has annotations from redis-py 8.2 on and none before: called through Any,
    # the same line type-checks on both.
    make_sentinel: Any = Sentinel
    sentinel = make_sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **options)
    client: redis.Redis = sentinel.master_for(master, **options)
    return client


def address_of(client: Any) -> str:
    """``host:port/db`` (or the socket path, or the Sentinel service) of a client, never
    its password."""
    if isinstance(client, RedisCluster):
        nodes = client.get_nodes()  # type: ignore[no-untyped-call]
        return "cluster(" + ",".join(f"{n.host}:{n.port}" for n in nodes[:3]) + ")"
    pool = client.connection_pool
    service = getattr(pool, "service_name", None)
    if service:
        return f"sentinel-master:{service}"
    kwargs = getattr(pool, "connection_kwargs", {})
    if kwargs.get("path"):
        return f"unix:{kwargs['path']}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"
