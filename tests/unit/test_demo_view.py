"""The demo's live view, story and checks, fed with events as the demo's processes write them."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo"


@pytest.fixture(scope="module")
def demo() -> Any:
    """The demo's modules (events, view, report), imported as run.py imports them."""
    sys.path.insert(0, str(DEMO))
    try:
        import events  # noqa: PLC0415
        import report  # noqa: PLC0415
        import view  # noqa: PLC0415
    finally:
        sys.path.remove(str(DEMO))
    return type("Demo", (), {"events": events, "view": view, "report": report})


POLICIES = {"demoapp.sync_user": "retry", "demoapp.nightly_report": "skip"}


def _ev(kind: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "t": t, "pid": 4242, **fields}


def test_live_view_shows_the_holder_then_free_and_counts_refusals(demo: Any) -> None:
    """While a run holds sync:1 the live table names it with its fence; a contended run
    counts as re-queued; once released the key reads free."""
    out = io.StringIO()
    live = demo.view.LiveView(POLICIES, t0=100.0, out=out)
    story = demo.events.Story()
    held = [
        _ev("publish", 100.0, task_id="aaaaaa11", key="sync:1", task="sync_user"),
        _ev("acquired", 100.1, task_id="aaaaaa11", key="sync:1", fence=1795519819949771,
            task="demoapp.sync_user"),
        _ev("start", 100.1, task_id="aaaaaa11", key="sync:1", fence=1795519819949771,
            task="demoapp.sync_user"),
        _ev("contended", 100.2, task_id="bbbbbb22", key="sync:1", task="demoapp.sync_user",
            holder={"task_id": "aaaaaa11"}),
    ]  # fmt: skip
    for event in held:
        story.add(event, POLICIES)
        live.event(event, story)
    live.refresh(story)
    screen = out.getvalue()
    row = next(line for line in screen.splitlines() if line.startswith("sync:1"))
    assert "aaaaaa" in row and "…9771" in row and "pid 4242" in row
    assert "bbbbbb finds it held by aaaaaa: re-queued" in screen
    assert story.runs["bbbbbb22"].refusals == 1

    out.truncate(0)
    for event in (
        _ev("end", 100.7, task_id="aaaaaa11", key="sync:1"),
        _ev("released", 100.7, task_id="aaaaaa11", key="sync:1", held=0.6),
    ):
        story.add(event, POLICIES)
        live.event(event, story)
    live.refresh(story)
    row = next(line for line in out.getvalue().splitlines() if line.startswith("sync:1"))
    assert "free" in row and "aaaaaa" not in row


def test_plain_view_prints_one_line_per_event_without_escape_codes(demo: Any) -> None:
    """Without a terminal: a plain line per event, with its offset, and no ANSI codes."""
    out = io.StringIO()
    plain = demo.view.PlainView(POLICIES, t0=100.0, out=out)
    story = demo.events.Story()
    plain.scene(1, 2, "contention")
    plain.event(_ev("kill", 101.5, task_id="cccccc33", key="export:x", victim=777), story)
    text = out.getvalue()
    assert "== scene 1/2: contention" in text
    assert "+1.50s  export:x" in text and "SIGKILL pool child pid 777" in text
    assert "\x1b[" not in text


def test_checks_catch_a_key_over_its_limit_and_a_crash_never_recovered(demo: Any) -> None:
    """The summary's checks fail when two runs of a mutex key overlap, and when no run
    followed a SIGKILL; they pass on the same story once the overlap is gone."""
    story = demo.events.Story()
    for event in (
        _ev("start", 1.0, task_id="r1", key="k", fence=1),
        _ev("end", 2.0, task_id="r1", key="k"),
        _ev("start", 1.5, task_id="r2", key="k", fence=2),
        _ev("end", 2.5, task_id="r2", key="k"),
        _ev("start", 3.0, task_id="r3", key="crash", fence=5),
        _ev("kill", 3.5, task_id="r3", key="crash", victim=1),
    ):
        story.add(event, {})
    results = {c.name.split(" in ")[0]: c.ok for c in demo.report.checks(story, {}, ttl=3.0)}
    assert results["no key ever held by more runs than its limit"] is False
    assert results["the crashed key crash recovered"] is False
    allowed = demo.report.checks(story, {"k": 2}, ttl=3.0)
    assert next(c for c in allowed if c.name.startswith("no key ever")).ok is True
