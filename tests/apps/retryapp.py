"""A Celery app whose locked tasks are re-queued by their lock, each with a result backend
that stores some states late or not at all, for tests/integration/test_retry_order.py.

Configured from the environment, as tests/apps/limitsapp.py:

REDLOCK_TEST_BROKER   broker URL
REDLOCK_TEST_BACKEND  result backend URL (a real Redis)
REDLOCK_TEST_LOCKS    redlock_url
REDLOCK_TEST_RECORD   a Redis URL where the worker counts each message it received and
                      each attempt whose trace ended (with its state)

Each task has a backend of its own (``@app.task(backend=...)``, Celery's public option): a
real Redis result backend that, for the states it names, waits between Celery's read of the
stored state and its write (``slow``), or refuses the write (``refuse``). Celery's
``_store_result`` reads the stored state, then writes, and skips the write only when it
read SUCCESS: a write held between the two lands over whatever was stored meanwhile, as a
loaded machine can do.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals
from celery.backends.redis import RedisBackend
from kombu.exceptions import OperationalError

from celery_redlock import LockedTask

BACKEND = os.environ.get("REDLOCK_TEST_BACKEND", "redis://127.0.0.1:1/2")

app = Celery(
    "retryapp",
    broker=os.environ.get("REDLOCK_TEST_BROKER", "redis://127.0.0.1:1/0"),
    backend=BACKEND,
)
app.conf.redlock_url = os.environ.get("REDLOCK_TEST_LOCKS", "redis://127.0.0.1:1/1")
app.conf.worker_prefetch_multiplier = 1
app.conf.broker_connection_retry_on_startup = True
app.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 1}}

#: How long a slowed write waits after Celery's read (a loaded machine's pause).
PAUSE = 0.3

#: Many cheap lock retries, 10 ms backoffs.
FAST: dict[str, Any] = {
    "lock_max_retries": 100_000,
    "lock_retry_backoff": 0.01,
    "lock_retry_backoff_max": 0.02,
}


_record: redis.Redis | None = None


def _count(event: str, name: str, **fields: Any) -> None:
    global _record
    if _record is None:
        _record = redis.Redis.from_url(os.environ["REDLOCK_TEST_RECORD"])
    _record.rpush("events", json.dumps({"event": event, "task": name, **fields}))


@signals.task_received.connect
def _received(request: Any = None, **_: Any) -> None:
    """Main process: one message of a task received."""
    _count("received", request.name)


@signals.task_postrun.connect
def _ended(sender: Any = None, state: Any = None, **_: Any) -> None:
    """The child: one attempt's trace ended (Celery stores a FAILURE for an internal error
    after this, paused at most twice)."""
    _count("ended", sender.name, state=state)


class HookedBackend(RedisBackend):  # type: ignore[misc]
    """A Redis result backend whose writes of the states in *slow* wait ``PAUSE`` after
    Celery read the stored state, and whose writes of the states in *refuse* fail."""

    def __init__(
        self, *args: Any, slow: tuple[str, ...] = (), refuse: tuple[str, ...] = (), **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.slow = slow
        self.refuse = refuse

    def set(self, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        status = self.decode(value).get("status")
        if status in self.refuse:
            raise OperationalError(f"result backend refuses {status} (test)")
        if status in self.slow:
            time.sleep(PAUSE)
        return super().set(key, value, *args, **kwargs)


def _backend(**hooks: Any) -> HookedBackend:
    return HookedBackend(app=app, url=BACKEND, **hooks)


def _body(n: int, seconds: float) -> int:
    time.sleep(seconds)
    return n


@app.task(base=LockedTask, lock_key="busy", backend=_backend(slow=("RETRY",)), **FAST)
def busy(n: int, seconds: float) -> int:
    """One run of key "busy" at a time; the RETRY of a refused run is stored late."""
    return _body(n, seconds)


@app.task(
    base=LockedTask,
    lock_key="paced",
    lock_limit=None,
    lock_rate="10/s",
    backend=_backend(slow=("RETRY",)),
    **FAST,
)
def paced(n: int) -> int:
    """Ten starts a second of key "paced"; the RETRY of a run re-queued for its rate slot
    is stored late."""
    return n


@app.task(base=LockedTask, lock_key="down", backend=_backend(refuse=("RETRY", "FAILURE")), **FAST)
def down(n: int, seconds: float) -> int:
    """Key "down": the result backend refuses every RETRY and FAILURE it is sent."""
    return _body(n, seconds)


@app.task(
    base=LockedTask,
    lock_key="flaky",
    backend=_backend(refuse=("RETRY",), slow=("FAILURE",)),
    **FAST,
)
def flaky(n: int, seconds: float) -> int:
    """Key "flaky": the result backend refuses every RETRY, and stores a FAILURE late."""
    return _body(n, seconds)


class RaisingOnRetry(LockedTask):  # type: ignore[misc]
    """A task class whose ``on_retry`` calls ours, then raises."""

    def on_retry(self, *args: Any, **kwargs: Any) -> None:
        super().on_retry(*args, **kwargs)
        raise RuntimeError("on_retry failed (test)")


class ReplacingOnRetry(LockedTask):  # type: ignore[misc]
    """A task class whose ``on_retry`` raises without calling ours."""

    def on_retry(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("on_retry failed (test)")


@app.task(base=RaisingOnRetry, lock_key="hook", backend=_backend(slow=("FAILURE",)), **FAST)
def hook(n: int, seconds: float) -> int:
    """Key "hook": on_retry raises after ours; a FAILURE is stored late."""
    return _body(n, seconds)


@app.task(
    base=ReplacingOnRetry,
    lock_key="bare",
    backend=_backend(),
    **{**FAST, "lock_retry_backoff": 0.2, "lock_retry_backoff_max": 0.2},
)
def bare(n: int, seconds: float) -> int:
    """Key "bare": on_retry raises and never calls ours."""
    return _body(n, seconds)


class UnpublishableRetry(LockedTask):  # type: ignore[misc]
    """A task class whose lock retries cannot be published (the broker refuses them)."""

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        if (options.get("headers") or {}).get("redlock_retries"):
            raise OperationalError("broker refuses the lock retry (test)")
        return super().apply_async(args, kwargs, **options)


@app.task(
    base=UnpublishableRetry,
    lock_key="stuck",
    lock_on="enqueue",
    backend=_backend(),
    **FAST,
)
def stuck(n: int, seconds: float) -> int:
    """Key "stuck" (held from publish until the body starts); its lock retries are refused."""
    return _body(n, seconds)
