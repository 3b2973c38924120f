"""The worker's main process hears of a pool child's exit at once: a watched process that
exits gets its callback called once, promptly, with a pidfd or with the /proc fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from celery_redlock.worker import child_watch


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc-poll"])
def test_a_watched_child_that_exits_gets_its_callback_once_and_promptly(
    pidfd: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL a watched child: its callback runs within a second, once; a second watch of
    the same pid replaced the first callback; an unwatched child's callback never runs."""
    if not pidfd:
        monkeypatch.setattr(child_watch, "_pidfd", lambda pid: None)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    child = subprocess.Popen(sleeper)
    spared = subprocess.Popen(sleeper)
    calls: list[tuple[str, float]] = []
    done = threading.Event()
    try:
        child_watch.watch(child.pid, lambda: calls.append(("first", time.monotonic())))
        child_watch.watch(
            child.pid, lambda: (calls.append(("newer", time.monotonic())), done.set())
        )
        child_watch.watch(spared.pid, lambda: calls.append(("spared", time.monotonic())))
        child_watch.unwatch(spared.pid)
        killed = time.monotonic()
        child.kill()
        assert done.wait(5), "no callback after the child exited"
        spared.kill()
        spared.wait(5)
        time.sleep(0.5)  # a callback for the unwatched child would come within this
    finally:
        for proc in (child, spared):
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
    assert [name for name, _ in calls] == ["newer"]
    assert calls[0][1] - killed < 1.0, f"called {calls[0][1] - killed:.2f} s after the kill"


def test_alive_tells_a_running_process_from_an_exited_one() -> None:
    """alive() is True for this process and False for a child that exited (reaped or not)."""
    assert child_watch.alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while child_watch.alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not child_watch.alive(child.pid)  # a zombie counts as gone
    child.wait(5)
    assert not child_watch.alive(child.pid)
