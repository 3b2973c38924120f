"""Renewal cost: commands per node per renewal round as the number of held locks grows.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_renewal.py [--ttl 3] [--rounds 5] [--write-docs]

Two runs, each on throwaway servers it starts and stops by pid:

1. One process holds 1,000 locks on one Redis and on three Redlock masters; the
   renewal thread keeps them alive for ``--rounds`` rounds. Reported: scripts each
   node ran per round (INFO commandstats), and whether every lock is still owned.
2. A three-master Redis Cluster; 4 processes hold 1,000, 5,000 and then 10,000 locks
   between them (names spread over the slots). Reported per size: scripts per node
   per round, renewal commands per process per round, and whether every lock is
   still owned at the end.

The budgets: at most one script per node per renewal round for 1,000 locks held by
one process (issues 16 and 23), flat as the number of locks grows (issue 16).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _docs import write_block  # noqa: E402
from servers import ClusterSetup, RedisServer, start_servers  # noqa: E402

from celery_redlock import Lock, Redlock, connect  # noqa: E402
from celery_redlock.core.renewal import get_manager  # noqa: E402


def scripts_run(server: RedisServer) -> int:
    """EVALSHA + EVAL calls the server counted since its stats were reset."""
    return server.command_count("evalsha") + server.command_count("eval")


def hold_and_count(
    make: Any, servers: list[RedisServer], n: int, ttl: float, rounds: int
) -> tuple[float, bool]:
    """Hold *n* locks made by *make(name)*; scripts per node per round over *rounds*."""
    locks = [make(f"bench:renew:{i}") for i in range(n)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    manager = get_manager()
    first = manager.rounds
    deadline = time.monotonic() + 10 * ttl
    while manager.rounds == first and time.monotonic() < deadline:
        time.sleep(0.01)
    for server in servers:
        server.reset_stats()
    start = manager.rounds
    while manager.rounds < start + rounds and time.monotonic() < deadline + rounds * ttl:
        time.sleep(0.01)
    done = manager.rounds - start
    per_node = max(scripts_run(s) for s in servers) / max(done, 1)
    owned = all(lock.owned() for lock in locks)
    for lock in locks:
        lock.release()
    return per_node, owned


def _cluster_holder(
    nodes: list[tuple[str, int]],
    first: int,
    count: int,
    ttl: float,
    ready: Any,
    stop: Any,
    out: Any,
) -> None:
    host, port = nodes[0]
    client = connect(f"redis://{host}:{port}/0", cluster=True)
    locks = [Lock(client, f"scale:{i}", ttl=ttl) for i in range(first, first + count)]
    for lock in locks:
        if not lock.acquire(blocking=False):
            raise SystemExit(f"could not take {lock.name}")
    manager = get_manager()
    ready.set()
    start = manager.rounds
    stop.wait(120)
    rounds = manager.rounds - start
    out.put((os.getpid(), rounds, all(lock.owned() for lock in locks)))
    for lock in locks:
        lock.release()


def cluster_scale(total: int, ttl: float, rounds: int, processes: int = 4) -> dict[str, Any]:
    """*total* locks over *processes* processes on a fresh 3-master cluster."""
    cluster = ClusterSetup.start()
    ctx = multiprocessing.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(processes)]
    share = total // processes
    procs = [
        ctx.Process(
            target=_cluster_holder,
            args=(cluster.startup_nodes, p * share, share, ttl, readies[p], stop, out),
        )
        for p in range(processes)
    ]
    try:
        for proc in procs:
            proc.start()
        for ready in readies:
            ready.wait(300)
        time.sleep(ttl)  # every process past its first round
        for node in cluster.nodes:
            node.reset_stats()
        began = time.monotonic()
        time.sleep(rounds * ttl / 3)
        elapsed = time.monotonic() - began
        scripts = [scripts_run(node) for node in cluster.nodes]
        stop.set()
        results = [out.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        cluster.stop()
    interval = ttl / 3
    per_round = elapsed / interval
    return {
        "locks": total,
        "scripts per node per round": max(scripts) / per_round,
        "renewal commands per process per round": sum(scripts) / per_round / processes,
        "all owned": all(ok for _, _, ok in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttl", type=float, default=3.0, help="lock TTL (rounds every TTL/3)")
    parser.add_argument("--rounds", type=int, default=5, help="renewal rounds measured")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    command = " ".join(["bench/bench_renewal.py", *sys.argv[1:]])
    load_before = os.getloadavg()[0]
    lines: list[str] = [f"Measured {time.strftime('%Y-%m-%d')} with `{command}`.", ""]

    def say(line: str = "") -> None:
        print(line)
        lines.append(line)

    say(f"1,000 locks in one process, TTL {args.ttl} s, {args.rounds} rounds\n")
    say("| store | scripts per node per round | every lock owned |")
    say("|---|---:|---|")
    single = RedisServer.start()
    try:
        client = single.client()
        per_node, owned = hold_and_count(
            lambda n: Lock(client, n, ttl=args.ttl), [single], 1000, args.ttl, args.rounds
        )
        say(f"| one Redis | {per_node:.2f} | {owned} |")
    finally:
        single.stop()
    masters = start_servers(3)
    try:
        clients = connect([m.url for m in masters])
        per_node, owned = hold_and_count(
            lambda n: Redlock(clients, n, ttl=args.ttl), masters, 1000, args.ttl, args.rounds
        )
        say(f"| Redlock, 3 masters | {per_node:.2f} | {owned} |")
    finally:
        for master in masters:
            master.stop()

    say()
    say(f"Redis Cluster, 3 masters, 4 processes, TTL {args.ttl} s\n")
    say("| locks | scripts per node per round | commands per process per round | all owned |")
    say("|---:|---:|---:|---|")
    for total in (1000, 5000, 10000):
        row = cluster_scale(total, args.ttl, args.rounds)
        say(
            f"| {row['locks']:,} | {row['scripts per node per round']:.2f} | "
            f"{row['renewal commands per process per round']:.2f} | {row['all owned']} |"
        )
    say()
    say(
        f"Other load on the machine (1-minute load average) at start: {load_before:.2f}, "
        f"at end: {os.getloadavg()[0]:.2f}."
    )
    if args.write_docs:
        write_block("## Renewal", "bench_renewal.py", "\n".join(lines))


if __name__ == "__main__":
    main()
