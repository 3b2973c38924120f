"""Where a locked run's microseconds go, beside a plain run and the lock taken by hand.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_run_groups.py [--runs 2000]

Starts its own throwaway redis-server on a free loopback port (see ``_servers``) and
stops it by pid. Three eager tasks on one app (memory broker, eager results), each run
on a user id never used before:

* ``plain``: the body alone;
* ``by hand``: the body inside redis-py's ``Lock`` on ``sync:<user_id>`` (``SET NX PX``,
  an owner-checked Lua release: the floor a lock can cost), on a default client;
* ``LockedTask``: ``lock_key="sync:<user_id>"``.

For each, ``--runs`` runs are timed without a profiler (this process's CPU a run, the
wall a run), then profiled with cProfile on this process's CPU clock (a read that waits for the
server counts only its CPU). The profile's own time per function is summed
by where the function lives: Celery (celery, kombu, billiard, vine), ours
(celery_redlock), redis-py's packing and parsing (redis), the socket (the socket and
select calls) and the rest (the stdlib, the interpreter's builtins). cProfile inflates
Python calls, so each group is given as its share of the profile times the unprofiled
CPU. The server's time is ``INFO commandstats`` (its ``usec`` of every command the runs
sent, divided by the runs), which no client profile sees.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _servers
import redis
from celery import Celery

import celery_redlock
from celery_redlock import LockedTask

OURS = str(Path(celery_redlock.__file__).resolve().parent)
GROUPS = ("Celery", "ours", "redis-py", "socket", "the rest")
_CELERY = ("celery", "kombu", "billiard", "vine")
_SOCKET_CALLS = ("sendall", "recv_into", "recv", "poll", "select", "send")


def group_of(filename: str, name: str) -> str:
    """The group of a profiled function (its file, or a builtin's name)."""
    if filename == "~":  # a builtin: a method of a socket, or the interpreter's own
        return "socket" if any(f"'{call}'" in name for call in _SOCKET_CALLS) else "the rest"
    path = os.path.abspath(filename)
    if path.startswith(OURS):
        return "ours"
    parts = Path(path).parts
    if "redis" in parts:
        return "redis-py"
    if any(part in parts for part in _CELERY):
        return "Celery"
    return "the rest"


def server_usec(client: redis.Redis) -> float:
    """The server's time in commands so far (µs), the ``INFO`` command's own left out."""
    stats: dict[str, Any] = client.info("commandstats")
    return sum(
        float(v["usec"]) for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config")
    )


def measure(
    run: Callable[[int], Any], runs: int, first: int, admin: redis.Redis
) -> dict[str, float]:
    """One variant: CPU and wall a run, then the profile's groups scaled to that CPU."""
    for user in range(first - 50, first):  # warm: scripts loaded, pools filled
        run(user)
    admin.config_resetstat()
    began, began_cpu = time.perf_counter(), time.process_time()
    for user in range(first, first + runs):
        run(user)
    cpu = (time.process_time() - began_cpu) / runs * 1e6
    wall = (time.perf_counter() - began) / runs * 1e6
    server = server_usec(admin) / runs
    profile = cProfile.Profile(time.process_time)  # CPU: a blocked read counts nothing
    profile.enable()
    for user in range(first + runs, first + 2 * runs):
        run(user)
    profile.disable()
    own: dict[str, float] = defaultdict(float)
    for (filename, _line, name), (_cc, _nc, tottime, *_rest) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        own[group_of(filename, name)] += tottime
    total = sum(own.values()) or 1.0
    row = {group: own[group] / total * cpu for group in GROUPS}
    row.update(cpu=cpu, wall=wall, server=server)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    server = _servers.start()
    try:
        url = f"redis://{_servers.HOST}:{server.port}/1"
        app = Celery("groups", broker="memory://", backend="cache+memory://")
        app.conf.redlock_url = url
        by_hand_client = redis.Redis.from_url(url)
        admin = server.client()

        @app.task(shared=False)
        def plain(user_id: int) -> int:
            return user_id

        @app.task(shared=False)
        def by_hand(user_id: int) -> int:
            with by_hand_client.lock(f"sync:{user_id}", timeout=60, blocking=False):
                return user_id

        @app.task(base=LockedTask, lock_key="sync:<user_id>", shared=False)
        def locked(user_id: int) -> int:
            return user_id

        variants = {"plain": plain, "by hand": by_hand, "LockedTask": locked}
        rows = {}
        for n, (label, task) in enumerate(variants.items()):
            rows[label] = measure(
                lambda user, task=task: task.apply(args=(user,)).get(),
                args.runs,
                (n + 1) * 10_000_000,
                admin,
            )
        print(f"{args.runs} eager runs each on fresh names; µs a run (redis {server.version()})")
        heads = ["", *variants]
        print("| " + " | ".join(heads) + " |")
        print("|---" + "|---:" * len(variants) + "|")
        titles = {"cpu": "client CPU", "server": "the server's commands", "wall": "wall"}
        for key in ("cpu", *GROUPS, "server", "wall"):
            cells = [f"{rows[v][key]:.0f}" for v in variants]
            print(f"| {titles.get(key, '- ' + key)} | " + " | ".join(cells) + " |")
        by_hand_client.close()
        admin.close()
        app.close()
    finally:
        _servers.stop(server)


if __name__ == "__main__":
    main()
