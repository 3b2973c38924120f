"""The board over the index of held keys (``lua/index.lua``), through a WSGI test client:
counts by kind and state and filters over every key (more than a page, more than 500),
paging, names that need quoting, what a refresh asks of Redis, the index after acquire,
release and expiry, what the page says when the store or the quorum does not answer, one
row a name on a Redlock, and the waiting runs derived from what happens now."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from servers import RedisServer, wait_for
from werkzeug.test import Client

from celery_redlock import (
    Lock,
    LockedTask,
    QueuedHold,
    RateLimiter,
    Redlock,
    Semaphore,
    connect,
    install,
)
from celery_redlock.app.event_log import flush, log_key
from celery_redlock.board import make_app, pages
from celery_redlock.core import open_backend
from celery_redlock.core.backend import EventLog, need
from celery_redlock.core.backend_types import Slot
from celery_redlock.core.keys import lock_keys

OWNER = {"task_name": "proj.sync", "task_id": "id-1"}
PREFIX = "redlock:"
NO_ANSWER = "The store did not answer: holders unknown."


@pytest.fixture
def app(redis_client: redis.Redis, shared_redis: RedisServer) -> Iterator[Celery]:
    """An app whose locks live on the (flushed) shared server."""
    app = Celery("boardindex", broker="memory://", set_as_current=False)
    app.conf.redlock_url = shared_redis.url
    yield app


def _text(response: Any) -> str:
    assert response.status_code == 200, response.get_data(as_text=True)
    return str(response.get_data(as_text=True))


def _names(page: str) -> list[str]:
    return re.findall(r'<tr data-name="([^"]*)"', page)


def _count(page: str, key: str) -> int:
    found = re.search(
        rf'<li data-count="{re.escape(key)}"><a [^>]*>[^<]*</a> <b>([\d,]+)</b>', page
    )
    assert found, f"no count {key!r} in the page"
    return int(found.group(1).replace(",", ""))


def _hold_many(client: redis.Redis, count: int, *, every_run: int = 3) -> None:
    """*count* mutexes ``n:0000`` ... held for 60 s as the acquire script writes them,
    every *every_run*-th by a task's run (its record has a task name)."""
    backend = open_backend(client)
    for i in range(count):
        owner = {"task_name": "proj.sync", "task_id": f"t-{i}"} if i % every_run == 0 else {}
        record = json.dumps({"hostname": f"w{i % 2}", "pid": 1, **owner})
        slot = Slot(lock_keys(f"n:{i:04d}", PREFIX))
        assert backend.acquire(
            slot, f"tok-{i}", 60_000, record, wait=False, fence_ttl_ms=0
        ).acquired


def test_counts_and_filters_cover_every_key_past_500_names(
    app: Celery, redis_client: redis.Redis
) -> None:
    """With 600 mutexes before it, a semaphore's permit held by ``render`` is counted and
    found by the kind filter; the counts by kind and state are of every key; the state,
    task id and worker filters find theirs among all 601."""
    _hold_many(redis_client, 600)
    permit = Semaphore(redis_client, "render", 3, 30, owner_info=OWNER, auto_renew=False)
    assert permit.acquire(blocking=False)
    board = Client(make_app(app))
    try:
        page = _text(board.get("/"))
        assert _count(page, "mutex") == 600 and _count(page, "semaphore") == 1
        assert _count(page, "mutex:running") == 200 and _count(page, "mutex:held") == 400
        assert "601 keys, 1-50 shown" in page
        semaphores = _text(board.get("/?kind=semaphore"))
        assert _names(semaphores) == ["render"] and "1 key<" in semaphores
        assert "No key held" not in semaphores
        running = _text(board.get("/?kind=mutex&state=running&offset=190"))
        assert _names(running) == [f"n:{i:04d}" for i in range(570, 600, 3)]
        assert "200 keys, 191-200 shown" in running
        assert _names(_text(board.get("/?task_id=t-300"))) == ["n:0300"]
        workers = _text(board.get("/?worker=w1&prefix=n:00"))
        assert _names(workers) == [f"n:{i:04d}" for i in range(1, 100, 2)][:50]
    finally:
        permit.release()


def test_pages_follow_one_another_in_key_order_both_ways(
    app: Celery, redis_client: redis.Redis
) -> None:
    """Page after page by the next link: every key once, in key order; reversed with
    sort=-name."""
    _hold_many(redis_client, 120)
    board = Client(make_app(app))
    seen: list[str] = []
    path = "/?prefix=n:"
    while path:
        page = _text(board.get(path))
        seen += _names(page)
        after = re.search(r'<a rel="next" href="([^"]+)"', page)
        path = after.group(1).replace("&amp;", "&") if after else ""
    assert seen == [f"n:{i:04d}" for i in range(120)]
    reversed_page = _text(board.get("/?prefix=n:&sort=-name"))
    assert _names(reversed_page)[:3] == ["n:0119", "n:0118", "n:0117"]


def test_a_name_of_spaces_is_visible_and_its_link_opens_its_page(
    app: Celery, redis_client: redis.Redis
) -> None:
    """A lock named two spaces shows as [U+0020 U+0020], linked to its URL-quoted key
    page, which shows its holder."""
    lock = Lock(redis_client, "  ", 30, owner_info=OWNER, auto_renew=False)
    assert lock.acquire(blocking=False)
    board = Client(make_app(app))
    try:
        page = _text(board.get("/"))
        assert '<a href="/key/%20%20">[U+0020 U+0020]</a>' in page
        assert "proj.sync[id-1]" in _text(board.get("/key/%20%20"))
    finally:
        lock.release()


def test_a_refresh_asks_redis_for_the_page_not_the_keyspace(
    app: Celery, redis_client: redis.Redis, shared_redis: RedisServer
) -> None:
    """No SCAN per overview or key page, and the commands of an overview refresh stay
    the same from 100 to 600 held names."""
    board = Client(make_app(app))
    costs = []
    for count in (100, 600):
        _hold_many(redis_client, count)
        _text(board.get("/", headers={"X-Board-Part": "live"}))  # scripts loaded
        shared_redis.reset_stats()
        _text(board.get("/", headers={"X-Board-Part": "live"}))
        _text(board.get("/key/n:0042"))
        assert shared_redis.command_count("scan") == 0
        shared_redis.reset_stats()
        _text(board.get("/", headers={"X-Board-Part": "live"}))
        costs.append(int(redis_client.info("stats")["total_commands_processed"]))
    assert costs[1] <= costs[0] + 1, costs


def test_the_page_follows_acquire_release_and_expiry(
    app: Celery, redis_client: redis.Redis
) -> None:
    """A lock shows once taken and goes once released; a short lock that expires
    unreleased goes from the page by itself (1.5 s: the two page reads before it must
    come first on a loaded machine too)."""
    board = Client(make_app(app))
    brief = Lock(redis_client, "brief", 1.5, owner_info=OWNER, auto_renew=False)
    given = Lock(redis_client, "given", 30, owner_info=OWNER, auto_renew=False)
    assert brief.acquire(blocking=False) and given.acquire(blocking=False)
    assert _names(_text(board.get("/"))) == ["brief", "given"]
    given.release()
    assert _names(_text(board.get("/"))) == ["brief"]
    assert wait_for(lambda: _names(_text(board.get("/"))) == [], timeout=5, what="brief gone")
    page = _text(board.get("/"))
    assert "No key held under this filter." in page and _count(page, "mutex") == 0


def test_a_store_that_does_not_answer_makes_the_holders_unknown(
    redis_servers: Any,
) -> None:
    """With its Redis stopped, the overview and the key page say the holders are unknown,
    never that nothing is held, and since when: the store's last answer to the board; a
    board that never got one says so."""
    (server,) = redis_servers(1)
    app = Celery("downboard", broker="memory://", set_as_current=False)
    app.conf.redlock_url = server.url
    board = Client(make_app(app))
    lock = Lock(server.client(), "held", 30, owner_info=OWNER, auto_renew=False)
    assert lock.acquire(blocking=False)
    assert _names(_text(board.get("/"))) == ["held"]
    server.stop()
    overview, key = _text(board.get("/")), _text(board.get("/key/held"))
    for page in (overview, key):
        assert NO_ANSWER in page and "unreachable" in page
        assert re.search(r"Last answer \d\d:\d\d:\d\d UTC, \d+ s ago\.", page), page
    assert "No key held" not in overview and "Nobody holds it now" not in key
    fresh = _text(Client(make_app(app)).get("/"))
    assert "No answer since the board started." in fresh


def test_a_quorum_shows_one_row_a_name_and_says_when_it_is_lost(
    redis_servers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On three masters, two names are two rows with "3 of 3" and "2 keys", a page at a
    time; an event each master logged shows once; with one master down a row says "2 of
    3", with two the page says the quorum is lost and the holders unknown."""
    servers = redis_servers(3)
    app = Celery("quorumboard", broker="memory://", set_as_current=False)
    app.conf.redlock_url = [s.url for s in servers]
    clients = [s.client() for s in servers]
    locks = [Redlock(clients, n, 30, owner_info=OWNER, auto_renew=False) for n in ("q:1", "q:2")]
    assert all(lock.acquire(blocking=False) for lock in locks)
    event = json.dumps({"kind": "acquired", "name": "q:1", "at": time.time(), "fence": 7})
    for client in clients:
        need(open_backend(client), EventLog).log_events(log_key(PREFIX), [event], 100, 60_000)
    board = Client(make_app(app))
    page = _text(board.get("/"))
    assert _names(page) == ["q:1", "q:2"] and page.count(">3 of 3<") == 2
    assert "2 keys<" in page
    key = _text(board.get("/key/q:1"))
    assert key.count('<tr data-kind="acquired">') == 1 and ">3 of 3<" in key
    monkeypatch.setattr(pages, "PAGE", 1)
    second = _text(board.get("/?offset=1"))
    assert _names(second) == ["q:2"] and "2 keys, 2-2 shown" in second
    servers[1].stop()
    one_down = _text(board.get("/?offset=1"))
    assert ">2 of 3<" in one_down and "quorum is lost" not in one_down
    servers[2].stop()
    lost = (
        "Fewer than a majority of the masters answered (1 of 3): the quorum is lost, "
        "holders unknown."
    )
    for path in ("/", "/key/q:1"):
        text = _text(board.get(path))
        assert lost in text and "No key held" not in text and "Nobody holds it now" not in text


def test_waiting_runs_are_those_that_wait_now() -> None:
    """A refused run that took the key since, a rate-limited one whose slot came and went,
    and a run refused ten minutes ago are not waiting; a run refused a second ago is."""
    now = 1_000_000.0
    events = [  # newest first, as the page reads them
        {"kind": "acquired", "task_id": "a", "at": now - 1},
        {"kind": "contended", "task_id": "b", "at": now - 1, "retry_after": 2},
        {"kind": "contended", "task_id": "a", "at": now - 3},
        {"kind": "rate_limited", "task_id": "c", "at": now - 30, "retry_after": 1.5},
        {"kind": "contended", "task_id": "d", "at": now - 600},
    ]
    assert [e["task_id"] for e in pages.waiting(events, now=now)] == ["b"]


def test_a_rate_limited_run_that_got_its_slot_waits_no_more(app: Celery) -> None:
    """A run refused a rate slot is listed as waiting; once the limiter grants it a slot
    (a ``granted`` event), the key page lists it no more."""
    install(app)
    url = app.conf.redlock_url
    first = RateLimiter(connect(url), "rl:1", "5/s", owner_info={**OWNER, "task_id": "r-1"})
    later = RateLimiter(connect(url), "rl:1", "5/s", owner_info={**OWNER, "task_id": "r-2"})
    assert first.acquire().granted
    assert not later.acquire().granted  # refused: its slot is 0.2 s away
    flush()
    board = Client(make_app(app))
    assert "[r-2]" in _waiting(_text(board.get("/key/rl%3A1")))
    assert later.acquire(blocking=True, timeout=5).granted
    flush()
    events, _ = make_app(app).source.events("rl:1")
    assert [e["kind"] for e in events][:2] == ["granted", "rate_limited"]
    assert "[r-2]" not in _waiting(_text(board.get("/key/rl%3A1")))


def _waiting(page: str) -> str:
    """The key page's "Waiting and queued runs" section."""
    return page.split("<h2>Waiting and queued runs</h2>", 1)[1].split("<h2>", 1)[0]


def test_leases_that_ran_out_unreleased_leave_the_index_when_later_locks_are_taken(
    redis_client: redis.Redis,
) -> None:
    """Five locks dropped unreleased run out; with no board or CLI ever reading, later
    acquires sweep all five from the held sets and the expiry set (sixteen, in one write
    of sixteen by the server's clock), so the index stays bounded where nobody lists it;
    a living lock stays listed."""
    kept = Lock(redis_client, "sweep:kept", ttl=30, auto_renew=False)
    assert kept.acquire(blocking=False)
    for i in range(5):
        assert Lock(redis_client, f"sweep:dropped:{i}", ttl=0.3, auto_renew=False).acquire(
            blocking=False
        )
    dropped = {f"redlock:{{sweep:dropped:{i}}}" for i in range(5)}
    assert dropped <= {k.decode() for k in redis_client.zrange("redlock:index:expiry", 0, -1)}
    assert wait_for(
        lambda: not any(redis_client.exists(k) for k in dropped), timeout=5, what="expiry"
    )

    def swept() -> bool:
        listed = {k.decode() for k in redis_client.zrange("redlock:index:expiry", 0, -1)}
        return not listed & dropped

    later = itertools.count()
    while not swept() and next(later) < 5000:  # bounded: a sweep comes within a few ms
        with Lock(redis_client, f"sweep:later:{next(later)}", ttl=30):
            pass
    for name in ("expiry", "held", "running"):
        listed = {k.decode() for k in redis_client.zrange(f"redlock:index:{name}", 0, -1)}
        assert not listed & dropped, (name, listed & dropped)
    assert redis_client.zscore("redlock:index:expiry", "redlock:{sweep:kept}") is not None
    kept.release()


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_refused_runs_event_names_its_policy_and_a_skipped_run_waits_no_more(
    app: Celery, redis_client: redis.Redis, policy: str
) -> None:
    """A run refused its key records the policy that then applies, and neither a skipped
    run nor one that failed with LockContended is listed as waiting (before, both were
    listed for a minute)."""
    install(app)

    @app.task(base=LockedTask, shared=False, name=f"proj.{policy}", lock_key="pol:1",
              lock_on_contended=policy, lock_max_retries=0)  # fmt: skip
    def run() -> None: ...

    holder = Lock(redis_client, "pol:1", ttl=30, owner_info={"task_name": "someone"})
    assert holder.acquire(blocking=False)
    try:
        run.apply()  # skipped, or failed with LockContended
        flush()
        events, _ = make_app(app).source.events("pol:1")
        refused = [e for e in events if e["kind"] == "contended"]
        assert refused and refused[0].get("policy") == policy, refused
        listed = "[" + str(refused[0]["task_id"]) + "]" in _waiting(
            _text(Client(make_app(app)).get("/key/pol%3A1"))
        )
        assert not listed
    finally:
        holder.release()


def test_a_queued_hold_shows_its_publisher_as_such_and_never_as_a_gone_worker(
    app: Celery, redis_client: redis.Redis
) -> None:
    """A queued hold's record is its publisher's, which publishes and exits: the overview
    and the key page say it was published and has not started, with no "worker gone"
    mark, where a held lock whose process is gone gets one."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    dead = int(exited.stdout)
    QueuedHold(redis_client, "q:1", owner_info={"task_name": "proj.imp", "pid": dead}).claim(
        "tid-q1", 60
    )
    Lock(redis_client, "h:1", 60, owner_info={"pid": dead}, auto_renew=False).acquire(
        blocking=False
    )
    board = Client(make_app(app))
    overview, key = _text(board.get("/")), _text(board.get("/key/q%3A1"))
    for page in (overview, key):
        assert "proj.imp[tid-q1], published by" in page and "not started yet" in page
    row = re.search(r'<tr data-name="q:1".*?</tr>', overview, re.S)
    assert row and "worker gone" not in row.group(0)
    held = re.search(r'<tr data-name="h:1".*?</tr>', overview, re.S)
    assert held and "worker gone" in held.group(0)
