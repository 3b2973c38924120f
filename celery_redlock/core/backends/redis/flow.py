"""Flow control's scripts on the Redis backend: the keys and arguments of
``hold_all.lua`` and ``release_all.lua`` (which run the slot's own acquire or release
script on its keys and arguments, and do the same for its rules, in one step: a slot
with rules), and how a cluster's replies of several slots read as one
(:func:`~.verbs.grant_of` reads an acquire's). :class:`~.backend.RedisBackend` runs them,
one per hash slot on a cluster (see its module docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis import exceptions as rx

from ...backend_types import RECENT_BYTES, Renewal, Rule, Slot

__all__ = [
    "RULE_ARGS",
    "deciding_reply",
    "hold_call",
    "moved",
    "primary_args",
    "release_call",
    "rule_items",
    "rule_renewals",
]

#: How many arguments of a primary's acquire a rule's hold takes (token, lease, record,
#: wait, fence ttl): what a slot of a cluster with no primary is sent.
RULE_ARGS = 5


def hold_call(
    slot: Slot, rules: Sequence[Rule], names: list[str], args: list[Any]
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of ``hold_all.lua`` for *slot*'s primary (its acquire's
    *names* and *args*; none when *names* is empty) and *rules*."""
    keys = [*names, slot.keys.control] if names else []
    argv = primary_args(slot, names, args)
    for rule in rules:
        keys += [rule.key, rule.key if rule.is_rate else rule.keys.fence, rule.keys.control]
        kind = "rate" if rule.is_rate else "mutex" if rule.is_mutex else "limit"
        size = rule.interval_us if rule.is_rate else rule.limit
        argv += [kind, size, rule.burst, rule.cost, rule.name]
    return keys, argv


def primary_args(slot: Slot, names: list[str], args: list[Any]) -> list[Any]:
    """The first arguments of ``hold_all.lua`` and ``release_all.lua``: how many keys the
    primary takes, which script takes it ('none': no primary), and its own arguments."""
    kind = "none" if not names else "permit" if slot.permits else "lock"
    return [len(names), kind, len(args), *args]


def release_call(
    slot: Slot, rules: Sequence[Rule], names: list[str], args: list[Any]
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of ``release_all.lua`` for *slot*'s primary (its release's
    *names* and *args*; none when *names* is empty) and the Limits *rules*."""
    keys = list(names)
    argv = primary_args(slot, names, args)
    for rule in rules:
        keys += [rule.key, rule.keys.notify, rule.keys.waiting, rule.keys.released]
        argv += ["mutex" if rule.is_mutex else "limit", rule.limit, RECENT_BYTES]
    return keys, argv


def deciding_reply(replies: list[Any]) -> Any:
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


def moved(exc: Exception) -> bool:
    """True for a node's answer that the slot is served elsewhere (MOVED, ASK): a
    ``MovedError`` or ``AskError`` where redis-py's parser maps them for a plain
    connection (8.1 does), else a plain ``ResponseError`` whose text says so (5.0)."""
    if isinstance(exc, (rx.MovedError, rx.AskError)):
        return True
    return isinstance(exc, rx.ResponseError) and str(exc).startswith(("MOVED ", "ASK "))


def rule_renewals(items: Sequence[Renewal]) -> tuple[list[Renewal], list[list[int]]]:
    """*items* with the Limits of each item's slot added (same token and lease), and for
    each item the indexes of its own renewal and its Limits' in that list."""
    flat: list[Renewal] = []
    where: list[list[int]] = []
    for item in items:
        own = [len(flat)]
        flat.append(item)
        for rule_item in rule_items(item):
            own.append(len(flat))
            flat.append(rule_item)
        where.append(own)
    return flat, where


def rule_items(item: Renewal) -> list[Renewal]:
    """The renewal of each Limit held with *item*'s slot, by the same token, to the same
    lease."""
    return [Renewal(Slot(r.keys, r.limit), item.token, item.ms) for r in item.slot.held_rules]
