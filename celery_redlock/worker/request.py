"""``LockedRequest``: the worker's request of a locked task (``LockedTask.Request``).

Celery makes it in the worker's main process only, by the import path the task class
names, so a process that only publishes never imports Celery's worker request.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from celery.exceptions import WorkerLostError
from celery.worker.request import Request

from ..task.contention import Skipped
from . import child_watch
from .bootstep import gone_child_handled, installed_state, key_headers, release_for_gone_child

__all__ = ["LockedRequest"]

log = logging.getLogger("celery_redlock.release")


class LockedRequest(Request):  # type: ignore[misc]  # celery is untyped
    """The worker's request of a locked task (``LockedTask.Request``): it tells the release
    of a run whose child is gone whether the message comes back, and ends a skipped run
    (:class:`~celery_redlock.task.contention.Skipped`) with Celery's ``task-succeeded``.

    In the worker's main process, Celery requeues the message of a lost child
    (``acks_late`` with ``task_reject_on_worker_lost``) or of a hard time limit
    (``acks_late`` with ``task_acks_on_timeout=False``) without any signal. This request
    sees the requeue (:meth:`reject`), and :func:`release_for_gone_child` then keeps the
    run's lock for the redelivered copy (``lock_on="enqueue"`` or ``"enqueue+run"``)
    instead of freeing the key. A task class with a ``Request`` of its own derives it from
    this one to keep that; otherwise the ``task_failure`` receiver frees the key when the
    message does not come back, and a requeued run's key waits for its lease.
    """

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        """Celery's handling, then the release of a lost child's run (requeued or not), or
        Celery's ``task-succeeded`` for a skipped run (:class:`Skipped`: its result is
        stored, and Celery sends no event for an ``Ignore``)."""
        self._redlock_requeued = False
        with gone_child_handled(self.id):
            super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        exc = getattr(exc_info, "exception", None)
        if isinstance(exc, ExceptionWithTraceback):  # how billiard hands a child's error over
            exc = exc.exc
        if isinstance(exc, Skipped):
            self.send_event("task-succeeded", result=exc.shown)
            return
        if isinstance(exc, (WorkerLostError, SystemExit, KeyboardInterrupt)):
            self._release_gone(type(exc).__name__)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """Celery's handling, then (a hard limit) the release of the run being killed."""
        self._redlock_requeued = False
        with gone_child_handled(self.id):
            super().on_timeout(soft, timeout)
        if not soft:
            self._release_gone("TimeLimitExceeded")

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        """Celery's handling; then, on a pool whose tasks run in child processes (prefork),
        the child running a locked task is watched, so that its lock is released (or kept
        for a requeued message) as soon as it exits, whether or not Celery notices at once
        (see :mod:`celery_redlock.worker.child_watch`).

        Other pools pass something else as *pid* (gevent and eventlet: the id of a green
        thread; threads and solo: the worker's own pid): the bootstep learnt the pool from
        its class (``state.pool``), and only a pool with children is watched. The message is
        acknowledged by now (unless ``acks_late``): an error in this bookkeeping is logged
        and the run goes on, never dropped with it.
        """
        super().on_accepted(pid, time_accepted)
        try:
            state = installed_state(self.task)
            pool = state.pool if state is not None else None
            if pool is not None and pool.children and isinstance(pid, int):
                child_watch.watch(pid, functools.partial(self._child_exited, pid))
        except Exception:
            log.exception(
                "task %s[%s]: could not watch pool child %r; the run goes on, and a lock "
                "its child leaves behind is freed when Celery reports the child lost, or "
                "expires within its TTL",
                getattr(self.task, "name", "?"),
                self.id,
                pid,
            )

    def _child_exited(self, pid: int) -> None:
        """In the watcher thread: the child that ran this request exited. If the run still
        holds its lock (its record names this task id and that pid), it is released, or
        kept when the message will be requeued (``acks_late`` with
        ``reject_on_worker_lost``, as Celery decides for a lost child)."""
        task = self.task
        comes_back = bool(task.acks_late and task.reject_on_worker_lost)
        release_for_gone_child(
            task,
            self.id,
            self.args,
            self.kwargs,
            key_headers(self),
            why=f"its pool child {pid} exited",
            comes_back=comes_back,
            early=True,
        )

    def reject(self, requeue: bool = False) -> None:
        """Reject the message; remember whether it comes back."""
        if requeue:
            self._redlock_requeued = True
        super().reject(requeue=requeue)

    def _release_gone(self, why: str) -> None:
        task = self.task
        if installed_state(task) is None:
            return
        if self._redlock_requeued:
            why = f"{why}, message requeued"
        headers = key_headers(self)
        comes_back = self._redlock_requeued
        release_for_gone_child(
            task, self.id, self.args, self.kwargs, headers, why=why, comes_back=comes_back
        )
