"""``MemoryBackend``: the Redis backend on an in-process server, for tests and
single-process tools (``connect("memory://")``).

The server is fakeredis's (``fakeredis[lua]``, the ``testing`` extra: it runs the Lua
scripts with lupa), so every verb runs the very script it runs on Redis: one source of
truth for what a lock does. One store per URL per process (``memory://`` and
``memory://name`` are two stores; the same URL is one store, as Celery's ``memory://``
broker): :meth:`MemoryBackend.for_url` keeps the backend of each URL, and each backend its
own server. Keys expire on ``time.time()`` (fakeredis reads it per command, as the
scripts' ``TIME`` does), so freezegun moves leases as it moves the clock; a blocked wait
is woken by another thread's release on the same server.

What a forked child sees: an empty store for every URL. Each backend puts a new server
behind its pool in the child (:func:`~celery_redlock.core.process.on_fork`; a server costs
about 0.1 ms, so a fork stays cheap however many stores the parent made), so the child
does not see its parent's locks, permits, holds or notices, and the parent never sees the
child's: a prefork worker or a beat on ``memory://`` shares nothing with its siblings.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from ...backend_types import Health
from ...errors import ConfigError
from ...process import ForkLock, made_once, on_fork
from ..redis import RedisBackend, scripts

__all__ = ["INSTALL", "MemoryBackend"]

#: How to get what ``memory://`` runs on.
INSTALL = "pip install 'celery-redlock[testing]'"

_registry: dict[str, MemoryBackend] = {}
_registry_lock = ForkLock()


def _fakeredis() -> Any:
    """The fakeredis module, with its Lua engine, or the ConfigError that says how to
    install them."""
    try:
        import fakeredis  # noqa: PLC0415 - the testing extra: only memory:// needs it
        import lupa  # noqa: F401, PLC0415 - fakeredis runs EVAL only with it
    except ImportError as exc:
        raise ConfigError(
            f"memory:// runs the lock scripts on an in-process server (fakeredis with its "
            f"Lua engine), which is not installed ({exc}): {INSTALL}"
        ) from None
    return fakeredis


def _new_server() -> Any:
    """A new, empty in-process server (the Redis version whose script features the Lua
    files use)."""
    return _fakeredis().FakeServer(version=(7, 4))


class MemoryBackend(RedisBackend):
    """A :class:`~celery_redlock.core.backends.redis.RedisBackend` whose server lives in
    this process.

    :meth:`for_url` gives the one store of a URL; ``MemoryBackend(url)`` makes a store of
    its own. Thread-safe as a Redis is: each script runs alone on its server.
    """

    def __init__(self, url: str = "memory://") -> None:
        if not isinstance(url, str) or not url.lower().startswith("memory://"):
            raise ConfigError(f"a memory backend needs a memory:// URL, got {url!r}")
        self.url = url
        client = _fakeredis().FakeRedis(server=_new_server())
        # Every script loaded, in the form this backend sends (the one that keeps the
        # operators' index): no EVALSHA meets NOSCRIPT, whose error fakeredis keeps past
        # the call, and with it the caller's frames (a dropped Lock would stay alive).
        for script in vars(scripts).values():
            if isinstance(script, scripts.Script):
                client.script_load(script.source)
                client.script_load(script.indexed.source)
        super().__init__(client)
        on_fork(self._forked)

    def _forked(self) -> None:
        """In a forked child: a new, empty server behind the same pool, whose connections
        (the parent's) are dropped. Its scripts load on their first call (``NOSCRIPT``,
        then ``EVAL``), as on a Redis that restarted."""
        pool = self.client.connection_pool
        pool.connection_kwargs["server"] = _new_server()
        pool.reset()

    @classmethod
    def for_url(cls, url: str) -> MemoryBackend:
        """The one store of *url* in this process (made on first use)."""
        return made_once(_registry, url, lambda: cls(url), _registry_lock)

    def describe(self) -> str:
        """The URL."""
        return self.url

    def identity(self) -> Hashable:
        """``("memory", url)``."""
        return ("memory", self.url)

    def __repr__(self) -> str:
        return f"<MemoryBackend {self.url}>"

    def check(self) -> list[Health]:
        """Always ok: nothing to reach."""
        return [Health(self.url, "ok")]

    def clear(self) -> None:
        """Forget every key (for tests); a thread blocked in a wait keeps waiting."""
        self.client.flushall()
