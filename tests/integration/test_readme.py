"""The README's "In ten lines" run as written: its Python block is the project (`proj`),
its shell lines are the commands, with every `redis://localhost:6379` pointed at a
throwaway Redis (the only change)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from servers import RedisServer, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _ten_lines() -> tuple[str, list[str]]:
    """The section's Python block and its shell lines (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## In ten lines", 1)[1].split("\n## ", 1)[0]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    shell = re.search(r"```sh\n(.*?)```", section, re.S)
    assert python and shell, "the section has a Python block and a shell block"
    lines = [line.split("#", 1)[0].strip() for line in shell.group(1).splitlines()]
    return python.group(1), [line for line in lines if line]


def _here(text: str, server: RedisServer) -> str:
    return text.replace("redis://localhost:6379", f"redis://127.0.0.1:{server.port}")


def _start_worker(
    argv: list[str], env: dict[str, str], where: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start the worker *argv* in *where* (its own process group) and wait until it is
    ready; the process and its log file."""
    log_path = where / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            argv, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: "ready." in log_path.read_text(errors="replace"), 40, "the worker")
    except BaseException:
        _stop(worker)
        raise
    return worker, log_path


def _stop(worker: subprocess.Popen[bytes]) -> None:
    """Warm shutdown, then SIGKILL its group if it lingers."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(10)


def test_the_ten_lines_run_as_written(server: RedisServer, tmp_path: Path) -> None:
    """proj.py is the README's block; its worker line starts a worker that logs where its
    locks live and runs both tasks; `celery locks list` and `release` answer from there."""
    code, commands = _ten_lines()
    (tmp_path / "proj.py").write_text(_here(code, server))
    worker_line, list_line, release_line = commands
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    argv = shlex.split(_here(worker_line, server))
    assert argv[:4] == ["celery", "-A", "proj", "worker"], argv
    argv = [sys.executable, "-m", *argv, "-c", "2", "-n", f"readme{uuid.uuid4().hex[:6]}@%h"]
    publish = textwrap.dedent("""
        from proj import nightly_report, sync_user
        sync_user.delay(42)
        nightly_report.delay()
    """)
    # Sent while the worker starts (the broker keeps the messages): two Python processes
    # importing Celery side by side instead of one after the other.
    publisher = subprocess.Popen(
        [sys.executable, "-c", publish], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        worker, log_path = _start_worker(argv, env, tmp_path)
    except BaseException:
        publisher.kill()
        publisher.communicate()
        raise
    try:
        text = log_path.read_text(errors="replace")
        assert f"locks at redis://127.0.0.1:{server.port}/1 (ttl=30.0s" in text
        _, err = publisher.communicate(timeout=60)
        assert publisher.returncode == 0, err
        wait_for(
            lambda: log_path.read_text(errors="replace").count("succeeded") >= 2,
            30,
            "both tasks to run",
            interval=0.05,
        )
        # `celery locks list` and `release` side by side: both ask about what is held now.
        commands = [
            (line, code_wanted, said, subprocess.Popen(
                [sys.executable, "-m", *shlex.split(_here(line, server))], cwd=tmp_path,
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
            for line, code_wanted, said in (
                (list_line, 0, f"no locks held at redis://127.0.0.1:{server.port}/1"),
                (release_line, 1, "'sync:42' is not held"),
            )
        ]  # fmt: skip
        answers = [(*c[:3], *c[3].communicate(timeout=60), c[3].returncode) for c in commands]
        for line, code_wanted, said, out, err, code in answers:
            assert code == code_wanted, (line, out, err)
            assert said in out + err, (line, out, err)
    finally:
        _stop(worker)


def _django_files() -> dict[str, str]:
    """The README's Django project: each block of "Where settings go" by its first line's
    path (``# proj/settings.py: ...``)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Where settings go", 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"```python\n(.*?)```", section, re.S):
        path = block.split("\n", 1)[0].lstrip("# ").split(":", 1)[0].strip()
        files[path] = block
    return files


def test_the_django_project_runs_as_written(server: RedisServer, tmp_path: Path) -> None:
    """proj/settings.py, proj/celery.py, proj/__init__.py and sync/tasks.py as the README
    gives them (with the rest of a Django settings file: a secret key and sync in
    INSTALLED_APPS): `celery -A proj worker` logs the CELERY_REDLOCK_URL and TTL, and
    runs sync_user called from Django code."""
    files = _django_files()
    assert set(files) == {"proj/settings.py", "proj/celery.py", "proj/__init__.py", "sync/tasks.py"}
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(_here(text, server))
    (tmp_path / "sync" / "__init__.py").write_text("")
    with open(tmp_path / "proj" / "settings.py", "a") as settings:
        settings.write('\nSECRET_KEY = "readme-test"\nINSTALLED_APPS = ["sync"]\nUSE_TZ = True\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    argv = [sys.executable, "-m", "celery", "-A", "proj", "worker", "-l", "info", "-c", "1"]
    argv += ["-n", f"django{uuid.uuid4().hex[:6]}@%h"]
    worker, log_path = _start_worker(argv, env, tmp_path)
    try:
        assert f"locks at redis://127.0.0.1:{server.port}/1 (ttl=30.0s" in log_path.read_text()
        call = textwrap.dedent("""
            import os
            import django
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
            django.setup()
            from sync.tasks import sync_user
            print("result", sync_user.delay(42).get(timeout=30))
        """)
        done = subprocess.run(
            [sys.executable, "-c", call], cwd=tmp_path, env=env, timeout=60, check=False,
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0 and "result None" in done.stdout, done.stderr
        assert (
            "sync.tasks.sync_user[" in log_path.read_text() and "succeeded" in log_path.read_text()
        )
    finally:
        _stop(worker)
