"""A page of what an operator lists (``celery locks``, the board): which keys match a
query, how many of each kind and state there are, and which of them make the page.

One query's answer is a :class:`Listing`. A store with an index of what it holds (the
Redis backend's, see ``core/backends/redis/lua/index.lua``) answers from the index and
reads only the page's keys; any other store reads everything it holds and hands it to
:func:`select`, which applies the same query the same way.

Each key is one *entry*: a mutex (state ``held``, ``running``, or ``queued``: a run kept
for its message's redelivered copy), a semaphore's permits, an enqueue-time hold (state
``queued``), a rate limiter's state, or a name's controls. The counts are of every key
that matches the pattern, the task id and the worker, whatever the kind and state asked
for (so that they say what each filter would show); the total is of the keys that match
every filter.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .backend_types import Control, LockInfo, RateInfo
from .errors import ConfigError
from .keys import lock_keys

__all__ = [
    "COUNTED",
    "KINDS",
    "SORTS",
    "STATES",
    "Entry",
    "ListQuery",
    "Listing",
    "entries_of",
    "literal_head",
    "select",
]

#: The kinds of key, as the board's filter names them.
KINDS = ("mutex", "semaphore", "queued", "rate", "control")
#: The states a mutex or an enqueue-time hold is in (other kinds have none).
STATES = ("held", "running", "queued")
#: Orders of a page: by key (``name``), or the reverse (``-name``).
SORTS = ("name", "-name")
#: What :attr:`Listing.counts` counts: each kind, and each state of the kinds that have one.
COUNTED = (
    "mutex",
    "mutex:held",
    "mutex:running",
    "mutex:queued",
    "semaphore",
    "queued",
    "rate",
    "control",
)
#: The most entries one page holds.
MAX_LIMIT = 1000
_GLOB = "*?["


@dataclass(frozen=True)
class ListQuery:
    """What to list: a glob over names (``sync:*``), and optional filters by kind, state,
    task id and worker (hostname, as the holder's record says); a page of *limit* entries
    from *offset*, in *sort* order."""

    pattern: str = "*"
    kind: str = ""
    state: str = ""
    task_id: str = ""
    worker: str = ""
    offset: int = 0
    limit: int = 50
    sort: str = "name"

    def __post_init__(self) -> None:
        if self.kind and self.kind not in KINDS:
            raise ConfigError(f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.state and self.state not in STATES:
            raise ConfigError(f"state {self.state!r} is not one of {', '.join(STATES)}")
        if self.sort not in SORTS:
            raise ConfigError(f"sort {self.sort!r} is not one of {', '.join(SORTS)}")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ConfigError(f"offset must be a whole number >= 0, got {self.offset!r}")
        if not isinstance(self.limit, int) or not 1 <= self.limit <= MAX_LIMIT:
            raise ConfigError(f"limit must be a whole number 1-{MAX_LIMIT}, got {self.limit!r}")

    @property
    def needs_records(self) -> bool:
        """Whether the filters read the holders' records (task id, worker)."""
        return bool(self.task_id or self.worker)

    def wants(self, kind: str, state: str) -> bool:
        """Whether an entry of *kind* in *state* passes the kind and state filters."""
        if self.kind and kind != self.kind:
            return False
        return not self.state or state == self.state


@dataclass(frozen=True)
class Entry:
    """One key as a listing sees it: its key, name, kind and state ("" for none)."""

    key: str
    name: str
    kind: str
    state: str = ""


@dataclass
class Listing:
    """One page of a query: what its keys hold, how many keys match, and the counts."""

    #: The page's locks, permits and queued hold (``celery locks list`` objects).
    locks: list[LockInfo] = field(default_factory=list)
    rates: list[RateInfo] = field(default_factory=list)
    controls: list[Control] = field(default_factory=list)
    #: The page's entries, in page order.
    entries: list[Entry] = field(default_factory=list)
    #: How many keys match every filter (the pages together).
    total: int = 0
    #: Keys by kind and by kind and state (:data:`COUNTED`), of every key matching the
    #: pattern, task id and worker.
    counts: dict[str, int] = field(default_factory=dict)


def literal_head(pattern: str) -> tuple[str, bool]:
    """The text every name matching the glob *pattern* starts with, and whether the
    pattern is that text then ``*`` (a prefix: no name needs matching one by one)."""
    cut = min((i for i, c in enumerate(pattern) if c in _GLOB), default=len(pattern))
    head = pattern[:cut]
    return head, pattern == head + "*"


def count(entries: Iterable[Entry]) -> dict[str, int]:
    """The :attr:`Listing.counts` of *entries*."""
    out = dict.fromkeys(COUNTED, 0)
    for entry in entries:
        out[entry.kind] += 1
        if entry.kind == "mutex":
            out[f"mutex:{entry.state}"] += 1
    return out


def page(entries: Sequence[Entry], query: ListQuery) -> list[Entry]:
    """The entries of *query*'s page from every entry that passes its filters."""
    ordered = sorted(entries, key=lambda e: e.key, reverse=query.sort == "-name")
    return ordered[query.offset : query.offset + query.limit]


def matches_record(record: dict[str, object], query: ListQuery) -> bool:
    """Whether a holder *record* passes *query*'s task id and worker filters."""
    if query.task_id and str(record.get("task_id") or "") != query.task_id:
        return False
    return not query.worker or str(record.get("hostname") or "") == query.worker


def entries_of(
    prefix: str,
    locks: Sequence[LockInfo],
    rates: Sequence[RateInfo],
    controls: Sequence[Control],
) -> dict[Entry, tuple[list[LockInfo], list[RateInfo], list[Control]]]:
    """What a store holds, by entry (a semaphore's permits are one entry)."""
    out: dict[Entry, tuple[list[LockInfo], list[RateInfo], list[Control]]] = {}
    for info in locks:
        if info.kind == "permit":
            entry = Entry(info.key, info.name, "semaphore")
        elif info.key.endswith(":queued"):
            entry = Entry(info.key, info.name, "queued", "queued")
        else:
            entry = Entry(info.key, info.name, "mutex", info.state)
        out.setdefault(entry, ([], [], []))[0].append(info)
    for rate in rates:
        out.setdefault(Entry(rate.key, rate.name, "rate"), ([], [], []))[1].append(rate)
    for control in controls:
        key = lock_keys(control.name, prefix).control
        out.setdefault(Entry(key, control.name, "control"), ([], [], []))[2].append(control)
    return out


def select(
    prefix: str,
    locks: Sequence[LockInfo],
    rates: Sequence[RateInfo],
    controls: Sequence[Control],
    query: ListQuery,
) -> Listing:
    """*query* over everything a store holds under the pattern (what a store without an
    index answers with)."""
    held = entries_of(prefix, locks, rates, controls)
    kept = [
        e
        for e, (infos, _, _) in held.items()
        if fnmatch.fnmatchcase(e.name, query.pattern)
        and (not query.needs_records or any(matches_record(i.record, query) for i in infos))
    ]
    chosen = [e for e in kept if query.wants(e.kind, e.state)]
    shown = page(chosen, query)
    out = Listing(entries=shown, total=len(chosen), counts=count(kept))
    for entry in shown:
        infos, found_rates, found_controls = held[entry]
        out.locks += infos
        out.rates += found_rates
        out.controls += found_controls
    return out
