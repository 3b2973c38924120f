"""Acquire+release latency: our Redlock (1, 3, 5 masters) vs pottery's Redlock vs our Lock.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_redlock.py [--rounds 5000] [--blocks 50] [--warmup 300]
                                            [--write-docs]

It starts its own five throwaway redis-servers on free loopback ports (no disk
persistence, temp dirs) and stops them by pid when done, also on error or Ctrl-C.
Each measured round is one non-blocking ``acquire()`` plus ``release()`` of an
uncontended lock (default options: ours register with the renewal thread), timed
with ``time.perf_counter_ns``; rounds alternate between two lock names. The rows
run in interleaved blocks (rotating order) so a burst of background load on the
host hits them alike. ``--write-docs`` rewrites the marked block of the "Redlock"
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
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
from pathlib import Path
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


class Case:
    """One implementation under test: two locks (alternated) and the timings so far."""

    def __init__(self, label: str, make: Callable[[str], Any]) -> None:
        self.label = label
        tag = str(abs(hash(label)))  # rows never share a key: they run interleaved
        self.locks = [make(f"bench:{tag}:a"), make(f"bench:{tag}:b")]
        self.times: list[float] = []
        self.turn = 0

    def run(self, rounds: int, keep: bool = True) -> None:
        """*rounds* acquire+release rounds; keep the microseconds of each when *keep*."""
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


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "## Redlock"
BEGIN = "<!-- bench_redlock.py results: begin -->"
END = "<!-- bench_redlock.py results: end -->"


def write_docs(body: str) -> None:
    """Put *body* between this script's markers in the "Redlock" section of docs/benchmarks.md.

    The file is read right before writing and only the marked block changes, so
    other sections (and notes around the block) survive a re-run.
    """
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{body.strip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    elif SECTION + "\n" in text:
        head, rest = text.split(SECTION + "\n", 1)
        text = f"{head}{SECTION}\n\n{block}\n{rest}"
    else:
        text = f"{text.rstrip()}\n\n{SECTION}\n\n{block}\n"
    DOCS.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5000, help="measured rounds per row")
    parser.add_argument("--blocks", type=int, default=50, help="interleaved blocks")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    opts = parser.parse_args()

    with servers(5) as procs:
        urls = [s.url for s in procs]
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

    single = statistics.median(cases[1].times)
    three = statistics.median(cases[3].times)
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')}: {per_block * opts.blocks} acquire+release rounds "
        f"per row in {opts.blocks} interleaved blocks (+{opts.warmup} warm-up), five "
        f"redis-server {server_version()} on loopback, Python {platform.python_version()}, "
        f"redis-py {redis.__version__}, pottery {importlib.metadata.version('pottery')}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}).",
        "",
        "| implementation | p50 (µs) | p99 (µs) | p50 vs our `Lock` |",
        "|---|---:|---:|---:|",
    ]
    for case in cases:
        p50 = statistics.median(case.times)
        lines.append(
            f"| {case.label} | {p50:.0f} | {pct(case.times, 99):.0f} | {p50 / single:.2f}x |"
        )
    verdict = "met" if three <= 1.5 * single else "NOT met"
    lines += [
        "",
        f"Target 3 masters <= 1.5x our single-node `Lock`: {three / single:.2f}x, {verdict}.",
    ]
    body = "\n".join(lines)
    print("\n" + body)
    if opts.write_docs:
        write_docs(body)
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
