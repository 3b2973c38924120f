"""Who may act on the board: tokens, sessions and their CSRF tokens.

A token is a secret with a name (the name goes in the log line of each action). The token
file holds one per line, ``name:secret`` or just ``secret`` (named ``token``); blank lines
and ``#`` comments are skipped. ``REDLOCK_BOARD_TOKEN`` holds one, in the same form.

A person pastes the secret into the page once (compared in constant time); the board
then starts a :class:`Session`: a random id (``secrets.token_urlsafe``) kept in the
board's memory with the token it was opened with, its own random CSRF token, and an
expiry (12 h by default). The cookie holds the id only, never the secret, so it differs
on every sign-in and on every board, and it ends at sign-out, at expiry or when the
board restarts. Each form that acts carries the session's CSRF token: a POST needs both,
so another site can neither forge one nor read the form's token.
"""

from __future__ import annotations

import hmac
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError

__all__ = ["ENV", "SESSION_TTL", "Session", "Sessions", "Token", "load_tokens"]

#: The environment variable holding a token.
ENV = "REDLOCK_BOARD_TOKEN"
#: The name of a token given without one.
DEFAULT_NAME = "token"
#: Shortest secret accepted: a guessable token would let anyone release locks.
MIN_SECRET = 16
#: How long a session lasts from its sign-in, in seconds.
SESSION_TTL = 12 * 3600.0
#: The most sessions a board keeps; the oldest goes first (each needs the secret).
MAX_SESSIONS = 10_000


@dataclass(frozen=True)
class Token:
    """A named secret."""

    name: str
    secret: str = ""

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"Token({self.name!r})"


@dataclass(frozen=True)
class Session:
    """One sign-in: its cookie value (*id*), the token it was opened with, the CSRF
    token of its forms and when it ends (``time.monotonic()``)."""

    id: str
    token: Token
    csrf: str
    expires: float

    def __repr__(self) -> str:  # never the id or the CSRF token
        return f"Session({self.token.name!r})"

    def csrf_ok(self, given: str) -> bool:
        """True when *given* is this session's CSRF token (constant time)."""
        return bool(given) and hmac.compare_digest(given.encode(), self.csrf.encode())


class Sessions:
    """The sessions of one board, in memory: opened at sign-in, ended at sign-out or
    after *ttl* seconds."""

    def __init__(self, ttl: float = SESSION_TTL) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < 10**9:
            raise ConfigError(f"session_ttl must be a number of seconds above 0, got {ttl!r}")
        self.ttl = float(ttl)
        self._lock = threading.Lock()
        self._open: OrderedDict[str, Session] = OrderedDict()

    def open(self, token: Token) -> Session:
        """A new session of *token*."""
        session = Session(
            secrets.token_urlsafe(32),
            token,
            secrets.token_urlsafe(32),
            time.monotonic() + self.ttl,
        )
        with self._lock:
            self._open[session.id] = session
            while len(self._open) > MAX_SESSIONS:
                self._open.popitem(last=False)
        return session

    def get(self, sid: str) -> Session | None:
        """The live session whose id is *sid*, or None (unknown, ended or expired)."""
        if not sid:
            return None
        now = time.monotonic()
        with self._lock:
            session = self._open.get(sid)
            if session is not None and session.expires <= now:
                del self._open[sid]
                session = None
        return session

    def end(self, sid: str) -> Session | None:
        """End session *sid*; the session ended, or None when there was none."""
        with self._lock:
            return self._open.pop(sid, None)


def parse_token(line: str, where: str) -> Token:
    """One ``name:secret`` (or ``secret``) line of *where* as a Token."""
    name, sep, secret = line.strip().rpartition(":")
    if not sep:
        name = DEFAULT_NAME
    name = name.strip() or DEFAULT_NAME
    secret = secret.strip()
    if len(secret) < MIN_SECRET:
        raise ConfigError(
            f"the board token {name!r} in {where} is too short ({len(secret)} characters): "
            f"use at least {MIN_SECRET} random characters, e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe())'`"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ConfigError(f"the board token's name {name!r} in {where} holds a control character")
    return Token(name, secret)


def load_tokens(token: Any = None, token_file: str | os.PathLike[str] | None = None) -> list[Token]:
    """The tokens that may act: *token* (a Token, or a ``name:secret`` text), the lines of
    *token_file*, else ``REDLOCK_BOARD_TOKEN``; empty when none is given."""
    if isinstance(token, Token):
        return [token]
    if isinstance(token, str):
        return [parse_token(token, "the token given")]
    if token is not None:
        raise ConfigError(
            f"token must be text (name:secret) or a Token, got {type(token).__name__}"
        )
    if token_file is not None:
        path = Path(token_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--token-file {str(path)!r}: cannot read it ({exc})") from None
        found = [
            parse_token(line, str(path))
            for line in lines
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if not found:
            raise ConfigError(f"--token-file {str(path)!r} holds no token (one name:secret a line)")
        return found
    env = os.environ.get(ENV, "").strip()
    return [parse_token(env, ENV)] if env else []


def pasted(tokens: list[Token], secret: str) -> Token | None:
    """The token whose secret is *secret* (pasted into the page), or None; every token
    is compared, each in constant time."""
    given = secret.strip().encode()
    found = None
    for token in tokens:
        if hmac.compare_digest(token.secret.encode(), given) and given:
            found = token
    return found
