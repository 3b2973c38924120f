"""Single-node lock benchmark: uncontended cycles, hand-off latency, a waiter's commands.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_lock.py [--cycles 5000] [--blocks 100] [--warmup 500]
                                         [--handoffs 200] [--wait-seconds 10]
                                         [--write-docs] [--profile]

It starts its own throwaway redis-server on a free loopback port and stops it
by pid at the end (also on error or Ctrl-C). Everything runs in the same
process against the same server with one plain ``redis.Redis`` client.

Cycles: one ``acquire()`` plus ``release()`` of an uncontended lock, timed with
``time.perf_counter_ns``. After ``--warmup`` unmeasured cycles each, every
implementation runs ``--cycles`` measured cycles in ``--blocks`` blocks; the
blocks of all implementations are interleaved (rotating order), so a burst of
background load hits them alike. cycles/s is the median block rate, p50/p99
are over every measured cycle. Two columns split a cycle's cost: client CPU
(this thread's CPU time per cycle, ``time.thread_time_ns``) and server time
(INFO commandstats usec of SET/EVALSHA per cycle, reset before each block); the rest of the
wall time is the two network round trips and scheduling. Two more rows run our
``Lock`` on the in-process memory backend (``connect("memory://")``): no server, the
cost of the lock logic alone.

Hand-off: the holder holds the lock, a waiter thread blocks in ``acquire()``;
after a random pause (5-105 ms, the same seeded sequence for every
implementation, so a polling waiter is caught at a random point of its sleep)
the holder calls ``release()``. The figure is release-call-start to
waiter-acquired.

Waiter: a holder keeps the lock (``auto_renew``, renewed every TTL/3) for
``--wait-seconds`` while a waiter on another client blocks in ``acquire()``. The
waiter's commands per second are the server's EVALSHA + EVAL + BLPOP calls over the
window (INFO commandstats, reset at its start) minus the holder's renewal scripts
(one per renewal round, counted by the renewal thread), for several TTLs: a waiter
waits at most the holder's lease left, so the TTL sets how often it wakes.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.metadata
import io
import os
import platform
import pstats
import random
import re
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _servers
import redis
import redis_lock
from _docs import DOCS, write_block

from celery_redlock import Lock, LockLost, connect
from celery_redlock.core.renewal import get_manager
from celery_redlock.core.renewal import shutdown as stop_renewal

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Single-node lock"

# The textbook compare-and-delete: the cheapest correct release.
COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

Cycle = Callable[[], None]


# --------------------------------------------------------------------------- what we compare


def raw_floor(client: redis.Redis) -> Cycle:
    """SET NX PX with a fresh token, then EVALSHA compare-and-delete: two round trips."""
    sha = client.script_load(COMPARE_AND_DELETE)
    key = "bench:raw"

    def cycle() -> None:
        token = secrets.token_hex(16)
        if not client.set(key, token, nx=True, px=30000):
            raise RuntimeError("raw SET NX failed")
        if client.evalsha(sha, 1, key, token) != 1:
            raise RuntimeError("raw compare-and-delete failed")

    return cycle


def redis_py(client: redis.Redis) -> Cycle:
    """redis-py's ``redis.lock.Lock``."""
    lock = client.lock("bench:redis-py", timeout=30)

    def cycle() -> None:
        if not lock.acquire():
            raise RuntimeError("redis-py acquire failed")
        lock.release()

    return cycle


def python_redis_lock(client: redis.Redis, auto_renewal: bool) -> Cycle:
    """python-redis-lock's ``redis_lock.Lock``."""
    lock = redis_lock.Lock(
        client, f"bench:prl-{auto_renewal}", expire=30, auto_renewal=auto_renewal
    )

    def cycle() -> None:
        if not lock.acquire():
            raise RuntimeError("python-redis-lock acquire failed")
        lock.release()

    return cycle


def ours(client: redis.Redis, auto_renew: bool) -> Cycle:
    """``celery_redlock.Lock``."""
    lock = Lock(client, f"bench:ours-{auto_renew}", ttl=30, auto_renew=auto_renew)

    def cycle() -> None:
        if not lock.acquire():
            raise RuntimeError("celery_redlock acquire failed")
        lock.release()

    return cycle


def ours_memory(auto_renew: bool) -> Cycle:
    """``celery_redlock.Lock`` on the in-process memory backend (no server)."""
    return ours(connect("memory://bench"), auto_renew)


CYCLE_IMPLS: list[tuple[str, Callable[[redis.Redis], Cycle]]] = [
    ("raw SET NX PX + EVALSHA (floor)", raw_floor),
    ("redis-py Lock", redis_py),
    ("python-redis-lock (auto_renewal=False)", lambda c: python_redis_lock(c, False)),
    ("python-redis-lock (auto_renewal=True)", lambda c: python_redis_lock(c, True)),
    ("celery_redlock.Lock (auto_renew=True)", lambda c: ours(c, True)),
    ("celery_redlock.Lock (auto_renew=False)", lambda c: ours(c, False)),
    ("celery_redlock.Lock on memory:// (auto_renew=True)", lambda c: ours_memory(True)),
    ("celery_redlock.Lock on memory:// (auto_renew=False)", lambda c: ours_memory(False)),
]
OURS_DEFAULT = "celery_redlock.Lock (auto_renew=True)"
OURS_MEMORY = "celery_redlock.Lock on memory:// (auto_renew=True)"
RAW = CYCLE_IMPLS[0][0]
REDIS_PY = CYCLE_IMPLS[1][0]
#: TTLs (seconds) of the waiter test: the default, and shorter leases that wake it more.
WAITER_TTLS = (30.0, 3.0, 1.0, 0.3)


@dataclass
class HandoffImpl:
    """How to make, take and give back one kind of lock for the hand-off test."""

    label: str
    make: Callable[[redis.Redis, str], Any]
    acquire: Callable[[Any], bool]
    release: Callable[[Any], None]


HANDOFF_IMPLS = [
    HandoffImpl(
        "redis-py Lock (sleep=0.1, its default)",
        lambda c, n: c.lock(n, timeout=30, sleep=0.1),
        lambda lk: bool(lk.acquire()),
        lambda lk: lk.release(),
    ),
    HandoffImpl(
        "redis-py Lock (sleep=0.001)",
        lambda c, n: c.lock(n, timeout=30, sleep=0.001),
        lambda lk: bool(lk.acquire()),
        lambda lk: lk.release(),
    ),
    HandoffImpl(
        "python-redis-lock",
        lambda c, n: redis_lock.Lock(c, n, expire=30),
        lambda lk: bool(lk.acquire()),
        lambda lk: lk.release(),
    ),
    HandoffImpl(
        "celery_redlock.Lock",
        lambda c, n: Lock(c, n, ttl=30),
        lambda lk: lk.acquire(),
        lambda lk: lk.release(),
    ),
]


# --------------------------------------------------------------------------- measuring


@dataclass
class Block:
    """One measured block of cycles."""

    samples: list[int]  # per-cycle wall time, ns
    wall: int  # ns for the whole block
    cpu: int  # ns of this thread's CPU for the whole block
    server_usec: float  # microseconds the server spent in commands during the block


#: The commands the clients send themselves in a cycle. Commands a script calls
#: are counted in commandstats too, and their time is already in the script's.
TOP_LEVEL = ("cmdstat_set", "cmdstat_evalsha", "cmdstat_eval")


def server_usec(client: redis.Redis) -> float:
    """Server time (usec) of the cycle's top-level commands since the last CONFIG RESETSTAT."""
    stats = client.info("commandstats")
    return sum(float(stats[k]["usec"]) for k in TOP_LEVEL if k in stats)


def measure_cycles(cycle: Cycle, n: int, warmup: int, client: redis.Redis) -> Block:
    """Run *warmup* unmeasured cycles, then time *n* cycles (wall, own CPU, server time)."""
    for _ in range(warmup):
        cycle()
    gc.collect()
    client.config_resetstat()
    clock = time.perf_counter_ns
    samples = [0] * n
    cpu0 = time.thread_time_ns()
    start = clock()
    for i in range(n):
        t0 = clock()
        cycle()
        samples[i] = clock() - t0
    wall = clock() - start
    cpu = time.thread_time_ns() - cpu0
    return Block(samples, wall, cpu, server_usec(client))


def measure_handoffs(impl: HandoffImpl, client: redis.Redis, n: int, seed: int) -> list[float]:
    """Seconds from the holder's release() call to the waiter's acquire() returning."""
    name = "bench:handoff:" + re.sub(r"\W+", "-", impl.label)
    rng = random.Random(seed)
    holder = impl.make(client, name)
    out: list[float] = []
    for _ in range(n):
        if not impl.acquire(holder):
            raise RuntimeError(f"{impl.label}: holder could not acquire")
        ready = threading.Event()
        got: list[float] = []
        waiter = impl.make(client, name)

        def wait(
            waiter: Any = waiter, ready: threading.Event = ready, got: list[float] = got
        ) -> None:
            ready.set()
            if impl.acquire(waiter):
                got.append(time.perf_counter())
                impl.release(waiter)

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        ready.wait(5)
        time.sleep(rng.uniform(0.005, 0.105))
        released = time.perf_counter()
        impl.release(holder)
        thread.join(10)
        if not got:
            raise RuntimeError(f"{impl.label}: waiter never acquired")
        out.append(got[0] - released)
    return out


@dataclass
class Waiting:
    """What one blocked waiter sent while a renewed holder kept the lock."""

    ttl: float
    seconds: float
    evalsha: int  # the waiter's scripts (acquire attempts): all scripts minus renewals
    blpop: int
    renewals: int  # the holder's renewal rounds in the window (one script each)
    #: The holder's lease ran out before a renewal got through (a loaded machine and a
    #: short TTL): the waiter took the lock during the window, the counts mean nothing.
    holder_lost: bool = False

    @property
    def per_second(self) -> float:
        return (self.evalsha + self.blpop) / self.seconds


def measure_waiter(
    server: _servers.Server, ttl: float, seconds: float, clients: list[redis.Redis]
) -> Waiting:
    """A holder (renewed) keeps the lock for *seconds* while a waiter blocks in acquire().
    The clients go into *clients*, closed by the caller once the renewal thread stopped
    (a renewal round in flight when the holder released still uses the holder's)."""
    holder_client, waiter_client, admin = server.client(), server.client(), server.client()
    clients += [holder_client, waiter_client, admin]
    name = f"bench:waiter:{ttl}"
    holder = Lock(holder_client, name, ttl=ttl)
    waiter = Lock(waiter_client, name, ttl=ttl)
    if not holder.acquire(blocking=False):
        raise RuntimeError("waiter test: holder could not acquire")
    got = threading.Event()

    def wait() -> None:
        if waiter.acquire(timeout=seconds + 30):
            got.set()
            waiter.release()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(min(1.0, ttl))  # the waiter is blocked by now
    manager = get_manager()
    rounds0 = manager.rounds
    admin.config_resetstat()
    time.sleep(seconds)
    stats = admin.info("commandstats")
    rounds = manager.rounds - rounds0
    holder_lost = got.is_set() or holder.lost
    try:
        holder.release()
    except LockLost:
        holder_lost = True
    thread.join(10)
    if not got.is_set():
        raise RuntimeError("waiter test: the waiter never got the lock after the release")

    def calls(name: str, what: str = "calls") -> int:
        return int(stats.get(f"cmdstat_{name}", {}).get(what, 0))

    # A script the server had not cached yet (the first renewal round on this server) is
    # an EVALSHA refused with NOSCRIPT, then an EVAL: one script run, counted once.
    scripts = calls("evalsha") - calls("evalsha", "failed_calls") + calls("eval")
    return Waiting(ttl, seconds, max(0, scripts - rounds), calls("blpop"), rounds, holder_lost)


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of *values*."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


# --------------------------------------------------------------------------- facts & output


def machine_facts(server: _servers.Server) -> dict[str, str]:
    """What the numbers were measured on."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "CPU": cpu,
        "nproc": str(os.cpu_count()),
        "OS": platform.platform(),
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "redis-server": f"{server.version()} ({server.binary}), loopback TCP, no persistence",
        "redis-py": redis.__version__,
        "python-redis-lock": importlib.metadata.version("python-redis-lock"),
        "celery-redlock": commit or "?",
    }


def cycles_table(results: dict[str, dict[str, float]]) -> str:
    raw, rp = results[RAW]["rate"], results[REDIS_PY]["rate"]
    rows = [
        "| implementation | cycles/s | vs floor | vs redis-py | p50 µs | p99 µs | "
        "client CPU µs | server µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        rows.append(
            f"| {label} | {r['rate']:,.0f} | {r['rate'] / raw:.2f}x | {r['rate'] / rp:.2f}x | "
            f"{r['p50']:.1f} | {r['p99']:.1f} | {r['cpu']:.1f} | {r['server']:.1f} |"
        )
    return "\n".join(rows)


def handoff_table(results: dict[str, list[float]]) -> str:
    rows = [
        "| implementation | hand-off p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|",
    ]
    for label, values in results.items():
        rows.append(
            f"| {label} | {pct(values, 50) * 1000:.3f} | {pct(values, 99) * 1000:.3f} | "
            f"{max(values) * 1000:.3f} |"
        )
    return "\n".join(rows)


def waiter_table(results: list[Waiting]) -> str:
    rows = [
        "| lock TTL s | window s | waiter EVALSHA | waiter BLPOP | commands/s | "
        "holder renewals (not counted) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for w in results:
        if w.holder_lost:
            rows.append(
                f"| {w.ttl:g} | {w.seconds:g} | - | - | the holder's lease ran out before a "
                f"renewal: not measured | {w.renewals} |"
            )
            continue
        rows.append(
            f"| {w.ttl:g} | {w.seconds:g} | {w.evalsha} | {w.blpop} | {w.per_second:.2f} | "
            f"{w.renewals} |"
        )
    return "\n".join(rows)


def targets(
    cycles: dict[str, dict[str, float]], handoffs: dict[str, list[float]], waits: list[Waiting]
) -> list[str]:
    ours_rate, rp = cycles[OURS_DEFAULT]["rate"], cycles[REDIS_PY]["rate"]
    ours_handoff = pct(handoffs["celery_redlock.Lock"], 50) * 1000
    memory_p50 = cycles[OURS_MEMORY]["p50"]

    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines = [
        f"- `Lock` cycle >= 1.0x redis-py's `Lock` (our cycles/s / theirs, above 1.0x: ours "
        f"faster): {ours_rate / rp:.2f}x, {mark(ours_rate >= rp)}",
        f"- hand-off p50 <= 1 ms: {ours_handoff:.3f} ms, {mark(ours_handoff <= 1.0)}",
    ]
    for w in waits:
        if w.holder_lost:
            lines.append(f"- a waiter <= 5 commands/s (TTL {w.ttl:g} s): not measured")
            continue
        lines.append(
            f"- a waiter <= 5 commands/s (TTL {w.ttl:g} s): {w.per_second:.2f}/s, "
            f"{mark(w.per_second <= 5)}"
        )
    lines.append(
        f"- memory backend `Lock` cycle <= 20 µs (p50): {memory_p50:.1f} µs, "
        f"{mark(memory_p50 <= 20)}"
    )
    return lines


def profile_ours(client: redis.Redis, n: int) -> str:
    """cProfile of our default cycle: where the time goes, by own time."""
    cycle = ours(client, True)
    for _ in range(200):
        cycle()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        cycle()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=5000, help="measured cycles per round")
    parser.add_argument("--warmup", type=int, default=500, help="unmeasured cycles first")
    parser.add_argument("--blocks", type=int, default=100, help="interleaved blocks per impl")
    parser.add_argument("--handoffs", type=int, default=200, help="hand-offs per implementation")
    parser.add_argument("--seed", type=int, default=7, help="seed of the pre-release pauses")
    parser.add_argument(
        "--wait-seconds", type=float, default=10.0, help="window of the waiter test, per TTL"
    )
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--profile", action="store_true", help="cProfile our default cycle")
    args = parser.parse_args()
    for value in (args.cycles, args.warmup, args.blocks, args.handoffs):
        if not 0 < value <= 1_000_000:
            parser.error("counts must be between 1 and 1,000,000")

    load_before = os.getloadavg()[0]
    with _servers.running() as server:
        client = server.client()
        facts = machine_facts(server)
        samples: dict[str, list[int]] = {label: [] for label, _ in CYCLE_IMPLS}
        rates: dict[str, list[float]] = {label: [] for label, _ in CYCLE_IMPLS}
        cpus: dict[str, list[float]] = {label: [] for label, _ in CYCLE_IMPLS}
        servers: dict[str, list[float]] = {label: [] for label, _ in CYCLE_IMPLS}
        cycles = {label: make(client) for label, make in CYCLE_IMPLS}
        per_block = max(1, args.cycles // args.blocks)
        for label, _ in CYCLE_IMPLS:
            measure_cycles(cycles[label], 1, args.warmup, client)
        for block in range(args.blocks):
            shift = block % len(CYCLE_IMPLS)
            for label, _ in CYCLE_IMPLS[shift:] + CYCLE_IMPLS[:shift]:
                got = measure_cycles(cycles[label], per_block, 0, client)
                samples[label] += got.samples
                rates[label].append(per_block / (got.wall / 1e9))
                cpus[label].append(got.cpu / per_block / 1000)
                servers[label].append(got.server_usec / per_block)
        for label, _ in CYCLE_IMPLS:
            print(f"  {label}: median {statistics.median(rates[label]):,.0f}/s", file=sys.stderr)
        cycle_results = {
            label: {
                "rate": statistics.median(rates[label]),
                "p50": pct([float(x) for x in samples[label]], 50) / 1000,
                "p99": pct([float(x) for x in samples[label]], 99) / 1000,
                "cpu": statistics.median(cpus[label]),
                "server": statistics.median(servers[label]),
            }
            for label, _ in CYCLE_IMPLS
        }
        handoffs: dict[str, list[float]] = {}
        for impl in HANDOFF_IMPLS:
            print(f"  hand-offs: {impl.label}", file=sys.stderr)
            handoffs[impl.label] = measure_handoffs(impl, client, args.handoffs, args.seed)
        waits: list[Waiting] = []
        waiter_clients: list[redis.Redis] = []
        for ttl in WAITER_TTLS:
            print(f"  waiter, TTL {ttl:g} s", file=sys.stderr)
            waits.append(measure_waiter(server, ttl, args.wait_seconds, waiter_clients))
        profile = profile_ours(client, args.cycles) if args.profile else ""
        stop_renewal()
        for other in waiter_clients:
            other.close()
        client.close()

    python = Path(sys.executable)
    if python.is_relative_to(ROOT):
        python = python.relative_to(ROOT)
    command = f"{python} bench/bench_lock.py " + " ".join(sys.argv[1:])
    body = "\n".join(
        [
            f"Measured {time.strftime('%Y-%m-%d')} with `{command.strip()}`.",
            "",
            "Machine: " + "; ".join(f"{k} {v}" for k, v in facts.items()) + ".",
            "",
            f"Other load on the machine (1-minute load average) at start: {load_before:.2f}, "
            f"at end: {os.getloadavg()[0]:.2f}.",
            "",
            f"Uncontended acquire+release, {args.cycles} cycles each in {args.blocks} "
            f"interleaved blocks (after {args.warmup} warm-up cycles each); cycles/s is "
            "the median block, p50/p99 over all cycles; client CPU and server µs are per "
            'cycle (median block); "vs" columns are cycles/s ratios (above 1.0x: faster):',
            "",
            cycles_table(cycle_results),
            "",
            f"Hand-off, {args.handoffs} times each (holder's release() call to the "
            "waiter's acquire() returning, waiter in another thread):",
            "",
            handoff_table(handoffs),
            "",
            f"A blocked waiter's commands, {args.wait_seconds:g} s per TTL (the holder renewed "
            "every TTL/3; its renewal scripts are subtracted):",
            "",
            waiter_table(waits),
        ]
    )
    # The budgets go to the terminal only: docs/benchmarks.md has them in one table.
    budgets = "\n".join(["Budgets (issue 23):", "", *targets(cycle_results, handoffs, waits)])
    print(f"{body}\n\n{budgets}")
    if profile:
        print("\ncProfile of celery_redlock.Lock (auto_renew=True), by own time:\n")
        print(profile)
    if args.write_docs:
        write_block(SECTION, "bench_lock.py", body)
        print(f"\nwrote {DOCS.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
