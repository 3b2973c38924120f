"""``celery -A proj locks serve``: the board on the standard library's WSGI server, one
thread per request, until SIGINT or SIGTERM.

Stopping takes well under a second, whatever the clients do: the signal handler only
asks a short thread to stop the serving loop (``shutdown()`` waits for the loop, so the
handler, which runs in the loop's thread, must not call it itself); then the listening
socket is closed, every connection still open (a browser's idle keep-alive or
pre-connected socket, a client that sent half a request) is shut down so its thread's
read returns, those threads get a short grace to finish, and the store's connections are
closed. Each connection also has a read timeout, so a silent client never holds a
thread for long while the board runs.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from socketserver import ThreadingMixIn
from types import FrameType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ..core.errors import ConfigError
from .auth import ENV, load_tokens
from .http import HostCheck, loopback
from .wsgi import Board

__all__ = ["loopback", "make_board_server", "serve_board", "show_log"]

log = logging.getLogger("celery_redlock.board")

#: Seconds a connection may stay silent before the board drops it.
READ_TIMEOUT = 10.0
#: Seconds the requests still running get to finish once the board stops.
GRACE = 0.3


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per connection; remembers the open ones so that stopping can end them."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open: dict[socket.socket, threading.Thread | None] = {}
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open[request] = None
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            if request in self._open:
                self._open[request] = threading.current_thread()
        super().process_request_thread(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer (or any error of the connection): one line
        at DEBUG, no traceback on the terminal."""
        error = sys.exc_info()[1]
        log.debug("celery-redlock board: connection from %s: %r", client_address[0], error)

    def end_connections(self, grace: float = GRACE) -> None:
        """Shut every open connection down (a blocked read returns at once), then wait
        up to *grace* seconds for their threads."""
        with self._open_lock:
            connections = list(self._open.items())
        for sock, _ in connections:
            with contextlib.suppress(OSError):  # closed meanwhile, or never connected
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + grace
        for _, thread in connections:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))


class _Quiet(WSGIRequestHandler):
    """Requests logged at DEBUG on ``celery_redlock.board`` (the page asks every second);
    a connection silent for :data:`READ_TIMEOUT` seconds is dropped."""

    timeout = READ_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def make_board_server(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 5566,
    actions: bool = False,
    token_file: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    allowed_hosts: Sequence[str] = (),
    secure_cookies: bool = False,
) -> WSGIServer:
    """A server of *app*'s board, bound and ready for ``serve_forever()``. ConfigError when
    a non-loopback *host* has no token, or actions have none. It answers requests whose
    ``Host`` is the address it is bound to (``localhost`` forms too on loopback) or one
    of *allowed_hosts* (the name a reverse proxy sends)."""
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
    HostCheck(list(allowed_hosts))  # a bad --allowed-host is refused before binding
    board = Board(
        app,
        actions=actions,
        token_file=token_file,
        overrides=overrides,
        private=not loopback(host),
        secure_cookies=secure_cookies,
    )
    try:
        server = make_server(host, port, board, server_class=_Server, handler_class=_Quiet)
    except (OSError, socket.gaierror) as exc:
        raise ConfigError(f"cannot serve the board on {host}:{port}: {exc}") from None
    bound = str(server.server_address[0])
    board.hosts = HostCheck.served(bound, server.server_port, list(allowed_hosts))
    return server


def show_log(level: str | int = "INFO") -> logging.Handler:
    """Print ``celery_redlock.board``'s lines at *level* and above on stderr (sign-ins,
    sign-outs and actions are INFO): the handler added."""
    if isinstance(level, str):
        value = logging.getLevelName(level.strip().upper())
        if not isinstance(value, int):
            raise ConfigError(
                f"--loglevel {level!r} is not a level: one of DEBUG, INFO, WARNING, ERROR"
            )
        level = value
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s] %(message)s"))
    handler.setLevel(level)
    log.addHandler(handler)
    log.setLevel(level)
    return handler


def serve_board(server: WSGIServer, *, echo: Callable[[str], object] = print) -> None:
    """Serve the board of *server* (:func:`make_board_server`) until SIGINT or SIGTERM
    (or KeyboardInterrupt), then stop it: see the module's doc."""
    host, port = str(server.server_address[0]), server.server_address[1]
    board = server.get_app()
    shown = f"[{host}]" if ":" in host else host
    where = f"http://{shown}:{port}/"
    mode = "actions on" if isinstance(board, Board) and board.actions else "read-only"
    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, name="celery-redlock-board-stop").start()

    previous = _on_signals(stop)
    echo(f"celery-redlock board on {where} ({mode})")
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:  # a signal handler other than ours (not the main thread)
        pass
    finally:
        _restore(previous)
        server.server_close()
        if isinstance(server, _Server):
            server.end_connections()
        if isinstance(board, Board):
            board.close()
        log.debug("celery-redlock board on %s stopped", where)


def _on_signals(handler: Callable[[int, FrameType | None], None]) -> dict[int, Any]:
    """Install *handler* for SIGINT and SIGTERM (from the main thread only): the previous
    handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
