"""What the demo shows while it runs: a live table in a terminal, plain lines elsewhere.

:class:`LiveView` redraws the whole screen a few times a second (who holds which key,
with what fence, for how long; per key how many runs waited, were re-queued, skipped
or de-duplicated; the last lines of the story). :class:`PlainView` prints one line per
event instead, for CI logs and pipes (``CI=true`` or no terminal).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, TextIO

from events import Event, Story, fence_text, short

RESET, BOLD, DIM = "\x1b[0m", "\x1b[1m", "\x1b[2m"
GREEN, YELLOW, RED, GREY, MAGENTA, CYAN = (
    "\x1b[32m",
    "\x1b[33m",
    "\x1b[31m",
    "\x1b[90m",
    "\x1b[35m",
    "\x1b[36m",
)


def wants_live(stream: TextIO) -> bool:
    """A live view only on a terminal, and never under CI."""
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        return False
    return stream.isatty()


def describe(event: Event, policies: Mapping[str, str]) -> tuple[str, str] | None:  # noqa: PLR0911
    """One event as (colour, text), or None for events not worth a line."""
    kind = event.get("kind")
    key = event.get("key") or ""
    who = short(event.get("task_id"))
    task = event.get("task") or ""
    if kind == "acquired":
        if not event.get("task_id"):
            holder = event.get("holder") or {}
            role = holder.get("role") or "a process"
            return CYAN, f"{key:<20} taken by {role} pid {event['pid']}"
        waited = float(event.get("waited") or 0.0)
        extra = f" after waiting {waited:.2f}s" if waited > 0.05 else ""
        return GREEN, f"{key:<20} acquired by {who} (fence {fence_text(event.get('fence'))}){extra}"
    if kind == "contended":
        holder = event.get("holder") or {}
        policy = policies.get(task, "?")
        verb = {"retry": "re-queued", "skip": "skipped", "wait": "waits", "raise": "fails"}
        return YELLOW, (
            f"{key:<20} {who} finds it held by {short(holder.get('task_id'))}: "
            f"{verb.get(policy, policy)}"
        )
    if kind == "rate_limited":
        policy = policies.get(task, "?")
        after = float(event.get("retry_after") or 0.0)
        verb = {"retry": "re-queued for its slot", "skip": "skipped", "wait": "waits"}
        return YELLOW, (
            f"{key:<20} {who} is over the rate: {verb.get(policy, policy)} in {after:.2f}s"
        )
    if kind == "released" and event.get("task_id"):
        held = event.get("held")
        return DIM, f"{key:<20} released by {who}" + (f" after {held:.2f}s" if held else "")
    if kind == "lost":
        return RED, f"{key:<20} LOST by {who}: {event.get('error') or ''}"
    if kind == "kill":
        return RED, f"{key:<20} SIGKILL pool child pid {event['victim']} running {who}"
    if kind in ("dedup", "duplicate"):
        return MAGENTA, f"{key:<20} publish de-duplicated: the queued run {who} is returned"
    if kind == "superseded":
        return GREY, f"{key:<20} {who} was replaced by a newer call: skipped"
    if kind == "log":
        return RED if "ERROR" in event["text"] else YELLOW, f"log {event['text']}"
    if kind == "note":
        return BOLD, event["text"]
    return None


class PlainView:
    """One line per event, for logs."""

    def __init__(self, policies: Mapping[str, str], t0: float, out: TextIO = sys.stdout) -> None:
        self.policies, self.t0, self.out = policies, t0, out
        self.lock = threading.Lock()

    def scene(self, number: int, total: int, title: str) -> None:
        """A new scene begins."""
        with self.lock:
            print(f"\n== scene {number}/{total}: {title}", file=self.out, flush=True)

    def event(self, event: Event, story: Story) -> None:
        """One line for *event*, if it says something."""
        line = describe(event, self.policies)
        if line is not None:
            with self.lock:
                stamp = float(event.get("t") or time.time()) - self.t0
                print(f"  {stamp:+7.2f}s  {line[1]}", file=self.out, flush=True)

    def refresh(self, story: Story) -> None:
        """Nothing to redraw in plain mode."""

    def close(self) -> None:
        """Nothing to tidy up."""


class LiveView:
    """A full-screen table, redrawn a few times a second."""

    def __init__(self, policies: Mapping[str, str], t0: float, out: TextIO = sys.stdout) -> None:
        self.policies, self.t0, self.out = policies, t0, out
        self.lock = threading.Lock()
        self.recent: deque[str] = deque(maxlen=12)
        self.title = "starting"
        self.holders: dict[str, dict[str, Any]] = {}
        self.out.write("\x1b[?25l")  # hide the cursor while redrawing

    def scene(self, number: int, total: int, title: str) -> None:
        """A new scene begins."""
        with self.lock:
            self.title = f"scene {number}/{total}: {title}"
            self.recent.append(f"{BOLD}-- {self.title}{RESET}")

    def event(self, event: Event, story: Story) -> None:
        """Keep who holds what; add a line to the recent list."""
        kind, key = event.get("kind"), event.get("key") or ""
        with self.lock:
            owner = event.get("task_id") or f"pid {event.get('pid')}"
            if kind == "acquired":
                held = self.holders.setdefault(key, {})
                for gone in [o for o, e in held.items() if e.get("crashed")]:
                    del held[gone]  # the next holder got in: the crashed one was released
                held[owner] = event
            elif kind in ("released", "lost"):
                self.holders.get(key, {}).pop(owner, None)
            elif kind == "kill":
                held = self.holders.get(key, {}).get(owner)
                if held is not None:
                    held["crashed"] = True
            line = describe(event, self.policies)
            if line is not None:
                stamp = float(event.get("t") or time.time()) - self.t0
                self.recent.append(f"{GREY}{stamp:+7.2f}s{RESET}  {line[0]}{line[1]}{RESET}")

    def refresh(self, story: Story) -> None:
        """Redraw the screen."""
        width = max(60, shutil.get_terminal_size((100, 30)).columns)
        now = time.time()
        rows = [
            f"{BOLD}celery-redlock demo{RESET}   t={now - self.t0:5.1f}s   "
            f"{CYAN}{self.title}{RESET}",
            "",
            f"{BOLD}{'key':<22}{'held by (task · fence · where · for)':<50}"
            f"{'runs':>5}{'wait':>5}{'retry':>6}{'skip':>5}{'dedup':>6}{RESET}",
        ]
        with self.lock:
            for key in story.keys:
                runs = story.on_key(key)
                holders = self.holders.get(key, {})
                held = []
                for owner, ev in holders.items():
                    since = now - float(ev.get("t") or now)
                    state = f"{RED}crashed{RESET} " if ev.get("crashed") else ""
                    who = short(owner) if ev.get("task_id") else owner
                    held.append(
                        f"{state}{who} · {fence_text(ev.get('fence'))} · pid {ev.get('pid')}"
                        f" · {since:.1f}s"
                    )
                text = "; ".join(held) if held else f"{DIM}free{RESET}"
                colour = GREEN if held else ""
                pad = 50 + (len(text) - len(_strip(text)))
                rows.append(
                    f"{key[:21]:<22}{colour}{text:<{pad}}{RESET}"
                    f"{sum(r.ran for r in runs) or len(story.holds.get(key, ())):>5}"
                    f"{sum(r.waited > 0.05 for r in runs):>5}"
                    f"{sum(r.refusals for r in runs if not r.skipped):>6}"
                    f"{sum(r.skipped for r in runs):>5}"
                    f"{len(story.dedups.get(key, ())):>6}"
                )
            rows += ["", f"{BOLD}what happened last{RESET}", *self.recent]
        screen = "\n".join(_clip(row, width) for row in rows)
        self.out.write("\x1b[H\x1b[J" + screen + "\n")
        self.out.flush()

    def close(self) -> None:
        """Show the cursor again."""
        self.out.write("\x1b[?25h\n")
        self.out.flush()


def _strip(text: str) -> str:
    """*text* without ANSI colour codes."""
    out, skipping = [], False
    for char in text:
        if char == "\x1b":
            skipping = True
        elif skipping and char == "m":
            skipping = False
        elif not skipping:
            out.append(char)
    return "".join(out)


def _clip(row: str, width: int) -> str:
    """Cut a row to the terminal width (colour codes do not count)."""
    if len(_strip(row)) <= width:
        return row
    out, visible, escape = [], 0, False
    for char in row:
        if char == "\x1b":
            escape = True
        if escape:
            out.append(char)
            escape = char != "m"
            continue
        if visible >= width - 1:
            break
        out.append(char)
        visible += 1
    return "".join(out) + RESET
