"""Lock names and Redis keys.

A lock named ``sync:42`` lives at ``<prefix>{sync:42}``. The braces are the
Redis Cluster hash tag, so the lock key, its fence counter and its wake-up list
share one slot, and the key still shows the name a person wrote.

A name starting with ``}`` or ``\\`` gets one backslash in front inside the braces
(``}{`` at ``<prefix>{\\}{}``, ``\\x`` at ``<prefix>{\\\\x}``): Redis would hash an empty tag
for a leading ``}``, and escaping the backslash too keeps two names from sharing a key.
:func:`name_of_key` drops that backslash again. Every other key of a name is its lock
key plus ``:<suffix>``, a suffix without ``}``, so the last ``}`` of any key ends its tag.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import enum
import hashlib
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = [
    "MAX_NAME_LENGTH",
    "KeyTemplate",
    "LockKeys",
    "lock_keys",
    "name_of_key",
    "normalize_name",
    "permit_keys",
    "rate_key",
    "render_value",
]

#: Names longer than this are replaced by a readable head plus a hash.
MAX_NAME_LENGTH = 200
_HEAD = 120
_PLACEHOLDER = re.compile(r"<([^<>]*)>")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: The placeholder of every argument of a call (``"proj.report:<*>"``).
ALL_ARGUMENTS = "*"
#: Stored names that get a backslash in front in their hash tag, and the tags that have one.
_ESCAPED = ("}", "\\")
_ESCAPES = ("\\}", "\\\\")


@dataclass(frozen=True, slots=True)
class LockKeys:
    """The Redis keys of one lock; all of them share one cluster hash slot."""

    name: str
    lock: str
    fence: str
    notify: str
    waiting: str
    #: The enqueue-time hold (``lock_on="enqueue"``): the task id of the one queued message
    #: ("" for keys that have none, such as a semaphore's).
    queued: str = ""
    #: Who last released the lock after finishing (a run's task id and attempt), for locks
    #: that ask for it: a redelivered copy of that message then knows it already ran.
    done: str = ""
    #: The tokens most recently given back by their own release (a bounded string, kept
    #: one lease after the last release): a re-sent copy of a release finds its token
    #: there and counts as released, while a key taken or removed by someone else does not.
    released: str = ""
    #: The name's operator controls (a pause, a limit, a rate: ``celery locks pause`` /
    #: ``set``), a hash read by the acquire of a task's run (see FlowControl).
    control: str = ""
    #: The state of the name's rate limiter (see :func:`rate_key`).
    rate: str = ""


def normalize_name(name: str) -> str:
    """Return the name as stored: unchanged, or head + sha256 when over the limit."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"lock name must be a non-empty string, got {name!r}")
    if not name.isascii() and not _encodes(name):
        # A lone surrogate ("\ud800", which JSON can carry to a worker) cannot be sent to
        # Redis: the name becomes its escaped head plus a hash, like an over-long one.
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        head = name.encode("utf-8", "backslashreplace").decode("utf-8")[:_HEAD]
        return f"{head}...#{digest}"
    if len(name) <= MAX_NAME_LENGTH:
        return name
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]
    return f"{name[:_HEAD]}...#{digest}"


def _encodes(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lock_keys(name: str, prefix: str = "redlock:") -> LockKeys:
    """Build the keys for lock *name* under *prefix* (name is normalised first)."""
    if not isinstance(prefix, str):
        raise ConfigError(f"key_prefix must be a string, got {prefix!r}")
    if "{" in prefix or "}" in prefix:
        raise ConfigError(
            f"key_prefix {prefix!r} must not contain braces: celery-redlock adds the "
            "cluster hash tag itself"
        )
    stored = normalize_name(name)
    # Redis hashes the text between the first "{" and the next "}": a name starting
    # with "}" would leave that empty, and the keys would land in different slots. The
    # backslash in front is escaped as well, so the tag gives the name back (and "\\}{"
    # does not share the key of "}{").
    tag = "\\" + stored if stored.startswith(_ESCAPED) else stored
    base = f"{prefix}{{{tag}}}"
    return LockKeys(
        name=stored,
        lock=base,
        fence=f"{base}:fence",
        notify=f"{base}:notify",
        waiting=f"{base}:waiting",
        queued=f"{base}:queued",
        done=f"{base}:done",
        released=f"{base}:recent",
        control=f"{base}:control",
        rate=f"{base}:rate",
    )


def name_of_key(key: str, prefix: str) -> str:
    """The stored name of a key built for it under *prefix* (its lock key, or the lock
    key plus ``:<suffix>``): the inverse of :func:`lock_keys`.

    A tag with a backslash in front of ``}`` or ``\\`` is an escaped name; any other tag
    is the name itself (so a key an older version wrote for ``\\x`` still reads ``\\x``).
    """
    tag = key[len(prefix) + 1 : key.rindex("}")]
    return tag[1:] if tag.startswith(_ESCAPES) else tag


def permit_keys(name: str, prefix: str = "redlock:") -> LockKeys:
    """The keys of semaphore *name*: its permits at ``<prefix>{<name>}:permits``, and the
    fence counter, notify list and waiter mark it shares with a lock of that name."""
    keys = lock_keys(name, prefix)
    return LockKeys(
        name=keys.name,
        lock=f"{keys.lock}:permits",
        fence=keys.fence,
        notify=keys.notify,
        waiting=keys.waiting,
        released=keys.released,
        control=keys.control,
    )


def rate_key(name: str, prefix: str = "redlock:") -> str:
    """The key of rate limiter *name*: ``<prefix>{<name>}:rate`` (the hash tag of the lock
    of that name)."""
    return lock_keys(name, prefix).rate


def render_value(value: Any) -> str:
    """Render one argument canonically: the same value gives the same text everywhere.

    Strings stay as they are; numbers, booleans, None, UUIDs, decimals, dates and
    enums have one spelling; dicts render with sorted keys, so key order does not
    matter. Objects without a canonical form are refused (their ``str()`` may hold a
    memory address, which would give every process a different lock).

    A value whose canonical form is text (a UUID, a date, a decimal, a non-integral
    float, an enum with a text value) renders as that text, without JSON's quotes,
    exactly as the string would: Celery's JSON serializer hands a worker a ``UUID``
    when the caller sent one and a ``str`` when the caller sent that, and both must
    lock the same name (``sync:<user_id>`` -> ``sync:12345678-...``), as 42 and "42"
    do. Containers render as JSON.
    """
    if isinstance(value, str):
        return value
    if type(value) is int:  # the common key argument (ids): json.dumps would give the same
        return str(value)
    canonical = _canonical(value)
    if isinstance(canonical, str):
        return canonical
    return json.dumps(canonical, sort_keys=True, separators=(",", ":"))


def _canonical(value: Any) -> Any:  # noqa: PLR0911 - one return per kind of value
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else repr(value)
    if isinstance(value, (uuid.UUID, decimal.Decimal)):
        return str(value)
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Mapping):
        return {render_value(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    raise TypeError(
        f"cannot render a {type(value).__name__} into a lock key canonically; "
        "pass a str/int/UUID/dict argument, or give lock_key a callable"
    )


class KeyTemplate:
    """A key template such as ``"sync:<user_id>"``.

    ``<name>`` is replaced by the rendered value of argument ``name``; ``<a.b>``
    reads attribute or key ``b`` of argument ``a``; ``<*>`` is every argument of the
    call by name, rendered as one JSON object with sorted keys (``{"day":"d1",
    "full":false}``), so two calls share the name exactly when all their arguments are
    equal. ``fields`` lists the argument names the template needs, so callers can
    check them against a signature early (``<*>`` needs none).
    """

    def __init__(self, template: str) -> None:
        if not isinstance(template, str) or not template:
            raise ConfigError(f"lock_key template must be a non-empty string, got {template!r}")
        if template.count("<") != template.count(">"):
            raise ConfigError(f"lock_key template {template!r} has unbalanced '<' and '>'")
        self.template = template
        self._parts: list[tuple[str, tuple[str, ...] | None]] = []
        pos = 0
        for m in _PLACEHOLDER.finditer(template):
            if m.start() > pos:
                self._parts.append((template[pos : m.start()], None))
            if m.group(1) == ALL_ARGUMENTS:
                self._parts.append(("", ()))
                pos = m.end()
                continue
            path = tuple(m.group(1).split("."))
            if not all(_IDENT.match(p) for p in path):
                raise ConfigError(
                    f"lock_key template {template!r}: <{m.group(1)}> is not an argument name"
                )
            self._parts.append(("", path))
            pos = m.end()
        if pos < len(template):
            self._parts.append((template[pos:], None))
        self.fields: tuple[str, ...] = tuple(dict.fromkeys(p[0] for _, p in self._parts if p))

    def render(self, arguments: Mapping[str, Any]) -> str:
        """Fill the template from *arguments* (argument name -> value)."""
        out: list[str] = []
        for text, path in self._parts:
            if path is None:
                out.append(text)
                continue
            if not path:
                out.append(render_value(dict(arguments)))
                continue
            try:
                value: Any = arguments[path[0]]
            except KeyError:
                raise ConfigError(
                    f"lock_key template {self.template!r} needs argument {path[0]!r}"
                ) from None
            for attr in path[1:]:
                value = value[attr] if isinstance(value, Mapping) else getattr(value, attr)
            out.append(render_value(value))
        return "".join(out)

    def __repr__(self) -> str:
        return f"KeyTemplate({self.template!r})"
