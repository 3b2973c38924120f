"""A "fenced store": a counter per key that refuses any operation carrying a stale fence.

It stands for the storage a locked task writes to, with ``self.lock.fence`` passed
along (the way DESIGN.md asks users to). It lives on its own throwaway Redis, never
the lock's, and is never faulted. Per key it keeps:

* ``value``    the counter;
* ``seen``     the highest fence any read or write has shown it;
* ``written``  the fence of the last accepted write;
* ``rejected`` how many reads and writes it refused;
* ``log``      every operation in arrival order: ``"r|w <fence> <1 accepted|0 refused>"``.

A read is refused when its fence is below ``seen``; a write when its fence is below
``seen`` or not above ``written``. Reads take part so that a read-modify-write is safe
even when the deposed holder writes before the new one does: the new holder's read
already raised ``seen`` (the classic fencing-token argument needs the read fenced too).
So, as long as the lock hands out a unique fence per acquisition, ``value`` always
equals the number of accepted writes; a duplicate fence, or one that goes backwards,
shows up as a lost update or as refusals in the log.

Used by the workers (``tests.integration.chaos.chaosapp``) and by the tests that check the log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

# KEYS: value, seen, written, rejected, log. ARGV[1]: fence.
# Returns {1, value} (accepted) or {0, seen} (refused).
READ = """
local fence = tonumber(ARGV[1])
local seen = tonumber(redis.call('GET', KEYS[2]) or '0')
if fence < seen then
  redis.call('INCR', KEYS[4])
  redis.call('RPUSH', KEYS[5], 'r ' .. ARGV[1] .. ' 0')
  return {0, seen}
end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('RPUSH', KEYS[5], 'r ' .. ARGV[1] .. ' 1')
return {1, tonumber(redis.call('GET', KEYS[1]) or '0')}
"""

# KEYS: value, seen, written, rejected, log. ARGV[1]: fence, ARGV[2]: new value.
# Returns 1 (accepted) or 0 (refused).
WRITE = """
local fence = tonumber(ARGV[1])
local seen = tonumber(redis.call('GET', KEYS[2]) or '0')
local written = tonumber(redis.call('GET', KEYS[3]) or '0')
if fence < seen or fence <= written then
  redis.call('INCR', KEYS[4])
  redis.call('RPUSH', KEYS[5], 'w ' .. ARGV[1] .. ' 0')
  return 0
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[1])
redis.call('RPUSH', KEYS[5], 'w ' .. ARGV[1] .. ' 1')
return 1
"""


@dataclass(frozen=True)
class Operation:
    """One entry of a key's log."""

    kind: str  # "r" or "w"
    fence: int
    accepted: bool


@dataclass(frozen=True)
class KeyState:
    """Everything the store holds for one key."""

    value: int
    seen: int
    written: int
    rejected: int
    log: tuple[Operation, ...]


class FencedStore:
    """Fenced reads and writes of per-key counters on one Redis (see the module doc)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._read = client.register_script(READ)
        self._write = client.register_script(WRITE)

    @staticmethod
    def _keys(key: str) -> list[str]:
        base = f"store:{{{key}}}"
        return [
            f"{base}:value",
            f"{base}:seen",
            f"{base}:written",
            f"{base}:rejected",
            f"{base}:log",
        ]

    def read(self, key: str, fence: int) -> int | None:
        """The counter, or None when *fence* is stale (a refusal, counted)."""
        ok, value = self._read(keys=self._keys(key), args=[fence])
        return int(value) if int(ok) == 1 else None

    def write(self, key: str, fence: int, value: int) -> bool:
        """Store *value* if *fence* is fresh; False (a counted refusal) otherwise."""
        return int(self._write(keys=self._keys(key), args=[fence, value])) == 1

    def state(self, key: str) -> KeyState:
        """The whole state of *key* (for the checks)."""
        value, seen, written, rejected = self.client.mget(self._keys(key)[:4])
        raw: list[Any] = self.client.lrange(self._keys(key)[4], 0, -1)
        log = []
        for entry in raw:
            kind, fence, accepted = (entry.decode() if isinstance(entry, bytes) else entry).split()
            log.append(Operation(kind, int(fence), accepted == "1"))
        return KeyState(
            int(value or 0), int(seen or 0), int(written or 0), int(rejected or 0), tuple(log)
        )
