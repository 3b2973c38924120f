"""Task throughput on a real prefork worker: plain vs LockedTask vs celery-once vs celery-singleton.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_tasks.py [--tasks 2000] [--reps 3] [--warmup 200]
                                          [--pin none|split|same]
    .venv/bin/python bench/bench_tasks.py --profile locked   # cProfile of the pool children

It starts its own throwaway redis-server on a free loopback port (no persistence)
and stops it by pid at the end, also on error or Ctrl-C. ``--pin split`` puts the
server on the last CPU and the worker (its children inherit it) and this process on the
first; the default, ``none``, leaves placement to the OS, as the worker is judged
(a prefork worker with two children on one CPU measures something else). Broker, locks and the
counter live on that one server (db 0, 1 and 3); no result backend (every task
has ``ignore_result=True``).

One *run* = one variant, one fresh worker::

    celery -A bench.taskapp worker -P prefork -c 2 -l warning --without-heartbeat
           --without-gossip --without-mingle -Q <queue of this run>

with ``worker_prefetch_multiplier=16``. Each run has its own queue and its own
task arguments (lock keys), so nothing leaks from one run into the next: every task
locks a name never used before (``k:<i>``, a counter across runs), and ``LockedTask``
builds its ``Lock`` per run, as users' tasks do (per-argument keys whose fence counters
have long expired); the floor and the peers key on the argument too. The
worker is warmed up with ``--warmup`` tasks (connections made, scripts loaded,
both children busy), then the clock starts at the first of ``--tasks`` publishes
(as fast as one client publishes them, ``apply_async`` on the task object, so
celery-once and celery-singleton take their publish-side lock there) and stops
when the counter that every task INCRs reaches ``--tasks``. With ``--publish before``
the ``--tasks`` tasks are all queued first (on a second queue the worker stops consuming
after the warm-up), the worker is then told to consume it again, and the clock runs
from the first body (which stamps the time) to the last: that times the worker
draining a full queue, with no publisher on the CPUs (in production the publishers
are usually other machines); celery-once's and celery-singleton's publish-side
locking is then outside the clock. ``--publish before`` is the default: the budgets of
issue 29 are set on a worker draining a full queue. Variants are
interleaved ``--reps`` times, each rep starting one variant later than the one
before (plain, locked, ..., rt2, then locked, once, ..., rt2, plain, ...), so no
variant always runs first; ``--order fixed`` keeps one order. Four are
references, not libraries. ``floor`` is the floor of issue 29, a lock written by hand:
a plain task whose body is preceded by ``SET floor:k:<i> <token> NX PX 30000`` and
followed by an owner-checked delete (EVALSHA of the textbook compare-and-delete,
SCRIPT LOAD once per process), on a module-level redis-py client of the lock server
(this variant was "plain + LockedTask's two Lua scripts" before issue 29; that one is
now ``lua``). ``lua`` is a plain task that calls LockedTask's two Lua scripts directly
(the same Redis round trips without any celery-redlock Python), ``core`` takes and
releases a core ``Lock`` around its body (LockedTask without the Celery adapter), and
``rt2`` makes two bare round trips (a PING on a raw socket) around its body: no lock
held while a task runs can cost less.

The summary ends with the budgets of issue 29, each against rows of the same run:
LockedTask at least 0.95x plain's tasks/s (the floor's ratio to plain beside it), and
LockedTask's CPU per task in the pool children (main thread and threads, the worker's
main process and the publisher apart) at most 1.3x the floor's.

After each run it checks that the queue is empty, that every lock of the run was
released and that exactly ``--tasks`` bodies ran, and it records the Redis
commands per task (INFO commandstats) and the CPU each process used (/proc), plus
the CPU other processes on the machine used meanwhile: the machine may be shared,
so it waits (bounded) for a quiet moment before each run and runs a slot again
(up to ``--retries`` times, within ``--budget`` seconds) when others used more than
``--max-outside`` % of the CPUs during it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import platform
import pstats
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent
APP_MODULE = "bench.taskapp"
VARIANTS = ("plain", "locked", "once", "singleton", "floor", "lua", "core", "rt2")
LABELS = {
    "plain": "plain `@app.task`",
    "locked": 'celery-redlock `LockedTask` (`lock_key="k:<i>"`)',
    "once": 'celery-once `QueueOnce` (`keys=["i"]`)',
    "singleton": "celery-singleton `Singleton`",
    "floor": "floor: plain + `SET NX PX` before the body, owner-checked delete after it",
    "lua": "reference: plain + LockedTask's two Lua scripts, no adapter code",
    "core": "reference: plain + the core `Lock` (acquire/release), no adapter code",
    "rt2": "reference: plain + two bare round trips (raw-socket PING), no lock at all",
}
#: Lock keys each variant leaves while a task is queued or running (fence counters
#: and wake-up lists of LockedTask are not locks and are not counted).
LOCK_PATTERNS = {
    "plain": None,
    "locked": "redlock:{k:*}",
    "once": "qo_bench.once_*",
    "singleton": "SINGLETONLOCK_*",
    "floor": "floor:k:*",
    "lua": "lua:{k:*}",
    "core": "redlock:{c:*}",
    "rt2": None,
}
#: Every key a variant's lock library writes (locks, fence counters, wake-up lists).
KEY_PATTERNS = {
    "plain": None,
    "locked": "redlock:*",
    "once": "qo_*",
    "singleton": "SINGLETONLOCK_*",
    "floor": "floor:*",
    "lua": "lua:*",
    "core": "redlock:{c:*",
    "rt2": None,
}
#: Commands the benchmark itself sends while timing (polling, stats).
OWN_COMMANDS = {"get", "info", "config|resetstat", "config", "ping"}


# -- the throwaway redis-server --------------------------------------------------------------
@dataclass
class Server:
    port: int
    proc: subprocess.Popen[bytes]
    tmp: str

    def url(self, db: int) -> str:
        return f"redis://{HOST}:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, db=db)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


#: Where the redis-server and the worker run (``--pin``): CPU sets, or None (the OS).
PLACEMENT: dict[str, set[int] | None] = {"server": None, "client": None}


def _place(pid: int, part: str) -> None:
    cpus = PLACEMENT[part]
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cpus)


def start_server() -> Server:
    """redis-server on a free loopback port, up and answering PING (bounded), or raise."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    for _ in range(5):
        port = free_port()
        tmp = tempfile.mkdtemp(prefix=f"bench-tasks-{port}-")
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", tmp, "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        server = Server(port, proc, tmp)
        _place(proc.pid, "server")
        client = server.client()
        try:
            for _ in range(250):  # <= 5 s
                if proc.poll() is not None:
                    break
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        return server
                time.sleep(0.02)
        finally:
            client.close()
        server.stop()  # port taken or too slow: try another port
    raise SystemExit("could not start redis-server")


# -- one worker subprocess -------------------------------------------------------------------
class Worker:
    """``celery -A bench.taskapp worker`` in its own session, stopped by pid."""

    def __init__(self, env: dict[str, str], queue: str, name: str, log_path: Path) -> None:
        self.hostname = f"{name}@{socket.gethostname()}"  # what -n name@%h expands to
        argv = [
            sys.executable, "-m", "celery", "-A", APP_MODULE, "worker", "-P", "prefork",
            "-c", "2", "-l", "warning", "--without-heartbeat", "--without-gossip",
            "--without-mingle", "-Q", queue, "-n", f"{name}@%h",
        ]  # fmt: skip
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _place(self.proc.pid, "client")  # before it forks its pool: the children inherit it

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL its process group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)
        self.log.close()


# -- CPU accounting from /proc ----------------------------------------------------------------
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PARTS = ("publisher", "redis-server", "worker main", "children: main thread", "children: threads")


def system_busy() -> float:
    """CPU seconds all processes on this machine have used since boot (from /proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICK


def wait_quiet(max_pct: float, timeout: float) -> float:
    """Wait (bounded) until the machine's other processes use < *max_pct* % of the CPUs.

    Called between runs, when nothing of this benchmark is busy, so the whole
    machine's load is someone else's. Returns that load (%) at the last look.
    """
    deadline = time.monotonic() + timeout
    cores = os.cpu_count() or 1
    load = 100.0
    while True:
        before, t0 = system_busy(), time.monotonic()
        time.sleep(0.5)
        load = 100 * (system_busy() - before) / ((time.monotonic() - t0) * cores)
        if load < max_pct or time.monotonic() >= deadline:
            return load


def _thread_usage(pid: int, tid: int) -> tuple[float, int]:
    """(CPU seconds, voluntary context switches) of one thread; zeros if it is gone."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        stat = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"{base}/status").read_text()
    except OSError:
        return 0.0, 0
    cpu = (int(stat[11]) + int(stat[12])) / TICK  # utime + stime
    found = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)
    switches = int(found.group(1)) if found else 0
    return cpu, switches


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def usage(worker_pid: int, server_pid: int) -> dict[str, list[float]]:
    """CPU seconds and voluntary switches per part of the system, right now."""
    out: dict[str, list[float]] = {p: [0.0, 0.0, 0.0] for p in PARTS}  # cpu, switches, threads
    out["machine"] = [system_busy(), 0.0, 0.0]

    def add(part: str, pid: int, tids: list[int]) -> None:
        for tid in tids:
            cpu, sw = _thread_usage(pid, tid)
            out[part][0] += cpu
            out[part][1] += sw
            out[part][2] += 1

    add("publisher", os.getpid(), _threads(os.getpid()))
    add("redis-server", server_pid, _threads(server_pid))
    add("worker main", worker_pid, _threads(worker_pid))
    for child in _children(worker_pid):
        tids = _threads(child)
        add("children: main thread", child, [t for t in tids if t == child])
        add("children: threads", child, [t for t in tids if t != child])
    return out


def usage_delta(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, Any]:
    delta: dict[str, Any] = {
        p: (after[p][0] - before[p][0], after[p][1] - before[p][1], int(after[p][2])) for p in PARTS
    }
    ours = sum(delta[p][0] for p in PARTS)
    delta["outside"] = (max(0.0, after["machine"][0] - before["machine"][0] - ours), 0, 0)
    return delta


# -- one measured run ------------------------------------------------------------------------
@dataclass
class Run:
    variant: str
    rep: int
    seconds: float
    publish_seconds: float
    tasks: int
    commands: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, Any] = field(default_factory=dict)
    #: keys the run left in the lock db, per task (LockedTask: fence counters and
    #: wake-up lists; the locks themselves are checked to be gone)
    keys_left: float = 0.0
    #: earlier attempts at this slot discarded because other processes were busy
    discarded: int = 0
    #: task completions the clock spans (``--publish before`` starts it at the first
    #: body, so it spans one fewer than ran); 0: all of ``tasks``
    timed: int = 0
    #: server microseconds per call of each command (INFO commandstats usec_per_call)
    usec: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return (self.timed or self.tasks) / self.seconds

    @property
    def cpu_per_task(self) -> float:
        """CPU microseconds per task used by all of this benchmark's processes."""
        return 1e6 * sum(self.cpu[p][0] for p in PARTS) / self.tasks

    @property
    def outside(self) -> float:
        """CPU used by processes outside this benchmark during the run, in % of all cores."""
        return 100 * self.cpu["outside"][0] / (self.seconds * (os.cpu_count() or 1))


def _control(control: Any, command: str, queue: str, worker: Worker) -> None:
    """Tell *worker* to cancel_consumer/add_consumer *queue*, and wait for its answer."""
    replies = getattr(control, command)(
        queue, destination=[worker.hostname], reply=True, timeout=10.0
    )
    if not replies or "ok" not in next(iter(replies[0].values())):
        raise RuntimeError(f"{command}({queue!r}) on {worker.hostname}: answer {replies!r}")


def ratio_interval(
    num: list[float], den: list[float], rounds: int = 4000, seed: int = 1
) -> tuple[float, float]:
    """A 90% bootstrap interval for median(num) / median(den): each round redraws both
    samples with replacement. It says how far this run's ratio could move on another
    run of the same machine; a fixed seed makes the same runs print the same interval."""
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(num, k=len(num)))
        / statistics.median(rng.choices(den, k=len(den)))
        for _ in range(rounds)
    )
    return ratios[int(0.05 * rounds)], ratios[int(0.95 * rounds) - 1]


def wait_count(counter: redis.Redis, target: int, worker: Worker, timeout: float) -> float:
    """Poll ``done`` until it reaches *target* (bounded); returns the perf_counter at that point.

    The poll is itself a Redis round trip and CPU taken from the processes being timed, so
    it sleeps for about half the time the tasks still left should take at the rate seen
    so far (1 ms to 50 ms): a few dozen polls per run instead of one every 2 ms, and the
    end is still seen within about 1 ms of the last task.
    """
    began = time.perf_counter()
    deadline = time.monotonic() + timeout
    polls = 0
    while time.monotonic() < deadline:
        value = counter.get("done")
        now = time.perf_counter()
        done = 0 if value is None else int(value)
        if done >= target:
            return now
        polls += 1
        if polls % 64 == 0 and not worker.alive():
            raise RuntimeError(f"worker exited early:\n{worker.tail()}")
        left = (target - done) * (now - began) / done if done else 0.05
        time.sleep(min(0.05, max(0.001, left / 2)))
    got = counter.get("done")
    raise RuntimeError(f"only {got!r} of {target} tasks ran within {timeout}s:\n{worker.tail()}")


def wait_locks_gone(locks: redis.Redis, pattern: str | None, timeout: float = 5.0) -> int:
    """Lock keys of this variant still present after the run (bounded wait for the last release)."""
    if pattern is None:
        return 0
    deadline = time.monotonic() + timeout
    left = 0
    while time.monotonic() < deadline:
        left = sum(1 for _ in locks.scan_iter(match=pattern, count=1000))
        if left == 0:
            return 0
        time.sleep(0.05)
    return left


def count_keys(client: redis.Redis, pattern: str | None) -> int:
    if pattern is None:
        return 0
    return sum(1 for _ in client.scan_iter(match=pattern, count=1000))


def command_stats(client: redis.Redis) -> dict[str, int]:
    info: dict[str, Any] = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def command_usec(client: redis.Redis) -> dict[str, float]:
    info: dict[str, Any] = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): float(v["usec_per_call"]) for k, v in info.items()}


def run_variant(
    server: Server,
    tasks_by_variant: dict[str, Any],
    variant: str,
    rep: int,
    index: int,
    n_tasks: int,
    warmup: int,
    workdir: Path,
    profile_dir: Path | None = None,
    publish_first: bool = False,
) -> Run:
    """Start a fresh worker for *variant*, warm it up, time *n_tasks*, stop it.

    *publish_first* (``--publish before``): the timed tasks go to a second queue that the
    worker stops consuming after the warm-up; they are all published, then the worker is
    told to consume that queue again. The clock runs from the first body (its ``first``
    stamp, see taskapp.bump) to the last, so the control command's own round trip and
    the consumer's start are not timed: what is timed is the worker draining a full
    queue, with no publisher competing for the CPUs.
    """
    task = tasks_by_variant[variant]
    warm_queue = f"bench.{variant}.{rep}.{index}"
    timed_queue = f"{warm_queue}.timed" if publish_first else warm_queue
    queue = f"{warm_queue},{timed_queue}" if publish_first else warm_queue
    counter = server.client(3)
    broker = server.client(0)
    locks = server.client(1)
    stats = server.client(0)
    counter.delete("done")
    env = {"BENCH_VARIANT": variant}
    if profile_dir is not None:
        env["BENCH_PROFILE"] = str(profile_dir)
        env["BENCH_PROFILE_CLOCK"] = os.environ.get("BENCH_PROFILE_CLOCK", "cpu")
    worker = Worker(env, queue, f"bench-{variant}-{index}", workdir / f"{warm_queue}.log")
    control = task.app.control
    base = (index + 1) * 1_000_000  # distinct task arguments (lock keys) in every run
    try:
        for j in range(warmup):
            task.apply_async((base + n_tasks + j,), queue=warm_queue)
        wait_count(counter, warmup, worker, timeout=90)  # also proves the worker is up
        if publish_first:
            # The worker declared the timed queue at start; now it stops consuming it.
            _control(control, "cancel_consumer", timed_queue, worker)
        time.sleep(0.3)  # let the last warm-up acks and releases settle
        counter.delete("done", "first")
        keys_before = count_keys(locks, KEY_PATTERNS[variant])
        stats.config_resetstat()
        if publish_first:
            for i in range(n_tasks):
                task.apply_async((base + i,), queue=timed_queue)
            if counter.get("done"):
                raise RuntimeError(f"{variant}: tasks ran before the timed queue was reopened")
            before = usage(worker.proc.pid, server.proc.pid)
            _control(control, "add_consumer", timed_queue, worker)  # the clock: see below
        else:
            before = usage(worker.proc.pid, server.proc.pid)
            start = time.perf_counter()
            for i in range(n_tasks):
                task.apply_async((base + i,), queue=timed_queue)
            published = time.perf_counter()
        end = wait_count(counter, n_tasks, worker, timeout=120)
        cpu = usage_delta(before, usage(worker.proc.pid, server.proc.pid))
        timed = 0
        if publish_first:
            # From the first body's wall-clock stamp to the end, seen on this perf_counter.
            stamp = counter.get("first")
            if stamp is None:
                raise RuntimeError(f"{variant}: no body stamped 'first' (see taskapp.bump)")
            start = published = time.perf_counter() - (time.time() - float(stamp))
            timed = n_tasks - 1

        calls = command_stats(stats)
        usec = command_usec(stats)
        left_in_queue = int(broker.llen(timed_queue))
        if left_in_queue:
            raise RuntimeError(f"{left_in_queue} messages left in {timed_queue} after the run")
        left_locks = wait_locks_gone(locks, LOCK_PATTERNS[variant])
        if left_locks:
            raise RuntimeError(f"{variant}: {left_locks} lock keys still held after the run")
        keys_left = (count_keys(locks, KEY_PATTERNS[variant]) - keys_before) / n_tasks
        done = int(counter.get("done") or 0)
        if done != n_tasks:
            raise RuntimeError(f"{variant}: counter says {done} runs, expected {n_tasks}")
    finally:
        worker.stop()
        for c in (counter, broker, locks, stats):
            c.close()
    per_task = {
        k: v / n_tasks for k, v in calls.items() if k not in OWN_COMMANDS and v >= n_tasks / 100
    }
    return Run(
        variant, rep, end - start, published - start, n_tasks, per_task, cpu, keys_left,
        timed=timed, usec={k: usec[k] for k in per_task if k in usec},
    )  # fmt: skip


# -- reporting ---------------------------------------------------------------------------------
def machine_facts() -> list[tuple[str, str]]:
    import celery  # noqa: PLC0415
    import kombu  # noqa: PLC0415

    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    server = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout.split()
    version = next((p.split("=", 1)[1] for p in server if p.startswith("v=")), "?")
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "celery_redlock"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split("\n")
    changed = [line[3:] for line in dirty if line.strip()]
    return [
        ("celery-redlock", head + (f" + uncommitted {', '.join(changed)}" if changed else "")),
        ("nproc", str(os.cpu_count())),
        ("cpu", cpu),
        ("os", f"{platform.system()} {platform.release()}"),
        ("python", platform.python_version()),
        ("redis-server", version),
        ("celery", celery.__version__),
        ("kombu", kombu.__version__),
        ("redis-py", redis.__version__),
        ("celery-once", _version("celery_once")),
        ("celery-singleton", _version("celery-singleton")),
    ]


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def summarize(runs: list[Run], variants: list[str]) -> str:
    lines = [
        "| variant | median tasks/s | spread (min-max) | runs | vs plain | publishing, median s "
        "| CPU per task, median µs | plain's CPU / this CPU "
        "| other processes, median % CPU | runs redone | keys left per task |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    medians = {v: statistics.median(r.rate for r in runs if r.variant == v) for v in variants}
    cpu = {v: statistics.median(r.cpu_per_task for r in runs if r.variant == v) for v in variants}
    for v in variants:
        mine = [r for r in runs if r.variant == v]
        rates = [r.rate for r in mine]
        pub = statistics.median(r.publish_seconds for r in mine)
        ratio = f"{medians[v] / medians['plain']:.2f}x" if "plain" in medians else "-"
        each = ", ".join(f"{x:.0f}" for x in rates)
        outside = statistics.median(r.outside for r in mine)
        keys = statistics.median(r.keys_left for r in mine)
        lines.append(
            f"| {LABELS[v]} | {medians[v]:.0f} | {min(rates):.0f}-{max(rates):.0f} | {each} | "
            f"{ratio} | {pub:.2f} | {cpu[v]:.0f} | "
            f"{cpu['plain'] / cpu[v] if 'plain' in cpu else 0:.2f} | "
            f"{outside:.0f} | {sum(r.discarded for r in mine)} | "
            f"{keys:.2f} |"
        )
    return "\n".join(lines)


def commands_table(runs: list[Run], variants: list[str]) -> str:
    lines = [
        "Redis commands per task (median; broker + locks, scripts' inner calls included), and "
        "the server's time per script call (EVALSHA usec_per_call, median):"
    ]
    for v in variants:
        mine = [r.commands for r in runs if r.variant == v]
        names = sorted({k for c in mine for k in c})
        med = {k: statistics.median(c.get(k, 0.0) for c in mine) for k in names}
        shown = ", ".join(f"{k}={x:.2f}" for k, x in sorted(med.items(), key=lambda kv: -kv[1]))
        scripts = [r.usec["evalsha"] for r in runs if r.variant == v and "evalsha" in r.usec]
        per_script = f"; EVALSHA {statistics.median(scripts):.1f} µs" if scripts else ""
        lines.append(f"  {v:<10} total={sum(med.values()):.2f}{per_script}: {shown}")
    return "\n".join(lines)


def cpu_table(runs: list[Run], variants: list[str]) -> str:
    lines = [
        "CPU per task in microseconds (median over runs), and voluntary context switches per task:",
        f"  {'variant':<10} " + " ".join(f"{p:>22}" for p in PARTS) + f" {'total':>8}",
    ]
    for v in variants:
        mine = [r for r in runs if r.variant == v]
        cells = []
        total = 0.0
        for p in PARTS:
            us = statistics.median(r.cpu[p][0] / r.tasks * 1e6 for r in mine)
            sw = statistics.median(r.cpu[p][1] / r.tasks for r in mine)
            total += us
            cells.append(f"{us:7.0f} us {sw:5.2f} sw")
        lines.append(f"  {v:<10} " + " ".join(f"{c:>22}" for c in cells) + f" {total:6.0f} us")
    return "\n".join(lines)


#: Issue 29: LockedTask's tasks/s against plain's, and its pool children's CPU per task
#: against the floor's.
RATE_BUDGET = 0.95
CHILD_CPU_BUDGET = 1.3


def child_cpu(runs: list[Run], variant: str) -> float:
    """Median over *variant*'s runs of the CPU per task in the pool children (main thread
    and threads), in microseconds: the worker's main process and the publisher apart."""
    return statistics.median(
        1e6 * (r.cpu["children: main thread"][0] + r.cpu["children: threads"][0]) / r.tasks
        for r in runs
        if r.variant == variant
    )


def child_cpu_table(runs: list[Run], variants: list[str]) -> str:
    lines = [
        "CPU per task in the pool children (main thread + threads; the worker's main process "
        "and the publisher apart), median over runs:"
    ]
    floor = child_cpu(runs, "floor") if "floor" in variants else None
    for v in variants:
        mine = child_cpu(runs, v)
        vs = f"  {mine / floor:.2f}x the floor's" if floor else ""
        lines.append(f"  {v:<10} {mine:7.0f} us{vs}")
    return "\n".join(lines)


def rate_ratios(runs: list[Run], variants: list[str]) -> list[str]:
    """LockedTask / plain tasks/s, with a bootstrap interval and rep by rep."""
    if "plain" not in variants or "locked" not in variants:
        return []
    plain_rates = [r.rate for r in runs if r.variant == "plain"]
    locked_rates = [r.rate for r in runs if r.variant == "locked"]
    plain = statistics.median(plain_rates)
    locked = statistics.median(locked_rates)
    low, high = ratio_interval(locked_rates, plain_rates)
    # The same, rep by rep: each LockedTask slot against the plain slot of its rep
    # (run minutes apart at most), which the machine's drift between reps moves less.
    by_rep = {(r.variant, r.rep): r.rate for r in runs}
    paired = [
        by_rep[("locked", rep)] / by_rep[("plain", rep)]
        for rep in sorted({r.rep for r in runs})
        if ("locked", rep) in by_rep and ("plain", rep) in by_rep
    ]
    return [
        f"LockedTask / plain = {locked / plain:.3f} (issue 29: >= {RATE_BUDGET}); "
        f"90% bootstrap interval {low:.3f}-{high:.3f}",
        "rep by rep: "
        + ", ".join(f"{x:.3f}" for x in paired)
        + f"; median {statistics.median(paired):.3f}, "
        + f"{sum(x >= RATE_BUDGET for x in paired)} of {len(paired)} at {RATE_BUDGET} or more",
    ]


def budgets(runs: list[Run], variants: list[str], publish: str) -> list[str]:
    """The budgets of issue 29, met or MISSED, against rows of this run."""

    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    def median_rate(v: str) -> float:
        return statistics.median(r.rate for r in runs if r.variant == v)

    have = set(variants)
    lines = ["Budgets (issue 29):", ""]
    if publish != "before":
        lines += [
            "(measured with --publish during; the budgets are set on a worker draining a "
            "full queue: --publish before)",
            "",
        ]
    if {"plain", "locked"} <= have:
        ratio = median_rate("locked") / median_rate("plain")
        floor = (
            f"; the floor / plain = {median_rate('floor') / median_rate('plain'):.3f}x"
            if "floor" in have
            else ""
        )
        lines.append(
            f"- LockedTask tasks/s >= {RATE_BUDGET}x plain: {ratio:.3f}x "
            f"({median_rate('locked'):.0f} / {median_rate('plain'):.0f} tasks/s), "
            f"{mark(ratio >= RATE_BUDGET)}{floor}"
        )
    else:
        lines.append("- LockedTask tasks/s vs plain: not measured (needs plain,locked)")
    if {"plain", "floor", "locked"} <= have:
        plain, floor, locked = (child_cpu(runs, v) for v in ("plain", "floor", "locked"))
        ratio = locked / floor
        lines.append(
            f"- LockedTask child CPU per task <= {CHILD_CPU_BUDGET}x the floor's: "
            f"{ratio:.2f}x ({locked:.0f} us / {floor:.0f} us; plain {plain:.0f} us), "
            f"{mark(ratio <= CHILD_CPU_BUDGET)}"
        )
    else:
        lines.append(
            "- LockedTask child CPU vs the floor's: not measured (needs plain,floor,locked)"
        )
    return lines


def print_profile(profile_dir: Path, limit: int = 35) -> None:
    files = sorted(profile_dir.glob("child-*.prof"))
    if not files:
        print("no child profiles were written (did the children exit warmly?)")
        return
    stats = pstats.Stats(*(str(f) for f in files))
    stats.sort_stats("tottime").print_stats(limit)
    stats.sort_stats("cumulative").print_stats(limit)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--order",
        choices=("rotate", "fixed"),
        default="rotate",
        help="rotate: each rep starts one variant later; fixed: every rep in --variants order "
        "(as before the fourth round)",
    )
    parser.add_argument(
        "--max-outside",
        type=float,
        default=15.0,
        help="a run during which other processes used more than this %% of the CPUs is "
        "run again (the machine may be shared); default 15",
    )
    parser.add_argument("--retries", type=int, default=2, help="re-runs per disturbed slot")
    parser.add_argument(
        "--publish",
        choices=("during", "before"),
        default="before",
        help="before (default; what the budgets of issue 29 are set on): all tasks are "
        "queued first and the clock times the worker draining them, with no publisher on "
        "the CPUs; during: the clock runs while one client publishes the tasks and the "
        "worker consumes them (every run before the sixth round)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds after which disturbed runs are kept instead of redone (default 240)",
    )
    parser.add_argument(
        "--profile", choices=VARIANTS, help="one run of this variant with cProfile in the children"
    )
    parser.add_argument(
        "--profile-clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the children's main-thread CPU time (default); wall: includes waiting",
    )
    parser.add_argument(
        "--pin",
        choices=("split", "same", "none"),
        default="none",
        help="split: the redis-server on the last CPU, the worker (and its children) and "
        "this process on the first; same: all on the first; none (default, as the worker "
        "is judged): the OS places them",
    )
    args = parser.parse_args()
    variants = args.variants.split(",") if args.profile is None else [args.profile]
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}")

    for name, value in machine_facts():
        print(f"{name:>16}: {value}")
    print(f"{'publish':>16}: {args.publish} (the clock)")
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin != "none" and len(cpus) > 1:
        PLACEMENT["client"] = {cpus[0]}
        PLACEMENT["server"] = {cpus[0]} if args.pin == "same" else {cpus[-1]}
        _place(0, "client")
    print(f"{'pin':>16}: {args.pin}")
    began = time.monotonic()
    server = start_server()
    workdir = Path(tempfile.mkdtemp(prefix="bench-tasks-logs-"))
    app = None
    try:
        env = {
            "BENCH_BROKER": server.url(0),
            "BENCH_LOCKS": server.url(1),
            "BENCH_COUNTER": server.url(3),
        }
        os.environ.update(env)  # the worker subprocesses inherit these
        sys.path.insert(0, str(ROOT))
        with environment({"BENCH_VARIANT": ""}):
            taskapp = importlib.import_module(APP_MODULE)
        app = taskapp.app
        print(f"redis-server pid {server.proc.pid} on {HOST}:{server.port}; logs in {workdir}")

        if args.profile is not None:
            os.environ["BENCH_PROFILE_CLOCK"] = args.profile_clock
            profile_dir = workdir / "profile"
            profile_dir.mkdir()
            run = run_variant(
                server, taskapp.TASKS, args.profile, 0, 0, args.tasks, args.warmup, workdir,
                profile_dir,
            )  # fmt: skip
            print(f"{args.profile} (under cProfile): {run.rate:.0f} tasks/s")
            print(commands_table([run], variants))
            print(cpu_table([run], variants))
            print_profile(profile_dir)
            return 0

        runs: list[Run] = []
        index = 0
        for rep in range(args.reps):
            # --order rotate: rep r starts with the r-th variant, so no variant always runs
            # first (right after the previous rep's last one) or last.
            shift = rep % len(variants) if args.order == "rotate" else 0
            for v in variants[shift:] + variants[:shift]:
                for attempt in range(args.retries + 1):
                    within_budget = time.monotonic() - began < args.budget
                    if within_budget:
                        wait_quiet(args.max_outside, timeout=15)
                    run = run_variant(
                        server, taskapp.TASKS, v, rep, index, args.tasks, args.warmup, workdir,
                        publish_first=args.publish == "before",
                    )  # fmt: skip
                    index += 1
                    run.discarded = attempt
                    disturbed = run.outside > args.max_outside
                    again = disturbed and attempt < args.retries and within_budget
                    print(
                        f"rep {rep} {v:<10} {run.rate:7.0f} tasks/s  ({run.seconds:.2f} s, "
                        f"publishing took {run.publish_seconds:.2f} s; other processes used "
                        f"{run.outside:.0f}% of the CPUs)"
                        + (" - discarded, running it again" if again else ""),
                        flush=True,
                    )
                    if not again:
                        break
                runs.append(run)
        print()
        print(summarize(runs, variants))
        ratios = rate_ratios(runs, variants)
        if ratios:
            print("\n" + "\n".join(ratios))
        print()
        print(commands_table(runs, variants))
        print()
        print(cpu_table(runs, variants))
        print()
        print(child_cpu_table(runs, variants))
        print()
        print("\n".join(budgets(runs, variants, args.publish)))
        print(f"\nwhole benchmark: {time.monotonic() - began:.0f} s")
        return 0
    finally:
        if app is not None:
            app.close()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
