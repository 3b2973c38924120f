"""`make demo` (examples/demo/run.py) end to end, as CI runs it: no terminal, CI=true."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo" / "run.py"


def _processes_mentioning(port: int) -> list[str]:
    """Processes whose command line or environment names the demo's Redis port."""
    found = []
    needle = f"127.0.0.1:{port}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ or f"--port\x00{port}\x00".encode() in cmdline:
            shown = cmdline.replace(b"\x00", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {shown}")
    return found


def test_demo_plays_every_scene_checks_itself_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """Under CI=true the demo prints plain lines, passes its own checks, writes the PNG,
    and stops every process it started (Redis, two workers, beat)."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    # At half pace (the task bodies last half their defaults, demoapp.PACE): the same
    # scenes and checks, in 5 s less.
    env = {**os.environ, "CI": "true", "DEMO_PACE": "0.5"}
    begin = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(DEMO), "--png", str(png)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    took = time.monotonic() - begin
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "\x1b[" not in done.stdout, "no terminal: no ANSI live view"
    assert re.search(r"== scene 1/\d+", out)
    assert "* every check passed" in out
    assert re.search(r"ok\s+the crashed key export:invoices recovered in \d+\.\d+ s", out)
    assert re.search(r"ok\s+no key ever held by more runs than its limit", out)
    assert "SIGKILL pool child pid" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000  # a drawn chart, not an empty canvas
    assert took < 120, f"the demo took {took:.0f} s"
    port = int(re.search(r"throwaway Redis: redis://127\.0\.0\.1:(\d+)", out).group(1))  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while _processes_mentioning(port) and time.monotonic() < deadline:
        time.sleep(0.1)  # a process may still be exiting after its last line
    assert _processes_mentioning(port) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hangup"])
def test_an_interrupted_demo_stops_everything_it_started(tmp_path: Path, sig: int) -> None:
    """Ctrl-C (SIGINT) or a closed terminal (SIGHUP) once the workers and beat are up:
    the demo exits 130 and no process it started is left (workers run in their own
    sessions, so only the demo's cleanup can stop them)."""
    env = {**os.environ, "CI": "true"}
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        demo = subprocess.Popen(
            [sys.executable, str(DEMO), "--png", str(tmp_path / "t.png")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 90
        while "the scenes begin" not in log.read_text() and time.monotonic() < deadline:
            assert demo.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        assert "the scenes begin" in log.read_text()
        demo.send_signal(sig)
        assert demo.wait(60) == 130, log.read_text()[-3000:]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
    out_text = log.read_text()
    assert "* every process the demo started is stopped" in out_text
    port = int(re.search(r"throwaway Redis: redis://127\.0\.0\.1:(\d+)", out_text).group(1))  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while _processes_mentioning(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(port) == []
