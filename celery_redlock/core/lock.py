"""``Lock``: a lock on one Redis (a plain server, a Sentinel master, or a Cluster)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)

from .base import Attempt, BaseLock
from .errors import ConfigError, QuorumUnavailable
from .keys import LockKeys
from .scripts import ACQUIRE, EXTEND, RELEASE

__all__ = [
    "Lock",
    "address_of",
    "check_client",
    "foreign_data_message",
    "parse_holder",
    "server_refused",
    "wait_for_notice",
]

log = logging.getLogger("celery_redlock.acquire")


class Lock(BaseLock):
    """A lease on one Redis, kept alive by the per-process renewal thread.

    >>> lock = Lock(redis.Redis(), "report:2024-06", ttl=30)
    >>> with lock:                # raises LockContended if someone else holds it
    ...     write(fence=lock.fence)

    Every mutation is one owner-checked Lua script; a fresh 160-bit token per
    acquisition means nobody releases or extends what they do not own: not
    another thread, not a forked child, not a retried duplicate.
    """

    def __init__(
        self,
        client: Any,
        name: str,
        ttl: float = 30.0,
        *,
        key_prefix: str = "redlock:",
        auto_renew: bool = True,
        reentrant: bool = False,
        max_hold: float | None = None,
        owner_info: Mapping[str, Any] | None = None,
        blocking: bool = True,
        timeout: float | None = None,
        on_lost: Callable[[Any], object] | None = None,
        fence_ttl: float | None = None,
    ) -> None:
        check_client(client)
        self.client = client
        super().__init__(
            name,
            ttl,
            key_prefix=key_prefix,
            auto_renew=auto_renew,
            reentrant=reentrant,
            max_hold=max_hold,
            owner_info=owner_info,
            blocking=blocking,
            timeout=timeout,
            on_lost=on_lost,
            fence_ttl=fence_ttl,
        )

    # -- I/O --------------------------------------------------------------------------
    @property
    def _release_keys(self) -> list[str]:
        return [self.keys.lock, self.keys.notify, self.keys.waiting]

    def _unavailable(self, exc: BaseException) -> QuorumUnavailable:
        return QuorumUnavailable(
            self.name, {address_of(self.client): f"{type(exc).__name__}: {exc}"}
        )

    def _do_acquire(self, token: str, info: str, wait: bool) -> Attempt:
        started = time.monotonic()
        keys = self.keys
        if wait or self.fence_ttl_ms:
            script_keys = [keys.lock, keys.fence, keys.waiting]
            args: list[Any] = [token, self.ttl_ms, info, "1" if wait else "0", self.fence_ttl_ms]
        else:
            # No waiter mark to set and no counter lifetime: the script's optional key and
            # arguments are left out (three fewer values to pack, send and hand to Lua).
            script_keys = [keys.lock, keys.fence]
            args = [token, self.ttl_ms, info]
        try:
            reply = ACQUIRE(self.client, script_keys, args)
        except ResponseError as exc:
            if server_refused(exc):  # out of memory, a read-only replica, ...: retry later
                log.debug("acquire of %r refused by Redis (%s)", self.name, exc)
                raise self._unavailable(exc) from exc
            # Foreign data at one of the lock's keys. A script stops at its first error but
            # keeps what it wrote before it: take back whatever this token may hold.
            self._do_abandon(token)
            message = foreign_data_message(self.client, self.keys, self.key_prefix, exc)
            raise ConfigError(message) from exc
        except RedisError as exc:
            # The script may have run before the reply was lost: take back what
            # this token might hold, so an unclear attempt leaves no orphan.
            self._do_abandon(token)
            # Debug only: the caller gets QuorumUnavailable with the same facts and logs it
            # once with its own context (the Celery adapter names the task); a warning here too
            # gave two lines per failed attempt.
            log.debug("acquire of %r failed: Redis unavailable (%s)", self.name, exc)
            raise self._unavailable(exc) from exc
        if int(reply[0]) == 1:
            return Attempt(True, started, fence=int(reply[1]))
        ttl_ms = int(reply[2])
        if ttl_ms == -1:  # our locks always expire: this key was written by something else
            log.warning(
                "lock %r is held with NO expiry (%r has no TTL): it is never freed by itself; "
                "if its holder is gone, remove it with `celery locks release %s`",
                self.name,
                self.keys.lock,
                self.name,
            )
        return Attempt(False, started, holder=parse_holder(reply[1]), ttl_ms=ttl_ms)

    def _do_release(self, token: str) -> int:
        try:
            return int(RELEASE(self.client, self._release_keys, [token, self.ttl_ms]))
        except RedisError as exc:
            log.debug(  # the caller gets QuorumUnavailable and reports it (see _do_acquire)
                "release of %r failed: Redis unavailable (%s); it expires within %ss",
                self.name,
                exc,
                self.ttl,
            )
            raise self._unavailable(exc) from exc

    def _do_abandon(self, token: str) -> None:
        # On failure the lease expires by itself within one TTL.
        with contextlib.suppress(RedisError):
            RELEASE(self.client, self._release_keys, [token, self.ttl_ms])

    def _do_extend(self, token: str, ms: int, replace: bool) -> int:
        try:
            return int(EXTEND(self.client, [self.keys.lock], [token, ms, "1" if replace else "0"]))
        except RedisError as exc:
            raise self._unavailable(exc) from exc

    def _do_owned(self, token: str) -> bool:
        try:
            current = self.client.hget(self.keys.lock, "token")
        except ResponseError as exc:
            if server_refused(exc):
                raise self._unavailable(exc) from exc
            return False  # the key holds foreign data: this owner's lock is gone
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        return _text(current) == token

    def _do_locked(self) -> bool:
        try:
            return bool(self.client.exists(self.keys.lock))
        except RedisError as exc:
            raise self._unavailable(exc) from exc

    def _do_release_matching(self, match: Mapping[str, Any]) -> bool:
        try:
            token, info = self.client.hmget(self.keys.lock, ["token", "info"])
            holder = parse_holder(info)
            if token is None or any(holder.get(k) != v for k, v in match.items()):
                return False
            return int(RELEASE(self.client, self._release_keys, [_text(token), self.ttl_ms])) == 1
        except ResponseError as exc:
            raise self._refused(exc) from exc
        except RedisError as exc:
            raise self._unavailable(exc) from exc

    def _do_read_holder(self) -> dict[str, Any] | None:
        try:
            token, info = self.client.hmget(self.keys.lock, ["token", "info"])
        except ResponseError as exc:
            raise self._refused(exc) from exc
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        return None if token is None else parse_holder(info)

    def _refused(self, exc: ResponseError) -> QuorumUnavailable | ConfigError:
        """A refused command: the server cannot serve now (unavailable), or foreign data."""
        if server_refused(exc):
            return self._unavailable(exc)
        return ConfigError(foreign_data_message(self.client, self.keys, self.key_prefix, exc))

    def _do_wait(self, seconds: float) -> None:
        wait_for_notice(self.client, self.keys.notify, seconds)

    def _targets(self, token: str) -> Sequence[tuple[Any, str, str, int]]:
        return ((self.client, self.keys.lock, token, self.ttl_ms),)

    def _combine_renewal(self, outcomes: Sequence[int | BaseException]) -> int | BaseException:
        return outcomes[0]


def wait_for_notice(client: Any, notify_key: str, seconds: float) -> None:
    """Block up to *seconds* for a release notice on *notify_key*: one BLPOP.

    The BLPOP runs on a connection taken from the pool with its own read
    deadline, so a wait longer than the client's socket timeout is still one
    command, and redis-py's retry policy never re-sends it.
    """
    if isinstance(client, RedisCluster):
        client = client.get_redis_connection(
            client.get_node_from_key(notify_key)  # type: ignore[no-untyped-call]
        )
    seconds = round(max(seconds, 0.001), 3)
    pool = client.connection_pool
    try:
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py < 5.3 requires a command name
            conn = pool.get_connection("BLPOP")
    except RedisError as exc:  # connecting (or its handshake) failed
        raise QuorumUnavailable(
            notify_key, {address_of(client): f"{type(exc).__name__}: {exc}"}
        ) from exc
    try:
        conn.send_command("BLPOP", notify_key, f"{seconds:.3f}")
        if conn.can_read(timeout=seconds + 1.0):
            conn.read_response()
        else:  # no reply in time: the connection is in an unknown state, drop it
            conn.disconnect()
    except RedisError as exc:
        conn.disconnect()
        raise QuorumUnavailable(
            notify_key, {address_of(client): f"{type(exc).__name__}: {exc}"}
        ) from exc
    finally:
        pool.release(conn)


def check_client(client: Any) -> None:
    """Refuse anything that is not a redis-py client, naming what was given."""
    if not isinstance(client, (redis.Redis, RedisCluster)):
        raise ConfigError(
            f"expected a redis.Redis, a Sentinel master_for() client or a RedisCluster, "
            f"got {type(client).__module__}.{type(client).__name__}; build one with "
            "celery_redlock.connect(url)"
        )


def address_of(client: Any) -> str:
    """``host:port/db`` (or the socket path) of a client, never its password."""
    if isinstance(client, RedisCluster):
        nodes = client.get_nodes()  # type: ignore[no-untyped-call]
        return "cluster(" + ",".join(f"{n.host}:{n.port}" for n in nodes[:3]) + ")"
    kwargs = getattr(client.connection_pool, "connection_kwargs", {})
    service = getattr(client.connection_pool, "service_name", None)
    if service:
        return f"sentinel-master:{service}"
    if kwargs.get("path"):
        return f"unix:{kwargs['path']}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"


#: Holder records longer than this (ours are a few hundred bytes) are not decoded: they are
#: foreign data, and would otherwise travel whole into errors, logs and task results.
MAX_RECORD = 65536
_RAW_HEAD = 200


def parse_holder(raw: Any) -> dict[str, Any]:
    """Decode the holder record stored with a lock; unreadable records become ``{"raw": ...}``
    (cut to its first 200 characters when the record is over :data:`MAX_RECORD`)."""
    text = _text(raw)
    if not text:
        return {}
    if len(text) > MAX_RECORD:
        return {"raw": f"{text[:_RAW_HEAD]}... ({len(text)} characters)"}
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"raw": text}


#: Error codes of a server that cannot serve a lock right now, whatever the data: out of
#: memory, a read-only replica, a busy script, a failed save, no replicas, a node loading
#: or down. A lock refused with one is
#: unavailable (retry later), not bad input.
_SERVER_STATES = frozenset(
    ("OOM", "READONLY", "BUSY", "MISCONF", "NOREPLICAS", "MASTERDOWN", "LOADING", "TRYAGAIN")
)
_SERVER_STATE_ERRORS = (
    OutOfMemoryError,
    ReadOnlyError,
    BusyLoadingError,
    ClusterDownError,  # MasterDownError is one
    TryAgainError,
)


def server_refused(exc: BaseException) -> bool:
    """True when a Redis error reply says the server cannot serve now (see _SERVER_STATES).

    redis-py strips the code of the replies it has a class for (``OutOfMemoryError``,
    ``ReadOnlyError``, ...) and keeps the others' (``MISCONF ...``); Redis < 7 reports an
    error inside a script as ``Error running script ...: -OOM ...``.
    """
    if isinstance(exc, _SERVER_STATE_ERRORS):
        return True
    text = str(exc)
    code = text.split(" ", 1)[0]
    if code in _SERVER_STATES:
        return True
    return any(f"-{state} " in text for state in _SERVER_STATES)


def foreign_data_message(client: Any, keys: LockKeys, prefix: str, exc: BaseException) -> str:
    """Say which of a lock's keys holds data celery-redlock did not write, and what to do.

    Called after Redis refused a lock script on the data (``WRONGTYPE``, a counter that
    is not an integer): looks at the keys (a few reads, on this error path only).
    """
    detail = ""
    try:
        kind = _text(client.type(keys.lock))
        if kind not in ("hash", "none"):
            detail = f"{keys.lock!r} holds a {kind}, not a lock hash"
        else:
            kind = _text(client.type(keys.fence))
            value = _text(client.get(keys.fence)) if kind == "string" else None
            if kind not in ("string", "none"):
                detail = f"its fence counter {keys.fence!r} holds a {kind}, not an integer"
            elif value is not None and not _is_int64(value):
                detail = f"its fence counter {keys.fence!r} holds {value[:40]!r}, not an integer"
            elif value is not None and int(value) >= 2**63 - 1:
                detail = f"its fence counter {keys.fence!r} is at the largest integer Redis keeps"
    except RedisError:
        pass
    if not detail:
        return f"lock {keys.name!r}: Redis refused the lock script on {keys.lock!r} ({exc})"
    return (
        f"lock {keys.name!r}: {detail}. Something other than celery-redlock writes under the "
        f"key prefix {prefix!r}: delete that key if it is stale, or give celery-redlock a "
        "prefix of its own (key_prefix=, or the redlock_key_prefix setting)"
    )


def _is_int64(text: str) -> bool:
    try:
        return -(2**63) <= int(text) < 2**63 and text.strip() == text
    except ValueError:
        return False


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
