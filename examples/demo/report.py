"""The end of the demo: a summary that checks itself, and the timeline picture.

:func:`checks` turns the :class:`~events.Story` into pass/fail lines (no key ever held by
more runs than its limit, fences increasing, the crashed key recovered within its
lease, ...); :func:`draw_timeline` writes the PNG (one lane per key, a bar per run).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from events import Run, Story, fence_text, lanes, max_overlap

COLOURS = {
    "running": "#43a047",
    "waiting": "#ffb300",
    "skipped": "#9e9e9e",
    "crashed": "#e53935",
    "leader": "#64b5f6",
    "dedup": "#8e24aa",
}


@dataclass(frozen=True)
class Check:
    """One line of the summary: what was checked, whether it held, the figures."""

    name: str
    ok: bool
    detail: str


def per_key_table(story: Story, limits: Mapping[str, int | None]) -> list[str]:
    """The summary table: per key, runs, most at once against the limit, waits, ..."""
    head = f"  {'key':<22}{'runs':>5}{'at once':>8}{'limit':>6}{'waited':>7}"
    head += f"{'retried':>8}{'skipped':>8}{'dedup':>6}"
    rows = [head]
    for key in story.keys:
        runs = story.on_key(key)
        spans = [s for r in runs if (s := r.interval())] or [
            (a, b) for a, b in story.holds.get(key, []) if b is not None
        ]
        if not spans and not runs and not story.dedups.get(key):
            continue
        limit = limits.get(key, 1)
        rows.append(
            f"  {key[:21]:<22}{len(spans):>5}{max_overlap(spans):>8}"
            f"{'-' if limit is None else limit:>6}"
            f"{sum(r.waited > 0.05 for r in runs):>7}"
            f"{sum(r.refusals for r in runs if not r.skipped):>8}"
            f"{sum(r.skipped for r in runs):>8}{len(story.dedups.get(key, ())):>6}"
        )
    return rows


def checks(story: Story, limits: Mapping[str, int | None], ttl: float) -> list[Check]:
    """What every demo run must show, whatever its scenes."""
    out = []
    worst = []
    for key in story.keys:
        spans = [s for r in story.on_key(key) if (s := r.interval())]
        spans += [(a, b) for a, b in story.holds.get(key, []) if b is not None]
        limit = limits.get(key, 1)
        if limit is not None and max_overlap(spans) > limit:
            worst.append(f"{key}: {max_overlap(spans)} at once, limit {limit}")
    out.append(
        Check(
            "no key ever held by more runs than its limit",
            not worst,
            "; ".join(worst) or f"{len(story.keys)} keys, {len(story.runs)} task runs",
        )
    )
    backwards = []
    for key in story.keys:
        if limits.get(key, 1) != 1:
            continue
        fences = [r.fence for r in sorted(story.on_key(key), key=_start) if r.ran and r.fence]
        if any(b <= a for a, b in itertools.pairwise(fences)):
            backwards.append(key)
    out.append(
        Check(
            "each key's fences strictly increase from one holder to the next",
            not backwards,
            ", ".join(backwards) or "every mutex key",
        )
    )
    for kill in story.kills:
        key = kill.get("key") or ""
        took = _recovery(story, kill)
        if took is None:
            out.append(Check(f"the crashed key {key} recovered", False, "no later run started"))
            continue
        out.append(
            Check(
                f"the crashed key {key} recovered in {took:.2f} s",
                took <= ttl + 1.0,
                f"next run started {took:.2f} s after the SIGKILL (lease {ttl:g} s)",
            )
        )
    return out


def _recovery(story: Story, kill: Mapping[str, Any]) -> float | None:
    """Seconds from a SIGKILL to the next run on the killed run's key (None: none ran)."""
    after = [
        r.start
        for r in story.on_key(kill.get("key") or "")
        if r.start is not None and r.start > kill["t"] and r.task_id != kill.get("task_id")
    ]
    return min(after) - float(kill["t"]) if after else None


def _start(run: Run) -> float:
    return run.start or 0.0


def draw_timeline(
    story: Story,
    t0: float,
    path: Path,
    title: str,
    limits: Mapping[str, int | None],
    *,
    rates: Mapping[str, str] | None = None,
) -> None:
    """Write the timeline PNG: one lane per key, one bar per run, a legend. A key's
    label names its limit when it is not 1, and its rate when it has one."""
    import matplotlib  # noqa: PLC0415 - only the end of the demo needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    def x(t: float) -> float:
        return max(0.0, t - t0)

    # Lay out: each key gets as many rows as it needs so that no two runs share one.
    layout: list[tuple[str, list[tuple[Run | None, tuple[float, float], int]]]] = []
    total_rows = 0
    for key in story.keys:
        items: list[tuple[Run | None, tuple[float, float]]] = []
        for run in story.on_key(key):
            first = (
                min(t for t in (run.first_refused, run.start, run.crashed_at) if t)
                if (run.first_refused or run.start)
                else None
            )
            if first is None:
                continue
            last = run.end or run.crashed_at or (first + 0.15)
            items.append((run, (first, max(last, first + 0.15))))
        for start, end in story.holds.get(key, []):
            items.append((None, (start, end or start)))
        if not items and not story.dedups.get(key):
            continue
        items.sort(key=lambda item: item[1][0])
        rows = lanes([span for _, span in items]) if items else []
        layout.append((key, [(r, s, row) for (r, s), row in zip(items, rows, strict=True)]))
        total_rows += max(rows, default=0) + 1

    end_time = max(
        [x(s[1]) for _, items in layout for _, s, _ in items]
        + [x(t) for d in story.dedups.values() for t, _ in d]
        + [1.0]
    )
    fig_height = 1.6 + 0.32 * total_rows + 0.25 * len(layout)
    fig, ax = plt.subplots(figsize=(13, fig_height), dpi=110)
    y = 0.0
    ticks, labels = [], []
    for index, (key, items) in enumerate(layout):
        height = max((row for *_, row in items), default=0) + 1
        if index % 2 == 0:
            ax.axhspan(y - 0.1, y + height + 0.1, color="#f5f5f5", zorder=0)
        for run, (first, last), row in items:
            base = y + row + 0.1
            if run is None:  # a non-task hold: the beat leader
                ax.broken_barh(
                    [(x(first), x(last) - x(first))], (base, 0.8), color=COLOURS["leader"], zorder=2
                )
                ax.text(x(first) + 0.1, base + 0.4, "beat leader", va="center", fontsize=7)
                continue
            _draw_run(ax, run, base, x)
        dedups = story.dedups.get(key, [])
        for t, _ in dedups:
            ax.plot(x(t), y + 0.5, marker="D", color=COLOURS["dedup"], markersize=5, zorder=4)
        if dedups:
            first = min(t for t, _ in dedups)
            ax.text(
                x(first) - 0.15,
                y + 0.5,
                f"{len(dedups)} calls de-duplicated",
                ha="right",
                va="center",
                fontsize=7,
                color=COLOURS["dedup"],
            )
        for kill in (k for k in story.kills if k.get("key") == key):
            note = f"SIGKILL pid {kill.get('victim')}"
            recovered = _recovery(story, kill)
            if recovered is not None:
                note += f": next run {recovered:.2f} s later"
            ax.text(
                x(float(kill["t"])) + 0.05,
                y + 0.5,
                note,
                fontsize=7,
                va="center",
                color=COLOURS["crashed"],
                zorder=5,
            )
        limit = limits.get(key, 1)
        ticks.append(y + height / 2)
        if rates and key in rates:
            suffix = f"\n(rate {rates[key]})"
        else:
            suffix = "" if limit == 1 else f"\n(limit {limit})" if limit else "\n(no limit)"
        labels.append(key + suffix)
        y += height + 0.25
    for kill in story.kills:
        ax.axvline(x(float(kill["t"])), color=COLOURS["crashed"], linestyle=":", linewidth=1)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(y, -0.3)
    ax.set_xlim(0, end_time * 1.12 + 0.5)  # room for the notes written right of a kill
    ax.set_xlabel("seconds since the first scene")
    ax.set_title(title, fontsize=11)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6, zorder=1)
    legend = [
        Patch(color=COLOURS["running"], label="running (fence: last 4 digits)"),
        Patch(color=COLOURS["waiting"], label="waiting / re-queued"),
        Patch(color=COLOURS["skipped"], label="skipped (key held)"),
        Patch(color=COLOURS["crashed"], label="crashed (SIGKILL)"),
        Patch(color=COLOURS["leader"], label="beat leader lock"),
        plt.Line2D(
            [], [], color=COLOURS["dedup"], marker="D", linestyle="", label="publish de-duplicated"
        ),
    ]
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.5 / fig_height - 0.04),
        ncol=6,
        fontsize=8,
        frameon=False,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _draw_run(ax: Any, run: Run, base: float, x: Callable[[float], float]) -> None:
    """One run: its wait (amber), its run (green, fence on it) or crash (red), or a skip."""
    if run.skipped and not run.ran:
        at = x(run.first_refused or 0.0)
        ax.broken_barh([(at, 0.15)], (base, 0.8), color=COLOURS["skipped"], zorder=2)
        ax.text(at + 0.2, base + 0.4, "skip", va="center", fontsize=6, color="#616161")
        return
    if run.start is not None and run.first_refused is not None and run.first_refused < run.start:
        a, b = x(run.first_refused), x(run.start)
        ax.broken_barh([(a, b - a)], (base + 0.2, 0.4), color=COLOURS["waiting"], zorder=2)
    if run.start is None:
        return
    stop = run.end if run.end is not None else run.crashed_at
    crashed = run.end is None and run.crashed_at is not None
    a = x(run.start)
    b = x(stop) if stop is not None else a + 0.15
    colour = COLOURS["crashed"] if crashed else COLOURS["running"]
    ax.broken_barh([(a, b - a)], (base, 0.8), color=colour, zorder=3)
    label = ("" if run.fence is None else fence_text(run.fence)) + (" ✕ SIGKILL" if crashed else "")
    ax.text(
        (a + b) / 2,
        base + 0.4,
        label,
        ha="center",
        va="center",
        fontsize=6.5,
        zorder=5,
        color="white" if crashed else "black",
    )
