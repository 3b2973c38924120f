"""Who may act on the board: tokens, the session cookie and the CSRF token.

A token is a secret with a name (the name goes in the log line of each action). The token
file holds one per line, ``name:secret`` or just ``secret`` (named ``token``); blank lines
and ``#`` comments are skipped. ``REDLOCK_BOARD_TOKEN`` holds one, in the same form.

A person pastes the secret into the page once; the board then sets a session cookie
(``HttpOnly``, ``SameSite=Strict``) holding the token's name and an HMAC of the secret,
never the secret itself. Each action form carries a CSRF token, an HMAC of that session:
a POST needs both, so another site can neither forge one nor read the form's token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError

__all__ = ["ENV", "Token", "load_tokens"]

#: The environment variable holding a token.
ENV = "REDLOCK_BOARD_TOKEN"
#: The name of a token given without one.
DEFAULT_NAME = "token"
#: Shortest secret accepted: a guessable token would let anyone release locks.
MIN_SECRET = 16


@dataclass(frozen=True)
class Token:
    """A named secret."""

    name: str
    secret: str = ""

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"Token({self.name!r})"

    def session(self) -> str:
        """The session cookie's value for this token."""
        return f"{self.name}:{self._mac('session')}"

    def csrf(self, session: str) -> str:
        """The CSRF token of the forms shown to *session*."""
        return self._mac("csrf:" + session)

    def _mac(self, what: str) -> str:
        return hmac.new(self.secret.encode(), what.encode(), hashlib.sha256).hexdigest()


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


def token_of(tokens: list[Token], session: str) -> Token | None:
    """The token whose session cookie is *session*, or None."""
    for token in tokens:
        if session and hmac.compare_digest(token.session(), session):
            return token
    return None


def pasted(tokens: list[Token], secret: str) -> Token | None:
    """The token whose secret is *secret* (pasted into the page), or None."""
    for token in tokens:
        if secret and hmac.compare_digest(token.secret.encode(), secret.strip().encode()):
            return token
    return None
