"""The memory backend (``connect("memory://")``): the Redis backend, its Lua scripts and
all, on an in-process server of this process (:class:`~.backend.MemoryBackend`; fakeredis
with its Lua engine, from the ``testing`` extra)."""

from __future__ import annotations

from .backend import INSTALL, MemoryBackend

__all__ = ["INSTALL", "MemoryBackend"]
