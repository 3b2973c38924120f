"""Take the board's screenshots for the README and docs/board.md with a headless Chromium.

    PYTHONPATH=. .venv/bin/python tools/board_screenshot.py [--out docs/img]

No server is needed: the locks live in a ``memory://`` store of this process (a mutex held
by a task's run, two permits of a semaphore, a queued hold, a rate limiter, a pause), the
board is served on a free loopback port, and Chromium (``apt-get install chromium
chromium-driver``) takes ``board.png`` (the overview) and ``board-key-dark.png`` (a key's
page in dark mode).
"""

from __future__ import annotations

import argparse
import shutil
import sys
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
from celery_redlock.app.event_log import flush  # noqa: E402
from celery_redlock.board.serve import make_board_server  # noqa: E402

URL = "memory://board-screenshot"


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
    kept = _locks(app)
    server = make_board_server(app, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(arg)
    options.add_argument("--window-size=1240,600")
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        driver.get(base + "/")
        time.sleep(0.5)  # the web font-free page is drawn at once; this lets the clock tick
        driver.save_screenshot(str(out / "board.png"))
        driver.execute_cdp_cmd(
            "Emulation.setEmulatedMedia",
            {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
        )
        driver.set_window_size(820, 900)
        driver.get(base + "/key/sync%3Aaccount%3A7")
        time.sleep(0.5)
        driver.save_screenshot(str(out / "board-key-dark.png"))
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()
        thread.join(10)
    print(f"wrote {out / 'board.png'} and {out / 'board-key-dark.png'} ({len(kept)} holds shown)")


if __name__ == "__main__":
    main()
