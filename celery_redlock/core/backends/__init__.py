"""The backends behind :mod:`celery_redlock.core.backend`, one module each, and
:func:`open_backend`, which picks one for what a user passes to a primitive."""

from __future__ import annotations

from typing import Any

from ..backend import Backend
from ..errors import ConfigError

__all__ = ["open_backend"]


def open_backend(target: Any, *, per_node_timeout: float | None = None) -> Backend:
    """The backend for *target*: a backend as it is; a list or tuple as a quorum of its
    members (Redlock), each opened the same way; a redis-py client (plain, Sentinel
    master or Cluster) as one Redis."""
    from .quorum import QuorumBackend  # noqa: PLC0415
    from .redis_backend import RedisBackend  # noqa: PLC0415

    if isinstance(target, (list, tuple)):
        return QuorumBackend([open_backend(t) for t in target], per_node_timeout=per_node_timeout)
    if isinstance(target, Backend):
        return target
    if isinstance(target, str):
        raise ConfigError(
            f"expected a redis-py client, a list of them or a backend, got str {target!r}: "
            "build one with celery_redlock.connect(url)"
        )
    return RedisBackend.of(target)
