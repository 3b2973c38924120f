"""Who held what, as a picture: the recent lock events drawn as an SVG timeline.

A lane per key (a semaphore: a lane per permit in use at once), a bar per run from
acquired to released, coloured by how the run went, its fence written on the bar; a
refused run (re-queued, skipped, de-duplicated) is a tick where it was refused. The
board draws it itself from the event log (:mod:`celery_redlock.app.event_log`): no
script, no CDN. Colours are classes that ``board.css`` sets for light and dark; the
picture scales to its container's width (``viewBox``), so it reads on a phone too.

Outcomes (the class of a bar or tick, and its legend):

============== =========================================================================
ran            acquired and released, without waiting
waited         released, after waiting for the lock more than :data:`WAITED` seconds
running        acquired and not released yet: the bar runs to now
lost           the lease was lost while the run held it (expired, taken over)
force-released an operator released it: the board records a ``forced`` event when it
               does; a ``lost`` event whose error names the operator counts too
re-queued      a run refused the lock, sent back to the queue (``policy`` "retry",
               "requeue" or "queue" on the event)
skipped        a run refused the lock and dropped (``policy`` "skip" on the event)
refused        a run refused the lock whose event says no policy (older events)
duplicate      a publish found the key held: nothing was sent
============== =========================================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

__all__ = ["WAITED", "WINDOW", "Bar", "Tick", "bars_of", "refusal", "timeline_svg"]

#: Seconds of waiting after which a run counts as one that waited.
WAITED = 0.05
#: How far back the picture reaches (s).
WINDOW = 300.0
#: How many lanes one picture draws at most (the rest are counted below it).
MAX_LANES = 40

_LANE_H = 22
_GAP = 4
_LABEL_W = 190
_WIDTH = 960
_AXIS_H = 18


@dataclass(frozen=True)
class Bar:
    """One run's hold of *name*: from *start* to *end* (epoch s; None: still held)."""

    name: str
    start: float
    end: float | None
    outcome: str
    fence: int | None
    task_id: str
    task_name: str
    #: Seconds the run waited for the lock before *start* (drawn as a thin bar before it).
    waited: float = 0.0


@dataclass(frozen=True)
class Tick:
    """A refusal of *name* at *at*: ``refused`` (a run) or ``duplicate`` (a publish)."""

    name: str
    at: float
    outcome: str
    task_id: str


def _key(event: Mapping[str, Any]) -> tuple[str, Any]:
    """What ties a release to its acquire: the name and the run's task id (else fence)."""
    return (str(event.get("name") or ""), event.get("task_id") or event.get("fence"))


def bars_of(events: Iterable[Mapping[str, Any]]) -> tuple[list[Bar], list[Tick]]:
    """The bars and ticks that *events* (the event log's objects, in any order) make."""
    open_: dict[tuple[str, Any], Mapping[str, Any]] = {}
    #: Runs an operator released: the run's own "lost" or "released" after it is the same end.
    forced: set[tuple[str, Any]] = set()
    bars: list[Bar] = []
    ticks: list[Tick] = []
    for event in sorted(events, key=lambda e: float(e.get("at") or 0.0)):
        kind = event.get("kind")
        name = str(event.get("name") or "")
        at = float(event.get("at") or 0.0)
        task_id = str(event.get("task_id") or "")
        if kind == "acquired":
            open_[_key(event)] = event
            forced.discard(_key(event))
        elif kind in ("released", "lost", "forced"):
            if kind != "forced" and _key(event) in forced:
                continue  # the holder found its lease gone: the bar ended at the release
            began = open_.pop(_key(event), None)
            held = event.get("held")
            start = float(began["at"]) if began else at - float(held or 0.0)
            waited = float((began or {}).get("waited") or 0.0)
            if kind == "forced":
                forced.add(_key(event))
                outcome = "force-released"
            elif kind == "lost":
                error = str(event.get("error") or "").lower()
                outcome = "force-released" if "force" in error or "operator" in error else "lost"
            else:
                outcome = "waited" if waited > WAITED else "ran"
            fence = event.get("fence", (began or {}).get("fence"))
            bars.append(
                Bar(
                    name,
                    start,
                    at,
                    outcome,
                    _int(fence),
                    task_id,
                    str(event.get("task_name") or ""),
                    waited,
                )
            )
        elif kind in ("contended", "rate_limited", "superseded"):
            ticks.append(Tick(name, at, refusal(event), task_id))
        elif kind == "duplicate":
            ticks.append(Tick(name, at, "duplicate", task_id))
    for event in open_.values():
        waited = float(event.get("waited") or 0.0)
        bars.append(
            Bar(
                str(event.get("name") or ""),
                float(event.get("at") or 0.0),
                None,
                "running",
                _int(event.get("fence")),
                str(event.get("task_id") or ""),
                str(event.get("task_name") or ""),
                waited,
            )
        )
    return bars, ticks


#: A refused run's ``policy`` (``lock_on_contended``) -> its outcome.
_POLICIES = {"retry": "re-queued", "requeue": "re-queued", "queue": "re-queued", "skip": "skipped"}


def refusal(event: Mapping[str, Any]) -> str:
    """How a refused run went: ``re-queued``, ``skipped`` (its event's ``policy``) or
    ``refused`` (an event that names no policy)."""
    policy = event.get("policy") or event.get("outcome")
    return _POLICIES.get(str(policy or ""), "refused")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _lanes(bars: Sequence[Bar], now: float) -> list[tuple[str, int, list[Bar]]]:
    """(name, permit, bars) per lane: a name's bars, each put in the first of its lanes that
    is free at the bar's start (a semaphore's permits held at once get a lane each)."""
    lanes: list[tuple[str, int, list[Bar]]] = []
    by_name: dict[str, list[list[Bar]]] = {}
    for bar in sorted(bars, key=lambda b: (b.name, b.start)):
        mine = by_name.setdefault(bar.name, [])
        for lane in mine:
            last = lane[-1]
            if (last.end if last.end is not None else now) <= bar.start:
                lane.append(bar)
                break
        else:
            mine.append([bar])
    for name in sorted(by_name):
        for permit, lane in enumerate(by_name[name]):
            lanes.append((name, permit, lane))
    return lanes


def timeline_svg(
    events: Iterable[Mapping[str, Any]],
    *,
    now: float,
    window: float = WINDOW,
    href: Any = None,
) -> str:
    """The SVG of the last *window* seconds before *now*: one lane per key (and permit),
    a bar per run, a tick per refusal. *href*, given a name, returns the link of its lane's
    label (the key's page); every text from Redis is escaped."""
    bars, ticks = bars_of(events)
    since = now - window
    bars = [b for b in bars if (b.end if b.end is not None else now) >= since]
    ticks = [t for t in ticks if t.at >= since]
    lanes = _lanes(bars, now)
    names_with_bars = {name for name, _, _ in lanes}
    for name in sorted({t.name for t in ticks} - names_with_bars):
        lanes.append((name, 0, []))
    lanes.sort(key=lambda lane: (lane[0], lane[1]))
    hidden = max(0, len(lanes) - MAX_LANES)
    lanes = lanes[:MAX_LANES]
    if not lanes:
        return (
            '<p class="timeline-empty">No run took or was refused a lock in the last '
            f"{_span(window)}.</p>"
        )
    plot = _WIDTH - _LABEL_W - 8
    height = _AXIS_H + len(lanes) * (_LANE_H + _GAP)

    def x(t: float) -> float:
        return _LABEL_W + max(0.0, min(1.0, (t - since) / window)) * plot

    out = [
        f'<svg class="timeline" viewBox="0 0 {_WIDTH} {height}" role="img" '
        f'preserveAspectRatio="xMinYMin meet" aria-label="runs of the last {_span(window)}">',
    ]
    for i in range(6):  # the time axis: now and five marks before it
        t = now - window * i / 5
        label = "now" if i == 0 else f"-{_span(window * i / 5)}"
        out.append(
            f'<line class="tl-grid" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{_AXIS_H - 4}" '
            f'y2="{height}"/><text class="tl-axis" x="{x(t):.1f}" y="{_AXIS_H - 6}" '
            f'text-anchor="{"end" if i == 0 else "middle"}">{label}</text>'
        )
    for row, (name, permit, lane) in enumerate(lanes):
        y = _AXIS_H + row * (_LANE_H + _GAP)
        label = escape(name if name.strip() else repr(name))
        if permit:
            label += f" #{permit + 1}"
        text = f'<text class="tl-label" x="4" y="{y + _LANE_H - 7}">{label}</text>'
        if href is not None:
            text = f'<a href="{escape(href(name))}">{text}</a>'
        out.append(f'<g class="tl-lane"><title>{escape(name)}</title>{text}')
        out.append(
            f'<rect class="tl-track" x="{_LABEL_W}" y="{y}" width="{plot}" height="{_LANE_H}"/>'
        )
        for bar in lane:
            x0 = x(bar.start)
            if bar.waited > WAITED:  # the wait before it: a thin bar that ends where it starts
                xw = x(bar.start - bar.waited)
                out.append(
                    f'<rect class="tl-wait" x="{xw:.1f}" y="{y + _LANE_H / 2 - 3:.1f}" '
                    f'width="{max(x0 - xw, 1.0):.1f}" height="6"><title>waited '
                    f"{bar.waited:.2f} s</title></rect>"
                )
            x1 = x(bar.end if bar.end is not None else now)
            w = max(x1 - x0, 2.0)
            tip = f"{bar.task_name or 'a run'} {bar.task_id} {bar.outcome}"
            if bar.fence is not None:
                tip += f" fence {bar.fence}"
            out.append(
                f'<rect class="tl-bar tl-{bar.outcome}" x="{x0:.1f}" y="{y + 2}" '
                f'width="{w:.1f}" height="{_LANE_H - 4}"><title>{escape(tip)}</title></rect>'
            )
            shown = _fence_text(bar.fence)
            if shown and w > 7 * len(shown) + 6:
                out.append(
                    f'<text class="tl-fence" x="{x0 + 3:.1f}" y="{y + _LANE_H - 7}">{shown}</text>'
                )
        for tick in (t for t in ticks if t.name == name and permit == 0):
            tx = x(tick.at)
            out.append(
                f'<line class="tl-tick tl-{tick.outcome}" x1="{tx:.1f}" x2="{tx:.1f}" '
                f'y1="{y}" y2="{y + _LANE_H}"><title>{escape(tick.outcome)} '
                f"{escape(tick.task_id)}</title></line>"
            )
        out.append("</g>")
    out.append("</svg>")
    legend = "".join(f'<span class="tl-key tl-{o}">{o}</span>' for o in _OUTCOMES)
    more = f'<p class="timeline-more">{hidden} more lanes not drawn.</p>' if hidden else ""
    picture = "".join(out)
    caption = f"<figcaption>{legend}</figcaption>"
    return (
        f'<figure class="timeline-box"><div class="scroll">{picture}</div>{caption}</figure>{more}'
    )


#: The outcomes of the legend, in its order.
_OUTCOMES = (
    "ran", "waited", "running", "lost", "force-released", "re-queued", "skipped", "refused",
    "duplicate",
)  # fmt: skip


def _fence_text(fence: int | None) -> str:
    """A fence as a bar shows it: whole up to 6 digits, else its last 4 (``…2390``; the
    bar's title has it whole)."""
    if fence is None:
        return ""
    text = str(fence)
    return text if len(text) <= 6 else "…" + text[-4:]


def _span(seconds: float) -> str:
    """300 -> "5 min", 45 -> "45 s"."""
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"
