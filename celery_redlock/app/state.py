"""Per-app state: settings, Redis clients and the locks this process holds.

Stored on the app object itself, so two Celery apps in one process never share
settings or clients (the mistake of module-global client caches).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..core import Backend, Lock, RateLimiter, RunLock, Semaphore, connect, open_backend, process
from .config import Settings, TaskOptions, load_settings, resolve

if TYPE_CHECKING:  # the worker side sets it; the app side only holds it
    from ..worker.pools import Pool

__all__ = ["AppState", "HeldRun", "state_for"]

log = logging.getLogger("celery_redlock")

_ATTR = "_celery_redlock_state"
_create_lock = threading.Lock()


class HeldRun(Protocol):
    """A run holding a lock in this process, as the worker's own paths see it (a task's
    run, :class:`celery_redlock.task.run.LockedRun`)."""

    @property
    def lock(self) -> Lock | None:
        """The lock it holds now (None once released)."""

    def release(self) -> bool:
        """Release its lock, once; True when this call released it."""


class AppState:
    """Everything celery-redlock keeps for one Celery app."""

    def __init__(self, app: Any) -> None:
        self.app = app
        #: Setting -> value, from this worker's flags (``redlock_url`` from --redlock-url).
        self.overrides: dict[str, Any] = {}
        self.installed = False
        #: True when this worker sends task events (-E): redlock-* events go out too.
        self.send_events = False
        #: The pool of the worker this process runs (set by its bootstep; None elsewhere).
        self.pool: Pool | None = None
        self._settings: Settings | None = None
        self._clients: Any = None
        self._backend: tuple[Any, Backend] | None = None
        self._lock = threading.Lock()
        #: task id -> the run holding a lock for it in this process (released on every
        #: exit, and then no longer here).
        self.held: dict[str, HeldRun] = {}
        #: task class -> its lock options resolved against these settings (dropped with
        #: the settings by reset()).
        self.task_options: dict[type, TaskOptions] = {}
        process.on_fork(self._forked)

    @property
    def settings(self) -> Settings:
        """The checked settings (loaded on first use; ConfigError if wrong)."""
        if self._settings is None:
            self._settings = load_settings(self.app.conf, self.overrides)
        return self._settings

    def reset(self) -> None:
        """Forget loaded settings and clients (after conf changes or new overrides)."""
        with self._lock:
            self._settings = None
            self._clients = None
            self._backend = None
            self.task_options = {}

    def _forked(self) -> None:
        """In a forked child: its own clients (sockets are per process) and guard."""
        self._lock = threading.Lock()
        self._clients = None
        self._backend = None

    @property
    def disabled(self) -> bool:
        """True when locking is switched off for this app (flag or setting).

        Read from ``app.conf`` on every run: a test may switch it on at any time.
        """
        return bool(self.overrides.get("redlock_disable") or self.app.conf.get("redlock_disable"))

    def options_for(self, task: Any) -> TaskOptions:
        """The lock options of *task*'s class, resolved on first use (see config.resolve)."""
        cls = type(task)
        found = self.task_options.get(cls)
        if found is None:
            found = self.task_options[cls] = resolve(cls, cls.redlock_spec, self.settings)
        return found

    def clients(self) -> Any:
        """The client (one URL) or list of clients (Redlock) for this app, per process."""
        if self._clients is None:
            with self._lock:
                if self._clients is None:
                    options: Mapping[str, Any] = self.settings.client_options
                    self._clients = connect(self.settings.urls, **options)
        return self._clients

    def backend(self) -> Backend:
        """The core backend of this app's ``redlock_url``, per process (a quorum when
        several URLs are set; the in-process store for ``memory://``)."""
        clients = self.clients()
        cached = self._backend
        if cached is None or cached[0] is not clients:
            cached = self._backend = (clients, open_backend(clients))
        return cached[1]

    def make_lock(self, name: str, ttl: float, *, limit: int = 1, **options: Any) -> Lock:
        """A core lock on this app's Redis (held by a majority when several URLs are set),
        with *limit* > 1 a :class:`Semaphore` of that many permits (one Redis only), and
        with ``handover`` or ``done_as`` a :class:`RunLock` (a queued message's run)."""
        settings = self.settings
        prefix = settings.key_prefix
        options.setdefault("fence_ttl", settings.fence_ttl)
        if limit > 1:
            return Semaphore(self.backend(), name, limit, ttl, key_prefix=prefix, **options)
        if "handover" in options or "done_as" in options:
            return RunLock(self.backend(), name, ttl, key_prefix=prefix, **options)
        return Lock(self.backend(), name, ttl, key_prefix=prefix, **options)

    def make_limiter(
        self, name: str, rate: str, burst: int, owner_info: Mapping[str, Any] | None = None
    ) -> RateLimiter:
        """A core rate limiter on this app's Redis (one Redis only)."""
        return RateLimiter(
            self.backend(),
            name,
            rate,
            burst=burst,
            key_prefix=self.settings.key_prefix,
            owner_info=owner_info,
        )


def state_for(app: Any) -> AppState:
    """The :class:`AppState` of *app*, created on first use."""
    state = app.__dict__.get(_ATTR)
    if state is None:
        with _create_lock:
            state = app.__dict__.get(_ATTR)
            if state is None:
                state = AppState(app)
                setattr(app, _ATTR, state)
    return state  # type: ignore[no-any-return]
