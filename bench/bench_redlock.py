"""Acquire+release latency: our Redlock (1, 3, 5 masters) vs pottery's Redlock vs our Lock.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_redlock.py [--rounds 3000] [--warmup 300]

It starts its own five throwaway redis-servers on free loopback ports (no disk
persistence, temp dirs) and stops them by pid when done, also on error or Ctrl-C.
Each measured round is one non-blocking ``acquire()`` plus ``release()`` of an
uncontended lock, timed with ``time.perf_counter_ns``; rounds alternate between
two lock names so no round sees the previous one's release notice.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pottery  # the bench extra: pip install -e .[bench]
import redis

from celery_redlock import Lock, Redlock, connect
from celery_redlock.core.renewal import shutdown as stop_renewal

HOST = "127.0.0.1"


@dataclass
class Server:
    """One throwaway redis-server process."""

    port: int
    proc: subprocess.Popen[bytes]
    tmp: str

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def start_server(binary: str) -> Server:
    """Start redis-server on a free loopback port and wait (bounded) until it answers PING."""
    for _ in range(5):
        port = free_port()
        tmp = tempfile.mkdtemp(prefix=f"bench-redlock-{port}-")
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", tmp, "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        server = Server(port, proc, tmp)
        client = redis.Redis(host=HOST, port=port, socket_timeout=0.5)
        for _ in range(250):  # <= 5 s
            if proc.poll() is not None:
                break
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    client.close()
                    return server
            time.sleep(0.02)
        client.close()
        stop_server(server)
    raise RuntimeError("could not start a redis-server in 5 tries")


def stop_server(server: Server) -> None:
    """Stop by pid: SIGTERM, bounded wait, then SIGKILL; remove the temp dir."""
    if server.proc.poll() is None:
        with contextlib.suppress(OSError):
            os.kill(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=5)
    shutil.rmtree(server.tmp, ignore_errors=True)


@contextlib.contextmanager
def servers(n: int) -> Iterator[list[Server]]:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        sys.exit("no redis-server (or valkey-server) on PATH")
    started: list[Server] = []
    try:
        for _ in range(n):
            started.append(start_server(binary))
        yield started
    finally:
        for server in started:
            stop_server(server)


def measure(make: Callable[[str], Any], rounds: int, warmup: int) -> list[float]:
    """Microseconds per acquire+release round, warm-up rounds dropped."""
    locks = [make("bench:a"), make("bench:b")]
    out: list[float] = []
    for i in range(warmup + rounds):
        lock = locks[i % 2]
        t0 = time.perf_counter_ns()
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"uncontended acquire failed on round {i}")
        lock.release()
        t1 = time.perf_counter_ns()
        if i >= warmup:
            out.append((t1 - t0) / 1000)
    return out


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    opts = parser.parse_args()

    rows: list[tuple[str, list[float]]] = []
    with servers(5) as procs:
        urls = [s.url for s in procs]
        clients = connect(urls)  # one client per master, shared by every lock below
        plain = [redis.Redis.from_url(u) for u in urls]  # redis-py defaults, for pottery

        def ours_single(name: str) -> Lock:
            return Lock(clients[0], name, ttl=10)

        def redis_py(name: str) -> Any:
            return plain[0].lock(name, timeout=10)

        cases: list[tuple[str, Callable[[str], Any]]] = [
            ("redis-py Lock (1 node)", redis_py),
            ("our Lock (1 node)", ours_single),
        ]
        for n in (1, 3, 5):
            cases.append(
                (
                    f"our Redlock ({n} master{'s' if n > 1 else ''})",
                    lambda name, n=n: Redlock(clients[:n], name, ttl=10),
                )
            )
        for n in (1, 3, 5):
            cases.append(
                (
                    f"pottery Redlock ({n} master{'s' if n > 1 else ''})",
                    lambda name, n=n: pottery.Redlock(
                        key=name, masters=set(plain[:n]), auto_release_time=10
                    ),
                )
            )
        for label, make in cases:
            rows.append((label, measure(make, opts.rounds, opts.warmup)))
            print(f"  measured {label}", file=sys.stderr)
        stop_renewal()

    single = statistics.median(dict(rows)["our Lock (1 node)"])
    print(
        f"\n{opts.rounds} rounds (+{opts.warmup} warm-up) of acquire+release per row; "
        f"Python {platform.python_version()}, redis-py {redis.__version__}, "
        f"{os.cpu_count()} CPUs, loopback\n"
    )
    print("| implementation | p50 (µs) | p99 (µs) | p50 vs our Lock |")
    print("|---|---:|---:|---:|")
    for label, values in rows:
        p50 = statistics.median(values)
        print(f"| {label} | {p50:.0f} | {pct(values, 99):.0f} | {p50 / single:.2f}x |")


if __name__ == "__main__":
    main()
