"""Apps and workers in this process, for tests: :class:`Env`, one test's throwaway Redis
and the apps on it (the ``env`` fixture of tests/integration/conftest.py), :func:`worker`,
Celery's in-process test worker, :func:`settings_on` for pytest-celery's ``celery_config``,
and :func:`gated` for a task whose body waits for the test."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from celery import Celery
from celery.contrib.testing.worker import start_worker
from servers import RedisServer

_app_numbers = itertools.count(1)


class Env:
    """The throwaway Redis of one test: broker db 0, locks db 1, results db 2, records db 3."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.base = f"redis://{server.host}:{server.port}"
        self.locks = server.client(db=1, decode_responses=True)
        self.rec = server.client(db=3, decode_responses=True)
        self.apps: list[Celery] = []

    def app(self, lock_url: str | list[str] | None = None, **conf: Any) -> Celery:
        """A fresh app on this server; ``conf`` entries go to ``app.conf``."""
        number = next(_app_numbers)
        app = Celery(
            f"inproc{number}",
            broker=f"{self.base}/0",
            backend=f"{self.base}/2",
            set_as_current=False,
        )
        app.conf.update(
            redlock_url=lock_url or f"{self.base}/1",
            task_default_queue=f"inproc{number}-{uuid.uuid4().hex[:6]}",
            worker_hijack_root_logger=False,
            broker_connection_retry_on_startup=True,
            broker_transport_options={"polling_interval": 0.1},
            result_backend_transport_options={"retry_policy": {"max_retries": 2}},
            worker_prefetch_multiplier=1,
        )
        app.conf.update(conf)
        self.apps.append(app)
        return app

    # -- records written by task bodies (db 3) --
    def push(self, key: str, value: Any) -> None:
        self.rec.rpush(key, json.dumps(value))

    def items(self, key: str) -> list[Any]:
        return [json.loads(v) for v in self.rec.lrange(key, 0, -1)]

    def held_keys(self) -> list[str]:
        """Lock keys (not fence counters, notify lists, the board's event log or the
        operators' index of held names) currently in the lock store."""
        side = (":fence", ":notify", ":recent")
        found = self.locks.scan_iter("redlock:*")
        return sorted(
            k
            for k in found
            if not k.endswith(side) and k != "redlock:events" and not k.startswith("redlock:index:")
        )

    def hold_until(self, flag: str, limit: float = 10.0) -> bool:
        """Block (in small steps) until ``flag`` is set in the record db; False on timeout."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.rec.exists(flag):
                return True
            time.sleep(0.01)
        return False


def settings_on(
    server: RedisServer, broker_db: int, backend_db: int, locks_db: int, **more: Any
) -> dict[str, Any]:
    """The settings of pytest-celery's ``celery_app`` on *server* (broker, results and locks
    in the databases given), with the root logger left alone; *more* adds settings."""
    base = f"redis://{server.host}:{server.port}"
    return {
        "broker_url": f"{base}/{broker_db}",
        "result_backend": f"{base}/{backend_db}",
        "redlock_url": f"{base}/{locks_db}",
        "worker_hijack_root_logger": False,
        **more,
    }


@contextlib.contextmanager
def gated(task: Any) -> Iterator[Any]:
    """*task* given the two events its body uses: ``task.started``, which the body sets, and
    ``task.release``, which it waits for; ``release`` is set when the block ends, so that no
    body outlives the test."""
    task.started, task.release = threading.Event(), threading.Event()
    try:
        yield task
    finally:
        task.release.set()


# start_worker, not redlock_worker: tests start it mid-test (after publishing), on per-test apps.
@contextlib.contextmanager
def worker(app: Celery, pool: str = "threads", concurrency: int = 4) -> Iterator[Any]:
    """An in-process worker (a background thread of this process) for *app*."""
    with start_worker(
        app,
        pool=pool,
        concurrency=concurrency,
        perform_ping_check=False,
        shutdown_timeout=30.0,
    ) as w:
        yield w
