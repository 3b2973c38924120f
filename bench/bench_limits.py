"""Limits benchmark: semaphore acquire+release, and rate limiter grants per second.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_limits.py [--cycles 5000] [--blocks 50] [--warmup 500]
                                           [--seconds 3] [--procs 4] [--pin split|same|none]

It starts its own throwaway redis-server on a free loopback port and stops it by pid
at the end (also on error or Ctrl-C); every figure comes from the same server in the
same run, on ``redis.Redis(host, port)`` clients with redis-py's defaults; ``--pin``
places the server and this process as in bench_lock.py (split by default). dramatiq's
limiters (the ``bench`` extra) run on its ``RedisBackend``.

Semaphore: one uncontended ``acquire`` + ``release`` cycle per sample (a permit of
limit 3 taken and given back), each cycle on a new object and a name never used before
(as users call it), timed with ``time.perf_counter_ns``: our
``Semaphore(limit=3)``, our ``Lock`` (the target: the semaphore within 1.2x of it at
the median) and dramatiq's ``ConcurrentRateLimiter(limit=3)``. Each runs ``--cycles``
measured cycles in ``--blocks`` blocks, the blocks of all three interleaved (rotating
order) so background load hits them alike; p50/p99 over every cycle. Round trips per
cycle are the server's command count (INFO commandstats) over the cycles.

Rate limiter: grants per second on one key whose limit is never reached (so every
call is a grant and the figure is the cost of granting), for ``--seconds``, from one
process and from ``--procs`` processes at once (the contended case: dramatiq's
limiters retry a WATCH transaction when another process got in between): ours
(GCRA, one script) vs dramatiq's ``WindowRateLimiter`` and ``BucketRateLimiter``.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import re
import statistics
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import _servers
import redis
from dramatiq.rate_limits import BucketRateLimiter, ConcurrentRateLimiter, WindowRateLimiter
from dramatiq.rate_limits.backends import RedisBackend

from celery_redlock import Lock, RateLimiter, Semaphore
from celery_redlock.core.renewal import shutdown as stop_renewal

#: One cycle on the name it is given (a new one each cycle).
Cycle = Callable[[str], None]
LIMIT = 3


# --------------------------------------------------------------------------- semaphores
def ours_semaphore(client: redis.Redis) -> Cycle:
    def cycle(name: str) -> None:
        sem = Semaphore(client, name, LIMIT, ttl=30)
        if not sem.acquire(blocking=False):
            raise RuntimeError("Semaphore acquire failed")
        sem.release()

    return cycle


def ours_lock(client: redis.Redis) -> Cycle:
    def cycle(name: str) -> None:
        lock = Lock(client, name, ttl=30)
        if not lock.acquire(blocking=False):
            raise RuntimeError("Lock acquire failed")
        lock.release()

    return cycle


def dramatiq_concurrent(client: redis.Redis) -> Cycle:
    backend = RedisBackend(client=client)

    def cycle(name: str) -> None:
        limiter = ConcurrentRateLimiter(backend, name, limit=LIMIT, ttl=30_000)
        with limiter.acquire(raise_on_failure=True):
            pass

    return cycle


SEMAPHORES: list[tuple[str, Callable[[redis.Redis], Cycle]]] = [
    (f"celery_redlock.Semaphore(limit={LIMIT})", ours_semaphore),
    ("celery_redlock.Lock", ours_lock),
    (f"dramatiq ConcurrentRateLimiter(limit={LIMIT})", dramatiq_concurrent),
]


def _script_commands() -> frozenset[str]:
    """The commands our Lua scripts call (read from ``core/backends/redis/lua/*.lua``), as
    commandstats names: the server counts those calls too, though no client sent them."""
    folder = resources.files("celery_redlock.core.backends.redis").joinpath("lua")
    found: set[str] = set()
    for item in folder.iterdir():
        if item.name.endswith(".lua"):
            found |= set(re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", item.read_text()))
    return frozenset(f"cmdstat_{name.lower()}" for name in found)


SCRIPT_COMMANDS = _script_commands()
SCRIPTS = ("cmdstat_evalsha", "cmdstat_eval")
ADMIN = ("cmdstat_config|resetstat", "cmdstat_config", "cmdstat_info")


def commands(client: redis.Redis) -> int:
    """Commands clients sent since the last CONFIG RESETSTAT. Where scripts ran (ours),
    the calls made from inside them are not counted; dramatiq's limiters run no scripts,
    so everything they sent counts."""
    stats = client.info("commandstats")
    scripts_ran = any(stats.get(k, {}).get("calls") for k in SCRIPTS)
    return sum(
        int(v["calls"])
        for k, v in stats.items()
        if k not in ADMIN and not (scripts_ran and k in SCRIPT_COMMANDS)
    )


def bench_semaphores(server: _servers.Server, cycles: int, blocks: int, warmup: int) -> None:
    client = server.client()
    admin = server.client()
    made = [(label, make(client)) for label, make in SEMAPHORES]
    serial = 0
    for index, (_, cycle) in enumerate(made):
        for _ in range(warmup):
            serial += 1
            cycle(f"bench:sem:{index}:{serial}")
    samples: dict[str, list[int]] = {label: [] for label, _ in made}
    trips: dict[str, list[float]] = {label: [] for label, _ in made}
    per_block = max(1, cycles // blocks)
    gc.disable()
    try:
        for block in range(blocks):
            order = made[block % len(made) :] + made[: block % len(made)]
            for label, cycle in order:
                admin.config_resetstat()
                clock = time.perf_counter_ns
                out = samples[label]
                names = [f"bench:sem:{label}:{serial + i}" for i in range(per_block)]
                serial += per_block
                for name in names:
                    start = clock()
                    cycle(name)
                    out.append(clock() - start)
                trips[label].append(commands(admin) / per_block)
    finally:
        gc.enable()
    print(
        f"\nSemaphore acquire+release, uncontended, a new object on a new name each cycle "
        f"({per_block * blocks} cycles each)"
    )
    print(f"{'implementation':48} {'p50 us':>8} {'p99 us':>8} {'cmds/cycle':>10}")
    p50s = {}
    for label, _ in made:
        xs = sorted(samples[label])
        p50s[label] = statistics.median(xs) / 1000
        p99 = xs[int(len(xs) * 0.99)] / 1000
        print(f"{label:48} {p50s[label]:8.1f} {p99:8.1f} {statistics.median(trips[label]):10.1f}")
    sem, lock = SEMAPHORES[0][0], SEMAPHORES[1][0]
    print(f"Semaphore / Lock at p50: {p50s[sem] / p50s[lock]:.2f}x (target <= 1.2x)")
    client.close()
    admin.close()


# --------------------------------------------------------------------------- rate limiters
def ours_rate(client: redis.Redis) -> Callable[[], bool]:
    limiter = RateLimiter(client, "bench:gcra", 1e6, burst=1_000_000)
    return lambda: limiter.acquire().granted


def dramatiq_window(client: redis.Redis) -> Callable[[], bool]:
    limiter = WindowRateLimiter(RedisBackend(client=client), "bench:window", limit=10**9, window=1)

    def grant() -> bool:
        with limiter.acquire(raise_on_failure=False) as acquired:
            return bool(acquired)

    return grant


def dramatiq_bucket(client: redis.Redis) -> Callable[[], bool]:
    limiter = BucketRateLimiter(RedisBackend(client=client), "bench:bucket", limit=10**9)

    def grant() -> bool:
        with limiter.acquire(raise_on_failure=False) as acquired:
            return bool(acquired)

    return grant


RATES: list[tuple[str, Callable[[redis.Redis], Callable[[], bool]]]] = [
    ("celery_redlock.RateLimiter (GCRA)", ours_rate),
    ("dramatiq WindowRateLimiter(window=1)", dramatiq_window),
    ("dramatiq BucketRateLimiter(bucket=1000)", dramatiq_bucket),
]


def _grant_loop(port: int, index: int, seconds: float, start: Any, out: Any) -> None:
    client = redis.Redis(host=_servers.HOST, port=port)
    grant = RATES[index][1](client)
    for _ in range(200):  # warm-up: connection, script load
        grant()
    if not start.wait(30):
        raise SystemExit(4)
    granted = refused = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if grant():
            granted += 1
        else:
            refused += 1
    out.put((granted, refused))
    client.close()


def bench_rates(server: _servers.Server, seconds: float, procs: int) -> None:
    admin = server.client()
    ctx = multiprocessing.get_context("fork")
    print(f"\nRate limiter grants/s on one key (limit never reached), {seconds:g} s each")
    print(f"{'implementation':42} {'procs':>5} {'grants/s':>10} {'cmds/grant':>10}")
    for index, (label, _) in enumerate(RATES):
        for n in sorted({1, procs}):
            start, out = ctx.Event(), ctx.Queue()
            workers = [
                ctx.Process(target=_grant_loop, args=(server.port, index, seconds, start, out))
                for _ in range(n)
            ]
            for w in workers:
                w.start()
            time.sleep(0.5)
            admin.config_resetstat()
            start.set()
            results = [out.get(timeout=seconds + 30) for _ in workers]
            sent = commands(admin)
            for w in workers:
                w.join(10)
            granted = sum(g for g, _ in results)
            print(f"{label:42} {n:5} {granted / seconds:10.0f} {sent / max(granted, 1):10.2f}")
    admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=5000)
    parser.add_argument("--blocks", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--procs", type=int, default=4)
    _servers.add_pin_option(parser)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    pin, server_cpus, client_cpus = _servers.placement(args.pin)
    _servers.pin_self(client_cpus)
    with _servers.running(cpus=server_cpus) as server:
        print(
            f"redis-server {server.version()} on 127.0.0.1:{server.port}; "
            + _servers.describe_pin(pin, server_cpus, client_cpus)
        )
        try:
            bench_semaphores(server, args.cycles, args.blocks, args.warmup)
            bench_rates(server, args.seconds, args.procs)
        finally:
            stop_renewal()
    print(
        f"\nOther load on the machine (1-minute load average) at start: {load_before:.2f}, "
        f"at end: {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
