"""The Celery app that ``bench/bench_tasks.py`` runs in its worker subprocesses.

Configured only through the environment (the benchmark sets these):

BENCH_BROKER    broker URL (the benchmark's throwaway Redis, db 0)
BENCH_LOCKS     Redis URL for every lock library (db 1)
BENCH_COUNTER   Redis URL where each task INCRs ``done`` (db 3)
BENCH_VARIANT   plain | locked | once | singleton | floor | lua | core | rt2: define only that
                task and import only the library it needs, so the plain worker carries no lock
                library at all. Unset (the benchmark's own publishing process):
                every variant.
BENCH_PROFILE   a directory: each pool child runs under cProfile and dumps
                ``child-<pid>.prof`` there when it exits (warm shutdown).
BENCH_PROFILE_CLOCK  ``cpu`` (default: CPU time of the child's main thread, so
                waiting for the next task or a Redis reply costs nothing) or ``wall``.

Every task is a no-op that INCRs one counter, with ``ignore_result=True``: no
result backend is configured, so only broker, lock and pool overhead is measured.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery, signals

VARIANTS = ("plain", "locked", "once", "singleton", "floor", "lua", "core", "rt2")
VARIANT = os.environ.get("BENCH_VARIANT", "")
if VARIANT and VARIANT not in VARIANTS:
    raise SystemExit(f"BENCH_VARIANT must be one of {VARIANTS}, got {VARIANT!r}")
LOCKS_URL = os.environ.get("BENCH_LOCKS", "redis://127.0.0.1:1/1")


def wanted(variant: str) -> bool:
    """True if this process defines *variant*'s task."""
    return not VARIANT or variant == VARIANT


app = Celery("benchtasks", broker=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:1/0"))
app.conf.update(
    worker_prefetch_multiplier=16,
    task_acks_late=False,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)

_counter: redis.Redis | None = None
_counter_pid = 0


def bump() -> None:
    """INCR the shared ``done`` counter (one client per process, made after fork).

    The body that brings it to 1 also stamps ``first`` with the wall time: with
    ``--publish before`` the clock runs from that stamp to the last body.
    """
    global _counter, _counter_pid
    if _counter is None or _counter_pid != os.getpid():
        _counter = redis.Redis.from_url(os.environ["BENCH_COUNTER"])
        _counter_pid = os.getpid()
    if _counter.incr("done") == 1:
        _counter.set("first", repr(time.time()))


TASKS: dict[str, Any] = {}

if wanted("plain"):

    @app.task(name="bench.plain", ignore_result=True)
    def plain(i: int) -> None:
        """No lock at all: the baseline."""
        bump()

    TASKS["plain"] = plain

if wanted("locked"):
    from celery_redlock import LockedTask

    app.conf.redlock_url = LOCKS_URL

    @app.task(name="bench.locked", base=LockedTask, lock_key="k:<i>", ignore_result=True)
    def locked(i: int) -> None:
        """celery-redlock: lock k:<i> taken in the worker around the run."""
        bump()

    TASKS["locked"] = locked

if wanted("once"):
    from celery_once import QueueOnce

    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": LOCKS_URL, "default_timeout": 60},
    }

    @app.task(name="bench.once", base=QueueOnce, once={"keys": ["i"]}, ignore_result=True)
    def once(i: int) -> None:
        """celery-once: lock taken at publish, cleared by the worker after the run."""
        bump()

    TASKS["once"] = once

if wanted("singleton"):
    from celery_singleton import Singleton

    app.conf.singleton_backend_url = LOCKS_URL

    @app.task(name="bench.singleton", base=Singleton, ignore_result=True)
    def singleton(i: int) -> None:
        """celery-singleton: lock taken at publish, released by the worker on success."""
        bump()

    TASKS["singleton"] = singleton


if wanted("floor"):
    import secrets

    #: The textbook owner-checked delete, loaded once per process (SCRIPT LOAD).
    _COMPARE_AND_DELETE = (
        "if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) "
        "else return 0 end"
    )
    #: A module-level client of the lock server, as a hand-written task would keep one
    #: (redis-py starts its pool afresh in each forked child).
    _hand = redis.Redis.from_url(LOCKS_URL)
    _hand_sha: dict[int, str] = {}  # pid -> SHA of the script, loaded in that process

    @app.task(name="bench.floor", ignore_result=True)
    def floor(i: int) -> None:
        """The floor (issue 29): a lock by hand, ``SET NX PX`` before the body and an
        owner-checked delete (EVALSHA compare-and-delete) after it, key per argument as
        LockedTask's ``k:<i>``, a 160-bit token as ours."""
        sha = _hand_sha.get(os.getpid())
        if sha is None:
            sha = _hand_sha[os.getpid()] = _hand.script_load(_COMPARE_AND_DELETE)
        key = f"floor:k:{i}"
        token = secrets.token_hex(20)
        if not _hand.set(key, token, nx=True, px=30000):
            raise RuntimeError(f"floor: {key} was held")
        try:
            bump()
        finally:
            _hand.evalsha(sha, 1, key, token)

    TASKS["floor"] = floor


if wanted("lua"):
    import secrets
    from importlib import resources

    _LUA = resources.files("celery_redlock.core.backends.redis").joinpath("lua")
    _ACQUIRE = _LUA.joinpath("acquire.lua").read_text("utf-8")
    _RELEASE = _LUA.joinpath("release.lua").read_text("utf-8")
    _locks: redis.Redis | None = None
    _locks_pid = 0
    _shas: dict[str, str] = {}

    @app.task(name="bench.lua", ignore_result=True)
    def lua(i: int) -> None:
        """Reference: plain + LockedTask's two Lua scripts called directly, no adapter code.

        The same acquire and release round trips (same scripts, same key shapes,
        a 160-bit token, a small holder record), without celery-redlock's Python:
        the floor for any lock taken and released inside the worker.
        """
        global _locks, _locks_pid
        if _locks is None or _locks_pid != os.getpid():
            _locks = redis.Redis.from_url(LOCKS_URL)
            _shas["acquire"] = _locks.script_load(_ACQUIRE)
            _shas["release"] = _locks.script_load(_RELEASE)
            _locks_pid = os.getpid()
        key = f"lua:{{k:{i}}}"
        token = secrets.token_hex(20)
        record = f'{{"pid":{os.getpid()}}}'
        keys = [key, key + ":fence", key + ":waiting"]
        got = _locks.evalsha(_shas["acquire"], 3, *keys, token, 30000, record, "0", 0)
        if int(got[0]) != 1:
            raise RuntimeError(f"lua: {key} was held")
        bump()
        released = (key + ":notify", key + ":waiting", key + ":released")
        _locks.evalsha(_shas["release"], 4, key, *released, token, 30000)

    TASKS["lua"] = lua


if wanted("core"):
    from celery_redlock.core import Lock, connect

    _core_client: Any = None
    _core_pid = 0

    @app.task(name="bench.core", bind=True, ignore_result=True)
    def core(self: Any, i: int) -> None:
        """Reference: plain + the core ``Lock`` (same client settings, holder record and
        renewal registration as LockedTask), without the Celery adapter around it."""
        global _core_client, _core_pid
        if _core_client is None or _core_pid != os.getpid():
            _core_client = connect(LOCKS_URL)
            _core_pid = os.getpid()
        lock = Lock(
            _core_client,
            f"c:{i}",
            30,
            owner_info={"task_name": self.name, "task_id": self.request.id},
        )
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"core: c:{i} was held")
        try:
            bump()
        finally:
            lock.release()

    TASKS["core"] = core


if wanted("rt2"):
    import socket
    from urllib.parse import urlsplit

    _sock: socket.socket | None = None
    _sock_pid = 0

    def _ping() -> None:
        global _sock, _sock_pid
        if _sock is None or _sock_pid != os.getpid():
            where = urlsplit(LOCKS_URL)
            _sock = socket.create_connection((where.hostname, where.port))
            _sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _sock_pid = os.getpid()
        _sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        if _sock.recv(64) != b"+PONG\r\n":
            raise RuntimeError("rt2: unexpected reply")

    @app.task(name="bench.rt2", ignore_result=True)
    def rt2(i: int) -> None:
        """Reference: plain + two bare round trips (PING on a raw blocking socket, no client
        library, no script): what any lock taken before the body and released after it
        costs at the very least, whatever it stores."""
        _ping()
        bump()
        _ping()

    TASKS["rt2"] = rt2


# -- optional profiling of the pool children ------------------------------------------------
_PROFILE_DIR = os.environ.get("BENCH_PROFILE")
_profiler: Any = None

if _PROFILE_DIR:

    @signals.worker_process_init.connect(weak=False)
    def _start_profile(**_: Any) -> None:
        global _profiler
        import cProfile  # noqa: PLC0415 - only when profiling
        import time  # noqa: PLC0415

        wall = os.environ.get("BENCH_PROFILE_CLOCK", "cpu") == "wall"
        _profiler = cProfile.Profile() if wall else cProfile.Profile(time.thread_time)
        _profiler.enable()

    @signals.worker_process_shutdown.connect(weak=False)
    def _dump_profile(**_: Any) -> None:
        if _profiler is not None:
            _profiler.disable()
            _profiler.dump_stats(os.path.join(str(_PROFILE_DIR), f"child-{os.getpid()}.prof"))
