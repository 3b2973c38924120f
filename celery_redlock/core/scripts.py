"""The Lua scripts (one ``.lua`` file each, header first) and the one place that
maps their status codes to outcomes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

from . import _wire

__all__ = [
    "ACQUIRE",
    "CLAIM_FIELD",
    "EXTEND",
    "EXTEND_MANY",
    "FORCE_RELEASE",
    "FOREIGN",
    "OK",
    "OTHER_OWNER",
    "RAISE_FENCE",
    "RELEASE",
    "UNKNOWN",
    "Script",
    "describe_code",
]

#: Status codes returned by release/extend scripts.
OK = 1
UNKNOWN = 0  # no such key: expired or removed
OTHER_OWNER = -1
FOREIGN = -2  # the lock key holds something that is not a lock hash


def describe_code(code: int) -> str:
    """Say in words what a release/extend status code means; unknown codes are errors."""
    if code == UNKNOWN:
        return "the key is gone (expired or removed)"
    if code == OTHER_OWNER:
        return "another owner holds it now"
    if code == FOREIGN:
        return (
            "the key now holds data that is not a celery-redlock lock: something else "
            "writes under the lock key prefix"
        )
    if code >= OK:
        return "owned"
    raise ValueError(f"unexpected status code {code!r} from a celery-redlock script")


class Script:
    """A Lua script run by EVALSHA, loaded on the node on first NOSCRIPT."""

    def __init__(self, filename: str, source: str | None = None) -> None:
        self.filename = filename
        if source is None:
            source = resources.files(__package__).joinpath("scripts").joinpath(filename).read_text()
        self.source = source
        self.sha = hashlib.sha1(self.source.encode("utf-8"), usedforsecurity=False).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run on *client* (a Redis, a Sentinel master client or a RedisCluster)."""
        return _wire.evalsha(client, self.sha, self.source, keys, args)

    def __repr__(self) -> str:
        return f"Script({self.filename!r})"


ACQUIRE = Script("acquire.lua")
RELEASE = Script("release.lua")
EXTEND = Script("extend.lua")
EXTEND_MANY = Script("extend_many.lua")
RAISE_FENCE = Script("raise_fence.lua")
FORCE_RELEASE = Script("force_release.lua")  # `celery locks release`
CLAIM_FIELD = Script("claim_field.lua")  # beat's once-per-tick claims (core/records.py)
