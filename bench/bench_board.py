"""The board with many held locks: how long its pages take, and what a refresh asks of Redis.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_board.py [--keys 100000] [--runs 7]

It starts its own throwaway redis-server on a free loopback port and stops it by pid at
the end. It builds the keyspace as users do: a project of five ``LockedTask`` tasks, and
``--keys`` locks taken through the public API (``Lock(...).acquire()``, each a name never
used before), each leaving its lock and its fence counter (so ``2 * --keys`` keys). Then
it asks the board's WSGI app for ``/`` (the whole page, as a browser does), its live part
(what an open tab asks every second) and one key's page, ``--runs`` times each; releases
every lock (their counters stay, as they do for users) and asks for ``/`` again. It prints
the median and the slowest of each, and the Redis commands one request cost (``INFO
stats``, ``total_commands_processed``): they grow with what the page shows, not with the
keyspace. ``--tabs N`` then keeps N open tabs for ``--tab-seconds``: N threads, each asking
for the live part once a second as board.js does, and prints what they cost the Redis
server (``INFO cpu``: its user and system CPU over the wall time, in % of one core).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _servers
from celery import Celery
from werkzeug.test import Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_redlock import Lock, LockedTask
from celery_redlock.board import make_app

OWNER = {"task_name": "proj.sync", "task_id": "bench"}


def _project(url: str) -> Celery:
    """A project of five locked tasks (their rules show on the overview's rows)."""
    app = Celery("bench", broker="memory://", set_as_current=False)
    app.conf.redlock_url = url

    @app.task(base=LockedTask, shared=False, name="proj.sync", lock_key="sync:<n>")
    def sync(n: int) -> None: ...

    @app.task(base=LockedTask, shared=False, name="proj.report", lock_on_contended="skip")
    def report() -> None: ...

    @app.task(base=LockedTask, shared=False, name="proj.render", lock_key="render", lock_limit=3)
    def render() -> None: ...

    @app.task(base=LockedTask, shared=False, name="proj.mail", lock_key="mail:<to>")
    def mail(to: str) -> None: ...

    @app.task(base=LockedTask, shared=False, name="proj.imp", lock_key="imp:<a>", lock_on="enqueue")
    def imp(a: int) -> None: ...

    return app


def _take(client: Any, keys: int) -> list[Lock]:
    """*keys* locks, each on a new name, through the public API."""
    held = []
    for i in range(keys):
        lock = Lock(client, f"sync:{i:06d}", 3600, owner_info=OWNER, auto_renew=False)
        assert lock.acquire(blocking=False)
        held.append(lock)
    return held


def _commands(client: Any) -> int:
    return int(client.info("stats")["total_commands_processed"])


def _timed(
    board: Client, client: Any, path: str, runs: int, **headers: str
) -> tuple[list[float], int]:
    took, asked = [], 0
    for _ in range(runs):
        before = _commands(client)
        start = time.perf_counter()
        answer = board.get(path, headers=headers)
        answer.get_data()
        took.append(time.perf_counter() - start)
        asked = _commands(client) - before - 1  # the INFO itself
        assert answer.status_code == 200
    return took, asked


def _server_cpu(client: Any) -> float:
    """The Redis server's CPU seconds so far (user + system)."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _tabs(app: Any, client: Any, tabs: int, seconds: float) -> None:
    """*tabs* open tabs refreshing the overview's live part every second for *seconds*."""
    stop = threading.Event()
    asked = [0] * tabs

    def tab(i: int) -> None:
        board = Client(app)
        nxt = time.monotonic()
        while not stop.is_set():
            answer = board.get("/", headers={"X-Board-Part": "live"})
            assert answer.status_code == 200
            answer.get_data()
            asked[i] += 1
            nxt += 1.0
            stop.wait(max(0.0, nxt - time.monotonic()))

    threads = [threading.Thread(target=tab, args=(i,), daemon=True) for i in range(tabs)]
    cpu, start = _server_cpu(client), time.monotonic()
    for thread in threads:
        thread.start()
    stop.wait(seconds)
    stop.set()
    for thread in threads:
        thread.join(30)
    wall, used = time.monotonic() - start, _server_cpu(client) - cpu
    print(
        f"{tabs} open tabs for {wall:.0f} s ({sum(asked)} refreshes): Redis used "
        f"{used:.2f} s of CPU, {100 * used / wall:.1f}% of one core"
    )


def _show(label: str, took: list[float], asked: int) -> None:
    print(
        f"{label:36} median {statistics.median(took) * 1000:6.0f} ms, "
        f"slowest {max(took) * 1000:6.0f} ms, {asked} Redis commands"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tabs", type=int, default=0, help="open tabs to keep (0: none)")
    parser.add_argument("--tab-seconds", type=float, default=30.0)
    args = parser.parse_args()
    with _servers.running() as server:
        import redis  # noqa: PLC0415

        url = f"redis://{_servers.HOST}:{server.port}/0"
        client = redis.Redis(_servers.HOST, server.port)
        start = time.perf_counter()
        held = _take(client, args.keys)
        print(
            f"{args.keys} locks taken in {time.perf_counter() - start:.1f}s; "
            f"{client.dbsize()} keys in Redis"
        )
        wsgi = make_app(_project(url))
        board = Client(wsgi)
        for label, path, headers in (
            ("overview (/)", "/", {}),
            ("its live part (every second)", "/", {"X-Board-Part": "live"}),
            ("one key's page", "/key/sync%3A000042", {}),
        ):
            _show(label, *_timed(board, client, path, args.runs, **headers))
        if args.tabs:
            _tabs(wsgi, client, args.tabs, args.tab_seconds)
        start = time.perf_counter()
        for lock in held:
            lock.release()
        print(
            f"released in {time.perf_counter() - start:.1f}s; {client.dbsize()} keys left "
            "(fence counters, released tokens)"
        )
        _show("overview, nothing held (/)", *_timed(board, client, "/", args.runs))
        client.close()


if __name__ == "__main__":
    main()
