"""The Redis backend's operator reads and forced removals
(:class:`~celery_redlock.core.backend.Admin`): the reads are :mod:`.redis_admin`'s
(``SCAN``, never ``KEYS``), the removals one script each.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from ..backend_types import (
    ForceRelease,
    Holder,
    LockInfo,
    RateInfo,
    Slot,
    Status,
    parse_holder,
    text,
)
from ..errors import ConfigError
from . import redis_admin
from .redis_admin import fence_of
from .redis_calls import RedisCalls, mutex_keys
from .redis_scripts import DEQUEUE, FORCE_RELEASE

__all__ = ["RedisOperator"]


class RedisOperator(RedisCalls):
    """What ``celery locks`` reads and removes on one Redis."""

    def holders(self, slot: Slot) -> list[Holder]:
        """Every current acquisition of *slot* (the lock verb, :mod:`.redis_backend`)."""
        raise NotImplementedError  # pragma: no cover - RedisBackend has it

    def on_node(self, node: Any) -> RedisOperator:
        """The backend of one node's client (the operator reads of a cluster)."""
        raise NotImplementedError  # pragma: no cover - RedisBackend has it

    def _node_permits(self, node: Any, slot: Slot) -> list[Holder]:
        return self.on_node(node).holders(slot)

    def scan(self, prefix: str, pattern: str = "*", limit: int | None = None) -> list[LockInfo]:
        with self._errors(pattern):
            return redis_admin.scan(self.client, prefix, pattern, self._node_permits, limit)

    def read(self, prefix: str, name: str) -> list[LockInfo]:
        with self._errors(name):
            return redis_admin.read(self.client, prefix, name, self._node_permits)

    def scan_rates(self, prefix: str, pattern: str = "*") -> list[RateInfo]:
        with self._errors(pattern):
            return redis_admin.scan_rates(self.client, prefix, pattern)

    def read_rate(self, prefix: str, name: str) -> RateInfo | None:
        with self._errors(name):
            return redis_admin.read_rate(self.client, prefix, name)

    def log_events(self, log_key: str, events: Sequence[str], maxlen: int, ttl_ms: int) -> None:
        """``XADD <log_key> MAXLEN ~ <maxlen>`` per event, then ``PEXPIRE``, in one pipeline."""
        with self._errors(log_key, partial(_not_a_log, log_key)):
            pipe = self.client.pipeline(transaction=False)
            for event in events:
                pipe.xadd(log_key, {"e": event}, maxlen=maxlen, approximate=True)
            pipe.pexpire(log_key, ttl_ms)
            pipe.execute()

    def read_events(self, log_key: str, count: int) -> list[str]:
        """``XREVRANGE <log_key> + - COUNT <count>``: the newest first."""
        with self._errors(log_key, partial(_not_a_log, log_key)):
            entries = self.client.xrevrange(log_key, count=count)
        return [text(fields.get(b"e", fields.get("e", b""))) for _, fields in entries]

    def force_release(self, slot: Slot, fence: int | None, notice_ms: int) -> ForceRelease:
        if slot.permits:
            raise ConfigError(f"lock {slot.name!r}: a permit is not released by force")
        keys = slot.keys
        args = [notice_ms, "" if fence is None else str(fence)]
        with self._guard(slot):
            reply = FORCE_RELEASE(self.client, [keys.lock, keys.notify], args)
        code = int(reply[0])
        if code == 0:
            return ForceRelease("gone")
        record = parse_holder(reply[1])
        return ForceRelease("released" if code == 1 else "refused", record, fence_of(reply[2]))

    def force_dequeue(self, slot: Slot, owner: str | None) -> ForceRelease:
        keys = mutex_keys(slot)
        with self._guard(slot):
            found, info = self.client.hmget(keys.queued, "owner", "info")
            if found is None:
                return ForceRelease("gone")
            record = parse_holder(info)
            record.setdefault("task_id", text(found))
            if owner is not None and text(found) != owner:
                return ForceRelease("refused", record)
            code = Status.of(DEQUEUE(self.client, [keys.queued], [text(found)]))
        if code is Status.OK:
            return ForceRelease("released", record)
        return ForceRelease("gone" if code is Status.GONE else "refused", record)


def _not_a_log(key: str, exc: Exception) -> str:
    return (
        f"{key!r} is not a stream of lock events ({exc}): something else writes under the "
        "lock key prefix; celery-redlock leaves it alone"
    )
