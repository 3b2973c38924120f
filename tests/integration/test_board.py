"""The board as a WSGI app, through a WSGI test client (no browser): the same objects as
``celery locks list --json``, escaping, foreign data, the event log workers write, the
token and CSRF checks of actions, ``celery locks serve``, and a Flask site mounting it.
The browser tests are in test_board_browser.py."""

from __future__ import annotations

import contextlib
import gc
import html
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.celery import celery as celery_main
from click.testing import CliRunner
from servers import ClusterSetup, RedisServer, SentinelSetup
from werkzeug.test import Client

from celery_redlock import Lock, LockedTask, Redlock, Semaphore, connect, install
from celery_redlock.app.event_log import flush, log_key
from celery_redlock.board import make_app
from celery_redlock.board.auth import Token
from celery_redlock.board.serve import make_board_server
from celery_redlock.board.wsgi import DONE
from celery_redlock.core import open_backend
from celery_redlock.core.admin import read_lock
from celery_redlock.core.backend import EventLog, need
from celery_redlock.core.errors import ConfigError
from tests.apps import locksapp

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret-board-token-0123456789"
TOKEN = Token("ops", SECRET)
OWNER = {"task_name": "proj.sync", "task_id": "id-1"}


@pytest.fixture
def app(redis_client: redis.Redis, shared_redis: RedisServer) -> Iterator[Celery]:
    """An app whose locks live on the (flushed) shared server."""
    app = Celery("boardtest", broker="memory://", set_as_current=False)
    app.conf.redlock_url = shared_redis.url
    yield app


def _lock(server: RedisServer, name: str, **owner: Any) -> Lock:
    lock = Lock(server.client(), name, 30, owner_info={**OWNER, **owner}, auto_renew=False)
    assert lock.acquire(blocking=False)
    return lock


def _text(response: Any) -> str:
    return str(response.get_data(as_text=True))


def _signed_in(board: Any) -> Client:
    """A client signed in with TOKEN (the session cookie set by /login)."""
    client = Client(board)
    answer = client.post("/login", data={"token": SECRET})
    assert answer.status_code == 303
    return client


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9A-Za-z_-]+)"', page)
    assert found, page
    return found.group(1)


# -- what it shows ----------------------------------------------------------------------------
def test_the_api_has_the_objects_of_celery_locks_list_json(
    shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """/api/locks answers the objects `celery locks list --json` prints, field for field
    (the lease left aside: it runs down between the two reads)."""
    locksapp.app.conf.redlock_url = shared_redis.url
    try:
        _lock(shared_redis, "sync:1")
        _lock(shared_redis, "sync:2", task_id="id-2")
        cli = CliRunner().invoke(
            celery_main, ["-A", "tests.apps.locksapp", "locks", "list", "--json"]
        )
        assert cli.exit_code == 0, cli.output
        api = Client(make_app(locksapp.app)).get("/api/locks")
        assert api.headers["Content-Type"] == "application/json"
    finally:
        locksapp.app.conf.redlock_url = None

    def steady(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in o.items() if k != "ttl_ms"} for o in objects]

    assert steady(json.loads(_text(api))["locks"]) == steady(json.loads(cli.output))
    assert [o["name"] for o in json.loads(cli.output)] == ["sync:1", "sync:2"]


def test_the_overview_shows_each_key_with_its_holder_and_filters_by_prefix_and_kind(
    app: Celery, shared_redis: RedisServer
) -> None:
    """A mutex and two permits of a semaphore show as two rows with their holders; the
    prefix and kind filters keep only the matching row."""
    _lock(shared_redis, "sync:1")
    client = shared_redis.client()
    permits = [
        Semaphore(
            client, "sem:a", 2, 30, owner_info={**OWNER, "task_id": f"p{n}"}, auto_renew=False
        )
        for n in (1, 2)
    ]
    assert all(p.acquire(blocking=False) for p in permits)
    board = Client(make_app(app))
    page = _text(board.get("/"))
    rows = dict(re.findall(r'<tr data-name="([^"]+)" data-kind="([^"]+)"', page))
    assert rows == {"sync:1": "mutex", "sem:a": "semaphore"}
    assert "proj.sync[id-1]" in page and "proj.sync[p1]" in page and "proj.sync[p2]" in page
    assert "semaphore, 2 held" in page  # no task of this app names sem:a
    only_sync = _text(board.get("/?prefix=sync", headers={"X-Board-Part": "live"}))
    assert 'data-name="sync:1"' in only_sync and "sem:a" not in only_sync
    assert not only_sync.startswith("<!doctype")  # the live part alone
    only_sem = _text(board.get("/?kind=semaphore"))
    assert 'data-name="sem:a"' in only_sem and 'data-name="sync:1"' not in only_sem


def test_a_script_in_a_lock_name_or_record_is_text_and_no_inline_script_may_run(
    app: Celery, shared_redis: RedisServer
) -> None:
    """A lock name and a holder record holding <script> render escaped, on the overview
    and on the key page; every answer forbids inline scripts (Content-Security-Policy)."""
    name = "x:<script>document.title='owned'</script>"
    _lock(shared_redis, name, task_name="<img src=x onerror=alert(1)>")
    board = Client(make_app(app))
    for path in ("/", "/key/" + urllib.request.quote(name, safe="")):
        answer = board.get(path)
        page = _text(answer)
        assert answer.status_code == 200
        assert "<script>document" not in page and "<img src=x" not in page
        assert "&lt;script&gt;document.title=&#x27;owned&#x27;&lt;/script&gt;" in page
        assert "script-src 'self'" in answer.headers["Content-Security-Policy"]


def test_foreign_data_under_the_prefix_shows_as_unreadable_never_a_500(
    app: Celery, shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """A list where a lock's hash should be, a string at the event log's key and garbage
    in the log: the pages answer 200 and say "unreadable"."""
    _lock(shared_redis, "sync:1")
    redis_client.set(log_key("redlock:"), "not a stream")
    redis_client.rpush("redlock:{odd}", "x")
    redis_client.hset("redlock:{weird}", mapping={"token": "t", "fence": "abc", "info": "[1,2]"})
    redis_client.hset("redlock:{weird}:control", mapping={"pause": "x", "rate": "nonsense"})
    redis_client.hset("redlock:{weird}:permits", mapping={"x": "garbage"})
    board = Client(make_app(app))
    key_page = board.get("/key/sync%3A1")
    assert key_page.status_code == 200
    assert "unreadable" in _text(key_page)
    overview = board.get("/")
    assert overview.status_code == 200 and 'data-name="sync:1"' in _text(overview)
    assert board.get("/key/weird").status_code == 200
    assert board.get("/api/locks").status_code == 200
    redis_client.delete(log_key("redlock:"))
    redis_client.xadd(log_key("redlock:"), {"e": "{not json"})
    redis_client.xadd(
        log_key("redlock:"), {"e": json.dumps({"kind": "acquired", "name": "sync:1"})}
    )
    events = json.loads(_text(board.get("/api/events")))["events"]
    assert [e["kind"] for e in events] == ["acquired", "unreadable"] or [
        e["kind"] for e in events
    ] == ["unreadable", "acquired"]
    assert board.get("/key/sync%3A1").status_code == 200


# -- the events workers record -------------------------------------------------------------------
def test_an_app_whose_store_cannot_open_leaves_the_others_recording(app: Celery) -> None:
    """An app of the process with a bad redlock_url (its store never opens) records
    nothing, and another app's events are still written, with nothing logged as ERROR."""
    broken = Celery("broken", broker="memory://", set_as_current=False)
    broken.conf.redlock_url = "http://127.0.0.1:1/1"
    install(broken)
    install(app)

    @app.task(base=LockedTask, shared=False, lock_key="ok:<n>")
    def job(n: int) -> None: ...

    with _error_lines() as errors:
        job(1)
        flush()
    assert [e["kind"] for e in make_app(app).source.events("ok:1")[0]] == [
        "released",
        "acquired",
    ]
    assert errors == []


@contextlib.contextmanager
def _error_lines() -> Iterator[list[str]]:
    """The ERROR lines logged by celery_redlock while the block runs."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                lines.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("celery_redlock")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def test_runs_record_their_lock_events_and_the_key_page_shows_them(app: Celery) -> None:
    """A run of a LockedTask records acquired and released (with its fence) in the app's
    event log; a refused run records contended; the key page lists them with the fence
    history; redlock_event_log=False records nothing."""
    install(app)

    @app.task(
        base=LockedTask, shared=False, bind=True, lock_key="rec:<n>", lock_on_contended="skip"
    )
    def job(self: Any, n: int) -> int | None:
        return self.lock.fence  # type: ignore[no-any-return]

    fence = job(1)
    other = Lock(connect(app.conf.redlock_url), "rec:1", 30, auto_renew=False)
    assert other.acquire(blocking=False)
    job(1)  # refused: skipped
    other.release()
    flush()
    events, _ = make_app(app).source.events("rec:1")
    assert [e["kind"] for e in events] == ["contended", "released", "acquired"]
    assert events[2]["fence"] == fence and events[2]["task_name"] == job.name
    page = _text(Client(make_app(app)).get("/key/rec%3A1"))
    assert f"<b>{fence}</b>" in page  # the fence history
    assert 'data-kind="contended"' in page and 'data-kind="acquired"' in page

    quiet = Celery("quiet", broker="memory://", set_as_current=False)
    quiet.conf.redlock_url = "memory://board-quiet"  # no other app of this process writes here
    quiet.conf.redlock_event_log = False
    install(quiet)

    @quiet.task(base=LockedTask, shared=False, lock_key="rec:<n>")
    def quiet_job(n: int) -> None: ...

    quiet_job(2)
    flush()
    assert make_app(quiet).source.events("rec:2")[0] == []


@pytest.mark.parametrize("url", ["memory://board-log", "redis"])
def test_the_event_log_is_capped_and_read_newest_first(
    url: str, shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """EventLog on memory and Redis: events come back newest first, and the log keeps
    about maxlen of them (Redis trims whole nodes: at most twice as many)."""
    backend = need(open_backend(connect(shared_redis.url if url == "redis" else url)), EventLog)
    backend.log_events("t:events", [str(i) for i in range(1000)], 100, 60_000)
    newest = backend.read_events("t:events", 3)
    assert newest == ["999", "998", "997"]
    assert 100 <= len(backend.read_events("t:events", 5000)) <= 200
    if url == "redis":  # the log goes when nobody writes to it
        assert 0 < redis_client.pttl("t:events") <= 60_000


def test_an_event_log_key_holding_foreign_data_is_a_config_error_naming_it(
    shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """A string where the log should be: the write fails naming the key (never "Redis
    down"), and the foreign value is left as it was."""
    backend = need(open_backend(connect(shared_redis.url)), EventLog)
    redis_client.set("t:events", "theirs")
    with pytest.raises(ConfigError, match="'t:events' is not a stream of lock events"):
        backend.log_events("t:events", ["1", "2"], 100, 60_000)
    assert redis_client.get("t:events") == b"theirs"
    assert redis_client.pttl("t:events") == -1


def test_a_redlock_board_shows_one_row_a_name_with_the_masters_that_agree(
    three_servers: list[RedisServer],
) -> None:
    """On a Redlock deployment the API keeps each master's object; the page shows one row
    a name with how many masters agree on its holder."""
    for server in three_servers:
        server.client().flushall()
    lock = Redlock(
        [s.client() for s in three_servers], "red:1", 30, owner_info=OWNER, auto_renew=False
    )
    assert lock.acquire(blocking=False)
    app = Celery("redlockboard", broker="memory://", set_as_current=False)
    app.conf.redlock_url = [s.url for s in three_servers]
    try:
        objects = json.loads(_text(Client(make_app(app)).get("/api/locks")))["locks"]
        assert sorted(o["master"] for o in objects) == sorted(
            open_backend(connect(s.url)).describe() for s in three_servers
        )
        page = _text(Client(make_app(app)).get("/"))
        assert page.count('data-name="red:1"') == 1 and "<th>masters</th>" in page
        assert ">3 of 3<" in page and ">1 key<" in page
    finally:
        lock.release()


# -- actions -----------------------------------------------------------------------------------
def test_an_action_needs_the_token_and_the_csrf_token_and_asks_first(
    app: Celery, shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """Release with the signed-in token and the form's CSRF token: a confirmation page
    first (nothing changed), then the lock is released and the change logged with the
    token's name. Without the cookie, without the CSRF token or with actions off: 403
    and the lock stays."""
    lock = _lock(shared_redis, "act:1")
    board = make_app(app, actions=True, token=TOKEN)
    client = _signed_in(board)
    page = _text(client.get("/key/act%3A1"))
    csrf = _csrf(page)
    form = {"verb": "release", "name": "act:1", "fence": str(lock.fence), "state": "running"}

    anonymous = Client(board).post("/action", data={**form, "csrf": csrf, "confirmed": "yes"})
    assert anonymous.status_code == 403
    no_csrf = client.post("/action", data={**form, "confirmed": "yes"})
    assert no_csrf.status_code == 403
    wrong_csrf = client.post("/action", data={**form, "csrf": "0" * 64, "confirmed": "yes"})
    assert wrong_csrf.status_code == 403
    off = Client(make_app(app)).post("/action", data={**form, "csrf": csrf, "confirmed": "yes"})
    assert off.status_code == 403
    ask = client.post("/action", data={**form, "csrf": csrf})
    assert ask.status_code == 200 and "Release lock" in _text(ask)
    assert lock.locked()

    done = client.post("/action", data={**form, "csrf": csrf, "confirmed": "yes"})
    assert done.status_code == 303
    assert not lock.locked()
    assert done.headers["Location"] == "/key/act%3A1?done=released"
    assert DONE["released"] in _text(client.get(done.headers["Location"]))


def test_pause_and_set_go_through_the_controls_of_celery_locks(
    app: Celery, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Pause (with a reason and a duration), set a limit, resume and unset: each shows in
    the API's control objects as `celery locks list --json` prints them, and each is
    logged with the token's name."""
    board = make_app(app, actions=True, token=TOKEN)
    client = _signed_in(board)
    csrf = _csrf(_text(client.get("/key/partner%3Aacme")))

    def act(**fields: str) -> None:
        answer = client.post(
            "/action", data={"name": "partner:acme", "csrf": csrf, "confirmed": "yes", **fields}
        )
        assert answer.status_code == 303

    with caplog.at_level("INFO", logger="celery_redlock.board"):
        act(verb="pause", reason="429 from acme", **{"for": "10m"})
        act(verb="set", limit="3")
    controls = {o["control"]: o for o in json.loads(_text(client.get("/api/locks")))["locks"]}
    assert controls["pause"]["value"] == "429 from acme" and controls["pause"]["ttl_ms"] > 590_000
    assert controls["limit"]["value"] == "3"
    assert "pause 'partner:acme' (token 'ops')" in caplog.text
    assert "set 'partner:acme' (token 'ops')" in caplog.text
    act(verb="resume")
    act(verb="unset")
    assert json.loads(_text(client.get("/api/locks")))["locks"] == []


def test_a_bad_or_missing_token_is_refused_with_a_clear_message(app: Celery) -> None:
    """Actions without a token, or a short secret, are a ConfigError that says what to do."""
    from celery_redlock import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match="REDLOCK_BOARD_TOKEN"):
        make_app(app, actions=True)
    with pytest.raises(ConfigError, match="too short"):
        make_app(app, actions=True, token="ops:short")
    page = _text(
        Client(make_app(app, actions=True, token=TOKEN)).post("/login", data={"token": "nope"})
    )
    assert "not a token of this board" in page
    board = make_app(app, actions=True, token=TOKEN)
    for elsewhere in ("//evil.example/", "/\\evil.example/", "https://evil.example/"):
        signed = Client(board).post("/login", data={"token": SECRET, "next": elsewhere})
        assert signed.headers["Location"] == "/"  # never sent to another site
    back = Client(board).post("/login", data={"token": SECRET, "next": "/key/a"})
    assert back.headers["Location"] == "/key/a"


# -- serving and mounting -------------------------------------------------------------------------
def test_serve_refuses_a_non_loopback_address_without_a_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`celery locks serve --host 0.0.0.0` with no token, a bad --loglevel or a bad
    --allowed-host exits 2 saying why."""
    monkeypatch.delenv("REDLOCK_BOARD_TOKEN", raising=False)
    result = CliRunner().invoke(
        celery_main,
        ["-A", "tests.apps.locksapp", "locks", "serve", "--host", "0.0.0.0", "--port", "0"],
    )
    assert result.exit_code == 2
    assert "needs a token" in result.output and "0.0.0.0" in result.output
    result = CliRunner().invoke(
        celery_main, ["-A", "tests.apps.locksapp", "locks", "serve", "--actions"]
    )
    assert result.exit_code == 2 and "--actions needs a token" in result.output
    for option, said in (
        (["--loglevel", "LOUD"], "--loglevel 'LOUD' is not a level"),
        (["--allowed-host", "a b:x"], "allowed host 'a b:x' is not a host name"),
    ):
        result = CliRunner().invoke(
            celery_main,
            ["-A", "tests.apps.locksapp", "locks", "serve", "--port", "0", *option],
        )
        assert result.exit_code == 2 and said in result.output, result.output


#: `locks serve` processes started at once by the stop test, and how many rounds.
SERVE_BATCH, SERVE_ROUNDS = 5, 4


def _serve_processes(env: dict[str, str], *extra: str) -> list[subprocess.Popen[str]]:
    command = [str(Path(sys.executable).parent / "celery"), "-A", "tests.apps.locksapp",
               "locks", "serve", "--port", "0", *extra]  # fmt: skip
    return [
        subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(SERVE_BATCH)
    ]


def _address_of(proc: subprocess.Popen[str], mode: str) -> str:
    """The URL `locks serve` prints on its first line (within 60 s)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, "no address printed within 60 s"
    line = proc.stdout.readline()
    found = re.fullmatch(rf"celery-redlock board on (http://127\.0\.0\.1:\d+/) \({mode}\)\n", line)
    assert found, line
    return found.group(1)


def _refresh(url: str, stop: threading.Event) -> None:
    """Ask for the overview's live part five times a second (an open page asks once),
    until *stop* or refused."""
    request = urllib.request.Request(url, headers={"X-Board-Part": "live"})
    while not stop.wait(0.2):
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                answer.read()
        except OSError:
            return


@pytest.mark.slow
def test_locks_serve_answers_logs_and_stops_within_a_second_of_sigint_or_sigterm(
    shared_redis: RedisServer,
) -> None:
    """`celery -A app locks serve --port 0` as a real process, 20 times: it prints where
    it serves, answers the API there (and an --allowed-host name), shows sign-ins on
    stderr, and with a silent connection, a half-sent request and pages refreshing in
    flight exits with 0 within 1 s of SIGINT or SIGTERM, every time."""
    held_lock = Lock(shared_redis.client(), "served:1", 600, owner_info=OWNER, auto_renew=False)
    assert held_lock.acquire(blocking=False)
    env = dict(os.environ, LOCKSAPP_REDLOCK_URL=shared_redis.url, REDLOCK_BOARD_TOKEN=SECRET)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    stops: list[float] = []
    for round_ in range(SERVE_ROUNDS):
        procs = _serve_processes(env, "--actions", "--allowed-host", "board.example")
        stop = threading.Event()
        threads: list[threading.Thread] = []
        held: list[socket.socket] = []
        try:
            urls = [_address_of(proc, "actions on") for proc in procs]
            for url in urls:
                port = int(url.rsplit(":", 1)[1].strip("/"))
                silent = socket.create_connection(("127.0.0.1", port))
                half = socket.create_connection(("127.0.0.1", port))
                half.sendall(b"GET /api/locks HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep")
                held += [silent, half]
                threads += [
                    threading.Thread(target=_refresh, args=(url, stop), daemon=True)
                    for _ in range(2)
                ]
            for thread in threads:
                thread.start()
            first = urls[0]
            with urllib.request.urlopen(first + "api/locks", timeout=10) as r:
                assert [row["name"] for row in json.loads(r.read())["locks"]] == ["served:1"]
            proxied = urllib.request.Request(first + "api/locks", headers={"Host": "board.example"})
            with urllib.request.urlopen(proxied, timeout=10) as r:
                assert r.status == 200
            signed = urllib.request.Request(
                first + "login", data=f"token={SECRET}".encode(), method="POST"
            )
            with contextlib.suppress(urllib.error.HTTPError):  # the 303 leads to /
                urllib.request.urlopen(signed, timeout=10).close()
            for i, proc in enumerate(procs):
                sent = time.monotonic()
                proc.send_signal(signal.SIGTERM if (round_ + i) % 3 == 0 else signal.SIGINT)
                assert proc.wait(10) == 0
                stops.append(time.monotonic() - sent)
            assert procs[0].stderr is not None
            said = procs[0].stderr.read()
            assert "INFO] celery-redlock board: 'token' signed in from 127.0.0.1" in said, said
            assert "Traceback" not in said, said
        finally:
            stop.set()
            for sock in held:
                sock.close()
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
                for stream in (proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
            for thread in threads:
                thread.join(10)
    assert len(stops) == SERVE_BATCH * SERVE_ROUNDS
    assert max(stops) < 1.0, [round(s, 2) for s in stops]


def test_the_served_board_answers_over_http_and_a_private_one_asks_to_sign_in(
    app: Celery, shared_redis: RedisServer, tmp_path: Any
) -> None:
    """The command's server answers the overview on a free port; served beyond loopback
    (private), every page needs the token first."""
    _lock(shared_redis, "http:1")
    server = make_board_server(app, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/", timeout=10) as r:
            assert 'data-name="http:1"' in r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    private = make_app(app)
    private.private, private.tokens = True, [TOKEN]
    assert Client(private).get("/").status_code == 303
    assert Client(private).get("/api/locks").status_code == 403
    assert 'data-name="http:1"' in _text(_signed_in(private).get("/"))


def test_mounted_under_a_prefix_in_a_flask_site_it_serves_the_same_pages(
    app: Celery, shared_redis: RedisServer
) -> None:
    """A Flask app with the board under /ops/locks: the same rows, links and static files
    under the prefix, the site's own routes untouched."""
    from flask import Flask  # noqa: PLC0415 - only this test needs Flask
    from werkzeug.middleware.dispatcher import DispatcherMiddleware  # noqa: PLC0415

    _lock(shared_redis, "mounted:1")
    site = Flask("site")

    @site.route("/")
    def home() -> str:
        return "the site"

    site.wsgi_app = DispatcherMiddleware(site.wsgi_app, {"/ops/locks": make_app(app)})  # type: ignore[method-assign]
    client = site.test_client()
    assert client.get("/").get_data(as_text=True) == "the site"
    page = client.get("/ops/locks/").get_data(as_text=True)
    alone = _text(Client(make_app(app)).get("/"))
    assert 'data-name="mounted:1"' in page
    assert (
        'href="/ops/locks/key/mounted%3A1"' in page and 'href="/ops/locks/static/board.css"' in page
    )
    assert page.replace("/ops/locks", "").count("data-name") == alone.count("data-name")
    assert client.get("/ops/locks/static/board.js").status_code == 200
    assert "mounted:1" in client.get("/ops/locks/key/mounted%3A1").get_data(as_text=True)


@pytest.mark.parametrize("where", ["memory", "redis"])
def test_the_overview_reads_one_page_of_names_and_says_more_match(
    where: str,
    shared_redis: RedisServer,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With more keys than a page, the overview shows the first keys in key order, how
    many match and a link to the next page; the API lists all."""
    from celery_redlock.board import pages  # noqa: PLC0415
    from celery_redlock.core.admin import scan_locks  # noqa: PLC0415

    url = shared_redis.url if where == "redis" else "memory://board-page"
    target = connect(url)
    held = [Lock(target, f"page:{i}", 30, owner_info=OWNER, auto_renew=False) for i in (4, 1, 3, 2)]
    assert all(lock.acquire(blocking=False) for lock in held)
    permit = Semaphore(target, "page:2", 2, 30, auto_renew=False)
    assert permit.acquire(blocking=False)
    try:
        first = scan_locks(target, "redlock:", "page:*", limit=2)
        assert [(i.name, i.kind) for i in first] == [
            ("page:1", "lock"),
            ("page:2", "lock"),
            ("page:2", "permit"),
        ]
        app = Celery("paged", broker="memory://", set_as_current=False)
        app.conf.redlock_url = url
        monkeypatch.setattr(pages, "PAGE", 2)
        page = _text(Client(make_app(app)).get("/?prefix=page:"))
        assert re.findall(r'<tr data-name="([^"]+)"', page) == ["page:1", "page:2"]
        assert "5 keys, 1-2 shown" in page and 'rel="next"' in page
        listed = json.loads(_text(Client(make_app(app)).get("/api/locks?pattern=page:*")))
        assert len(listed["locks"]) == 5 and listed["next"] is None
    finally:
        for lock in [*held, permit]:
            lock.release()


def test_each_key_shows_the_task_rules_that_name_it(app: Celery, shared_redis: RedisServer) -> None:
    """A task's lock_key (with its lock_limit) and its lock_limits rules show on the rows
    of the keys they can give, and the semaphore's limit comes from the rule."""
    from celery_redlock import Limit, Rate  # noqa: PLC0415

    @app.task(
        base=LockedTask,
        shared=False,
        name="proj.import_rows",
        lock_key="imp:<n>",
        lock_limits=[Limit("imports", 3), Rate("partner:<p>", "60/m")],
    )
    def import_rows(n: int, p: str) -> None: ...

    @app.task(
        base=LockedTask, shared=False, name="proj.report", lock_key="report:<day>", lock_limit=2
    )
    def report(day: str) -> None: ...

    client = shared_redis.client()
    held = [
        Lock(client, "imp:1", 30, owner_info=OWNER, auto_renew=False),
        Semaphore(client, "imports", 3, 30, owner_info=OWNER, auto_renew=False),
        Semaphore(client, "report:mon", 2, 30, owner_info=OWNER, auto_renew=False),
    ]
    assert all(h.acquire(blocking=False) for h in held)
    page = _text(Client(make_app(app)).get("/"))
    rows = dict(re.findall(r'<tr data-name="([^"]+)".*?<td data-col="rules">(.*?)</td>', page))
    assert rows["imp:1"] == "proj.import_rows: lock_key=&#x27;imp:&lt;n&gt;&#x27;"
    assert rows["imports"] == "proj.import_rows: Limit(&#x27;imports&#x27;, 3)"
    assert "lock_limit=2" in rows["report:mon"]
    assert "semaphore 1/2" in page and "semaphore 1/3" in page
    key_page = _text(Client(make_app(app)).get("/key/imports"))
    assert "Rules that name it" in key_page and "Limit(&#x27;imports&#x27;, 3)" in key_page


def test_a_back_off_is_recorded_and_shown_with_the_pause(app: Celery) -> None:
    """A run that raises BackOff(30) records a backed_off event on the key it paused, with
    its reason; the key page shows the event and the pause."""
    from celery_redlock import BackOff  # noqa: PLC0415

    install(app)

    @app.task(base=LockedTask, shared=False, name="proj.call_partner", lock_key="partner:<p>")
    def call_partner(p: str) -> None:
        raise BackOff(30, reason="429 from the partner")

    with pytest.raises(BackOff):
        call_partner("acme")
    flush()
    events, _ = make_app(app).source.events("partner:acme")
    backed = [e for e in events if e["kind"] == "backed_off"]
    assert len(backed) == 1 and backed[0]["retry_after"] == 30
    assert backed[0]["error"] == "429 from the partner"
    assert backed[0]["task_name"] == "proj.call_partner"
    page = _text(Client(make_app(app)).get("/key/partner%3Aacme"))
    assert 'data-kind="backed_off"' in page and "paused: 429 from the partner" in page


def test_on_a_cluster_the_board_finds_keys_on_every_primary_and_their_events(
    redis_cluster: ClusterSetup,
) -> None:
    """On a Redis Cluster the overview and the API list locks held on all three
    primaries (one page of names across them, in order), and the event log is written
    and read there."""
    client = redis_cluster.client()
    names = [f"job:{i:02d}" for i in range(12)]
    owners = {client.get_node_from_key(f"redlock:{{{n}}}").name for n in names}
    assert len(owners) == 3, "the names should spread over all three primaries"
    held = [Lock(client, n, 30, owner_info=OWNER, auto_renew=False) for n in names]
    assert all(lock.acquire(blocking=False) for lock in held)
    app = Celery("clusterboard", broker="memory://", set_as_current=False)
    app.conf.redlock_url = redis_cluster.nodes[0].url
    app.conf.redlock_client_options = {"cluster": True}
    try:
        board = make_app(app)
        assert (
            sorted(o["name"] for o in json.loads(_text(Client(board).get("/api/locks")))["locks"])
            == names
        )
        assert re.findall(r'<tr data-name="([^"]+)"', _text(Client(board).get("/"))) == names
        view = board.source.listing("job:*", limit=5)
        assert [o["name"] for o in view.objects] == names[:5] and view.more
        store = need(open_backend(client), EventLog)
        store.log_events(
            log_key("redlock:"), [json.dumps({"kind": "acquired", "name": "job:01"})], 100, 60_000
        )
        assert [e["kind"] for e in board.source.events("job:01")[0]] == ["acquired"]
    finally:
        for lock in held:
            lock.release()
        client.close()


def test_on_sentinel_the_board_reads_the_master(sentinel_setup: SentinelSetup) -> None:
    """With a sentinel:// URL the board shows the locks on the current master, and the
    event log is written there (its script sent behind the master guard) and read back."""
    url = ";".join(sentinel_setup.sentinel_urls) + "?master=mymaster"
    client = connect(url)
    lock = Lock(client, "sent:1", 30, owner_info=OWNER, auto_renew=False)
    assert lock.acquire(blocking=False)
    app = Celery("sentinelboard", broker="memory://", set_as_current=False)
    app.conf.redlock_url = url
    try:
        board = make_app(app)
        page = _text(Client(board).get("/"))
        assert 'data-name="sent:1"' in page and "proj.sync[id-1]" in page
        store = need(open_backend(client), EventLog)
        events = [json.dumps({"kind": kind, "name": "sent:1"}) for kind in ("acquired", "released")]
        store.log_events(log_key("redlock:"), events, 100, 60_000)
        assert [e["kind"] for e in board.source.events("sent:1")[0]] == ["released", "acquired"]
    finally:
        lock.release()


def test_the_recorder_writes_from_its_thread_which_ends_when_idle(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without flush(), a run's events reach the log from the background thread, which
    then ends by itself when no event comes (no thread is left behind)."""
    from celery_redlock.app import event_log as recorder  # noqa: PLC0415

    # Earlier tests' apps record until they are collected: one whose servers are gone
    # would hold the writer thread in its client's timeouts before this app's turn.
    gc.collect()
    monkeypatch.setattr(recorder, "FLUSH_EVERY", 0.05)
    monkeypatch.setattr(recorder, "IDLE", 0.3)
    install(app)

    @app.task(base=LockedTask, shared=False, lock_key="bg:<n>")
    def job(n: int) -> None: ...

    job(1)
    board = make_app(app)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(board.source.events("bg:1")[0]) < 2:
        time.sleep(0.02)
    assert [e["kind"] for e in board.source.events("bg:1")[0]] == ["released", "acquired"]

    def writer_alive() -> bool:
        return any(t.name == "celery-redlock-events" for t in threading.enumerate())

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and writer_alive():
        time.sleep(0.02)
    assert not writer_alive()


# -- safe: headers, Host, sessions, messages, parameters ---------------------------------------
def _raw(
    board: Any, path: str, *, method: str = "GET", data: Any = None, **environ: Any
) -> tuple[str, list[tuple[str, str]], str]:
    """*board* called as a WSGI app with one request (no client in between to check or
    fix its headers): the status, the headers as written, the body."""
    from werkzeug.test import EnvironBuilder  # noqa: PLC0415

    env = EnvironBuilder(path=path, method=method, data=data).get_environ()
    env.update(environ)
    said: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        said.update(status=status, headers=headers)

    body = b"".join(board(env, start_response)).decode()
    return said["status"], said["headers"], body


def test_a_crlf_or_tab_in_next_never_reaches_a_header() -> None:
    """Sign-in's `next` holding CR LF (a second Set-Cookie) or a tab is not a local
    path: the board sends the person home, and writes one Set-Cookie only; a header value
    with a control character is refused where headers are built."""
    from celery_redlock.board.http import headers, local_path  # noqa: PLC0415

    board = make_app(Celery("crlf", set_as_current=False), actions=True, token=TOKEN)
    for evil in ("/\r\nSet-Cookie: injected=1", "/key/a\tb", "/\nx", "/key/\x7f"):
        status, sent, _ = _raw(board, "/login", method="POST", data={"token": SECRET, "next": evil})
        assert status.startswith("303")
        assert dict(sent)["Location"] == "/"
        assert next(v for k, v in sent if k == "Set-Cookie").startswith("redlock_board=")
        assert len([k for k, _ in sent if k == "Set-Cookie"]) == 1
        assert all("\r" not in v and "\n" not in v and "\t" not in v for _, v in sent)
    assert local_path("/key/a?x=1", "") == "/key/a?x=1"
    assert (
        local_path("/ops/key/a", "/ops") == "/ops/key/a" and local_path("/key/a", "/ops") == "/ops/"
    )
    for bad_value in ("/\r\nX: 1", "a\tb", "x\x00"):
        with pytest.raises(ValueError, match="control character"):
            headers([("Location", bad_value)])


def test_a_request_for_another_host_is_refused_by_the_served_board(
    app: Celery, shared_redis: RedisServer
) -> None:
    """Served on 127.0.0.1:PORT, the board answers Host 127.0.0.1:PORT and localhost:PORT
    and an --allowed-host name, and refuses another Host (a DNS-rebinding page) with 400;
    make_app without allowed_hosts checks none, with them refuses the others."""
    _lock(shared_redis, "host:1")
    server = make_board_server(app, host="127.0.0.1", port=0, allowed_hosts=["board.example"])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    port = server.server_port

    def status(host: str) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/locks")
        request.add_header("Host", host)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert status(f"attacker.example:{port}") == 400
        assert status(f"127.0.0.1:{port + 1}") == 400
        assert status(f"127.0.0.1:{port}") == 200 and status(f"LOCALHOST:{port}") == 200
        assert status("board.example") == 200 and status("board.example:8443") == 200
        assert status("board.example.attacker.example") == 400
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert Client(make_app(app)).get("/", headers={"Host": "anything.example"}).status_code == 200
    pinned = make_app(app, allowed_hosts=["ops.example:443"])
    assert Client(pinned).get("/", headers={"Host": "other.example"}).status_code == 400
    assert Client(pinned).get("/", base_url="https://ops.example/").status_code == 200
    with pytest.raises(ConfigError, match="allowed host 'a b:x'"):
        make_app(app, allowed_hosts=["a b:x"])


def test_sessions_are_random_per_sign_in_end_at_sign_out_and_expire(
    app: Celery, shared_redis: RedisServer
) -> None:
    """Two sign-ins get different session cookies and CSRF tokens (HttpOnly,
    SameSite=Strict, Secure over https or with secure_cookies); sign-out (a POST with the
    session's CSRF token) ends the session; a session ends by itself after session_ttl."""
    from freezegun import freeze_time  # noqa: PLC0415

    lock = _lock(shared_redis, "sess:1")
    board = make_app(app, actions=True, token=TOKEN, session_ttl=60)
    first, second = _signed_in(board), _signed_in(board)
    cookies = [c.get_cookie("redlock_board") for c in (first, second)]
    assert all(c is not None and c.http_only and c.same_site == "Strict" for c in cookies)
    assert cookies[0].value != cookies[1].value and not cookies[0].secure  # type: ignore[union-attr]
    assert SECRET not in cookies[0].value  # type: ignore[union-attr]
    csrfs = [_csrf(_text(c.get("/key/sess%3A1"))) for c in (first, second)]
    assert csrfs[0] != csrfs[1]
    crossed = {"verb": "release", "name": "sess:1", "state": "running", "confirmed": "yes"}
    assert first.post("/action", data={**crossed, "csrf": csrfs[1]}).status_code == 403
    https = Client(board).post("/login", data={"token": SECRET}, base_url="https://localhost/")
    assert "; Secure" in https.headers["Set-Cookie"]
    behind = Client(make_app(app, token=TOKEN, secure_cookies=True)).post(
        "/login", data={"token": SECRET}
    )
    assert "; Secure" in behind.headers["Set-Cookie"]

    assert first.post("/logout", data={"csrf": csrfs[1]}).status_code == 403  # not its token
    assert first.get("/logout").status_code == 405
    out = first.post("/logout", data={"csrf": csrfs[0]})
    assert out.status_code == 303 and "Max-Age=0" in out.headers["Set-Cookie"]
    replayed = Client(board)
    replayed.set_cookie("redlock_board", cookies[0].value)  # type: ignore[union-attr]
    assert replayed.post("/action", data={**crossed, "csrf": csrfs[0]}).status_code == 403
    assert "sign out" not in _text(replayed.get("/"))
    with freeze_time() as clock:
        late = _signed_in(board)
        csrf = _csrf(_text(late.get("/key/sess%3A1")))
        clock.tick(61)
        assert late.post("/action", data={**crossed, "csrf": csrf}).status_code == 403
    assert lock.locked()
    mine = {**crossed, "csrf": csrfs[1], "fence": str(lock.fence)}
    assert second.post("/action", data=mine).status_code == 303  # the other session lives
    assert not lock.locked()


def test_a_pages_message_comes_from_a_fixed_set_never_from_the_query(app: Celery) -> None:
    """`?done=` picks one of the board's sentences by its code; any other text shows
    nothing."""
    board = Client(make_app(app))
    evil = _text(board.get("/key/sync%3A1?done=Your+session+expired%2C+call+555-0100"))
    assert "555-0100" not in evil and 'class="done"' not in evil
    for code, sentence in DONE.items():
        page = _text(board.get(f"/key/sync%3A1?done={code}"))
        assert f'<p class="done" role="status">{html.escape(sentence)}</p>' in page


def test_every_bad_parameter_is_a_400_with_a_reason_and_no_traceback(
    app: Celery, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Unicode digits, zero, out-of-range counts and limits, a fence that is not a
    number and a duration of 1e308s: each a 400 whose page says which value is wrong,
    nothing changed and nothing logged at ERROR."""
    lock = _lock(shared_redis, "bad:1")
    board = make_app(app, actions=True, token=TOKEN)
    client = _signed_in(board)
    csrf = _csrf(_text(client.get("/key/bad%3A1")))
    with caplog.at_level("DEBUG", logger="celery_redlock.board"):
        for path, said in [
            ("/api/events?count=%C2%B2", "limit must be a whole number from 1 to 1000"),
            ("/api/events?count=0", "got '0'"),
            ("/api/events?limit=1001", "got '1001'"),
            ("/api/events?cursor=-1", "cursor must be a whole number"),
            ("/api/locks?limit=%D9%A3", "limit must be"),
            ("/api/locks?cursor=x", "cursor must be"),
        ]:
            answer = client.get(path)
            assert answer.status_code == 400, path
            assert said in html.unescape(_text(answer)), path
        for fields, said in [
            ({"verb": "set", "limit": "²"}, "limit must be a whole number"),
            ({"verb": "set", "limit": "3", "burst": "1e9"}, "burst must be"),
            ({"verb": "release", "fence": "abc", "state": "running"}, "fence must be"),
            ({"verb": "pause", "for": "1e308s"}, "for '1e308s'"),
            ({"verb": "pause", "for": "400d"}, "longer than a year"),
            ({"verb": "pause", "for": "soon"}, "must be a duration"),
            ({"verb": "set", "rate": "fast"}, "set 'bad:1' refused"),
            ({"verb": "dance"}, "unknown action 'dance'"),
        ]:
            for confirmed in ("", "yes"):
                answer = client.post(
                    "/action",
                    data={"name": "bad:1", "csrf": csrf, "confirmed": confirmed, **fields},
                )
                if fields.get("rate") and not confirmed:
                    continue  # the rate is checked by the controls, when done
                assert answer.status_code == 400, fields
                assert said in html.unescape(_text(answer)), fields
        assert client.get("/api/events?count=5").status_code == 200
    assert lock.locked()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_the_api_is_paged_and_says_whether_there_is_more(
    app: Celery, shared_redis: RedisServer, redis_client: redis.Redis
) -> None:
    """/api/locks?limit=2 answers two names' objects (a semaphore's permits with their
    name) and a cursor; following `next` reads every name once, in order, until next is
    null. /api/events pages the same way, newest first."""
    for i in (5, 1, 4, 2):
        _lock(shared_redis, f"pg:{i}")
    permits = [
        Semaphore(shared_redis.client(), "pg:3", 2, 30, owner_info=OWNER, auto_renew=False)
        for _ in range(2)
    ]
    assert all(p.acquire(blocking=False) for p in permits)
    client = Client(make_app(app))
    seen: list[list[str]] = []
    cursor: str | None = ""
    while cursor is not None:
        page = json.loads(_text(client.get(f"/api/locks?pattern=pg:*&limit=2&cursor={cursor}")))
        seen.append(sorted(o["name"] for o in page["locks"]))
        cursor = page["next"]
    assert seen == [["pg:1", "pg:2"], ["pg:3", "pg:3", "pg:4"], ["pg:5"]]
    assert json.loads(_text(client.get("/api/locks?pattern=pg:*")))["next"] is None

    # A prefix of its own: the event writers of earlier tests' apps may still flush theirs.
    app.conf.redlock_key_prefix = "pgtest:"
    client = Client(make_app(app))
    redis_client.xadd(log_key("pgtest:"), {"e": json.dumps({"kind": "acquired", "name": "e:0"})})
    for i in range(1, 5):
        event = {"kind": "acquired", "name": f"e:{i}", "at": 1000.0 + i}
        redis_client.xadd(log_key("pgtest:"), {"e": json.dumps(event)})
    first = json.loads(_text(client.get("/api/events?limit=3")))
    assert [e["name"] for e in first["events"]] == ["e:4", "e:3", "e:2"] and first["next"] == "3"
    rest = json.loads(_text(client.get(f"/api/events?limit=3&cursor={first['next']}")))
    assert [e["name"] for e in rest["events"]] == ["e:1", "e:0"] and rest["next"] is None


def test_sign_ins_sign_outs_and_actions_are_logged_with_who_and_from_where(
    app: Celery, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """One INFO line on celery_redlock.board for a sign-in, a refused sign-in, an action
    (the token's name, the verb, the key, the client's address) and a sign-out."""
    lock = _lock(shared_redis, "log:1")
    board = make_app(app, actions=True, token=TOKEN)
    with caplog.at_level("INFO", logger="celery_redlock.board"):
        client = Client(board)
        env = {"REMOTE_ADDR": "127.0.0.9"}
        client.post("/login", data={"token": "wrong"}, environ_overrides=env)
        client.post("/login", data={"token": SECRET}, environ_overrides=env)
        csrf = _csrf(_text(client.get("/key/log%3A1")))
        form = {"verb": "release", "name": "log:1", "fence": str(lock.fence), "state": "running"}
        client.post(
            "/action", data={**form, "csrf": csrf, "confirmed": "yes"}, environ_overrides=env
        )
        client.post("/logout", data={"csrf": csrf}, environ_overrides=env)
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_redlock.board"]
    assert all(
        r.levelno == logging.INFO for r in caplog.records if r.name == "celery_redlock.board"
    )
    assert [lines[0], lines[1], lines[3]] == [
        "celery-redlock board: sign-in refused from 127.0.0.9 (not a token of this board)",
        "celery-redlock board: 'ops' signed in from 127.0.0.9",
        "celery-redlock board: 'ops' signed out from 127.0.0.9",
    ]
    assert lines[2].startswith(
        "celery-redlock board: release 'log:1' (token 'ops') from 127.0.0.9: released "
        "'log:1': was held by task proj.sync[id-1]"
    )
    assert lines[2].endswith(f"fence {lock.fence}") and len(lines) == 4


# -- the timeline, permits, filtered releases, gone workers (issue 47) -----------------------
def _permit(server: RedisServer, name: str, tid: str) -> Semaphore:
    permit = Semaphore(
        server.client(), name, 3, 30, owner_info={**OWNER, "task_id": tid}, auto_renew=False
    )
    assert permit.acquire(blocking=False)
    return permit


def _permit_fences(server: RedisServer, name: str) -> list[int | None]:
    """The fences of the live permits of semaphore *name*, as ``celery locks show`` reads them."""
    infos = read_lock(server.client(), "redlock:", name)
    return sorted(i.fence for i in infos if i.kind == "permit")  # type: ignore[type-var]


def _live(client: Client, path: str) -> str:
    return _text(client.get(path, headers={"X-Board-Part": "live"}))


def test_the_pages_draw_a_timeline_of_their_keys_runs(app: Celery) -> None:
    """A run of a LockedTask is a bar with its fence on the overview's timeline and on its
    key's page; a key the overview's filter leaves out has no lane."""
    install(app)

    @app.task(base=LockedTask, shared=False, bind=True, lock_key="tl:<n>")
    def job(self: Any, n: int) -> int | None:
        return self.lock.fence  # type: ignore[no-any-return]

    fence = job(1)
    job(2)
    flush()
    board = make_app(app)
    client = Client(board)
    overview = _live(client, "/?prefix=tl%3A1")
    assert '<svg class="timeline"' in overview
    assert re.search(rf'class="tl-bar tl-ran"[^>]*><title>[^<]*fence {fence}</title>', overview)
    assert "tl:1" in overview and "tl:2" not in overview
    page = _live(client, "/key/tl%3A2")
    assert '<svg class="timeline"' in page and "tl-bar tl-ran" in page


def test_one_permit_is_released_by_its_fence_and_the_others_stay(
    app: Celery, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Each permit of a semaphore has its release form; releasing one (confirmed) removes
    that permit only, logs it at INFO, records a forced event the timeline draws as
    force-released; a second release of it finds it gone."""
    first, second = _permit(shared_redis, "sem:1", "p-1"), _permit(shared_redis, "sem:1", "p-2")
    board = make_app(app, actions=True, token=TOKEN)
    client = _signed_in(board)
    page = _text(client.get("/key/sem%3A1"))
    assert page.count('name="kind" value="permit"') == 2
    form = {
        "verb": "release", "name": "sem:1", "kind": "permit", "state": "held",
        "fence": str(first.fence), "csrf": _csrf(page),
    }  # fmt: skip
    ask = client.post("/action", data=form)
    assert ask.status_code == 200 and "Release one permit" in _text(ask)
    assert len(_permit_fences(shared_redis, "sem:1")) == 2
    with caplog.at_level("INFO", logger="celery_redlock.board"):
        done = client.post("/action", data={**form, "confirmed": "yes"})
    assert done.headers["Location"] == "/key/sem%3A1?done=released"
    holders = _permit_fences(shared_redis, "sem:1")
    assert holders == [second.fence]
    [line] = [r.getMessage() for r in caplog.records if r.name == "celery_redlock.board"]
    assert "release 'sem:1' (token 'ops')" in line and f"fence {first.fence}" in line
    events, _ = board.source.events("sem:1")
    assert events[0]["kind"] == "forced" and events[0]["fence"] == first.fence
    assert "tl-force-released" in _live(client, "/key/sem%3A1")
    again = client.post("/action", data={**form, "confirmed": "yes"})
    assert again.headers["Location"] == "/key/sem%3A1?done=gone"


def test_a_release_of_the_filtered_set_lists_what_goes_then_releases_only_that(
    app: Celery, shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The overview's "release what these filters match": a confirm page listing the
    matching names (and not the others), nothing released yet; confirmed, the locks and
    permits matching go, the others stay, one INFO line per key and one for the set."""
    locks = [_lock(shared_redis, n) for n in ("sweep:1", "sweep:2")]
    permit = _permit(shared_redis, "sweep:sem", "p-9")
    keep = _lock(shared_redis, "keep:1")
    board = make_app(app, actions=True, token=TOKEN)
    client = _signed_in(board)
    overview = _text(client.get("/?prefix=sweep%3A"))
    assert 'id="release-set"' in overview
    form = {"verb": "release-set", "prefix": "sweep:", "csrf": _csrf(overview)}
    ask = _text(client.post("/action", data=form))
    listed = re.search(r'<ul class="names" id="to-release">(.*?)</ul>', ask)
    assert listed and re.findall(r"<li>(.*?)</li>", listed.group(1)) == [
        "sweep:1", "sweep:2", "sweep:sem",
    ]  # fmt: skip
    assert all(lock.locked() for lock in locks)
    assert _permit_fences(shared_redis, "sweep:sem") == [permit.fence]
    with caplog.at_level("INFO", logger="celery_redlock.board"):
        done = client.post("/action", data={**form, "confirmed": "yes"})
    assert done.status_code == 303
    assert done.headers["Location"] == "/?prefix=sweep%3A&done=released-set"
    assert not any(lock.locked() for lock in locks)
    assert _permit_fences(shared_redis, "sweep:sem") == []
    assert keep.locked()
    lines = [r.getMessage() for r in caplog.records if r.name == "celery_redlock.board"]
    assert len(lines) == 4 and lines[-1].endswith("3 of 3 released")
    assert DONE["released-set"] in _text(client.get(done.headers["Location"]))


def test_a_release_of_the_filtered_set_says_when_more_match_than_it_lists(
    app: Celery, shared_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More matching names than the cap: the confirm page lists the cap's worth and says
    how many match; confirmed, only those go."""
    import celery_redlock.board.wsgi as wsgi  # noqa: PLC0415 - its cap, lowered

    monkeypatch.setattr(wsgi, "SET_MAX", 3)
    locks = [_lock(shared_redis, f"many:{i}") for i in range(5)]
    client = _signed_in(make_app(app, actions=True, token=TOKEN))
    form = {"verb": "release-set", "prefix": "many:", "csrf": _csrf(_text(client.get("/")))}
    ask = _text(client.post("/action", data=form))
    assert "More than 3 keys match (5 keys)" in ask and ask.count("<li>many:") == 3
    client.post("/action", data={**form, "confirmed": "yes"})
    assert [lock.locked() for lock in locks] == [False, False, False, True, True]


def test_a_holder_shows_its_worker_node_and_is_marked_when_its_process_is_gone(
    app: Celery, shared_redis: RedisServer, tmp_path: Path
) -> None:
    """A holder's worker node name (the record's ``worker``) is on its row; a lock whose
    process ended without releasing it (a pid of this host that no longer runs) is marked
    "worker gone"; a live holder is not."""
    live = _lock(shared_redis, "alive:1", worker="w1@somewhere")
    script = (
        "import sys; from celery_redlock import Lock; import redis\n"
        f"lock = Lock(redis.Redis.from_url({shared_redis.url!r}), 'dead:1', 60, auto_renew=False)\n"
        "assert lock.acquire(blocking=False); print(lock.fence)\n"
    )
    ended = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True,
    )  # fmt: skip
    assert ended.stdout.strip().isdigit()
    client = Client(make_app(app))
    page = _live(client, "/")
    alive = re.search(r'<tr data-name="alive:1".*?</tr>', page)
    dead = re.search(r'<tr data-name="dead:1".*?</tr>', page)
    assert alive and dead, page
    assert "on w1@somewhere" in alive.group(0) and "worker gone" not in alive.group(0)
    assert "worker gone" in dead.group(0) and "is not running on" in dead.group(0)
    assert "worker gone" in _live(client, "/key/dead%3A1")
    assert json.loads(_text(client.get("/api/locks/alive%3A1")))[0]["holder"].keys() == {
        "task_name", "task_id", "hostname", "pid",
    }  # fmt: skip
    live.release()


def test_on_a_redlock_a_release_of_the_filtered_set_releases_it_on_every_master(
    three_servers: list[RedisServer],
) -> None:
    """A Redlock's lock matching the filters is listed once on the confirm page and,
    confirmed, removed from each of the three masters."""
    for server in three_servers:
        server.client().flushall()
    lock = Redlock(
        [s.client() for s in three_servers], "redset:1", 30, owner_info=OWNER, auto_renew=False
    )
    assert lock.acquire(blocking=False)
    app = Celery("redlockset", broker="memory://", set_as_current=False)
    app.conf.redlock_url = [s.url for s in three_servers]
    client = _signed_in(make_app(app, actions=True, token=TOKEN))
    form = {"verb": "release-set", "prefix": "redset:", "csrf": _csrf(_text(client.get("/")))}
    ask = _text(client.post("/action", data=form))
    assert ask.count("<li>redset:1</li>") == 1 and "Release 3 holds of 1 key" in ask
    client.post("/action", data={**form, "confirmed": "yes"})
    assert [read_lock(s.client(), "redlock:", "redset:1") for s in three_servers] == [[], [], []]
