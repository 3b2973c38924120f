"""The Redis backend's flow control (:class:`~celery_redlock.core.backend.FlowControl`): a
slot with rules or under operator control is taken by ``hold_all.lua`` and given back by
``release_all.lua``, which run the slot's own acquire or release script on its keys and
arguments, and do the same for its rules, in one step; the controls are written by
``control.lua`` and read with ``SCAN``.

A Redis Cluster runs a script on one node: it declines FlowControl
(:meth:`RedisFlow.declines`, and :meth:`RedisFlow.why_not` says why), so a worker whose
tasks set ``lock_limits`` there stops at start-up, and its runs read no controls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..backend import FlowControl
from ..backend_types import (
    RECENT_BYTES,
    Control,
    Grant,
    Renewal,
    Slot,
    Status,
    parse_holder,
    text,
)
from ..errors import cost_above_burst
from ..keys import name_of_key
from .redis_calls import RedisCalls
from .redis_scripts import CONTROL, HOLD_ALL, RELEASE_ALL, extend_many, grant_of

__all__ = ["RedisFlow", "flow_grant", "rule_renewals"]


class RedisFlow(RedisCalls):
    """FlowControl on one Redis (a Cluster declines it)."""

    def declines(self, capability: type) -> bool:
        """A Redis Cluster declines FlowControl: a run's holds on several names are one
        script, which runs on one node."""
        return self.cluster and capability is FlowControl

    def why_not(self, capability: type) -> str:
        """Why this backend lacks *capability* (the reason in :func:`~..backend.lacks`)."""
        if self.cluster and capability is FlowControl:
            return (
                "a Redis Cluster runs a script on one node, and a run's holds on several "
                "names are one script; use one Redis or a Sentinel-managed master"
            )
        return ""

    def _hold_all(self, slot: Slot, names: list[str], args: list[Any]) -> Any:
        """``hold_all.lua``: the slot's own acquire script (*names*, *args*) with its controls
        and rules."""
        keys = [*names, slot.keys.control]
        argv: list[Any] = [len(names), "permit" if slot.permits else "lock", len(args), *args]
        for rule in slot.rules:
            keys += [rule.key, rule.key if rule.is_rate else rule.keys.fence, rule.keys.control]
            kind = "rate" if rule.is_rate else "mutex" if rule.is_mutex else "limit"
            size = rule.interval_us if rule.is_rate else rule.limit
            argv += [kind, size, rule.burst, rule.cost, rule.name]
        return self._run(HOLD_ALL, keys, argv)

    def _release_all(self, slot: Slot, names: list[str], args: list[Any]) -> Status:
        """``release_all.lua``: the slot's own release (*names*, *args*) and its Limits'."""
        keys = list(names)
        argv: list[Any] = [len(names), "permit" if slot.permits else "lock", len(args), *args]
        for rule in slot.held_rules:
            keys += [rule.key, rule.keys.notify, rule.keys.waiting, rule.keys.released]
            argv += ["mutex" if rule.is_mutex else "limit", rule.limit, RECENT_BYTES]
        codes = [Status.of(code) for code in self._run(RELEASE_ALL, keys, argv)]
        return Status.first_failure(codes)

    def _extend_rules(self, slot: Slot, token: str, ms: int) -> Status:
        """Set the lease of *slot*'s Limits held by *token* to *ms*, in one script."""
        items = _rule_items(Renewal(slot, token, ms))
        return (
            Status.first_failure(extend_many(self.client, items, self._pool))
            if items
            else Status.OK
        )

    def set_control(self, control_key: str, kind: str, value: str | None, ttl_ms: int) -> bool:
        with self._errors(control_key):
            return bool(self._run(CONTROL, [control_key], [kind, value or "", ttl_ms]))

    def controls(self, prefix: str, pattern: str = "*") -> list[Control]:
        found: list[Control] = []
        with self._errors(prefix):
            for key in self.client.scan_iter(match=f"{prefix}{{{pattern}}}:control", count=500):
                found += self._controls_at(text(key), prefix)
        return sorted(found, key=lambda c: (c.name, c.kind))

    def _controls_at(self, key: str, prefix: str) -> list[Control]:
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(key)
        pipe.execute_command("TIME")
        fields, (secs, micros) = pipe.execute()
        now = int(secs) * 1000 + int(micros) // 1000
        name = name_of_key(key, prefix)
        out = []
        for kind, raw in fields.items():
            until, _, value = text(raw).partition("|")
            end = int(until or 0)
            if end and end <= now:
                continue
            out.append(Control(name, text(kind), value, end - now if end else None))
        return out


def flow_grant(reply: Any, slot: Slot) -> Grant:
    """A ``hold_all.lua`` reply as a Grant (the slot's own refusals as its script's)."""
    code = int(reply[0])
    if code == 1:
        return Grant(True, fence=int(reply[1]), fences=tuple(int(f) for f in reply[2:]))
    if code == -2:
        wait = int(reply[2])
        why, detail = text(reply[3]), text(reply[4])
        holder: dict[str, Any] = {"reason": detail} if why == "paused" else {}
        if why == "limit":
            holder = parse_holder(detail)
        name = text(reply[1]) or slot.name
        return Grant(
            False,
            holder=holder,
            holder_ttl_ms=None if wait < 0 else wait,
            wait_ms=None if wait < 0 else wait,
            refused_by=name,
            refusal=why,
        )
    if code == -3:
        raise cost_above_burst(f"rate {text(reply[1])!r}", int(reply[2]), int(reply[3]))
    return grant_of(reply, permits=slot.permits)


def rule_renewals(items: Sequence[Renewal]) -> tuple[list[Renewal], list[list[int]]]:
    """*items* with the Limits of each item's slot added (same token and lease), and for
    each item the indexes of its own renewal and its Limits' in that list."""
    flat: list[Renewal] = []
    where: list[list[int]] = []
    for item in items:
        own = [len(flat)]
        flat.append(item)
        for rule_item in _rule_items(item):
            own.append(len(flat))
            flat.append(rule_item)
        where.append(own)
    return flat, where


def _rule_items(item: Renewal) -> list[Renewal]:
    """The renewal of each Limit held with *item*'s slot, by the same token, to the same
    lease."""
    return [Renewal(Slot(r.keys, r.limit), item.token, item.ms) for r in item.slot.held_rules]
