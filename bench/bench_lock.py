"""Single-node lock benchmark: uncontended cycles, hand-off latency, a waiter's commands.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_lock.py [--cycles 5000] [--blocks 100] [--warmup 500]
                                         [--handoffs 200] [--wait-seconds 10]
                                         [--pin split|same|none] [--write-docs] [--profile]

It starts its own throwaway redis-server on a free loopback port and stops it
by pid at the end (also on error or Ctrl-C). Everything runs in the same
process against the same server, on ``redis.Redis(host, port)`` clients with
redis-py's defaults, as users build them, one per row (no object of another row
keeps anything of a row's client alive). With ``--pin split`` (the default) the
server runs on the last CPU and this process on the first (``--pin none``: the
OS places them).

Cycles, measured as users call a lock: each cycle builds a new lock object on a
name never used before (a counter in the name: per-argument names such as
``sync:<user_id>``, whose fence counters have long expired), then one
``acquire()`` plus ``release()``, timed with ``time.perf_counter_ns``. Every
implementation (ours, the floor by hand, redis-py's ``Lock``, python-redis-lock)
runs the same way. Two rows marked "warm" are there to split our cost: a new
object per cycle on one name (the fence counter and the released-token record
stay warm), and one object cycling one name (what this benchmark measured before
issue 38). After ``--warmup`` unmeasured cycles each, every row runs ``--cycles``
measured cycles in ``--blocks`` blocks; the blocks of all rows are interleaved
(rotating order), so a burst of background load hits them alike. cycles/s is the
median block rate, p50/p99 are over every measured cycle. Two columns split a
cycle's cost: client CPU (this process's CPU time per cycle, every thread) and
server time (INFO commandstats usec of the commands the client sent, reset
before each block); the rest of the wall time is the two round trips and
scheduling. A second table counts every command the server ran per cycle,
those inside scripts included. A row runs our ``Lock`` on the in-process memory
backend (``connect("memory://")``): no server, the cost of the lock logic alone.

Hand-off: the holder holds a lock, a waiter thread blocks in ``acquire()``;
after a random pause (5-105 ms, the same seeded sequence for every
implementation, so a polling waiter is caught at a random point of its sleep)
the holder calls ``release()``. The figure is release-call-start to
waiter-acquired. Each hand-off uses a new name and new objects.

Waiter: a holder keeps the lock (``auto_renew``, renewed every TTL/3) for
``--wait-seconds`` while a waiter on another client blocks in ``acquire()``. The
waiter's commands per second are the server's EVALSHA + EVAL + BLPOP calls over the
window (INFO commandstats, reset at its start) minus the holder's renewal scripts
(one per renewal round, counted by the renewal thread), for several TTLs: a waiter
waits at most the holder's lease left, so the TTL sets how often it wakes.

``--profile``: a cProfile of our cold cycle (the top entries by own time, and the
cumulative time of its parts) and each lock object's construction cost alone.
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
#: One cycle on the lock name it is given (new for every cold cycle).
Cycle = Callable[[str], None]


def raw_floor(client: redis.Redis) -> Cycle:
    """SET NX PX with a fresh token, then EVALSHA compare-and-delete: two round trips."""
    sha = client.script_load(COMPARE_AND_DELETE)

    def cycle(name: str) -> None:
        token = secrets.token_hex(20)  # 160 bits, as ours
        if not client.set(name, token, nx=True, px=30000):
            raise RuntimeError("raw SET NX failed")
        if client.evalsha(sha, 1, name, token) != 1:
            raise RuntimeError("raw compare-and-delete failed")

    return cycle


def redis_py(client: redis.Redis) -> Cycle:
    """redis-py's ``redis.lock.Lock`` (``client.lock(name)``), a new one per cycle."""

    def cycle(name: str) -> None:
        lock = client.lock(name, timeout=30)
        if not lock.acquire(blocking=False):
            raise RuntimeError("redis-py acquire failed")
        lock.release()

    return cycle


def python_redis_lock(client: redis.Redis, auto_renewal: bool) -> Cycle:
    """python-redis-lock's ``redis_lock.Lock``, a new one per cycle."""

    def cycle(name: str) -> None:
        lock = redis_lock.Lock(client, name, expire=30, auto_renewal=auto_renewal)
        if not lock.acquire(blocking=False):
            raise RuntimeError("python-redis-lock acquire failed")
        lock.release()

    return cycle


def ours(client: Any, auto_renew: bool) -> Cycle:
    """``celery_redlock.Lock``, a new one per cycle."""

    def cycle(name: str) -> None:
        lock = Lock(client, name, ttl=30, auto_renew=auto_renew)
        if lock.acquire(blocking=False) is not True:
            raise RuntimeError("celery_redlock acquire failed")
        lock.release()

    return cycle


def ours_same_name(client: redis.Redis) -> Cycle:
    """Warm: a new ``celery_redlock.Lock`` per cycle, always on one name."""
    return lambda name: ours(client, True)("bench:ours-same-name")


def ours_one_object(client: redis.Redis) -> Cycle:
    """Warm: one ``celery_redlock.Lock`` cycling one name."""
    lock = Lock(client, "bench:ours-one-object", ttl=30)

    def cycle(name: str) -> None:
        if lock.acquire(blocking=False) is not True:
            raise RuntimeError("celery_redlock acquire failed")
        lock.release()

    return cycle


def ours_memory(client: redis.Redis) -> Cycle:
    """``celery_redlock.Lock`` on the in-process memory backend (no server)."""
    return ours(connect("memory://bench"), True)


RAW = "floor by hand: SET NX PX + compare-and-delete"
REDIS_PY = "redis-py `Lock` (`r.lock()`)"
OURS_DEFAULT = "`Lock` (auto_renew=True)"
OURS_MEMORY = "`Lock` on memory://"
CYCLE_IMPLS: list[tuple[str, Callable[[redis.Redis], Cycle]]] = [
    (RAW, raw_floor),
    (REDIS_PY, redis_py),
    ("python-redis-lock (auto_renewal=False)", lambda c: python_redis_lock(c, False)),
    ("python-redis-lock (auto_renewal=True)", lambda c: python_redis_lock(c, True)),
    (OURS_DEFAULT, lambda c: ours(c, True)),
    ("`Lock` (auto_renew=False)", lambda c: ours(c, False)),
    ("warm: `Lock`, a new object per cycle on one name", ours_same_name),
    ("warm: `Lock`, one object cycling one name", ours_one_object),
    (OURS_MEMORY, ours_memory),
]
#: Each row's key prefix: rows never share a name.
PREFIXES = {label: f"bench:{i}:" for i, (label, _) in enumerate(CYCLE_IMPLS)}
#: The commands each row's client sends itself (ours: its two scripts). INFO commandstats
#: counts a script's inner calls under their own names too, and their time is already in
#: the script's: the rest of a command's calls ran inside scripts.
BY_HAND = ("set", "evalsha", "eval")
SENT: dict[str, tuple[str, ...]] = {
    label: BY_HAND if not label.startswith(("`Lock`", "warm:")) else ("evalsha", "eval")
    for label, _ in CYCLE_IMPLS
}
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
    cpu: int  # ns of this process's CPU (every thread) for the whole block
    server_usec: float  # microseconds the server spent in the commands the client sent
    commands: dict[str, tuple[int, float]]  # every command the server ran: (calls, usec)


#: The benchmark's own commands, left out of the command counts.
OWN = ("cmdstat_info", "cmdstat_config|resetstat", "cmdstat_config")


class Names:
    """Names never used before: a row's prefix and a counter."""

    def __init__(self) -> None:
        self.serial = 0

    def take(self, prefix: str, n: int) -> list[str]:
        first = self.serial
        self.serial += n
        return [f"{prefix}{i}" for i in range(first, first + n)]


def measure_cycles(
    cycle: Cycle, names: list[str], admin: redis.Redis, sent: tuple[str, ...]
) -> Block:
    """Time one cycle per name in *names* (wall, this process's CPU, and the server's time
    in the commands *sent* by the client)."""
    gc.collect()
    admin.config_resetstat()
    clock = time.perf_counter_ns
    samples = [0] * len(names)
    cpu0 = time.process_time_ns()
    start = clock()
    for i, name in enumerate(names):
        t0 = clock()
        cycle(name)
        samples[i] = clock() - t0
    wall = clock() - start
    cpu = time.process_time_ns() - cpu0
    stats = admin.info("commandstats")
    commands = {
        k.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"]))
        for k, v in stats.items()
        if k not in OWN
    }
    top = sum(commands[k][1] for k in sent if k in commands)
    return Block(samples, wall, cpu, top, commands)


def measure_handoffs(impl: HandoffImpl, client: redis.Redis, n: int, seed: int) -> list[float]:
    """Seconds from the holder's release() call to the waiter's acquire() returning."""
    prefix = "bench:handoff:" + re.sub(r"\W+", "-", impl.label) + ":"
    rng = random.Random(seed)
    out: list[float] = []
    for trial in range(n):
        name = f"{prefix}{trial}"  # a new name and new objects for every hand-off
        holder = impl.make(client, name)
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


def paired(rates: dict[str, list[float]], label: str, base: str) -> float:
    """Median over blocks of *label*'s cycles/s over *base*'s in the same block (the blocks
    ran interleaved, so a block's pair met the same background load)."""
    return statistics.median(a / b for a, b in zip(rates[label], rates[base], strict=True))


def cycles_table(results: dict[str, dict[str, float]], rates: dict[str, list[float]]) -> str:
    rows = [
        "| implementation | cycles/s | vs floor | vs redis-py | p50 µs | p99 µs | "
        "client CPU µs | server µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        rows.append(
            f"| {label} | {r['rate']:,.0f} | {paired(rates, label, RAW):.2f}x | "
            f"{paired(rates, label, REDIS_PY):.2f}x | "
            f"{r['p50']:.1f} | {r['p99']:.1f} | {r['cpu']:.1f} | {r['server']:.1f} |"
        )
    return "\n".join(rows)


def _per_cycle(found: dict[str, list[float]], cycles: int) -> str:
    """``NAME calls-per-cycle`` for each command, the most frequent first."""
    ordered = sorted(found.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return ", ".join(f"{k.upper()} {v[0] / cycles:.3g}" for k, v in ordered)


def commands_table(blocks: dict[str, list[Block]], cycles: int) -> str:
    """Per cycle: the commands the client sent and their server time each, and every
    command run inside them (scripts' calls included)."""
    rows = [
        "| implementation | sent per cycle | server µs per command sent (median block) | "
        "run inside scripts, per cycle |",
        "|---|---|---:|---|",
    ]
    for label, got in blocks.items():
        if label == OURS_MEMORY:
            continue
        total: dict[str, list[float]] = {}
        per_sent: list[float] = []  # per block: server µs per command sent
        for block in got:
            for name, (calls, usec) in block.commands.items():
                mine = total.setdefault(name, [0.0, 0.0])
                mine[0] += calls
                mine[1] += usec
            mine_sent = [block.commands[k] for k in SENT[label] if k in block.commands]
            if sum(c for c, _ in mine_sent):
                per_sent.append(sum(u for _, u in mine_sent) / sum(c for c, _ in mine_sent))
        n = cycles or 1
        sent = {k: v for k, v in total.items() if k in SENT[label]}
        inner = {k: v for k, v in total.items() if k not in SENT[label]}
        usec = statistics.median(per_sent) if per_sent else 0.0
        rows.append(
            f"| {label} | {_per_cycle(sent, n)} | {usec:.1f} | {_per_cycle(inner, n) or '-'} |"
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
    cycles: dict[str, dict[str, float]],
    rates: dict[str, list[float]],
    handoffs: dict[str, list[float]],
    waits: list[Waiting],
) -> list[str]:
    vs_rp, floor_rp = paired(rates, OURS_DEFAULT, REDIS_PY), paired(rates, RAW, REDIS_PY)
    ours_handoff = pct(handoffs["celery_redlock.Lock"], 50) * 1000
    memory_p50 = cycles[OURS_MEMORY]["p50"]

    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines = [
        f"- `Lock` cycle >= 1.0x redis-py's `Lock`, a new object on a new name per cycle "
        f"(our cycles/s / theirs, median block pair): {vs_rp:.2f}x, {mark(vs_rp >= 1.0)} "
        f"(the floor by hand: {floor_rp:.2f}x)",
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


def construction(client: redis.Redis, n: int) -> str:
    """What building each lock object costs alone (no I/O), µs, median of 5 batches."""
    makers: list[tuple[str, Callable[[str], object]]] = [
        (REDIS_PY, lambda name: client.lock(name, timeout=30)),
        ("python-redis-lock", lambda name: redis_lock.Lock(client, name, expire=30)),
        (OURS_DEFAULT, lambda name: Lock(client, name, ttl=30)),
    ]
    lines = ["Building one lock object, no I/O (µs, median of 5 batches):"]
    for label, make in makers:
        batches = []
        for batch in range(5):
            names = [f"bench:build:{batch}:{i}" for i in range(n)]
            t0 = time.perf_counter_ns()
            for name in names:
                make(name)
            batches.append((time.perf_counter_ns() - t0) / n / 1000)
        lines.append(f"  {label:40} {statistics.median(batches):6.2f}")
    return "\n".join(lines)


def profile_ours(client: redis.Redis, n: int) -> str:
    """cProfile of our default cycle, cold (a new object on a new name each time): the top
    entries by own time, then the cumulative time of the parts of a cycle."""
    cycle = ours(client, True)
    for i in range(200):
        cycle(f"bench:profile-warmup:{i}")
    names = [f"bench:profile:{i}" for i in range(n)]
    prof = cProfile.Profile()
    prof.enable()
    for name in names:
        cycle(name)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(
        r"lock\.py|lease\.py|redis_backend|redis_scripts|renewal\.py|keys\.py|"
        r"connection\.py:\d+\((pack_command|get_connection|release|read_response|"
        r"send_packed_command)\)",
        25,
    )
    return out.getvalue()


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=5000, help="measured cycles per row")
    parser.add_argument("--warmup", type=int, default=500, help="unmeasured cycles first")
    parser.add_argument("--blocks", type=int, default=100, help="interleaved blocks per row")
    parser.add_argument("--handoffs", type=int, default=200, help="hand-offs per implementation")
    parser.add_argument("--seed", type=int, default=7, help="seed of the pre-release pauses")
    parser.add_argument(
        "--wait-seconds", type=float, default=10.0, help="window of the waiter test, per TTL"
    )
    _servers.add_pin_option(parser)
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile our cold cycle; construction costs"
    )
    args = parser.parse_args()
    for value in (args.cycles, args.warmup, args.blocks, args.handoffs):
        if not 0 < value <= 1_000_000:
            parser.error("counts must be between 1 and 1,000,000")

    pin, server_cpus, client_cpus = _servers.placement(args.pin)
    _servers.pin_self(client_cpus)
    load_before = os.getloadavg()[0]
    names = Names()
    with _servers.running(cpus=server_cpus) as server:
        client = server.client()
        facts = machine_facts(server)
        samples: dict[str, list[int]] = {label: [] for label, _ in CYCLE_IMPLS}
        rates: dict[str, list[float]] = {label: [] for label, _ in CYCLE_IMPLS}
        cpus: dict[str, list[float]] = {label: [] for label, _ in CYCLE_IMPLS}
        servers: dict[str, list[float]] = {label: [] for label, _ in CYCLE_IMPLS}
        blocks: dict[str, list[Block]] = {label: [] for label, _ in CYCLE_IMPLS}
        # Each row its own client, as a user's module-level one: nothing another row keeps
        # alive (a held object, a backend) serves it.
        row_clients = {label: server.client() for label, _ in CYCLE_IMPLS}
        cycles = {label: make(row_clients[label]) for label, make in CYCLE_IMPLS}
        per_block = max(1, args.cycles // args.blocks)
        for label, _ in CYCLE_IMPLS:
            warm = names.take(PREFIXES[label], args.warmup)
            measure_cycles(cycles[label], warm, client, SENT[label])
        for block in range(args.blocks):
            shift = block % len(CYCLE_IMPLS)
            for label, _ in CYCLE_IMPLS[shift:] + CYCLE_IMPLS[:shift]:
                fresh = names.take(PREFIXES[label], per_block)
                got = measure_cycles(cycles[label], fresh, client, SENT[label])
                samples[label] += got.samples
                rates[label].append(per_block / (got.wall / 1e9))
                cpus[label].append(got.cpu / per_block / 1000)
                servers[label].append(got.server_usec / per_block)
                blocks[label].append(got)
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
        profile = ""
        if args.profile:
            fresh_client = server.client()
            profile = construction(fresh_client, 2000) + "\n\n"
            profile += profile_ours(fresh_client, args.cycles)
            fresh_client.close()
        stop_renewal()
        for other in waiter_clients:
            other.close()
        client.close()
        for each in row_clients.values():
            each.close()

    python = Path(sys.executable)
    if python.is_relative_to(ROOT):
        python = python.relative_to(ROOT)
    command = f"{python} bench/bench_lock.py " + " ".join(sys.argv[1:])
    body = "\n".join(
        [
            f"Measured {time.strftime('%Y-%m-%d')} with `{command.strip()}`.",
            "",
            "Machine: "
            + "; ".join(f"{k} {v}" for k, v in facts.items())
            + "; "
            + _servers.describe_pin(pin, server_cpus, client_cpus)
            + ".",
            "",
            f"Other load on the machine (1-minute load average) at start: {load_before:.2f}, "
            f"at end: {os.getloadavg()[0]:.2f}.",
            "",
            f"Uncontended acquire+release, a new lock object on a name never used before "
            f'in every cycle ("warm" rows apart), {per_block * args.blocks} cycles per row in '
            f"{args.blocks} interleaved blocks (after {args.warmup} warm-up cycles each), each "
            "row on a client of its own. cycles/s: the median block; vs: the median over blocks "
            "of the ratio to the other row's block beside it (above 1.0x: faster); p50/p99 over "
            "all cycles; client CPU (every thread of the process) and server µs (the commands "
            "the client sent): per cycle, median block.",
            "",
            cycles_table(cycle_results, rates),
            "",
            "Commands the server ran per cycle, same blocks:",
            "",
            commands_table(blocks, per_block * args.blocks),
            "",
            f"Hand-off, {args.handoffs} times each, a new name and new objects each time "
            "(holder's release() call to the waiter's acquire() returning, waiter in another "
            "thread):",
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
    budgets = "\n".join(
        ["Budgets (issues 23, 38):", "", *targets(cycle_results, rates, handoffs, waits)]
    )
    print(f"{body}\n\n{budgets}")
    if profile:
        print("\n" + profile)
    if args.write_docs:
        write_block(SECTION, "bench_lock.py", body)
        print(f"\nwrote {DOCS.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
