"""Foreign or malformed data under the lock key prefix, on real servers.

Something other than celery-redlock may write under ``redlock:`` (a script with the
same prefix, an operator's ``SET``, an older build): a string where a lock hash is
expected, a hash without its fields, an unreadable or huge holder record, a key with no
TTL, a fence counter that is not an integer. Whatever is there, every part reports it
clearly, naming the key: ``Lock`` and ``Redlock``, the renewal thread, a worker running
``LockedTask``, ``celery locks`` and beat's ``LeaderScheduler``. None of them crashes,
runs a task without its lock, or calls it a Redis outage (``StoreUnavailable``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.celery import celery as celery_main
from click.testing import CliRunner, Result
from inprocess import settings_on
from servers import RedisServer, wait_for

from celery_redlock import (
    ConfigError,
    Lock,
    LockContended,
    LockedTask,
    LockLost,
    Redlock,
    StoreUnavailable,
)
from celery_redlock.beat import LeaderScheduler
from celery_redlock.core.renewal import get_manager
from tests.apps import locksapp

FOREIGN_WORDS = "not a celery-redlock lock"
_apps = itertools.count(1)


def text_client(server: RedisServer, db: int = 0) -> redis.Redis:
    """A plain client that decodes replies, for writing and reading foreign data."""
    return server.client(db=db, decode_responses=True)


def warnings_of(caplog: pytest.LogCaptureFixture, logger: str = "celery_redlock") -> list[str]:
    """celery_redlock messages logged at WARNING or above."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(logger) and r.levelno >= logging.WARNING
    ]


#: Ways to put something that is not a lock hash at a key.
NON_HASH_WRITERS: dict[str, Callable[[redis.Redis, str], Any]] = {
    "string": lambda c, k: c.set(k, "written by someone else"),
    "list": lambda c, k: c.rpush(k, "a", "b"),
    "set": lambda c, k: c.sadd(k, "a"),
    "zset": lambda c, k: c.zadd(k, {"a": 1.0}),
}


# ------------------------------------------------------------------ Lock: the lock key


@pytest.mark.parametrize("kind", sorted(NON_HASH_WRITERS))
@pytest.mark.parametrize("blocking", [False, True])
def test_acquire_over_a_non_hash_at_the_lock_key_is_a_config_error_naming_the_key(
    redis_client: redis.Redis, shared_redis: RedisServer, kind: str, blocking: bool
) -> None:
    """A string (list, set, zset) where the lock hash goes: ConfigError naming the key and
    its type, at once even when blocking, and the foreign key is left as it was."""
    raw = text_client(shared_redis)
    lock = Lock(redis_client, "sync:1", ttl=5, auto_renew=False)
    NON_HASH_WRITERS[kind](raw, lock.keys.lock)
    before = raw.dump(lock.keys.lock)
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        lock.acquire(blocking=blocking, timeout=5 if blocking else None)
    assert time.monotonic() - started < 2
    message = str(caught.value)
    assert repr(lock.keys.lock) in message and f"holds a {kind}" in message
    assert "prefix" in message  # says what to do about it
    assert not isinstance(caught.value, StoreUnavailable)
    assert raw.dump(lock.keys.lock) == before
    assert not raw.exists(lock.keys.fence)
    assert lock.fence is None and not lock.owned()


def test_reading_or_releasing_a_foreign_key_from_outside_names_the_key(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """read_holder() and release_matching() on a string say so (ConfigError naming the key),
    not "Redis unavailable"; locked() says the name is taken."""
    raw = text_client(shared_redis)
    lock = Lock(redis_client, "sync:2", ttl=5)
    raw.set(lock.keys.lock, "x")
    for call in (lock.read_holder, lambda: lock.release_matching(task_id="t")):
        with pytest.raises(ConfigError, match=r"holds a string") as caught:
            call()
        assert repr(lock.keys.lock) in str(caught.value)
    assert lock.locked()
    assert raw.get(lock.keys.lock) == "x"


@pytest.mark.parametrize(
    "fields",
    [{"info": "{}"}, {"fence": "7"}, {"info": "not json", "fence": "x"}, {"other": "x"}],
    ids=["info-only", "fence-only", "garbage", "unrelated-field"],
)
def test_a_hash_without_a_token_is_no_lock_and_is_taken_with_an_expiry(
    redis_client: redis.Redis, shared_redis: RedisServer, fields: dict[str, str]
) -> None:
    """A hash with no ``token`` field holds no lock: acquire takes it, gives it our TTL and
    fence, and release removes it."""
    raw = text_client(shared_redis)
    lock = Lock(redis_client, "sync:3", ttl=5, auto_renew=False, fence_ttl=None)
    raw.hset(lock.keys.lock, mapping=fields)
    assert lock.acquire(blocking=False)
    assert lock.fence == 1
    assert 0 < raw.pttl(lock.keys.lock) <= 5000
    assert raw.hget(lock.keys.lock, "fence") == "1"
    lock.release()
    assert not raw.exists(lock.keys.lock)


def test_a_foreign_holder_without_expiry_is_contended_and_warned_about(
    redis_client: redis.Redis, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A token hash with no TTL (never freed by itself) is contention, never taken over; each
    attempt warns that it has no expiry, naming the key and how to remove it; a blocking
    acquire gives up at its timeout."""
    caplog.set_level(logging.WARNING, logger="celery_redlock")
    raw = text_client(shared_redis)
    lock = Lock(redis_client, "sync:4", ttl=5, auto_renew=False)
    raw.hset(lock.keys.lock, mapping={"token": "someone", "info": '{"task_name": "old.task"}'})
    assert lock.acquire(blocking=False) is False
    assert lock.holder == {"task_name": "old.task"}
    assert lock.holder_ttl_ms == -1
    started = time.monotonic()
    assert lock.acquire(timeout=0.3) is False
    assert 0.25 < time.monotonic() - started < 2
    warned = [m for m in warnings_of(caplog) if "NO expiry" in m]
    assert warned and all(repr(lock.keys.lock) in m for m in warned)
    assert "celery locks release sync:4" in warned[0]
    assert raw.hget(lock.keys.lock, "token") == "someone"
    assert raw.pttl(lock.keys.lock) == -1


@pytest.mark.parametrize(
    ("info", "holder"),
    [
        ("{not json", {"raw": "{not json"}),
        ("[1, 2]", {"raw": "[1, 2]"}),
        ('"text"', {"raw": '"text"'}),
        ("", {}),
    ],
)
def test_an_unreadable_holder_record_is_shown_raw(
    redis_client: redis.Redis, shared_redis: RedisServer, info: str, holder: dict[str, Any]
) -> None:
    """A holder record that is not a JSON object is reported as its raw text."""
    raw = text_client(shared_redis)
    lock = Lock(redis_client, "sync:5", ttl=5, auto_renew=False)
    raw.hset(lock.keys.lock, mapping={"token": "someone", "info": info})
    raw.pexpire(lock.keys.lock, 5000)
    assert lock.acquire(blocking=False) is False
    assert lock.holder == holder
    assert lock.read_holder() == holder


def test_a_huge_holder_record_is_cut_before_it_reaches_errors_and_logs(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """An 8 MB holder record is reported as its first 200 characters and its size: it does
    not travel whole into LockContended (and from there into task results)."""
    raw = text_client(shared_redis)
    lock = Lock(redis_client, "sync:6", ttl=5, auto_renew=False)
    raw.hset(lock.keys.lock, mapping={"token": "someone", "info": "x" * 8_000_000})
    raw.pexpire(lock.keys.lock, 5000)
    assert lock.acquire(blocking=False) is False
    assert len(repr(lock.holder)) < 400
    assert "8000000 characters" in lock.holder["raw"]
    with pytest.raises(LockContended) as caught, Lock(redis_client, "sync:6", blocking=False):
        pass
    assert len(str(caught.value)) < 400
    assert len(json.dumps(caught.value.holder)) < 400


# ------------------------------------------------------------------ Lock: the fence counter


@pytest.mark.parametrize(
    ("write", "words"),
    [
        (lambda c, k: c.set(k, "abc"), "holds 'abc', not an integer"),
        (lambda c, k: c.set(k, "1.5"), "holds '1.5', not an integer"),
        (lambda c, k: c.set(k, str(2**63 - 1)), "largest integer"),
        (lambda c, k: c.hset(k, "n", "1"), "holds a hash, not an integer"),
    ],
    ids=["text", "float", "int64-max", "hash"],
)
def test_a_foreign_fence_counter_is_a_config_error_naming_the_counter(
    redis_client: redis.Redis,
    shared_redis: RedisServer,
    write: Callable[[redis.Redis, str], Any],
    words: str,
) -> None:
    """A fence counter that cannot count on: ConfigError naming the counter key and what it
    holds; no lock key is left behind, and the counter is not touched."""
    raw = text_client(shared_redis)
    lock = Lock(redis_client, "sync:7", ttl=5, auto_renew=False)
    write(raw, lock.keys.fence)
    before = raw.dump(lock.keys.fence)
    with pytest.raises(ConfigError) as caught:
        lock.acquire(blocking=False)
    assert repr(lock.keys.fence) in str(caught.value) and words in str(caught.value)
    assert not raw.exists(lock.keys.lock)
    assert raw.dump(lock.keys.fence) == before


# ------------------------------------------------------------------ Lock: held, then overwritten


def test_extend_release_and_owned_of_a_lock_overwritten_by_foreign_data(
    redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """A held lock whose key someone overwrote with a string is lost, and said to be lost to
    foreign data: owned() is False, extend() and release() raise LockLost (not an outage),
    and the foreign value is left alone."""
    raw = text_client(shared_redis)
    lock = Lock(redis_client, "sync:8", ttl=5, auto_renew=False)
    assert lock.acquire(blocking=False)
    raw.set(lock.keys.lock, "overwritten")
    with pytest.raises(LockLost, match=FOREIGN_WORDS):
        lock.extend()
    assert lock.lost and FOREIGN_WORDS in lock.lost_reason
    with pytest.raises(LockLost, match=FOREIGN_WORDS):
        lock.release()
    assert raw.get(lock.keys.lock) == "overwritten"

    other = Lock(redis_client, "sync:9", ttl=5, auto_renew=False)
    assert other.acquire(blocking=False)
    raw.set(other.keys.lock, "overwritten")
    assert other.owned() is False
    assert other.lost
    with pytest.raises(LockLost):
        other.release()

    third = Lock(redis_client, "sync:10", ttl=5, auto_renew=False)
    assert third.acquire(blocking=False)
    raw.set(third.keys.lock, "overwritten")
    with pytest.raises(LockLost, match=FOREIGN_WORDS):  # release without a look first
        third.release()


def test_the_renewal_thread_loses_only_the_lock_whose_key_was_overwritten(
    redis_client: redis.Redis, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """One foreign key in the renewal batch costs only its own lock: it is marked lost (a
    WARNING says why), while the other lock on that Redis is renewed for many TTLs, by the
    same thread, which is still alive."""
    caplog.set_level(logging.WARNING, logger="celery_redlock")
    raw = text_client(shared_redis)
    spoiled = Lock(redis_client, "renew:spoiled", ttl=0.6)
    kept = Lock(redis_client, "renew:kept", ttl=0.6)
    assert spoiled.acquire(blocking=False) and kept.acquire(blocking=False)
    thread = get_manager().thread
    raw.set(spoiled.keys.lock, "overwritten")
    wait_for(lambda: spoiled.lost, 3, "the overwritten lock to be marked lost")
    assert FOREIGN_WORDS in spoiled.lost_reason
    wait_for(  # the renewal thread marks the lock lost, then logs why
        lambda: any("renew:spoiled" in m and FOREIGN_WORDS in m for m in warnings_of(caplog)),
        3,
        "the WARNING about the overwritten lock",
    )
    rounds = get_manager().rounds
    deadline = time.monotonic() + 4 * kept.ttl
    while time.monotonic() < deadline:
        assert kept.owned(), "the other lock lost its renewal"
        time.sleep(0.05)
    assert get_manager().rounds >= rounds + 5
    assert thread is not None and thread.is_alive() and get_manager().thread is thread
    assert not kept.lost
    kept.release()
    with pytest.raises(LockLost):
        spoiled.release()


# ------------------------------------------------------------------ Redlock


def test_redlock_with_foreign_data_on_a_minority_still_locks_and_on_a_majority_says_so(
    redis_servers: Callable[[int], list[RedisServer]],
) -> None:
    """A string at the lock key on one master of three costs that master only: the lock is
    taken, kept alive and released. On two of three it is a ConfigError naming the key and
    each master's answer, not a quorum outage."""
    servers = redis_servers(3)
    clients = [s.client() for s in servers]
    lock = Redlock(clients, "redlock:one-bad", ttl=0.6)
    raw = [text_client(s) for s in servers]
    raw[0].set(lock.keys.lock, "foreign")
    assert lock.acquire(blocking=False)
    deadline = time.monotonic() + 3 * lock.ttl
    while time.monotonic() < deadline:
        assert lock.owned() and not lock.lost
        time.sleep(0.05)
    lock.release()
    assert raw[0].get(lock.keys.lock) == "foreign"
    assert not raw[1].exists(lock.keys.lock) and not raw[2].exists(lock.keys.lock)

    raw[1].set(lock.keys.lock, "foreign")
    again = Redlock(clients, "redlock:one-bad", ttl=5, auto_renew=False)
    with pytest.raises(ConfigError) as caught:
        again.acquire(blocking=False)
    assert not isinstance(caught.value, StoreUnavailable)
    assert repr(lock.keys.lock) in str(caught.value) and "2 of 3 masters" in str(caught.value)
    assert not raw[2].exists(lock.keys.lock)  # what master 2 granted was given back


# ------------------------------------------------------------------ LockedTask on a worker
# pytest-celery's celery_app (the settings below) with the task of the test, then the
# plugin's redlock_worker: an in-process worker, threads pool.


@pytest.fixture
def celery_config(shared_redis: RedisServer, redis_client: redis.Redis) -> dict[str, Any]:
    """celery_app on the (flushed) shared server: broker db 0, locks db 1, results db 2,
    a queue of its own."""
    return settings_on(
        shared_redis, 0, 2, 1,
        task_default_queue=f"foreign{next(_apps)}-{uuid.uuid4().hex[:6]}",
        broker_connection_retry_on_startup=True,
        broker_transport_options={"polling_interval": 0.1},
        worker_prefetch_multiplier=1,
    )  # fmt: skip


@pytest.fixture
def sync(celery_app: Celery) -> Any:
    """``sync(uid)`` under the lock sync:<uid>; ``sync.ran`` lists the uids whose body ran."""
    ran: list[int] = []

    @celery_app.task(base=LockedTask, lock_key="sync:<uid>", shared=False)
    def sync(uid: int) -> int:
        ran.append(uid)
        return uid

    sync.ran = ran  # type: ignore[attr-defined]
    return sync


def test_a_task_whose_lock_key_holds_foreign_data_fails_clearly_and_never_runs(
    sync: Any, redlock_worker: Any, shared_redis: RedisServer
) -> None:
    """A run whose lock key holds a string fails with a ConfigError naming the key; its body
    never runs; the worker goes on and runs the next call (another key) under its lock."""
    locks = text_client(shared_redis, db=1)
    locks.set("redlock:{sync:1}", "foreign")
    bad = sync.delay(1)
    with pytest.raises(ConfigError) as caught:
        bad.get(timeout=20, propagate=True)
    assert "'redlock:{sync:1}' holds a string" in str(caught.value)
    assert sync.delay(2).get(timeout=20) == 2
    assert sync.ran == [2]
    assert locks.get("redlock:{sync:1}") == "foreign"
    assert not locks.exists("redlock:{sync:2}")


@pytest.fixture
def job(celery_app: Celery) -> Any:
    """``job(n, wait)`` under the lock job:<n> (0.6 s lease, renewed) for *wait* seconds;
    ``job.started`` is set when a body starts, ``job.outcome`` says how each ended."""
    started = threading.Event()
    outcome: list[str] = []

    @celery_app.task(base=LockedTask, lock_key="job:<n>", lock_ttl=0.6, shared=False)
    def job(n: int, wait: float) -> int:
        started.set()
        try:
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                time.sleep(0.01)
        except LockLost as exc:
            outcome.append(str(exc))
            raise
        outcome.append("finished")
        return n

    job.started, job.outcome = started, outcome  # type: ignore[attr-defined]
    return job


def test_a_running_task_whose_key_is_overwritten_gets_lock_lost_and_the_worker_goes_on(
    job: Any, redlock_worker: Any, shared_redis: RedisServer
) -> None:
    """A key overwritten while its task runs: the renewal thread finds foreign data, the
    body is interrupted with LockLost (lock_on_lost="raise"), and the worker runs the
    next task under a fresh lock."""
    outcome: list[str] = job.outcome
    locks = text_client(shared_redis, db=1)
    running = job.delay(1, 10.0)
    assert job.started.wait(20)
    locks.delete("redlock:{job:1}")
    locks.set("redlock:{job:1}", "foreign")
    with pytest.raises(LockLost) as caught:
        running.get(timeout=20, propagate=True)
    assert FOREIGN_WORDS in str(caught.value) and "job:1" in str(caught.value)
    assert len(outcome) == 1  # the body was interrupted
    assert job.delay(2, 0.0).get(timeout=20) == 2
    assert outcome[-1] == "finished"
    assert locks.get("redlock:{job:1}") == "foreign"


# ------------------------------------------------------------------ celery locks


@pytest.fixture
def cli_locks(redis_client: redis.Redis, shared_redis: RedisServer) -> Iterator[redis.Redis]:
    """locksapp's locks live on the (flushed) shared server; a decoding client to it."""
    conf = locksapp.app.conf
    saved = conf.get("redlock_url")
    conf.redlock_url = shared_redis.url
    try:
        yield text_client(shared_redis)
    finally:
        conf.redlock_url = saved


def run_cli(*args: str) -> Result:
    """``celery -A tests.apps.locksapp locks ARGS`` in this process."""
    return CliRunner().invoke(
        celery_main, ["-A", "tests.apps.locksapp", "locks", *args], catch_exceptions=False
    )


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


#: Lock hashes with a token (so they look held) and malformed other fields.
MALFORMED = {
    "bad-fence": {"fence": "abc", "info": '{"task_name": "t"}'},
    "unicode-digit-fence": {"fence": "\u00b2", "info": "{}"},
    "no-fence-no-info": {},
    "bad-json": {"fence": "3", "info": "{not json"},
    "nan-time": {"fence": "4", "info": '{"acquired_at": NaN, "pid": [1, 2]}'},
    "far-time": {"fence": "5", "info": '{"acquired_at": 1e300, "task_name": "t"}'},
    "negative-time": {"fence": "6", "info": '{"acquired_at": -1e300}'},
    "infinite-time": {"fence": "7", "info": '{"acquired_at": Infinity, "hostname": NaN}'},
    "huge-info": {"fence": "8", "info": json.dumps({"task_name": "t" * 70_000})},
    "multiline": {"fence": "9", "info": json.dumps({"task_name": "a\nb\r\nc", "x": "y\n" * 5})},
}


def test_locks_list_and_show_render_malformed_lock_hashes_without_crashing(
    cli_locks: redis.Redis, redis_client: redis.Redis
) -> None:
    """list (table and --json) and show survive hashes with a bad fence, bad or huge JSON,
    impossible times and no TTL: exit 0, strict JSON, bounded one-line cells, real locks
    shown as usual."""
    real = Lock(redis_client, "real", ttl=30)
    assert real.acquire(blocking=False)
    try:
        for name, fields in MALFORMED.items():
            cli_locks.hset(f"redlock:{{{name}}}", mapping={"token": "foreign", **fields})
        cli_locks.set("redlock:{a-string}", "x")
        listed = run_cli("list")
        assert listed.exit_code == 0, listed.output
        lines = listed.stdout.splitlines()
        assert len(lines) == 1 + len(MALFORMED) + 1
        assert all(len(line) < 1200 for line in lines)
        as_json = run_cli("list", "--json")
        assert as_json.exit_code == 0, as_json.output
        rows = {row["name"]: row for row in _strict_json(as_json.stdout)}
        assert set(rows) == {*MALFORMED, "real"}
        assert rows["real"]["fence"] == real.fence and rows["real"]["ttl_ms"] > 0
        for name in MALFORMED:
            row = rows[name]
            assert row["ttl_ms"] == -1  # no expiry, and shown as such
            assert row["acquired_at"] is None
        assert rows["bad-fence"]["fence"] is None
        assert rows["unicode-digit-fence"]["fence"] is None
        assert rows["bad-json"]["fence"] == 3
        assert "no expiry" in listed.stdout
        for name in MALFORMED:
            shown = run_cli("show", name)
            assert shown.exit_code == 0, shown.output
            assert all(len(line) < 400 for line in shown.stdout.splitlines())
            assert _strict_json(run_cli("show", name, "--json").stdout)[0]["name"] == name
    finally:
        real.release()


def test_locks_show_and_release_of_a_key_holding_foreign_data_exit_2_naming_it(
    cli_locks: redis.Redis,
) -> None:
    """show/release of a name whose key holds a string or a token-less hash: exit 2 (a
    configuration problem, not "not held" and not "unreachable"), naming the key; release
    never deletes what celery-redlock did not write."""
    cli_locks.set("redlock:{str}", "x")
    cli_locks.hset("redlock:{tokenless}", "field", "x")
    for name, what in (("str", "a string"), ("tokenless", "a hash without a lock token")):
        for args in (("show", name), ("release", name, "--force")):
            result = run_cli(*args)
            assert result.exit_code == 2, result.output
            assert f"'redlock:{{{name}}}' holds {what}" in result.stderr
            assert FOREIGN_WORDS in result.stderr
    assert cli_locks.get("redlock:{str}") == "x"
    assert cli_locks.hget("redlock:{tokenless}", "field") == "x"


def test_locks_release_removes_a_lock_hash_that_has_no_expiry(cli_locks: redis.Redis) -> None:
    """A lock hash left without a TTL (never freed by itself) is removed by release --force."""
    cli_locks.hset("redlock:{stuck}", mapping={"token": "t", "fence": "3", "info": "{}"})
    shown = run_cli("show", "stuck")
    assert shown.exit_code == 0 and "no expiry" in shown.stdout
    result = run_cli("release", "stuck", "--force")
    assert result.exit_code == 0, result.output
    assert not cli_locks.exists("redlock:{stuck}")


# ------------------------------------------------------------------ beat


@pytest.fixture
def beat_app(shared_redis: RedisServer, redis_client: redis.Redis) -> Iterator[Celery]:
    """An app for LeaderScheduler with a short leader lease and one hourly entry."""
    base = f"redis://{shared_redis.host}:{shared_redis.port}"
    number = next(_apps)
    celery_app = Celery(f"beatfd{number}", broker=f"{base}/0", set_as_current=False)
    celery_app.conf.update(
        redlock_url=f"{base}/1",
        redlock_beat_ttl=0.3,
        beat_schedule={"hourly": {"task": "x.hourly", "schedule": 3600.0}},
    )
    try:
        yield celery_app
    finally:
        celery_app.close()


@contextlib.contextmanager
def scheduler(app: Celery) -> Iterator[LeaderScheduler]:
    """A LeaderScheduler on *app*, closed afterwards."""
    sched = LeaderScheduler(app)
    try:
        yield sched
    finally:
        sched.close()


def beat_problems(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "celery_redlock.beat" and r.levelno >= logging.WARNING
    ]


def test_beat_over_a_foreign_leader_key_stands_by_logs_once_and_leads_once_it_is_removed(
    beat_app: Celery, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A string at the leader lock's key: beat stands by (never crashes), logs ONE error
    naming the key (not "cannot reach"), and leads as soon as the key is removed."""
    caplog.set_level(logging.INFO, logger="celery_redlock")
    locks = text_client(shared_redis, db=1)
    key = f"redlock:{{beat:leader:{beat_app.main}}}"
    locks.set(key, "foreign")
    with scheduler(beat_app) as sched:
        for _ in range(4):
            sched.tick()
            assert not sched.is_leader
        problems = beat_problems(caplog)
        assert len(problems) == 1, [r.getMessage() for r in problems]
        assert problems[0].levelno == logging.ERROR
        assert repr(key) in problems[0].getMessage()
        assert "cannot reach" not in problems[0].getMessage()
        locks.delete(key)
        sched.tick()
        assert sched.is_leader
    assert locks.get(key) is None  # resigned at close


def test_beat_with_a_foreign_tick_records_key_stands_by_without_holding_the_lock(
    beat_app: Celery, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The ``:ticks`` hash replaced by a string: beat cannot know what was published, so it
    does not lead, logs one error naming that key, and does not sit on the leader lock
    (another beat could lead); once the key is removed it leads."""
    caplog.set_level(logging.INFO, logger="celery_redlock")
    locks = text_client(shared_redis, db=1)
    leader_key = f"redlock:{{beat:leader:{beat_app.main}}}"
    locks.set(f"{leader_key}:ticks", "foreign")
    with scheduler(beat_app) as sched:
        for _ in range(3):
            sched.tick()
            assert not sched.is_leader
            assert not locks.exists(leader_key)
        problems = beat_problems(caplog)
        assert len(problems) == 1, [r.getMessage() for r in problems]
        assert f"'{leader_key}:ticks'" in problems[0].getMessage()
        locks.delete(f"{leader_key}:ticks")
        sched.tick()
        assert sched.is_leader


@pytest.mark.parametrize(
    "record",
    [
        "{not json",
        json.dumps({"at": 1e300, "n": 3, "fence": 1}),
        json.dumps({"at": -1e300, "n": 3, "fence": 1}),
        json.dumps({"at": "yesterday", "n": 3}),
        json.dumps({"at": 1.0, "n": "many"}),
        json.dumps(["not", "an", "object"]),
        "x" * 1_000_000,
    ],
    ids=["bad-json", "far-future", "far-past", "text-time", "text-count", "list", "huge"],
)
def test_beat_ignores_an_unreadable_tick_record_and_leads(
    beat_app: Celery, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture, record: str
) -> None:
    """A tick record beat cannot read is skipped with a bounded warning naming the entry and
    the key; beat still takes the lead (it is never wedged holding the lock unled)."""
    caplog.set_level(logging.INFO, logger="celery_redlock")
    locks = text_client(shared_redis, db=1)
    leader_key = f"redlock:{{beat:leader:{beat_app.main}}}"
    locks.hset(f"{leader_key}:ticks", "hourly", record)
    with scheduler(beat_app) as sched:
        sched.tick()
        assert sched.is_leader
        problems = [r.getMessage() for r in beat_problems(caplog)]
        assert len(problems) == 1, problems
        assert "'hourly'" in problems[0] and f"'{leader_key}:ticks'" in problems[0]
        assert len(problems[0]) < 500
        sched.tick()
        assert sched.is_leader
