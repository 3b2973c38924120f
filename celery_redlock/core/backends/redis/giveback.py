"""The give-backs of the Redis backend that did not get through at once: an acquire whose
outcome is unclear (no reply, or foreign data met after writing) is given back where it
ran, and when that give-back fails too (the server still does not answer), it is tried
once more a little later, from one thread per process (:func:`later`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from contextlib import suppress

from ... import process

__all__ = ["GIVE_BACK_AFTER", "GIVE_BACK_QUEUE", "GiveBacks", "later"]


class GiveBacks:
    """One thread per process for the give-backs that did not get through at once: each
    is tried again :data:`GIVE_BACK_AFTER` seconds later, in order, and dropped when it
    fails again (its lease ends by itself). At most :data:`GIVE_BACK_QUEUE` wait; more
    are dropped. One thread however many fail: a silent server delays the others, never
    multiplies threads."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[float, Callable[[], object]]] = queue.Queue(GIVE_BACK_QUEUE)
        self._started = False
        self._mutex = threading.Lock()

    def later(self, give_back: Callable[[], object]) -> None:
        """Queue *give_back* for its second try (the thread starts on first use)."""
        with self._mutex:
            if not self._started:
                self._started = True
                threading.Thread(
                    target=self._run, name="celery-redlock-giveback", daemon=True
                ).start()
        with suppress(queue.Full):
            self._queue.put_nowait((time.monotonic() + GIVE_BACK_AFTER, give_back))

    def _run(self) -> None:
        while True:
            when, give_back = self._queue.get()
            time.sleep(max(when - time.monotonic(), 0.0))
            with suppress(Exception):
                give_back()


#: How long after a failed give-back of an unclear acquire it is tried once more.
GIVE_BACK_AFTER = 0.5
#: Give-backs waiting for their second try at most (more are dropped).
GIVE_BACK_QUEUE = 256
_give_backs = GiveBacks()


@process.on_fork
def _new_give_backs() -> None:
    global _give_backs
    _give_backs = GiveBacks()  # the parent's thread does not exist in a child


def later(give_back: Callable[[], object]) -> None:
    """Try *give_back* once more :data:`GIVE_BACK_AFTER` seconds from now, on this
    process's give-back thread; dropped when it fails again (its lease ends by itself)."""
    _give_backs.later(give_back)
