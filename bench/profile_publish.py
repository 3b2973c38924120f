"""Where the time of one ``lock_on="enqueue"`` publish goes (issue 24, item 4).

Run by hand (not part of the test suite)::

    .venv/bin/python bench/profile_publish.py [--calls 3000] [--reps 5] [--only a,b]
    .venv/bin/python bench/profile_publish.py --calls 400 --reps 31 --only ping --ablate
    .venv/bin/python bench/profile_publish.py --calls 5000 --reps 1 --only plain,enqueue --profile
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg/out.%p \
        .venv/bin/python bench/profile_publish.py --calls 300 --reps 1 --only ping --callgrind

Starts its own throwaway redis-server on a free loopback port (see ``_servers``), builds
the tasks of ``bench_dedup`` (broker db 0, locks db 1) and times, per call (median of
``--reps`` interleaved runs of ``--calls`` calls, µs: wall, this thread's CPU, user CPU),
the whole publish and its parts (``--only`` picks some):

* ``plain``            ``apply_async`` of a plain task (Celery's own publish)
* ``enqueue``          ``apply_async`` of the ``lock_on="enqueue"`` task
* ``celery-send-L``    ``Task.apply_async`` (Celery's, not ours) on the LockedTask, with
                       the ``redlock_hold`` header and a task id: what our ``send`` costs
* ``plain+hdr+id``     ``apply_async`` of the plain task with that header and a task id
* ``publish-nosend``   ``dedup.publish`` with a no-op ``send``: everything of ours
* ``claim``            ``QueuedHold(...).claim`` (a new hold per call, as publish makes)
* ``backend.enqueue``  ``RedisBackend.enqueue`` with a ready record
* ``evalsha``          the raw redis-py ``EVALSHA`` of ``enqueue.lua`` on the lock client
* ``raw-conn-evalsha`` the same written and read on one held connection (no pool)
* ``ping``             a redis-py ``PING`` on the lock client (one round trip's floor)
* ``evalsha+plain``    a raw EVALSHA, then a plain publish: the synchronous floor
* small pure-Python pieces: ``lock_name_for``, ``QueuedHold()``, ``_hold_ttl``, ``uuid``,
  the hold record's ``json.dumps``, ``state_for``/``options_for``.

``--ablate``: interleaved reps of ``plain``, ``enqueue``, celery-once, celery-singleton and
the enqueue publish with parts replaced by monkeypatching in this process (the package is
not changed; see :func:`ablations`): a stubbed claim (no Redis), a lean EVALSHA (no
``execute_command``), ``disabled`` read from ``conf.maps``, a trimmed ``publish``
(``fast_publish``), the same on one held connection, and the *overlap* prototype: EVALSHA
written before Celery builds the message, its reply read in ``app.amqp.send_task_message``
just before the message goes to the broker. ``--variants`` picks some.

``--callgrind`` (under ``valgrind --tool=callgrind --instr-atstart=no``): one dump per
ablation variant of the instructions of ``--calls`` publishes, which the machine's load
does not change; ``callgrind_annotate <dump> | grep "PROGRAM TOTALS"``.

``--profile``: cProfile of ``--calls`` publishes each of ``plain`` and ``enqueue``
(tottime and cumtime tables, and the functions whose tottime grows the most).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import resource
import statistics
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import _servers  # noqa: E402
from bench.bench_dedup import tasks_of  # noqa: E402

#: enqueue.lua's SHA1 (set by main, after sys.path is set)
ENQUEUE_SHA = ""


def _enqueue_sha() -> str:
    """The SHA1 of enqueue.lua (the scripts moved to redis_scripts after 85d1a38, and to
    redis/scripts.py with issue 39)."""
    from importlib import import_module  # noqa: PLC0415

    for module, name in (
        ("celery_redlock.core.backends.redis.scripts", "ENQUEUE"),
        ("celery_redlock.core.backends.redis_scripts", "ENQUEUE"),
        ("celery_redlock.core.backends.redis_backend", "_ENQUEUE"),
    ):
        try:
            return str(getattr(import_module(module), name).sha)
        except (ImportError, AttributeError):
            continue
    raise RuntimeError("enqueue.lua's script object not found")


def key_prefix(state: Any) -> str:
    """The app's key prefix (a Settings attribute since 85d1a38's successors, a key before)."""
    settings = state.settings
    prefix = getattr(settings, "key_prefix", None)
    return str(prefix if prefix is not None else settings["redlock_key_prefix"])


def claim_flags(options: Any) -> tuple[bool, bool]:
    """(replace, running_blocks) of a task's ``lock_on_duplicate``, as publish_held passes
    them to the enqueue script (policy attributes at 85d1a38, claim functions later)."""
    policy = options.duplicate
    if hasattr(policy, "replace"):
        return policy.replace, policy.running_is_duplicate and options.lock_on == "enqueue+run"
    claim = getattr(policy.claim, "__name__", "")
    return claim == "take_place", claim == "keep_first" and options.lock_on == "enqueue+run"


def per_call(fn: Callable[[int], Any], calls: int, start: int) -> tuple[float, float, float]:
    """(wall, CPU, user CPU) µs per call of ``fn(i)`` over *calls* calls; CPU is this
    thread's own (``thread_time``: no time waiting for Redis), user CPU without the
    kernel's share (system calls: socket send/recv, being woken)."""
    began, cpu = time.perf_counter(), time.thread_time()
    user = resource.getrusage(resource.RUSAGE_THREAD).ru_utime
    for i in range(start, start + calls):
        fn(i)
    return (
        (time.perf_counter() - began) / calls * 1e6,
        (time.thread_time() - cpu) / calls * 1e6,
        (resource.getrusage(resource.RUSAGE_THREAD).ru_utime - user) / calls * 1e6,
    )


def ablations(app: Any, enq: Any) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """name -> (patch, unpatch): the lock_on=enqueue publish with one part replaced, by
    monkeypatching in this process only (the package is not changed)."""
    from celery_redlock.app import state as state_mod  # noqa: PLC0415
    from celery_redlock.core import QueuedHold  # noqa: PLC0415
    from celery_redlock.core.backend import Queued, parse_holder, text  # noqa: PLC0415
    from celery_redlock.core.backends.redis import backend as rb  # noqa: PLC0415
    from celery_redlock.core.keys import lock_keys  # noqa: PLC0415
    from celery_redlock.task import dedup  # noqa: PLC0415
    from celery_redlock.task import locked_task as task_mod  # noqa: PLC0415

    saved: dict[str, Any] = {}

    def swap(obj: Any, attr: str, new: Any) -> Callable[[], None]:
        def patch() -> None:
            saved[(id(obj), attr)] = obj.__dict__[attr]
            setattr(obj, attr, new)

        return patch

    def unswap(obj: Any, attr: str) -> Callable[[], None]:
        return lambda: setattr(obj, attr, saved.pop((id(obj), attr)))

    def pair(obj: Any, attr: str, new: Any) -> tuple[Callable[[], None], Callable[[], None]]:
        return swap(obj, attr, new), unswap(obj, attr)

    queued = Queued("queued")

    def stub_claim(self: Any, owner: str, ttl: float, **_: Any) -> Any:
        return queued

    def stub_enqueue(self: Any, slot: Any, owner: str, ttl_ms: int, record: str, **_: Any) -> Any:
        return queued

    def lean_enqueue(
        self: Any, slot: Any, owner: str, ttl_ms: int, record: str, *, replace: bool,
        running_blocks: bool,
    ) -> Any:  # fmt: skip
        """RedisBackend.enqueue on a pooled connection without Redis.execute_command (its
        retry wrapper, observability records and response callbacks)."""
        keys = slot.keys
        pool = self.client.connection_pool
        release: Callable[[Any], None]
        if mode["held"] and held_lock.acquire(blocking=False):
            if "conn" not in held:
                held["conn"] = pool.make_connection()
            conn, release = held["conn"], release_held
        else:
            conn, release = pool.get_connection(), pool.release
        try:
            conn.send_command(
                "EVALSHA", ENQUEUE_SHA, 2, keys.queued, keys.lock, owner, ttl_ms, record,
                "1" if replace else "0", "1" if running_blocks else "0",
            )  # fmt: skip
            reply = conn.read_response()
        except BaseException:
            conn.disconnect()
            raise
        finally:
            release(conn)
        code = int(reply[0])
        if code == 1:
            return queued
        if code == 2:
            return Queued("replaced", owner=text(reply[1]), holder=parse_holder(reply[2]))
        holder = parse_holder(reply[2])
        return Queued("duplicate", text(reply[1]), holder, int(reply[3]), text(reply[4]))

    def conf_direct(conf: Any, key: str) -> Any:
        for layer in conf.maps:
            if key in layer:
                return layer[key]
        return None

    disabled_fast = property(
        lambda self: bool(
            self.overrides.get("redlock_disable") or conf_direct(self.app.conf, "redlock_disable")
        )
    )

    # A prototype publish with the proposals together (no QueuedHold object; its record's
    # constant part serialised once per task class; conf read from its maps; lean EVALSHA).
    prefixes: dict[type, str] = {}

    def common_path(
        task: Any, args: Any, kwargs: Any, call: dict[str, Any], send: Any
    ) -> tuple[bool, Any]:
        """What both prototypes leave to the library: ``(True, sent)`` for a call sent as
        it is or through ``publish_held``; else ``(False, (state, options, lock name))``."""
        st = state_mod.state_for(task.app)
        conf = task.app.conf
        if (
            st.overrides.get("redlock_disable")
            or conf_direct(conf, "redlock_disable")
            or conf_direct(conf, "task_always_eager")
        ):
            return True, send(args, kwargs, **call)
        options = st.options_for(task)
        if options.lock_on == "run":
            return True, send(args, kwargs, **call)
        name = dedup.lock_name_for(
            task, tuple(args or ()), dict(kwargs or {}), call.get("headers"), options
        )
        if any(call.get(k) for k in _SLOW_PATH) or options.debounce or dedup._running_id(task):
            held = dedup.publish_held(st, task, name, options, args, kwargs, call=call, send=send)
            return True, held
        return False, (st, options, name)

    def fast_publish(task: Any, args: Any, kwargs: Any, call: dict[str, Any], send: Any) -> Any:
        done, found = common_path(task, args, kwargs, call, send)
        if done:
            return found
        st, options, name = found
        task_id = call["task_id"] = uuid4_str()
        cls = type(task)
        head = prefixes.get(cls)
        if head is None:
            head = prefixes[cls] = (
                '{"hostname":' + json.dumps(rb_hostname()) + ',"pid":' + str(os.getpid())
                + ',"task_name":' + json.dumps(task.name)
            )  # fmt: skip
        record = f'{head},"queued_at":{time.time():.3f},"task_id":"{task_id}"}}'
        keys = lock_keys(name, key_prefix(st))
        replace, running_blocks = claim_flags(options)
        found = lean_enqueue(
            st.backend(), _Slot(keys), task_id, round(options.enqueue_ttl * 1000), record,
            replace=replace, running_blocks=running_blocks,
        )  # fmt: skip
        if found.outcome == "duplicate":
            return dedup.publish_held(st, task, name, options, args, kwargs, call=call, send=send)
        call["headers"] = {**(call.get("headers") or {}), dedup.HOLD_HEADER: name}
        return send(args, kwargs, **call)

    class _Slot:
        __slots__ = ("keys",)

        def __init__(self, keys: Any) -> None:
            self.keys = keys

    def rb_hostname() -> str:
        import socket  # noqa: PLC0415

        return socket.gethostname()

    def uuid4_str() -> str:
        return str(uuid.uuid4())

    # The overlap prototype: EVALSHA is written before Celery builds the message and its
    # reply read just before the message goes to the broker (app.amqp.send_task_message),
    # so the round trip's latency and the server's script time pass while Celery works.
    pending: dict[str, tuple[Any, Any]] = {}

    class _Dup(Exception):
        def __init__(self, found: Any) -> None:
            self.found = found

    def read_reply(entry: tuple[Any, Any]) -> Any:
        conn, release = entry
        try:
            reply = conn.read_response()
        except BaseException:
            conn.disconnect()
            raise
        finally:
            release(conn)
        code = int(reply[0])
        if code == 1:
            return queued
        if code == 2:
            return Queued("replaced", owner=text(reply[1]), holder=parse_holder(reply[2]))
        holder = parse_holder(reply[2])
        return Queued("duplicate", text(reply[1]), holder, int(reply[3]), text(reply[4]))

    import threading  # noqa: PLC0415

    mode = {"held": False}
    held: dict[str, Any] = {}
    held_lock = threading.Lock()

    def release_held(conn: Any) -> None:
        held_lock.release()

    amqp = app.amqp
    original_send_message = amqp.send_task_message

    def send_task_message(producer: Any, name: str, message: Any, **kw: Any) -> Any:
        entry = pending.pop(message[0].get("id"), None) if pending else None
        if entry is not None:
            found = read_reply(entry)
            if found.outcome == "duplicate":
                raise _Dup(found)
        return original_send_message(producer, name, message, **kw)

    def overlap_publish(task: Any, args: Any, kwargs: Any, call: dict[str, Any], send: Any) -> Any:
        done, found = common_path(task, args, kwargs, call, send)
        if done:
            return found
        st, options, name = found
        task_id = call["task_id"] = uuid4_str()
        cls = type(task)
        head = prefixes.get(cls)
        if head is None:
            head = prefixes[cls] = (
                '{"hostname":' + json.dumps(rb_hostname()) + ',"pid":' + str(os.getpid())
                + ',"task_name":' + json.dumps(task.name)
            )  # fmt: skip
        record = f'{head},"queued_at":{time.time():.3f},"task_id":"{task_id}"}}'
        keys = lock_keys(name, key_prefix(st))
        replace, running_blocks = claim_flags(options)
        pool = st.backend().client.connection_pool
        release: Callable[[Any], None]
        if mode["held"] and held_lock.acquire(blocking=False):
            # One connection of this process's own, outside the pool: no checkout.
            if "conn" not in held:
                held["conn"] = pool.make_connection()
            conn = held["conn"]
            release = release_held
        else:
            conn, release = pool.get_connection(), pool.release
        try:
            conn.send_command(
                "EVALSHA", ENQUEUE_SHA, 2, keys.queued, keys.lock, task_id,
                round(options.enqueue_ttl * 1000), record, "1" if replace else "0",
                "1" if running_blocks else "0",
            )  # fmt: skip
        except BaseException:
            release(conn)
            raise
        pending[task_id] = (conn, release)
        call["headers"] = {**(call.get("headers") or {}), dedup.HOLD_HEADER: name}
        try:
            return send(args, kwargs, **call)
        except _Dup as dup:
            return dedup._duplicate(task, name, options, dup.found, task_id)
        finally:
            entry = pending.pop(task_id, None)
            # the send failed before the message went out: give back a hold it took
            if entry is not None and read_reply(entry).outcome != "duplicate":
                dedup.give_back_hold(task.app, name, task_id, "was not published")

    _SLOW_PATH = ("task_id", "eta", "countdown", "expires", "chain", "link", "link_error",
                  "chord", "group_id")  # fmt: skip

    def overlap_patch() -> None:
        amqp.send_task_message = send_task_message
        swap(task_mod, "publish", overlap_publish)()

    def overlap_unpatch() -> None:
        amqp.send_task_message = original_send_message
        unswap(task_mod, "publish")()
        mode["held"] = False

    def overlap_held_patch() -> None:
        mode["held"] = True
        overlap_patch()

    def fast_held_patch() -> None:
        mode["held"] = True
        swap(task_mod, "publish", fast_publish)()

    def fast_held_unpatch() -> None:
        unswap(task_mod, "publish")()
        mode["held"] = False

    _ = QueuedHold
    return {
        "overlap prototype": (overlap_patch, overlap_unpatch),
        "overlap + held connection": (overlap_held_patch, overlap_unpatch),
        "fast_publish + held connection": (fast_held_patch, fast_held_unpatch),
        "stub-claim (no Redis)": pair(QueuedHold, "claim", stub_claim),
        "stub-backend.enqueue": pair(rb.RedisBackend, "enqueue", stub_enqueue),
        "lean EVALSHA": pair(rb.RedisBackend, "enqueue", lean_enqueue),
        "disabled via conf.maps": pair(state_mod.AppState, "disabled", disabled_fast),
        "fast_publish prototype": pair(task_mod, "publish", fast_publish),
    }


def variants_and_fns(
    plain: Any, enq: Any, others: dict[str, Any] | None = None
) -> tuple[
    dict[str, tuple[Callable[[], None], Callable[[], None]]], dict[str, Callable[[int], Any]]
]:
    """The ablation variants (name -> patch, unpatch) and the calls of those that are not
    ``enq.apply_async((i,))``."""
    from celery_redlock.app.state import state_for  # noqa: PLC0415

    none = (lambda: None, lambda: None)
    client = state_for(enq.app).backend().client
    pool = client.connection_pool
    record = '{"hostname":"h","pid":1,"queued_at":1.0,"task_name":"b.enqueue","task_id":"x"}'

    def evalsha(i: int) -> Any:
        return client.evalsha(
            ENQUEUE_SHA, 2, f"k:{i}:q", f"k:{i}", f"t{i}", 3600000, record, "0", "0"
        )

    def lean_evalsha(i: int) -> Any:
        conn = pool.get_connection()
        try:
            conn.send_command(
                "EVALSHA", ENQUEUE_SHA, 2, f"k:{i}:q", f"k:{i}", f"t{i}", 3600000, record,
                "0", "0",
            )  # fmt: skip
            return conn.read_response()
        finally:
            pool.release(conn)

    variants: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "plain": none,
        "enqueue": none,
        "plain + task_id + header": none,
        "ping + plain": none,
        "SET NX PX + plain": none,
        "EVALSHA + plain": none,
        "lean EVALSHA + plain": none,
        **ablations(enq.app, enq),
    }
    fns: dict[str, Callable[[int], Any]] = {
        "plain": lambda i: plain.apply_async((i,)),
        "plain + task_id + header": lambda i: plain.apply_async(
            (i,), task_id=str(uuid.uuid4()), headers={"redlock_hold": f"b:{i}"}
        ),
        "ping + plain": lambda i: (client.ping(), plain.apply_async((i,))),
        "SET NX PX + plain": lambda i: (
            client.set(f"s:{i}", "x", nx=True, px=3600000),
            plain.apply_async((i,)),
        ),
        "EVALSHA + plain": lambda i: (evalsha(i), plain.apply_async((i,))),
        "lean EVALSHA + plain": lambda i: (lean_evalsha(i), plain.apply_async((i,))),
    }
    for name, task in (others or {}).items():
        variants[name] = none
        fns[name] = lambda i, task=task: task.apply_async((i,))
    return variants, fns


def run_ablations(
    opts: Any, server: Any, plain: Any, enq: Any, start: int, others: dict[str, Any]
) -> int:
    """Interleaved reps of plain, enqueue, each ablation and *others* (celery-once,
    celery-singleton); prints µs per call."""
    variants, fns = variants_and_fns(plain, enq, others)
    if opts.variants:
        wanted = {"plain", "enqueue", *opts.variants.split(",")}
        variants = {k: v for k, v in variants.items() if k in wanted}
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(opts.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            patch, unpatch = variants[name]
            fn = fns.get(name) or (lambda i: enq.apply_async((i,)))
            patch()
            try:
                results[name].append(per_call(fn, opts.calls, start))
            finally:
                unpatch()
            start += opts.calls
            for db in range(4):
                server.client(db=db).flushdb()

    def q1(values: list[float]) -> float:
        return statistics.quantiles(values, n=4)[0] if len(values) > 1 else values[0]

    base = statistics.median(w for w, _, _ in results["plain"])
    base_q1 = q1([w for w, _, _ in results["plain"]])
    print(
        f"ablations, {opts.reps} x {opts.calls} calls, µs/call: median wall, median CPU, "
        "median user CPU, 25th-percentile wall, min wall, min CPU, plain/median, plain/q1"
    )
    for name in names:
        walls = [w for w, _, _ in results[name]]
        cpus = [c for _, c, _ in results[name]]
        users = [u for _, _, u in results[name]]
        wall = statistics.median(walls)
        print(
            f"  {name:26s} {wall:7.1f} {statistics.median(cpus):7.1f} "
            f"{statistics.median(users):7.1f}  {q1(walls):7.1f} {min(walls):7.1f} "
            f"{min(cpus):7.1f}  {base / wall:5.2f}x {base_q1 / q1(walls):5.2f}x"
        )
    return start


def instructions(
    opts: Any, server: Any, plain: Any, enq: Any, start: int, others: dict[str, Any]
) -> None:
    """Under callgrind: zero the counters, run --calls calls of one variant, dump; for each
    variant (``callgrind_control``). Instruction counts do not depend on the machine's load:
    the dumps' ``summary:`` lines divided by --calls are instructions per publish."""
    import subprocess  # noqa: PLC0415

    variants, fns = variants_and_fns(plain, enq, others)
    me = str(os.getpid())
    for name, (patch, unpatch) in variants.items():
        fn = fns.get(name) or (lambda i: enq.apply_async((i,)))
        patch()
        try:
            for i in range(start, start + 50):  # warm this variant's path
                fn(i)
            start += 50
            subprocess.run(["callgrind_control", "-z", me], check=True, capture_output=True)
            subprocess.run(["callgrind_control", "-i", "on", me], check=True, capture_output=True)
            for i in range(start, start + opts.calls):
                fn(i)
            subprocess.run(["callgrind_control", "-i", "off", me], check=True, capture_output=True)
            tag = name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "and")
            subprocess.run(["callgrind_control", "-d", tag, me], check=True, capture_output=True)
        finally:
            unpatch()
        start += opts.calls
        for db in range(4):
            server.client(db=db).flushdb()
        print(f"dumped {name}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated probe names")
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="time lock_on=enqueue publishes with parts of the path replaced (see ablations())",
    )
    parser.add_argument(
        "--variants",
        default="",
        help="with --ablate: only these (comma-separated), plus plain and enqueue",
    )
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="run under valgrind --tool=callgrind --instr-atstart=no: counts the instructions "
        "of --calls calls of each ablation variant (one dump per variant, see instructions())",
    )
    parser.add_argument(
        "--pin",
        default="",
        help="'same': this process and redis-server on CPU 0; 'split': this on 0, redis on 1",
    )
    opts = parser.parse_args()
    global ENQUEUE_SHA
    ENQUEUE_SHA = _enqueue_sha()
    logging.disable(logging.INFO)
    warnings.simplefilter("ignore")

    from celery import Task  # noqa: PLC0415
    from celery.utils import uuid as celery_uuid  # noqa: PLC0415

    from celery_redlock.app.state import state_for  # noqa: PLC0415
    from celery_redlock.core import QueuedHold  # noqa: PLC0415
    from celery_redlock.task import dedup  # noqa: PLC0415
    from celery_redlock.task.naming import lock_name_for  # noqa: PLC0415

    with _servers.running() as server:
        if opts.pin:
            os.sched_setaffinity(0, {0})
            os.sched_setaffinity(server.pid, {0} if opts.pin == "same" else {1})
        tasks = tasks_of(server.port)
        plain, enq_proxy = tasks["plain"], tasks["enqueue"]  # as bench_dedup calls them
        app = enq_proxy.app
        enq = app.tasks[enq_proxy.name]  # the task object (the proxy resolves to it)
        for i in range(300):  # connections, scripts, classes
            plain.apply_async((i,))
            enq.apply_async((i,))
        state = state_for(app)
        options = state.options_for(enq)
        backend = state.backend()
        client = backend.client
        prefix = key_prefix(state)
        raw = server.client(db=1)
        keys0 = QueuedHold(backend, "x", key_prefix=prefix).keys
        print(
            f"lock client: {type(client).__name__} "
            f"{client.connection_pool.connection_kwargs.get('retry')!r}; "
            f"enqueue_ttl={options.enqueue_ttl}",
            file=sys.stderr,
        )
        record = json.dumps({"hostname": "h", "pid": 1, "queued_at": 1.0, "task_name": enq.name})
        conn = client.connection_pool.get_connection()  # held for the whole run

        def raw_evalsha(owner: str) -> Any:
            """EVALSHA on one checked-out connection: no pool, retry or observability."""
            conn.send_command(
                "EVALSHA", ENQUEUE_SHA, 2, keys0.queued, keys0.lock, owner, 3600000, record,
                "1", "0",
            )  # fmt: skip
            return conn.read_response()

        def noop_send(args: Any, kwargs: Any, **call: Any) -> None:
            return None

        probes: dict[str, Callable[[int], Any]] = {
            "plain": lambda i: plain.apply_async((i,)),
            "enqueue": lambda i: enq_proxy.apply_async((i,)),
            "celery-send-L": lambda i: Task.apply_async(
                enq, (i,), None, task_id=celery_uuid(), headers={dedup.HOLD_HEADER: f"b:{i}"}
            ),
            "plain+hdr+id": lambda i: plain.apply_async(
                (i,), task_id=celery_uuid(), headers={dedup.HOLD_HEADER: f"b:{i}"}
            ),
            "publish-nosend": lambda i: dedup.publish(enq, (i,), None, {}, noop_send),
            "claim": lambda i: QueuedHold(
                backend, f"c:{i}", key_prefix=prefix, owner_info={"task_name": enq.name}
            ).claim(celery_uuid(), 3600.0),
            "claim-same-hold": None,  # set below
            "backend.enqueue": lambda i: backend.enqueue(
                hold0.slot, f"t{i}", 3600000, record, replace=False, running_blocks=False
            ),
            "evalsha": lambda i: client.evalsha(
                ENQUEUE_SHA, 2, keys0.queued, keys0.lock, f"t{i}", 3600000, record, "1", "0"
            ),
            "evalsha-plainclient": lambda i: raw.evalsha(
                ENQUEUE_SHA, 2, keys0.queued, keys0.lock, f"t{i}", 3600000, record, "1", "0"
            ),
            "ping": lambda i: client.ping(),
            "evalsha+plain": lambda i: (
                client.evalsha(
                    ENQUEUE_SHA, 2, keys0.queued, keys0.lock, f"t{i}", 3600000, record, "1", "0"
                ),
                plain.apply_async((i,)),
            ),
            "ping+plain": lambda i: (client.ping(), plain.apply_async((i,))),
            "raw-conn-evalsha": lambda i: raw_evalsha(f"t{i}"),
            "set-nx-px": lambda i: client.set(f"s:{i}", "x", nx=True, px=3600000),
            "lock_name_for": lambda i: lock_name_for(enq, (i,), {}, None, options),
            "QueuedHold()": lambda i: QueuedHold(
                backend, f"c:{i}", key_prefix=prefix, owner_info={"task_name": enq.name}
            ),
            "_hold_ttl": lambda i: dedup._hold_ttl(options.enqueue_ttl, {}),
            "uuid": lambda i: celery_uuid(),
            "json.dumps": lambda i: json.dumps(
                {"hostname": "h", "pid": 1, "queued_at": 1.0, "task_name": "b", "task_id": "x"},
                separators=(",", ":"),
                default=str,
            ),
            "state+options": lambda i: state_for(app).options_for(enq),
            "state.backend()": lambda i: state.backend(),
            "_running_id": lambda i: dedup._running_id(enq),
        }
        hold0 = QueuedHold(backend, "same", key_prefix=prefix, owner_info={"task_name": enq.name})
        probes["claim-same-hold"] = lambda i: hold0.claim(f"t{i}", 3600.0, replace=True)
        if opts.only:
            probes = {k: v for k, v in probes.items() if k in opts.only.split(",")}
        results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in probes}
        start = 10_000
        names = list(probes)
        for rep in range(opts.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                results[name].append(per_call(probes[name], opts.calls, start))
                start += opts.calls
                for db in (0, 1):
                    server.client(db=db).flushdb()
        print(
            f"µs per call, median of {opts.reps} x {opts.calls} (redis {server.version()}): "
            f"pin={opts.pin or 'no'}: wall, this thread's CPU, wall - CPU (waiting); "
            "min wall, min CPU; (wall of each rep)"
        )
        for name in names:
            walls = [w for w, _, _ in results[name]]
            cpus = [c for _, c, _ in results[name]]
            users = [u for _, _, u in results[name]]
            wall, cpu = statistics.median(walls), statistics.median(cpus)
            spread = ", ".join(f"{v:.0f}" for v in walls)
            print(
                f"  {name:20s} {wall:7.1f} {cpu:7.1f} {wall - cpu:7.1f}  "
                f"{min(walls):7.1f} {min(cpus):7.1f}  user {statistics.median(users):6.1f}"
                f"   ({spread})"
            )
        stats = server.client().info("commandstats")
        for cmd in ("cmdstat_evalsha", "cmdstat_lpush", "cmdstat_ping", "cmdstat_set"):
            if cmd in stats:
                print(f"  server side {cmd[8:]:8s} {stats[cmd]['usec_per_call']:6.2f} µs/call")

        others = {k: tasks[k] for k in ("celery-once", "singleton")}
        if opts.callgrind:
            instructions(opts, server, plain, enq_proxy, start, others)
            return
        if opts.ablate:
            start = run_ablations(opts, server, plain, enq_proxy, start, others)

        if opts.profile:
            stats = {}
            for name in ("plain", "enqueue"):
                prof = cProfile.Profile()
                fn = probes.get(name) or (
                    (lambda i: plain.apply_async((i,)))
                    if name == "plain"
                    else (lambda i: enq_proxy.apply_async((i,)))
                )
                prof.enable()
                for i in range(start, start + opts.calls):
                    fn(i)
                prof.disable()
                start += opts.calls
                out = io.StringIO()
                st = pstats.Stats(prof, stream=out)
                stats[name] = st
                st.sort_stats("tottime").print_stats(30)
                st.sort_stats("cumulative").print_stats(60)
                print(f"===== cProfile {name} ({opts.calls} calls) =====")
                print(out.getvalue())
                prof.dump_stats(f"/tmp/publish_{name}.prof")
            # the functions whose own time grows most from plain to enqueue (µs per call)
            a, b = stats["plain"].stats, stats["enqueue"].stats  # type: ignore[attr-defined]
            rows = []
            for func, (_cc, nc, tt, ct, _callers) in b.items():
                base = a.get(func, (0, 0, 0.0, 0.0, {}))
                rows.append(
                    (
                        (tt - base[2]) / opts.calls * 1e6,
                        (ct - base[3]) / opts.calls * 1e6,
                        nc / opts.calls,
                        base[1] / opts.calls,
                        func,
                    )
                )
            rows.sort(reverse=True)
            print("===== tottime growth plain -> enqueue, µs/call (calls/publish) =====")
            for dt, dc, n1, n0, func in rows[:40]:
                where = f"{Path(func[0]).name}:{func[1]}({func[2]})"
                print(f"  {dt:7.1f} tot {dc:7.1f} cum  {n0:4.1f}->{n1:4.1f}  {where}")


if __name__ == "__main__":
    main()
