"""The acquire a task's run takes with no ``lock_limits``: its server time and its cycle.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_run_acquire.py [--cycles 2000] [--pin split|same|none]

It starts its own throwaway redis-server on a free loopback port and stops it by pid at
the end. Each cycle builds a ``Lock`` on a fresh name, as a ``LockedTask`` run does
(``hold_with((), controlled=True)``: the name's operator controls apply), acquires and
releases it. A first pass of ``--cycles`` prints the server's ``usec_per_call`` of
``evalsha`` (``INFO commandstats``: the acquire and the release together) and the wall
time of one cycle on this side; a second pass, with ``SLOWLOG`` logging every command,
splits the server time by script (medians; the log's own cost is in them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

import _servers
import redis

from celery_redlock import Lock
from celery_redlock.core.backends.redis import scripts
from celery_redlock.core.renewal import shutdown as stop_renewal


def _all_scripts() -> Iterator[scripts.Script]:
    """Every script of the Redis backend, as it is and as a plain server runs it."""
    for value in vars(scripts).values():
        if isinstance(value, scripts.Script):
            yield value
            yield value.indexed


def _cycles(client: redis.Redis, label: str, cycles: int) -> float:
    """*cycles* runs' acquire and release on fresh names: µs a cycle."""
    start = time.perf_counter_ns()
    for i in range(cycles):
        lock = Lock(client, f"bench:{label}:{i}", ttl=30, auto_renew=False)
        lock.hold_with((), controlled=True)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"acquire refused ({lock.refused_by} {lock.refusal})")
        lock.release()
    return (time.perf_counter_ns() - start) / cycles / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=2000)
    _servers.add_pin_option(parser)
    opts = parser.parse_args()
    mode, server_cpus, client_cpus = _servers.placement(opts.pin)
    with _servers.running(cpus=server_cpus) as server:
        _servers.pin_self(client_cpus)
        client, admin = server.client(), server.client()
        _cycles(client, "warm", 100)  # scripts loaded, connections made
        admin.config_resetstat()
        wall = _cycles(client, "run", opts.cycles)
        stats = admin.info("commandstats")
        admin.config_set("slowlog-max-len", 40 * opts.cycles)
        admin.config_set("slowlog-log-slower-than", 0)
        admin.slowlog_reset()
        _cycles(client, "logged", opts.cycles)
        admin.config_set("slowlog-log-slower-than", 10_000)
        logged = admin.slowlog_get(40 * opts.cycles)
        version = server.version()
        stop_renewal()
    print(f"redis-server {version}, {_servers.describe_pin(mode, server_cpus, client_cpus)}")
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        if name in stats:
            row = stats[name]
            print(f"{name[8:]}: {row['calls']} calls, {row['usec_per_call']:.2f} usec_per_call")
    print(f"{opts.cycles} cycles: {wall:.1f} µs a cycle (acquire + release, Python side)")
    names = {s.sha: s.name for s in _all_scripts()}
    times: dict[str, list[int]] = {}
    for entry in logged:
        words = entry["command"].split()
        if words and words[0].lower() == b"evalsha":
            name = names.get(words[1].decode(), words[1].decode())
            times.setdefault(name, []).append(int(entry["duration"]))
    for name, took in sorted(times.items()):
        print(f"  {name}: {len(took)} calls, {statistics.median(took)} µs median (SLOWLOG on)")


if __name__ == "__main__":
    main()
