"""How far one locked run reaches into the package: files entered and calls made.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/profile_run.py [--runs 200] [--rules]

Starts its own throwaway redis-server on a free loopback port (see ``_servers``), defines
a ``LockedTask`` (``lock_key="sync:<user_id>"``, a new user id per run, so every run's
name is one never used before, as users' per-argument keys are) on an app with a memory
broker and eager results, warms it with a few runs, then profiles ``--runs`` eager
``apply()`` calls with cProfile and prints, per run:

* the package's files the run enters (a function of the file is called);
* calls into the package's functions (``ncalls`` summed over them);
* the distinct functions called;
* the same for the whole process (Celery, redis-py, the stdlib), for scale.

``--rules`` gives the task a ``lock_limits`` rule too (a run that takes two holds).
``--cpu`` measures instead of profiling: this process's CPU time and the wall time per
run over ``--runs`` runs, medians of five passes (to compare two trees, run each one
alternately, the other with ``PYTHONPATH`` at its checkout).
Issue 46's target: at most 8 files and 50 calls a run.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _servers
from celery import Celery

import celery_redlock
from celery_redlock import Limit, LockedTask

PACKAGE = str(Path(celery_redlock.__file__).resolve().parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rules", action="store_true", help="a lock_limits rule as well")
    parser.add_argument("--cpu", action="store_true", help="time the runs, no profile")
    args = parser.parse_args()
    server = _servers.start()
    try:
        app = Celery("profile_run", broker="memory://", backend="cache+memory://")
        app.conf.redlock_url = f"redis://{_servers.HOST}:{server.port}/1"
        rules = [Limit("imports", 4)] if args.rules else []

        @app.task(base=LockedTask, lock_key="sync:<user_id>", lock_limits=rules, shared=False)
        def sync(user_id: int) -> int:
            return user_id

        for user in range(20):  # warm: scripts loaded, options resolved, pools filled
            sync.apply(args=(-1 - user,)).get()
        if args.cpu:
            cpu, wall = [], []
            for rep in range(5):
                first = (rep + 1) * 1_000_000  # names never used before, every pass
                began, began_cpu = time.perf_counter(), time.process_time()
                for user in range(first, first + args.runs):
                    sync.apply(args=(user,)).get()
                cpu.append((time.process_time() - began_cpu) / args.runs * 1e6)
                wall.append((time.perf_counter() - began) / args.runs * 1e6)
            print(
                f"{celery_redlock.__file__}: {args.runs} eager runs x 5: "
                f"CPU {statistics.median(cpu):.0f} us a run, wall {statistics.median(wall):.0f} us"
            )
            return
        profile = cProfile.Profile()
        profile.enable()
        for user in range(args.runs):
            sync.apply(args=(user,)).get()
        profile.disable()
        stats = pstats.Stats(profile)
        ours: Counter[str] = Counter()
        functions = 0
        total = 0
        for (filename, _line, _name), (_cc, ncalls, *_rest) in stats.stats.items():
            total += ncalls
            if os.path.abspath(filename).startswith(PACKAGE):
                ours[os.path.relpath(filename, PACKAGE)] += ncalls
                functions += 1
        runs = args.runs
        print(f"{runs} eager runs on fresh names{' with a Limit rule' if args.rules else ''}")
        print(f"  package files entered: {len(ours)}")
        print(f"  calls into the package a run: {sum(ours.values()) / runs:.1f}")
        print(f"  distinct package functions: {functions}")
        print(f"  calls in the whole process a run: {total / runs:.1f}")
        for name, calls in ours.most_common():
            print(f"    {calls / runs:6.1f}  {name}")
        app.close()
    finally:
        _servers.stop(server)


if __name__ == "__main__":
    main()
