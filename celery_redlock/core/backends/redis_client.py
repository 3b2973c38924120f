"""The redis-py client as the Redis backend uses it: what is one (:func:`is_client`),
what its errors mean (:func:`cannot_decide`, :func:`server_refused`), and a connection
from its pool for a command with a read deadline of its own (:func:`checkout`).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import redis
from redis import exceptions as rx
from redis.cluster import RedisCluster

from ..errors import ConfigError

__all__ = ["cannot_decide", "check_client", "checkout", "is_client", "server_refused"]


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


# -- what a failure means --------------------------------------------------------------
#: What redis-py's pools say when they have no connection to give: ``ConnectionPool`` on
#: redis-py < 5.3 (later ones raise ``MaxConnectionsError``), ``BlockingConnectionPool``.
_POOL_EXHAUSTED = frozenset(("Too many connections", "No connection available."))
#: Words of a cluster client's own errors that mean it cannot reach or route to the nodes
#: (the others, "Missing key", "all keys must map to the same key slot", are bugs).
_CLUSTER_TROUBLE = ("cannot be connected", "not covered", "could not agree", "No targets")
#: Error codes of a server that cannot serve right now, whatever the data: out of memory,
#: a read-only replica, a busy script, a failed save, no replicas, a master down, loading,
#: a cluster slot moving.
_SERVER_STATE = re.compile(
    r"(?:^|-|caused error: )(?:OOM|READONLY|BUSY|MISCONF|NOREPLICAS|MASTERDOWN|LOADING|TRYAGAIN)"
    r"(?: |$)"
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


#: Pool classes whose ``get_connection`` needs a command name (redis-py < 5.3), by type.
_needs_name: dict[type, bool] = {}


def checkout(pool: Any) -> Any:
    """A connection from *pool*, connected (redis-py's pools connect what they hand out).
    redis-py < 5.3 requires a command name (unused since); newer versions warn when given
    one. Which one a pool class wants is read once from its signature."""
    kind = type(pool)
    needs = _needs_name.get(kind)
    if needs is None:
        try:
            params = list(inspect.signature(pool.get_connection).parameters.values())
        except (TypeError, ValueError):  # no signature: assume the new API
            params = []
        first = params[0] if params else None
        needs = _needs_name[kind] = (
            first is not None
            and first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD)
            and first.default is first.empty
        )
    return pool.get_connection("BLPOP") if needs else pool.get_connection()
