"""The server's work in a lock cycle, counted in instructions: redis-server runs under
valgrind's callgrind, which counts every instruction the server executes, so the figure
is the same on a busy machine as on a quiet one (a timing of the server, `INFO
commandstats` or the CPU time, moves with the load by more than the changes it should
show).

Run by hand (not part of the test suite; needs ``valgrind`` on PATH)::

    .venv/bin/python bench/bench_script_cost.py [--cycles 300]

Each row starts its own throwaway redis-server under callgrind on a free loopback port,
runs 50 unmeasured cycles, zeroes the counters, runs ``--cycles`` measured ones, dumps
the counters and stops the server by pid. A cycle is what users do: a new lock object on
a name never used before, ``acquire(blocking=False)``, ``release()``, on a client with
redis-py's defaults. Rows: our ``Lock``; our ``Lock`` with the Redis Cluster variant of
its scripts (the same scripts without the board's index, run here on a plain Redis: what
the index costs); redis-py's ``Lock``; and the floor by hand (``SET NX PX`` and a
compare-and-delete script). The figure counts everything the server does for a cycle:
reading and parsing the commands, the scripts, the replies.

To compare two trees, run this file with the other tree first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

import redis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _servers as S

import celery_redlock
from celery_redlock import Lock
from celery_redlock.core.backends.redis import scripts

RELEASE_LUA = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
    "else return 0 end"
)
RELEASE_SHA = hashlib.sha1(RELEASE_LUA.encode()).hexdigest()
Cycle = Callable[[redis.Redis, str], None]


def ours(r: redis.Redis, name: str) -> None:
    lock = Lock(r, "crl:" + name, ttl=30.0)
    if lock.acquire(blocking=False) is not True:
        raise RuntimeError("our Lock: an uncontended acquire failed")
    lock.release()


def redis_py(r: redis.Redis, name: str) -> None:
    lock = r.lock("rp:" + name, timeout=30)
    if not lock.acquire(blocking=False):
        raise RuntimeError("redis-py Lock: an uncontended acquire failed")
    lock.release()


def floor(r: redis.Redis, name: str) -> None:
    token = os.urandom(16).hex()
    if not r.set("raw:" + name, token, nx=True, px=30000):
        raise RuntimeError("the floor: an uncontended SET NX failed")
    if r.evalsha(RELEASE_SHA, 1, "raw:" + name, token) != 1:
        raise RuntimeError("the floor: the release failed")


def instructions(cycle: Cycle, cycles: int) -> float:
    """The server's instructions per *cycle*, counted by callgrind."""
    out = tempfile.mkdtemp(prefix="bench-script-cost-")
    wrapper = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.out")
    server = S.start(wrapper=wrapper, startup=60.0)
    try:
        r = redis.Redis(host=S.HOST, port=server.port, socket_timeout=60)
        r.script_load(RELEASE_LUA)
        for i in range(50):
            cycle(r, f"warm:{i}")
        subprocess.run(
            ["callgrind_control", "-z", str(server.pid)], check=True, capture_output=True
        )
        for i in range(cycles):
            cycle(r, f"cold:{i}")
        subprocess.run(
            ["callgrind_control", "-d", str(server.pid)], check=True, capture_output=True
        )
        r.close()
    finally:
        S.stop(server)
    try:
        dumps = sorted(glob.glob(f"{out}/cg.out.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        text = subprocess.run(
            ["callgrind_annotate", dumps[-1]], check=True, capture_output=True, text=True
        ).stdout
    finally:
        shutil.rmtree(out, ignore_errors=True)
    found = re.search(r"([\d,]+)\s+(?:\(100\.0%\)\s+)?PROGRAM TOTALS", text)
    if found is None:
        raise SystemExit("callgrind_annotate printed no total")
    return int(found.group(1).replace(",", "")) / cycles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=300)
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        raise SystemExit("valgrind is not on PATH (Debian: apt-get install valgrind)")
    rows: list[tuple[str, float]] = [("our `Lock`", instructions(ours, args.cycles))]
    # The Cluster variant of each script writes no index (scripts.py): run on a plain
    # Redis, it is the same cycle without the board's index.
    indexed = scripts.Script.indexed
    scripts.Script.indexed = property(lambda self: self)  # type: ignore[assignment]
    try:
        rows.append(("our `Lock`, scripts without the index", instructions(ours, args.cycles)))
    finally:
        scripts.Script.indexed = indexed  # type: ignore[method-assign]
    rows.append(("redis-py `Lock`", instructions(redis_py, args.cycles)))
    rows.append(
        ("the floor by hand: SET NX PX + compare-and-delete", instructions(floor, args.cycles))
    )
    print(
        f"celery-redlock {celery_redlock.__version__}",
        f"from {os.path.dirname(celery_redlock.__file__)}",
    )
    print(f"{args.cycles} cycles a row, each on a name never used before\n")
    print("| cycle | server instructions a cycle | vs redis-py |")
    print("|---|---:|---:|")
    base = rows[2][1]
    for label, count in rows:
        print(f"| {label} | {count:,.0f} | {count / base:.2f}x |")


if __name__ == "__main__":
    main()
