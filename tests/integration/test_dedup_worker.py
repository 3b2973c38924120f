"""De-duplication from enqueue on real prefork workers and beat (`celery -A
tests.apps.dedupapp worker|beat` subprocesses): the failures only a real pool shows
(a SIGKILLed child or worker, a hard time limit, revoke(terminate=True), a broker
redelivery) free the key, and beat publishing every 0.5 s a task that runs 2 s never
overlaps it nor builds a backlog, through apply_async and through send_task by name.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu
import pytest
from celery import Celery, chord
from servers import RedisServer, wait_for
from workers import ROOT, Worker, running_worker, worker_env

pytestmark = pytest.mark.slow

APP = "tests.apps.dedupapp"


def _env(server: RedisServer, ttl: float, **extra: str) -> dict[str, str]:
    return worker_env(server, DEDUP_TTL=str(ttl), **extra)


def _client(env: dict[str, str]) -> Celery:
    """A publisher that imports the task module (so it takes holds at publish)."""
    from tests.apps import dedupapp  # noqa: PLC0415 - configured from the environment

    app: Celery = dedupapp.app
    app.conf.update(
        broker_url=env["REDLOCK_TEST_BROKER"],
        result_backend=env["REDLOCK_TEST_BACKEND"],
        redlock_url=env["REDLOCK_TEST_LOCKS"],
    )
    from celery_redlock.app.state import state_for  # noqa: PLC0415

    state_for(app).reset()
    return app


def _events(server: RedisServer, kind: str | None = None) -> list[dict[str, Any]]:
    events = [json.loads(r) for r in server.client(db=3).lrange("events", 0, -1)]
    return [e for e in events if kind is None or e["event"] == kind]


def _held(server: RedisServer, name: str) -> bool:
    locks = server.client(db=1)
    return bool(locks.exists(f"redlock:{{{name}}}") or locks.exists(f"redlock:{{{name}}}:queued"))


@pytest.fixture(scope="module")
def worker(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A prefork worker, concurrency 2, 30 s lock TTL, shared by the kill tests."""
    with running_worker(
        APP, _env(server, 30), tmp_path_factory.mktemp("w") / "worker.log", concurrency=2
    ) as w:
        yield w


@pytest.fixture
def client(server: RedisServer, worker: Worker) -> Iterator[Celery]:
    """The publisher for the shared worker; the record list is emptied first."""
    server.client(db=3).delete("events")
    yield _client(_env(server, 30))


def _start(server: RedisServer, task_id: str) -> dict[str, Any]:
    found = wait_for(lambda: [e for e in _events(server, "start") if e["task_id"] == task_id], 20)
    return found[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["sigkill-child", "hard-time-limit", "revoke-terminate"])
def test_a_lost_run_frees_the_key_at_once(client: Celery, server: RedisServer, how: str) -> None:
    """An "enqueue+run" key whose run is lost (child SIGKILLed, hard time limit, revoke
    with terminate) without acks_late (its message does not come back) is freed by the
    worker's main process at once (a SIGKILLed child's within a second), not after the
    30 s TTL: the next call is queued (a new task id) and runs."""
    key = f"{how}-{uuid.uuid4().hex[:6]}"
    if how == "hard-time-limit":
        task, args, name = client.tasks["dd.limited"], (key,), f"limited:{key}"
    else:
        task, args, name = client.tasks["dd.hold"], (key, 25), f"hold:{key}"
    first = task.delay(*args)
    child = _start(server, first.id)["pid"]
    assert _held(server, name)
    assert task.delay(*args).id == first.id  # running: a duplicate
    began = time.monotonic()
    if how == "sigkill-child":
        os.kill(child, signal.SIGKILL)
    elif how == "revoke-terminate":
        client.control.revoke(first.id, terminate=True, signal="SIGKILL")
    wait_for(lambda: not _held(server, name), 15)
    freed = time.monotonic() - began
    if how == "sigkill-child":  # without acks_late the message does not come back
        assert freed < 1.0, f"freed {freed:.2f} s after the kill"
    assert freed < 10, "freed by the main process, well before the TTL"
    if how != "hard-time-limit":
        again = client.tasks["dd.hold"].delay(key, 0)
        assert again.id != first.id
        assert again.get(timeout=20) == key


def test_a_killed_worker_leaves_the_key_to_expire_within_its_ttl(
    server: RedisServer, tmp_path: Path
) -> None:
    """The whole worker SIGKILLed mid-run: the key expires within the 2 s TTL, and the next
    call is queued and runs on another worker."""
    env = _env(server, 2, DEDUP_CONF=json.dumps({"task_default_queue": "killed"}))
    app = _client(env)
    app.conf.task_default_queue = "killed"
    server.client(db=3).delete("events")
    w = Worker(APP, env, tmp_path / "killed.log", concurrency=1, extra=("-Q", "killed"))
    try:
        w.wait_ready()
        first = app.tasks["dd.hold"].delay("killed", 25)
        _start(server, first.id)
        w.kill()
        killed = time.monotonic()
        wait_for(lambda: not _held(server, "hold:killed"), 10)
        assert time.monotonic() - killed < 2 + 1.0
    finally:
        w.stop()
    w2 = Worker(APP, env, tmp_path / "next.log", concurrency=1, extra=("-Q", "killed"))
    try:
        w2.wait_ready()
        again = app.tasks["dd.hold"].delay("killed", 0)
        assert again.id != first.id
        assert again.get(timeout=20) == "killed"
    finally:
        w2.stop()
        app.conf.task_default_queue = "celery"


@pytest.mark.skipif(
    tuple(int(part) for part in kombu.__version__.split(".")[:2]) < (5, 7),
    reason="kombu < 5.7 restores unacknowledged messages only every 10 s or more",
)
def test_a_redelivered_message_does_not_start_while_its_first_delivery_runs(
    server: RedisServer, tmp_path: Path
) -> None:
    """Redis broker, acks_late, a 1 s visibility timeout and a 3.5 s task: the broker hands
    the message out again while it runs; that copy does not start (the body runs once)."""
    conf = {
        "task_acks_late": True,
        "task_default_queue": "redeliver",
        "broker_transport_options": {
            "visibility_timeout": 1,
            "unacked_restore_interval": 0.5,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 5,
        },
    }
    env = _env(server, 30, DEDUP_CONF=json.dumps(conf))
    app = _client(env)
    app.conf.update(conf)
    server.client(db=3).delete("events")
    w = Worker(APP, env, tmp_path / "redeliver.log", concurrency=2, extra=("-Q", "redeliver"))
    try:
        w.wait_ready()
        result = app.tasks["dd.hold"].delay("redeliver", 3.5)
        assert result.get(timeout=30) == "redeliver"
        wait_for(lambda: "this copy does not start" in w.text(), 10)
        wait_for(lambda: "dropped" in w.text(), 10)
    finally:
        w.kill()  # a warm shutdown waits on the transport's restore of unacked messages
        w.stop()
        app.conf.update(task_acks_late=False, task_default_queue="celery")
    assert len([e for e in _events(server, "start") if e["task_id"] == result.id]) == 1


# -------------------------------------------------------------- canvas members and purge
def test_a_chains_last_step_whose_key_runs_is_sent_and_skipped_by_its_worker(
    client: Celery, server: RedisServer
) -> None:
    """chain(pre.s(1), fin.s()) while fin.delay(100, 3) runs its key: the chain's last step
    (frozen, no chain or link of its own) is sent, not answered with the running id, and
    its worker skips it visibly: the chain's get() returns the skip marker naming the
    running call within seconds."""
    tag = f"last-{uuid.uuid4().hex[:6]}"
    fin = client.tasks["dd.fin"]
    chained = (client.tasks["dd.pre"].s(1) | fin.s(tag=tag)).apply_async()
    running = fin.delay(100, 3, tag=tag)
    value = chained.get(timeout=10)
    assert isinstance(value, dict) and value.get("celery_redlock.skipped") is True, value
    assert value["task_id"] == running.id
    assert running.get(timeout=10) == 100


def test_two_identical_chains_both_end_in_a_result(client: Celery, server: RedisServer) -> None:
    """Two chains estep(0, 1) | estep(10) of one key at once, three times: a chain's second
    step that finds the other chain's first step holding the key is sent and ends in a
    result (a run, or the visible skip), so each chain's get() returns within seconds."""
    estep = client.tasks["dd.estep"]
    for _ in range(3):
        tag = f"twin-{uuid.uuid4().hex[:6]}"
        a = (estep.s(0, 1, tag=tag) | estep.s(10, tag=tag)).apply_async()
        b = (estep.s(0, 1, tag=tag) | estep.s(10, tag=tag)).apply_async()
        for value in (a.get(timeout=15), b.get(timeout=15)):
            skipped = isinstance(value, dict) and value.get("celery_redlock.skipped") is True
            assert value == 11 or skipped, value


def test_a_chord_of_raise_members_completes_with_the_duplicate_skipped(
    client: Celery, server: RedisServer
) -> None:
    """A chord whose header members are lock_on_duplicate="raise" and hold a duplicate: the
    duplicate is sent and skipped by its worker (SUCCESS, the marker), never AlreadyQueued,
    so the chord's callback runs and its get() returns within seconds."""
    tag = f"chord-{uuid.uuid4().hex[:6]}"
    part = client.tasks["dd.rpart"]
    result = chord([part.s(tag, 1), part.s(tag, 1), part.s(tag, 2)])(client.tasks["dd.rtotal"].s())
    assert result.get(timeout=15) == {"sum": 3, "skipped": 1}
    members = result.parent.results
    assert [m.state for m in members] == ["SUCCESS"] * 3


def _documented_release() -> list[str]:
    """The command docs/dedup.md gives to clear the holds of purged messages (its argv)."""
    page = (ROOT / "docs" / "dedup.md").read_text().splitlines()
    lines = [ln.strip().removeprefix("$ ") for ln in page]
    (line,) = [ln for ln in lines if ln.startswith("celery -A proj locks release")]
    return shlex.split(line)


def test_after_purge_the_documented_release_lets_the_next_call_be_sent(
    server: RedisServer,
) -> None:
    """`celery -A app purge -f` drops queued lock_on="enqueue+run" messages but not their
    holds (a new call still returns a purged id); the one command docs/dedup.md gives then
    releases those holds, and the next call is sent under a new id."""
    conf = {"task_default_queue": "purged"}
    env = _env(server, 30, DEDUP_CONF=json.dumps(conf))
    app = _client(env)
    app.conf.task_default_queue = "purged"
    broker = server.client(db=0)
    tag = f"purge-{uuid.uuid4().hex[:6]}"
    fin = app.tasks["dd.fin"]
    try:
        first = fin.delay(1, tag=tag)
        assert broker.llen("purged") == 1
        celery_env = {**os.environ, **env}

        def celery(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "celery", "-A", APP, *argv],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=celery_env,
                timeout=60,
                check=False,
            )

        purged = celery("purge", "-f")
        assert purged.returncode == 0, purged.stderr
        assert broker.llen("purged") == 0
        assert fin.delay(1, tag=tag).id == first.id  # the purged message's hold is left
        argv = _documented_release()
        assert argv[:4] == ["celery", "-A", "proj", "locks"]
        released = celery(*argv[3:])
        assert released.returncode == 0, released.stderr
        assert f"taken at publish for task {first.id}" in released.stdout
        again = fin.delay(1, tag=tag)
        assert again.id != first.id
        assert broker.llen("purged") == 1
    finally:
        broker.delete("purged")
        app.conf.task_default_queue = "celery"


def _runs_never_overlap(server: RedisServer, key: str, kills: dict[int, float]) -> None:
    """Each run of *key* (a start, then its end, or its kill) ends before the next starts."""
    runs = []
    for start in _events(server, "start"):
        if start["key"] != key:
            continue
        ends = [
            e["t"]
            for e in _events(server, "end")
            if e["key"] == key and e["pid"] == start["pid"] and e["t"] >= start["t"]
        ]
        end = min(ends) if ends else kills.get(start["pid"])
        assert end is not None, f"a run that neither ended nor was killed: {start}"
        runs.append((start["t"], end, start["task_id"]))
    runs.sort()
    for (_, end, before), (begin, _, after) in itertools.pairwise(runs):
        assert begin >= end, f"two runs of {key!r} at once: {before} and {after}"


def _keep_calling(app: Celery, key: str, stop: threading.Event, ids: list[str]) -> None:
    """Call dd.hold(key, 1.0) every 0.1 s until *stop*, keeping each task id handed back."""
    for _ in range(1200):  # bounded: two minutes of calls at most
        if stop.wait(0.1):
            return
        ids.append(app.tasks["dd.hold"].delay(key, 1.0).id)


def test_a_requeued_killed_run_keeps_its_place_and_every_id_runs(
    server: RedisServer, tmp_path: Path
) -> None:
    """acks_late and task_reject_on_worker_lost: calls for one key keep arriving while the
    running child is SIGKILLed twice in a row. The killed run's message comes back and
    its task id keeps the key meanwhile (calls get that id), every task id handed to a
    caller ends with a run of that id, and no two runs of the key overlap."""
    conf = {
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_default_queue": "requeued",
    }
    env = _env(server, 30, DEDUP_CONF=json.dumps(conf))
    app = _client(env)
    app.conf.update(conf)
    server.client(db=3).delete("events")
    key = f"requeued-{uuid.uuid4().hex[:6]}"
    w = Worker(APP, env, tmp_path / "requeued.log", concurrency=2, extra=("-Q", "requeued"))
    stop, ids, kills = threading.Event(), list[str](), dict[int, float]()  # kills: pid -> when
    caller = threading.Thread(target=_keep_calling, args=(app, key, stop, ids), daemon=True)
    try:
        w.wait_ready()
        caller.start()
        victim = None
        for _ in range(2):  # kill the run, then the run of its redelivered copy

            def run_to_kill(victim: str | None = victim) -> list[dict[str, Any]]:
                return [
                    e
                    for e in _events(server, "start")
                    if e["key"] == key
                    and e["pid"] not in kills
                    and (victim is None or e["task_id"] == victim)
                ]

            start = wait_for(run_to_kill, 20, "a run to kill")[0]
            victim = start["task_id"]
            os.kill(start["pid"], signal.SIGKILL)
            kills[start["pid"]] = time.time()
        time.sleep(2.5)  # calls keep coming after the second kill
        stop.set()
        caller.join(10)
        handed = set(ids)
        assert victim in handed, "callers were given the killed run's task id"
        wait_for(  # well within the 30 s lease a dead run's lock would otherwise keep
            lambda: handed <= {e["task_id"] for e in _events(server, "end") if e["key"] == key},
            20,
            "a run of every task id handed to a caller",
        )
        assert app.AsyncResult(victim).get(timeout=10) == key
    finally:
        stop.set()
        w.stop()
        app.conf.update(task_acks_late=False, task_reject_on_worker_lost=False)
        app.conf.task_default_queue = "celery"
    ended = [e["task_id"] for e in _events(server, "end") if e["key"] == key]
    assert len(ended) == len(set(ended)), "a task id ran to its end twice"
    _runs_never_overlap(server, key, kills)
    log = w.text()
    assert log.count("kept for its redelivered copy") == 2, log[-3000:]
    # docs/dedup.md quotes this line: the same words, with its example's names and numbers
    ours = {"dd.hold": "proj.sync_user", f"hold:{key}": "sync:42"}
    kept = [_shape(line, ours) for line in log.splitlines() if "kept for its redel" in line]
    assert _shape(_dedup_doc_kept_line(), {}) in kept, (_dedup_doc_kept_line(), kept)


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _shape(line: str, names: dict[str, str]) -> str:
    """*line* with *names* replaced, task ids as <id> and every number as <n>."""
    for name, example in names.items():
        line = line.replace(name, example)
    return re.sub(r"\d+", "<n>", _UUID.sub("<id>", line.strip()))


def _dedup_doc_kept_line() -> str:
    """The kept-for-redelivery line docs/dedup.md quotes."""
    page = (ROOT / "docs" / "dedup.md").read_text().splitlines()
    (line,) = [ln.strip() for ln in page if ln.strip().startswith("[") and "kept for" in ln]
    return line


def test_beat_every_half_second_never_overlaps_nor_backs_up_two_second_runs(
    server: RedisServer, tmp_path: Path
) -> None:
    """beat publishes two "enqueue+run" tasks every 0.5 s, each running 2 s: dd.tick through
    its apply_async (beat knows it), dd.blind_tick by name (beat does not know it: its
    worker checks). Runs of each never overlap, they follow each other (no gaps of more
    than a tick or two), and once beat stops no backlog of duplicates keeps them going."""
    env = _env(server, 30, DEDUP_CONF=json.dumps({"task_default_queue": "beat"}))
    server.client(db=3).delete("events")
    w = Worker(APP, env, tmp_path / "beat-worker.log", concurrency=2, extra=("-Q", "beat"))
    beat: subprocess.Popen[bytes] | None = None
    beat_log = open(tmp_path / "beat.log", "wb")
    try:
        w.wait_ready()
        argv = [sys.executable, "-m", "celery", "-A", APP, "beat", "-l", "info", "--pidfile="]
        argv += ["-s", str(tmp_path / "schedule")]
        beat = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **env, "DEDUP_ROLE": "beat"},
            stdout=beat_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(lambda: len(_events(server, "run")) >= 2, 20)
        time.sleep(6.5)  # the scenario itself: beat ticks 13 times while runs take 2 s
        beat.send_signal(signal.SIGTERM)
        beat.wait(15)
        stopped = time.time()
        wait_for(lambda: len(_events(server, "run")) == len(_events(server, "run-end")), 15)
        time.sleep(1.0)  # a backlog would start another run now
    finally:
        if beat is not None and beat.poll() is None:
            os.killpg(beat.pid, signal.SIGKILL)
            beat.wait(10)
        beat_log.close()
        w.stop()
    log = (tmp_path / "beat-worker.log").read_text(errors="replace")
    beat_said = (tmp_path / "beat.log").read_text(errors="replace")
    assert "dd.tick" in beat_said and "not sent: lock 'tick' is held by task" in beat_said
    for name in ("tick", "blind"):
        starts = sorted(e["start"] for e in _events(server, "run") if e["name"] == name)
        ends = sorted(e["end"] for e in _events(server, "run-end") if e["name"] == name)
        assert len(starts) >= 3, (name, starts)
        for before_end, next_start in zip(ends, starts[1:], strict=False):
            assert next_start >= before_end, f"{name}: two runs at once"
            assert next_start - before_end < 1.6, f"{name}: a gap, a tick was lost"
        assert sum(1 for s in starts if s > stopped + 0.5) == 0, f"{name}: backlog after beat"
    assert "not started: a duplicate" in log  # blind_tick's duplicates, skipped visibly
