"""The backends behind :mod:`celery_redlock.core.backend`, one folder each (``redis/``,
``memory/``: the Redis backend on an in-process server, ``quorum/``), and
:func:`open_backend`, which picks one for what a user passes to a primitive."""

from __future__ import annotations

from typing import Any

from ..backend import Backend, has
from ..errors import ConfigError
from .memory import MemoryBackend
from .quorum import QuorumBackend
from .redis import STORE_ERRORS, RedisBackend, access_denied, is_client

__all__ = [
    "STORE_ERRORS",
    "MemoryBackend",
    "QuorumBackend",
    "RedisBackend",
    "access_denied",
    "open_backend",
]

#: The backends of this package: told apart by a plain isinstance, which costs far less
#: than one against the Backend protocol (a check of every verb) on every Lock made.
_OURS = (RedisBackend, QuorumBackend)  # a MemoryBackend is a RedisBackend


def open_backend(target: Any, *, per_node_timeout: float | None = None) -> Backend:
    """The backend for *target*: a backend as it is; a list or tuple as a quorum of its
    members (Redlock), each opened the same way; a redis-py client (plain, Sentinel
    master or Cluster) as one Redis."""
    if isinstance(target, _OURS):
        return target
    if isinstance(target, (list, tuple)):
        return QuorumBackend([open_backend(t) for t in target], per_node_timeout=per_node_timeout)
    if is_client(target):
        return RedisBackend.of(target)
    if isinstance(target, str):
        raise ConfigError(
            f"expected a redis-py client, a list of them or a backend, got str {target!r}: "
            "build one with celery_redlock.connect(url)"
        )
    if has(target, Backend):  # a backend of someone else's, through the seam
        return target  # type: ignore[no-any-return]
    return RedisBackend.of(target)  # refuses it, naming what was given
