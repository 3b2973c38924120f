"""`celery worker` subprocesses for tests: started in their own process group, stopped by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """A `celery -A <app> worker` subprocess (prefork by default) logging to *log_path*."""

    def __init__(
        self,
        app: str,
        env: dict[str, str],
        log_path: Path,
        concurrency: int = 1,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.log_path = log_path
        argv = [
            sys.executable, "-m", "celery", "-A", app, "worker", "-P", "prefork",
            "-c", str(concurrency), "-l", "info", "-n", f"w{uuid.uuid4().hex[:8]}@%h",
            "--without-heartbeat", "--without-gossip", "--without-mingle", *extra,
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self.log.close()
