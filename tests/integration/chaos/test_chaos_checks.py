"""The chaos checks catch what they claim to: each violation, made up by hand, is reported.

These run without servers: they feed :func:`chaos_harness.analyse` records such as the
workers write, so a scenario that passes is known to have been able to fail.
"""

from __future__ import annotations

from typing import Any

from chaos_harness import analyse, last_message_gone
from fenced_store import KeyState, Operation


def _check(t: float, vu: float, lost: bool = False) -> dict[str, Any]:
    return {"t": t, "vu": vu, "lost": lost, "valid": not lost and t < vu}


def _run(
    run: str, fence: int, start: float, end: float | None, vu: float, pid: int = 1,
    write_at: float | None = None, key: str = "k0",
) -> list[dict[str, Any]]:  # fmt: skip
    """Records of one run: start, read, write, end; *vu* is the deadline it keeps seeing."""
    out = [
        {"event": "start", "run": run, "key": key, "task": "t", "task_id": run, "pid": pid,
         "fence": fence, **_check(start, vu)},
        {"event": "read", "run": run, "accepted": True, "pid": pid, **_check(start + 0.01, vu)},
    ]  # fmt: skip
    if write_at is not None:
        out.append({
            "event": "write", "run": run, "accepted": True, "fence": fence, "pid": pid,
            "before": _check(write_at, vu), "after": _check(write_at + 0.01, vu),
        })  # fmt: skip
    if end is not None:
        out.append({"event": "end", "run": run, "outcome": "written", "pid": pid,
                    **_check(end, vu)})  # fmt: skip
    return out


def _store(*ops: tuple[str, int, bool], value: int | None = None) -> dict[str, KeyState]:
    log = tuple(Operation(k, f, a) for k, f, a in ops)
    accepted = sum(1 for op in log if op.kind == "w" and op.accepted)
    refused = sum(1 for op in log if not op.accepted)
    seen = max((op.fence for op in log if op.accepted), default=0)
    written = max((op.fence for op in log if op.kind == "w" and op.accepted), default=0)
    return {"k0": KeyState(accepted if value is None else value, seen, written, refused, log)}


GOOD_STORE = (("r", 1, True), ("w", 1, True), ("r", 2, True), ("w", 2, True))


def test_clean_history_has_no_violation() -> None:
    """Two runs one after the other, fences 1 then 2, store consistent: nothing reported."""
    events = _run("a", 1, 0.0, 1.0, 2.0, write_at=0.5) + _run("b", 2, 1.1, 2.0, 3.1, write_at=1.5)
    found = analyse(events, _store(*GOOD_STORE), {})
    assert found.violations == []
    assert found.runs == 2 and found.accepted_writes == 2


def test_overlapping_valid_runs_are_reported() -> None:
    """Run b starts while run a still holds a valid lock: an overlap."""
    events = _run("a", 1, 0.0, 1.0, 2.0, write_at=0.5) + _run("b", 2, 0.8, 2.0, 3.1, write_at=1.5)
    found = analyse(events, _store(*GOOD_STORE), {})
    assert any("still held a valid lock" in v for v in found.violations), found.violations


def test_a_killed_run_holds_only_until_its_kill() -> None:
    """A run SIGKILLed at 0.5 (no end record) does not overlap a run that starts at 0.6."""
    events = _run("a", 1, 0.0, None, 2.0, pid=7) + _run("b", 2, 0.6, 1.0, 2.6, write_at=0.7)
    store = _store(("r", 1, True), ("r", 2, True), ("w", 2, True))
    assert analyse(events, store, {7: 0.5}).violations == []
    assert analyse(events, store, {}).violations, "without the kill it is an overlap"


def test_fence_that_goes_backwards_or_repeats_is_reported() -> None:
    """A later run with a lower or equal fence (a restarted counter) is reported."""
    lower = _run("a", 5, 0.0, 1.0, 2.0) + _run("b", 3, 2.5, 3.0, 4.5)
    assert any("not above fence" in v for v in analyse(lower, {}, {}).violations)
    same = _run("a", 5, 0.0, 1.0, 2.0) + _run("b", 5, 2.5, 3.0, 4.5)
    assert any("more than one run" in v for v in analyse(same, {}, {}).violations)


def test_lost_update_and_miscounted_refusals_are_reported() -> None:
    """A counter below the accepted writes, or a refusal count that does not match the log."""
    lost = analyse([], _store(*GOOD_STORE, value=1), {})
    assert any("lost update" in v for v in lost.violations)
    state = _store(("r", 2, True), ("r", 1, False))["k0"]
    miscounted = {"k0": KeyState(state.value, state.seen, state.written, 0, state.log)}
    assert any("refusals" in v for v in analyse([], miscounted, {}).violations)


def test_store_log_against_the_fencing_rule_is_reported() -> None:
    """A log where a stale write was accepted (a broken store) is reported."""
    found = analyse([], _store(("r", 3, True), ("w", 3, True), ("w", 2, True)), {})
    assert any("disagrees with the fencing rule" in v for v in found.violations)


def test_write_refused_while_valid_is_reported() -> None:
    """The store refused a write although the writer's lock was valid before and after it."""
    events = _run("a", 1, 0.0, 1.0, 2.0, write_at=0.5)
    for e in events:
        if e["event"] == "write":
            e["accepted"] = False
    found = analyse(events, _store(("r", 1, True), ("r", 2, True), ("w", 1, False)), {})
    assert any("while its lock was valid" in v for v in found.violations), found.violations
    assert found.refused_writes == 1


def test_a_scenario_can_excuse_only_violations_its_documented_limit_explains() -> None:
    """A fence handed out twice is excused when the first holder held it as its master
    died (the Sentinel caveat), and reported when the death came at another time."""
    events = _run("a", 5, 0.0, 1.0, 2.0) + _run("b", 5, 3.0, 3.5, 5.0)

    def died_at(t: float) -> Any:
        return lambda runs: any(r.start - 0.5 <= t <= (r.end or t) for r in runs)

    during = analyse(events, {}, {})
    assert during.excuse(died_at(0.5)) and not during.violations
    later = analyse(events, {}, {})
    assert not later.excuse(died_at(2.0)) and later.violations


def test_only_a_message_nobody_received_counts_as_gone() -> None:
    """A task never received, or retried with its retry's message never received, lost a
    message in the broker; a retry received (even before its ``retried`` record) did not,
    and a redelivery does not stand in for a first delivery."""

    def received(task: str, redelivered: bool = False) -> dict[str, Any]:
        return {"event": "received", "task_id": task, "redelivered": redelivered}

    def retried(task: str) -> dict[str, Any]:
        return {"event": "retried", "task_id": task}

    events = [
        received("again"), retried("again"), received("again"),
        received("early"), received("early"), retried("early"),
        received("popped"), retried("popped"),
        received("restored"), received("restored", redelivered=True), retried("restored"),
        received("done"),
    ]  # fmt: skip
    tasks = ["again", "early", "popped", "restored", "done", "never"]
    assert last_message_gone(events, tasks) == {"popped", "restored", "never"}
