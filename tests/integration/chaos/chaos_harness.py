"""What every chaos scenario shares: servers, prefork workers, a task feeder, the checks.

A scenario starts a throwaway "infra" Redis (broker db 0, results db 1, fenced store
and run records db 2: never faulted), the lock servers it is about, and two
``celery -A tests.integration.chaos.chaosapp worker`` subprocesses with concurrency 2. A feeder
thread keeps a few read-modify-write tasks over a handful of keys in flight while the
scenario injects its faults; then the feeder stops once the system has made progress
after the last fault, the queue drains, and :func:`analyse` checks the invariants on
what the runs recorded and what the store logged:

* no two runs of one key overlapped while both held a valid lock;
* per key, fences strictly increase in the order runs started, and are unique;
* the store accepted write fences in strictly increasing order, counted every
  refusal, and its counter equals the number of accepted writes;
* no read or write was refused while its run's lock was valid throughout;

and the scenario itself checks that no lock is alive one TTL after the last run or
fault, that every worker answers a ping, and that no process or thread outlives it.

Times are ``time.monotonic()`` everywhere: on Linux that is one clock for every
process on the machine, so the workers' records and the test's fault log compare.
Every wait is a poll with a deadline; the only timed pauses are the chaos schedule
itself (how long a fault lasts, the gap between faults).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import random
import re
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery
from celery.result import AsyncResult
from celery.states import READY_STATES
from fenced_store import FencedStore, KeyState
from servers import FaultProxy, RedisServer, wait_for
from workers import Worker, stop_workers

from celery_redlock import Lock, connect

APP = "tests.integration.chaos.chaosapp"
#: ``make chaos`` sets CHAOS_LONG=1: longer chaos phases, more faults, more tasks.
LONG = os.environ.get("CHAOS_LONG", "") not in ("", "0")
#: Seed of this session; ``CHAOS_SEED`` replays one (timings still vary from run to run).
SEED = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**32))
#: Scenario figures, printed at the end of the session (see conftest.py).
FIGURES: list[Figures] = []
#: Threads the package keeps for the life of a process by design (the shared I/O pool).
LONG_LIVED_THREADS = ("celery-redlock-io",)


def chaos_seconds(short: float, long: float = 30.0) -> float:
    """How long the faults go on: *short* inside ``make test``, *long* under ``make chaos``."""
    return long if LONG else short


# --------------------------------------------------------------------------- processes


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """True while *pid* exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    """Pids whose parent is *pid* (read from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and len(stat) > 2 and stat[2] == str(pid):
                out.append(int(entry))
    return out


def last_message_gone(events: list[dict[str, Any]], task_ids: list[str]) -> set[str]:
    """Of *task_ids*, those with a message nobody received: fewer first deliveries
    (``received``, not redelivered) than messages published, the first one and one per
    ``retried`` (recorded from the signal that publishes the retry). Counts, not order: a
    retry's message may be received elsewhere before its ``retried`` record is written."""
    published: Counter[str] = Counter()
    delivered: Counter[str] = Counter()
    for e in events:
        if e["event"] == "retried":
            published[e["task_id"]] += 1
        elif e["event"] == "received" and not e.get("redelivered"):
            delivered[e["task_id"]] += 1
    return {t for t in task_ids if delivered[t] < 1 + published[t]}


class ChaosWorker:
    """A prefork ``celery worker`` (concurrency 2) of the chaos app, with the pids it had."""

    def __init__(self, env: dict[str, str], log_path: Path, concurrency: int = 2) -> None:
        self.worker = Worker(APP, env, log_path, concurrency=concurrency)
        self.hostname = ""
        self.pids: set[int] = {self.worker.proc.pid}
        self.killed = False

    @property
    def pid(self) -> int:
        """The main process."""
        return self.worker.proc.pid

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until it logs "ready."; learn its node name (for pings)."""
        self.worker.wait_ready(timeout)
        found = re.search(r"(\S+@\S+) ready\.", self.worker.text())
        assert found, self.worker.text()[-2000:]
        self.hostname = found.group(1)
        self.children()

    def children(self) -> list[int]:
        """Current pool children (remembered for the leak check)."""
        pids = children_of(self.pid)
        self.pids.update(pids)
        return pids

    def kill(self) -> list[int]:
        """SIGKILL the whole worker (main process and children); the pids it killed."""
        pids = [self.pid, *self.children()]
        self.killed = True
        self.worker.kill()
        return pids

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), SIGKILL if it lingers."""
        with contextlib.suppress(OSError):
            self.children()
        self.worker.stop()


# --------------------------------------------------------------------------- records


@dataclass
class Run:
    """One execution of a task body, from what it recorded."""

    run: str
    key: str
    task_id: str
    task: str
    pid: int
    fence: int
    start: float
    redelivered: bool
    #: (time, valid_until) of every moment the run saw its lock valid
    valid_at: list[tuple[float, float]] = field(default_factory=list)
    read: dict[str, Any] | None = None
    write: dict[str, Any] | None = None
    end: float | None = None
    outcome: str = ""
    lost_at_end: bool = False


def build_runs(events: Iterable[dict[str, Any]]) -> dict[str, Run]:
    """Runs by id, from the ``chaos:events`` records."""
    runs: dict[str, Run] = {}
    for e in events:
        kind = e["event"]
        if kind == "start":
            r = runs[e["run"]] = Run(
                e["run"], e["key"], e["task_id"], e["task"], e["pid"], int(e["fence"]),
                e["t"], bool(e.get("redelivered")),
            )  # fmt: skip
            if e["valid"]:
                r.valid_at.append((e["t"], e["vu"]))
            continue
        r2 = runs.get(e.get("run", ""))
        if r2 is None:
            continue
        if kind == "read":
            r2.read = e
            if e["valid"]:
                r2.valid_at.append((e["t"], e["vu"]))
        elif kind == "write":
            r2.write = e
            for side in (e["before"], e["after"]):
                if side["valid"]:
                    r2.valid_at.append((side["t"], side["vu"]))
        elif kind == "end":
            r2.end = e["t"]
            r2.outcome = e["outcome"]
            r2.lost_at_end = bool(e["lost"])
            if e["valid"]:
                r2.valid_at.append((e["t"], e["vu"]))
    return runs


def claimed_interval(run: Run, killed: dict[int, float]) -> tuple[float, float] | None:
    """When *run* held a valid lock by its own lock's account: from its start to the latest
    deadline it saw while valid, cut at its end (or at the SIGKILL of its process)."""
    if not run.valid_at:
        return None
    until = max(vu for _, vu in run.valid_at)
    stop = run.end if run.end is not None else killed.get(run.pid)
    if stop is not None:
        until = min(until, stop)
    return (run.start, until) if until > run.start else None


@dataclass
class Analysis:
    """What :func:`analyse` found."""

    runs: int = 0
    accepted_writes: int = 0
    refused_reads: int = 0
    refused_writes: int = 0
    violations: list[str] = field(default_factory=list)
    #: the runs each violation is about (empty for the store's own consistency)
    involved: list[tuple[Run, ...]] = field(default_factory=list)

    def add(self, text: str, *runs: Run) -> None:
        """Record one violation and the runs it involves."""
        self.violations.append(text)
        self.involved.append(runs)

    def excuse(self, explained: Callable[[tuple[Run, ...]], bool]) -> list[str]:
        """Drop the violations that *explained* accounts for (it sees their runs); the
        dropped ones, as text."""
        kept = [(v, r) for v, r in zip(self.violations, self.involved, strict=True)
                if not (r and explained(r))]  # fmt: skip
        dropped = [v for v in self.violations if v not in {k for k, _ in kept}]
        self.violations = [v for v, _ in kept]
        self.involved = [r for _, r in kept]
        return dropped


def analyse(
    events: list[dict[str, Any]], states: dict[str, KeyState], killed: dict[int, float]
) -> Analysis:
    """Check the invariants (module doc) on the run records and the store's state."""
    out = Analysis()
    runs = build_runs(events)
    out.runs = len(runs)
    by_key: dict[str, list[Run]] = defaultdict(list)
    for r in runs.values():
        by_key[r.key].append(r)
    bad = out.add

    for key, key_runs in sorted(by_key.items()):
        key_runs.sort(key=lambda r: r.start)
        fences = [r.fence for r in key_runs]
        dupes = {f for f in fences if fences.count(f) > 1}
        for f in sorted(dupes):
            bad(
                f"{key}: fence {f} handed to more than one run",
                *(r for r in key_runs if r.fence == f),
            )
        for a, b in itertools.pairwise(key_runs):
            if b.fence <= a.fence:
                bad(
                    f"{key}: run {b.run[:8]} (pid {b.pid}) started at {b.start:.3f} with fence "
                    f"{b.fence}, not above fence {a.fence} of run {a.run[:8]} (pid {a.pid}) "
                    f"started at {a.start:.3f}",
                    a,
                    b,
                )
        # overlap of validity: a sweep over intervals sorted by start
        held = [(iv, r) for r in key_runs if (iv := claimed_interval(r, killed)) is not None]
        held.sort(key=lambda x: x[0][0])
        latest: tuple[float, Run] | None = None
        for (start, until), r in held:
            if latest is not None and start < latest[0]:
                other = latest[1]
                bad(
                    f"{key}: run {r.run[:8]} (pid {r.pid}, fence {r.fence}) started at "
                    f"{start:.3f} while run {other.run[:8]} (pid {other.pid}, fence "
                    f"{other.fence}) still held a valid lock until {latest[0]:.3f}",
                    other,
                    r,
                )
            if latest is None or until > latest[0]:
                latest = (until, r)

    by_fence = {(r.key, r.fence): r for r in runs.values()}
    for key, state in sorted(states.items()):
        seen = written = 0
        accepted: list[int] = []
        refused = 0
        for op in state.log:
            expect = op.fence >= seen if op.kind == "r" else op.fence >= seen and op.fence > written
            if expect != op.accepted:
                bad(f"{key}: store log entry {op} disagrees with the fencing rule")
            if op.accepted:
                seen = max(seen, op.fence)
                if op.kind == "w":
                    written = op.fence
                    accepted.append(op.fence)
            else:
                refused += 1
                if op.kind == "r":
                    out.refused_reads += 1
                else:
                    out.refused_writes += 1
                r = by_fence.get((key, op.fence))
                if r is not None and _valid_throughout(r, op.kind):
                    higher = [o for o in by_key[key] if o.fence >= r.fence and o.start < r.start]
                    bad(
                        f"{key}: the store refused the {'read' if op.kind == 'r' else 'write'} "
                        f"of run {r.run[:8]} (pid {r.pid}, fence {op.fence}, started at "
                        f"{r.start:.3f}) while its lock was valid before and after it: someone "
                        "else had a higher fence"
                        + "".join(f", {o.fence} at {o.start:.3f}" for o in higher[-3:]),
                        r,
                        *higher,
                    )
        if any(b <= a for a, b in itertools.pairwise(accepted)):
            bad(f"{key}: accepted write fences not strictly increasing: {accepted}")
        if refused != state.rejected:
            bad(f"{key}: store counted {state.rejected} refusals, its log shows {refused}")
        if state.value != len(accepted):
            bad(
                f"{key}: counter is {state.value} after {len(accepted)} accepted writes "
                "(a lost update)"
            )
        out.accepted_writes += len(accepted)
    return out


def _valid_throughout(run: Run, kind: str) -> bool:
    if kind == "r":
        return bool(run.valid_at and run.valid_at[0][0] == run.start and run.read
                    and run.read["valid"])  # fmt: skip
    w = run.write
    return bool(w and w["before"]["valid"] and w["after"]["valid"])


# --------------------------------------------------------------------------- figures


@dataclass
class Figures:
    """What one scenario prints."""

    scenario: str
    seed: int
    seconds: float = 0.0
    tasks: int = 0
    runs: int = 0
    accepted: int = 0
    faults: int = 0
    refused_reads: int = 0
    refused_writes: int = 0
    longest_recovery: float | None = None
    lost_tasks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """One line for the session summary."""
        rec = "-" if self.longest_recovery is None else f"{self.longest_recovery:.2f}s"
        more = "".join(f" {k}={v}" for k, v in self.extra.items())
        return (
            f"{self.scenario}: runs={self.runs} accepted_writes={self.accepted} "
            f"faults={self.faults} refused(reads={self.refused_reads}, "
            f"writes={self.refused_writes}) longest_recovery={rec} tasks={self.tasks} "
            f"lost_tasks={self.lost_tasks}{more} time={self.seconds:.1f}s seed={self.seed}"
        )


@dataclass
class Fault:
    """One injected fault: when it began and when it was healed (the same for a kill)."""

    kind: str
    start: float
    end: float
    detail: str = ""


# --------------------------------------------------------------------------- scenario


class Scenario:
    """Servers, workers, feeder and checks of one chaos scenario (see the module doc)."""

    def __init__(
        self,
        name: str,
        tmp_path: Path,
        *,
        lock_url: str | list[str],
        check_urls: list[str] | None = None,
        ttl: float = 2.0,
        conf: dict[str, Any] | None = None,
        keys: int = 3,
        tasks: tuple[str, ...] = ("chaos.rmw", "chaos.rmw_warn"),
        work: tuple[float, float] = (0.1, 0.4),
        max_inflight: int = 6,
    ) -> None:
        self.name = name
        self.started = time.monotonic()
        self.rng = random.Random(f"{SEED}:{name}")
        self.tmp_path = tmp_path
        self.ttl = ttl
        self.keys = [f"k{i}" for i in range(keys)]
        self.task_names = tasks
        self.work = work
        self.max_inflight = max_inflight
        self.lock_url = lock_url
        #: URLs to ask, at the end, whether a lock is still alive (each master on its own)
        self.check_urls = check_urls or ([lock_url] if isinstance(lock_url, str) else lock_url)
        self.thread_baseline = {t.ident for t in threading.enumerate()}
        self.servers: list[RedisServer] = []
        self.proxies: list[FaultProxy] = []
        self.workers: list[ChaosWorker] = []
        self.faults: list[Fault] = []
        self.killed: dict[int, float] = {}
        self.stopped: set[int] = set()
        self.results: dict[str, AsyncResult] = {}
        self._ready: set[str] = set()
        self._events: list[dict[str, Any]] = []
        self._events_lock = threading.Lock()
        self._feeder: threading.Thread | None = None
        self._feeding = threading.Event()
        self._feed_error: BaseException | None = None
        self.figures = Figures(name, SEED)
        #: violations a scenario's documented limit accounts for, judged by their runs
        self.excuse: Callable[[tuple[Run, ...]], bool] | None = None
        #: seconds spent in each phase (printed with -s, to keep the suite inside its budget)
        self.phases: dict[str, float] = {}
        self.infra = self.add_server(RedisServer.start())
        base = f"redis://{self.infra.host}:{self.infra.port}"
        self.store_client = self.infra.client(db=2)
        self.store = FencedStore(self.store_client)
        options = {
            "visibility_timeout": 4,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 5,
        }
        merged = {"broker_transport_options": options, **(conf or {})}
        self.env = {
            "CHAOS_BROKER": f"{base}/0",
            "CHAOS_BACKEND": f"{base}/1",
            "CHAOS_STORE": f"{base}/2",
            "CHAOS_LOCKS": lock_url if isinstance(lock_url, str) else ",".join(lock_url),
            "CHAOS_TTL": str(ttl),
            "CHAOS_CONF": json.dumps(merged),
        }
        self.app = Celery("chaos-client", broker=self.env["CHAOS_BROKER"],
                          backend=self.env["CHAOS_BACKEND"])  # fmt: skip
        self.app.conf.broker_connection_retry_on_startup = True
        self.app.conf.broker_transport_options = options

    # ---- set-up

    def add_server(self, server: RedisServer) -> RedisServer:
        """Track a server: stopped and checked for leaks at the end."""
        self.servers.append(server)
        return server

    def add_proxy(self, proxy: FaultProxy) -> FaultProxy:
        """Track a proxy: stopped at the end."""
        self.proxies.append(proxy)
        return proxy

    def start_workers(self, n: int = 2) -> list[ChaosWorker]:
        """Start *n* workers at once and wait until each is ready."""
        new = [
            ChaosWorker(self.env, self.tmp_path / f"worker-{len(self.workers) + i}.log")
            for i in range(n)
        ]
        self.workers.extend(new)
        for w in new:
            w.wait_ready()
        return new

    def live_workers(self) -> list[ChaosWorker]:
        """Workers not killed by the scenario."""
        return [w for w in self.workers if not w.killed]

    # ---- tasks

    def submit(self) -> AsyncResult:
        """Send one task: a random key, task kind and amount of work."""
        name = self.rng.choice(self.task_names)
        key = self.rng.choice(self.keys)
        work = round(self.rng.uniform(*self.work), 3)
        result = self.app.send_task(name, args=(key, work))
        self.results[result.id] = result
        return result

    def events(self) -> list[dict[str, Any]]:
        """Every record so far (read incrementally)."""
        with self._events_lock:
            raw = self.store_client.lrange("chaos:events", len(self._events), -1)
            self._events.extend(json.loads(r) for r in raw)
            return list(self._events)

    def runs(self) -> dict[str, Run]:
        """Runs so far."""
        return build_runs(self.events())

    def lost_task_ids(self) -> set[str]:
        """Tasks that died with a SIGKILLed process: their run never ended there, or the
        killed worker was the last to receive them (acked early: nobody finishes them). A
        message the killed worker had only reserved comes back (visibility timeout) and is
        received again elsewhere, which takes it off this list."""
        events = self.events()
        last_received: dict[str, int] = {}
        for e in events:
            if e["event"] == "received":
                last_received[e["task_id"]] = e["pid"]
        lost = {t for t, pid in last_received.items() if pid in self.killed}
        runs = build_runs(events).values()
        lost.update(r.task_id for r in runs if r.end is None and r.pid in self.killed)
        return lost

    def unsettled(self) -> list[str]:
        """Sent tasks that have no final state yet and did not die with a killed process."""
        lost = self.lost_task_ids() if self.killed else set()
        out = []
        for task_id, result in list(self.results.items()):
            if task_id in self._ready or task_id in lost:
                continue
            if result.state in READY_STATES:
                self._ready.add(task_id)
            else:
                out.append(task_id)
        return out

    def open_runs(self, task: str | None = None, phase: str = "any") -> list[Run]:
        """Runs that started and have not ended, in live processes (not paused)."""
        out = []
        for r in self.runs().values():
            if r.end is not None or r.pid in self.killed or r.pid in self.stopped:
                continue
            if task is not None and r.task != task:
                continue
            if phase == "working" and not (r.read and r.read["accepted"] and r.write is None):
                continue
            if alive(r.pid):
                out.append(r)
        return out

    def start_feeding(self) -> None:
        """Keep up to ``max_inflight`` tasks in flight from a thread until stop_feeding()."""
        self._feeding.set()

        def feed() -> None:
            try:
                for _ in range(1_000_000):
                    if not self._feeding.is_set():
                        return
                    if len(self.unsettled()) < self.max_inflight:
                        self.submit()
                    else:
                        time.sleep(0.05)
            except BaseException as exc:  # surfaced by stop_feeding
                self._feed_error = exc

        self._feeder = threading.Thread(target=feed, name="chaos-feeder", daemon=True)
        self._feeder.start()

    def stop_feeding(self) -> None:
        """Stop the feeder thread (bounded join); re-raise what it failed with."""
        self._feeding.clear()
        if self._feeder is not None:
            self._feeder.join(30)
            assert not self._feeder.is_alive(), "feeder thread did not stop"
        if self._feed_error is not None:
            raise self._feed_error

    # ---- faults

    def fault(self, kind: str, start: float, end: float | None = None, detail: str = "") -> None:
        """Log one injected fault."""
        self.faults.append(Fault(kind, start, time.monotonic() if end is None else end, detail))

    def pause(self, seconds: float) -> None:
        """The chaos schedule's own pacing (a fault's length, the gap between faults)."""
        time.sleep(max(0.0, seconds))

    def kill_pid(self, pid: int, kind: str = "sigkill-child") -> None:
        """SIGKILL one process and log it."""
        now = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.killed.setdefault(pid, now)
        self.fault(kind, now, now, f"pid {pid}")

    def whole_worker_killed(self) -> bool:
        """True once a whole worker was SIGKILLed."""
        return any(w.killed for w in self.workers)

    def kill_worker(self, worker: ChaosWorker) -> None:
        """SIGKILL a whole worker (its process group) and log every pid it had. A child
        killed before and not reaped yet is still listed: its first kill time stands (its
        runs ended then, and the main process may have released their locks since)."""
        now = time.monotonic()
        for pid in worker.kill():
            self.killed.setdefault(pid, now)
        self.fault("sigkill-worker", now, now, f"pid {worker.pid}")

    def wait_for_progress_after_faults(self, timeout: float = 60.0) -> None:
        """Keep feeding until a write is accepted after the last fault was healed; fail at
        once if the runs so far already break an invariant (no point waiting then)."""
        last = max((f.end for f in self.faults), default=self.started)
        polls = 0

        def progressed() -> bool:
            nonlocal polls
            polls += 1
            if polls % 10 == 0:
                found = analyse(self.events(), {}, self.killed)
                if self.excuse is not None:
                    found.excuse(self.excuse)
                self.fail_on_violations(found)
            return any(
                r.write and r.write["accepted"] and r.write["after"]["t"] > last
                for r in self.runs().values()
            )

        wait_for(progressed, timeout, "an accepted write after the last fault", interval=0.1)

    def fail_on_violations(self, found: Analysis) -> None:
        """AssertionError listing the violations *found*, if any, with the seed."""
        assert not found.violations, (
            f"{self.name} (CHAOS_SEED={SEED}): {len(found.violations)} violation(s):\n"
            + "\n".join(found.violations[:30])
        )

    def run_chaos(self, seconds: float, inject: Callable[[Scenario], None]) -> None:
        """Feed tasks while calling *inject* until *seconds* have passed; then feed until the
        system made progress after the last fault, and stop feeding."""
        self.phases["setup"] = time.monotonic() - self.started
        self.start_feeding()
        try:
            wait_for(lambda: any(r.write for r in self.runs().values()), 60, "a first write")
            end = time.monotonic() + seconds
            for _ in range(10_000):
                if time.monotonic() >= end:
                    break
                inject(self)
            self.wait_for_progress_after_faults()
        finally:
            self.stop_feeding()
            self.phases["chaos"] = time.monotonic() - self.started - self.phases["setup"]

    # ---- end

    def drain(self, timeout: float = 90.0) -> None:
        """Until every task settled and the broker holds nothing: no queued or unacked
        message, so no redelivery or retry can start another run.

        A message a worker had popped from the queue but not yet written to its unacked
        set when the whole worker was SIGKILLed is gone (kombu's Redis transport moves it
        in two steps). With the broker empty, a task one of whose messages (the first, or
        a retry's) nobody received counts as vanished (a figure), not as unsettled.
        """
        broker = self.infra.client(db=0)
        vanished: set[str] = set()

        def state() -> dict[str, Any]:
            queued, unacked = broker.llen("celery"), broker.hlen("unacked")
            unsettled = self.unsettled()
            if unsettled and not queued and not unacked and self.whole_worker_killed():
                vanished.update(last_message_gone(self.events(), unsettled))
            return {
                "unsettled": {t: self.results[t].state for t in unsettled if t not in vanished},
                "queued": queued,
                "unacked": unacked,
                "open runs": [(r.task_id, r.pid) for r in self.open_runs()],
            }

        began = time.monotonic()
        try:
            wait_for(
                lambda: not any(state().values()), timeout, "the tasks to settle", interval=0.1
            )
            self.phases["drain"] = time.monotonic() - began
            if vanished:
                self.figures.extra["vanished_tasks"] = len(vanished)
        except AssertionError as exc:
            now = state()
            history = {
                t: [
                    (e["event"], e["pid"], round(e.get("t", 0), 3))
                    for e in self.events()
                    if e.get("task_id") == t
                    or e.get("run") in {r.run for r in self.runs().values() if r.task_id == t}
                ]
                for t in now["unsettled"]
            }
            killed = {p: round(t, 3) for p, t in self.killed.items()}
            raise AssertionError(
                f"{exc}: {now}; history of unsettled tasks: {history}; killed pids: {killed}; "
                f"worker pids: {[(w.pid, w.killed) for w in self.workers]}"
            ) from None
        finally:
            broker.close()

    def quiet_since(self) -> float:
        """The last moment anything happened: a run ended, a fault was healed, a kill."""
        runs = self.runs().values()
        ends = [r.end for r in runs if r.end is not None]
        return max([*ends, *(f.end for f in self.faults), self.started])

    def check_no_lock_alive(self) -> float:
        """No lock of any key is alive on any lock server one TTL after the system went
        quiet; returns how long after going quiet the check ran."""
        began = time.monotonic()
        deadline = self.quiet_since() + self.ttl * 1.01 + 0.25
        wait_for(lambda: time.monotonic() >= deadline, self.ttl + 5, "one TTL to pass")
        self.phases["ttl-check"] = time.monotonic() - began
        alive_locks = []
        for url in self.check_urls:
            client = connect(url)
            try:
                for key in self.keys:
                    if Lock(client, f"chaos:{key}", auto_renew=False).locked():
                        alive_locks.append((url, key))
            finally:
                client.close()
        assert not alive_locks, f"locks still alive one TTL after the chaos: {alive_locks}"
        return time.monotonic() - self.quiet_since()

    def check_pings(self, timeout: float = 30.0) -> None:
        """Every live worker answers a ping."""
        names = {w.hostname for w in self.live_workers()}
        answered: set[str] = set()

        def all_answer() -> bool:
            replies = self.app.control.ping(destination=sorted(names - answered), timeout=1.0)
            for reply in replies or []:
                answered.update(reply)
            return answered >= names

        wait_for(all_answer, timeout, f"pings from {sorted(names)}", interval=0.2)

    def verify(self) -> Analysis:
        """Run the invariant checks on the records and the store; AssertionError lists
        every violation found, but those ``self.excuse`` accounts for by the runs involved
        (a documented limit; counted in the figures as ``excused``)."""
        states = {key: self.store.state(key) for key in self.keys}
        found = analyse(self.events(), states, self.killed)
        if self.excuse is not None:
            excused = found.excuse(self.excuse)
            self.figures.extra["excused"] = len(excused)
            if excused:
                print(f"\n{self.name}: excused (documented limit):\n  " + "\n  ".join(excused))
        f = self.figures
        f.tasks = len(self.results)
        f.runs = found.runs
        f.accepted = found.accepted_writes
        f.refused_reads = found.refused_reads
        f.refused_writes = found.refused_writes
        f.faults = len(self.faults)
        f.lost_tasks = len(self.lost_task_ids() - self._ready)
        f.longest_recovery = self.longest_recovery()
        runs = self.runs().values()
        f.extra["runs_that_lost_their_lock"] = sum(
            1 for r in runs if r.outcome == "LockLost" or (r.end is not None and r.lost_at_end)
        )
        f.extra["false_loss_reports"] = len(self.false_loss_reports())
        f.extra["unavailable_log_lines"] = sum(
            w.worker.text().count("unavailable") for w in self.workers
        )
        self.fail_on_violations(found)
        return found

    def false_loss_reports(self, margin: float = 0.5) -> list[str]:
        """``lost`` events for acquisitions that were not lost: the run's last record (just
        before its release) shows the lock valid with *margin* seconds of lease left."""
        runs = {(f"chaos:{r.key}", r.fence): r for r in self.runs().values()}
        out = []
        for e in self.events():
            if e["event"] != "lock-lost":
                continue
            r = runs.get((e["name"], e["fence"]))
            if r is None or r.end is None or not r.valid_at or r.valid_at[-1][0] != r.end:
                continue
            if r.valid_at[-1][1] - r.end > margin:
                out.append(
                    f"{e['name']} fence {e['fence']} (pid {e['pid']}) reported lost "
                    f"({e['error']}) after {e['held']:.3f}s; its run ended at {r.end:.3f} "
                    f"with the lease valid until {r.valid_at[-1][1]:.3f}"
                )
        return out

    def longest_recovery(self) -> float | None:
        """The longest time from a fault's end to the next accepted write."""
        writes = sorted(
            r.write["after"]["t"] for r in self.runs().values() if r.write and r.write["accepted"]
        )
        longest: float | None = None
        for fault in self.faults:
            after = [t for t in writes if t > fault.end]
            if not after:
                continue
            took = after[0] - fault.end
            longest = took if longest is None else max(longest, took)
        return longest

    def finish(self) -> Figures:
        """Ping, stop every worker, server and proxy, check nothing leaked, print figures."""
        began = time.monotonic()
        self.check_pings()
        self.shutdown()
        self.phases["finish"] = time.monotonic() - began
        self.check_no_leaks()
        self.figures.seconds = time.monotonic() - self.started
        FIGURES.append(self.figures)
        phases = " ".join(f"{k}={v:.1f}s" for k, v in self.phases.items())
        print(f"\nCHAOS {self.figures.line()}\n      phases: {phases}")
        return self.figures

    def shutdown(self) -> None:
        """Stop everything (idempotent; also the fixture's clean-up after a failure)."""
        self._feeding.clear()
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for w in self.workers:  # the pool children, remembered for the leak check
            with contextlib.suppress(OSError):
                w.children()
        stop_workers(w.worker for w in self.workers)
        for proxy in self.proxies:
            proxy.stop()
        with contextlib.suppress(Exception):
            self.store_client.close()
        # An AsyncResult unsubscribes from its result channel when it is freed: free them
        # while the backend still runs (after, each one retries its reconnect for seconds).
        self.results.clear()
        gc.collect()
        self.app.close()
        for server in self.servers:
            server.stop()

    def check_no_leaks(self) -> None:
        """No worker or pool process, server process or test thread outlives the scenario."""
        pids = {p for w in self.workers for p in w.pids} | {r.pid for r in self.runs_cached()}
        wait_for(lambda: not [p for p in pids if alive(p)], 20, "worker processes to exit")
        assert not [s for s in self.servers if s.alive()], "a server still runs"

        def extra_threads() -> list[str]:
            return [
                t.name
                for t in threading.enumerate()
                if t.ident not in self.thread_baseline and not t.name.startswith(LONG_LIVED_THREADS)
            ]

        with contextlib.suppress(AssertionError):
            wait_for(lambda: not extra_threads(), 10, "threads to end")
        assert not extra_threads(), f"threads left behind: {extra_threads()}"

    def runs_cached(self) -> list[Run]:
        """Runs from the records already read (the store may be stopped by now)."""
        with self._events_lock:
            return list(build_runs(self._events).values())


@contextlib.contextmanager
def scenario(name: str, tmp_path: Path, **kwargs: Any) -> Iterator[Scenario]:
    """A :class:`Scenario` that is shut down whatever happens."""
    sc = Scenario(name, tmp_path, **kwargs)
    try:
        yield sc
    finally:
        sc.shutdown()


def new_id() -> str:
    """A short random id."""
    return uuid.uuid4().hex[:8]
