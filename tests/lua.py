"""The package's Lua scripts, for tests that run one as another client would.

Each is read from the installed package (``celery_redlock/core/backends/redis/lua``) and run with
redis-py's ``eval``: what a second program sharing the server could send.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis

LUA = resources.files("celery_redlock.core.backends.redis").joinpath("lua")


class Script:
    """One script file (with the shared parts appended, as the backend sends it)."""

    def __init__(self, filename: str, *parts: str) -> None:
        self.filename = filename
        self.source = "".join(LUA.joinpath(name).read_text("utf-8") for name in (filename, *parts))

    def run(self, client: redis.Redis, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The script's reply on *client*."""
        return client.eval(self.source, len(keys), *keys, *args)

    def __repr__(self) -> str:
        return f"Script({self.filename!r})"


ACQUIRE = Script("acquire.lua")
RELEASE = Script("release.lua")
EXTEND = Script("extend.lua")
FORCE_RELEASE = Script("force_release.lua")
PERMIT_ACQUIRE = Script("permit_acquire.lua")


def run_script(
    client: redis.Redis, script: Script, keys: Sequence[str], args: Sequence[Any]
) -> Any:
    """Run one of the package's scripts directly, as another client would."""
    return script.run(client, keys, args)
