"""Per-app state: settings, Redis clients and the locks this process holds.

Stored on the app object itself, so two Celery apps in one process never share
settings or clients (the mistake of module-global client caches).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from .core.connect import connect
from .core.lock import Lock, open_store
from .core.store import Store
from .settings import Settings, load_settings

__all__ = ["AppState", "state_for"]

log = logging.getLogger("celery_redlock")

_ATTR = "_celery_redlock_state"
_create_lock = threading.Lock()
_ABSENT = object()


class AppState:
    """Everything celery-redlock keeps for one Celery app."""

    def __init__(self, app: Any) -> None:
        self.app = app
        #: Values from worker flags (--redlock-url, --redlock-ttl, --redlock-disable).
        self.overrides: dict[str, Any] = {}
        self.installed = False
        #: True when this worker sends task events (-E): task-lock-* events go out too.
        self.send_events = False
        self._settings: Settings | None = None
        self._clients: Any = None
        self._clients_pid = 0
        self._store: tuple[Any, Store] | None = None
        self._lock = threading.Lock()
        #: (app.conf, the names Celery looks redlock_disable up by in it), for disabled
        self._disable_names: tuple[Any, tuple[str, ...]] = (None, ())
        #: task id -> lock held for it in this process (released on every exit).
        self.held: dict[str, Lock] = {}
        #: task class -> what celery_redlock.task resolved for it from these settings
        #: (dropped with the settings by reset()).
        self.plans: dict[Any, Any] = {}

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
            self.plans = {}

    @property
    def disabled(self) -> bool:
        """True when locking is switched off for this app (flag or setting)."""
        if self.overrides.get("redlock_disable"):
            return True
        # Read on every task (tests flip it at run time), so not through conf.get, which
        # raises and catches a KeyError per configuration layer when the setting is absent:
        # the same names (as Celery spells them for this app) in the same layers, in order.
        conf = self.app.conf
        if self._disable_names[0] is not conf:
            to_keys = getattr(conf, "_to_keys", None)
            if not callable(to_keys) or vars(conf).get("key_t") is not None:
                return bool(conf.get("redlock_disable"))
            self._disable_names = (conf, tuple(dict.fromkeys(to_keys("redlock_disable"))))
        names = self._disable_names[1]
        for layer in conf.maps:
            for name in names:
                value = layer.get(name, _ABSENT)
                if value is not _ABSENT:
                    return bool(value)
        return False

    def clients(self) -> Any:
        """The client (one URL) or list of clients (Redlock) for this app, per process."""
        pid = os.getpid()
        if self._clients is None or self._clients_pid != pid:
            with self._lock:
                if self._clients is None or self._clients_pid != pid:
                    options: Mapping[str, Any] = self.settings["redlock_client_options"]
                    self._clients = connect(self.settings.url, **options)
                    self._clients_pid = pid
        return self._clients

    def store(self) -> Store:
        """The core store of this app's Redis, per process (a quorum when several URLs
        are set)."""
        clients = self.clients()
        cached = self._store
        if cached is None or cached[0] is not clients:
            cached = self._store = (clients, open_store(clients))
        return cached[1]

    def make_lock(self, name: str, ttl: float, **options: Any) -> Lock:
        """A core lock on this app's Redis (held by a majority when several URLs are set)."""
        prefix = self.settings["redlock_key_prefix"]
        options.setdefault("fence_ttl", self.settings["redlock_fence_ttl"])
        return Lock(self.store(), name, ttl, key_prefix=prefix, **options)


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
