"""The board's event log: what writing a run's lock events costs the process that runs
the tasks (the recorder thread shares its CPU).

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_event_log.py [--blocks 7] [--write-docs]

On a throwaway redis-server, batches of 2, 20 and 200 ``acquired`` events (what a worker
child gathers in one 0.25 s flush at about 4, 40 and 400 tasks a second) are written
to one log, and the client CPU per event is measured (``time.process_time``) for:

- *by hand*: ``json.dumps(..., default=str)`` per event, then one redis-py pipeline of
  ``XADD ... MAXLEN ~`` per event and a ``PEXPIRE`` (the obvious way);
- *ours*: ``event_json`` per event, then ``RedisBackend.log_events``.

The two run in alternating blocks; each figure is the best block (the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from _docs import write_block  # noqa: E402
from servers import start_servers  # noqa: E402

from celery_redlock import connect  # noqa: E402
from celery_redlock.app.event_log import LOG_TTL_MS, MAXLEN, event_json, log_key  # noqa: E402
from celery_redlock.core import open_backend  # noqa: E402
from celery_redlock.core.backend import EventLog, need  # noqa: E402
from celery_redlock.core.events import LockEvent  # noqa: E402

HOLDER = {"task_name": "proj.sync", "task_id": "3f0e8a52-5b1e-4c53-9a2e-0d6c1f7b9e21",
          "hostname": "celery@worker-1", "pid": 4242}  # fmt: skip
LOG = log_key("redlock:")


def _events(batch: int) -> list[LockEvent]:
    return [
        LockEvent("acquired", f"sync:{i}", f"redlock:{{sync:{i}}}", fence=i, holder=HOLDER,
                  waited=0.0012)
        for i in range(batch)
    ]  # fmt: skip


def _fields(e: LockEvent) -> dict[str, Any]:
    return {"kind": e.kind, "name": e.name, "at": e.at, "fence": e.fence, **e.holder,
            "waited": e.waited}  # fmt: skip


def by_hand(
    client: Any,
) -> tuple[Callable[[list[LockEvent]], list[str]], Callable[[list[str]], None]]:
    def encode(events: list[LockEvent]) -> list[str]:
        return [json.dumps(_fields(e), default=str) for e in events]

    def write(texts: list[str]) -> None:
        pipe = client.pipeline(transaction=False)
        for text in texts:
            pipe.xadd(LOG, {"e": text}, maxlen=MAXLEN, approximate=True)
        pipe.pexpire(LOG, LOG_TTL_MS)
        pipe.execute()

    return encode, write


def ours(client: Any) -> tuple[Callable[[list[LockEvent]], list[str]], Callable[[list[str]], None]]:
    store = need(open_backend(client), EventLog)

    def encode(events: list[LockEvent]) -> list[str]:
        return [event_json(e) for e in events]

    def write(texts: list[str]) -> None:
        store.log_events(LOG, texts, MAXLEN, LOG_TTL_MS)

    return encode, write


def measure(make: Any, client: Any, batch: int, rounds: int) -> tuple[float, float]:
    """(encode, write) client CPU µs per event over *rounds* batches."""
    encode, write = make(client)
    events = _events(batch)
    t0 = time.process_time()
    for _ in range(rounds):
        texts = encode(events)
    t1 = time.process_time()
    for _ in range(rounds):
        write(texts)
    t2 = time.process_time()
    per = 1e6 / (rounds * batch)
    return (t1 - t0) * per, (t2 - t1) * per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--write-docs", action="store_true")
    opts = parser.parse_args()
    (server,) = start_servers(1)
    try:
        client = connect(server.url)
        rows = []
        for batch in (2, 20, 200):
            rounds = max(20, 4000 // batch)
            best: dict[str, tuple[float, float]] = {}
            for _ in range(opts.blocks):
                for name, make in (("by hand", by_hand), ("ours", ours)):
                    got = measure(make, client, batch, rounds)
                    seen = best.get(name, (1e9, 1e9))
                    best[name] = (min(seen[0], got[0]), min(seen[1], got[1]))
            hand, our = best["by hand"], best["ours"]
            rows.append(
                f"| {batch} | {hand[0]:.1f} + {hand[1]:.1f} = {sum(hand):.1f} "
                f"| {our[0]:.1f} + {our[1]:.1f} = {sum(our):.1f} | {sum(our) / sum(hand):.2f}x |"
            )
        client.close()
    finally:
        server.stop()
    table = "\n".join(
        [
            "| events a flush | by hand: JSON + pipeline of XADD, µs CPU an event | ours: "
            "`event_json` + `log_events`, µs CPU an event | ours / by hand |",
            "|---:|---:|---:|---:|",
            *rows,
        ]
    )
    print(table)
    if opts.write_docs:
        write_block("## The board", "bench_event_log.py", table)


if __name__ == "__main__":
    main()
