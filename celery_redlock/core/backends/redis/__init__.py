"""The Redis backend: one Redis (a plain server, a Sentinel-managed master or a Cluster)
behind the seam (:class:`~.backend.RedisBackend`), with its Lua scripts beside it
(``lua/``, run by :mod:`.scripts`), each verb's script call written once (:mod:`.verbs`),
and what redis-py's clients and errors mean to it (:mod:`.client`)."""

from __future__ import annotations

from .backend import RedisBackend
from .client import (
    STORE_ERRORS,
    access_denied,
    cannot_decide,
    check_client,
    is_client,
    server_refused,
)

__all__ = [
    "STORE_ERRORS",
    "RedisBackend",
    "access_denied",
    "cannot_decide",
    "check_client",
    "is_client",
    "server_refused",
]
