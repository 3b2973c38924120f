"""Acquire+release latency: our Redlock (1, 3, 5 masters) vs pottery's Redlock vs our Lock.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_redlock.py [--rounds 5000] [--blocks 50] [--warmup 300]
                                            [--stopped-rounds 1000] [--pin split|same|none]
                                            [--write-docs] [--profile]

It starts its own five throwaway redis-servers on free loopback ports (no disk
persistence, temp dirs) and stops them by pid when done, also on error or Ctrl-C.
With ``--pin split`` (the default) every server runs on the last CPU and this process
on the first, so the masters share one core and never the client's (``--pin none``,
or ``--no-pin``: the OS places them). Every implementation talks to the masters through
``redis.Redis(host, port)`` clients with redis-py's defaults, one per master, as users
build them.

Each measured round builds a new lock object on a name never used before (a counter in
the name: per-argument names, whose fence counters have long expired), then one
non-blocking ``acquire()`` plus ``release()`` of that uncontended lock (default
options: ours register with the renewal thread), timed with
``time.perf_counter_ns``. The rows run in interleaved blocks (rotating order) so a
burst of background load on the host hits them alike. A row marked "warm" keeps one
object cycling two names (what this benchmark measured before issue 38), to split the
cost. Beside the latency it reports the process's CPU time per round (every thread: a
quorum's member calls may run on the process's thread pool, pottery's on a pool it
starts per call) and the server time of the scripts (INFO commandstats over the
masters).

The floor (issue 29) is a row of its own, interleaved with the others: a Redlock written
by hand on redis-py's public API over the same 3 masters and the same clients as ours,
built per round too. For each master it takes a connection from that client's pool,
sends ``SET key token NX PX ttl`` on all three before it reads any reply, then reads
the three replies (a majority must say OK); the release does the same with an EVALSHA
of the textbook compare-and-delete script (SCRIPT LOAD once per master) on the same
connections, then gives them back: one pool checkout per master per round, as the
budget's floor is defined. Budgets: our `Redlock` over 3 masters at most 1.3x the floor's p50,
and faster than pottery's over the same masters.

After the interleaved blocks, one scenario runs on its own (it would slow every row
that shares the masters): the third of the 3 masters is stopped with SIGSTOP (and
always resumed with SIGCONT afterwards) while our `Redlock` over the 3 runs
``--stopped-rounds`` acquire+release rounds. Budget: one stopped master adds at most the
per-node timeout in force (``Redlock.per_node_timeout``) to the p50 of a round.

``--profile``: each lock object's construction cost alone, and a cProfile of our cold
`Redlock` (3 masters) round. ``--write-docs`` rewrites the marked block of the
"Redlock" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import importlib.metadata
import io
import os
import platform
import pstats
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import _servers
import pottery  # the bench extra: pip install -e .[bench]
import redis
from _docs import DOCS, write_block

from celery_redlock import Lock, Redlock
from celery_redlock.core.backends.redis.client import checkout
from celery_redlock.core.renewal import shutdown as stop_renewal


@contextlib.contextmanager
def servers(n: int, cpus: set[int] | None) -> Iterator[list[_servers.Server]]:
    """*n* throwaway servers (see bench/_servers.py), on *cpus* when given."""
    started: list[_servers.Server] = []
    try:
        for _ in range(n):
            started.append(_servers.start(cpus=cpus))
        yield started
    finally:
        for server in started:
            _servers.stop(server)


#: The textbook owner-checked delete: the cheapest correct release.
COMPARE_AND_DELETE = (
    "if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end"
)


class HandRedlock:
    """The floor: a Redlock written by hand on redis-py's public API, nothing else, as the
    budget's floor is defined.

    ``acquire``: a connection from each master's pool, ``SET key token NX PX ttl`` sent
    on all of them before any reply is read, then each reply read; held when a majority
    said OK. ``release``: an EVALSHA of :data:`COMPARE_AND_DELETE` (loaded once per master
    with SCRIPT LOAD: pass *shas*, or each new object loads it) the same way, on the same
    connections, which then go back to their pools: one checkout per master per round.
    (A lock whose holder uses the client between the two gives its connections back in
    between: a pool checkout per master more, about 10 µs each with redis-py 8.)
    """

    def __init__(
        self, clients: list[redis.Redis], name: str, ttl: float, shas: list[str] | None = None
    ) -> None:
        self.pools = [c.connection_pool for c in clients]
        self.shas = shas or [c.script_load(COMPARE_AND_DELETE) for c in clients]
        self.name = name
        self.ttl_ms = int(ttl * 1000)
        self.quorum = len(clients) // 2 + 1
        self.token = ""
        self.conns: list[Any] = []

    def _all(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """*commands[i]* on master i, on the connections this round holds: all sent first,
        then each reply read."""
        if not self.conns:
            self.conns = [checkout(pool) for pool in self.pools]
        try:
            for conn, command in zip(self.conns, commands, strict=True):
                conn.send_command(*command)
            return [conn.read_response() for conn in self.conns]
        except BaseException:
            for conn in self.conns:  # a reply may be left unread: start those afresh
                conn.disconnect()
            self._give_back()
            raise

    def _give_back(self) -> None:
        conns, self.conns = self.conns, []
        for pool, conn in zip(self.pools, conns, strict=True):
            pool.release(conn)

    def acquire(self, blocking: bool = False) -> bool:
        token = secrets.token_hex(20)  # 160 bits, as ours
        set_nx = ("SET", self.name, token, "NX", "PX", self.ttl_ms)
        granted = sum(reply is not None for reply in self._all([set_nx] * len(self.pools)))
        if granted < self.quorum:
            self._delete(token)  # the minority it got
            return False
        self.token = token
        return True

    def release(self) -> None:
        self._delete(self.token)

    def _delete(self, token: str) -> None:
        try:
            self._all([("EVALSHA", sha, 1, self.name, token) for sha in self.shas])
        finally:
            self._give_back()


class Case:
    """One implementation under test and the timings so far.

    *make* builds a lock on a name; :meth:`run` calls it once per round on a name never
    used before (cold). With *warm*, two objects are built once and cycled instead."""

    serial = 0  # names never repeat, across every case

    def __init__(self, label: str, make: Callable[[str], Any], warm: bool = False) -> None:
        self.label = label
        self.make = make
        self.prefix = f"bench:{abs(hash(label))}:"  # rows never share a key
        self.locks = [make(self.prefix + "a"), make(self.prefix + "b")] if warm else []
        self.times: list[float] = []
        self.p50s: list[float] = []  # per block: the p50 of its rounds, µs
        self.cpu: list[float] = []  # per block: this process's CPU per round, µs
        self.commands: list[dict[str, tuple[int, float]]] = []  # per block: calls, usec
        self.turn = 0

    def run(self, rounds: int, keep: bool = True, admins: Sequence[redis.Redis] = ()) -> None:
        """*rounds* acquire+release rounds; keep the microseconds of each when *keep*, and
        the process's CPU time per round (every thread: the caller and any pool threads);
        with *admins*, the masters' INFO commandstats over the block."""
        first = Case.serial
        Case.serial += rounds
        names = [f"{self.prefix}{i}" for i in range(first, first + rounds)]
        gc.collect()
        for admin in admins:
            admin.config_resetstat()
        cpu0 = time.process_time_ns()
        for name in names:
            t0 = time.perf_counter_ns()
            if self.locks:
                lock = self.locks[self.turn % 2]
                self.turn += 1
            else:
                lock = self.make(name)
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"{self.label}: uncontended acquire failed")
            lock.release()
            t1 = time.perf_counter_ns()
            if keep:
                self.times.append((t1 - t0) / 1000)
        if keep:
            self.cpu.append((time.process_time_ns() - cpu0) / rounds / 1000)
            self.p50s.append(statistics.median(self.times[-rounds:]))
        if keep and admins:
            total: dict[str, tuple[int, float]] = {}
            for admin in admins:
                for key, value in admin.info("commandstats").items():
                    if key in OWN:
                        continue
                    name = key.removeprefix("cmdstat_")
                    calls, usec = total.get(name, (0, 0.0))
                    total[name] = (calls + int(value["calls"]), usec + float(value["usec"]))
            self.commands.append({k: (v[0], v[1] / rounds) for k, v in total.items()})

    def vs(self, other: Case) -> float:
        """Median over blocks of this row's p50 over *other*'s in the same block (the
        blocks ran interleaved: a pair met the same background load)."""
        return statistics.median(a / b for a, b in zip(self.p50s, other.p50s, strict=True))

    def per_round(self) -> dict[str, float]:
        """Every command the masters ran per round (scripts' inner calls included)."""
        rounds = len(self.times) / len(self.commands) if self.commands else 1
        names = {k for block in self.commands for k in block}
        return {
            k: sum(b.get(k, (0, 0.0))[0] for b in self.commands) / len(self.commands) / rounds
            for k in names
        }

    def script_usec(self, sent: tuple[str, ...]) -> float:
        """Median block: the masters' time in the commands the client sent, per round."""
        if not self.commands:
            return float("nan")
        return statistics.median(sum(b[k][1] for k in sent if k in b) for b in self.commands)


#: The benchmark's own commands, left out of the command counts.
OWN = ("cmdstat_info", "cmdstat_config|resetstat", "cmdstat_config")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


SECTION = "## Redlock"
FLOOR = "by hand: `SET NX PX` + compare-and-delete on 3 masters at once (floor)"
FLOOR_1 = "by hand: the same on 1 master"
LOCK_1 = "our `Lock` (1 node)"
OURS_3 = "our `Redlock` (3 masters)"
POTTERY_3 = "pottery `Redlock` (3 masters)"
WARM_3 = "warm: our `Redlock` (3 masters), one object cycling two names"
STOPPED = "our `Redlock` (3 masters, 1 stopped)"
#: What each row's client sends itself (the rest of a command's calls ran inside scripts).
BY_HAND = ("set", "evalsha", "eval")
SCRIPTS = ("evalsha", "eval")


def plural(n: int) -> str:
    return f"{n} master{'s' if n > 1 else ''}"


def build_cases(procs: list[_servers.Server], shas: list[str]) -> list[Case]:
    """Every row, each building its lock per round on default clients of its own, one per
    master, as a user's module-level ones (nothing another row keeps alive serves it)."""

    def own() -> list[redis.Redis]:
        return [server.client() for server in procs]

    floor3, floor1, rp, lock1, warm = own(), own(), own(), own(), own()
    cases = [
        Case(FLOOR, lambda name: HandRedlock(floor3[:3], name, ttl=10, shas=shas[:3])),
        Case(FLOOR_1, lambda name: HandRedlock(floor1[:1], name, ttl=10, shas=shas[:1])),
        Case("redis-py `Lock` (1 node)", lambda name: rp[0].lock(name, timeout=10)),
        Case(LOCK_1, lambda name: Lock(lock1[0], name, ttl=10)),
    ]
    for n in (1, 3, 5):
        ours = own()
        cases.append(
            Case(
                f"our `Redlock` ({plural(n)})",
                lambda name, n=n, c=ours: Redlock(c[:n], name, ttl=10),
            )
        )
    for n in (1, 3, 5):
        theirs = own()
        cases.append(
            Case(
                f"pottery `Redlock` ({plural(n)})",
                lambda name, n=n, c=theirs: pottery.Redlock(
                    key=name, masters=set(c[:n]), auto_release_time=10
                ),
            )
        )
    cases.append(Case(WARM_3, lambda name: Redlock(warm[:3], name, ttl=10), warm=True))
    return cases


def sent_by(label: str) -> tuple[str, ...]:
    return SCRIPTS if label.startswith(("our", "warm")) else BY_HAND


def construction(plain: list[redis.Redis], shas: list[str], n: int) -> str:
    """What building each lock object over 3 masters costs alone (no I/O)."""
    makers: list[tuple[str, Callable[[str], object]]] = [
        (FLOOR, lambda name: HandRedlock(plain[:3], name, ttl=10, shas=shas[:3])),
        (OURS_3, lambda name: Redlock(plain[:3], name, ttl=10)),
        (
            POTTERY_3,
            lambda name: pottery.Redlock(key=name, masters=set(plain[:3]), auto_release_time=10),
        ),
    ]
    lines = ["Building one lock object over 3 masters, no I/O (µs, median of 5 batches):"]
    for label, make in makers:
        batches = []
        for batch in range(5):
            names = [f"bench:build:{batch}:{i}" for i in range(n)]
            t0 = time.perf_counter_ns()
            for name in names:
                make(name)
            batches.append((time.perf_counter_ns() - t0) / n / 1000)
        lines.append(f"  {label:75} {statistics.median(batches):7.2f}")
    return "\n".join(lines)


def profile_redlock(plain: list[redis.Redis], n: int) -> str:
    """cProfile of our cold `Redlock` (3 masters) round: the top entries by own time, then
    the cumulative time of its parts."""
    for i in range(200):
        lock = Redlock(plain[:3], f"bench:profile-warmup:{i}", ttl=10)
        lock.acquire(blocking=False)
        lock.release()
    names = [f"bench:profile:{i}" for i in range(n)]
    prof = cProfile.Profile()
    prof.enable()
    for name in names:
        lock = Redlock(plain[:3], name, ttl=10)
        if not lock.acquire(blocking=False):
            raise RuntimeError("profile: uncontended acquire failed")
        lock.release()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(r"celery_redlock", 30)
    return out.getvalue()


def commands_table(cases: list[Case]) -> str:
    rows = [
        "| implementation | commands per round, all masters (scripts' inner calls included) "
        "| server µs per round in what the client sent |",
        "|---|---|---:|",
    ]
    for case in cases:
        found = case.per_round()
        shown = ", ".join(
            f"{k.upper()} {v:.3g}" for k, v in sorted(found.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        rows.append(f"| {case.label} | {shown} | {case.script_usec(sent_by(case.label)):.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5000, help="measured rounds per row")
    parser.add_argument("--blocks", type=int, default=50, help="interleaved blocks")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument(
        "--stopped-rounds",
        type=int,
        default=1000,
        help="rounds of our 3-master Redlock with one master stopped (SIGSTOP)",
    )
    _servers.add_pin_option(parser)
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="construction costs, and a cProfile of our cold Redlock (3 masters) round",
    )
    opts = parser.parse_args()
    load_before = os.getloadavg()[0]
    pin, server_cpus, client_cpus = _servers.placement(opts.pin)
    _servers.pin_self(client_cpus)

    with servers(5, server_cpus) as procs:
        # One client per master, as users build them, shared by every row.
        admins = [s.client() for s in procs]
        shas = [c.script_load(COMPARE_AND_DELETE) for c in admins]
        cases = build_cases(procs, shas)
        for case in cases:
            case.run(opts.warmup, keep=False)
        per_block = max(1, opts.rounds // opts.blocks)
        for block in range(opts.blocks):  # rotate the order: background load hits all alike
            for k in range(len(cases)):
                cases[(block + k) % len(cases)].run(per_block, admins=admins)
            print(f"  block {block + 1}/{opts.blocks}", file=sys.stderr, end="\r")
        print(file=sys.stderr)
        profile = ""
        if opts.profile:
            fresh = [s.client() for s in procs]
            profile = construction(fresh, shas, 1000) + "\n\n" + profile_redlock(fresh, 2000)
        plain = [s.client() for s in procs]
        stopped = Case(STOPPED, lambda name: Redlock(plain[:3], name, ttl=10))
        per_node = Redlock(plain[:3], "bench:probe", ttl=10).per_node_timeout
        stopped.run(opts.warmup, keep=False)  # healthy: connected, scripts loaded
        victim = procs[2]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            print(f"  master 3 (pid {victim.pid}) stopped", file=sys.stderr)
            stopped.run(opts.stopped_rounds)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        print(f"  master 3 (pid {victim.pid}) resumed", file=sys.stderr)
        stop_renewal()

    command = " ".join(["bench/bench_redlock.py", *sys.argv[1:]])
    by_label = {case.label: case for case in cases}
    floor = statistics.median(by_label[FLOOR].times)
    three = statistics.median(by_label[OURS_3].times)
    vs_floor = by_label[OURS_3].vs(by_label[FLOOR])
    vs_pottery = by_label[OURS_3].vs(by_label[POTTERY_3])
    stopped_p50 = statistics.median(stopped.times)
    added_ms = (stopped_p50 - three) / 1000
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} with `{command}`: "
        f"{per_block * opts.blocks} acquire+release rounds per row, each on a new lock "
        f"object and a name never used before (the warm row apart), in {opts.blocks} "
        f"interleaved blocks (+{opts.warmup} warm-up), five redis-server {server_version()} "
        f"on loopback, {_servers.describe_pin(pin, server_cpus, client_cpus)}, "
        f"`redis.Redis(host, port)` clients with redis-py's defaults, Python "
        f"{platform.python_version()}, redis-py {redis.__version__}, pottery "
        f"{importlib.metadata.version('pottery')}, {os.cpu_count()} CPUs "
        f"({platform.machine()}). Client CPU: this process's CPU time (every thread) per "
        "round, median block; server µs: the masters' time in the commands the client sent, "
        'per round, median block; "vs": the median over blocks of the ratio of the two '
        "rows' p50 in the same block. Each row has clients of its own.",
        "",
        "| implementation | p50 (µs) | p99 (µs) | p50 vs our `Lock` | p50 vs by-hand floor "
        "| client CPU (µs) | server µs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        p50 = statistics.median(case.times)
        lines.append(
            f"| {case.label} | {p50:.0f} | {pct(case.times, 99):.0f} | "
            f"{case.vs(by_label[LOCK_1]):.2f}x | {case.vs(by_label[FLOOR]):.2f}x | "
            f"{statistics.median(case.cpu):.0f} | "
            f"{case.script_usec(sent_by(case.label)):.1f} |"
        )
    lines += [
        "",
        f"Our `Redlock` (3 masters) p50 vs by-hand floor: {vs_floor:.2f}x "
        f"({three:.0f} µs / {floor:.0f} µs over all rounds); vs pottery's: {vs_pottery:.2f}x.",
        "",
        "Commands the masters ran per round, same blocks:",
        "",
        commands_table(cases),
        "",
        f"One master stopped (SIGSTOP on master 3 of 3, resumed after; "
        f"{len(stopped.times)} rounds after the interleaved blocks): our `Redlock` "
        f"(3 masters) p50 {stopped_p50:.0f} µs, p99 {pct(stopped.times, 99):.0f} µs, client "
        f"CPU {statistics.median(stopped.cpu):.0f} µs per round; healthy p50 {three:.0f} µs; "
        f"per-node timeout in force {per_node * 1000:.0f} ms (`Redlock.per_node_timeout`).",
        "",
        f"Other load on the machine (1-minute load average) at start: {load_before:.2f}, "
        f"at end: {os.getloadavg()[0]:.2f}.",
    ]
    # The budgets go to the terminal only: docs/benchmarks.md has them in one table.
    budgets = [
        "Budgets (issues 29, 38):",
        "",
        f"- our `Redlock` (3 masters) p50 <= 1.3x the by-hand floor: {vs_floor:.2f}x, "
        f"{mark(vs_floor <= 1.3)}",
        f"- our `Redlock` (3 masters) ahead of pottery's: {vs_pottery:.2f}x its p50, "
        f"{mark(vs_pottery < 1.0)}",
        f"- one master stopped adds at most the per-node timeout ({per_node * 1000:.0f} ms) "
        f"to the p50: {added_ms:+.1f} ms ({stopped_p50:.0f} µs stopped vs {three:.0f} µs "
        f"healthy), {mark(added_ms <= per_node * 1000)}",
    ]
    body = "\n".join(lines)
    print("\n" + body + "\n\n" + "\n".join(budgets))
    if profile:
        print("\n" + profile)
    if opts.write_docs:
        write_block(SECTION, "bench_redlock.py", body)
        print(f"\nwrote {DOCS}")


def mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def server_version() -> str:
    binary = shutil.which("redis-server") or shutil.which("valkey-server") or "redis-server"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    for word in out.split():
        if word.startswith("v="):
            return word[2:]
    return "?"


if __name__ == "__main__":
    main()
