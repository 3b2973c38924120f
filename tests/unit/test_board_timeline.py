"""The board's timeline picture (celery_redlock.board.timeline): the event log's objects
drawn as an SVG of lanes and bars, parsed back here as XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from celery_redlock.board.timeline import MAX_LANES, bars_of, timeline_svg

NOW = 1_000_000.0
SVG = "{http://www.w3.org/2000/svg}"


def ev(kind: str, name: str, at: float, task_id: str = "t1", **more: Any) -> dict[str, Any]:
    return {"kind": kind, "name": name, "at": NOW + at, "task_id": task_id, **more}


def svg_of(events: list[dict[str, Any]], **kw: Any) -> ET.Element:
    html = timeline_svg(events, now=NOW, **kw)
    start, end = html.index("<svg"), html.index("</svg>") + len("</svg>")
    return ET.fromstring(html[start:end].replace("<svg ", f'<svg xmlns="{SVG[1:-1]}" ', 1))


def bars(root: ET.Element) -> list[ET.Element]:
    return [r for r in root.iter(f"{SVG}rect") if "tl-bar" in r.get("class", "")]


def test_a_run_is_a_bar_from_acquired_to_released_with_its_fence_on_it() -> None:
    """acquire at -60 s and release at -30 s: one "ran" bar, half as wide as the span
    from -60 s to now, with its fence written on it."""
    root = svg_of([ev("acquired", "sync:1", -60, fence=7, waited=0.0),
                   ev("released", "sync:1", -30, fence=7, held=30.0)])  # fmt: skip
    [bar] = bars(root)
    assert "tl-ran" in bar.get("class", "")
    width = float(bar.get("width", 0))
    lane = next(r for r in root.iter(f"{SVG}rect") if "tl-track" in r.get("class", ""))
    assert abs(width / float(lane.get("width", 1)) - 30 / 300) < 0.01
    assert "7" in [t.text for t in root.iter(f"{SVG}text") if "tl-fence" in t.get("class", "")]


def test_outcomes_are_told_apart() -> None:
    """A run that waited, a run still holding, a lost lease, a refusal and a duplicate each
    get their own class."""
    events = [
        ev("acquired", "a", -100, "w", waited=2.0, fence=1), ev("released", "a", -90, "w"),
        ev("acquired", "b", -50, "r", fence=3),
        ev("acquired", "c", -80, "l", fence=4), ev("lost", "c", -70, "l", error="expired"),
        ev("contended", "a", -60, "x"), ev("duplicate", "b", -40, "d"),
    ]  # fmt: skip
    root = svg_of(events)
    classes = {b.get("class") for b in bars(root)}
    assert classes == {"tl-bar tl-waited", "tl-bar tl-running", "tl-bar tl-lost"}
    ticks = {t.get("class") for t in root.iter(f"{SVG}line") if "tl-tick" in t.get("class", "")}
    assert ticks == {"tl-tick tl-refused", "tl-tick tl-duplicate"}
    running = next(b for b in bars(root) if "running" in b.get("class", ""))
    right = float(running.get("x", 0)) + float(running.get("width", 0))
    assert right > 950, "a run still holding reaches now, the right edge"


def test_permits_held_at_once_get_a_lane_each() -> None:
    """Two runs of one semaphore that overlap are drawn in two lanes (#2 labelled); a third
    that starts after the first ended reuses the first lane."""
    events = [
        ev("acquired", "render", -100, "a"), ev("released", "render", -50, "a"),
        ev("acquired", "render", -90, "b"), ev("released", "render", -20, "b"),
        ev("acquired", "render", -40, "c"), ev("released", "render", -10, "c"),
    ]  # fmt: skip
    b, _ = bars_of(events)
    assert len(b) == 3
    root = svg_of(events)
    labels = [t.text for t in root.iter(f"{SVG}text") if "tl-label" in t.get("class", "")]
    assert labels == ["render", "render #2"]


def test_names_from_redis_are_escaped_and_a_name_of_spaces_is_visible() -> None:
    """A name with markup is text, not markup; a name of spaces is shown quoted."""
    html = timeline_svg(
        [ev("acquired", "<script>x</script>", -5), ev("acquired", "   ", -5, "s")],
        now=NOW, href=lambda name: "/key/" + name,
    )  # fmt: skip
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "&#x27;   &#x27;" in html or "'   '" in html


def test_only_the_window_is_drawn_and_an_empty_window_says_so() -> None:
    """A run that ended before the window is left out; with nothing left, one sentence."""
    old = [ev("acquired", "old", -900), ev("released", "old", -800)]
    assert "No run took or was refused a lock in the last 5 min" in timeline_svg(old, now=NOW)
    root = svg_of([*old, ev("acquired", "new", -10)])
    assert len(bars(root)) == 1


def test_lanes_are_capped_and_the_rest_counted() -> None:
    """More keys than MAX_LANES: MAX_LANES lanes, and a line counting the others."""
    events = [ev("acquired", f"k{i:03}", -5, f"t{i}") for i in range(MAX_LANES + 7)]
    html = timeline_svg(events, now=NOW)
    assert html.count('class="tl-lane"') == MAX_LANES
    assert "7 more lanes not drawn." in html


def test_a_forced_release_ends_the_bar_as_force_released_and_the_holders_lost_is_not_another() -> (
    None
):
    """A "forced" event (the board's release) ends the run's bar as force-released; the
    holder's own "lost" after it draws no second bar."""
    root = svg_of([
        ev("acquired", "f", -60, "t", fence=5),
        ev("forced", "f", -40, "t", fence=5),
        ev("lost", "f", -35, "t", fence=5, held=25.0, error="expired"),
    ])  # fmt: skip
    [bar] = bars(root)
    assert "tl-force-released" in bar.get("class", "")


def test_a_refusal_says_re_queued_or_skipped_when_its_event_names_the_policy() -> None:
    """contended with policy retry is a re-queued tick, with skip a skipped one, with no
    policy a plain refused one."""
    _, ticks = bars_of([
        ev("contended", "k", -30, "a", policy="retry"),
        ev("contended", "k", -20, "b", policy="skip"),
        ev("contended", "k", -10, "c"),
    ])  # fmt: skip
    assert [t.outcome for t in ticks] == ["re-queued", "skipped", "refused"]


def test_a_wait_is_drawn_before_its_bar_and_a_long_fence_shows_its_last_digits() -> None:
    """An acquire that waited 20 s gets a wait bar ending where its run's bar starts; a
    16-digit fence is written as its last four digits, whole in the bar's title."""
    fence = 1796192303394938
    root = svg_of([ev("acquired", "w", -100, fence=fence, waited=20.0),
                   ev("released", "w", -40, fence=fence)])  # fmt: skip
    [wait] = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "tl-wait"]
    [bar] = bars(root)
    assert abs(float(wait.get("x", 0)) + float(wait.get("width", 0)) - float(bar.get("x", 0))) < 0.2
    assert str(fence) in "".join(bar.itertext())
    assert "…4938" in [t.text for t in root.iter(f"{SVG}text") if "tl-fence" in t.get("class", "")]
