"""``celery locks list/show/release`` against real locks held on throwaway servers."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.bin.celery import celery as celery_main
from click.testing import CliRunner, Result
from lua import FORCE_RELEASE, run_script
from servers import ClusterSetup, RedisServer, free_port
from tricky_names import TRICKY_NAMES

from celery_redlock import Lock, QueuedHold
from celery_redlock.core.connect import address_of, mask_url
from celery_redlock.core.keys import lock_keys
from tests.apps import locksapp

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).parent / "celery")
APP = "tests.apps.locksapp"
JSON_FIELDS = {"kind", "name", "key", "state", "holder", "acquired_at", "ttl_ms", "fence"}
HOLDER_FIELDS = {"task_name", "task_id", "hostname", "pid"}


@pytest.fixture
def configure() -> Iterator[Callable[..., None]]:
    """Point the test app's lock settings at a test's servers; restored afterwards."""
    conf = locksapp.app.conf
    saved = {k: conf.get(k) for k in ("redlock_url", "redlock_client_options")}

    def set_conf(url: Any, **options: Any) -> None:
        conf.redlock_url = url
        conf.redlock_client_options = options or None

    try:
        yield set_conf
    finally:
        for key, value in saved.items():
            conf[key] = value


@pytest.fixture
def locks_on(
    redis_client: redis.Redis, shared_redis: RedisServer, configure: Callable[..., None]
) -> redis.Redis:
    """The app's locks live on the (flushed) shared server; returns a client to it."""
    configure(shared_redis.url)
    return redis_client


@pytest.fixture
def hold() -> Iterator[Callable[..., Lock]]:
    """Factory acquiring real locks; whatever is still held is released afterwards."""
    held: list[Lock] = []

    def acquire(client: Any, name: str, **owner: Any) -> Lock:
        lock = Lock(client, name, ttl=30, owner_info=owner or None)
        assert lock.acquire(blocking=False)
        held.append(lock)
        return lock

    try:
        yield acquire
    finally:
        for lock in held:
            with contextlib.suppress(Exception):
                lock.release()


def run(*args: str, input: str | None = None) -> Result:
    """``celery -A tests.apps.locksapp locks ARGS`` in this process."""
    return CliRunner().invoke(
        celery_main, ["-A", APP, "locks", *args], input=input, catch_exceptions=False
    )


def test_list_json_has_exactly_the_documented_fields_of_each_held_lock(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """list --json prints one object per held lock with the DESIGN.md fields and true values."""
    sync = hold(locks_on, "sync:42", task_name="proj.sync", task_id="t-1")
    report = hold(locks_on, "report")
    result = run("list", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert set(rows) == {"sync:42", "report"}
    for row in rows.values():
        assert set(row) == JSON_FIELDS
        assert set(row["holder"]) == HOLDER_FIELDS
        assert 25_000 < row["ttl_ms"] <= 30_000
        assert abs(row["acquired_at"] - time.time()) < 10
        assert row["holder"]["pid"] == os.getpid()
        assert row["holder"]["hostname"] == socket.gethostname()
    assert rows["sync:42"]["key"] == "redlock:{sync:42}"
    assert rows["sync:42"]["holder"]["task_name"] == "proj.sync"
    assert rows["sync:42"]["holder"]["task_id"] == "t-1"
    assert rows["sync:42"]["fence"] == sync.fence
    assert rows["report"]["fence"] == report.fence
    assert rows["report"]["holder"]["task_name"] is None


def test_list_with_a_pattern_shows_only_matching_locks_in_a_table(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """list PATTERN filters by name (glob); the human output is a table with a header."""
    for name in ("sync:1", "sync:2", "report:1"):
        hold(locks_on, name, task_name="proj.t")
    result = run("list", "sync:*", "--json")
    assert result.exit_code == 0
    assert sorted(r["name"] for r in json.loads(result.stdout)) == ["sync:1", "sync:2"]
    table = run("list", "sync:*")
    assert table.exit_code == 0
    lines = table.stdout.splitlines()
    header = ["NAME", "STATE", "HOLDER", "HOST", "PID", "HELD", "FOR", "TTL", "FENCE"]
    assert lines[0].split() == header
    assert [line.split()[0] for line in lines[1:]] == ["sync:1", "sync:2"]
    assert "report:1" not in table.stdout


def test_list_and_show_give_every_tricky_name_and_its_key_as_written(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """list --json and show --json give each tricky name (held side by side) as stored."""
    for name in TRICKY_NAMES:
        hold(locks_on, name)  # "\\}{" is held beside "}{"
    stored = {lock_keys(n).name: lock_keys(n).lock for n in TRICKY_NAMES}
    listed = run("list", "--json")
    assert listed.exit_code == 0, listed.output
    assert [(r["name"], r["key"]) for r in json.loads(listed.stdout)] == sorted(stored.items())
    for name in TRICKY_NAMES:
        shown = run("show", name, "--json")
        assert shown.exit_code == 0, (name, shown.output)
        keys = lock_keys(name)
        assert [(r["name"], r["key"]) for r in json.loads(shown.stdout)] == [(keys.name, keys.lock)]
    escaped = run("list", "[}\\\\]*", "--json")  # names starting with "}" or "\\"
    assert [r["name"] for r in json.loads(escaped.stdout)] == sorted(
        n for n in stored if n.startswith(("}", "\\"))
    )


def test_list_skips_fence_notify_and_waiting_keys_and_foreign_keys_and_says_when_empty(
    locks_on: redis.Redis,
) -> None:
    """A released lock (its :fence, :notify and :waiting keys remain) and non-lock keys
    are not listed."""
    lock = Lock(locks_on, "gone", ttl=30)
    lock.acquire()
    assert Lock(locks_on, "gone", ttl=30).acquire(timeout=0.01) is False  # leaves a mark
    lock.release()  # someone may be waiting: the release pushes a notice
    locks_on.set("redlock:{plain-string}", "x")
    locks_on.hset("redlock:{other-hash}", "field", "x")
    keys = ("redlock:{gone}:fence", "redlock:{gone}:notify", "redlock:{gone}:waiting")
    assert locks_on.exists(*keys) == 3
    result = run("list")
    assert result.exit_code == 0
    assert (
        result.stdout.strip() == f"no locks held at {mask_url(str(locksapp.app.conf.redlock_url))}"
    )
    assert json.loads(run("list", "--json").stdout) == []


def test_show_prints_the_holder_and_exits_1_for_a_lock_nobody_holds(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """show NAME prints holder, fence and TTL of a held lock; a free one exits 1."""
    lock = hold(locks_on, "sync:7", task_name="proj.sync", task_id="abc")
    result = run("show", "sync:7")
    assert result.exit_code == 0
    assert "redlock:{sync:7}" in result.stdout
    assert "proj.sync[abc]" in result.stdout
    assert f"fence:       {lock.fence}" in result.stdout
    assert [r["fence"] for r in json.loads(run("show", "sync:7", "--json").stdout)] == [lock.fence]
    missing = run("show", "sync:8")
    assert missing.exit_code == 1
    assert "'sync:8' is not held" in missing.stderr


def test_release_force_frees_the_lock_and_wakes_a_blocked_waiter(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """release --force removes a 30 s lock, says who held it, and a blocked waiter wakes at once."""
    holder = hold(locks_on, "sync:9", task_name="proj.sync", task_id="t-9")
    waiter = Lock(locks_on, "sync:9", ttl=30)
    got: list[float] = []

    def wait() -> None:
        started = time.monotonic()
        if waiter.acquire(timeout=20):
            got.append(time.monotonic() - started)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.5)  # the waiter is blocked on the release notice by now
    assert not got
    released_at = time.monotonic()
    result = run("release", "sync:9", "--force")
    assert result.exit_code == 0, result.output
    assert "proj.sync[t-9]" in result.stdout
    thread.join(10)
    assert got, "the waiter did not get the lock"
    assert time.monotonic() - released_at < 5, "the waiter was not woken by the release"
    assert waiter.owned()
    assert not holder.owned()  # the old holder learns it lost the lock
    waiter.release()
    again = run("release", "sync:9", "--force")
    assert again.exit_code == 1
    assert "not held" in again.stderr


def test_release_asks_first_and_answering_no_keeps_the_lock(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """Without --force, release asks; "n" aborts with exit 1 and the lock stays, "y" releases."""
    lock = hold(locks_on, "sync:10", task_name="proj.sync")
    refused = run("release", "sync:10", input="n\n")
    assert refused.exit_code == 1
    assert "Release lock 'sync:10'?" in refused.stdout
    assert "Aborted" in refused.stderr
    assert lock.owned()
    accepted = run("release", "sync:10", input="y\n")
    assert accepted.exit_code == 0
    assert "released 'sync:10'" in accepted.stdout
    assert not locks_on.exists("redlock:{sync:10}")


def test_confirmed_release_leaves_a_lock_taken_meanwhile_alone(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """force_release.lua with the confirmed fence does not remove a newer acquisition."""
    lock = hold(locks_on, "sync:11")
    stale = str((lock.fence or 0) - 1)
    code, _, fence = run_script(
        locks_on, FORCE_RELEASE, ["redlock:{sync:11}", "redlock:{sync:11}:notify"], [1000, stale]
    )
    assert (code, int(fence)) == (-1, lock.fence)
    assert lock.owned()


def test_usage_errors_exit_2() -> None:
    """A missing argument is a usage error (exit 2)."""
    assert run("show").exit_code == 2
    assert run("release").exit_code == 2


def test_redlock_url_flag_and_environment_point_the_command_elsewhere(
    redis_servers: Callable[[int], list[RedisServer]],
    configure: Callable[..., None],
    hold: Callable[..., Lock],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """app.conf points at one server, a lock is held on another: list finds nothing where
    the app points (and says where it looked), and finds the lock with --redlock-url
    (before or after the subcommand) or REDLOCK_URL, as a worker so started keeps it."""
    conf_server, flag_server = redis_servers(2)
    configure(conf_server.url)
    hold(flag_server.client(), "elsewhere:1", task_name="proj.sync")
    plain = run("list")
    assert plain.stdout.strip() == f"no locks held at {mask_url(conf_server.url)}"
    for args in (
        ["list", "--redlock-url", flag_server.url],
        ["--redlock-url", flag_server.url, "list"],
    ):
        result = run(*args)
        assert result.exit_code == 0, result.output
        assert "elsewhere:1" in result.stdout, (args, result.output)
    shown = run("show", "elsewhere:1", "--redlock-url", flag_server.url)
    assert shown.exit_code == 0 and "proj.sync" in shown.stdout, shown.output
    monkeypatch.setenv("REDLOCK_URL", flag_server.url)
    from_env = run("list", "--json")
    assert [row["name"] for row in json.loads(from_env.stdout)] == ["elsewhere:1"]


def test_list_says_the_broker_was_searched_when_no_redlock_url_is_set(
    shared_redis: RedisServer, configure: Callable[..., None]
) -> None:
    """No redlock_url: the broker's Redis is searched, and finding nothing says so, and how
    to look where a worker started with --redlock-url keeps its locks."""
    configure(None)
    saved = locksapp.app.conf.broker_url
    locksapp.app.conf.broker_url = shared_redis.url
    try:
        result = run("list")
    finally:
        locksapp.app.conf.broker_url = saved
    assert result.exit_code == 0, result.output
    out = result.stdout.strip()
    assert out.startswith(f"no locks held at {mask_url(shared_redis.url)} (the broker's Redis")
    assert "--redlock-url" in out and "REDLOCK_URL" in out


def test_refused_credentials_exit_3_worded_as_the_worker_words_them(
    configure: Callable[..., None], tmp_path: Path
) -> None:
    """A wrong password in redlock_url: exit 3 (the Redis side, not usage), one line saying
    Redis refused the credentials, the password masked."""
    server = RedisServer.start()
    try:
        server.client().config_set("requirepass", "right-one")
        configure(f"redis://:wrong-one@127.0.0.1:{server.port}/0")
        for args in (["list"], ["show", "x"]):
            result = run(*args)
            assert result.exit_code == 3, (args, result.output)
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1, result.stderr
            assert "refused the credentials" in lines[0] and "redlock_url" in lines[0]
            assert "wrong-one" not in result.output
    finally:
        server.stop()


def test_unreachable_redis_exits_3_with_one_line_and_a_masked_url(
    configure: Callable[..., None],
) -> None:
    """With Redis down, list/show/release exit 3 with one clear line; the password is masked."""
    configure(f"redis://:s3cret@127.0.0.1:{free_port()}/0")
    for args in (["list"], ["show", "x"], ["release", "x", "--force"]):
        result = run(*args)
        assert result.exit_code == 3, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert "cannot reach Redis at redis://:***@127.0.0.1" in lines[0]
        assert "s3cret" not in result.output
        assert "Traceback" not in result.output


def test_redlock_list_shows_one_row_per_master_and_release_clears_every_master(
    redis_servers: Callable[[int], list[RedisServer]],
    configure: Callable[..., None],
    hold: Callable[..., Lock],
) -> None:
    """With three masters, list shows each (lock, master) with its address; release clears all;
    a master down gives exit 3 but the others are still listed."""
    servers = redis_servers(3)
    configure([s.url for s in servers])
    clients = [s.client() for s in servers]
    for client in clients[:2]:  # a lock held on a majority, as Redlock leaves it
        hold(client, "sync:42", task_name="proj.sync")
    hold(clients[2], "other", task_name="proj.other")

    result = run("list", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert all(set(r) == {*JSON_FIELDS, "master"} for r in rows)
    expected = [("sync:42", address_of(clients[0])), ("sync:42", address_of(clients[1]))]
    expected.append(("other", address_of(clients[2])))
    assert sorted((r["name"], r["master"]) for r in rows) == sorted(expected)
    table = run("list", "sync:*")
    assert "MASTER" in table.stdout.splitlines()[0]
    assert len(table.stdout.splitlines()) == 3

    servers[2].kill()
    partial = run("list", "--json")
    assert partial.exit_code == 3
    assert {r["name"] for r in json.loads(partial.stdout)} == {"sync:42"}
    assert f"127.0.0.1:{servers[2].port}" in partial.stderr

    servers[2].restart()
    released = run("release", "sync:42", "--force")
    assert released.exit_code == 0, released.output
    assert released.stdout.count("released 'sync:42'") == 2
    assert not any(c.exists("redlock:{sync:42}") for c in clients[:2])


def _cluster_session(
    redis_cluster: ClusterSetup, configure: Callable[..., None], stem: str
) -> tuple[Any, list[str]]:
    """The command pointed at *redis_cluster*; a client of it, and 12 names "<stem>:<i>"
    whose keys (a name's keys share its slot) fall on all three primaries."""
    configure(redis_cluster.nodes[0].url, cluster=True)
    client = redis_cluster.client()
    names = [f"{stem}:{i}" for i in range(12)]
    owners = {client.get_node_from_key(f"redlock:{{{n}}}").name for n in names}
    assert len(owners) == 3, "the names should spread over all three primaries"
    return client, names


def test_cluster_list_scans_every_primary(
    redis_cluster: ClusterSetup, configure: Callable[..., None], hold: Callable[..., Lock]
) -> None:
    """On a Redis Cluster, list finds locks on every primary node."""
    client, names = _cluster_session(redis_cluster, configure, "job")
    for name in names:
        hold(client, name)
    result = run("list", "--json")
    assert result.exit_code == 0, result.output
    assert sorted(r["name"] for r in json.loads(result.stdout)) == sorted(names)
    shown = run("show", "job:5", "--json")
    assert json.loads(shown.stdout)[0]["key"] == "redlock:{job:5}"
    client.close()


def test_cluster_pause_is_listed_from_its_node_and_refuses_a_run_there(
    redis_cluster: ClusterSetup, configure: Callable[..., None]
) -> None:
    """On a Redis Cluster, pause writes each key's control on the node of its slot, list
    finds the pauses on every primary, a run's lock of a paused key is refused there, and
    resume lifts it."""
    client, names = _cluster_session(redis_cluster, configure, "partner")
    for name in names:
        paused = run("pause", name, "--reason", "down")
        assert paused.exit_code == 0, paused.output
    assert sorted(r["name"] for r in _controls_listed("list")) == sorted(names)
    run_lock = Lock(client, names[5], ttl=10, auto_renew=False)
    run_lock.hold_with([], controlled=True)  # as a task's run takes its lock
    assert run_lock.acquire(blocking=False) is False
    assert (run_lock.refusal, run_lock.holder) == ("paused", {"reason": "down"})
    resumed = run("resume", names[5])
    assert resumed.exit_code == 0, resumed.output
    assert run_lock.acquire(blocking=False)
    run_lock.release()
    assert names[5] not in {r["name"] for r in _controls_listed("list")}
    client.close()


@pytest.mark.slow
def test_entry_point_works_in_a_real_celery_process(
    redis_client: redis.Redis, shared_redis: RedisServer, hold: Callable[..., Lock]
) -> None:
    """`celery -A app locks ...` from the installed entry point lists, shows and releases."""
    hold(redis_client, "sync:1", task_name="proj.sync")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["LOCKSAPP_REDLOCK_URL"] = shared_redis.url

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CELERY, "-A", APP, "locks", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=60,
            check=False,
        )

    listed = celery("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["name"] for r in json.loads(listed.stdout)] == ["sync:1"]
    assert celery("release", "sync:1", "--force").returncode == 0
    gone = celery("show", "sync:1")
    assert gone.returncode == 1
    assert "not held" in gone.stderr


def test_configuration_errors_exit_2_naming_the_setting(configure: Callable[..., None]) -> None:
    """No redlock_url with a non-Redis broker, a mistyped redlock_* setting or a bad URL scheme
    are configuration errors: exit 2 with one line saying what to fix."""
    conf = locksapp.app.conf
    configure(None)
    missing = run("list")
    assert missing.exit_code == 2, missing.output
    assert "redlock_url is not set and the broker is not Redis" in missing.stderr

    configure("http://127.0.0.1:1/0")
    scheme = run("list")
    assert scheme.exit_code == 2, scheme.output
    assert "unknown Redis URL scheme 'http'" in scheme.stderr

    configure(f"redis://127.0.0.1:{free_port()}/0")
    conf["redlock_ttll"] = 5
    try:
        typo = run("show", "x")
    finally:
        conf.pop("redlock_ttll")
    assert typo.exit_code == 2, typo.output
    assert "unknown setting 'redlock_ttll'" in typo.stderr
    assert "redlock_ttl" in typo.stderr
    assert "Traceback" not in typo.output


def test_lock_url_defaults_to_a_redis_broker(
    shared_redis: RedisServer,
    redis_client: redis.Redis,
    configure: Callable[..., None],
    hold: Callable[..., Lock],
) -> None:
    """Without redlock_url the locks are looked up on the broker when the broker is Redis."""
    conf = locksapp.app.conf
    configure(None)
    hold(redis_client, "sync:broker", task_name="proj.sync")
    saved = conf.broker_url
    conf.broker_url = shared_redis.url
    try:
        result = run("list", "--json")
    finally:
        conf.broker_url = saved
    assert result.exit_code == 0, result.output
    assert [r["name"] for r in json.loads(result.stdout)] == ["sync:broker"]


# --------------------------------------------------------------------------- limits


def test_list_and_show_give_each_permit_its_holder_and_a_limiters_state(
    locks_on: redis.Redis,
) -> None:
    """A semaphore's permits are listed one row each with holder and fence, and a rate
    limiter's state (rate, burst, free now, next slot, runs queued) in a table of its own;
    show NAME gives both for one name."""
    from celery_redlock import RateLimiter, Semaphore  # noqa: PLC0415 - these tests only

    sems = [
        Semaphore(locks_on, "import:7", 3, owner_info={"task_name": "proj.imp", "task_id": f"t{i}"})
        for i in range(2)
    ]
    limiter = RateLimiter(locks_on, "import:7", "6/m", burst=2)
    try:
        for sem in sems:
            assert sem.acquire(blocking=False)
        assert limiter.acquire() and limiter.acquire()
        assert not limiter.acquire(queue=True)  # one run promised the next slot
        rows = json.loads(run("list", "--json").stdout)
        permits = [r for r in rows if r["kind"] == "permit"]
        assert sorted(r["holder"]["task_id"] for r in permits) == ["t0", "t1"]
        assert sorted(r["fence"] for r in permits) == sorted(s.fence for s in sems)
        assert all(
            set(r) == JSON_FIELDS and r["key"] == "redlock:{import:7}:permits" for r in permits
        )
        (rate,) = [r for r in rows if r["kind"] == "rate"]
        assert (rate["name"], rate["rate"], rate["burst"], rate["free"]) == (
            "import:7",
            "6/m",
            2,
            0,
        )
        assert rate["queued"] == 1 and 9_000 < rate["next_ms"] <= 10_000
        table = run("list").stdout
        assert "PERMITS" in table and "proj.imp[t0]" in table and "proj.imp[t1]" in table
        assert "RATE LIMITERS" in table and "6/m" in table
        shown = run("show", "import:7")
        assert shown.exit_code == 0
        assert shown.stdout.count("kind:") == 3 and "rate limiter" in shown.stdout
        assert len(json.loads(run("show", "import:7", "--json").stdout)) == 3
    finally:
        for sem in sems:
            sem.release()


def test_list_show_and_release_a_queued_hold(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """A key whose run holds the lock while the next message is queued: list shows it as
    running (first task id) and queued (second task id), show names both, and release
    --force removes both."""
    hold(locks_on, "sync:7", task_name="proj.sync", task_id="run-1")
    QueuedHold(locks_on, "sync:7", owner_info={"task_name": "proj.sync"}).claim("q-2", ttl=60)
    listed = run("list", "--json")
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["state"], r["holder"]["task_id"]) for r in rows] == [
        ("sync:7", "running", "run-1"),
        ("sync:7", "queued", "q-2"),
    ]
    assert 55_000 < rows[1]["ttl_ms"] <= 60_000
    table = run("list").stdout.splitlines()
    assert [line.split()[:2] for line in table[1:]] == [["sync:7", "running"], ["sync:7", "queued"]]
    shown = run("show", "sync:7")
    assert "state:" in shown.stdout and "q-2" in shown.stdout and "queued_at:" in shown.stdout
    released = run("release", "sync:7", "--force")
    assert released.exit_code == 0, released.output
    assert "queued hold" in released.stdout
    assert not locks_on.exists("redlock:{sync:7}", "redlock:{sync:7}:queued")


def _some_holds(client: redis.Redis, hold: Callable[..., Lock]) -> None:
    """sync:1 and sync:2 running, sync:3 queued, report:1 running and report:2 queued."""
    hold(client, "sync:1", task_name="proj.sync", task_id="r-1")
    hold(client, "sync:2", task_name="proj.sync", task_id="r-2")
    QueuedHold(client, "sync:3", owner_info={"task_name": "proj.sync"}).claim("q-3", ttl=60)
    hold(client, "report:1", task_name="proj.report", task_id="r-4")
    QueuedHold(client, "report:2", owner_info={"task_name": "proj.report"}).claim("q-5", ttl=60)


def _still_held(client: redis.Redis) -> set[str]:
    names = ("sync:1", "sync:2", "sync:3", "report:1", "report:2")
    keys = {n: (lock_keys(n).lock, lock_keys(n).lock + ":queued") for n in names}
    return {n for n, (lock, queued) in keys.items() if client.exists(lock, queued)}


def test_release_a_pattern_with_yes_releases_exactly_what_matches(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """release 'sync:*' --force --yes lists the matching locks and queued holds and releases
    each of them (found with SCAN), and nothing else."""
    _some_holds(locks_on, hold)
    result = run("release", "sync:*", "--force", "--yes")
    assert result.exit_code == 0, result.output
    assert "NAME" in result.stdout and "q-3" in result.stdout  # the list of what goes
    assert "released 'sync:1'" in result.stdout and "released 'sync:2'" in result.stdout
    assert "released the queued hold of 'sync:3'" in result.stdout
    assert _still_held(locks_on) == {"report:1", "report:2"}
    none = run("release", "nothing:*", "--force", "--yes")
    assert none.exit_code == 1
    assert "no lock matches 'nothing:*'" in none.stderr


def test_release_a_pattern_without_yes_and_without_a_terminal_refuses(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """release 'sync:*' --force with no terminal and no --yes releases nothing, even with a
    "y" piped in, and says to pass --yes."""
    _some_holds(locks_on, hold)
    result = run("release", "sync:*", "--force", input="y\n")
    assert result.exit_code == 1
    assert "pass --yes" in result.stderr
    assert _still_held(locks_on) == {"sync:1", "sync:2", "sync:3", "report:1", "report:2"}


def test_release_queued_releases_only_the_queued_holds(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """release '*' --queued --force --yes (what docs/dedup.md gives after a purge) releases
    every queued hold and no running lock."""
    _some_holds(locks_on, hold)
    result = run("release", "*", "--queued", "--force", "--yes")
    assert result.exit_code == 0, result.output
    assert _still_held(locks_on) == {"sync:1", "sync:2", "report:1"}
    again = run("release", "*", "--queued", "--force", "--yes")
    assert again.exit_code == 1
    assert "no queued hold matches '*'" in again.stderr


def test_releasing_a_queued_hold_says_what_a_queued_hold_is(locks_on: redis.Redis) -> None:
    """Releasing a queued hold by name asks and reports in terms of a message not started
    (its hold taken at publish; the next call publishes again), not of a holder that runs."""
    QueuedHold(locks_on, "sync:7", owner_info={"task_name": "proj.sync"}).claim("q-2", ttl=60)
    result = run("release", "sync:7", input="y\n")
    assert result.exit_code == 0, result.output
    assert "keeps running" not in result.stdout
    assert "taken at publish (lock_on='enqueue') for a message that has not" in result.stdout
    assert (
        "released the queued hold of 'sync:7': it was taken at publish for task q-2, whose "
        "message had not started running; the next call of 'sync:7' publishes again"
    ) in result.stdout
    assert not locks_on.exists("redlock:{sync:7}:queued")


def test_release_a_pattern_at_a_terminal_lists_and_asks(
    redis_client: redis.Redis, shared_redis: RedisServer, hold: Callable[..., Lock]
) -> None:
    """At a terminal (a pty), `celery locks release 'sync:*' --force` lists the matching
    holds and asks; "n" keeps them all, "y" releases them."""
    _some_holds(redis_client, hold)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["LOCKSAPP_REDLOCK_URL"] = shared_redis.url

    def answer(reply: str) -> tuple[int, str]:
        leader, follower = pty.openpty()
        proc = subprocess.Popen(
            [CELERY, "-A", APP, "locks", "release", "sync:*", "--force"],
            stdin=follower,
            stdout=follower,
            stderr=follower,
            cwd=ROOT,
            env=env,
        )
        os.close(follower)
        seen = b""
        try:
            deadline = time.monotonic() + 30
            while b"[y/N]" not in seen and time.monotonic() < deadline:
                ready, _, _ = select.select([leader], [], [], 1.0)
                if ready:
                    seen += os.read(leader, 4096)
            os.write(leader, reply.encode() + b"\n")
            code = proc.wait(30)
            with contextlib.suppress(OSError):
                while select.select([leader], [], [], 0.2)[0]:
                    chunk = os.read(leader, 4096)
                    if not chunk:
                        break
                    seen += chunk
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            os.close(leader)
        return code, seen.decode(errors="replace")

    code, said = answer("n")
    assert code == 1, said
    assert "Release these 3 holds of 3 locks?" in said and "q-3" in said
    assert _still_held(redis_client) == {"sync:1", "sync:2", "sync:3", "report:1", "report:2"}
    code, said = answer("y")
    assert code == 0, said
    assert _still_held(redis_client) == {"report:1", "report:2"}


def _doc_sample(heading: str) -> list[str]:
    """The first console sample under *heading* in docs/cli.md, without its `$` line."""
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text.split(f"## {heading}", 1)[1]
    block = section.split("```\n", 2)[1]
    return [line for line in block.splitlines() if line and not line.startswith("$")]


def test_the_docs_list_sample_matches_a_real_run(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """docs/cli.md's `list` sample has the columns a real run prints, in the same places,
    and values of the same form: full task ids, 16-digit fences, a queued row's "-"."""
    sample = _doc_sample("`list`")
    hold(locks_on, "sync:41", task_name="proj.sync_user", task_id=str(uuid.uuid4()))
    hold(locks_on, "sync:42", task_name="proj.sync_user", task_id=str(uuid.uuid4()))
    QueuedHold(locks_on, "sync:42", owner_info={"task_name": "proj.sync_user"}).claim(
        str(uuid.uuid4()), 3600
    )
    real = run("list", "sync:*").stdout.splitlines()
    assert len(real) == len(sample) == 4, (real, sample)
    assert real[0].split() == sample[0].split()  # the same columns
    for mine, theirs in zip(real[1:], sample[1:], strict=True):
        got, shown = mine.split(), theirs.split()
        assert len(got) == len(shown), (mine, theirs)
        assert got[:2] == shown[:2]  # name and state
        assert len(got[2]) == len(shown[2])  # task name and a full task id
        assert len(got[-1]) == len(shown[-1])  # a 16-digit fence, or "-"


# --------------------------------------------------------------------------- flow control
CONTROL_FIELDS = {"name", "kind", "control", "value", "ttl_ms"}


def _controls_listed(*args: str) -> list[dict[str, Any]]:
    """The "control" objects of ``ARGS --json`` (list or show), which must exit 0."""
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    rows = [row for row in json.loads(result.stdout) if row["kind"] == "control"]
    assert all(set(row) == CONTROL_FIELDS for row in rows), rows
    return rows


def test_pause_shows_in_list_and_show_refuses_runs_and_resume_lifts_it(
    locks_on: redis.Redis,
) -> None:
    """pause KEY [--for D] [--reason T] exits 0 saying what it did; list and show give the
    pause in a CONTROLS table and as a "control" JSON object (show exits 0 for a key with
    only a control); a run's lock of the key is refused with the reason; resume lifts it
    (exit 0), and exits 1 when there is nothing to lift."""
    timed = run("pause", "partner:acme", "--for", "10m", "--reason", "maintenance")
    assert timed.exit_code == 0, timed.output
    assert timed.stdout.strip() == "paused 'partner:acme' for 10m: maintenance"
    assert 590_000 < locks_on.pttl("redlock:{partner:acme}:control") <= 600_000
    open_ended = run("pause", "imports")
    assert open_ended.exit_code == 0, open_ended.output
    assert open_ended.stdout.strip() == "paused 'imports' until resumed"
    assert locks_on.pttl("redlock:{imports}:control") == -1  # until lifted

    listed = _controls_listed("list")
    assert [(r["name"], r["control"], r["value"]) for r in listed] == [
        ("imports", "pause", "paused by an operator"),
        ("partner:acme", "pause", "maintenance"),
    ]
    assert listed[0]["ttl_ms"] is None and 590_000 < listed[1]["ttl_ms"] <= 600_000
    table = run("list").stdout.splitlines()
    assert table[0] == "CONTROLS" and table[1].split() == ["NAME", "CONTROL", "VALUE", "LEFT"]
    words = ["imports", "pause", "paused", "by", "an", "operator", "until", "lifted"]
    assert table[2].split() == words
    assert table[3].split()[:3] == ["partner:acme", "pause", "maintenance"]
    left = table[3].split()[3]
    assert left == "10m00s" or left.startswith("9m5"), left
    shown = run("show", "partner:acme")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.splitlines()[0] == "CONTROLS" and "maintenance" in shown.stdout
    assert [r["name"] for r in _controls_listed("show", "partner:acme")] == ["partner:acme"]

    run_lock = Lock(locks_on, "partner:acme", ttl=10, auto_renew=False)
    run_lock.hold_with([], controlled=True)  # as a task's run takes its lock
    assert run_lock.acquire(blocking=False) is False
    assert (run_lock.refusal, run_lock.holder) == ("paused", {"reason": "maintenance"})

    resumed = run("resume", "partner:acme")
    assert resumed.exit_code == 0 and resumed.stdout.strip() == "resumed 'partner:acme'"
    again = run("resume", "partner:acme")
    assert again.exit_code == 1
    assert "'partner:acme' is not paused" in again.stderr
    assert run("show", "partner:acme").exit_code == 1  # nothing held, no control
    assert run_lock.acquire(blocking=False)
    run_lock.release()
    assert [r["name"] for r in _controls_listed("list")] == ["imports"]


def test_set_and_unset_override_a_keys_limit_and_rate(locks_on: redis.Redis) -> None:
    """set KEY --limit N / --rate R [--burst B] [--for D] exits 0 saying each change, and
    list shows each override; unset lifts a key's overrides but not its pause (exit 0),
    and exits 1 when it has none."""
    limited = run("set", "imports", "--limit", "2", "--for", "1h")
    assert limited.exit_code == 0, limited.output
    assert limited.stdout.strip() == "'imports': limit 2 for 1h"
    rated = run("set", "p:acme", "--rate", "100/m", "--burst", "5")
    assert rated.exit_code == 0, rated.output
    assert rated.stdout.strip() == "'p:acme': rate 100/m, burst 5 until unset"
    both = run("set", "p:b", "--limit", "3", "--rate", "10/s")
    assert both.exit_code == 0, both.output
    said = ["'p:b': limit 3 until unset", "'p:b': rate 10/s until unset"]
    assert both.stdout.splitlines() == said
    stored = locks_on.hget("redlock:{p:acme}:control", "rate")
    assert stored is not None and stored.decode().endswith("|600000|5|100/m")

    listed = _controls_listed("list")
    assert [(r["name"], r["control"], r["value"]) for r in listed] == [
        ("imports", "limit", "2"),
        ("p:acme", "rate", "100/m, burst 5"),
        ("p:b", "limit", "3"),
        ("p:b", "rate", "10/s"),
    ]
    assert 3_590_000 < listed[0]["ttl_ms"] <= 3_600_000
    assert [r["ttl_ms"] for r in listed[1:]] == [None, None, None]
    table = run("list").stdout.splitlines()
    assert table[0] == "CONTROLS"
    assert table[3].split() == ["p:acme", "rate", "100/m,", "burst", "5", "until", "lifted"]

    lifted = run("unset", "p:acme")
    assert lifted.exit_code == 0 and lifted.stdout.strip() == "'p:acme': overrides lifted"
    none_left = run("unset", "p:acme")
    assert none_left.exit_code == 1 and "'p:acme' has no override" in none_left.stderr
    assert run("pause", "p:b").exit_code == 0
    assert run("unset", "p:b").exit_code == 0
    assert [(r["name"], r["control"]) for r in _controls_listed("list")] == [
        ("imports", "limit"),
        ("p:b", "pause"),
    ]


@pytest.mark.parametrize(
    "args",
    [
        ("pause", "x", "--for", "-1m"),
        ("pause", "x", "--for", "0"),
        ("pause", "x", "--for", "soon"),
        ("set", "x", "--limit", "2", "--for", "-1m"),
        ("set", "x", "--rate", "0/s"),
        ("set", "x", "--rate", "100/m", "--burst", "0"),
        ("set", "x", "--limit", "0"),
        ("set", "x", "--limit", "two"),
        ("set", "x"),
        ("set", "x", "--burst", "2"),
        ("set", "x", "--limit", "2", "--burst", "2"),
        ("resume",),
    ],
)
def test_bad_control_input_exits_2_and_changes_nothing(
    locks_on: redis.Redis, args: tuple[str, ...]
) -> None:
    """A bad duration, rate, burst or limit, set without --limit or --rate, and a missing
    key are usage errors: exit 2, an error line, no traceback, nothing written."""
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() and "Traceback" not in result.output
    assert locks_on.keys("*") == []


def test_set_with_a_bad_rate_does_not_apply_its_limit(locks_on: redis.Redis) -> None:
    """set KEY --limit 2 --rate 0/s is refused as a whole: exit 2 and no override written."""
    result = run("set", "x", "--limit", "2", "--rate", "0/s")
    assert result.exit_code == 2, result.output
    assert locks_on.keys("*") == []


def test_control_commands_on_redlock_masters_exit_2_and_write_nothing(
    redis_servers: Callable[[int], list[RedisServer]], configure: Callable[..., None]
) -> None:
    """With a list of URLs (Redlock), pause, resume, set and unset exit 2 saying flow
    control is not available, and write nothing on any master; list still works and
    shows no CONTROLS."""
    servers = redis_servers(3)
    configure([s.url for s in servers])
    for args in (("pause", "x"), ("resume", "x"), ("set", "x", "--limit", "2"), ("unset", "x")):
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert "flow control" in result.stderr and "not available" in result.stderr
    assert all(s.client().keys("*") == [] for s in servers)
    listed = run("list")
    assert listed.exit_code == 0 and "CONTROLS" not in listed.stdout


def test_control_commands_on_redlock_masters_say_a_quorum_has_no_flow_control(
    redis_servers: Callable[[int], list[RedisServer]], configure: Callable[..., None]
) -> None:
    """The refusal on Redlock masters says why: a quorum (Redlock) has no flow control."""
    servers = redis_servers(3)
    configure([s.url for s in servers])
    result = run("pause", "x")
    assert result.exit_code == 2
    assert "quorum" in result.stderr.lower() or "redlock" in result.stderr.lower(), result.stderr


def test_a_forced_release_is_recorded_in_the_event_log(
    locks_on: redis.Redis, hold: Callable[..., Lock]
) -> None:
    """release --force writes a ``forced`` event (the lock, its fence, its task) to the
    app's event log, which the board's timeline draws as force-released."""
    from celery_redlock.core import open_backend  # noqa: PLC0415
    from celery_redlock.core.backend import EventLog, need  # noqa: PLC0415

    holder = hold(locks_on, "sync:forced", task_name="proj.sync", task_id="t-f")
    result = run("release", "sync:forced", "--force")
    assert result.exit_code == 0, result.output
    texts = need(open_backend(locks_on), EventLog).read_events("redlock:events", 10)
    [event] = [json.loads(t) for t in texts if '"forced"' in t]
    assert (event["name"], event["fence"], event["task_id"]) == (
        "sync:forced", holder.fence, "t-f",
    )  # fmt: skip
    assert event["error"] == "released by celery locks release"
