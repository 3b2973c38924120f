"""The Lua scripts (one ``.lua`` file each, header first) and the one place that
says what their status codes mean."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from enum import IntEnum
from importlib import resources
from typing import Any

from .send import Packed

__all__ = [
    "ACQUIRE",
    "CLAIM_FIELD",
    "DEQUEUE",
    "ENQUEUE",
    "EXTEND",
    "EXTEND_MANY",
    "EXTEND_NODE",
    "FORCE_RELEASE",
    "PERMITS",
    "PERMIT_ACQUIRE",
    "PERMIT_EXTEND",
    "PERMIT_RELEASE",
    "RAISE_FENCE",
    "RATE",
    "RELEASE",
    "Script",
    "ScriptCall",
    "Status",
]


class Status(IntEnum):
    """What a release or extend script found (renewal: one per lock)."""

    OK = 1
    #: No such key: it expired or was removed.
    GONE = 0
    #: Another acquisition holds the key now.
    TAKEN = -1
    #: The key holds something that is not a lock (foreign data under our prefix).
    FOREIGN = -2

    @classmethod
    def of(cls, code: Any) -> Status:
        """The status a script returned; a code no script returns is an error, not a guess."""
        value = int(code)
        if value > 0:
            return cls.OK  # extend returns the new lease in ms
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unexpected status code {code!r} from a celery-redlock script"
            ) from None

    def describe(self) -> str:
        """The status in words, for log lines and errors."""
        return _WORDS[self]


_WORDS = {
    Status.OK: "ok",
    Status.GONE: "the key is gone (expired or removed)",
    Status.TAKEN: "another owner holds it now",
    Status.FOREIGN: (
        "the key now holds data that is not a celery-redlock lock: something else "
        "writes under the lock key prefix"
    ),
}


class Script:
    """A Lua script of this package, run by ``EVALSHA`` (``EVAL`` once per server)."""

    def __init__(self, filename: str, *parts: str) -> None:
        """The script in *filename*, followed by the text of *parts* (a body that several
        scripts share, such as the renewal loop)."""
        self.filename = filename
        folder = resources.files(__package__).joinpath("scripts")
        self.source = "".join(folder.joinpath(name).read_text() for name in (filename, *parts))
        self.sha = hashlib.sha1(self.source.encode("utf-8"), usedforsecurity=False).hexdigest()

    def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> ScriptCall:
        """This script with *keys* and *args*, ready to send (see ``core.send``)."""
        return ScriptCall(self, tuple(keys), tuple(args))

    def __repr__(self) -> str:
        return f"Script({self.filename!r})"


class ScriptCall(Packed):
    """One run of a script: what a channel sends, and what it sends after ``NOSCRIPT``."""

    __slots__ = ("args_", "keys", "script")

    def __init__(self, script: Script, keys: tuple[str, ...], args: tuple[Any, ...]) -> None:
        super().__init__()
        self.script = script
        self.keys = keys
        self.args_ = args

    def args(self) -> tuple[Any, ...]:
        return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args_)

    def fallback(self) -> tuple[Any, ...] | None:
        return ("EVAL", self.script.source, len(self.keys), *self.keys, *self.args_)

    def __repr__(self) -> str:
        return f"<{self.script.filename} keys={list(self.keys)!r}>"


ACQUIRE = Script("acquire.lua")
RELEASE = Script("release.lua")
EXTEND = Script("extend.lua")
EXTEND_MANY = Script("extend_many.lua", "extend_items.lua")
EXTEND_NODE = Script("extend_node.lua", "extend_items.lua")  # a Cluster node, across slots
RAISE_FENCE = Script("raise_fence.lua")
FORCE_RELEASE = Script("force_release.lua")  # `celery locks release`
CLAIM_FIELD = Script("claim_field.lua")  # beat's once-per-tick claims (core/records.py)
PERMIT_ACQUIRE = Script("permit_acquire.lua")  # a semaphore's permits (core/semaphore.py)
PERMIT_RELEASE = Script("permit_release.lua")
PERMIT_EXTEND = Script("permit_extend.lua")
PERMITS = Script("permits.lua")
RATE = Script("rate.lua")  # a rate limiter's one call (core/ratelimit.py)
ENQUEUE = Script("enqueue.lua")  # the enqueue-time hold (core/queued.py)
DEQUEUE = Script("dequeue.lua")
