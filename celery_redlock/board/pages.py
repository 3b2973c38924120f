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
from .liveness import gone
from .rules import KeyRule, matching
from .source import Problem, View, merged

__all__ = [
    "KINDS",
    "Row",
    "e",
    "group",
    "key_live",
    "key_page",
    "keys_text",
    "label",
    "link",
    "overview_filters",
    "overview_live",
    "overview_page",
    "unknown_text",
    "waiting",
    "who",
    "who_html",
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
#: Keys a page of the overview shows.
PAGE = 50
#: The overview's state filter: value -> label.
STATES = {"": "every state", "held": "held", "running": "running", "queued": "queued"}
#: The overview's orders: value -> label.
SORTS = {"name": "name", "-name": "name, reversed"}
#: The counts shown first on the overview: (count key, label, kind, state).
_COUNTS = (
    ("mutex", "mutexes", "mutex", ""),
    ("mutex:running", "running", "mutex", "running"),
    ("mutex:held", "held", "mutex", "held"),
    ("mutex:queued", "kept for a redelivery", "mutex", "queued"),
    ("semaphore", "semaphores", "semaphore", ""),
    ("queued", "queued holds", "queued", ""),
    ("rate", "rate limiters", "rate", ""),
    ("control", "controls", "control", ""),
)
#: What the page says when nothing can be said of what is held.
NO_ANSWER = "The store did not answer: holders unknown."


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
    #: On a Redlock: "2 of 3" masters agree on the holder.
    agree: str = ""
    #: The task rules that name the key (:mod:`.rules`).
    rules: list[KeyRule] = field(default_factory=list)


def who(holder: dict[str, Any]) -> str:
    """A holder in words: ``task[id] on w1@host (pid N)``: its worker's node name where
    the record has it (a task's run), else its host."""
    task = holder.get("task_name") or "-"
    tid = holder.get("task_id")
    host, pid = holder.get("worker") or holder.get("hostname"), holder.get("pid")
    where = f" on {host}" if host else ""
    where += f" (pid {pid})" if pid else ""
    return (f"{task}[{tid}]" if tid else str(task)) + where


def who_html(holder: dict[str, Any], *, queued: bool = False) -> str:
    """:func:`who` as HTML, with a mark when its worker is known to run no more
    (:func:`~.liveness.gone`). A *queued* hold's record is its publisher's, not a worker's:
    it says so, and the publisher's exit is no mark (it publishes and goes). A run kept
    for its redelivered message (``kept_for``) is still its worker's."""
    if queued and not holder.get("kept_for"):
        task = holder.get("task_name") or "-"
        tid = holder.get("task_id")
        host, pid = holder.get("hostname"), holder.get("pid")
        by = f" by {host}" if host else ""
        by += f" (publisher pid {pid})" if pid else ""
        name = f"{task}[{tid}]" if tid else str(task)
        return e(f"{name}, published{by}, not started yet")
    why = gone(holder)
    text = e(who(holder))
    if why:
        text += f' <span class="gone" title="{e(why)}">worker gone: {e(why)}</span>'
    return text


def group(view: View, rules: list[KeyRule] | None = None) -> list[Row]:
    """The ``--json`` objects of *view* as overview rows: a semaphore's permits in one row,
    each control on its key's rows (a row of its own for a key nothing holds), each row
    with the task *rules* that name its key."""
    now = time.time()
    rows: dict[tuple[str, str, str], Row] = {}
    controls: dict[str, list[dict[str, Any]]] = {}
    for obj in merged(view):
        kind, name = obj["kind"], obj["name"]
        master = None if view.redlock else obj.get("master")
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
            if "masters" in obj:
                row.agree = f"{obj['masters']} of {obj['of']}"
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
    return list(rows.values())


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


def link(name: str) -> str:
    """The path of key *name*'s page: every character URL-quoted, so that a name of
    spaces, slashes or ``?`` is one path segment."""
    return "/key/" + quote(name, safe="")


def label(name: str) -> str:
    """*name* as link text a person can see and click: a name of spaces only, or empty,
    shows its characters' codes in brackets (``[U+0020 U+0020]``)."""
    if name.strip():
        return name
    return "[" + " ".join(f"U+{ord(c):04X}" for c in name) + "]"


def unknown_text(view: View, now: float | None = None) -> str:
    """What the page says when nothing can be said of what is held (:attr:`View.unknown`),
    and since when: the store's last answer to this board."""
    if view.quorum_lost:
        text = (
            f"Fewer than a majority of the masters answered ({view.answered} of "
            f"{view.masters}): the quorum is lost, holders unknown."
        )
    else:
        text = NO_ANSWER
    if view.last_answer is None:
        return f"{text} No answer since the board started."
    now = time.time() if now is None else now
    at = time.strftime("%H:%M:%S", time.gmtime(view.last_answer))
    return f"{text} Last answer {at} UTC, {max(0, round(now - view.last_answer))} s ago."


def keys_text(n: int) -> str:
    """``1 key``, ``N keys``."""
    return "1 key" if n == 1 else f"{n:,} keys"


def _counts(base: str, view: View, filters: dict[str, str]) -> str:
    """The counts by kind and state, each a link to its filter."""
    items = []
    for key, text, kind, state in _COUNTS:
        n = view.counts.get(key, 0)
        href = f"{base}/" + query(**{**filters, "kind": kind, "state": state, "offset": ""})
        items.append(
            f'<li data-count="{e(key)}"><a href="{e(href)}">{e(text)}</a> <b>{n:,}</b></li>'
        )
    return f'<ul class="counts">{"".join(items)}</ul>'


def _pager(base: str, view: View, filters: dict[str, str]) -> str:
    """ "N keys", what this page shows of them, and links to the pages before and after."""
    total = view.total or 0
    shown = f'<p class="count">{e(keys_text(total))}'
    limit = view.limit or total
    if total > limit:
        last = min(total, view.offset + limit)
        shown += f", {view.offset + 1:,}-{last:,} shown" if last > view.offset else ", none here"
        if view.offset > 0:
            back = max(0, view.offset - limit)
            before = query(**{**filters, "offset": str(back) if back else ""})
            shown += f' <a rel="prev" href="{e(base)}/{e(before)}">previous</a>'
        if last < total:
            after = query(**{**filters, "offset": str(view.offset + limit)})
            shown += f' <a rel="next" href="{e(base)}/{e(after)}">next</a>'
    return shown + "</p>"


def overview_live(
    base: str,
    view: View,
    rows: Sequence[Row],
    filters: dict[str, str] | None = None,
    timeline: str = "",
) -> str:
    """The overview's live part: problems, the counts by kind and state, the *timeline*
    of the page's keys, then the page of keys and where it is among them. *filters*: the
    query of the page (prefix, kind, state, task_id, worker, sort), kept by the count and
    page links."""
    filters = dict(filters or {})
    out = [_problems(view.problems)]
    if view.unknown:
        out.append(f'<p class="unknown" role="alert">{e(unknown_text(view))}</p>')
        return "".join(out)
    out.append(_counts(base, view, filters))
    if timeline:
        out.append(f'<section id="timeline"><h2>Last minutes</h2>{timeline}</section>')
    return "".join(out) + _keys_table(base, view, rows, filters)


def _keys_table(base: str, view: View, rows: Sequence[Row], filters: dict[str, str]) -> str:
    """The overview's page of keys and where it is among them."""
    out: list[str] = []
    if not rows:
        out.append('<p class="empty">No key held under this filter.</p>')
        out.append(_pager(base, view, filters))
        return "".join(out)
    head = ["kind", "name", "holder(s)", "held for", "TTL left", "fence", "control", "rules"]
    if view.redlock:
        head.append("masters")
    out.append('<div class="scroll"><table id="keys"><thead><tr>')
    out += [f"<th>{h}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for r in rows:
        text = _semaphore(r) if r.kind == "semaphore" else _KIND_TEXT[r.kind]
        waits = r.state == "queued"
        holders = "<br>".join(who_html(h, queued=waits) for h in r.holders) or "-"
        if r.detail:
            holders = e(r.detail)
        cells = [
            e(text),
            f'<a href="{e(base)}{e(link(r.name))}">{e(label(r.name))}</a>',
            holders,
            e(_duration(r.held_for)) if r.held_for is not None else "-",
            e(_ttl(r.ttl_ms)) if r.ttl_ms is not None else "-",
            e(r.fence) if r.fence is not None else "-",
            e(_control_text(r.controls)) or "-",
            "<br>".join(e(rule.text) for rule in r.rules) or "-",
        ]
        if view.redlock:
            cells.append(e(r.agree or "-"))
        out.append(
            f'<tr data-name="{e(r.name)}" data-kind="{e(r.kind)}" class="{e(r.state)}">'
            + "".join(f'<td data-col="{h}">{c}</td>' for h, c in zip(head, cells, strict=True))
            + "</tr>"
        )
    out.append("</tbody></table></div>")
    out.append(_pager(base, view, filters))
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


def overview_filters(args: dict[str, str]) -> dict[str, str]:
    """The overview's query from the request's *args*: each filter, a value outside its
    choices dropped (prefix, kind, state, task_id, worker, offset, sort)."""
    out = {k: args.get(k, "") for k in ("prefix", "task_id", "worker")}
    out["kind"] = args.get("kind", "") if args.get("kind", "") in KINDS else ""
    out["state"] = args.get("state", "") if args.get("state", "") in STATES else ""
    out["sort"] = args.get("sort", "") if args.get("sort", "") in SORTS else ""
    offset = args.get("offset", "")
    out["offset"] = offset if offset.isdigit() and offset.isascii() else ""
    return out


def _select(name: str, choices: dict[str, str], chosen: str) -> str:
    options = "".join(
        f'<option value="{e(k)}"{" selected" if k == chosen else ""}>{e(v)}</option>'
        for k, v in choices.items()
    )
    return f'<select name="{e(name)}">{options}</select>'


def overview_page(
    base: str, live: str, filters: dict[str, str], actions: str = "", message: str = ""
) -> str:
    """The overview around its live part: the filters (key prefix, kind, state, task id,
    worker) and the order, the *message* of an action's end and the *actions* form."""

    def field(name: str, text: str) -> str:
        value = e(filters.get(name, ""))
        return f'<label>{text} <input name="{name}" value="{value}" autocomplete="off"></label>'

    return (
        f'<form class="filters" method="get" action="{e(base)}/">'
        + field("prefix", "key prefix")
        + f"<label>kind {_select('kind', KINDS, filters.get('kind', ''))}</label>"
        + f"<label>state {_select('state', STATES, filters.get('state', ''))}</label>"
        + field("task_id", "task id")
        + field("worker", "worker")
        + f"<label>order {_select('sort', SORTS, filters.get('sort', 'name'))}</label>"
        + '<button type="submit">filter</button></form>'
        + (f'<p class="done" role="status">{e(message)}</p>' if message else "")
        + f'<div id="live" data-refresh="1000">{live}</div>{actions}'
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


#: Events after which a run no longer waits for the key: it took it (an acquire, a rate
#: slot granted), gave up, ended or was skipped.
_DONE = (
    "acquired", "granted", "released", "lost", "forced", "skipped", "superseded", "failed",
    "expired",
)  # fmt: skip
#: Events of a run refused the key that will come back for it.
_REFUSED = ("contended", "rate_limited")


#: Refused runs that wait for nothing: skipped, or failed with LockContended.
_GIVEN_UP = frozenset({"skip", "raise"})


def waiting(events: Sequence[dict[str, Any]], now: float | None = None) -> list[dict[str, Any]]:
    """The runs refused the key (contended, rate limited) that wait for it now, newest
    first: refused, not skipped or failed (``policy`` "skip" or "raise"), with no later
    event of the run, and
    refused less than their own wait ago (``retry_after``; a minute without one), after
    which their retry has come and gone or they were given up."""
    now = time.time() if now is None else now
    done: set[Any] = set()
    out = []
    for event in events:  # newest first
        tid = event.get("task_id")
        kind = event.get("kind")
        if kind in _DONE:
            done.add(tid)
        elif kind in _REFUSED and tid not in done:
            done.add(tid)
            if (event.get("policy") or event.get("outcome")) in _GIVEN_UP:
                continue
            at = event.get("at")
            wait = event.get("retry_after")
            wait = float(wait) if isinstance(wait, (int, float)) else 60.0
            if isinstance(at, (int, float)) and now - at > wait + 5.0:
                continue
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
    timeline: str = "",
) -> str:
    """A key's live part: holders, its *timeline*, controls, fence history, waiting runs
    and events."""
    out = [_problems([*view.problems, *problems])]
    holders = [o for o in merged(view) if o["kind"] in ("lock", "permit")]
    out.append("<h2>Holders</h2>")
    if view.unknown:  # what a minority of masters says is shown, but is not the state
        out.append(f'<p class="unknown" role="alert">{e(unknown_text(view))}</p>')
    if holders:
        out.append(
            '<div class="scroll"><table id="holders"><thead><tr><th>kind</th><th>state</th>'
            "<th>holder</th><th>held for</th><th>TTL left</th><th>fence</th>"
            + ("<th>masters</th>" if view.redlock else "")
            + "<th></th></tr></thead><tbody>"
        )
        now = time.time()
        for o in holders:
            at = o.get("acquired_at")
            held = _duration(now - at) if isinstance(at, (int, float)) else "-"
            out.append(
                f'<tr data-state="{e(o["state"])}"><td>{e(o["kind"])}</td><td>{e(o["state"])}</td>'
                f'<td class="holder">{who_html(o["holder"], queued=o["state"] == "queued")}'
                f"</td><td>{e(held)}</td>"
                f"<td>{e(_ttl(o['ttl_ms']))}</td>"
                f"<td>{e(o['fence'] if o['fence'] is not None else '-')}</td>"
                + (f"<td>{e(_agree(o))}</td>" if view.redlock else "")
                + f"<td>{forms.release(o)}</td></tr>"
            )
        out.append("</tbody></table></div>")
    elif not view.unknown:
        out.append('<p class="empty">Nobody holds it now.</p>')
    if timeline:
        out.append(f'<section id="timeline"><h2>Last minutes</h2>{timeline}</section>')
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
    if view.unknown and not queued:
        out.append('<p class="unknown">Unknown: the store did not answer.</p>')
    elif queued or waits:
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


def _agree(obj: dict[str, Any]) -> str:
    """How many masters agree on a Redlock's holder: ``2 of 3``."""
    if "masters" in obj:
        return f"{obj['masters']} of {obj['of']}"
    return str(obj.get("master") or "-")


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
