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

``--parts`` splits our cycle instead, on one server under callgrind (its counters zeroed
and dumped around each row): the two scripts as they are; the same script calls doing
nothing (``return``), with the same keys and arguments; a bare pair of scripts sending
the same fourteen commands with ready-made arguments, whole and with each command left
out in turn (what that command costs); and single Lua steps, each run 2,000 times in a
loop inside one script (what one step costs the server).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from functools import partial

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


class Counted:
    """One redis-server under callgrind for many rows: :meth:`count` zeroes its counters,
    runs a row and reads the instructions it took."""

    def __init__(self) -> None:
        self.out = tempfile.mkdtemp(prefix="bench-script-cost-")
        wrapper = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}/cg.out")
        self.server = S.start(wrapper=wrapper, startup=60.0)
        self.client = redis.Redis(host=S.HOST, port=self.server.port, socket_timeout=60)

    def count(self, row: Callable[[int], None], runs: int, warm: int = 30) -> float:
        """Instructions a run of *row* (called with 0..runs-1, after *warm* unmeasured runs
        with negative numbers)."""
        for i in range(warm):
            row(-1 - i)
        subprocess.run(
            ["callgrind_control", "-z", str(self.server.pid)], check=True, capture_output=True
        )
        for i in range(runs):
            row(i)
        subprocess.run(
            ["callgrind_control", "-d", str(self.server.pid)], check=True, capture_output=True
        )
        dumps = sorted(glob.glob(f"{self.out}/cg.out.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        text = subprocess.run(
            ["callgrind_annotate", dumps[-1]], check=True, capture_output=True, text=True
        ).stdout
        found = re.search(r"([\d,]+)\s+(?:\(100\.0%\)\s+)?PROGRAM TOTALS", text)
        if found is None:
            raise SystemExit("callgrind_annotate printed no total")
        return int(found.group(1).replace(",", "")) / runs

    def close(self) -> None:
        self.client.close()
        S.stop(self.server)
        shutil.rmtree(self.out, ignore_errors=True)


def instructions(cycle: Cycle, cycles: int) -> float:
    """The server's instructions per *cycle*, on a server of its own, counted by callgrind."""
    counted = Counted()
    try:
        r = counted.client
        r.script_load(RELEASE_LUA)
        return counted.count(lambda i: cycle(r, f"{'cold' if i >= 0 else 'warm'}:{i}"), cycles, 50)
    finally:
        counted.close()


#: The commands our cycle sends from inside its two scripts (a new name, nobody waiting),
#: with ready-made arguments: what a script that decides nothing would send.
BARE_ACQUIRE = (
    "local cur = redis.call('HMGET', KEYS[1], 'token', 'fence', 'info')",
    "local t = redis.call('TIME')",
    "redis.call('SET', KEYS[2], t[1] .. t[2], 'PX', ARGV[5], 'NX')",
    "redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', t[1] .. t[2], 'info', ARGV[3])",
    "redis.call('PEXPIRE', KEYS[1], ARGV[2])",
    "redis.call('ZADD', 'redlock:index:expiry', t[1], KEYS[1])",
    "redis.call('ZADD', 'redlock:index:held', '0', KEYS[1])",
)
BARE_RELEASE = (
    "local cur = redis.call('HMGET', KEYS[1], 'token', 'info')",
    "local recent = redis.call('GET', KEYS[4])",
    "redis.call('DEL', KEYS[1])",
    "redis.call('ZREM', 'redlock:index:expiry', KEYS[1])",
    "redis.call('ZREM', 'redlock:index:held', KEYS[1])",
    "redis.call('SET', KEYS[4], ' ' .. ARGV[1] .. ' ', 'PX', ARGV[2])",
    "redis.call('EXISTS', KEYS[3])",
)
#: Single steps of our scripts' Lua, each timed in a loop inside one script call.
STEPS = {
    "string.format('%d', n) of a 16-digit number": "x = string.format('%d', 1796304649075781 + i)",
    "tonumber of an argument": "x = tonumber(ARGV[2])",
    "a concatenation (key .. text)": "x = KEYS[1] .. 'expiry'",
    "string.match of a key's prefix": "x = string.match(KEYS[1], '^[^{]*')",
    "two plain string.find in a holder record": (
        "x = string.find(ARGV[3], '\"kept_for\":', 1, true)"
        " or string.find(ARGV[3], '\"task_name\":', 1, true)"
    ),
    "redis.call('TIME')": "x = redis.call('TIME')",
    "redis.call('EXISTS', a missing key)": "x = redis.call('EXISTS', KEYS[2])",
    "redis.call('GET', a missing key)": "x = redis.call('GET', KEYS[2])",
    "redis.call('MGET', two missing keys)": "x = redis.call('MGET', KEYS[2], KEYS[3])",
    "redis.call('HMGET', a missing key, 3 fields)": (
        "x = redis.call('HMGET', KEYS[2], 'token', 'fence', 'info')"
    ),
}
STEP_LOOPS = 2000


def parts(cycles: int) -> None:
    """Print what each part of our cycle costs the server (``--parts``)."""
    counted = Counted()
    r = counted.client
    record = json.dumps({"hostname": "bench", "pid": os.getpid(), "acquired_at": 1.0})
    token = os.urandom(20).hex()

    def pair(acquire: str, release: str) -> Callable[[int], None]:
        """A cycle of two scripts with our keys and arguments, on a new name a call."""
        sha_a, sha_r = r.script_load(acquire), r.script_load(release)
        tag = os.urandom(4).hex()

        def cycle(i: int) -> None:
            key = f"redlock:{{{tag}:{i}}}"
            r.evalsha(sha_a, 3, key, f"{key}:fence", f"{key}:waiting", token, 30000, record,
                      0, 3600000)  # fmt: skip
            r.evalsha(sha_r, 4, key, f"{key}:notify", f"{key}:waiting", f"{key}:recent",
                      token, 30000, 700)  # fmt: skip

        return cycle

    def bare(acquire: Sequence[str], release: Sequence[str]) -> Callable[[int], None]:
        return pair("\n".join(acquire) + "\nreturn {1, 1}", "\n".join(release) + "\nreturn 1")

    rows: list[tuple[str, float]] = []
    try:
        whole = counted.count(
            pair(scripts.ACQUIRE.indexed.source, scripts.RELEASE.indexed.source), cycles
        )
        empty = counted.count(pair("return {1, 1}", "return 1"), cycles)
        naked = counted.count(bare(BARE_ACQUIRE, BARE_RELEASE), cycles)
        rows += [
            ("our cycle: acquire.lua + release.lua", whole),
            ("the same two calls, each script only a `return`", empty),
            ("a bare pair sending the same 14 commands", naked),
            ("- so the 14 commands", naked - empty),
            ("- and our scripts' Lua around them", whole - naked),
        ]
        for i, line in enumerate(BARE_ACQUIRE + BARE_RELEASE):
            if "'TIME'" in line or "'ZREM'" in line:
                # The others read TIME's reply; without a ZREM the index's set grows over
                # the row, and every command on it costs more (the row reads negative).
                continue
            acq = [x for j, x in enumerate(BARE_ACQUIRE) if j != i]
            rel = [x for j, x in enumerate(BARE_RELEASE) if j != i - len(BARE_ACQUIRE)]
            command = line.split("redis.call(", 1)[1].split(",", 1)[0].strip("'")
            where = "acquire" if i < len(BARE_ACQUIRE) else "release"
            rows.append(
                (f"- one {command} of the {where}", naked - counted.count(bare(acq, rel), cycles))
            )
        base_sha = r.script_load(f"local x\nfor i = 1, {STEP_LOOPS} do\nend\nreturn 1")

        def loop(_i: int, sha: str) -> None:
            r.evalsha(sha, 3, "k1{a}", "k2{a}", "k3{a}", token, "30000", record)

        empty_loop = counted.count(partial(loop, sha=base_sha), 5, warm=3)
        for label, step in STEPS.items():
            sha = r.script_load(f"local x\nfor i = 1, {STEP_LOOPS} do\n{step}\nend\nreturn 1")
            cost = (counted.count(partial(loop, sha=sha), 5, warm=3) - empty_loop) / STEP_LOOPS
            rows.append((f"a Lua step: {label}", cost))
    finally:
        counted.close()
    print(
        f"celery-redlock {celery_redlock.__version__}",
        f"from {os.path.dirname(celery_redlock.__file__)}",
    )
    print(f"{cycles} cycles a row, each on a name never used before\n")
    print("| part | server instructions |")
    print("|---|---:|")
    for label, count in rows:
        print(f"| {label} | {count:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--parts", action="store_true", help="split our cycle (see above)")
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        raise SystemExit("valgrind is not on PATH (Debian: apt-get install valgrind)")
    if args.parts:
        parts(args.cycles)
        return
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
