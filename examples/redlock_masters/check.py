"""Take a Redlock over the masters in ``REDLOCK_URLS`` and show what each one holds.

``python check.py`` prints the fence, how long the lock is valid, which masters
granted it, and that a second owner is refused while it is held. With a majority of
the masters down it exits with status 3 and the ``QuorumUnavailable`` message.
"""

from __future__ import annotations

import sys
import time

from tasks import URLS

from celery_redlock import QuorumUnavailable, Redlock, connect


def main() -> int:
    clients = connect(URLS)
    first = Redlock(clients, "report:2026-11", ttl=10)
    try:
        if not first.acquire(blocking=False):
            print("report:2026-11 is already held; try again")
            return 1
    except QuorumUnavailable as exc:
        print(f"no quorum: {exc}")
        return 3
    down: list[str] = []
    try:
        left = first.valid_until - time.monotonic()
        print(f"acquired report:2026-11 on a majority of {len(URLS)} masters")
        print(f"  fence {first.fence}, valid for {left:.2f} s more")
        for url, client in zip(URLS, clients, strict=True):
            try:
                held = any(
                    True for _ in client.scan_iter(match="redlock:{report:2026-11}", count=100)
                )
                print(f"  {url}: {'holds it' if held else 'does not hold it'}")
            except Exception as exc:  # a master that is down: the quorum did without it
                print(f"  {url}: unreachable ({type(exc).__name__})")
                down.append(url)
        second = Redlock(clients, "report:2026-11", ttl=10)
        print(f"a second owner gets it too? {second.acquire(blocking=False)}")
    finally:
        first.release()
    if down:
        print(
            f"released on the masters that answered; {len(down)} unreachable: whatever it "
            "holds there expires within the 10 s lease"
        )
    else:
        print("released on every master")
    return 0


if __name__ == "__main__":
    sys.exit(main())
