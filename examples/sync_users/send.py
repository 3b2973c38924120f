"""Publish nine syncs for three users at once and show when each ran (``python send.py``).

Runs for one user never overlap (each waits its turn, re-queued with backoff while the
user's key is held); runs for different users do.
"""

from __future__ import annotations

from tasks import sync_user


def main() -> None:
    results = [sync_user.delay(user_id) for _ in range(3) for user_id in (1, 2, 3)]
    runs = [r.get(timeout=120) for r in results]
    first = min(run["started"] for run in runs)
    for run in sorted(runs, key=lambda r: (r["user_id"], r["started"])):
        print(
            f"user {run['user_id']}: {run['started'] - first:5.2f}s -> "
            f"{run['finished'] - first:5.2f}s  fence {run['fence']}  on {run['worker']}"
        )


if __name__ == "__main__":
    main()
