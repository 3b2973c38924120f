"""The board in a real headless Chromium (system packages, driven by Selenium), with two
real prefork workers holding a mutex and two permits of a semaphore, and a queued hold.

Under ``CI=true`` a missing browser fails these tests; elsewhere they skip, saying how to
install one (``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import RedisServer
from workers import Worker, forget_results, worker_env

from celery_redlock import Lock
from celery_redlock.board.serve import make_board_server
from celery_redlock.board.wsgi import DONE
from tests.apps import boardapp

pytestmark = pytest.mark.slow

APP = "tests.apps.boardapp"
#: The names of the runs the tests start.
NAMES = ("m", "s", "ev", "act")
SECRET = "browser-board-token-0123456789"
INSTALL = (
    "the board's browser tests need Chromium and its driver from the system's packages: "
    "`sudo apt-get install chromium chromium-driver` (Debian, Ubuntu), then run them again"
)


def _need(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {what}: {INSTALL}")
    pytest.skip(f"{what}: {INSTALL}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium of the system's packages (nothing downloaded)."""
    try:
        from selenium import webdriver  # noqa: PLC0415 - the test extra's
        from selenium.webdriver.chrome.service import Service  # noqa: PLC0415
    except ImportError:
        _need("selenium is not installed (pip install -e '.[test]')")
    binary = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )
    driver_path = shutil.which("chromedriver") or (
        "/usr/lib/chromium/chromedriver"
        if Path("/usr/lib/chromium/chromedriver").exists()
        else None
    )
    if binary is None or driver_path is None:
        _need("no Chromium or chromedriver on PATH")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1200,900")
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def workers(
    server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    """Two prefork workers of concurrency 2 of tests.apps.boardapp."""
    logs = tmp_path_factory.mktemp("board")
    started = [Worker(APP, worker_env(server), logs / f"w{i}.log", concurrency=2) for i in range(2)]
    try:
        for w in started:
            w.wait_ready()
        yield started
    finally:
        for name in NAMES:  # every run the tests started ends
            _go(server, name)
        for w in started:
            w.stop()


@pytest.fixture(scope="module")
def board(
    server: RedisServer, workers: list[Worker], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The board of boardapp (actions on, one token) served on a free loopback port: its URL."""
    env = worker_env(server)
    conf = boardapp.app.conf
    saved = {k: conf.get(k) for k in ("broker_url", "result_backend", "redlock_url")}
    conf.update(broker_url=env["REDLOCK_TEST_BROKER"], result_backend=env["REDLOCK_TEST_BACKEND"])
    conf.redlock_url = env["REDLOCK_TEST_LOCKS"]
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"# who may act\nops:{SECRET}\n")
    http = make_board_server(
        boardapp.app, host="127.0.0.1", port=0, actions=True, token_file=str(tokens)
    )
    thread = threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield f"http://127.0.0.1:{http.server_port}"
    finally:
        http.shutdown()
        http.server_close()
        thread.join(10)
        forget_results(boardapp.app)
        conf.update(saved)


def _api(board: str, path: str = "/api/locks") -> list[dict[str, Any]]:
    with urllib.request.urlopen(board + path, timeout=10) as answer:
        data = json.loads(answer.read())
    return data["events" if "events" in data else "locks"]  # type: ignore[no-any-return]


def _until(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


#: The rows of a table as the page shows them now, read in one step: the live part is
#: swapped in every second, so an element found earlier may be gone by the next call.
_ROWS = """
return Array.from(document.querySelectorAll(arguments[0])).map(function (r) {
  return {name: r.dataset.name, kind: r.dataset.kind, text: r.innerText};
});
"""


def _rows(browser: Any, selector: str) -> list[dict[str, str]]:
    return list(browser.execute_script(_ROWS, selector))


def _row(browser: Any, name: str) -> dict[str, str] | None:
    return next((r for r in _rows(browser, "#keys tbody tr") if r["name"] == name), None)


def _go(server: RedisServer, name: str) -> None:
    server.client(db=3).set(f"go:{name}", 1)


def test_the_overview_shows_the_workers_holds_and_a_release_within_two_seconds(
    browser: Any, board: str, server: RedisServer
) -> None:
    """A mutex held by one worker's run, two permits of a semaphore held by runs on the
    workers and a queued hold: one row each with the right holders; when the mutex's run
    ends, its row leaves the open page within 2 s, without a reload."""
    hold = boardapp.hold.delay("m")
    permits = [boardapp.permit.delay("s") for _ in range(2)]
    queued = boardapp.queued.apply_async(("q",), queue="parked")

    def ready() -> bool:
        objects = _api(board)
        names = [(o["name"], o["state"]) for o in objects]
        return (
            names.count(("sem:s", "running")) == 2
            and ("mutex:m", "running") in names
            and (
                "queued:q",
                "queued",
            )
            in names
        )

    _until("the workers hold the mutex and both permits", ready)
    browser.get(board + "/")
    browser.execute_script("window.__same_page = 1;")
    mutex = _row(browser, "mutex:m")
    assert mutex is not None and mutex["kind"] == "mutex"
    assert f"boardapp.hold[{hold.id}]" in mutex["text"]
    semaphore = _row(browser, "sem:s")
    assert semaphore is not None and semaphore["kind"] == "semaphore"
    assert all(f"[{p.id}]" in semaphore["text"] for p in permits)
    assert "semaphore 2/2" in semaphore["text"]  # 2 permits held of the task's lock_limit=2
    parked = _row(browser, "queued:q")
    assert parked is not None and parked["kind"] == "queued"
    assert f"[{queued.id}]" in parked["text"]

    _go(server, "m")
    released = time.monotonic()
    # the run ends within ~50 ms of the go; the page must show it within 2 s of the release
    _until("the mutex's row leaves the page", lambda: _row(browser, "mutex:m") is None, timeout=3.0)
    assert time.monotonic() - released < 2.5
    assert browser.execute_script("return window.__same_page;") == 1  # no reload
    assert _row(browser, "sem:s") is not None


def test_the_key_page_shows_the_runs_events_and_fences(
    browser: Any, board: str, server: RedisServer
) -> None:
    """The key page of the mutex lists the events its run recorded (acquired, released)
    with the run's task id and fence."""
    result = boardapp.hold.delay("ev")
    _until("the run holds mutex:ev", lambda: any(o["name"] == "mutex:ev" for o in _api(board)))
    _go(server, "ev")
    path = "/key/" + urllib.parse.quote("mutex:ev", safe="")

    def recorded() -> bool:
        events = _api(board, "/api/events?name=mutex%3Aev")
        return {"acquired", "released"} <= {e["kind"] for e in events}

    _until("the worker recorded its events", recorded)
    browser.get(board + path)

    events = _rows(browser, "#events tbody tr")
    assert [e["kind"] for e in events[:2]] == ["released", "acquired"]
    assert all(result.id in e["text"] for e in events[:2])
    fences = browser.execute_script("return document.querySelector('ol.fences').innerText;")
    assert result.id in fences


def test_an_action_with_the_token_releases_a_holder_and_without_it_is_refused(
    browser: Any, board: str, server: RedisServer
) -> None:
    """Signed in with the token, the release button and its confirmation release the
    run's lock; the same POST without the session cookie, or without the CSRF token, is
    refused with 403 and the lock stays; after sign-out the session's cookie is refused."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    run = boardapp.hold.delay("act")
    _until("the run holds mutex:act", lambda: any(o["name"] == "mutex:act" for o in _api(board)))
    path = "/key/" + urllib.parse.quote("mutex:act", safe="")
    browser.get(board + "/login?next=" + urllib.parse.quote(path))
    browser.find_element(By.NAME, "token").send_keys(SECRET)
    browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    _until("back on the key page", lambda: browser.current_url.endswith(path))
    fields = browser.execute_script(
        "var f = {}; document.querySelectorAll('#holders form.act input[type=hidden]')"
        ".forEach(function (i) { f[i.name] = i.value; }); return f;"
    )
    assert fields["verb"] == "release" and fields["csrf"]

    def post(data: dict[str, str], cookie: str | None) -> int:
        request = urllib.request.Request(
            board + "/action", data=urllib.parse.urlencode(data).encode(), method="POST"
        )
        if cookie:
            request.add_header("Cookie", cookie)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    session = browser.get_cookie("redlock_board")["value"]
    confirmed = {**fields, "confirmed": "yes"}
    assert post(confirmed, None) == 403
    assert (
        post({k: v for k, v in confirmed.items() if k != "csrf"}, f"redlock_board={session}") == 403
    )
    assert any(o["name"] == "mutex:act" for o in _api(board))

    browser.execute_script("document.querySelector('#holders form.act button').click();")
    _until("the confirmation page", lambda: "/action" in browser.current_url)
    question = browser.find_element(By.CSS_SELECTOR, "p.confirm").text
    assert "mutex:act" in question and run.id in question
    browser.find_element(By.ID, "confirm").click()
    _until("back on the key page", lambda: "done=" in browser.current_url)
    assert browser.find_element(By.CSS_SELECTOR, "p.done").text == DONE["released"]
    assert not any(o["name"] == "mutex:act" for o in _api(board))
    _go(server, "act")
    browser.find_element(By.ID, "signout").click()  # the session ends: its cookie is refused
    _until("signed out", lambda: browser.get_cookie("redlock_board") is None)
    assert post({**confirmed, "verb": "resume"}, f"redlock_board={session}") == 403


def test_a_script_in_a_lock_name_does_not_run(
    browser: Any, board: str, server: RedisServer
) -> None:
    """A lock whose name and holder record hold scripts shows them as text on the
    overview and its key page; none runs."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    name = "x:<script>window.__pwned=1</script>"
    owner = {"task_name": "<img src=x onerror='window.__pwned=2'>", "task_id": "t-1"}
    lock = Lock(server.client(db=1), name, 30, owner_info=owner, auto_renew=False)
    assert lock.acquire(blocking=False)
    try:
        browser.get(board + "/")
        _until("the row shows", lambda: _row(browser, name) is not None)
        assert name in (_row(browser, name) or {})["text"]
        assert browser.execute_script("return window.__pwned;") is None
        browser.get(board + "/key/" + urllib.parse.quote(name, safe=""))
        assert browser.find_element(By.CSS_SELECTOR, "h1.key").text == name
        holders = _rows(browser, "#holders tbody tr")
        assert "<img src=x" in holders[0]["text"]
        updated = "return document.getElementById('live').getAttribute('data-updated');"
        before = browser.execute_script(updated)
        _until(
            "the live part is swapped in again",
            lambda: browser.execute_script(updated) not in (None, before),
            timeout=5.0,
        )
        assert browser.execute_script("return window.__pwned;") is None
    finally:
        lock.release()


def _serve(app: Any, **kw: Any) -> tuple[str, Callable[[], None]]:
    """Another board of *app* on a free loopback port: its URL and its stop."""
    http = make_board_server(app, host="127.0.0.1", port=0, **kw)
    thread = threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()

    def stop() -> None:
        http.shutdown()
        http.server_close()
        thread.join(10)

    return f"http://127.0.0.1:{http.server_port}", stop


def _updates(browser: Any, n: int = 2) -> None:
    """Wait until the live part was updated *n* more times."""
    read = "return document.getElementById('live').getAttribute('data-updated');"
    for _ in range(n):
        before = browser.execute_script(read)
        _until(
            "the live part is updated",
            lambda b=before: browser.execute_script(read) not in (None, b),
            5.0,
        )


def test_the_timeline_draws_a_bar_for_each_run_that_happened(
    browser: Any, board: str, server: RedisServer
) -> None:
    """Two runs of the mutex, one after the other: the key page's and the overview's
    timelines each draw two "ran" bars titled with the runs' task ids and fences; the
    lane's label links to the key's page."""
    runs = []
    for _ in range(2):
        run = boardapp.hold.delay("tl")
        _until("the run holds mutex:tl", lambda: any(o["name"] == "mutex:tl" for o in _api(board)))
        _go(server, "tl")
        run.get(timeout=20)
        server.client(db=3).delete("go:tl")
        runs.append(run)

    def recorded() -> bool:
        events = _api(board, "/api/events?name=mutex%3Atl")
        return [e["kind"] for e in events].count("released") == 2

    _until("the worker recorded both runs", recorded)
    bars = (
        "return Array.from(document.querySelectorAll('#timeline rect.tl-bar')).map("
        "function (r) { return [r.getAttribute('class'), r.textContent]; });"
    )
    for path in ("/key/mutex%3Atl", "/?prefix=mutex%3Atl"):
        browser.get(board + path)
        drawn = browser.execute_script(bars)
        assert len(drawn) == 2, drawn
        assert all("tl-ran" in cls for cls, _ in drawn)
        for run in runs:
            assert any(run.id in title and "fence" in title for _, title in drawn)
    link = browser.execute_script(
        "return document.querySelector('#timeline svg a').getAttribute('href');"
    )
    assert link == "/key/mutex%3Atl"


def test_a_refresh_keeps_the_sideways_scroll_the_selection_and_unchanged_rows(
    browser: Any, board: str, server: RedisServer
) -> None:
    """On a phone-wide window the keys' table scrolls sideways: after refreshes, its
    scroll is where the user left it, the text selected in a row is still selected, and
    that row is the same element (updated in place, not replaced)."""
    owner = {"task_name": "boardapp." + "long_task_name_" * 8, "task_id": "t-scroll"}
    lock = Lock(server.client(db=1), "scroll:1", 60, owner_info=owner, auto_renew=False)
    assert lock.acquire(blocking=False)
    browser.set_window_size(420, 900)
    try:
        browser.get(board + "/?prefix=scroll%3A")
        _until("the row shows", lambda: _row(browser, "scroll:1") is not None)
        browser.execute_script(
            "var s = document.getElementById('keys').parentElement; s.scrollLeft = 120;"
            "var row = document.querySelector('#keys tr[data-name=\"scroll:1\"]');"
            "row.__mark = 'kept';"
            "var cell = row.querySelector('td[data-col=\"holder(s)\"]');"
            "var r = document.createRange(); r.selectNodeContents(cell);"
            "var sel = window.getSelection(); sel.removeAllRanges(); sel.addRange(r);"
        )
        scrolled = browser.execute_script(
            "return document.getElementById('keys').parentElement.scrollLeft;"
        )
        assert scrolled > 0  # the table is wider than the window
        selected = browser.execute_script("return window.getSelection().toString();")
        assert "t-scroll" in selected
        browser.execute_script("window.getSelection().removeAllRanges();")
        _updates(browser, 2)  # refreshes with no selection: the row is patched in place
        state = browser.execute_script(
            "var row = document.querySelector('#keys tr[data-name=\"scroll:1\"]');"
            "return [document.getElementById('keys').parentElement.scrollLeft, row.__mark];"
        )
        assert state == [scrolled, "kept"]
        browser.execute_script(
            'var cell = document.querySelector(\'#keys tr[data-name="scroll:1"] '
            'td[data-col="holder(s)"]\');'
            "var r = document.createRange(); r.selectNodeContents(cell);"
            "var sel = window.getSelection(); sel.removeAllRanges(); sel.addRange(r);"
        )
        time.sleep(0)  # let the page run its timers
        deadline = time.monotonic() + 2.5  # two refresh periods pass with the selection
        while time.monotonic() < deadline:
            assert "t-scroll" in browser.execute_script("return window.getSelection().toString();")
            time.sleep(0.1)
    finally:
        browser.execute_script("window.getSelection().removeAllRanges();")
        browser.set_window_size(1200, 900)
        lock.release()


def test_counts_paging_and_search_follow_the_filters(
    browser: Any, board: str, server: RedisServer
) -> None:
    """60 locks under one prefix: the counts say 60 mutexes, the first page shows 50 and
    links to the next, which shows the other 10; typing a longer prefix narrows the rows
    in place and the URL follows."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    client = server.client(db=1)
    locks = [Lock(client, f"pg:{i:02d}", 60, auto_renew=False) for i in range(60)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    try:
        browser.get(board + "/?prefix=pg%3A")
        count = "return document.querySelector('[data-count=\"mutex\"] b').textContent;"
        assert browser.execute_script(count) == "60"
        assert len(_rows(browser, "#keys tbody tr")) == 50
        assert "60 keys, 1-50 shown" in browser.find_element(By.CSS_SELECTOR, "p.count").text
        browser.find_element(By.CSS_SELECTOR, "a[rel=next]").click()
        _until("the second page", lambda: "offset=50" in browser.current_url)
        assert [r["name"] for r in _rows(browser, "#keys tbody tr")] == [
            f"pg:{i}" for i in range(50, 60)
        ]
        browser.get(board + "/?prefix=pg%3A")
        field = browser.find_element(By.NAME, "prefix")
        field.send_keys("5")
        _until(
            "the rows narrow to pg:5*",
            lambda: (
                [r["name"] for r in _rows(browser, "#keys tbody tr")]
                == [f"pg:{i}" for i in range(50, 60)]
            ),
            timeout=5.0,
        )
        assert "prefix=pg%3A5" in browser.current_url
        assert browser.execute_script(count) == "10"
    finally:
        for lock in locks:
            lock.release()


def test_signed_in_the_filtered_set_and_one_permit_are_released_then_sign_out(
    browser: Any, board: str, server: RedisServer
) -> None:
    """Signed in: "release what these filters match" lists the three bulk locks on its
    confirm page and releases them; a permit of the semaphore is released from its key's
    page, the other stays; sign-out ends the session (the actions' forms go)."""
    from selenium.webdriver.common.by import By  # noqa: PLC0415

    client = server.client(db=1)
    bulk = [Lock(client, f"bulk:{i}", 60, auto_renew=False) for i in range(3)]
    for lock in bulk:
        assert lock.acquire(blocking=False)
    permits = [boardapp.permit.delay("rel") for _ in range(2)]
    _until(
        "both permits held",
        lambda: [o["name"] for o in _api(board)].count("sem:rel") == 2,
    )
    try:
        browser.get(board + "/login?next=" + urllib.parse.quote("/?prefix=bulk%3A"))
        browser.find_element(By.NAME, "token").send_keys(SECRET)
        browser.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
        _until("back on the overview", lambda: "prefix=bulk" in browser.current_url)
        browser.find_element(By.ID, "release-set").click()
        _until("the confirm page", lambda: "/action" in browser.current_url)
        listed = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#to-release li")]
        assert listed == ["bulk:0", "bulk:1", "bulk:2"]
        browser.find_element(By.ID, "confirm").click()
        _until("back on the overview", lambda: "done=released-set" in browser.current_url)
        assert browser.find_element(By.CSS_SELECTOR, "p.done").text == DONE["released-set"]
        assert not any(lock.locked() for lock in bulk)

        browser.get(board + "/key/sem%3Arel")
        forms = browser.find_elements(By.CSS_SELECTOR, "#holders form.act")
        assert len(forms) == 2
        browser.execute_script("document.querySelector('#holders form.act button').click();")
        _until("the confirm page", lambda: "/action" in browser.current_url)
        assert "Release one permit" in browser.find_element(By.CSS_SELECTOR, "p.confirm").text
        browser.find_element(By.ID, "confirm").click()
        _until("back on the key page", lambda: "done=released" in browser.current_url)
        assert [o["name"] for o in _api(board)].count("sem:rel") == 1
        browser.find_element(By.ID, "signout").click()
        _until("signed out", lambda: browser.get_cookie("redlock_board") is None)
        browser.get(board + "/key/sem%3Arel")
        assert browser.find_elements(By.CSS_SELECTOR, "#holders form.act") == []
        assert "Sign in" in browser.find_element(By.CSS_SELECTOR, "p.signin").text
    finally:
        _go(server, "rel")
        for p in permits:
            p.get(timeout=30, propagate=False)


def test_the_pages_say_when_the_store_is_down_or_the_quorum_is_lost(browser: Any) -> None:
    """A board whose Redis stops says so on the open page within seconds (no reload), with
    the time of the store's last answer; when the board itself stops answering, the page
    says since when what it shows is old; a Redlock board with two of its three masters
    down says the quorum is lost."""
    from celery import Celery  # noqa: PLC0415
    from selenium.webdriver.common.by import By  # noqa: PLC0415
    from servers import free_port  # noqa: PLC0415

    alone = RedisServer.start()
    app = Celery("down", broker="memory://", set_as_current=False)
    app.conf.redlock_url = alone.url
    url, stop = _serve(app)
    try:
        browser.get(url + "/")
        assert browser.find_elements(By.CSS_SELECTOR, "p.unknown") == []
        alone.stop()
        _until(
            "the page says the store did not answer",
            lambda: (
                "did not answer"
                in " ".join(
                    p.text for p in browser.find_elements(By.CSS_SELECTOR, "#live p.unknown")
                )
            ),
            timeout=15.0,
        )
        notice = browser.find_element(By.CSS_SELECTOR, "#live p.unknown").text
        assert re.search(r"Last answer \d\d:\d\d:\d\d UTC, \d+ s ago", notice), notice
        stop()  # the board goes too: the open page says since when it shows old news
        _until(
            "the page says the board did not answer",
            lambda: (
                "last update"
                in " ".join(p.text for p in browser.find_elements(By.CSS_SELECTOR, "#stale-note"))
            ),
            timeout=15.0,
        )
    finally:
        stop()
        alone.stop()
    one = RedisServer.start()
    quorum = Celery("quorum", broker="memory://", set_as_current=False)
    quorum.conf.redlock_url = [one.url] + [f"redis://127.0.0.1:{free_port()}/0" for _ in range(2)]
    url, stop = _serve(quorum)
    try:
        browser.get(url + "/")
        notice = browser.find_element(By.CSS_SELECTOR, "#live p.unknown").text
        assert "quorum is lost" in notice and "1 of 3" in notice
    finally:
        stop()
        one.stop()
