"""What the board checks of a request and of its own answers, before any page is made:
the ``Host`` a request names, the values a client sends (query and form), the target of
a redirect and every header value written.

A request turned down is an :class:`HttpError` (an HTTP status and a one-line reason for the
client), never an exception of Python that would turn into a 500 and a traceback.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ..app.checks import parse_duration
from ..core.errors import ConfigError

__all__ = [
    "MAX_SECONDS",
    "HostCheck",
    "HttpError",
    "bad",
    "duration",
    "headers",
    "local_path",
    "loopback",
    "whole",
]

#: The longest pause or override the board sets: a year (a longer one is a typo).
MAX_SECONDS = 366 * 86400.0
#: ASCII digits only: ``str.isdigit()`` also takes "²" and "٣", which ``int()`` refuses.
_DIGITS = re.compile(r"[0-9]{1,19}")
#: A control character (C0, DEL, C1): never in a header, a redirect or a query value.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class HttpError(Exception):
    """A request the board answers with *status* and a one-line *text*, nothing done."""

    def __init__(self, status: str, text: str) -> None:
        super().__init__(text)
        self.status = status


def bad(text: str) -> HttpError:
    """A 400 saying *text*."""
    return HttpError("400 Bad Request", text)


# -- values a client sends ------------------------------------------------------------------------
def whole(
    value: str | None, what: str, *, low: int = 0, high: int, default: int | None = None
) -> int:
    """*value* as a whole number in [*low*, *high*] (ASCII digits only), *default* when
    it is empty; a 400 naming *what* otherwise."""
    text = (value or "").strip()
    if not text and default is not None:
        return default
    if not _DIGITS.fullmatch(text) or not low <= int(text) <= high:
        raise bad(f"{what} must be a whole number from {low} to {high}, got {_shown(text)}")
    return int(text)


def duration(value: str | None, what: str = "for") -> float | None:
    """*value* as seconds (``90s``, ``10m``, ``2h``, ``1d``), at most :data:`MAX_SECONDS`;
    None when it is empty; a 400 naming *what* otherwise."""
    text = (value or "").strip()
    if not text:
        return None
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise bad(f"{what} {_shown(text)} {exc}") from None
    if not math.isfinite(seconds) or seconds > MAX_SECONDS:
        raise bad(f"{what} {_shown(text)} is longer than a year: give at most 366d")
    return seconds


def _shown(text: str) -> str:
    """*text* for an error line: its repr, cut short."""
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def local_path(target: str | None, base: str) -> str:
    """*target* when it is a path of this board (``base + "/..."``: one leading slash,
    no backslash, no scheme or host, no control character); else the board's home."""
    home = base + "/"
    text = target or ""
    # One leading slash: "//host" and "/\\host" are another site's address to a browser,
    # and a path (never "scheme:...") cannot name another site.
    if not text.startswith(home) or text.startswith("//") or "\\" in text:
        return home
    return home if _CONTROL.search(text) else text


# -- what the board writes ------------------------------------------------------------------------
def headers(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """*pairs* as the answer's headers; ValueError for a name or value holding a control
    character (a CR or LF would end the header and start one of the client's)."""
    out = []
    for name, value in pairs:
        if _CONTROL.search(name) or _CONTROL.search(value) or not name:
            raise ValueError(f"header {name!r} holds a control character: not sent")
        out.append((name, value))
    return out


# -- the Host a request names ----------------------------------------------------------------------
class HostCheck:
    """The ``Host`` names a board answers to: *allowed* entries (``name`` for any port,
    ``name:port`` for one), case-insensitive. A request naming another host is refused
    (400): a page of another site that rebinds its name to this address (DNS
    rebinding) names its own host, so it cannot read the board.

    *any_address_on*: a port on which any IP address is the machine's own (a wildcard
    bind): an address is no rebinding, which needs a host name the attacker owns."""

    def __init__(self, allowed: Sequence[str], any_address_on: int | None = None) -> None:
        self.any_port: set[str] = set()
        self.exact: set[tuple[str, int]] = set()
        self.any_address_on = any_address_on
        for entry in allowed:
            host, port = _split(str(entry))
            if not host:
                raise ConfigError(
                    f"allowed host {entry!r} is not a host name: give NAME or NAME:PORT "
                    "(the Host header your proxy sends, e.g. board.example.com)"
                )
            if port is None:
                self.any_port.add(host)
            else:
                self.exact.add((host, port))

    @classmethod
    def served(cls, host: str, port: int, extra: Sequence[str] = ()) -> HostCheck:
        """The names of a board served on *host*:*port*: that address, its
        ``localhost``/``127.0.0.1``/``[::1]`` forms on a loopback, the machine's names
        and addresses on a wildcard bind (``0.0.0.0``, ``::``), and *extra*
        (``--allowed-host``)."""
        names = {host.lower()}
        wildcard = not host or _unspecified(host)
        if wildcard or loopback(host):
            names |= {"localhost", "127.0.0.1", "::1"}
        if wildcard:
            import socket  # noqa: PLC0415 - only a wildcard bind asks the machine's names

            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        served = [f"[{n}]:{port}" if ":" in n else f"{n}:{port}" for n in names if n]
        return cls([*served, *extra], any_address_on=port if wildcard else None)

    def allows(self, environ: dict[str, Any]) -> bool:
        """True when *environ*'s ``Host`` (else ``SERVER_NAME``) is one of these."""
        given = environ.get("HTTP_HOST")
        if given is None:
            given = f"{environ.get('SERVER_NAME', '')}:{environ.get('SERVER_PORT', '')}"
        host, port = _split(str(given))
        if not host:
            return False
        if port is None:
            port = 443 if environ.get("wsgi.url_scheme") == "https" else 80
        if host in self.any_port or (host, port) in self.exact:
            return True
        return self.any_address_on == port and _address(host)


def _split(text: str) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port`` too) as (lower-case host, port or None); ("", None)
    when it is not one."""
    text = text.strip().lower()
    if text.count(":") > 1 and not text.startswith("["):  # a bare IPv6 address
        text = f"[{text}]"
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        ok = bool(sep) and _address(host) and (not rest or rest.startswith(":"))
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
        ok = bool(host)
    if not ok or _CONTROL.search(text):
        return "", None
    if not port_text:
        return host, None
    if not _DIGITS.fullmatch(port_text) or not 0 < int(port_text) < 65536:
        return "", None
    return host, int(port_text)


def _address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _unspecified(host: str) -> bool:
    """True for a wildcard bind's address (``0.0.0.0``, ``::``)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def loopback(host: str) -> bool:
    """True when *host* reaches only this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
