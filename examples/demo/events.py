"""What the demo collected, and what it means: runs per task, per-key counts, checks.

Everything here works on the list of event dicts read from ``demo:events`` (see
``demoapp.py``) plus the demo's own ``publish`` / ``kill`` / ``dedup`` / ``log``
events; both the live view and the final report use it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]


def short(task_id: str | None) -> str:
    """The first 6 characters of a task id (enough to tell runs apart on screen)."""
    return (task_id or "?")[:6]


def fence_text(fence: int | None) -> str:
    """A fence as its last 4 digits: fences are large numbers (see docs/redlock.md)."""
    return "-" if fence is None else f"…{int(fence) % 10_000:04d}"


@dataclass
class Run:
    """One task id's life on one key: queued, waiting, running, and how it ended."""

    task_id: str
    key: str
    task: str = ""
    published: float | None = None
    #: First time the run found the key held (retry / skip), or began a blocking wait.
    first_refused: float | None = None
    refusals: int = 0
    #: When its lock event ``acquired`` was recorded: the grant, before the body starts.
    granted: float | None = None
    start: float | None = None
    end: float | None = None
    fence: int | None = None
    pid: int | None = None
    worker: str = ""
    skipped: bool = False
    crashed_at: float | None = None
    waited: float = 0.0

    @property
    def ran(self) -> bool:
        """The body started."""
        return self.start is not None

    def interval(self) -> tuple[float, float] | None:
        """When the body held the key: start to end, or to the crash."""
        if self.start is None:
            return None
        stop = self.end if self.end is not None else self.crashed_at
        return None if stop is None else (self.start, stop)


@dataclass
class Story:
    """The whole demo, rebuilt from its events."""

    runs: dict[str, Run] = field(default_factory=dict)
    #: key -> [(time, task id)] of publishes answered with an existing run (de-duplicated).
    dedups: dict[str, list[tuple[float, str]]] = field(default_factory=lambda: defaultdict(list))
    #: key -> [(start, end)] of non-task holds (the beat leader lock).
    holds: dict[str, list[tuple[float, float | None]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    kills: list[Event] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)

    def _key(self, key: str) -> None:
        if key and key not in self.keys:
            self.keys.append(key)

    def _run(self, event: Event) -> Run:
        task_id = event["task_id"]
        run = self.runs.get(task_id)
        if run is None:
            run = self.runs[task_id] = Run(task_id, event.get("key") or "")
        if event.get("key") and not run.key:
            run.key = event["key"]
        if event.get("task") and not run.task:
            run.task = event["task"]
        return run

    def add(self, event: Event, policies: Mapping[str, str]) -> None:
        """Fold one event in (events arrive in about time order, per process exactly)."""
        kind, t = event.get("kind"), float(event.get("t") or 0.0)
        key = event.get("key") or ""
        self._key(key)
        if kind in ("dedup", "duplicate"):  # a publish answered with the run already queued
            self.dedups[key].append((t, event.get("task_id") or ""))
            return
        if kind == "kill":
            self.kills.append(event)
            run = self.runs.get(event.get("task_id") or "")
            if run is not None:
                run.crashed_at = t
            return
        if not event.get("task_id"):
            if kind == "acquired":
                self.holds[key].append((t, None))
            elif kind in ("released", "lost") and self.holds[key]:
                start, _ = self.holds[key][-1]
                self.holds[key][-1] = (start, t)
            return
        run = self._run(event)
        if kind == "publish":
            run.published = t
        elif kind in ("contended", "rate_limited"):
            policy = policies.get(run.task)
            if policy != "wait":  # a waiting run is counted by its wait, not as a retry
                run.refusals += 1
            if run.first_refused is None:
                run.first_refused = t
            if policy == "skip":
                run.skipped = True
        elif kind == "superseded":  # a queued call replaced by a newer one: skipped
            run.refusals += 1
            run.skipped = True
            run.first_refused = run.first_refused or t
        elif kind == "acquired":
            run.granted = run.granted or t
            waited = float(event.get("waited") or 0.0)
            run.waited = max(run.waited, waited)
            if waited > 0.05 and run.first_refused is None:
                run.first_refused = t - waited
        elif kind == "start":
            run.start, run.fence = t, event.get("fence")
            run.pid, run.worker = event.get("pid"), event.get("worker") or ""
        elif kind == "end":
            run.end = t

    def on_key(self, key: str) -> list[Run]:
        """The runs of *key*, by the time they first showed up."""
        return sorted(
            (r for r in self.runs.values() if r.key == key),
            key=lambda r: r.start or r.first_refused or r.published or 0.0,
        )


def build(events: Iterable[Event], policies: Mapping[str, str]) -> Story:
    """A :class:`Story` of *events* (sorted by time first)."""
    story = Story()
    for event in sorted(events, key=lambda e: float(e.get("t") or 0.0)):
        story.add(event, policies)
    return story


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The largest number of *intervals* open at one instant (ends close before starts)."""
    points = []
    for start, end in intervals:
        points.append((start, 1))
        points.append((end, -1))
    points.sort(key=lambda p: (p[0], p[1]))
    most = current = 0
    for _, step in points:
        current += step
        most = max(most, current)
    return most


def lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """A sub-row per interval so that overlapping ones never share a row (greedy)."""
    rows: list[float] = []  # each row's last end
    out = []
    for start, end in intervals:
        for index, last in enumerate(rows):
            if last <= start:
                rows[index] = end
                out.append(index)
                break
        else:
            rows.append(end)
            out.append(len(rows) - 1)
    return out
