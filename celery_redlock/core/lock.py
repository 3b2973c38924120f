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
from redis.exceptions import RedisError, ResponseError

from .base import Attempt, BaseLock
from .errors import ConfigError, QuorumUnavailable
from .scripts import ACQUIRE, EXTEND, RELEASE

__all__ = ["Lock", "address_of", "check_client", "wait_for_notice"]

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
            raise ConfigError(
                f"lock {self.name!r}: Redis refused the acquire script ({exc}); is "
                f"{self.keys.lock!r} used by something else?"
            ) from exc
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
        return Attempt(False, started, holder=parse_holder(reply[1]), ttl_ms=int(reply[2]))

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
        except RedisError as exc:
            raise self._unavailable(exc) from exc

    def _do_read_holder(self) -> dict[str, Any] | None:
        try:
            token, info = self.client.hmget(self.keys.lock, ["token", "info"])
        except RedisError as exc:
            raise self._unavailable(exc) from exc
        return None if token is None else parse_holder(info)

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


def parse_holder(raw: Any) -> dict[str, Any]:
    """Decode the holder record stored with a lock; unreadable records become ``{}``."""
    text = _text(raw)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"raw": text}


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
