"""Flow-control benchmark: the acquire of a run's three holds against one plain ``Lock``.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_flow.py [--cycles 5000] [--blocks 50] [--warmup 500]
                                         [--pin split|same|none]
    .venv/bin/python bench/bench_flow.py --cluster   # a three-master Redis Cluster

It starts its own throwaway redis-server on a free loopback port (with ``--cluster``, a
three-master cluster from the tests' harness) and stops it by pid at the end (also on
error or Ctrl-C); every figure comes from the same servers in the same run, on a
``redis.Redis(host, port)`` client with redis-py's defaults; ``--pin`` places the server
and this process as in bench_lock.py (split by default). Four ways to take a lock, each
a new object on a fresh name per cycle (as a task's run does):

* ``Lock``: a plain lock (``acquire.lua``), the reference;
* ``Lock, controlled``: what a ``LockedTask`` run with no ``lock_limits`` takes, a lock
  whose acquire also reads its name's operator controls (``acquire.lua`` with its
  control hash; ``hold_all.lua`` before issue 46's hot path);
* ``Lock + Limit + Rate``: a run with a mutex, a ``Limit("all", 1000)`` and a
  ``Rate("p:acme", ...)`` that never refuses: three holds in one ``hold_all.lua`` (on a
  cluster the three names hash to different slots: one script per slot, sent at once);
* the floor: ``SET NX PX`` of the name by hand (one command, no fence, no record).

The ``acquire`` alone is timed (``time.perf_counter_ns``); the release follows, untimed,
so that the next cycle starts from the same state. Blocks of the four are interleaved
(rotating order) so background load hits them alike; p50/p99 over every cycle. Client
commands per acquire are the server's command count (INFO commandstats) less the calls
made inside scripts; "server µs" is the server's own time per script call.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _servers
import redis

from celery_redlock import Lock
from celery_redlock.core.backend_types import Rule
from celery_redlock.core.keys import lock_keys, permit_keys
from celery_redlock.core.renewal import shutdown as stop_renewal

#: One cycle: acquire (timed, returns the ns it took), then release.
Cycle = Callable[[int], int]


def _rules() -> list[Rule]:
    return [
        Rule(permit_keys("bench:all"), limit=1000),
        Rule(lock_keys("bench:p:acme"), interval_us=1, burst=10**6),
    ]


def _lock_cycle(client: redis.Redis, flow: str) -> Cycle:
    rules = _rules()

    def cycle(i: int) -> int:
        lock = Lock(client, f"bench:flow:{flow}:{i}", ttl=30, auto_renew=False)
        if flow == "controlled":
            lock.hold_with((), controlled=True)
        elif flow == "three":
            lock.hold_with(rules)
        clock = time.perf_counter_ns
        start = clock()
        got = lock.acquire(blocking=False)
        took = clock() - start
        if not got:
            raise RuntimeError(f"{flow}: acquire refused ({lock.refused_by} {lock.refusal})")
        lock.release()
        return took

    return cycle


def _floor_cycle(client: redis.Redis) -> Cycle:
    def cycle(i: int) -> int:
        key = f"bench:floor:{i}"
        clock = time.perf_counter_ns
        start = clock()
        got = client.set(key, "token", nx=True, px=30_000)
        took = clock() - start
        if not got:
            raise RuntimeError("floor: SET NX refused")
        client.delete(key)
        return took

    return cycle


VARIANTS: list[tuple[str, Callable[[redis.Redis], Cycle]]] = [
    ("Lock", lambda c: _lock_cycle(c, "plain")),
    ("Lock, controlled (a LockedTask run)", lambda c: _lock_cycle(c, "controlled")),
    ("Lock + Limit + Rate (three holds)", lambda c: _lock_cycle(c, "three")),
    ("floor: SET NX PX", _floor_cycle),
]


def _stats(admins: list[redis.Redis]) -> dict[str, Any]:
    """INFO commandstats summed over *admins* (calls; usec_per_call of the first that has
    the command)."""
    out: dict[str, Any] = {}
    for admin in admins:
        for name, fields in admin.info("commandstats").items():
            mine = out.setdefault(name, {**fields, "calls": 0})
            mine["calls"] += int(fields.get("calls", 0))
    return out


@contextlib.contextmanager
def _target(cluster: bool, cpus: set[int] | None) -> Iterator[tuple[Any, list[redis.Redis], str]]:
    """The client to bench, a plain client per server (for its stats), and a label. The
    server runs on *cpus* (a cluster's nodes are placed by the OS)."""
    if not cluster:
        with _servers.running(cpus=cpus) as server:
            yield server.client(), [server.client()], f"redis-server {server.version()}"
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from servers import ClusterSetup  # noqa: PLC0415 - the tests' harness, only here

    setup = ClusterSetup.start()
    try:
        admins = [node.client() for node in setup.nodes]
        yield setup.client(), admins, f"a {len(admins)}-master Redis Cluster"
    finally:
        setup.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5000)
    parser.add_argument("--blocks", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--cluster", action="store_true", help="on a Redis Cluster")
    _servers.add_pin_option(parser)
    args = parser.parse_args()
    pin, server_cpus, client_cpus = _servers.placement(args.pin)
    _servers.pin_self(client_cpus)
    with _target(args.cluster, server_cpus) as (client, admins, where):
        made = [(label, make(client)) for label, make in VARIANTS]
        serial = 0
        for _, cycle in made:
            for _ in range(args.warmup):
                serial += 1
                cycle(serial)
        samples: dict[str, list[int]] = {label: [] for label, _ in made}
        sent: dict[str, int] = dict.fromkeys(samples, 0)
        server_us: dict[str, list[float]] = {label: [] for label in samples}
        per_block = max(1, args.cycles // args.blocks)
        gc.disable()
        try:
            for block in range(args.blocks):
                order = made[block % len(made) :] + made[: block % len(made)]
                for label, cycle in order:
                    for admin in admins:
                        admin.config_resetstat()
                    for _ in range(per_block):
                        serial += 1
                        samples[label].append(cycle(serial))
                    stats = _stats(admins)
                    scripts = stats.get("cmdstat_evalsha", {})
                    # Ours: the scripts (the calls inside them are not sent by a client);
                    # the floor: its SET and DEL.
                    calls = int(scripts.get("calls", 0))
                    if not calls:
                        by_hand = ("cmdstat_set", "cmdstat_del")
                        calls = sum(int(stats.get(c, {}).get("calls", 0)) for c in by_hand)
                    sent[label] += calls
                    if scripts:
                        server_us[label].append(float(scripts["usec_per_call"]))
        finally:
            gc.enable()
        base = statistics.median(samples["Lock"])
        placed = _servers.describe_pin(pin, None if args.cluster else server_cpus, client_cpus)
        print(f"{where}, {args.cycles} acquires each, {args.blocks} blocks; {placed}")
        print(f"{'acquire':40} {'p50 µs':>8} {'p99 µs':>8} {'vs Lock':>8} {'trips':>6} "
              f"{'server µs/script':>17}")  # fmt: skip
        for label, values in samples.items():
            values.sort()
            p50 = statistics.median(values)
            p99 = values[int(len(values) * 0.99) - 1]
            per = sent[label] / len(values)
            inside = statistics.median(server_us[label]) if server_us[label] else float("nan")
            print(
                f"{label:40} {p50 / 1000:8.1f} {p99 / 1000:8.1f} {p50 / base:7.2f}x "
                f"{per:6.2f} {inside:17.2f}"
            )
        print("trips: commands a client sent per cycle, acquire and release (one each way)")
        stop_renewal()


if __name__ == "__main__":
    main()
