"""Each script verb of the Redis backend written once: the script, its keys and arguments,
and how its reply reads (:class:`Call`). The backend runs a call
(:meth:`~.backend.RedisBackend.acquire` and the others) or sends it now and reads its
answer later (:meth:`~.backend.RedisBackend.send`, :class:`~.sent.RedisSent`) from the
same :class:`Call`, so the two never disagree on what a verb writes.

A builder takes the arguments of the backend's verb of the same name (the seam's
signature), so that a verb a quorum sends by name (``acquire``, ``release``, ...) is built
by calling the builder of that name with the verb's own arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

from ...backend import Sendable
from ...backend_types import (
    RECENT_BYTES,
    Acquired,
    Claim,
    ForceRelease,
    Grant,
    Handover,
    Held,
    Holder,
    Queued,
    RateGrant,
    Refused,
    Renewal,
    Slot,
    Status,
    Superseded,
    mutex_keys,
    parse_holder,
    text,
)
from ...errors import cost_above_burst
from .admin import fence_of
from .scripts import (
    ACQUIRE,
    CLAIM_FIELD,
    CONTROL,
    DEQUEUE,
    ENQUEUE,
    EXTEND,
    EXTEND_MANY,
    EXTEND_NODE,
    FORCE_RELEASE,
    PARK,
    PERMIT_ACQUIRE,
    PERMIT_EXTEND,
    PERMIT_RELEASE,
    PERMITS,
    RAISE_FENCE,
    RATE,
    RELEASE,
    Script,
)

__all__ = [
    "SENDABLE",
    "Call",
    "acquire",
    "claim",
    "control",
    "dequeue",
    "enqueue",
    "extend",
    "extend_many",
    "extend_node",
    "force_release",
    "grant_of",
    "park",
    "permits",
    "raise_fence",
    "rate",
    "release",
    "release_done",
    "take_over",
]


class Call(NamedTuple):
    """One script call: what it runs, on which keys, with which arguments, and how its
    reply reads into the verb's result."""

    script: Script
    keys: list[str]
    args: list[Any]
    read: Callable[[Any], Any]


def _flag(value: bool) -> str:
    return "1" if value else "0"


# -- an acquisition's life ----------------------------------------------------------------
def acquire(
    slot: Slot, token: str, ttl_ms: int, record: str, *, wait: bool, fence_ttl_ms: int,
    fence_step_ms: int = 0
) -> Call:  # fmt: skip
    """acquire.lua (permit_acquire.lua for permits): *fence_step_ms*, a mutex's counter
    restart rounded up to that step (a quorum's member: acquire.lua's ARGV[6]). A
    ``controlled`` slot (a task's run) passes its control hash: the script reads the
    name's operator controls in the same step."""
    keys = slot.keys
    names = [keys.lock, keys.fence, keys.waiting]
    if slot.controlled:
        names.append(keys.control)
    args: list[Any] = [token, ttl_ms, record, _flag(wait), fence_ttl_ms]
    read = partial(grant_of, slot=slot)
    if slot.permits:
        args.append(slot.limit)
        return Call(PERMIT_ACQUIRE, names, args, read)
    if fence_step_ms:
        args.append(fence_step_ms)
    return Call(ACQUIRE, names, args, read)


def take_over(
    slot: Slot, token: str, ttl_ms: int, record: str, handover: Handover, *, wait: bool,
    fence_ttl_ms: int
) -> Call:  # fmt: skip
    """acquire.lua with the queued hold's key: the mutex, and task ``handover.owner``'s
    queued hold with it; a task's run, so the name's control hash is read with it."""
    keys = mutex_keys(slot)
    names = [keys.lock, keys.fence, keys.waiting, keys.control, keys.queued]
    args: list[Any] = [token, ttl_ms, record, _flag(wait), fence_ttl_ms]
    args += [handover.owner, _flag(handover.strict)]
    return Call(ACQUIRE, names, args, partial(grant_of, slot=slot))


def release(slot: Slot, token: str, notice_ms: int) -> Call:
    """release.lua (permit_release.lua for permits)."""
    keys = slot.keys
    names = [keys.lock, keys.notify, keys.waiting, keys.released]
    if slot.permits:
        return Call(PERMIT_RELEASE, names, [token, notice_ms, slot.limit, RECENT_BYTES], Status.of)
    return Call(RELEASE, names, [token, notice_ms, RECENT_BYTES], Status.of)


def release_done(slot: Slot, token: str, notice_ms: int, mark: str, mark_ms: int) -> Call:
    """release.lua with the done marks' key: a mutex's release that adds *mark*."""
    keys = mutex_keys(slot)
    names = [keys.lock, keys.notify, keys.waiting, keys.released, keys.done]
    return Call(RELEASE, names, [token, notice_ms, RECENT_BYTES, mark, mark_ms], Status.of)


def extend(slot: Slot, token: str, ms: int, *, replace: bool) -> Call:
    """extend.lua (permit_extend.lua for permits): the new lease in ms, or a Status."""
    script = PERMIT_EXTEND if slot.permits else EXTEND
    return Call(script, [slot.keys.lock], [token, ms, _flag(replace)], _lease)


def extend_many(items: Sequence[Renewal]) -> Call:
    """extend_many.lua: each item's lease set to its ``ms`` where its token still holds
    it, on one node (every key in one slot on a cluster): a Status per item."""
    args: list[Any] = []
    for item in items:
        args += [item.token, item.ms]
    return Call(EXTEND_MANY, [item.slot.keys.lock for item in items], args, _statuses)


def extend_node(items: Sequence[Renewal]) -> Call:
    """extend_node.lua: :func:`extend_many` on one cluster node, across slots (the keys
    are arguments)."""
    args: list[Any] = []
    for item in items:
        args += [item.slot.keys.lock, item.token, item.ms]
    return Call(EXTEND_NODE, [], args, _statuses)


def raise_fence(slot: Slot, fence: int, fence_ttl_ms: int) -> Call:
    """raise_fence.lua: the name's fence counter lifted to at least *fence*."""
    return Call(RAISE_FENCE, [slot.keys.fence], [fence, fence_ttl_ms], int)


def permits(slot: Slot) -> Call:
    """permits.lua: the live permits of *slot*, first to expire first."""
    return Call(PERMITS, [slot.keys.lock], [], _permit_holders)


# -- queued holds -------------------------------------------------------------------------
def enqueue(
    slot: Slot, owner: str, ttl_ms: int, record: str, *, replace: bool, running_blocks: bool
) -> Call:
    """enqueue.lua: task *owner*'s enqueue-time hold, or whose it is."""
    keys = mutex_keys(slot)
    args = [owner, ttl_ms, record, _flag(replace), _flag(running_blocks)]
    return Call(ENQUEUE, [keys.queued, keys.lock], args, _queued)


def dequeue(slot: Slot, owner: str) -> Call:
    """dequeue.lua: task *owner*'s enqueue-time hold given up."""
    return Call(DEQUEUE, [mutex_keys(slot).queued], [owner], Status.of)


def park(slot: Slot, token: str, owner: str, ttl_ms: int, *, record: str, notice_ms: int) -> Call:
    """park.lua: *token*'s acquisition kept for task *owner*'s redelivered copy."""
    keys = mutex_keys(slot)
    args = [token, owner, ttl_ms, record, notice_ms]
    return Call(PARK, [keys.lock, keys.notify, keys.waiting], args, Status.of)


# -- rates, records, controls, forced removal ---------------------------------------------
def rate(
    key: str, interval_us: int, burst: int, *, mode: str, most_us: int = 0, grace_us: int = 0
) -> Call:
    """rate.lua: one GCRA decision."""
    return Call(RATE, [key], [interval_us, burst, mode, most_us, grace_us], _rate_grant)


def claim(
    slot: Slot, key: str, token: str, name: str, value: str, *, version: tuple[int, int]
) -> Call:
    """claim_field.lua: field *name* of the records at *key* written while *token* holds
    the lock, never over a newer version of the same fence."""
    args = [token, name, value, version[0], version[1]]

    def read(reply: Any) -> Claim:
        code = int(reply[0])
        if code == 1:
            return Claim("claimed", value)
        if code == -1:
            return Claim("stale", text(reply[1]))
        return Claim("lost", detail="the lock is gone or held by another acquisition")

    return Call(CLAIM_FIELD, [slot.keys.lock, key], args, read)


def control(control_key: str, kind: str, value: str | None, ttl_ms: int) -> Call:
    """control.lua: one control of a name set (*value*) or lifted (None)."""
    return Call(CONTROL, [control_key], [kind, value or "", ttl_ms], bool)


def force_release(slot: Slot, fence: int | None, notice_ms: int) -> Call:
    """force_release.lua: the lock removed whoever holds it (only the acquisition with
    *fence*, when given)."""
    keys = slot.keys
    args = [notice_ms, "" if fence is None else str(fence)]
    return Call(FORCE_RELEASE, [keys.lock, keys.notify], args, _forced)


#: The verbs :meth:`~.backend.RedisBackend.send` sends, by name: each builds its call from
#: the verb's own arguments.
SENDABLE: dict[Sendable, Callable[..., Call]] = {
    Sendable.ACQUIRE: acquire,
    Sendable.RELEASE: release,
    Sendable.RELEASE_DONE: release_done,
    Sendable.EXTEND: extend,
    Sendable.ENQUEUE: enqueue,
    Sendable.RAISE_FENCE: raise_fence,
}


# -- replies ------------------------------------------------------------------------------
def grant_of(reply: Any, slot: Slot) -> Grant:
    """An acquire's reply for *slot* as a Grant: acquire.lua's or permit_acquire.lua's, or
    hold_all.lua's (the slot's own script with its controls and rules), which adds each
    rule's fence, a refusal by a control or a rule (-2) and a cost above a burst (-3)."""
    code = int(reply[0])
    if code == 1:
        return Acquired(fence=int(reply[1]), fences=tuple(int(f) for f in reply[2:]))
    if code == -2:
        return _refused(reply, slot)
    if code == -3:
        raise cost_above_burst(f"rate {text(reply[1])!r}", int(reply[2]), int(reply[3]))
    holder, left = parse_holder(reply[1]), int(reply[2])
    # A hand-over (acquire.lua with KEYS[5]) adds the queued hold's owner.
    queued = text(reply[3]) if len(reply) > 3 and not slot.permits else None
    if code == -1:  # a hand-over whose queued hold belongs to another task id
        return Superseded(queued or "", holder=holder, holder_ttl_ms=left)
    return Held(holder=holder, holder_ttl_ms=left, wait_ms=left, queued_owner=queued)


def _refused(reply: Any, slot: Slot) -> Refused:
    """A refusal by an operator control or a rule: ``{-2, name ('': the slot's own), wait
    ms (-1: unknown), why, detail}``."""
    wait = int(reply[2])
    why, detail = text(reply[3]), text(reply[4])
    holder: dict[str, Any] = {"reason": detail} if why == "paused" else {}
    if why == "limit":
        holder = parse_holder(detail)
    return Refused(
        text(reply[1]) or slot.name, why, holder=holder, wait_ms=None if wait < 0 else wait
    )


def _lease(reply: Any) -> int | Status:
    code = int(reply)
    return code if code > 0 else Status.of(code)


def _statuses(reply: Any) -> list[Status]:
    return [Status.of(code) for code in reply]


def _permit_holders(reply: Any) -> list[Holder]:
    """A ``permits.lua`` reply (four entries per live permit), first to expire first."""
    found = [
        Holder(
            text(reply[i]), parse_holder(reply[i + 3]), fence_of(reply[i + 2]), int(reply[i + 1])
        )
        for i in range(0, len(reply) - 3, 4)
    ]
    return sorted(found, key=lambda h: h.ttl_ms or 0)


def _queued(reply: Any) -> Queued:
    """An ``enqueue.lua`` reply as a :class:`~...backend_types.Queued`."""
    code = int(reply[0])
    if code == 1:
        return Queued("queued")
    if code == 2:
        return Queued("replaced", owner=text(reply[1]), holder=parse_holder(reply[2]))
    holder = parse_holder(reply[2])
    other = text(reply[1]) or str(holder.get("task_id") or "")
    return Queued("duplicate", other, holder, ttl_ms=int(reply[3]), state=text(reply[4]))


def _rate_grant(reply: Any) -> RateGrant:
    granted, wait_us, free = reply
    return RateGrant(int(granted) == 1, max(0, int(wait_us)) / 1e6, int(free))


def _forced(reply: Any) -> ForceRelease:
    code = int(reply[0])
    if code == 0:
        return ForceRelease("gone")
    record = parse_holder(reply[1])
    return ForceRelease("released" if code == 1 else "refused", record, fence_of(reply[2]))
