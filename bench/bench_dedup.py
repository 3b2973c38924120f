"""Publish throughput of ``apply_async``: plain vs ``lock_on="enqueue"`` vs celery-once's and
celery-singleton's enqueue-time locks, in one run.

Run by hand (not part of the test suite)::

    .venv/bin/python bench/bench_dedup.py [--calls 5000] [--reps 5] [--pin split|same|none]

It starts its own throwaway redis-server on a free loopback port (no persistence) and
stops it by pid at the end, also on error or Ctrl-C. The broker (db 0) and every lock
(db 1 for celery-redlock, db 2 for celery-once, db 3 for celery-singleton) live on that
one server; no worker runs: only the publishing side is timed. ``--pin`` places the
server and this process as in bench_lock.py (split by default). Each variant publishes
``--calls`` calls of a one-argument task from this process, as fast as it can, with a
new argument per call (every call is sent: the enqueue-time lock is taken, never
refused), then its queue and its locks are deleted (outside the clock). The variants:

* ``plain``        a plain ``@app.task``: Celery's own publish;
* ``floor``        the floor of issue 29, a de-duplicating publish by hand: one
                   ``SET b:<n> <task id> NX PX 3600000`` on the lock server (db 1, a plain
                   redis-py client), then the plain task's ``apply_async`` with that task
                   id, sent only when the SET succeeded;
* ``enqueue``      ``base=LockedTask, lock_on="enqueue"``: one enqueue script per call;
* ``enqueue+run``  the same with ``lock_on="enqueue+run"`` (the script also looks at the
                   lock itself, which is free);
* ``celery-once``  ``base=QueueOnce`` (its Redis backend: a lock script per call);
* ``singleton``    ``base=Singleton`` (celery-singleton: ``SET NX`` per call);
* ``duplicate``    ``lock_on="enqueue+run"`` with one argument for every call: the first
                   is sent, every other call is a duplicate (returns the queued task's
                   ``AsyncResult``, nothing sent), as beat or a busy view would see it.

Variants are interleaved ``--reps`` times, each rep starting one variant later than
the one before, so no variant always runs first; the median rate of each is printed
with its ratio to ``plain`` and to ``floor``. Budgets (issue 29), against rows of the
same run: ``enqueue`` within 3% of the floor (at least 0.97x its calls/s) and ahead of
both celery-once and celery-singleton.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import _servers  # noqa: E402

VARIANTS = ("plain", "floor", "enqueue", "enqueue+run", "celery-once", "singleton", "duplicate")
#: Each variant's queue (the floor publishes a plain task on its own queue).
QUEUES = {
    "plain": "q-plain",
    "floor": "q-floor",
    "enqueue": "q-enqueue",
    "enqueue+run": "q-enqueue-run",
    "celery-once": "q-once",
    "singleton": "q-singleton",
    "duplicate": "q-duplicate",
}
#: Issue 29: ``enqueue`` at least this fraction of the floor's calls/s.
FLOOR_BUDGET = 0.97


def tasks_of(port: int) -> dict[str, Any]:
    """One Celery app with one task per variant (each on its own queue; the floor's is a
    plain task): the task objects, by variant."""
    from celery import Celery  # noqa: PLC0415 - after sys.path is set
    from celery_once import QueueOnce  # noqa: PLC0415
    from celery_singleton import Singleton  # noqa: PLC0415

    from celery_redlock import LockedTask  # noqa: PLC0415

    base = f"redis://127.0.0.1:{port}"
    app = Celery("benchdedup", broker=f"{base}/0", set_as_current=False)
    app.conf.update(
        redlock_url=f"{base}/1",
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": f"{base}/2", "default_timeout": 3600},
        },
        singleton_backend_url=f"{base}/3",
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
    )

    def body(n: int) -> int:
        return n

    tasks: dict[str, Callable[..., Any]] = {
        "plain": app.task(name="b.plain", shared=False, queue="q-plain")(body),
        "enqueue": app.task(
            name="b.enqueue",
            base=LockedTask,
            shared=False,
            queue="q-enqueue",
            lock_key="b:<n>",
            lock_on="enqueue",
        )(body),
        "enqueue+run": app.task(
            name="b.enqueue_run",
            base=LockedTask,
            shared=False,
            queue="q-enqueue-run",
            lock_key="br:<n>",
            lock_on="enqueue+run",
        )(body),
        "celery-once": app.task(
            name="b.once", base=QueueOnce, shared=False, queue="q-once", once={"graceful": True}
        )(body),
        "singleton": app.task(
            name="b.singleton", base=Singleton, shared=False, queue="q-singleton"
        )(body),
        "duplicate": app.task(
            name="b.duplicate",
            base=LockedTask,
            shared=False,
            queue="q-duplicate",
            lock_key="dup",
            lock_on="enqueue+run",
        )(body),
    }
    tasks["floor"] = app.task(name="b.floor", shared=False, queue="q-floor")(body)
    app.finalize()
    return tasks


def build(port: int) -> dict[str, Callable[[int], Any]]:
    """For each variant, the call that publishes one call of it with argument *n*."""
    import redis  # noqa: PLC0415
    from kombu.utils.uuid import uuid  # noqa: PLC0415 - the task ids Celery makes itself

    base = f"redis://127.0.0.1:{port}"
    tasks = tasks_of(port)

    hand = redis.Redis.from_url(f"{base}/1")  # the lock server, as a hand-written one

    def floor(n: int) -> Any:
        """The floor: one SET NX PX, then the publish (only when the SET succeeded)."""
        task_id = uuid()
        if hand.set(f"bf:{n}", task_id, nx=True, px=3_600_000):
            return tasks["floor"].apply_async((n,), task_id=task_id)
        return None

    publish: dict[str, Callable[[int], Any]] = {
        v: (lambda n, task=task: task.apply_async((n,))) for v, task in tasks.items()
    }
    publish["floor"] = floor
    return publish


def one_run(publish: Callable[[int], Any], variant: str, calls: int, offset: int) -> float:
    """Publish *calls* calls with *publish*; calls per second."""
    args = [0] * calls if variant == "duplicate" else [offset + i for i in range(calls)]
    started = time.perf_counter()
    for n in args:
        publish(n)
    return calls / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per variant and rep")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--warmup", type=int, default=300, help="calls per variant, untimed")
    _servers.add_pin_option(parser)
    options = parser.parse_args()
    pin, server_cpus, client_cpus = _servers.placement(options.pin)
    _servers.pin_self(client_cpus)
    logging.disable(logging.INFO)  # the duplicate variant logs one line per refused call
    warnings.simplefilter("ignore")
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with _servers.running(cpus=server_cpus) as server:
        publish = build(server.port)
        client = server.client()

        def reset() -> None:
            for db in range(4):
                server.client(db=db).flushdb()

        offset = 0
        for variant in VARIANTS:  # connections made, scripts loaded, classes resolved
            one_run(publish[variant], variant, options.warmup, offset)
            offset += options.warmup
        reset()
        for rep in range(options.reps):
            order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
            for variant in order:
                rates[variant].append(one_run(publish[variant], variant, options.calls, offset))
                offset += options.calls
                sent = sum(client.llen(queue) for queue in QUEUES.values())
                expected = 1 if variant == "duplicate" else options.calls
                if sent != expected:
                    raise SystemExit(f"{variant}: {sent} messages queued, expected {expected}")
                reset()
            print(f"rep {rep + 1}/{options.reps} done", file=sys.stderr)
        version = server.version()
    median = {v: statistics.median(rates[v]) for v in VARIANTS}

    def paired(variant: str, base: str) -> float:
        """Median over reps of the ratio to *base* in the same rep (the same background)."""
        return statistics.median(a / b for a, b in zip(rates[variant], rates[base], strict=True))

    print(
        f"apply_async publish rate, {options.calls} calls x {options.reps} reps, "
        f"redis-server {version}, one process, "
        f"{_servers.describe_pin(pin, server_cpus, client_cpus)}; every call a new argument "
        "(a new key) but 'duplicate'. Median calls/s; ratios: the median over reps of the "
        "ratio to plain, to the by-hand floor, in the same rep:"
    )
    for variant in VARIANTS:
        spread = ", ".join(f"{r:,.0f}" for r in rates[variant])
        print(
            f"  {variant:12s} {median[variant]:9,.0f}/s  {paired(variant, 'plain'):5.2f}x plain"
            f"  {paired(variant, 'floor'):5.2f}x floor   ({spread})"
        )
    print()
    ratios = {v: paired(v, "floor") for v in ("enqueue", "celery-once", "singleton")}
    print("\n".join(budgets(median, ratios)))


def budgets(median: dict[str, float], vs_floor: dict[str, float]) -> list[str]:
    """The budgets of issue 29, met or MISSED, against rows of the same run (ratios to the
    floor paired by rep)."""

    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    ours, once, singleton = vs_floor["enqueue"], vs_floor["celery-once"], vs_floor["singleton"]
    return [
        "Budgets (issue 29):",
        "",
        f'- `lock_on="enqueue"` >= {FLOOR_BUDGET}x the by-hand floor (SET NX PX, then the '
        f"publish): {ours:.3f}x ({median['enqueue']:,.0f} / {median['floor']:,.0f} calls/s), "
        f"{mark(ours >= FLOOR_BUDGET)}",
        f'- `lock_on="enqueue"` ahead of celery-once: {ours / once:.2f}x, {mark(ours > once)}',
        f'- `lock_on="enqueue"` ahead of celery-singleton: {ours / singleton:.2f}x, '
        f"{mark(ours > singleton)}",
    ]


if __name__ == "__main__":
    main()
