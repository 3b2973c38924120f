"""The memory backend (``connect("memory://")``): the lock semantics of the Redis backend,
kept in this process (:class:`~.backend.MemoryBackend`), on a store that keeps keys as
Redis does (:mod:`.store`)."""

from __future__ import annotations

from .backend import MemoryBackend

__all__ = ["MemoryBackend"]
