"""The lock board: ``celery -A proj locks serve``, or :func:`make_app` to mount it.

The board shows what ``celery locks list`` shows (the same reads, the same JSON), the
recent lock events of each key (:mod:`celery_redlock.app.event_log`), and with
``actions=True`` and a token offers the verbs of ``celery locks`` (release,
pause/resume, set/unset). See ``docs/board.md``.
"""

from __future__ import annotations

from typing import Any

from .wsgi import Board

__all__ = ["make_app"]


def make_app(app: Any, *, actions: bool = False, token: Any = None) -> Any:
    """The board of Celery app *app* as a WSGI application.

    *actions*: offer release, pause/resume and set/unset (needs *token*: the text a
    person pastes into the page, or a :class:`~.auth.Token` with a name for the log).
    """
    return Board(app, actions=actions, token=token)
