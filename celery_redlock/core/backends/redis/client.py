"""The redis-py client as the Redis backend uses it: what is one (:func:`is_client`),
the client its lock traffic goes through (:func:`lock_client`), what its errors mean
(:func:`cannot_decide`, :func:`server_refused`; for the code above the seam,
:data:`STORE_ERRORS` and :func:`refusal`), a server's health (:func:`probe`), and a
connection from its pool for a command with a read deadline of its own
(:func:`checkout`). No module above the core imports redis: what they need of its errors
is here.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
import weakref
from typing import Any, Literal

import redis
from redis import exceptions as rx
from redis.cluster import RedisCluster

from ... import process
from ...backend_types import Health, text
from ...connect import LOCK_CLIENT_DEFAULTS, lock_retry
from ...errors import ConfigError, StoreUnavailable

__all__ = [
    "STORE_ERRORS",
    "MasterChanging",
    "access_denied",
    "cannot_decide",
    "check_client",
    "checkout",
    "is_client",
    "lock_client",
    "plain_pool",
    "probe",
    "server_refused",
]


def is_client(value: Any) -> bool:
    """True for a redis-py client: a ``redis.Redis`` (plain or Sentinel) or a cluster."""
    return isinstance(value, (redis.Redis, RedisCluster))


def check_client(client: Any) -> None:
    """Refuse anything that is not a redis-py client, naming what was given."""
    if not is_client(client):
        raise ConfigError(
            f"expected a redis.Redis, a Sentinel master_for() client or a RedisCluster, "
            f"got {type(client).__module__}.{type(client).__name__}; build one with "
            "celery_redlock.connect(url)"
        )


# -- the lock traffic's own connections ---------------------------------------------------
#: The pool classes whose connections :func:`lock_client` makes again with its own policy.
_PLAIN_POOLS = (redis.ConnectionPool, redis.BlockingConnectionPool)
#: Each plain pool's lock client, while the pool lives (see :func:`lock_client`).
_lock_clients: weakref.WeakKeyDictionary[Any, redis.Redis] = weakref.WeakKeyDictionary()
_lock_clients_lock = process.ForkLock()


def lock_client(client: Any) -> Any:
    """The client that carries this package's calls to *client*'s server.

    A ``redis.Redis`` on a plain pool (``ConnectionPool``, ``BlockingConnectionPool``: what
    ``redis.Redis(host, port)`` and ``from_url`` build) gets a client of its own on a pool
    of its own: the same server, class, credentials, TLS and database
    (``pool.connection_kwargs``), the same connection cap, and the lock clients' policy
    (:func:`~celery_redlock.core.connect.lock_retry`: one immediate retry on a broken
    connection, none after a timeout; socket timeouts of at most
    :data:`~celery_redlock.core.connect.LOCK_CLIENT_DEFAULTS`'). The user's client keeps its
    own policy for the user's calls, whatever it is: redis-py 6+ retries a refused connect
    three times with exponential backoff by default (seconds per command), and a lock call
    that waits on that stalls a Redlock on a dead master and starves the renewal of every
    other lock. The lock client is made on first use and kept while the user's pool lives
    or a backend uses it (a ``Lock`` whose client was made inline outlives that client);
    its connections close when it is collected.

    Any other client (a Sentinel-managed master, whose pool follows the sentinels; a
    cluster, which routes calls itself; a client that holds a single connection) is used as
    it is.
    """
    pool = plain_pool(client)
    if pool is None:
        return client
    return process.made_once(
        _lock_clients, pool, lambda: _make_lock_client(pool), _lock_clients_lock
    )


def plain_pool(client: Any) -> Any:
    """*client*'s pool when it is a plain one, whose lock traffic :func:`lock_client` gives
    connections of its own; None for any other client."""
    if not isinstance(client, redis.Redis) or getattr(client, "connection", None) is not None:
        return None
    pool = getattr(client, "connection_pool", None)
    return pool if type(pool) in _PLAIN_POOLS else None


def _make_lock_client(pool: Any) -> redis.Redis:
    kwargs = dict(pool.connection_kwargs)
    kwargs["retry"] = lock_retry()
    # redis-py < 6 retries only the errors named here, and adds TimeoutError to them with
    # retry_on_timeout; newer ones add them to the Retry object's own.
    kwargs["retry_on_error"] = [rx.ConnectionError]
    if "retry_on_timeout" in kwargs:
        kwargs["retry_on_timeout"] = False
    for key in ("socket_timeout", "socket_connect_timeout"):
        ours, theirs = LOCK_CLIENT_DEFAULTS[key], kwargs.get(key)
        kwargs[key] = ours if theirs is None else min(theirs, ours)
    # RESP2 and no CLIENT SETINFO (redis-py 8 takes it from driver_info, 5-7 from
    # lib_name/lib_version; None turns it off in each): a new connection sends no HELLO and
    # needs no reply before its first command (unless AUTH, SELECT or a client name ask for
    # one), so a connection made while the server is slow still sends the script at once.
    # Every reply of the scripts reads the same in RESP2 and RESP3.
    kwargs["protocol"] = 2
    if "maint_notifications_config" in kwargs:  # redis-py 8: a RESP3 feature, off in RESP2
        kwargs["maint_notifications_config"] = None
    kwargs.pop("maint_notifications_pool_handler", None)  # the user's pool's own
    for key in ("driver_info", "lib_name", "lib_version"):
        if key in kwargs:
            kwargs[key] = None
    made: Any
    if type(pool) is redis.BlockingConnectionPool:
        made = _KeepOneBlocking(
            connection_class=pool.connection_class,
            max_connections=pool.max_connections,
            timeout=pool.timeout,
            **kwargs,
        )
    else:
        made = _KeepOnePool(
            connection_class=pool.connection_class,
            max_connections=pool.max_connections,
            **kwargs,
        )
    return redis.Redis(connection_pool=made)


class _KeepOne:
    """A lock client's pool that keeps the last connection given back aside for the next
    checkout: a lock's acquire and release (a Redlock's, on each master) take it without
    the pool's own checkout and release (its lock, pid check, health read, bookkeeping).

    The kept connection stays counted in use by the pool, and every checkout takes it
    first, so the cap is the same and nothing waits for it; it closes with the pool. A
    forked child drops its parent's (:func:`~celery_redlock.core.process.on_fork`; not
    closed: redis-py closes only its own process's socket). A connection is given back
    read to the end or disconnected (redis-py disconnects on any error between a send
    and its reply).
    """

    _kept: Any = None
    _kept_mutex = threading.Lock()
    #: The redis-py pool class this one keeps a connection in front of.
    _base: type = redis.ConnectionPool

    def _keep_one(self) -> None:
        """Nothing kept, and a mutex of this process's (registered for every fork: a
        parent's thread may have held it)."""
        self._kept = None
        self._kept_mutex = threading.Lock()

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        with self._kept_mutex:
            kept, self._kept = self._kept, None
        if kept is not None:
            return kept
        if not args:
            needs = _needs_name.get(self._base)
            if needs if needs is not None else needs_name(self._base):
                args = ("BLPOP",)  # redis-py < 5.3: a command name
        return super().get_connection(*args, **kwargs)  # type: ignore[misc]

    def release(self, connection: Any) -> None:
        with self._kept_mutex:
            if self._kept is None:
                self._kept = connection
                return
        super().release(connection)  # type: ignore[misc]


class _KeepOnePool(_KeepOne, redis.ConnectionPool):
    """A :class:`_KeepOne` :class:`redis.ConnectionPool`."""

    _base = redis.ConnectionPool

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._keep_one()
        process.on_fork(self._keep_one)


class _KeepOneBlocking(_KeepOne, redis.BlockingConnectionPool):
    """A :class:`_KeepOne` :class:`redis.BlockingConnectionPool`."""

    _base = redis.BlockingConnectionPool

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self._keep_one()
        process.on_fork(self._keep_one)


# -- what a failure means --------------------------------------------------------------
class MasterChanging(rx.RedisError):
    """A script for a Sentinel-managed master was not run: the server the connection
    reached is not the master the sentinels name now, or a failover of that master is
    under way, or the server says a later master replaced it (see
    :mod:`.sentinel`). Nothing was changed; a later call goes to the new master.
    Not a ``ConnectionError``: a client's retry policy does not wait and re-send it."""


#: What redis-py's pools say when they have no connection to give: ``ConnectionPool`` on
#: redis-py < 5.3 (later ones raise ``MaxConnectionsError``), ``BlockingConnectionPool``.
_POOL_EXHAUSTED = frozenset(("Too many connections", "No connection available."))
#: Words of a cluster client's own errors that mean it cannot reach or route to the nodes
#: (the others, "Missing key", "all keys must map to the same key slot", are bugs).
_CLUSTER_TROUBLE = ("cannot be connected", "not covered", "could not agree", "No targets")
#: Error codes of a server that cannot serve right now, whatever the data: out of memory,
#: a read-only replica, a busy script, a failed save, no replicas, a master down, loading,
#: a cluster slot moving, a demoted Sentinel master (REPLACED, from master_guard.lua).
_SERVER_STATE = re.compile(
    r"(?:^|-|caused error: )"
    r"(?:OOM|READONLY|BUSY|MISCONF|NOREPLICAS|MASTERDOWN|LOADING|TRYAGAIN|REPLACED)(?: |$)"
)
_SERVER_STATE_ERRORS = (
    rx.OutOfMemoryError,
    rx.ReadOnlyError,
    rx.BusyLoadingError,
    rx.TryAgainError,
)


def cannot_decide(exc: BaseException) -> bool:
    """True when *exc* means the server could not decide the call (report it as
    unavailable: a later attempt may succeed), False for what a retry cannot mend.

    - A Sentinel-managed master that is changing (:class:`MasterChanging`): unavailable.
    - A connection error or timeout (redis-py's, or an ``OSError`` from the socket):
      the server is down or did not answer in time, and may have run the call. A failed
      ``AUTH`` is one too (as the server is, for this client, unusable right now).
    - A pool with no connection to give (``MaxConnectionsError``; redis-py < 5.3 and
      ``BlockingConnectionPool`` raise a plain ``ConnectionError`` that says so) is not:
      the client is exhausted, nothing was sent, and the server was never asked.
    - A cluster that is down, a slot moving (``TRYAGAIN``), or a cluster client that
      cannot reach or agree on its nodes: unavailable. Its usage errors are bugs: not.
    - An error reply is unavailable only when it is about the server's state
      (:func:`server_refused`); one about the data is foreign data (a ConfigError).
    - ``DataError`` (an argument of a wrong type), any other Redis error and any other
      exception are bugs: raised as they are.
    """
    if isinstance(exc, rx.MaxConnectionsError):
        return False
    if isinstance(exc, MasterChanging):
        return True
    if isinstance(exc, rx.ConnectionError):
        return str(exc) not in _POOL_EXHAUSTED
    if isinstance(exc, (rx.TimeoutError, OSError, rx.ClusterError, rx.SlotNotCoveredError)):
        return True
    if isinstance(exc, rx.RedisClusterException):
        return any(words in str(exc) for words in _CLUSTER_TROUBLE)
    return isinstance(exc, rx.ResponseError) and server_refused(exc)


def server_refused(exc: BaseException) -> bool:
    """True when a Redis error reply says the server cannot serve now (see _SERVER_STATE).

    redis-py strips the code of the replies it has a class for (``OutOfMemoryError``,
    ``ReadOnlyError``, ...) and keeps the others' (``MISCONF ...``); Redis < 7 reports an
    error inside a script as ``Error running script ...: -OOM ...``, and a pipeline puts
    ``Command # n (...) of pipeline caused error:`` before it.
    """
    if isinstance(exc, (*_SERVER_STATE_ERRORS, rx.ClusterError)):
        return True
    return isinstance(exc, rx.RedisError) and _SERVER_STATE.search(str(exc)) is not None


#: What a call to a lock store raises when the store cannot be asked: the seam's
#: StoreUnavailable, or an error of the Redis client that a verb passes on as it is
#: (redis-py's ``RedisError``: a pool with nothing to give, a refused command).
STORE_ERRORS: tuple[type[Exception], ...] = (StoreUnavailable, rx.RedisError)


def access_denied(exc: BaseException) -> Literal["credentials", "permissions"] | None:
    """What an access denial that no retry mends is, or None: ``credentials`` when Redis refused
    the user name or password, ``permissions`` when its ACL refused the command
    (``NOPERM``). A verb's StoreUnavailable carries the Redis error as its cause."""
    cause = exc.__cause__ if isinstance(exc, StoreUnavailable) else exc
    if isinstance(cause, rx.AuthenticationError):
        return "credentials"
    if isinstance(cause, rx.ResponseError) and "NOPERM" in str(cause):
        return "permissions"
    return None


def probe(where: str, client: Any, *, cluster: bool) -> Health:
    """The health of *client*'s server: ``PING``, then (not on a cluster, whose client
    routes to primaries) ``ROLE``, whose refusal (an ACL) says nothing either way."""
    try:
        client.ping()
    except rx.AuthenticationError as exc:
        return Health(where, "credentials", str(exc))
    except rx.BusyLoadingError as exc:
        return Health(where, "loading", str(exc))
    except Exception as exc:
        return Health(where, "unreachable", str(exc))
    kind = "master"
    if not cluster:
        with contextlib.suppress(Exception):  # an ACL may refuse ROLE: nothing to learn
            kind = text(client.execute_command("ROLE")[0])
    return Health(where, "replica" if kind in ("slave", "replica") else "ok")


#: Pool classes whose ``get_connection`` needs a command name (redis-py < 5.3), by type.
_needs_name: dict[type, bool] = {}


def checkout(pool: Any) -> Any:
    """A connection from *pool*, connected (redis-py's pools connect what they hand out).
    redis-py < 5.3 requires a command name (unused since); newer versions warn when given
    one. Which one a pool class wants is read once from its signature."""
    needs = _needs_name.get(type(pool))  # read here: a checkout is on every command's path
    if needs is None:
        needs = needs_name(type(pool))
    return pool.get_connection("BLPOP") if needs else pool.get_connection()


def needs_name(kind: Any) -> bool:
    """True when pool class *kind*'s ``get_connection`` requires a command name."""
    needs = _needs_name.get(kind)
    if needs is None:
        try:
            method = kind.get_connection  # the function: its first parameter is self
            params = list(inspect.signature(method).parameters.values())[1:]
        except (TypeError, ValueError):  # no signature: assume the new API
            params = []
        first = params[0] if params else None
        needs = _needs_name[kind] = (
            first is not None
            and first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD)
            and first.default is first.empty
        )
    return needs
