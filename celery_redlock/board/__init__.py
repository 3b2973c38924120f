"""The lock board: ``celery -A proj locks serve``, or :func:`make_app` to mount it.

The board shows what ``celery locks list`` shows (the same reads, the same JSON), the
recent lock events of each key (:mod:`celery_redlock.app.event_log`), and with
``actions=True`` and a token offers the verbs of ``celery locks`` (release,
pause/resume, set/unset). See ``docs/board.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .auth import SESSION_TTL
from .wsgi import Board

__all__ = ["make_app"]


def make_app(
    app: Any,
    *,
    actions: bool = False,
    token: Any = None,
    allowed_hosts: Sequence[str] | None = None,
    secure_cookies: bool = False,
    session_ttl: float = SESSION_TTL,
) -> Any:
    """The board of Celery app *app* as a WSGI application.

    *actions*: offer release, pause/resume and set/unset (needs *token*: the text a
    person pastes into the page, or a :class:`~.auth.Token` with a name for the log).

    *allowed_hosts*: the ``Host`` names it answers (``name`` or ``name:port``), any
    other a 400; None (the default) checks none, since the site it is mounted in owns
    its Host handling (Django's ``ALLOWED_HOSTS``, a proxy's server names).

    *secure_cookies*: the session cookie is ``Secure`` on every answer (behind a proxy
    that ends TLS); it is anyway when the request came over https. *session_ttl*:
    seconds a sign-in lasts (12 h).
    """
    return Board(
        app,
        actions=actions,
        token=token,
        allowed_hosts=allowed_hosts,
        secure_cookies=secure_cookies,
        session_ttl=session_ttl,
    )
