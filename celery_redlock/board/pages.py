"""The board's HTML: pure functions of what :mod:`.source` read, every value from Redis
escaped (:func:`e`). The live part of each page (``<div id="live">``) is also served
alone, for the page's script to swap in without a reload."""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, urlencode

from ..cli.render import _duration, _ttl
from .rules import KeyRule, matching
from .source import Problem, View

__all__ = [
    "KINDS",
    "Row",
    "e",
    "group",
    "key_live",
    "key_page",
    "overview_live",
    "overview_page",
    "who",
]

#: The overview's kind filter: value -> label.
KINDS = {
    "": "every kind",
    "mutex": "mutex",
    "semaphore": "semaphore",
    "queued": "queued hold",
    "rate": "rate limiter",
    "control": "paused or overridden",
}
#: Rows shown on the overview's first page.
PAGE = 500


def e(value: Any) -> str:
    """*value* as HTML text: nothing in it is markup."""
    return html.escape("" if value is None else str(value), quote=True)


@dataclass
class Row:
    """One row of the overview: one key, what holds it and what controls it."""

    name: str
    kind: str
    holders: list[dict[str, Any]]
    held_for: float | None = None
    ttl_ms: int | None = None
    fence: int | None = None
    state: str = ""
    controls: list[dict[str, Any]] | None = None
    master: str | None = None
    detail: str = ""
    #: The task rules that name the key (:mod:`.rules`).
    rules: list[KeyRule] = field(default_factory=list)


def who(holder: dict[str, Any]) -> str:
    """A holder in words: ``task[id] on host (pid N)``."""
    task = holder.get("task_name") or "-"
    tid = holder.get("task_id")
    host, pid = holder.get("hostname"), holder.get("pid")
    where = f" on {host}" if host else ""
    where += f" (pid {pid})" if pid else ""
    return (f"{task}[{tid}]" if tid else str(task)) + where


def group(view: View, rules: list[KeyRule] | None = None) -> list[Row]:
    """The ``--json`` objects of *view* as overview rows: a semaphore's permits in one row,
    each control on its key's rows (a row of its own for a key nothing holds), each row
    with the task *rules* that name its key."""
    now = time.time()
    rows: dict[tuple[str, str, str], Row] = {}
    controls: dict[str, list[dict[str, Any]]] = {}
    for obj in view.objects:
        kind, name = obj["kind"], obj["name"]
        master = obj.get("master")
        if kind == "control":
            controls.setdefault(name, []).append(obj)
            continue
        if kind == "rate":
            detail = f"{obj['rate']}, burst {obj['burst']}: {obj['free']} free now"
            if obj["next_ms"]:
                detail += f", next in {_duration(obj['next_ms'] / 1000)}"
            if obj["queued"]:
                detail += f", {obj['queued']} queued"
            rows[(name, "rate", master or "")] = Row(
                name, "rate", [], ttl_ms=obj["ttl_ms"], master=master, detail=detail
            )
            continue
        label = (
            "semaphore" if kind == "permit" else "queued" if obj["state"] == "queued" else "mutex"
        )
        at = obj.get("acquired_at")
        held = now - at if isinstance(at, (int, float)) else None
        row = rows.get((name, label, master or ""))
        if row is None:
            row = rows[(name, label, master or "")] = Row(
                name, label, [], held, obj["ttl_ms"], obj["fence"], obj["state"], master=master
            )
        else:  # another permit: the row shows the longest held and the newest fence
            row.held_for = max(row.held_for or 0, held or 0) or None
            row.ttl_ms = min(row.ttl_ms or obj["ttl_ms"], obj["ttl_ms"])
            row.fence = max((f for f in (row.fence, obj["fence"]) if f is not None), default=None)
        row.holders.append(obj["holder"])
    for row in rows.values():
        row.controls = (
            controls.pop(row.name, None) if row.kind != "rate" else controls.get(row.name)
        )
    for name, found in controls.items():
        if not any(r.name == name for r in rows.values()):
            rows[(name, "control", "")] = Row(name, "control", [], controls=found)
    for row in rows.values():
        row.rules = matching(rules or [], row.name)
    return sorted(rows.values(), key=lambda r: (r.name, r.kind, r.master or ""))


def _control_text(controls: Iterable[dict[str, Any]] | None) -> str:
    parts = []
    for c in controls or ():
        left = "until lifted" if c["ttl_ms"] is None else f"{_duration(c['ttl_ms'] / 1000)} left"
        what = (
            f"paused: {c['value']}" if c["control"] == "pause" else f"{c['control']} {c['value']}"
        )
        parts.append(f"{what} ({left})")
    return "; ".join(parts)


def _semaphore(row: Row) -> str:
    """``semaphore 2/3``: permits held / the limit in force (an operator's override, else
    the largest limit of the rules that name it); without one, how many are held."""
    used = len(row.holders)
    limit: Any = next((c["value"] for c in row.controls or () if c["control"] == "limit"), None)
    if limit is None:
        limit = max((r.limit for r in row.rules if r.limit and r.limit > 1), default=None)
    return f"semaphore {used}/{limit}" if limit else f"semaphore, {used} held"


_KIND_TEXT = {
    "mutex": "mutex",
    "queued": "queued hold",
    "rate": "rate limiter",
    "control": "control",
}


def overview_live(base: str, view: View, rows: Sequence[Row], kind: str) -> str:
    """The overview's live part: problems, then the table of keys."""
    shown = [r for r in rows if not kind or r.kind == kind or (kind == "control" and r.controls)]
    out = [_problems(view.problems)]
    if not shown:
        out.append('<p class="empty">No key held under this filter.</p>')
        return "".join(out)
    head = ["kind", "name", "holder(s)", "held for", "TTL left", "fence", "control", "rules"]
    if view.redlock:
        head.append("master")
    out.append('<div class="scroll"><table id="keys"><thead><tr>')
    out += [f"<th>{h}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for r in shown[:PAGE]:
        text = _semaphore(r) if r.kind == "semaphore" else _KIND_TEXT[r.kind]
        holders = r.detail or "<br>".join(e(who(h)) for h in r.holders) or "-"
        if r.detail:
            holders = e(r.detail)
        cells = [
            e(text),
            f'<a href="{e(base)}/key/{e(quote(r.name, safe=""))}">{e(r.name)}</a>',
            holders,
            e(_duration(r.held_for)) if r.held_for is not None else "-",
            e(_ttl(r.ttl_ms)) if r.ttl_ms is not None else "-",
            e(r.fence) if r.fence is not None else "-",
            e(_control_text(r.controls)) or "-",
            "<br>".join(e(rule.text) for rule in r.rules) or "-",
        ]
        if view.redlock:
            cells.append(e(r.master or "-"))
        out.append(
            f'<tr data-name="{e(r.name)}" data-kind="{e(r.kind)}" class="{e(r.state)}">'
            + "".join(f'<td data-col="{h}">{c}</td>' for h, c in zip(head, cells, strict=True))
            + "</tr>"
        )
    out.append("</tbody></table></div>")
    more = view.more or len(shown) > PAGE
    count = f"the first {PAGE} names" if more else f"{len(shown)} keys"
    out.append(
        f'<p class="count">{count}'
        + ("; more match: narrow the filter by key prefix to see them" if more else "")
        + "</p>"
    )
    return "".join(out)


def _problems(problems: Sequence[Problem]) -> str:
    if not problems:
        return ""
    items = "".join(
        f'<li class="{e(p.what)}"><b>{e(p.what)}</b> {e(p.master)}: {e(p.detail)}</li>'
        for p in problems
    )
    return f'<ul class="problems">{items}</ul>'


def layout(base: str, title: str, body: str, *, where: str, user: str | None) -> str:
    """A whole page around *body*."""
    who = f'<span class="who">acting as {e(user)}</span>' if user else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(title)} · celery-redlock</title>"
        f'<link rel="stylesheet" href="{e(base)}/static/board.css">'
        f'<script defer src="{e(base)}/static/board.js"></script>'
        f'</head><body><header><a class="home" href="{e(base)}/">celery-redlock board</a>'
        f'<span class="where">{e(where)}</span>{who}</header><main>{body}</main></body></html>'
    )


def overview_page(base: str, live: str, prefix: str, kind: str) -> str:
    options = "".join(
        f'<option value="{e(k)}"{" selected" if k == kind else ""}>{e(v)}</option>'
        for k, v in KINDS.items()
    )
    return (
        f'<form class="filters" method="get" action="{e(base)}/">'
        f'<label>key prefix <input name="prefix" value="{e(prefix)}" autocomplete="off"></label>'
        f'<label>kind <select name="kind">{options}</select></label>'
        '<button type="submit">filter</button></form>'
        f'<div id="live" data-refresh="1000">{live}</div>'
    )


def _when(at: Any) -> str:
    if not isinstance(at, (int, float)):
        return "-"
    try:
        stamp = datetime.fromtimestamp(at, tz=timezone.utc)
    except (OverflowError, OSError, ValueError):
        return "-"
    return stamp.strftime("%H:%M:%S.") + f"{stamp.microsecond // 1000:03d} UTC"


def _event_who(event: dict[str, Any]) -> str:
    text = who({k: event.get(k) for k in ("task_name", "task_id", "hostname", "pid")})
    if isinstance(event.get("holder"), dict):
        text += f" (held by {who(event['holder'])})"
    return text


def _event_more(event: dict[str, Any]) -> str:
    parts = []
    for key, label in (("waited", "waited"), ("held", "held"), ("retry_after", "retry in")):
        if isinstance(event.get(key), (int, float)):
            parts.append(f"{label} {_duration(event[key])}")
    if event.get("error"):
        parts.append(str(event["error"]))
    if event.get("detail"):
        parts.append(str(event["detail"]))
    return ", ".join(parts)


def waiting(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs refused the key (contended, rate limited) that have not taken it since,
    newest first: the waiting runs the events know of."""
    done: set[Any] = set()
    out = []
    for event in events:  # newest first
        tid = event.get("task_id")
        if event.get("kind") in ("acquired", "released", "lost"):
            done.add(tid)
        elif event.get("kind") in ("contended", "rate_limited") and tid not in done:
            done.add(tid)
            out.append(event)
    return out


def key_live(  # noqa: PLR0917 - the parts of one key's page
    base: str,
    name: str,
    view: View,
    events: Sequence[dict[str, Any]],
    problems: Sequence[Problem],
    forms: Any,
    rules: Sequence[KeyRule] = (),
) -> str:
    """A key's live part: holders, controls, fence history, waiting runs and events."""
    out = [_problems([*view.problems, *problems])]
    holders = [o for o in view.objects if o["kind"] in ("lock", "permit")]
    out.append("<h2>Holders</h2>")
    if holders:
        out.append(
            '<div class="scroll"><table id="holders"><thead><tr><th>kind</th><th>state</th>'
            "<th>holder</th><th>held for</th><th>TTL left</th><th>fence</th>"
            + ("<th>master</th>" if view.redlock else "")
            + "<th></th></tr></thead><tbody>"
        )
        now = time.time()
        for o in holders:
            at = o.get("acquired_at")
            held = _duration(now - at) if isinstance(at, (int, float)) else "-"
            out.append(
                f'<tr data-state="{e(o["state"])}"><td>{e(o["kind"])}</td><td>{e(o["state"])}</td>'
                f'<td class="holder">{e(who(o["holder"]))}</td><td>{e(held)}</td>'
                f"<td>{e(_ttl(o['ttl_ms']))}</td>"
                f"<td>{e(o['fence'] if o['fence'] is not None else '-')}</td>"
                + (f"<td>{e(o.get('master') or '-')}</td>" if view.redlock else "")
                + f"<td>{forms.release(o)}</td></tr>"
            )
        out.append("</tbody></table></div>")
    else:
        out.append('<p class="empty">Nobody holds it now.</p>')
    rates = [o for o in view.objects if o["kind"] == "rate"]
    for o in rates:
        out.append(
            f"<h2>Rate limiter</h2><p>{e(o['rate'])}, burst {e(o['burst'])}: {e(o['free'])} free "
            f"now, next in {e(_duration(o['next_ms'] / 1000) if o['next_ms'] else 'now')}, "
            f"{e(o['queued'])} queued runs promised a slot</p>"
        )
    controls = [o for o in view.objects if o["kind"] == "control"]
    if controls:
        out.append(f'<h2>Controls</h2><p id="controls">{e(_control_text(controls))}</p>')
    if rules:
        items = "".join(f"<li>{e(rule.text)}</li>" for rule in rules)
        out.append(f'<h2>Rules that name it</h2><ul id="rules">{items}</ul>')
    fences = [ev for ev in events if ev.get("kind") == "acquired" and ev.get("fence") is not None]
    out.append("<h2>Fence history</h2>")
    if fences:
        out.append(
            '<ol class="fences">'
            + "".join(
                f"<li><b>{e(ev['fence'])}</b> {e(_event_who(ev))} at {e(_when(ev.get('at')))}</li>"
                for ev in fences[:20]
            )
            + "</ol>"
        )
    else:
        out.append('<p class="empty">No acquisition recorded.</p>')
    queued = [o for o in holders if o["state"] == "queued"]
    waits = waiting(events)
    out.append("<h2>Waiting and queued runs</h2>")
    if queued or waits:
        out.append(
            '<ul class="waiting">'
            + "".join(f"<li>queued: {e(who(o['holder']))}</li>" for o in queued)
            + "".join(
                f"<li>{e(ev.get('kind'))} at {e(_when(ev.get('at')))}: {e(_event_who(ev))}</li>"
                for ev in waits
            )
            + "</ul>"
        )
    else:
        out.append('<p class="empty">None known.</p>')
    out.append("<h2>Last events</h2>")
    if events:
        out.append(
            '<div class="scroll"><table id="events"><thead><tr><th>when</th><th>event</th>'
            "<th>run</th><th>fence</th><th></th></tr></thead><tbody>"
        )
        for ev in events:
            out.append(
                f'<tr data-kind="{e(ev.get("kind"))}"><td>{e(_when(ev.get("at")))}</td>'
                f"<td>{e(ev.get('kind'))}</td><td>{e(_event_who(ev))}</td>"
                f"<td>{e(ev.get('fence') if ev.get('fence') is not None else '-')}</td>"
                f"<td>{e(_event_more(ev))}</td></tr>"
            )
        out.append("</tbody></table></div>")
    else:
        out.append(
            '<p class="empty">No event recorded (workers record them unless '
            "redlock_event_log is False).</p>"
        )
    return "".join(out)


def key_page(name: str, live: str, forms: str, message: str) -> str:
    note = f'<p class="done" role="status">{e(message)}</p>' if message else ""
    return (
        f'<h1 class="key">{e(name)}</h1>{note}'
        f'<div id="live" data-refresh="1000">{live}</div>{forms}'
    )


def hidden(fields: dict[str, Any]) -> str:
    return "".join(
        f'<input type="hidden" name="{e(k)}" value="{e(v)}">'
        for k, v in fields.items()
        if v is not None
    )


def query(**params: str) -> str:
    kept = {k: v for k, v in params.items() if v}
    return "?" + urlencode(kept) if kept else ""
