"""What a real prefork worker logs when a run loses its lock: one WARNING line.

The line names the lock, the task, its id and why the lock was lost; a loss is an
outcome the task's options expect (``lock_on_lost``), so Celery logs the run's end at
INFO, with no traceback.
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from servers import RedisServer, wait_for
from workers import Worker, publishing, running_worker, worker_env

from celery_redlock.core import admin

pytestmark = pytest.mark.slow

APP = "tests.apps.lostapp"
#: The start of a log line at WARNING or worse in a worker's log (`-l info` format).
_SEVERE = re.compile(r"^\[[^\]]*: (WARNING|ERROR|CRITICAL)/", re.MULTILINE)


@pytest.fixture(scope="module")
def worker(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One prefork worker (one child) of the test app for the module."""
    with running_worker(
        APP, worker_env(server), tmp_path_factory.mktemp("lost") / "worker.log"
    ) as w:
        yield w


@pytest.fixture
def client(server: RedisServer, worker: Worker) -> Iterator[Celery]:
    """A publisher for the module's worker."""
    with publishing(worker_env(server)) as app:
        yield app


def _lines_about(text: str, lock: str) -> list[str]:
    """The log records (a record is its first line and what follows it) that mention
    *lock*."""
    starts = [m.start() for m in re.finditer(r"^\[\d{4}-", text, re.MULTILINE)] + [len(text)]
    records = [text[a:b] for a, b in itertools.pairwise(starts)]
    return [r for r in records if lock in r]


@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_a_forced_release_of_a_running_lock_is_one_warning_line(
    client: Celery, server: RedisServer, worker: Worker, policy: str
) -> None:
    """A run whose lock an operator force-releases: the worker's log has exactly one
    WARNING-or-worse line about that lock, naming it, the task, its id and why, and no
    traceback or "raised unexpected" for the LockLost."""
    name = uuid.uuid4().hex[:8]
    lock = f"lost:{name}"
    task = "interrupted" if policy == "raise" else "warned"
    before = len(worker.text())
    result = client.send_task(f"{APP}.{task}", args=(name,))
    wait_for(lambda: server.client(db=3).exists(f"started:{name}"), 20, "the run to start")
    locks = server.client(db=1)
    assert admin.force_release(locks, "redlock:", lock).outcome == "released"
    result.get(timeout=20, propagate=False)
    assert result.state == ("FAILURE" if policy == "raise" else "SUCCESS")
    ended = (f"[{result.id}] succeeded", f"[{result.id}] raised")
    wait_for(lambda: any(e in worker.text() for e in ended), 10, "the run's end to be logged")
    text = worker.text()[before:]
    about = _lines_about(text, f"'{lock}'")
    severe = [r for r in about if _SEVERE.match(r)]
    assert len(severe) == 1, text
    line = severe[0]
    assert f"{APP}.{task}[{result.id}]" in line, line
    assert "the key is gone" in line, line
    assert "Traceback" not in text and "raised unexpected" not in text, text
    if policy == "raise":  # LockLost is in the task's throws: Celery's INFO line
        assert (
            f"INFO/ForkPoolWorker-1] Task {APP}.{task}[{result.id}] raised expected: LockLost("
            in text
        )
