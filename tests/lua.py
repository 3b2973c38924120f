"""The package's Lua scripts, for tests that run one as another client would.

Each is the source the Redis backend sends (its file with the shared parts it lists, from
``celery_redlock.core.backends.redis.scripts``), run with redis-py's ``eval``: what a
second program sharing the server could send.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from celery_redlock.core.backends.redis import scripts
from celery_redlock.core.backends.redis.scripts import Script

ACQUIRE = scripts.ACQUIRE
RELEASE = scripts.RELEASE
EXTEND = scripts.EXTEND
FORCE_RELEASE = scripts.FORCE_RELEASE
PERMIT_ACQUIRE = scripts.PERMIT_ACQUIRE


def run_script(
    client: redis.Redis, script: Script, keys: Sequence[str], args: Sequence[Any]
) -> Any:
    """Run one of the package's scripts directly with ``EVAL``, as another client would."""
    return client.eval(script.source, len(keys), *keys, *args)
