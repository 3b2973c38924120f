"""Take the board's screenshots for the README and docs/board.md with a headless Chromium.

    PYTHONPATH=. .venv/bin/python tools/board_screenshot.py [--out docs/img]

No server is needed: the locks live in a ``memory://`` store of this process (a mutex held
by a task's run, two permits of a semaphore, a queued hold, a rate limiter, a pause), the
board is served on a free loopback port, and Chromium (``apt-get install chromium
chromium-driver``) takes ``board.png`` (the overview and its timeline),
``board-timeline.png`` (that timeline alone), ``board-key-dark.png`` (a key's page in
dark mode), ``board-phone.png`` (the overview on a phone-wide window) and
``board-release-set.png`` (the confirm page of a release of what the filters match,
signed in). The timeline's earlier runs are made-up events written to
the event log (runs of minutes would take minutes); the held locks are real.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from celery import Celery

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celery_redlock import (  # noqa: E402 - after the path of this checkout
    Limit,
    Lock,
    LockedTask,
    QueuedHold,
    Rate,
    RateLimiter,
    Semaphore,
    connect,
    control,
    install,
)
from celery_redlock.app.event_log import LOG_TTL_MS, MAXLEN, flush, log_key  # noqa: E402
from celery_redlock.board.serve import make_board_server  # noqa: E402
from celery_redlock.core import open_backend  # noqa: E402
from celery_redlock.core.backend import EventLog, need  # noqa: E402

URL = "memory://board-screenshot"
SECRET = "screenshot-token-0123456789"


def _history() -> None:
    """The last minutes of runs, as workers would have logged them (oldest first)."""
    now = time.time()
    rng = random.Random(47)
    fence = 1796192303390000
    events: list[dict[str, object]] = []

    def run(name: str, start: float, held: float, waited: float = 0.0, **end: object) -> None:
        nonlocal fence
        fence += rng.randint(1, 40)
        tid = f"{rng.getrandbits(32):08x}"
        task = name.split(":", maxsplit=1)[0] + ".run"
        common = {"name": name, "fence": fence, "task_id": tid, "task_name": task, "pid": 4121}
        common["hostname"] = "w1@host"
        events.append({**common, "kind": "acquired", "at": now - start, "waited": waited})
        kind = str(end.pop("kind", "released"))
        events.append({**common, "kind": kind, "at": now - start + held, "held": held, **end})

    t = 290.0
    while t > 20:  # a steady job, one run after another
        run("sync:account:42", t, 18 + rng.random() * 10)
        t -= 35
    for t in (280, 200, 120, 40):  # the nightly report, and the calls skipped meanwhile
        run("report:daily", t, 25)
        events.append({"kind": "contended", "name": "report:daily", "at": now - t + 10,
                       "task_id": "skipped", "policy": "skip"})  # fmt: skip
    for lane, t in enumerate(range(260, 30, -46)):  # two permits of a semaphore
        run("imports:acme", t, 30, waited=6.0 if lane % 2 else 0.0)
        run("imports:acme", t - 8, 34, waited=9.0)
    run("export:user:7", 150, 40, kind="lost", error="lease expired: worker SIGKILLed")
    run("export:user:7", 105, 20, waited=2)
    run("partner:acme", 90, 12, kind="forced", error="released by operator 'ops'")
    for t in (70, 66, 61):
        events.append({"kind": "contended", "name": "partner:acme", "at": now - t,
                       "task_id": f"r{t}", "policy": "retry", "retry_after": 30})  # fmt: skip
    events.sort(key=lambda e: float(e["at"]))  # type: ignore[arg-type]
    log = need(open_backend(connect(URL)), EventLog)
    log.log_events(log_key("redlock:"), [json.dumps(e) for e in events], MAXLEN, LOG_TTL_MS)


def _shot(driver: object, url: str | None, path: Path, width: int, tallest: int = 1400) -> None:
    """Open *url* (None: the page shown) at *width* px and save it, the window as tall as
    the page (at most *tallest*), as a PNG of at most 256 colours when Pillow is there
    (small files for the docs)."""
    driver.set_window_size(width, 600)  # type: ignore[attr-defined]
    if url is not None:
        driver.get(url)  # type: ignore[attr-defined]
    time.sleep(0.3)
    height = driver.execute_script("return document.documentElement.scrollHeight;")  # type: ignore[attr-defined]
    driver.set_window_size(width, min(int(height) + 20, tallest))  # type: ignore[attr-defined]
    time.sleep(0.3)
    driver.save_screenshot(str(path))  # type: ignore[attr-defined]
    _small(path)


def _small(path: Path) -> None:
    """*path* as a PNG of at most 256 colours, when Pillow is there."""
    try:
        from PIL import Image  # noqa: PLC0415 - optional: only makes the files smaller
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(256)
    small.save(path, optimize=True)


def _locks(app: Celery) -> list[object]:
    """What the screenshot shows; the objects are kept so nothing is released early."""
    store = connect(URL)

    def owner(task: str, tid: str, host: str, pid: int) -> dict[str, object]:
        return {"task_name": task, "task_id": tid, "hostname": host, "pid": pid}

    kept: list[object] = []
    sync = Lock(
        store, "sync:account:42", 60, owner_info=owner("billing.sync", "5f1c2a9e", "worker-1", 4121)
    )
    report = Lock(
        store, "report:daily", 600, owner_info=owner("reports.daily", "9b77e0d4", "worker-2", 3310)
    )
    for lock in (sync, report):
        lock.acquire()
        kept.append(lock)
    for n, (host, pid) in enumerate((("worker-1", 4122), ("worker-2", 3311))):
        permit = Semaphore(
            store, "imports:acme", 3, 120, owner_info=owner("imports.run", f"c0ffee0{n}", host, pid)
        )
        permit.acquire()
        kept.append(permit)
    hold = QueuedHold(store, "export:user:7", owner_info={"task_name": "exports.user"})
    hold.claim("e1a2b3c4", 300)
    limiter = RateLimiter(store, "partner:acme", "60/h", burst=5)
    for _ in range(3):
        limiter.acquire(blocking=False)
    control(app).pause("partner:acme", 900, reason="429 from acme")
    control(app).set_limit("imports:acme", 2)

    @app.task(base=LockedTask, lock_key="sync:account:<n>", lock_on_contended="skip")
    def sync_account(n: int) -> int:
        return n

    @app.task(
        base=LockedTask,
        name="imports.run",
        lock_key="import:<account>",
        lock_limits=[Limit("imports:<partner>", 3), Rate("partner:<partner>", "60/h", burst=5)],
    )
    def import_run(account: int, partner: str) -> None: ...

    for _ in range(2):
        sync_account.apply((7,))
    flush()
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = parser.parse_args()
    from selenium import webdriver  # noqa: PLC0415 - the test extra's
    from selenium.webdriver.chrome.service import Service  # noqa: PLC0415

    binary = shutil.which("chromium") or shutil.which("google-chrome")
    driver_path = shutil.which("chromedriver")
    if not binary or not driver_path:
        sys.exit("no Chromium: apt-get install chromium chromium-driver")
    app = Celery("proj", broker="memory://", set_as_current=False)
    app.conf.redlock_url = URL
    install(app)
    _history()
    kept = _locks(app)
    tokens = Path(tempfile.mkdtemp()) / "tokens"
    tokens.write_text(f"ops:{SECRET}\n")
    server = make_board_server(app, host="127.0.0.1", port=0, actions=True, token_file=str(tokens))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(arg)
    options.add_argument("--window-size=1240,600")
    options.add_argument("--force-device-scale-factor=1")
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from selenium.webdriver.common.by import By  # noqa: PLC0415

        base = f"http://127.0.0.1:{server.server_port}"
        _shot(driver, base + "/", out / "board.png", 1240)
        driver.find_element(By.ID, "timeline").screenshot(str(out / "board-timeline.png"))
        _small(out / "board-timeline.png")
        driver.get(base + "/login?next=%2F")
        driver.find_element(By.NAME, "token").send_keys(SECRET)
        driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
        time.sleep(0.5)
        driver.find_element(By.ID, "release-set").click()
        time.sleep(0.3)
        _shot(driver, None, out / "board-release-set.png", 900)
        driver.execute_cdp_cmd(
            "Emulation.setEmulatedMedia",
            {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
        )
        _shot(driver, base + "/key/imports%3Aacme", out / "board-key-dark.png", 820)
        _shot(driver, base + "/", out / "board-phone.png", 390)
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()
        thread.join(10)
    print(f"wrote 5 screenshots to {out} ({len(kept)} holds shown)")


if __name__ == "__main__":
    main()
