"""The board's overview with many keys: how long its first page takes to answer.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_board.py [--keys 100000] [--runs 5]

It starts its own throwaway redis-server on a free loopback port and stops it by pid at
the end. It takes one lock for real, copies its hash (``DUMP`` / ``RESTORE``) to
``--keys`` names under the prefix (the same bytes a worker's lock leaves), and asks the
board's WSGI app for ``/`` (the whole page, as a browser does) and for its live part (what
the page asks every second), ``--runs`` times each. It prints the slowest and the median;
the goal is a first page under 1 s with 100,000 keys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import _servers
from celery import Celery
from werkzeug.test import Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_redlock import Lock
from celery_redlock.board import make_app

BATCH = 5000


def _fill(client: object, keys: int) -> None:
    """*keys* copies of one real lock's hash, each under its own name."""
    lock = Lock(
        client,
        "bench:seed",
        3600,
        owner_info={"task_name": "proj.sync", "task_id": "x"},
        auto_renew=False,
    )
    assert lock.acquire(blocking=False)
    dumped = client.dump("redlock:{bench:seed}")  # type: ignore[attr-defined]
    pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
    for i in range(keys):
        pipe.restore(f"redlock:{{sync:{i:06d}}}", 3_600_000, dumped, replace=True)
        if i % BATCH == BATCH - 1:
            pipe.execute()
    pipe.execute()


def _timed(client: Client, path: str, runs: int, **headers: str) -> list[float]:
    took = []
    for _ in range(runs):
        start = time.perf_counter()
        answer = client.get(path, headers=headers)
        answer.get_data()
        took.append(time.perf_counter() - start)
        assert answer.status_code == 200
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with _servers.running() as server:
        import redis  # noqa: PLC0415

        client = redis.Redis(_servers.HOST, server.port)
        start = time.perf_counter()
        _fill(client, args.keys)
        print(f"{args.keys} locks written in {time.perf_counter() - start:.1f}s")
        app = Celery("bench", broker="memory://", set_as_current=False)
        app.conf.redlock_url = f"redis://{_servers.HOST}:{server.port}/0"
        board = Client(make_app(app))
        for label, path, headers in (
            ("first page (/)", "/", {}),
            ("live part (every second)", "/", {"X-Board-Part": "live"}),
            ("one key's page", "/key/sync%3A000042", {}),
        ):
            took = _timed(board, path, args.runs, **headers)
            print(
                f"{label:28} median {statistics.median(took) * 1000:7.0f} ms, "
                f"slowest {max(took) * 1000:7.0f} ms"
            )
        client.close()


if __name__ == "__main__":
    main()
