"""The Redis backend's flow control (:class:`~celery_redlock.core.backend.FlowControl`): a
slot with rules or under operator control is taken by ``hold_all.lua`` and given back by
``release_all.lua``, which run the slot's own acquire or release script on its keys and
arguments, and do the same for its rules, in one step; the controls are written by
``control.lua`` and read with ``SCAN``.

A Redis Cluster runs a script on one node, on the keys of one hash slot; a name's keys
share its slot (:mod:`~celery_redlock.core.keys`), so a name's controls are read in its
own acquire there too. A run whose rules name keys in other slots sends one
``hold_all.lua`` per slot: the primary's (with the rules that share its slot) and one with
no primary (``'none'``) for each other slot, all written to their nodes before any answer
is read (:class:`~.redis_sent.RedisSent`, on the connection pool of each slot's node), so
the run costs one round trip whatever the slots. When any slot refuses, what the others
granted is given back before the call returns (permits released, Rate units returned),
so the run holds all or nothing once the call returns. Its release goes to each slot the
same way; extend and renewal go to each slot too. A slot that moved to another node since
the client last looked answers MOVED: its script is sent again through the cluster
client, which finds the slot's node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rx

from ..backend_types import (
    RECENT_BYTES,
    Control,
    Grant,
    Renewal,
    Rule,
    Slot,
    Status,
    parse_holder,
    text,
)
from ..errors import cost_above_burst
from ..keys import name_of_key
from .redis_admin import node_of, primaries
from .redis_calls import RedisCalls
from .redis_scripts import CONTROL, HOLD_ALL, RELEASE_ALL, Script, extend_many, grant_of
from .redis_sent import RedisSent

__all__ = ["RedisFlow", "flow_grant", "rule_renewals"]

#: How many arguments of a primary's acquire a rule's hold takes (token, lease, record,
#: wait, fence ttl): what a slot of a cluster with no primary is sent.
_RULE_ARGS = 5


class RedisFlow(RedisCalls):
    """FlowControl on one Redis or a Redis Cluster."""

    def _hold_all(self, slot: Slot, names: list[str], args: list[Any]) -> Any:
        """``hold_all.lua``: the slot's own acquire script (*names*, *args*) with its controls
        and rules (on a cluster, one call per hash slot: see the module)."""
        if self.cluster and slot.rules:
            near, far = self._by_slot(slot, slot.rules)
            if far:
                return self._hold_by_slot(slot, near, far, names, args)
        return self._hold_here(slot, slot.rules, names, args)

    def _hold_here(
        self, slot: Slot, rules: Sequence[Rule], names: list[str], args: list[Any]
    ) -> Any:
        """One ``hold_all.lua``: *slot*'s primary (none when *names* is empty) and *rules*."""
        return self._run(HOLD_ALL, *_hold_call(slot, rules, names, args))

    def _hold_by_slot(
        self,
        slot: Slot,
        near: list[int],
        far: dict[int, list[int]],
        names: list[str],
        args: list[Any],
    ) -> Any:
        """The run's holds on a cluster whose rules span several hash slots, one script per
        slot, all written before any answer is read: a reply as one ``hold_all.lua`` would
        give (the fences in the order of ``slot.rules``). When any slot refuses, what the
        others granted is given back first."""
        groups = [near, *(far[where] for where in sorted(far))]
        calls = [_hold_call(slot, [slot.rules[i] for i in near], names, args)]
        calls += [
            _hold_call(slot, [slot.rules[i] for i in group], [], args[:_RULE_ARGS])
            for group in groups[1:]
        ]
        replies = self._at_once(HOLD_ALL, calls)
        granted = [not isinstance(r, Exception) and int(r[0]) == 1 for r in replies]
        if all(granted):
            fences: dict[int, Any] = {}
            for group, reply in zip(groups, replies, strict=True):
                fences.update(zip(group, reply[2:], strict=True))
            return [1, replies[0][1], *(fences[i] for i in range(len(slot.rules)))]
        taken = [i for group, ok in zip(groups, granted, strict=True) if ok for i in group]
        self._give_back_taken(slot, taken, str(args[0]), int(args[1]))
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return _refusal(replies)

    def _at_once(self, script: Script, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """*script* with each call's keys and arguments, each written on a connection of
        the cluster node that serves its keys' slot before any answer is read: each call's
        reply, or the error it met (a call not sent because an earlier one could not be
        sent: that error). Every answer sent for is read, every connection given back."""
        sent: list[RedisSent] = []
        failed: Exception | None = None
        for keys, argv in calls:
            try:
                sent.append(self._send_now(script, keys, argv))
            except Exception as exc:  # a client-side error: read what was sent, then say so
                failed = exc
                break
        replies: list[Any] = []
        for each in sent:
            try:
                replies.append(each.result())
            except Exception as exc:
                replies.append(exc)
        return replies + [failed] * (len(calls) - len(sent))

    def _send_now(self, script: Script, keys: list[str], argv: list[Any]) -> RedisSent:
        """*script* written now on a connection of the node that serves its keys' slot,
        its answer read later (``result()``); a slot that moved meanwhile is asked again
        through the cluster client, which finds its node."""

        def moved(exc: Exception) -> Any:
            if _moved(exc):
                return self._run(script, keys, argv)
            raise exc

        pool = node_of(self.client, keys[0]).connection_pool
        return RedisSent(pool, script, keys, argv, _same, moved, _nothing)

    def _give_back_taken(self, slot: Slot, taken: list[int], token: str, ttl_ms: int) -> None:
        """Give back a cluster's run that a slot refused (or failed in): its primary and
        Limits (:meth:`_abandon`), and the units of the Rates in *taken* (indexes of
        ``slot.rules``), best effort: what is not given back expires with its lease."""
        self._abandon(slot, token, ttl_ms)
        rates = [i for i in taken if slot.rules[i].is_rate]
        groups: dict[int, list[Rule]] = {}
        for i in rates:
            rule = slot.rules[i]
            groups.setdefault(self.client.keyslot(rule.key), []).append(rule)
        for rules in groups.values():
            keys: list[str] = []
            argv = _primary(slot, [], [token, ttl_ms])
            for rule in rules:
                keys += [rule.key] * 4
                argv += ["rate", rule.interval_us, rule.cost]
            with contextlib.suppress(Exception):
                self._run(RELEASE_ALL, keys, argv)

    def _abandon(self, slot: Slot, token: str, notice_ms: int) -> None:
        """Give back what *token* may hold of *slot* and its rules, best effort, never
        raising (here: after a cluster's slot refused or failed)."""
        raise NotImplementedError  # pragma: no cover - RedisBackend has it

    def _by_slot(self, slot: Slot, rules: Sequence[Rule]) -> tuple[list[int], dict[int, list[int]]]:
        """The indexes of *rules* whose keys share *slot*'s cluster hash slot, and the
        others' by their hash slot."""
        here = self.client.keyslot(slot.keys.lock)
        near: list[int] = []
        far: dict[int, list[int]] = {}
        for i, rule in enumerate(rules):
            where = self.client.keyslot(rule.key)
            if where == here:
                near.append(i)
            else:
                far.setdefault(where, []).append(i)
        return near, far

    def _release_all(self, slot: Slot, names: list[str], args: list[Any]) -> Status:
        """``release_all.lua``: the slot's own release (*names*, *args*) and its Limits'
        (on a cluster, one call per hash slot, sent at once: see :meth:`_at_once`)."""
        held = slot.held_rules
        if not self.cluster:
            return self._release_here(slot, held, names, args)
        near, far = self._by_slot(slot, held)
        if not far:
            return self._release_here(slot, held, names, args)
        calls = [_release_call(slot, [held[i] for i in near], names, args)]
        calls += [_release_call(slot, [held[i] for i in far[w]], [], args[:2]) for w in sorted(far)]
        replies = self._at_once(RELEASE_ALL, calls)  # each given back whatever the others say
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return Status.first_failure([Status.of(code) for reply in replies for code in reply])

    def _release_here(
        self, slot: Slot, rules: Sequence[Rule], names: list[str], args: list[Any]
    ) -> Status:
        """One ``release_all.lua``: *slot*'s primary and its Limits *rules*."""
        codes = self._run(RELEASE_ALL, *_release_call(slot, rules, names, args))
        return Status.first_failure([Status.of(code) for code in codes])

    def _extend_rules(self, slot: Slot, token: str, ms: int) -> Status:
        """Set the lease of *slot*'s Limits held by *token* to *ms*: one script (on a
        cluster, one per hash slot)."""
        items = _rule_items(Renewal(slot, token, ms))
        groups: dict[int, list[Renewal]] = {}
        for item in items:
            where = self.client.keyslot(item.slot.keys.lock) if self.cluster else 0
            groups.setdefault(where, []).append(item)
        codes: list[Status] = []
        for group in groups.values():
            codes += extend_many(self.client, group, self._pool, self._run)
        return Status.first_failure(codes) if codes else Status.OK

    def set_control(self, control_key: str, kind: str, value: str | None, ttl_ms: int) -> bool:
        with self._errors(control_key):
            return bool(self._run(CONTROL, [control_key], [kind, value or "", ttl_ms]))

    def controls(self, prefix: str, pattern: str = "*") -> list[Control]:
        found: list[Control] = []
        with self._errors(prefix):
            for node in primaries(self.client):
                for key in node.scan_iter(match=f"{prefix}{{{pattern}}}:control", count=500):
                    found += self._controls_at(text(key), prefix)
        return sorted(found, key=lambda c: (c.name, c.kind))

    def _controls_at(self, key: str, prefix: str) -> list[Control]:
        pipe = node_of(self.client, key).pipeline(transaction=False)
        pipe.hgetall(key)
        pipe.execute_command("TIME")
        fields, (secs, micros) = pipe.execute()
        now = int(secs) * 1000 + int(micros) // 1000
        name = name_of_key(key, prefix)
        out = []
        for kind, raw in fields.items():
            until, _, value = text(raw).partition("|")
            try:
                end = int(until or 0)
            except ValueError:  # not a control celery-redlock wrote: left alone
                continue
            if end and end <= now:
                continue
            out.append(Control(name, text(kind), value, end - now if end else None))
        return out


def _hold_call(
    slot: Slot, rules: Sequence[Rule], names: list[str], args: list[Any]
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of ``hold_all.lua`` for *slot*'s primary (its acquire's
    *names* and *args*; none when *names* is empty) and *rules*."""
    keys = [*names, slot.keys.control] if names else []
    argv = _primary(slot, names, args)
    for rule in rules:
        keys += [rule.key, rule.key if rule.is_rate else rule.keys.fence, rule.keys.control]
        kind = "rate" if rule.is_rate else "mutex" if rule.is_mutex else "limit"
        size = rule.interval_us if rule.is_rate else rule.limit
        argv += [kind, size, rule.burst, rule.cost, rule.name]
    return keys, argv


def _primary(slot: Slot, names: list[str], args: list[Any]) -> list[Any]:
    """The first arguments of ``hold_all.lua`` and ``release_all.lua``: how many keys the
    primary takes, which script takes it ('none': no primary), and its own arguments."""
    kind = "none" if not names else "permit" if slot.permits else "lock"
    return [len(names), kind, len(args), *args]


def _release_call(
    slot: Slot, rules: Sequence[Rule], names: list[str], args: list[Any]
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of ``release_all.lua`` for *slot*'s primary (its release's
    *names* and *args*; none when *names* is empty) and the Limits *rules*."""
    keys = list(names)
    argv = _primary(slot, names, args)
    for rule in rules:
        keys += [rule.key, rule.keys.notify, rule.keys.waiting, rule.keys.released]
        argv += ["mutex" if rule.is_mutex else "limit", rule.limit, RECENT_BYTES]
    return keys, argv


def _refusal(replies: list[Any]) -> Any:
    """The reply of a cluster's run that some slot refused (*replies*: each slot's, the
    primary's first): the primary's own refusal when its holder refused it; a cost above
    a burst; else the first rule's refusal, with the longest known wait of them all."""
    first = replies[0]
    if int(first[0]) not in {1, -2}:
        return first
    for reply in replies:
        if int(reply[0]) == -3:
            return reply
    refused = [r for r in replies if int(r[0]) == -2]
    waits = [int(r[2]) for r in refused if int(r[2]) >= 0]
    head = refused[0]
    return [-2, head[1], max(waits) if waits else -1, head[3], head[4]]


def _moved(exc: Exception) -> bool:
    """True for a node's answer that the slot is served elsewhere (MOVED, ASK): a
    ``MovedError`` or ``AskError`` where redis-py's parser maps them for a plain
    connection (8.1 does), else a plain ``ResponseError`` whose text says so (5.0)."""
    if isinstance(exc, (rx.MovedError, rx.AskError)):
        return True
    return isinstance(exc, rx.ResponseError) and str(exc).startswith(("MOVED ", "ASK "))


def _same(reply: Any) -> Any:
    return reply


def _nothing(_heard: bool) -> None:
    return None


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
