"""Flow control without a server: the rules a task declares (``Limit``, ``Rate``,
``lock_limits``), ``BackOff`` and ``HeldBack``, ``parse_duration``, ``control(app)``'s
checks, and eager runs of tasks with ``lock_limits`` on an in-process ``memory://`` store
(each test has a store of its own).
"""

from __future__ import annotations

import email.utils
import pickle
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_redlock import (
    BackOff,
    ConfigError,
    HeldBack,
    KeyTemplate,
    Limit,
    Lock,
    LockContended,
    LockedTask,
    Rate,
    control,
    install,
    is_skipped,
)
from celery_redlock.app.checks import parse_duration
from celery_redlock.app.rules import check_cost, limits_option
from celery_redlock.app.state import state_for
from celery_redlock.core.backend_types import Rule
from celery_redlock.core.keys import lock_keys, permit_keys
from celery_redlock.task.locked_task import apply_redlock_tasks

#: A fixed "now" for Retry-After dates: 2026-10-21 07:28:00 UTC.
NOW = email.utils.parsedate_to_datetime("Wed, 21 Oct 2026 07:28:00 GMT").timestamp()


@pytest.fixture
def app() -> Iterator[Celery]:
    """An app whose locks live in a memory:// store of this test's own; tasks run eagerly."""
    app = Celery(f"flow-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.redlock_url = f"memory://flow-{uuid.uuid4().hex}"
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    try:
        yield app
    finally:
        if app.finalized:
            state_for(app).backend().clear()  # type: ignore[attr-defined]
        app.close()


def _task(app: Celery, name: str, **options: Any) -> Callable[..., Any]:
    """Decorate ``body(self, account, partner, rows=1)`` (returns its lock's fences) as a
    LockedTask *name* of *app* with *options*."""
    if not app.finalized:
        app.finalize()

    def body(self: Any, account: int, partner: str, rows: int = 1) -> dict[str, int]:
        return dict(self.lock.fences)

    options.setdefault("lock_on_contended", "raise")
    return app.task(base=LockedTask, bind=True, shared=False, name=name, **options)(body)  # type: ignore[no-any-return]


def _run(task: Any, *args: Any, **kwargs: Any) -> Any:
    """One eager run of *task*: its result, or what it raised."""
    return task.apply(args=args, kwargs=kwargs).get()


def _hold_limit(app: Celery, key: str, limit: int) -> Lock:
    """Another run's hold of ``Limit(key, limit)`` in *app*'s store: one of its permits,
    or for a Limit of one the mutex of *key* (a Lock of that name)."""
    keys = lock_keys(key) if limit == 1 else permit_keys(key)
    rule = Rule(keys, limit=limit)
    lock = Lock(
        state_for(app).backend(), f"other:{uuid.uuid4().hex[:8]}", ttl=10, auto_renew=False,
        owner_info={"task_name": "proj.other", "task_id": "t-other"},
    )  # fmt: skip
    lock.hold_with([rule])
    assert lock.acquire(blocking=False)
    return lock


# -- Limit, Rate, lock_limits -------------------------------------------------------------
@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "2", None])
def test_a_limit_must_be_a_whole_number_of_runs(limit: Any) -> None:
    """Limit(key, n) refuses an n that is not a whole number >= 1, naming the rule."""
    with pytest.raises(ConfigError, match=r"Limit\('imports', .*whole number >= 1"):
        Limit("imports", limit)


def test_a_limit_key_is_a_name_or_a_template() -> None:
    """A Limit's key is kept as written, compiled to a KeyTemplate when it has
    placeholders; an empty or unbalanced key is refused."""
    assert Limit("imports", 3).template == "imports"
    template = Limit("tenant:<tenant.id>", 2).template
    assert isinstance(template, KeyTemplate) and template.fields == ("tenant",)
    with pytest.raises(ConfigError, match="non-empty string"):
        Limit("", 1)
    with pytest.raises(ConfigError, match="unbalanced"):
        Limit("tenant:<id", 1)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"rate": "0/s"}, "more than 0 grants"),
        ({"rate": "ten a minute"}, "must look like"),
        ({"rate": None}, "must be a string"),
        ({"rate": "10/m", "burst": 0}, "burst must be a whole number >= 1"),
        ({"rate": "10/m", "burst": True}, "burst must be a whole number >= 1"),
        ({"rate": "10/m", "cost": 0}, "cost of a run must be a whole number >= 1"),
        ({"rate": "10/m", "cost": 3, "burst": 2}, "asks for 3 units, more than .* burst, 2"),
        ({"rate": "10/m", "cost": "<rows><more>"}, "must name one argument"),
        ({"rate": "10/m", "cost": "rows"}, "must name one argument"),
        ({"rate": "10/m", "cost": "n:<rows>"}, "must name one argument"),
        ({"rate": "10/m", "cost": "<*>"}, "must name one argument"),
        ({"rate": "10/m", "cost": 1.5}, "cost must be an int, an argument template"),
    ],
)
def test_a_rate_refuses_a_bad_rate_burst_or_cost(options: dict[str, Any], words: str) -> None:
    """Rate(key, rate, burst=, cost=) refuses each bad value with a ConfigError naming the
    rule and what is wrong."""
    with pytest.raises(ConfigError, match=rf"Rate\('p:acme', .*{words}"):
        Rate("p:acme", **options)


def test_a_rate_compiles_its_interval_and_its_cost() -> None:
    """A Rate's interval is the microseconds between units; its cost stays an int, becomes
    a KeyTemplate of one argument, or stays a callable."""
    assert Rate("p", "600/m").interval_us == 100_000
    assert Rate("p", "2/s", burst=5, cost=5).units == 5
    template = Rate("p:<partner>", "10/s", burst=100, cost="<rows>").units
    assert isinstance(template, KeyTemplate) and template.fields == ("rows",)
    assert Rate("p", "10/s", cost=len).units is len
    assert check_cost("what", 2, 2) == 2
    with pytest.raises(ConfigError, match="what: the cost of a run"):
        check_cost("what", "2", 2)


def test_limits_option_takes_a_list_of_rules_and_nothing_else() -> None:
    """lock_limits is None or a list (tuple) of Limit and Rate rules: a rule alone, a
    string or a list holding something else is a TypeError saying so."""
    rules = [Limit("a", 1), Rate("b", "1/s")]
    assert limits_option(None) == () and limits_option([]) == ()
    assert limits_option(rules) == tuple(rules) and limits_option(tuple(rules)) == tuple(rules)
    for bad in (Limit("a", 1), "a", {"a": 1}):
        with pytest.raises(TypeError, match="a list of Limit"):
            limits_option(bad)
    with pytest.raises(TypeError, match="'x' is neither"):
        limits_option([Limit("a", 1), "x"])


# -- BackOff and HeldBack -----------------------------------------------------------------
def test_back_off_checks_its_seconds_and_key_and_says_what_it_does() -> None:
    """BackOff(seconds, key=, reason=) takes a finite number >= 0 and a key name; its text
    names the key, the time and the reason."""
    for bad in (True, "5", None):
        with pytest.raises(TypeError, match="a number of seconds"):
            BackOff(bad)
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=">= 0"):
            BackOff(bad)
    for key in ("", 5):
        with pytest.raises(TypeError, match="a key name"):
            BackOff(1, key=key)  # type: ignore[arg-type]
    assert str(BackOff(2.5, key="p:acme", reason="429")) == "back-off on 'p:acme' for 2.5s (429)"
    plain = BackOff(0)
    assert (plain.seconds, plain.key, plain.reason, str(plain)) == (
        0.0,
        None,
        "",
        "back-off for 0s",
    )


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30", 30.0),
        (" 7 ", 7.0),
        (b"12", 12.0),
        ("0", 0.0),
        ("Wed, 21 Oct 2026 07:30:00 GMT", 120.0),
        ("Wed, 21 Oct 2026 07:00:00 GMT", 0.0),  # in the past
        ("soon", 9.0),
        ("-5", 9.0),
        ("inf", 9.0),
        ("", 9.0),
        (None, 9.0),
    ],
)
def test_back_off_from_a_retry_after_header(value: Any, seconds: float) -> None:
    """BackOff.from_header reads seconds or an HTTP date (against *now*; a past date is 0);
    a missing or unreadable value gives the default; the reason quotes the header."""
    back_off = BackOff.from_header(value, key="p:acme", default=9.0, now=NOW)
    assert back_off.seconds == pytest.approx(seconds)
    assert back_off.key == "p:acme"
    if value:
        assert back_off.reason == f"Retry-After: {value}"
    assert BackOff.from_header("garbage").seconds == 1.0  # the default default


def test_held_back_says_why_and_survives_pickling_and_rebuilding() -> None:
    """HeldBack is a LockContended naming the key and why (paused with its reason and
    time left or "until resumed", at its limit held by whom, at its rate); pickled, or
    rebuilt from its args as a JSON result backend does, it keeps all of it."""
    holder = {"task_name": "proj.imp", "task_id": "t-1", "hostname": "w1", "pid": 7}
    cases = [
        (HeldBack("p:acme", "paused", {"reason": "maint"}, 1500),
         "'p:acme' is paused (maint); 1.500 s to wait"),
        (HeldBack("p:acme", "paused", {"reason": "maint"}),
         "'p:acme' is paused until resumed (maint)"),
        (HeldBack("p:acme", "paused"), "'p:acme' is paused until resumed (no reason given)"),
        (HeldBack("imports", "limit", holder, 2000),
         "'imports' is at its limit (held by task proj.imp[t-1] on w1 pid 7); 2.000 s to wait"),
        (HeldBack("p:acme", "rate", None, 250), "'p:acme' is at its rate; 0.250 s to wait"),
    ]  # fmt: skip
    for error, text in cases:
        assert isinstance(error, LockContended)
        assert str(error) == text
        for copy in (pickle.loads(pickle.dumps(error)), type(error)(*error.args)):
            assert type(copy) is HeldBack and str(copy) == text
            assert (copy.name, copy.why, copy.holder, copy.ttl_ms) == (
                error.name,
                error.why,
                error.holder,
                error.ttl_ms,
            )


# -- parse_duration and control(app)'s checks ---------------------------------------------
@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("10m", 600), ("1.5h", 5400), ("2d", 172_800), (" 2M ", 120)],
)
def test_parse_duration_reads_an_operators_durations(text: str, seconds: float) -> None:
    """parse_duration reads a number of seconds, or one with s, m, h or d."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["-1m", "0", "0s", "x", "", "m", "10w", "nan", "inf", None])
def test_parse_duration_refuses_what_is_not_a_duration_above_zero(text: Any) -> None:
    """Anything else, or a duration of 0 or less, is a ValueError saying what is expected."""
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_control_refuses_bad_keys_limits_rates_and_durations(app: Celery) -> None:
    """control(app) refuses an empty key, a limit or burst below 1, a rate of nothing, a
    duration of 0 or less and a reason that is not text, writing nothing."""
    controls = control(app)
    for change in (
        lambda: controls.pause(""),
        lambda: controls.pause("k", 0),
        lambda: controls.pause("k", -1.0),
        lambda: controls.pause("k", float("nan")),
        lambda: controls.pause("k", reason=5),  # type: ignore[arg-type]
        lambda: controls.set_limit("k", 0),
        lambda: controls.set_limit("k", True),
        lambda: controls.set_rate("k", "0/s"),
        lambda: controls.set_rate("k", "10/m", burst=0),
    ):
        with pytest.raises(ConfigError):
            change()
    assert controls.overrides() == []
    assert controls.resume("k") is False and controls.unset("k") is False


def test_control_sets_lists_and_lifts_each_kind(app: Celery) -> None:
    """pause, set_limit and set_rate show in overrides() (with time left when given);
    resume lifts the pause only, unset the limit and rate only."""
    controls = control(app)
    controls.pause("k", 60, reason="deploy")
    controls.set_limit("k", 2)
    controls.set_rate("k", "100/m", burst=5)
    assert [(c.kind, c.value) for c in controls.overrides()] == [
        ("limit", "2"),
        ("pause", "deploy"),
        ("rate", "600000|5|100/m"),
    ]
    left = {c.kind: c.ttl_ms for c in controls.overrides("k")}
    assert left["limit"] is None and left["rate"] is None
    assert left["pause"] is not None and 59_000 < left["pause"] <= 60_000
    assert controls.unset("k") is True
    assert [c.kind for c in controls.overrides()] == ["pause"]
    assert controls.resume("k") is True and controls.overrides() == []


# -- lock_limits on a task ----------------------------------------------------------------
def test_a_rule_naming_an_unknown_argument_is_refused_at_decoration(app: Celery) -> None:
    """A lock_limits key or cost template naming an argument the task does not take is a
    ConfigError when the task is decorated, with a did-you-mean."""
    with pytest.raises(
        ConfigError, match=r"key 'p:<partnr>' names <partnr>.*did you mean <partner>"
    ):
        _task(app, "flow.bad_key", lock_key="a:<account>", lock_limits=[Limit("p:<partnr>", 2)])
    with pytest.raises(ConfigError, match=r"cost '<rowz>' names <rowz>.*did you mean <rows>"):
        _task(
            app, "flow.bad_cost", lock_key="a:<account>",
            lock_limits=[Rate("p:<partner>", "10/s", burst=9, cost="<rowz>")],
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"lock_limits=.*must be a list of Limit"):
        _task(app, "flow.not_a_list", lock_key="a:<account>", lock_limits=Limit("x", 1))


def test_lock_limits_without_the_tasks_own_lock_is_refused(app: Celery) -> None:
    """lock_limits with lock_limit=None (a rate-only task: no lock to take the rules with)
    is a ConfigError saying the rules need the task's own lock, where the task is made."""
    with pytest.raises(ConfigError, match="lock_limits must be used with the task's own lock"):
        _task(
            app, "flow.no_lock", lock_key="a:<account>", lock_limit=None, lock_rate="10/m",
            lock_limits=[Limit("imports", 2)],
        )  # fmt: skip


def test_an_eager_run_takes_its_limits_and_gives_their_fences(app: Celery) -> None:
    """An eager run takes its lock and each Limit (self.lock.fences names them all, not the
    Rate); a full Limit refuses it with HeldBack naming the Limit and its holder, or
    skips it with a marker saying held back; a freed permit lets it in."""
    rules = [Limit("imports", 1), Rate("p:<partner>", "100/s", burst=10)]
    task = _task(app, "flow.limited", lock_key="a:<account>", lock_limits=rules)
    skipping = _task(
        app, "flow.skipping", lock_key="b:<account>", lock_limits=rules, lock_on_contended="skip"
    )
    first = _run(task, 1, "acme")
    assert set(first) == {"a:1", "imports"}
    other = _hold_limit(app, "imports", 1)
    with pytest.raises(HeldBack) as refused:
        _run(task, 2, "acme")
    assert (refused.value.name, refused.value.why) == ("imports", "limit")
    assert refused.value.holder["task_id"] == "t-other"
    marker = _run(skipping, 2, "acme")
    assert is_skipped(marker) and marker["reason"] == "held back"
    other.release()
    second = _run(task, 2, "acme")
    assert second["imports"] > first["imports"] and set(second) == {"a:2", "imports"}


def test_an_eager_run_spends_its_rate_cost(app: Celery) -> None:
    """A Rate with a cost template spends that many units per run: with burst 5, rows=3
    then rows=3 is refused (HeldBack "rate" with the wait), rows=2 gets in; another key
    has its own rate; a cost above the burst is a ConfigError."""
    task = _task(
        app, "flow.rated", lock_key="a:<account>",
        lock_limits=[Rate("p:<partner>", "1/m", burst=5, cost="<rows>")],
    )  # fmt: skip
    assert set(_run(task, 1, "acme", rows=3)) == {"a:1"}
    with pytest.raises(HeldBack) as refused:
        _run(task, 2, "acme", rows=3)
    assert (refused.value.name, refused.value.why) == ("p:acme", "rate")
    assert refused.value.ttl_ms is not None and 59_000 < refused.value.ttl_ms <= 60_000
    _run(task, 3, "acme", rows=2)
    _run(task, 4, "globex", rows=5)
    with pytest.raises(ConfigError, match="asks for 6 units"):
        _run(task, 5, "initech", rows=6)


def test_an_eager_run_obeys_a_pause_of_its_key_or_of_a_rule(app: Celery) -> None:
    """A pause of the run's own key or of one of its rules refuses it with HeldBack
    "paused" and the reason; resumed, it runs."""
    task = _task(
        app, "flow.paused", lock_key="a:<account>", lock_limits=[Rate("p:<partner>", "100/s")]
    )
    controls = control(app)
    for key in ("a:1", "p:acme"):
        controls.pause(key, 30, reason=f"{key} down")
        with pytest.raises(HeldBack) as refused:
            _run(task, 1, "acme")
        assert (refused.value.name, refused.value.why) == (key, "paused")
        assert refused.value.holder == {"reason": f"{key} down"}
        assert controls.resume(key)
    assert set(_run(task, 1, "acme")) == {"a:1"}


def test_lock_limits_through_redlock_tasks(app: Celery) -> None:
    """redlock_tasks gives a plain task lock_limits: its eager run takes the Limit (in
    self.lock.fences) and is refused by it when full; a template naming an unknown
    argument there is a ConfigError when a worker sets the tasks up."""
    app.conf.redlock_tasks = {
        "flow.plain": {
            "lock_key": "a:<account>",
            "lock_limits": [Limit("imports", 1)],
            "lock_on_contended": "raise",
        }
    }
    install(app)

    @app.task(bind=True, shared=False, name="flow.plain")
    def plain(self: Any, account: int) -> dict[str, int]:
        return dict(self.lock.fences)

    app.finalize()
    task = app.tasks["flow.plain"]
    assert isinstance(task, LockedTask)
    assert set(_run(task, 1)) == {"a:1", "imports"}
    other = _hold_limit(app, "imports", 1)
    with pytest.raises(HeldBack, match="'imports' is at its limit"):
        _run(task, 2)
    other.release()

    broken = Celery("flow-broken", broker="memory://", set_as_current=False)
    broken.conf.redlock_url = "memory://flow-broken"
    broken.conf.redlock_tasks = {
        "flow.plain": {"lock_key": "a:<account>", "lock_limits": [Limit("p:<acount>", 1)]}
    }
    install(broken)

    @broken.task(shared=False, name="flow.plain")
    def again(account: int) -> None: ...

    try:
        broken.finalize()  # Celery's signal dispatch logs what its receivers raise
        with pytest.raises(ConfigError, match="did you mean <account>"):
            apply_redlock_tasks(broken)  # as a worker does at start: it stops there
    finally:
        broken.close()


def test_back_off_in_an_eager_body_pauses_its_key_and_is_raised(app: Celery) -> None:
    """BackOff raised in an eager body pauses its key for every worker (the task's first
    Rate key, else its own lock key, or the key it names) for its seconds, shows in
    control(app).overrides() with its reason, and is raised to the caller; the next run
    is held back by that pause. BackOff(0) pauses nothing."""
    if not app.finalized:
        app.finalize()
    raised: dict[str, BackOff] = {
        "rated": BackOff(30, reason="429 from partner"),
        "plain": BackOff(20, reason="busy"),
        "named": BackOff(10, key="upstream"),
        "zero": BackOff(0),
    }

    def make(kind: str, **options: Any) -> Any:
        def body(account: int, partner: str) -> None:
            raise raised[kind]

        return app.task(
            base=LockedTask, shared=False, name=f"flow.{kind}", lock_key=f"{kind}:<account>",
            lock_on_contended="raise", **options,
        )(body)  # fmt: skip

    tasks = {
        "rated": make("rated", lock_limits=[Rate("p:<partner>", "100/s")]),
        "plain": make("plain"),
        "named": make("named"),
        "zero": make("zero"),
    }
    for kind, task in tasks.items():
        with pytest.raises(BackOff) as caught:
            _run(task, 1, "acme")
        assert caught.value is raised[kind]
    paused = {c.name: c for c in control(app).overrides() if c.kind == "pause"}
    assert set(paused) == {"p:acme", "plain:1", "upstream"}
    for key, kind, why in (
        ("p:acme", "rated", "429 from partner"),
        ("plain:1", "plain", "busy"),
        ("upstream", "named", "BackOff raised"),
    ):
        assert paused[key].value.startswith(f"{why} in flow.{kind}["), paused[key]
        ms = raised[kind].seconds * 1000
        assert paused[key].ttl_ms is not None and ms - 1_000 < paused[key].ttl_ms <= ms
    with pytest.raises(HeldBack) as refused:
        _run(tasks["rated"], 2, "acme")
    assert (refused.value.name, refused.value.why) == ("p:acme", "paused")
    assert "429 from partner" in refused.value.holder["reason"]


def test_two_rates_rendering_one_key_for_a_call_are_refused_not_counted_twice(
    app: Celery,
) -> None:
    """Two Rate rules whose keys render to one name for a call would each check the same
    state before either takes its units (granting more than the burst): the call fails
    with a ConfigError naming the key; calls where they differ run."""
    task = _task(
        app, "flow.two_rates", lock_key="a:<account>",
        lock_limits=[Rate("p:<partner>", "5/s"), Rate("p:<account>", "5/s")],
    )  # fmt: skip
    assert set(_run(task, 1, "acme")) == {"a:1"}
    with pytest.raises(ConfigError, match=r"two Rate rules of lock_limits name 'p:7'"):
        _run(task, 7, "7")
