"""How the Redis backend (:mod:`.redis_backend`) calls its server: :class:`RedisCalls`, the
part every group of its verbs shares (the client, the pool a script's connection comes
from, and what an error means for a verb). A script for a Sentinel-managed master goes
through that pool's :class:`~.sentinel_watch.MasterWatch`.

Errors: see :func:`~.redis_client.cannot_decide` for what is reported as
:class:`~celery_redlock.core.errors.QuorumUnavailable`; an error reply about the data at a
lock's keys is a :class:`~celery_redlock.core.errors.ConfigError` (foreign data);
anything else is raised as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from redis import exceptions as rx
from redis.cluster import RedisCluster

from ..backend_types import Slot
from ..connect import address_of
from ..errors import ConfigError, QuorumUnavailable
from ..keys import LockKeys
from .redis_admin import foreign_data_message
from .redis_client import cannot_decide, check_client, lock_client
from .redis_scripts import Script, pool_of, run
from .sentinel_watch import is_sentinel_master, watch_of

__all__ = ["RedisCalls", "mutex_keys"]


class RedisCalls:
    """One redis-py client as the backend's verbs call it: ``client`` is the one its calls
    go through (:func:`~.redis_client.lock_client`: the same server, the lock clients'
    policy), ``given`` what the backend is the backend of: the user's client when its
    calls go through it, else the lock client (which holds nothing of the user's, so the
    backend can live as long as the user's pool without keeping it alive)."""

    def __init__(self, client: Any) -> None:
        check_client(client)
        self.client = lock_client(client)
        self.given = self.client
        self.cluster = isinstance(client, RedisCluster)
        #: Where a script's connection comes from (None: the client's own evalsha).
        self._pool = None if self.cluster else pool_of(self.client)
        #: The pool of a Sentinel-managed master (its scripts go through its watch).
        self._sentinel = self._pool if is_sentinel_master(self._pool) else None
        self._address: str | None = None

    def describe(self) -> str:
        """The password-free address, for log lines and errors."""
        if self._address is None:
            self._address = address_of(self.client)
        return self._address

    def unavailable(self, name: str, exc: BaseException, where: str = "") -> QuorumUnavailable:
        """The error for lock *name* when this Redis (or node *where*) could not decide."""
        return QuorumUnavailable(name, {where or self.describe(): f"{type(exc).__name__}: {exc}"})

    def _errors(self, name: str, foreign: Callable[[Exception], str] | None = None) -> _Errors:
        """Report what cannot be decided as unavailable and an error reply about the data
        (with *foreign*, which words it) as a ConfigError; let everything else through."""
        return _Errors(self, name, foreign)

    def _guard(self, slot: Slot) -> _Errors:
        return _Errors(self, slot.name, partial(foreign_data_message, self.client, slot.keys))

    def _run(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        if self._sentinel is None:
            return run(script, self.client, self._pool, keys, args)
        return watch_of(self._sentinel).run(self._sentinel, script, keys, args)


class _Errors:
    """:meth:`RedisCalls._errors` as a plain context manager (one per verb call)."""

    __slots__ = ("backend", "foreign", "name")

    def __init__(
        self, backend: RedisCalls, name: str, foreign: Callable[[Exception], str] | None
    ) -> None:
        self.backend, self.name, self.foreign = backend, name, foreign

    def __enter__(self) -> None:
        return None

    def __exit__(self, _type: Any, exc: BaseException | None, _tb: Any) -> None:
        if not isinstance(exc, Exception):
            return
        if cannot_decide(exc):
            raise self.backend.unavailable(self.name, exc) from exc
        if self.foreign is not None and isinstance(exc, rx.ResponseError):
            raise ConfigError(self.foreign(exc)) from exc


def mutex_keys(slot: Slot) -> LockKeys:
    """The keys of *slot*, which must be a mutex: permits have no queued hold or marks."""
    if slot.permits or not slot.keys.queued:
        raise ConfigError(f"lock {slot.name!r}: enqueue-time holds take a mutex, not permits")
    return slot.keys
