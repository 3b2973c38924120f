"""The Redis backend's queued holds, done marks, rates and records
(:class:`~celery_redlock.core.backend.QueuedHolds` without the hand-over, which is an
acquire: :mod:`.redis_backend`; :class:`~celery_redlock.core.backend.DoneMarks`'
check; :class:`~celery_redlock.core.backend.Rates`;
:class:`~celery_redlock.core.backend.Records`), each one script or one read.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from ..backend_types import Claim, Queued, RateGrant, Slot, Status, parse_holder, text
from .redis_calls import RedisCalls, mutex_keys
from .redis_scripts import CLAIM_FIELD, DEQUEUE, ENQUEUE, PARK, RATE

__all__ = ["RedisHolds", "queued_of"]


class RedisHolds(RedisCalls):
    """Queued holds, done marks, rates and records on one Redis."""

    def was_done(self, slot: Slot, mark: str) -> bool:
        if not slot.keys.done:
            return False  # permits keep no done marks
        with self._guard(slot):
            return self.client.zscore(slot.keys.done, mark) is not None

    def enqueue(
        self, slot: Slot, owner: str, ttl_ms: int, record: str, *, replace: bool,
        running_blocks: bool
    ) -> Queued:  # fmt: skip
        keys = mutex_keys(slot)
        args = [owner, ttl_ms, record, "1" if replace else "0", "1" if running_blocks else "0"]
        with self._guard(slot):
            reply = self._run(ENQUEUE, [keys.queued, keys.lock], args)
        return queued_of(reply)

    def dequeue(self, slot: Slot, owner: str) -> Status:
        keys = mutex_keys(slot)
        with self._guard(slot):
            return Status.of(self._run(DEQUEUE, [keys.queued], [owner]))

    def park(
        self, slot: Slot, token: str, owner: str, ttl_ms: int, *, record: str, notice_ms: int
    ) -> Status:
        keys = mutex_keys(slot)
        args = [token, owner, ttl_ms, record, notice_ms]
        with self._guard(slot):
            return Status.of(self._run(PARK, [keys.lock, keys.notify, keys.waiting], args))

    def rate(
        self, name: str, key: str, interval_us: int, burst: int, *, mode: str,
        most_us: int = 0, grace_us: int = 0
    ) -> RateGrant:  # fmt: skip
        def foreign(exc: Exception) -> str:
            return (
                f"rate limiter {name!r}: Redis refused the rate script on {key!r} ({exc}): "
                "something other than celery-redlock writes under the key prefix; delete "
                "that key if it is stale, or give celery-redlock a prefix of its own"
            )

        with self._errors(name, foreign):
            args = [interval_us, burst, mode, most_us, grace_us]
            granted, wait_us, free = self._run(RATE, [key], args)
        return RateGrant(int(granted) == 1, max(0, int(wait_us)) / 1e6, int(free))

    def load_records(self, slot: Slot, suffix: str) -> dict[str, str]:
        key = f"{slot.keys.lock}:{suffix}"
        with self._errors(slot.name, partial(_records_message, key)):
            found = self.client.hgetall(key)
        return {text(name): text(value) for name, value in found.items()}

    def claim(  # noqa: PLR0917 - the Records protocol's signature
        self, slot: Slot, suffix: str, token: str, name: str, value: str,
        version: tuple[int, int], deadline: float | None = None
    ) -> Claim:  # fmt: skip
        """See :meth:`~celery_redlock.core.backend.Records.claim`; one Redis answers
        within its client's socket timeout, so *deadline* (a quorum's bound) is not
        needed here."""
        key = f"{slot.keys.lock}:{suffix}"
        args = [token, name, value, version[0], version[1]]
        with self._errors(slot.name, partial(_records_message, key)):
            reply = self._run(CLAIM_FIELD, [slot.keys.lock, key], args)
        code = int(reply[0])
        if code == 1:
            return Claim("claimed", value)
        if code == -1:
            return Claim("stale", text(reply[1]))
        return Claim("lost", detail="the lock is gone or held by another acquisition")


def _records_message(key: str, exc: Exception) -> str:
    return (
        f"{key!r} holds data that is not a hash of records ({exc}): something other than "
        "celery-redlock writes under the lock key prefix; delete that key if it is stale"
    )


def queued_of(reply: Any) -> Queued:
    """An ``enqueue.lua`` reply as a :class:`~..backend_types.Queued`."""
    code = int(reply[0])
    if code == 1:
        return Queued("queued")
    if code == 2:
        return Queued("replaced", owner=text(reply[1]), holder=parse_holder(reply[2]))
    holder = parse_holder(reply[2])
    other = text(reply[1]) or str(holder.get("task_id") or "")
    return Queued("duplicate", other, holder, ttl_ms=int(reply[3]), state=text(reply[4]))
