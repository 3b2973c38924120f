"""Instructions per Celery task and per lock script, counted by callgrind: a noise-free measure.

Run by hand (not part of the test suite; needs valgrind)::

    .venv/bin/python bench/bench_instructions.py [--variants plain,floor,core,locked,rt2]
                                                 [--tasks 200] [--warmup 100] [--no-server]

Task throughput on a shared 2-vCPU VM moves by a quarter from one run to the
next (see ``bench_tasks.py`` and docs/benchmarks.md), far more than a change of a
few microseconds in our code. Instructions do not move with the machine: two
runs of the same code agree to about 1%.

**Client side.** For each variant of ``bench/taskapp.py`` (the very tasks
``bench_tasks.py`` runs), Celery's tracer (``celery.app.trace.build_tracer``,
what a prefork pool child runs per task) runs the task in one process against
a throwaway redis-server, under ``valgrind --tool=callgrind``, twice: once for
``--warmup`` tasks and once for ``--warmup`` + ``--tasks``. The difference,
divided by ``--tasks``, is the client's instructions per task, everything
included (Celery's tracer, the body's counter ``INCR``, the lock). Before the
tasks run, ``worker_process_init`` is sent, as in a pool child. Variants with
``--stub`` run with every lock script replaced by a canned answer: only the
Python that is ours and Celery's, no I/O.

**Server side** (unless ``--no-server``). redis-server runs under callgrind,
and a client sends it ``--calls`` of: ``PING``; ``LockedTask``'s acquire script
as the adapter sends it (two keys, three arguments); the acquire and the release
script in turn (a lock cycle). Instructions per call, from two runs of 500 and
500 + ``--calls`` calls, include the server's own I/O handling.

Instructions are not time: code right after a blocking read runs with cold
caches, and a round trip costs the client little in instructions and much in
time. Use this to see whether a change removes work, and ``bench_tasks.py`` to
see what the machine makes of it.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import _servers  # noqa: E402 - the sibling module, found through the path set above

VARIANTS = ("plain", "rt2", "floor", "core", "locked")
_COLLECTED = re.compile(r"Collected\s*:\s*([\d,]+)")
_SUMMARY = re.compile(r"^summary:\s*(\d+)", re.MULTILINE)  # callgrind's output file


# -- child: run one variant's tasks through Celery's tracer ------------------------------------
def _child(variant: str, count: int, stub: bool) -> None:
    from celery import signals  # noqa: PLC0415 - only in the child
    from celery.app.trace import build_tracer  # noqa: PLC0415

    os.environ["BENCH_VARIANT"] = variant
    os.environ["BENCH_BROKER"] = "memory://"
    taskapp = __import__("bench.taskapp", fromlist=["app"])
    app = taskapp.app
    app.finalize()
    signals.worker_process_init.send(sender=None)  # as in a prefork pool child
    if stub:
        _stub_scripts()
    task = taskapp.TASKS[variant]
    tracer = build_tracer(task.name, task, app=app, eager=False, propagate=False)
    base = int(time.time() * 1000) * 1000
    for i in range(count):
        task_id = str(uuid.uuid4())
        request = {
            "id": task_id,
            "task": task.name,
            "args": (base + i,),
            "kwargs": {},
            "delivery_info": {"routing_key": "celery", "exchange": "", "priority": 0},
            "hostname": "bench@localhost",
            "is_eager": False,
        }
        tracer(task_id, (base + i,), {}, request)


def _stub_scripts() -> None:
    """Every lock script, the body's INCR and rt2's PINGs answer at once (no I/O)."""
    from celery_redlock.core import _wire  # noqa: PLC0415 - only with --stub
    from celery_redlock.core.scripts import ACQUIRE  # noqa: PLC0415

    acquire = ACQUIRE.sha.encode()

    def answer(_held: Any, packed: bytes) -> Any:
        return [1, 1] if acquire in packed[:80] else 1

    _wire._call = answer  # type: ignore[assignment]
    taskapp = sys.modules["bench.taskapp"]

    class _Counter:
        """Counts like the real ``done`` counter, so only the first body stamps ``first``."""

        n = 0

        def incr(self, _key: str) -> int:
            self.n += 1
            return self.n

        def set(self, _key: str, _value: str) -> None:
            pass

    taskapp._counter = _Counter()  # the body's INCR answers at once as well
    taskapp._counter_pid = os.getpid()
    if hasattr(taskapp, "_ping"):
        taskapp._ping = lambda: None  # rt2's raw-socket round trips


# -- parent: callgrind runs ------------------------------------------------------------------
def _callgrind(command: list[str], env: dict[str, str]) -> int:
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"callgrind run failed ({done.returncode}): {done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def client_per_task(variant: str, server: _servers.Server, args: argparse.Namespace) -> float:
    env = {
        **os.environ,
        "BENCH_LOCKS": f"redis://{_servers.HOST}:{server.port}/1",
        "BENCH_COUNTER": f"redis://{_servers.HOST}:{server.port}/3",
    }
    me = [sys.executable, str(Path(__file__).resolve()), "--child", variant]
    if args.stub:
        me.append("--stub")
    short = _callgrind([*me, str(args.warmup)], env)
    long = _callgrind([*me, str(args.warmup + args.tasks)], env)
    return (long - short) / args.tasks


def _drive(port: int, what: str, calls: int) -> None:
    """Client of the server-side runs: *calls* of *what* against 127.0.0.1:*port*."""
    import redis  # noqa: PLC0415

    from celery_redlock.core.scripts import ACQUIRE, RELEASE  # noqa: PLC0415

    client = redis.Redis(host=_servers.HOST, port=port)
    record = (
        '{"hostname":"bench","pid":1,"acquired_at":1795454888.914,"task_name":"bench.locked",'
        f'"task_id":"{uuid.uuid4()}","worker":"celery@bench"}}'
    )
    run = secrets.token_hex(4)
    for i in range(calls):
        if what == "ping":
            client.ping()
            continue
        key = f"redlock:{{k:{run}:{i}}}"
        token = secrets.token_hex(20)
        ACQUIRE(client, [key, f"{key}:fence"], [token, 30000, record])
        if what == "cycle":
            RELEASE(client, [key, f"{key}:notify", f"{key}:waiting"], [token, 30000])
    client.close()


def server_per_call(binary: str, what: str, calls: int) -> float:
    counts = []
    for n in (500, 500 + calls):
        with tempfile.TemporaryDirectory(prefix="bench-instr-") as tmp:
            out = Path(tmp) / "callgrind.out"
            wrapper = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}")
            server = _servers.start(binary, wrapper=wrapper, startup=60.0)
            try:
                subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--drive", str(server.port),
                     what, str(n)],
                    check=True,
                    timeout=600,
                )  # fmt: skip
            finally:
                _servers.stop(server)  # SIGTERM: redis-server exits, callgrind writes out
            found = _SUMMARY.search(out.read_text()) if out.exists() else None
        if found is None:
            raise SystemExit("callgrind on redis-server wrote no instruction count")
        counts.append(int(found.group(1)))
    return (counts[1] - counts[0]) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tasks", type=int, default=200, help="measured tasks per variant")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--stub", action="store_true", help="lock scripts answered in-process")
    parser.add_argument("--calls", type=int, default=1000, help="server-side calls per kind")
    parser.add_argument("--no-server", action="store_true", help="skip the server-side counts")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--drive", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("count", nargs="?", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.count, args.stub)
        return
    if args.drive:
        port, what, calls = args.drive
        _drive(int(port), what, int(calls))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH (Debian: apt-get install valgrind)")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {','.join(VARIANTS)}")
    started = time.monotonic()
    with _servers.running() as server:
        print(f"redis-server {server.version()} ({server.binary}); Python {sys.version.split()[0]}")
        mode = "lock scripts stubbed (no I/O)" if args.stub else "real redis-server, loopback TCP"
        print(f"\nClient instructions per task ({mode}; {args.tasks} tasks after {args.warmup}):\n")
        print("| variant | instructions per task | over plain |")
        print("|---|---:|---:|")
        plain = None
        for variant in variants:
            per_task = client_per_task(variant, server, args)
            plain = per_task if variant == "plain" else plain
            over = "" if plain is None or variant == "plain" else f"{per_task - plain:+,.0f}"
            print(f"| {variant} | {per_task:,.0f} | {over} |", flush=True)
        binary = server.binary
    if not args.no_server:
        print(f"\nredis-server instructions per call ({args.calls} calls after 500):\n")
        print("| call | instructions per call |")
        print("|---|---:|")
        for what, label in (
            ("ping", "PING"),
            ("acquire", "acquire script (2 keys, 3 arguments)"),
            ("cycle", "acquire + release scripts (one lock cycle)"),
        ):
            print(f"| {label} | {server_per_call(binary, what, args.calls):,.0f} |", flush=True)
    print(f"\nwhole benchmark: {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
