"""How ``celery locks`` shows what it read: a row per held lock (:class:`LockRow`), the
tables of ``list``, the details of ``show`` and the documented ``--json`` objects."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..core.admin import LockInfo, RateInfo
from ..core.backend_types import Control

__all__ = [
    "LockRow",
    "control_json",
    "control_table",
    "dequeue_said",
    "lock_details",
    "lock_table",
    "rate_details",
    "rate_json",
    "rate_table",
    "release_notes",
    "task_of",
]


@dataclass
class LockRow:
    """One held lock on one master."""

    name: str
    key: str
    fence: int | None
    ttl_ms: int
    record: dict[str, Any] = field(default_factory=dict)
    master: str | None = None
    #: ``"lock"``, or ``"permit"`` (one permit of a semaphore: one row per permit).
    kind: str = "lock"
    #: "running", "held", or "queued" (an enqueue-time hold: the message is not started).
    state: str = "held"

    @classmethod
    def of(cls, info: LockInfo, master: str | None) -> LockRow:
        """The row for what one master (*master*: its address, Redlock only) stores."""
        return cls(
            info.name,
            info.key,
            info.fence,
            info.ttl_ms,
            dict(info.record),
            master,
            info.kind,
            info.state,
        )

    @property
    def acquired_at(self) -> float | None:
        """Wall-clock time of the acquisition (or of the publish, for a queued hold), as
        the holder recorded it (None when the record holds no plausible time: foreign
        data may hold anything)."""
        value = self.record.get("queued_at" if self.state == "queued" else "acquired_at")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        stamp = float(value)
        return stamp if 0 < stamp < _LATEST else None

    @property
    def holder(self) -> dict[str, Any]:
        """The documented holder fields (each a JSON scalar: see _scalar)."""
        return {k: _scalar(self.record.get(k)) for k in ("task_name", "task_id", "hostname", "pid")}

    def as_json(self, with_master: bool) -> dict[str, Any]:
        """The documented ``--json`` object."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "name": self.name,
            "key": self.key,
            "state": self.state,
            "holder": self.holder,
            "acquired_at": self.acquired_at,
            "ttl_ms": self.ttl_ms,
            "fence": self.fence,
        }
        if with_master:
            out["master"] = self.master
        return out


def rate_json(info: RateInfo) -> dict[str, Any]:
    """A rate limiter's ``--json`` object (``kind: "rate"``)."""
    return {
        "kind": "rate",
        "name": info.name,
        "key": info.key,
        "rate": info.rate,
        "burst": info.burst,
        "free": info.free,
        "next_ms": info.next_ms,
        "queued": info.queued,
        "ttl_ms": info.ttl_ms,
    }


def rate_table(rates: Sequence[RateInfo]) -> str:
    lines = [["NAME", "RATE", "BURST", "FREE NOW", "NEXT IN", "QUEUED"]]
    for info in rates:
        lines.append(
            [
                _cell(info.name),
                info.rate,
                str(info.burst),
                str(info.free),
                _duration(info.next_ms / 1000) if info.next_ms else "now",
                str(info.queued),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def control_value(c: Control) -> str:
    """What a control says, in words: the reason of a pause, a limit, a rate."""
    if c.kind == "rate":
        interval, burst, *written = c.value.split("|")
        text = written[0] if written else f"1 per {int(interval) / 1e6:g}s"
        return f"{text}, burst {burst}" if burst not in ("", "0") else text
    return c.value


def control_json(c: Control) -> dict[str, Any]:
    """One control as ``celery locks list --json`` prints it."""
    return {
        "name": c.name,
        "kind": "control",
        "control": c.kind,
        "value": control_value(c),
        "ttl_ms": c.ttl_ms,
    }


def control_table(controls: Sequence[Control]) -> str:
    lines = [["NAME", "CONTROL", "VALUE", "LEFT"]]
    for c in controls:
        left = "until lifted" if c.ttl_ms is None else _duration(c.ttl_ms / 1000)
        lines.append([_cell(c.name), c.kind, _cell(control_value(c)), left])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def rate_details(info: RateInfo) -> str:
    pairs = [
        ("name", info.name),
        ("key", info.key),
        ("kind", "rate limiter"),
        ("rate", f"{info.rate}, burst {info.burst}"),
        ("free now", str(info.free)),
        ("next in", _duration(info.next_ms / 1000) if info.next_ms else "now"),
        ("queued", f"{info.queued} runs promised a slot"),
        ("idle in", _ttl(info.ttl_ms)),
    ]
    pairs = [(_cell(k), _cell(v)) for k, v in pairs]
    width = max(len(k) for k, _ in pairs) + 1
    return "\n".join(f"{(k + ':').ljust(width)} {v}" for k, v in pairs)


def lock_table(rows: Sequence[LockRow], with_master: bool) -> str:
    now = time.time()
    header = ["NAME", "STATE", "HOLDER", "HOST", "PID", "HELD FOR", "TTL", "FENCE"]
    if with_master:
        header.append("MASTER")
    lines = [header]
    for r in rows:
        line = [
            r.name,
            r.state,
            _who(r.record),
            str(r.record.get("hostname") or "-"),
            str(r.record.get("pid") or "-"),
            _duration(now - r.acquired_at) if r.acquired_at else "-",
            _ttl(r.ttl_ms),
            "-" if r.fence is None else str(r.fence),
        ]
        if with_master:
            line.append(r.master or "-")
        lines.append([_cell(cell) for cell in line])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def lock_details(r: LockRow) -> str:
    now = time.time()
    pairs: list[tuple[str, str]] = [("name", r.name), ("key", r.key)]
    if r.kind != "lock":
        pairs.append(("kind", r.kind))
    if r.master:
        pairs.append(("master", r.master))
    pairs.append(("state", r.state))
    pairs.append(("holder", _who(r.record)))
    for field_name in ("task_name", "task_id", "hostname", "pid"):
        pairs.append((field_name, str(r.record.get(field_name) or "-")))
    if r.acquired_at:
        stamp = datetime.fromtimestamp(r.acquired_at).isoformat(sep=" ", timespec="seconds")
        label = "queued_at" if r.state == "queued" else "acquired_at"
        pairs.append((label, f"{stamp} ({_duration(now - r.acquired_at)} ago)"))
    pairs += [("ttl left", _ttl(r.ttl_ms)), ("fence", "-" if r.fence is None else str(r.fence))]
    shown = {"task_name", "task_id", "hostname", "pid", "acquired_at", "queued_at"}
    pairs += [(str(k), str(v)) for k, v in sorted(r.record.items()) if k not in shown]
    pairs = [(_cell(k), _cell(v)) for k, v in pairs]
    width = max(len(k) for k, _ in pairs) + 1
    return "\n".join(f"{(k + ':').ljust(width)} {v}" for k, v in pairs)


def _who(record: dict[str, Any]) -> str:
    if record.get("task_name"):
        tid = record.get("task_id")
        return f"{record['task_name']}[{tid}]" if tid else str(record["task_name"])
    return str(record.get("role") or "-")


#: acquired_at values past this (the year 9999) are not shown as times: not a real record.
_LATEST = 253402300799.0
#: Longest text shown in one table cell or detail line; the rest is cut (foreign records
#: may hold megabytes).
_CELL = 200


def _cell(text: str) -> str:
    """*text* on one line, cut to _CELL characters."""
    text = " ".join(text.split()) if any(c in text for c in "\r\n\t") else text
    if len(text) <= _CELL:
        return text
    return f"{text[:_CELL]}... ({len(text)} characters)"


def _scalar(value: Any) -> Any:
    """A JSON scalar for the ``--json`` holder fields: what is not one (a list, a NaN) is
    shown as its text, so the output stays strict JSON."""
    if value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return _cell(json.dumps(value, default=str))


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _ttl(ms: int) -> str:
    if ms == -1:
        return "no expiry"
    if ms < 0:
        return "gone"
    return _duration(ms / 1000)


def task_of(done: Any) -> str:
    """The task id in the record of what a forced release removed ("?" if none)."""
    return str(done.record.get("task_id") or "?")


#: What releasing a queued hold means, for the prompt and the line after it.
QUEUED_HOLD = (
    "a queued hold is taken at publish (lock_on='enqueue') for a message that has not "
    "started running; releasing it lets the next call publish again (a message of it "
    "still queued runs as well)"
)


def release_notes(rows: Sequence[LockRow]) -> str:
    """What releasing *rows* does, for the confirmation prompt: a running holder keeps
    running; a queued hold only lets the next call be published."""
    notes = []
    if any(r.state != "queued" for r in rows):
        notes.append("the holder keeps running and may overlap with the next owner")
    if any(r.state == "queued" for r in rows):
        notes.append(QUEUED_HOLD)
    text = "; ".join(notes)
    return text[:1].upper() + text[1:]


def dequeue_said(done: Any, name: str, where: str = "") -> str:
    """What an operator is told of a removed (or not removed) queued hold of *name*."""
    on = f" on {where}" if where else ""
    task = task_of(done)
    if done.outcome == "released":
        return (
            f"released the queued hold of {name!r}{on}: it was taken at publish for task "
            f"{task}, whose message had not started running; the next call of {name!r} "
            "publishes again"
        )
    if done.outcome == "gone":
        return (
            f"the queued hold of {name!r}{on} was already gone (its message started, or it expired)"
        )
    return f"the queued hold of {name!r}{on} is now task {task}'s, not the one shown; left alone"
