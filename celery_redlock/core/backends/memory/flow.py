"""The memory backend's flow control (:class:`~celery_redlock.core.backend.FlowControl`)
on its store, step for step as ``hold_all.lua`` and ``control.lua`` do it on Redis: the
controls of every name, then every rule checked, then the slot and its rules taken. Each
function runs inside a verb of :class:`~.backend.MemoryBackend` (under the store's lock,
at its clock: :func:`~.store.atomic`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...backend_types import Control, Grant, Rule, Slot, parse_holder
from ...errors import cost_above_burst
from ...keys import name_of_key
from .store import MemoryStore, stored_int

__all__ = ["TakeSlot", "controls_at", "controls_under", "flow_acquire", "set_control"]

#: The verbs' own steps a flow acquire runs (the memory backend's): take the slot as its
#: acquire does (with its permits' limit as an operator set it, or None: its own).
TakeSlot = Callable[[int | None], Grant]


def controls_at(store: MemoryStore, key: str) -> dict[str, tuple[float, str]]:
    """The controls in force at *key*: kind -> (until: store ms, 0 none; value)."""
    found: dict[str, tuple[float, str]] = {}
    for kind, raw in (store.get(key, "hash") or {}).items():
        until, _, value = raw.partition("|")
        end = float(until or 0)
        if not end or end > store.now:
            found[kind] = (end, value)
    return found


def flow_acquire(
    store: MemoryStore,
    slot: Slot,
    token: str,
    take: TakeSlot,
    rule_take: Callable[[Rule, int], int],
) -> Grant:
    """hold_all.lua: *take* takes the slot for *token*, *rule_take* one Limit (its
    permit of that many, or its mutex) and gives its fence. A re-sent copy (the slot
    already *token*'s) is not refused and takes no Rate unit again."""
    mine: dict[str, str] = store.get(slot.keys.lock, "hash") or {}
    resent = token in mine if slot.permits else mine.get("token") == token
    refusals: list[tuple[str, float, str, str]] = []

    def paused(controls: dict[str, tuple[float, str]], name: str) -> None:
        pause = controls.get("pause")
        if pause is not None:
            wait = -1.0 if not pause[0] else pause[0] - store.now
            refusals.append((name, wait, "paused", pause[1]))

    main = controls_at(store, slot.keys.control)
    paused(main, slot.name)
    own_limit = int(main["limit"][1]) if slot.permits and "limit" in main else None
    now_us = round(store.now * 1000)
    plan: list[tuple[Rule, int, int, int]] = []  # rule, limit or interval, burst, tat
    for rule in slot.rules:
        controls = controls_at(store, rule.keys.control)
        paused(controls, rule.name)
        if rule.is_mutex:  # the lock of its name; a permit frees when its holder ends
            held: dict[str, str] = store.get(rule.key, "hash") or {}
            if held.get("token") not in (None, token):
                refusals.append((rule.name, -1.0, "limit", held.get("info") or ""))
            plan.append((rule, 1, 0, 0))
            continue
        if not rule.is_rate:
            limit = int(controls["limit"][1]) if "limit" in controls else rule.limit
            live = store.live_permits(rule.key)
            if len(live) >= limit:
                refusals.append((rule.name, -1.0, "limit", live[0][3]))
            plan.append((rule, limit, 0, 0))
            continue
        interval, burst = rule.interval_us, rule.burst
        if "rate" in controls:
            given, most = controls["rate"][1].split("|")[:2]
            interval, burst = int(given), int(most) or burst
        if rule.cost > burst:
            raise cost_above_burst(f"rate {rule.name!r}", rule.cost, burst)
        state: dict[str, str] = store.get(rule.key, "hash") or {}
        tat = max(stored_int(state.get("tat")) or 0, now_us)
        at = tat + (rule.cost - burst) * interval
        if at > now_us:
            refusals.append((rule.name, math.ceil((at - now_us) / 1000), "rate", ""))
        plan.append((rule, interval, burst, tat))
    if refusals and not resent:
        name, _, why, detail = refusals[0]
        waits = [w for _, w, _, _ in refusals]
        known = [w for w in waits if w >= 0]
        wait = None if not known else math.ceil(max(known))
        holder: dict[str, Any] = {"reason": detail} if why == "paused" else {}
        if why == "limit":
            holder = parse_holder(detail)
        return Grant(
            False,
            holder=holder,
            holder_ttl_ms=wait,
            wait_ms=wait,
            refused_by=name,
            refusal=why,
        )
    grant = take(own_limit)
    if not grant.acquired:
        return grant
    fences: list[int] = []
    for rule, size, burst, was in plan:
        if not rule.is_rate:
            fences.append(rule_take(rule, size))
            continue
        if resent:
            fences.append(0)
            continue
        tat = was + rule.cost * size
        hold = store.writable_hash(rule.key)
        hold.update(tat=str(tat), interval=str(size), burst=str(burst))
        line = stored_int(hold.get("line")) or 0
        store.expire(rule.key, math.ceil((max(tat, line) - now_us) / 1000) + 1)
        fences.append(0)
    return Grant(True, fence=grant.fence, fences=tuple(fences))


def set_control(store: MemoryStore, key: str, kind: str, value: str | None, ttl_ms: int) -> bool:
    """control.lua."""
    hold: dict[str, str] = store.get(key, "hash") or {}
    if value is None:
        changed = hold.pop(kind, None) is not None
    else:
        hold = store.writable_hash(key)
        hold[kind] = f"{store.now + ttl_ms if ttl_ms > 0 else 0}|{value}"
        changed = True
    ends = []
    for field in list(hold):
        end = float(hold[field].partition("|")[0] or 0)
        if end and end <= store.now:
            del hold[field]
        else:
            ends.append(end)
    if not hold:
        store.entries.pop(key, None)
    elif 0 in ends:
        store.entries[key].expires = None
    else:
        store.expire(key, max(ends) - store.now)
    return changed


def controls_under(store: MemoryStore, prefix: str, match: Callable[[str], bool]) -> list[Control]:
    found = []
    for key in list(store.entries):
        if not key.startswith(prefix + "{") or not key.endswith("}:control"):
            continue
        name = name_of_key(key, prefix)
        if not match(name):
            continue
        for kind, (end, value) in controls_at(store, key).items():
            left = math.ceil(end - store.now) if end else None
            found.append(Control(name, kind, value, left))
    return sorted(found, key=lambda c: (c.name, c.kind))
