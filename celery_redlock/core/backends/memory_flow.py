"""The memory backend's flow control (:class:`~celery_redlock.core.backend.FlowControl`),
step for step as ``hold_all.lua``, ``release_all.lua`` and ``control.lua`` do it on Redis:
the controls of every name, then every rule checked, then the slot and its rules taken.
The steps run inside a verb of :class:`~.memory.MemoryBackend` (under the store's lock,
at its clock)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..backend_types import Control, Grant, Rule, Slot, Status, parse_holder
from ..errors import cost_above_burst
from ..keys import name_of_key
from .memory_store import MemoryStore, stored_int

__all__ = ["MemoryFlow"]

#: The verbs' own steps a flow acquire runs (the memory backend's): take the slot as its
#: acquire does (with its permits' limit as an operator set it, or None: its own).
TakeSlot = Callable[[int | None], Grant]


class MemoryFlow(MemoryStore):
    """FlowControl in this process: the steps :class:`~.memory.MemoryBackend` runs for a
    slot with rules or controls, on its own lock verbs' steps."""

    def _release(
        self, slot: Slot, token: str, notice_ms: int, done: tuple[str, int] | None
    ) -> Status:
        """release.lua / permit_release.lua (the memory backend's)."""
        raise NotImplementedError

    def _extend(self, slot: Slot, token: str, ms: int, replace: bool) -> int | Status:
        """extend.lua / permit_extend.lua (the memory backend's)."""
        raise NotImplementedError

    def _controls(self, key: str) -> dict[str, tuple[float, str]]:
        """The controls in force at *key*: kind -> (until: store ms, 0 none; value)."""
        found: dict[str, tuple[float, str]] = {}
        for kind, raw in (self.get(key, "hash") or {}).items():
            until, _, value = raw.partition("|")
            end = float(until or 0)
            if not end or end > self.now:
                found[kind] = (end, value)
        return found

    def _flow_acquire(
        self, slot: Slot, token: str, take: TakeSlot, rule_take: Callable[[Rule, int], int]
    ) -> Grant:
        """hold_all.lua: *take* takes the slot for *token*, *rule_take* one Limit (its
        permit of that many, or its mutex) and gives its fence. A re-sent copy (the slot
        already *token*'s) is not refused and takes no Rate unit again."""
        mine: dict[str, str] = self.get(slot.keys.lock, "hash") or {}
        resent = token in mine if slot.permits else mine.get("token") == token
        refusals: list[tuple[str, float, str, str]] = []

        def paused(controls: dict[str, tuple[float, str]], name: str) -> None:
            pause = controls.get("pause")
            if pause is not None:
                wait = -1.0 if not pause[0] else pause[0] - self.now
                refusals.append((name, wait, "paused", pause[1]))

        main = self._controls(slot.keys.control)
        paused(main, slot.name)
        own_limit = int(main["limit"][1]) if slot.permits and "limit" in main else None
        now_us = round(self.now * 1000)
        plan: list[tuple[Rule, int, int, int]] = []  # rule, limit or interval, burst, tat
        for rule in slot.rules:
            controls = self._controls(rule.keys.control)
            paused(controls, rule.name)
            if rule.is_mutex:  # the lock of its name; a permit frees when its holder ends
                held: dict[str, str] = self.get(rule.key, "hash") or {}
                if held.get("token") not in (None, token):
                    refusals.append((rule.name, -1.0, "limit", held.get("info") or ""))
                plan.append((rule, 1, 0, 0))
                continue
            if not rule.is_rate:
                limit = int(controls["limit"][1]) if "limit" in controls else rule.limit
                live = self.live_permits(rule.key)
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
            state: dict[str, str] = self.get(rule.key, "hash") or {}
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
            hold = self.writable_hash(rule.key)
            hold.update(tat=str(tat), interval=str(size), burst=str(burst))
            line = stored_int(hold.get("line")) or 0
            self.expire(rule.key, math.ceil((max(tat, line) - now_us) / 1000) + 1)
            fences.append(0)
        return Grant(True, fence=grant.fence, fences=tuple(fences))

    def _set_control(self, key: str, kind: str, value: str | None, ttl_ms: int) -> bool:
        """control.lua."""
        hold: dict[str, str] = self.get(key, "hash") or {}
        if value is None:
            changed = hold.pop(kind, None) is not None
        else:
            hold = self.writable_hash(key)
            hold[kind] = f"{self.now + ttl_ms if ttl_ms > 0 else 0}|{value}"
            changed = True
        ends = []
        for field in list(hold):
            end = float(hold[field].partition("|")[0] or 0)
            if end and end <= self.now:
                del hold[field]
            else:
                ends.append(end)
        if not hold:
            self.entries.pop(key, None)
        elif 0 in ends:
            self.entries[key].expires = None
        else:
            self.expire(key, max(ends) - self.now)
        return changed

    def _controls_under(self, prefix: str, match: Callable[[str], bool]) -> list[Control]:
        found = []
        for key in list(self.entries):
            if not key.startswith(prefix + "{") or not key.endswith("}:control"):
                continue
            name = name_of_key(key, prefix)
            if not match(name):
                continue
            for kind, (end, value) in self._controls(key).items():
                left = math.ceil(end - self.now) if end else None
                found.append(Control(name, kind, value, left))
        return sorted(found, key=lambda c: (c.name, c.kind))

    def _release_rules(self, slot: Slot, token: str, notice_ms: int) -> list[Status]:
        """release_all.lua's rule part: each Limit held by *token* given back, as its own
        release does."""
        return [
            self._release(Slot(rule.keys, rule.limit), token, notice_ms, None)
            for rule in slot.held_rules
        ]

    def _extend_rules(self, slot: Slot, token: str, ms: int) -> list[Status]:
        """Each Limit held by *token* set to *ms* (extend_items.lua)."""
        out = []
        for rule in slot.held_rules:
            found = self._extend(Slot(rule.keys, rule.limit), token, ms, True)
            out.append(found if isinstance(found, Status) else Status.OK)
        return out
