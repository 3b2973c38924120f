"""`celery worker` subprocesses for tests: started in their own process group, stopped by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from celery import Celery
from celery.result import AsyncResult
from servers import wait_for

ROOT = Path(__file__).resolve().parent.parent


def worker_env(
    server: Any,
    prefix: str = "REDLOCK_TEST",
    *,
    broker: str | None = None,
    locks: str | None = None,
    **extra: str,
) -> dict[str, str]:
    """The environment a test app (``tests/apps``) reads its URLs from, all on *server*:
    ``<prefix>_BROKER`` db 0, ``_LOCKS`` db 1, ``_BACKEND`` db 2, ``_RECORD`` db 3 (what
    task bodies write for the test to read); *broker* and *locks* replace theirs, and
    *extra* is added as it is."""
    base = f"redis://127.0.0.1:{server.port}"
    return {
        f"{prefix}_BROKER": broker or f"{base}/0",
        f"{prefix}_BACKEND": f"{base}/2",
        f"{prefix}_LOCKS": locks or f"{base}/1",
        f"{prefix}_RECORD": f"{base}/3",
        **extra,
    }


class Worker:
    """A `celery -A <app> worker -P <pool>` subprocess (prefork by default) logging to
    *log_path*; *heartbeat*: it sends worker heartbeats, as a worker started with
    Celery's defaults does (so its event dispatcher is on without -E)."""

    def __init__(
        self,
        app: str,
        env: dict[str, str],
        log_path: Path,
        concurrency: int = 1,
        extra: tuple[str, ...] = (),
        pool: str = "prefork",
        *,
        heartbeat: bool = False,
    ) -> None:
        self.log_path = log_path
        self.pool = pool
        #: The worker's node name, as remote control (``destination=``) names it.
        self.name = f"w{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
        quiet = ("--without-gossip", "--without-mingle")
        if not heartbeat:
            quiet = ("--without-heartbeat", *quiet)
        argv = [
            sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool,
            "-c", str(concurrency), "-l", "info", "-n", self.name,
            *quiet, *extra,
        ]  # fmt: skip
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 40.0) -> None:
        """Block until the worker logs that it is ready (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited early:\n{self.text()[-3000:]}")
            if "ready." in self.text():
                return
            time.sleep(0.1)
        raise AssertionError(f"worker not ready in {timeout}s:\n{self.text()[-3000:]}")

    def wait_exit(self, timeout: float = 40.0) -> int:
        """Wait (bounded) for the worker to exit on its own; its exit code."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker still running:\n{self.text()[-3000:]}") from None

    def text(self) -> str:
        """Everything the worker logged so far."""
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole worker: main process and pool children."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL the group if it lingers."""
        stop_group(self.proc, grace=20)
        self.log.close()


def stop_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace: float = 15) -> bool:
    """Stop *proc*, started in a session (a process group) of its own: *sig* to it, up to
    *grace* seconds for it to exit, then SIGKILL to the whole group (whatever it left
    behind, its pool children among them) and a bounded wait for it. False when *proc*
    was still running at the end of *grace* (it ignored *sig*)."""
    exited = True
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            exited = False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(10)
    return exited


@contextlib.contextmanager
def running_worker(
    app: str, env: dict[str, str], log_path: Path, **options: Any
) -> Iterator[Worker]:
    """A :class:`Worker` (*options* as its own) once it logs that it is ready; stopped when
    the block ends, however it ends (a worker that never gets ready is stopped too)."""
    worker = Worker(app, env, log_path, **options)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


@contextlib.contextmanager
def publishing(env: dict[str, str]) -> Iterator[Celery]:
    """A :func:`publisher` to the broker and backend of a :func:`worker_env` *env*; closed
    (see :func:`close_publisher`) when the block ends."""
    app = publisher(env["REDLOCK_TEST_BROKER"], env["REDLOCK_TEST_BACKEND"])
    try:
        yield app
    finally:
        close_publisher(app)


def stop_workers(workers: Iterable[Worker]) -> None:
    """Warm-shut *workers* down side by side: SIGTERM to each, then :meth:`Worker.stop` on
    each (which waits for it, and SIGKILLs its group if it lingers). One after the other,
    each would wait for its own runs and pool before the next one even starts."""
    workers = list(workers)
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(20)
        w.stop()


def idle_before_stop(
    app: Celery, workers: Iterable[Worker], queue: str, timeout: float = 30
) -> None:
    """Make *workers* stop taking messages from *queue*, revoke the tasks they hold for a
    later start (a retry's countdown), and wait (bounded) until each has started every
    task it took: a warm shutdown from then on hands no task to a pool child, and ends
    once the runs under way end.

    Why: at warm shutdown, Celery's prefork pool drops from its books every task it has
    written to a child but whose start the child has not confirmed yet (the consumer's
    close flushes the pool: "they will be redelivered"), and so reads no result of that
    task. The child runs it anyway, and before it exits waits for the worker to read every
    result it sent, 30 s at most (billiard's ``_ensure_messages_consumed``). A SIGTERM a
    few milliseconds after a task went to a child thus makes that warm shutdown last
    30 s longer, whatever the task does (a plain Celery app does it too).
    """
    workers = list(workers)
    names = [w.name for w in workers]
    revoked: set[str] = set()

    def idle() -> bool:
        inspect = app.control.inspect(destination=names, timeout=1.0)
        consuming = inspect.active_queues()
        if consuming is None or set(consuming) != set(names):
            return False  # a reply missing (a loaded worker): asked again
        if any(q["name"] == queue for queues in consuming.values() for q in queues):
            # Told until it is done: a worker cancels its consumer after it has replied.
            app.control.cancel_consumer(queue, destination=names, reply=True, timeout=5)
            return False
        reserved, scheduled = inspect.reserved(), inspect.scheduled()
        if reserved is None or scheduled is None or not set(names) <= {*reserved} & {*scheduled}:
            return False
        later = {e["request"]["id"] for entries in scheduled.values() for e in entries}
        if later - revoked:  # each would go to a child at its countdown's end
            app.control.revoke(list(later - revoked), destination=names, reply=True, timeout=5)
            revoked.update(later)
            return False
        return not any(reserved.values())

    wait_for(idle, timeout, "the workers to start every task they took", interval=0.2)


def forget_results(app: Celery) -> None:
    """Stop *app*'s result subscriptions (in this thread) while the server still runs.

    An AsyncResult unsubscribes in ``__del__``. One that outlives the test (held by a
    failure's traceback, or in a reference cycle, like those a worker thread makes when it
    re-queues a retry) would otherwise do that after the session's server is gone: the
    garbage collector then reports an error at some random later point, and on CPython
    3.11.7 that report can even break pytest's own parsing (gh-106905).
    """
    backend = getattr(app._local, "backend", None)  # this thread's backend, if it made one
    consumer = getattr(backend, "result_consumer", None)
    if consumer is None:
        return
    with contextlib.suppress(Exception):
        consumer.stop()
    consumer.subscribed_to.clear()
    consumer._pubsub = None


def publisher(broker: str, backend: str) -> Celery:
    """A Celery app that publishes to the workers of a test and reads their results,
    with a short retry policy for its result connection (see :func:`close_publisher`)."""
    app = Celery("client", broker=broker, backend=backend)
    app.conf.broker_connection_retry_on_startup = True
    app.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 2}}
    return app


def close_publisher(app: Celery) -> None:
    """Close *app* once its results are unsubscribed: on Celery 5.3 a result collected
    later, on a closed app, retries its unsubscribe for minutes inside whatever test
    publishes next (pytest-timeout cannot interrupt that: it runs in ``__del__``)."""
    forget_results(app)
    app.close()


def values_of(results: Sequence[AsyncResult], timeout: float) -> list[Any]:
    """The value of every result once all are stored, within *timeout* seconds in all.

    Polls each result's stored state in order instead of calling ``get()`` on each: Celery
    5.3's ``get()`` waits one drain interval (1 s) on a result already stored once its
    subscriptions are gone, so 200 finished results took 200 s there.
    """
    pending = list(results)

    def stored() -> bool:
        while pending and pending[0].ready():  # ready() caches the stored result
            pending.pop(0)
        return not pending

    wait_for(stored, timeout, f"all {len(results)} results to be stored", interval=0.05)
    return [result.get(timeout=1) for result in results]
