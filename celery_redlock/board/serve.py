"""``celery -A proj locks serve``: the board on the standard library's WSGI server, one
thread per request, until interrupted."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..core.errors import ConfigError
from .auth import ENV, load_tokens
from .wsgi import Board

__all__ = ["loopback", "make_board_server", "serve_board"]

log = logging.getLogger("celery_redlock.board")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Quiet(WSGIRequestHandler):
    """Requests logged at DEBUG on ``celery_redlock.board`` (the page asks every second)."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def loopback(host: str) -> bool:
    """True when *host* reaches only this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_board_server(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 5566,
    actions: bool = False,
    token_file: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> WSGIServer:
    """A server of *app*'s board, bound and ready for ``serve_forever()``. ConfigError when
    a non-loopback *host* has no token, or actions have none."""
    tokens = load_tokens(None, token_file)
    if not loopback(host) and not tokens:
        raise ConfigError(
            f"the board would serve every lock of this app to anyone who can reach {host}: "
            f"on an address other than loopback it needs a token (--token-file PATH or "
            f"{ENV}), or serve on 127.0.0.1 behind your own proxy"
        )
    if actions and not tokens:
        raise ConfigError(
            f"--actions needs a token: --token-file PATH, or {ENV}=name:secret (the secret "
            "16 characters or more)"
        )
    board = Board(
        app,
        actions=actions,
        token_file=token_file,
        overrides=overrides,
        private=not loopback(host),
    )
    try:
        return make_server(host, port, board, server_class=_Server, handler_class=_Quiet)
    except (OSError, socket.gaierror) as exc:
        raise ConfigError(f"cannot serve the board on {host}:{port}: {exc}") from None


def serve_board(server: WSGIServer, *, echo: Callable[[str], object] = print) -> None:
    """Serve the board of *server* (:func:`make_board_server`) until interrupted, then
    close it."""
    host, port = str(server.server_address[0]), server.server_address[1]
    board = server.get_app()
    shown = f"[{host}]" if ":" in host else host
    where = f"http://{shown}:{port}/"
    mode = "actions on" if isinstance(board, Board) and board.actions else "read-only"
    echo(f"celery-redlock board on {where} ({mode})")
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
