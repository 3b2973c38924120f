"""Acquire+release latency: our Redlock (1, 3, 5 masters) vs pottery's Redlock vs our Lock.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_redlock.py [--rounds 5000] [--blocks 50] [--warmup 300]
                                            [--write-docs]

It starts its own five throwaway redis-servers on free loopback ports (no disk
persistence, temp dirs) and stops them by pid when done, also on error or Ctrl-C.
By default every server runs on the last CPU (``taskset``) and this process on the
others, so the masters share one core and never the client's; ``--no-pin`` leaves
placement to the OS.
Each measured round is one non-blocking ``acquire()`` plus ``release()`` of an
uncontended lock (default options: ours register with the renewal thread), timed
with ``time.perf_counter_ns``; rounds alternate between two lock names. The rows
run in interleaved blocks (rotating order) so a burst of background load on the
host hits them alike. Beside the latency it reports the process's CPU time per round
(every thread: a quorum's member calls run on the process's thread pool, pottery's on
a pool it starts per call). ``--write-docs`` rewrites the marked block of the "Redlock"
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import _servers
import pottery  # the bench extra: pip install -e .[bench]
import redis
from _docs import DOCS, write_block

from celery_redlock import Lock, Redlock, connect
from celery_redlock.core.renewal import shutdown as stop_renewal


@contextlib.contextmanager
def servers(n: int, pin: bool) -> Iterator[list[_servers.Server]]:
    """*n* throwaway servers (see bench/_servers.py); with *pin*, all on the last CPU."""
    wrapper: tuple[str, ...] = ()
    if pin:
        taskset = shutil.which("taskset")
        if taskset is None:
            sys.exit("--pin needs taskset (util-linux)")
        wrapper = (taskset, "-c", str(LAST_CPU))
    started: list[_servers.Server] = []
    try:
        for _ in range(n):
            started.append(_servers.start(wrapper=wrapper))
        yield started
    finally:
        for server in started:
            _servers.stop(server)


LAST_CPU = max(os.sched_getaffinity(0))


class Case:
    """One implementation under test: two locks (alternated) and the timings so far."""

    def __init__(self, label: str, make: Callable[[str], Any]) -> None:
        self.label = label
        tag = str(abs(hash(label)))  # rows never share a key: they run interleaved
        self.locks = [make(f"bench:{tag}:a"), make(f"bench:{tag}:b")]
        self.times: list[float] = []
        self.cpu: list[float] = []  # per block: this process's CPU per round, µs
        self.turn = 0

    def run(self, rounds: int, keep: bool = True) -> None:
        """*rounds* acquire+release rounds; keep the microseconds of each when *keep*, and
        the process's CPU time per round (every thread: the caller and any pool threads)."""
        cpu0 = time.process_time_ns()
        for _ in range(rounds):
            lock = self.locks[self.turn % 2]
            self.turn += 1
            t0 = time.perf_counter_ns()
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"{self.label}: uncontended acquire failed")
            lock.release()
            t1 = time.perf_counter_ns()
            if keep:
                self.times.append((t1 - t0) / 1000)
        if keep:
            self.cpu.append((time.process_time_ns() - cpu0) / rounds / 1000)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


SECTION = "## Redlock"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5000, help="measured rounds per row")
    parser.add_argument("--blocks", type=int, default=50, help="interleaved blocks")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave placement to the OS (default: every server on the last CPU, the client "
        "on the others)",
    )
    opts = parser.parse_args()
    load_before = os.getloadavg()[0]
    pin = not opts.no_pin and len(os.sched_getaffinity(0)) > 1
    if pin:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {LAST_CPU})

    with servers(5, pin) as procs:
        urls = [f"redis://{_servers.HOST}:{s.port}/0" for s in procs]
        clients = connect(urls)  # one client per master, shared by every lock below
        plain = [redis.Redis.from_url(u) for u in urls]  # redis-py defaults, for the others

        def plural(n: int) -> str:
            return f"{n} master{'s' if n > 1 else ''}"

        cases = [
            Case("redis-py `Lock` (1 node)", lambda name: plain[0].lock(name, timeout=10)),
            Case("our `Lock` (1 node)", lambda name: Lock(clients[0], name, ttl=10)),
        ]
        for n in (1, 3, 5):
            cases.append(
                Case(
                    f"our `Redlock` ({plural(n)})",
                    lambda name, n=n: Redlock(clients[:n], name, ttl=10),
                )
            )
        for n in (1, 3, 5):
            cases.append(
                Case(
                    f"pottery `Redlock` ({plural(n)})",
                    lambda name, n=n: pottery.Redlock(
                        key=name, masters=set(plain[:n]), auto_release_time=10
                    ),
                )
            )
        for case in cases:
            case.run(opts.warmup, keep=False)
        per_block = max(1, opts.rounds // opts.blocks)
        for block in range(opts.blocks):  # rotate the order: background load hits all alike
            for k in range(len(cases)):
                cases[(block + k) % len(cases)].run(per_block)
            print(f"  block {block + 1}/{opts.blocks}", file=sys.stderr, end="\r")
        stop_renewal()

    command = " ".join(["bench/bench_redlock.py", *sys.argv[1:]])
    single = statistics.median(cases[1].times)
    three = statistics.median(cases[3].times)
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} with `{command}`: "
        f"{per_block * opts.blocks} acquire+release rounds "
        f"per row in {opts.blocks} interleaved blocks (+{opts.warmup} warm-up), five "
        f"redis-server {server_version()} on loopback"
        + (f" sharing CPU {LAST_CPU}, the client on the other CPUs" if pin else "")
        + f", Python {platform.python_version()}, "
        f"redis-py {redis.__version__}, pottery {importlib.metadata.version('pottery')}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}). Client CPU: this process's CPU "
        "time (every thread) per round, median block.",
        "",
        "| implementation | p50 (µs) | p99 (µs) | p50 vs our `Lock` | client CPU (µs) |",
        "|---|---:|---:|---:|---:|",
    ]
    for case in cases:
        p50 = statistics.median(case.times)
        lines.append(
            f"| {case.label} | {p50:.0f} | {pct(case.times, 99):.0f} | {p50 / single:.2f}x | "
            f"{statistics.median(case.cpu):.0f} |"
        )
    pottery3 = statistics.median(cases[6].times)
    target = 1.7 if pin else 1.5
    verdict = "met" if three <= target * single else "NOT met"
    lines += [
        "",
        f"Budget (issue 23): 3 masters p50 <= {target}x our single-node `Lock`"
        + (" (masters sharing one CPU)" if pin else " (masters placed by the OS)")
        + f": {three / single:.2f}x, {verdict}. Against pottery's over the same 3 masters "
        f"(issue 16 asked <= 0.25x): {three / pottery3:.2f}x.",
        "",
        f"Other load on the machine (1-minute load average) at start: {load_before:.2f}, "
        f"at end: {os.getloadavg()[0]:.2f}.",
    ]
    body = "\n".join(lines)
    print("\n" + body)
    if opts.write_docs:
        write_block(SECTION, "bench_redlock.py", body)
        print(f"\nwrote {DOCS}")


def server_version() -> str:
    binary = shutil.which("redis-server") or shutil.which("valkey-server") or "redis-server"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    for word in out.split():
        if word.startswith("v="):
            return word[2:]
    return "?"


if __name__ == "__main__":
    main()
