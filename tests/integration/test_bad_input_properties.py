"""Property tests (hypothesis) for bad and odd input: key templates, argument values, task
options and the core ``Lock``'s options.

What holds for every input hypothesis tries:

* a call locks one name, whichever way its arguments are passed, in this process or in
  another one (another hash seed), and whatever a worker receives of the value after
  Celery's JSON or pickle serializer (42 and "42", a UUID and its str, a tuple and a
  list are one name, as ``celery_redlock/core/keys.py`` documents);
* the key is bounded in length and can be sent to Redis;
* every refusal is a ``ConfigError`` whose message names the task and the option (or the
  setting) and says what it must be; every accepted value runs a task under its lock
  on a real Redis, and no accepted value leaves a key without expiry behind.

Runs are bounded: fixed example counts, ``derandomize=True`` (the same examples on every
run, in CI too), no deadline (the Redis round trips vary on a loaded machine).
"""

from __future__ import annotations

import copy
import datetime as dt
import decimal
import gc
import itertools
import json
import math
import os
import pickle
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from celery import Celery
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads
from servers import RedisServer, free_port

from celery_redlock import ConfigError, Lock, LockedTask, StoreUnavailable, connect
from celery_redlock.app.config import OPTIONS as TASK_OPTIONS
from celery_redlock.app.config import load_settings
from celery_redlock.app.state import state_for
from celery_redlock.core.connect import mask_url
from celery_redlock.core.keys import MAX_NAME_LENGTH, lock_keys
from celery_redlock.task.contention import backoff_delay
from celery_redlock.task.locked_task import lock_name_for
from tests.apps import keysapp

ROOT = Path(__file__).resolve().parents[2]
FAST = settings(max_examples=150, deadline=None, derandomize=True)
ON_REDIS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_names = itertools.count(1)

# -- values a task may be called with ---------------------------------------------------------
SCALARS = st.one_of(
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=30),
    st.booleans(),
    st.none(),
    st.uuids(),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.dates(),
    st.datetimes(timezones=st.none() | st.just(dt.timezone.utc)),
    st.times(),
    st.binary(max_size=16),
    st.sampled_from(list(keysapp.Color)),
    st.sampled_from(list(keysapp.Level)),
)
#: Dict keys as JSON writes them back: float keys are left out (JSON turns 1e16 into the
#: key "1e+16", while the value 1e16 renders as 10000000000000000).
KEYS = st.text(max_size=8) | st.integers() | st.booleans() | st.none()
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(KEYS, inner, max_size=4),
        st.frozensets(SCALARS, max_size=4),
        st.sets(SCALARS, max_size=4),
    ),
    max_leaves=10,
)


#: The tasks themselves (``keysapp.sync`` is Celery's lazy proxy of one, which a worker
#: never sees).
SYNC = keysapp.app.tasks["keysapp.sync"]
PAIR = keysapp.app.tasks["keysapp.pair"]
NESTED = keysapp.app.tasks["keysapp.nested"]


def test_the_tasks_under_test_render_their_templates() -> None:
    """The key tests below test rendering, not a fallback to the task name."""
    assert name_of(SYNC, 42) == "sync:42"
    assert name_of(PAIR, "acme", 7) == "pair:acme:7:null"
    assert name_of(NESTED, {"org": "acme"}) == "acct:acme"


def name_of(task: Any, *args: Any, **kwargs: Any) -> str:
    """The lock name a worker renders for this call."""
    return lock_name_for(task, args, kwargs)


def json_trip(value: Any) -> Any:
    """*value* as a worker receives it through Celery's JSON serializer."""
    try:
        text = kombu_dumps(value)
    except TypeError:  # sets, and the like: the JSON serializer refuses them at publish
        assume(False)
    try:
        return kombu_loads(text)
    except ValueError:  # kombu 5.3.0 cannot decode a UUID of version 6-15 it encoded itself
        assume(False)  # (fixed in 5.3.1): such a call never reaches a worker there


# -- keys: stable, bounded, equal for equal values -------------------------------------------


@FAST
@given(user_id=VALUES, org=VALUES)
def test_a_call_locks_one_name_however_its_arguments_are_passed(user_id: Any, org: Any) -> None:
    """Positional or keyword, defaults given or not, a copy of the value or the value: one
    name, and its key is bounded and sendable."""
    sync, pair = SYNC, PAIR
    name = name_of(sync, user_id)
    assert name == name_of(sync, user_id=user_id) == name_of(sync, copy.deepcopy(user_id), True)
    assert name == name_of(sync, user_id, full=True)
    both = name_of(pair, org, user_id)
    assert both == name_of(pair, org=org, user_id=user_id, full=None) == name_of(pair, org, user_id)
    assert both == name_of(pair, copy.deepcopy(org), copy.deepcopy(user_id), None)
    for rendered in (name, both):
        key = lock_keys(rendered).lock
        assert len(key) <= len("redlock:{}") + MAX_NAME_LENGTH
        key.encode("utf-8")  # Redis keys are bytes: the key must encode


@FAST
@given(user_id=VALUES)
def test_what_a_worker_receives_of_a_value_locks_the_same_name(user_id: Any) -> None:
    """The value as the caller passed it, and as a worker gets it from Celery's JSON or
    pickle serializer, render one name (an eager call and a worker run exclude each other,
    and a name rendered at publish time is the worker's)."""
    name = name_of(SYNC, user_id)
    assert name_of(SYNC, pickle.loads(pickle.dumps(user_id))) == name
    assert name_of(SYNC, json_trip(user_id)) == name


EQUAL = [
    (42, "42"),
    (uuid.UUID("12345678-1234-5678-1234-567812345678"), "12345678-1234-5678-1234-567812345678"),
    (7.0, 7),
    (decimal.Decimal("1.50"), "1.50"),
    (dt.date(2024, 6, 1), "2024-06-01"),
    ((1, "a"), [1, "a"]),
    ({"b": 1, "a": [2, 3]}, {"a": [2, 3], "b": 1}),
    ({3, 1, 2}, {2, 3, 1}),
    (frozenset({"x", "y"}), {"y", "x"}),
    ({1: "a"}, {"1": "a"}),
    (keysapp.Color.RED, "red"),
    (keysapp.Level.HIGH, 2),
]


@pytest.mark.parametrize(("one", "other"), EQUAL, ids=[type(a).__name__ for a, _ in EQUAL])
def test_equal_values_lock_equal_names(one: Any, other: Any) -> None:
    """Values that are one value to a user (and to the JSON a worker receives) lock one
    name: 42 and "42", a UUID and its str, a tuple and a list, dicts and sets in any order."""
    assert name_of(SYNC, one) == name_of(SYNC, other)


def test_names_are_the_same_in_another_process_with_another_hash_seed() -> None:
    """Set and dict iteration order depends on the hash seed: the names a process with
    another seed renders for the same calls are the same."""
    values = st.lists(VALUES, min_size=40, max_size=40)
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    @settings(max_examples=3, deadline=None, derandomize=True, database=None)
    @given(values)
    def collect(drawn: list[Any]) -> None:
        for i, value in enumerate(drawn):
            strings = {f"s{i}-{j}" for j in range(5)}  # string hashes follow the seed
            calls.append(("keysapp.sync", (value,), {}))
            calls.append(("keysapp.pair", (strings, value), {}))

    collect()
    here = [name_of(keysapp.app.tasks[task], *args, **kwargs) for task, args, kwargs in calls]
    script = (
        "import json, pickle, sys\n"
        "from tests.apps import keysapp\n"
        "from celery_redlock.task.locked_task import lock_name_for\n"
        "calls = pickle.load(sys.stdin.buffer)\n"
        "print(json.dumps([lock_name_for(keysapp.app.tasks[t], a, k) for t, a, k in calls]))\n"
    )
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script],
            input=pickle.dumps(calls),
            capture_output=True,
            cwd=ROOT,
            env=env,
            timeout=60,
            check=True,
        )
        assert json.loads(done.stdout) == here


# -- refusals name the task and the option -----------------------------------------------------


class Opaque:
    """An object with no canonical text (its str() would hold a memory address)."""


@pytest.mark.parametrize(
    ("task", "args", "words"),
    [
        (SYNC, (Opaque(),), "Opaque"),
        (SYNC, ([1, Opaque()],), "Opaque"),
        (SYNC, ({"k": object()},), "object"),
        (SYNC, (len,), "builtin_function_or_method"),
        (NESTED, ({"id": 1},), "org"),
        (NESTED, (Opaque(),), "org"),
        (NESTED, (None,), "org"),
    ],
    ids=["object", "in-list", "in-dict", "function", "missing-key", "missing-attr", "none"],
)
def test_an_argument_the_key_cannot_be_rendered_from_is_a_config_error_naming_task_and_option(
    task: Any, args: tuple[Any, ...], words: str
) -> None:
    """An argument with no canonical text, or without the field ``<a.b>`` reads: a
    ConfigError naming the task, ``lock_key`` and what is wrong; the eager run fails with it
    before any lock is asked for."""
    with pytest.raises(ConfigError) as caught:
        name_of(task, *args)
    message = str(caught.value)
    assert repr(task.name) in message and "lock_key" in message and words in message
    result = task.apply(args=args)
    assert result.failed() and isinstance(result.result, ConfigError)


@pytest.fixture(scope="module")
def memory_app() -> Any:
    """An app on the in-memory broker: tasks can be defined and published, nothing runs."""
    app = Celery("badprops", broker="memory://", set_as_current=False)
    app.conf.redlock_url = "redis://127.0.0.1:1/1"
    app.finalize()  # tasks are then made when decorated, not lazily at first use
    yield app
    app.close()


TEMPLATES = st.text(alphabet="<>._:{} abuserid_org0", max_size=24)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(template=TEMPLATES)
@example(template="sync:<user_id")
@example(template="<>")
@example(template="a<b>c")
@example(template="<user_id.x.>")
@example(template="<org.name>")
@example(template="<org.missing>")
def test_a_key_template_is_accepted_and_renders_or_is_refused_naming_task_and_option(
    memory_app: Celery, template: str
) -> None:
    """Any lock_key text, at decoration and per call (apply_async(lock_key=...)): refused
    with a ConfigError naming the task and lock_key, or accepted and rendered to a
    non-empty name (or a ConfigError naming both when an argument lacks a field)."""
    task_name = f"props.template{next(_names)}"
    try:

        @memory_app.task(base=LockedTask, name=task_name, lock_key=template, shared=False)
        def f(user_id: Any, org: Any = None) -> None:
            """A task to hang the template on."""

    except ConfigError as exc:
        assert repr(task_name) in str(exc) and "lock_key" in str(exc), str(exc)
        event("refused at decoration")
    else:
        try:
            name = name_of(f, 7, org={"name": "acme"})
        except ConfigError as exc:
            assert repr(task_name) in str(exc) and "lock_key" in str(exc), str(exc)
            event("refused for the call")
        else:
            assert isinstance(name, str) and name
            event("rendered")
    carrier = memory_app.tasks.get(task_name) or _plain_task(memory_app)
    try:
        carrier.apply_async((7,), lock_key=template)
    except ConfigError as exc:
        assert repr(carrier.name) in str(exc) and "lock_key" in str(exc), str(exc)


def _plain_task(app: Celery) -> Any:
    name = "props.carrier"
    if name not in app.tasks:

        @app.task(base=LockedTask, name=name, shared=False)
        def carrier(user_id: Any, org: Any = None) -> None:
            """A task whose per-call key is checked at publish."""

    return app.tasks[name]


# -- task options ------------------------------------------------------------------------------
OPTION_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(),  # NaN, infinities, subnormals, 1e308
    st.sampled_from([0.0004, 0.001, 2**52 / 1000, 2**53, 1e300, -1e-9, 30]),
    st.sampled_from(["30", "retry", "skip", "wait", "raise", "warn", "", "RETRY"]),
    st.lists(st.integers(), max_size=2),
)
OPTIONS = sorted(set(TASK_OPTIONS) - {"lock_key"})


@pytest.fixture(scope="module")
def redis_app(shared_redis: RedisServer) -> Any:
    """An app whose locks live on the shared real server (db 5); eager runs only."""
    app = Celery("badprops-redis", broker="memory://", set_as_current=False)
    app.conf.redlock_url = f"redis://{shared_redis.host}:{shared_redis.port}/5"
    app.finalize()  # tasks are then made when decorated, not lazily at first use
    yield app
    app.close()


@ON_REDIS
@given(option=st.sampled_from(OPTIONS), value=OPTION_VALUES)
@example(option="lock_ttl", value=1e300)
@example(option="lock_ttl", value=0.0004)
@example(option="lock_ttl", value=0.002)  # shorter than its drift allowance: never valid
@example(option="lock_ttl", value=float("nan"))
@example(option="lock_max_hold", value=float("inf"))
@example(option="lock_wait_timeout", value=float("nan"))
@example(option="lock_retry_backoff", value=float("inf"))
def test_a_task_option_value_is_refused_naming_task_and_option_or_runs_locked(
    redis_app: Celery, shared_redis: RedisServer, option: str, value: Any
) -> None:
    """Every value of every LockedTask option: refused at decoration with a ConfigError
    naming the task, the option and what it must be; or accepted, and then an eager call
    runs under a lock on a real Redis (a fence), leaves no key behind, and the contention
    backoff it gives is a finite delay."""
    task_name = f"props.option{next(_names)}"
    fences: list[int | None] = []
    try:

        @redis_app.task(base=LockedTask, name=task_name, bind=True, shared=False, **{option: value})
        def f(self: Any) -> None:
            fences.append(self.lock.fence if self.lock is not None else None)

    except ConfigError as exc:
        message = str(exc)
        assert repr(task_name) in message and option in message and "must be" in message
        event("refused")
        return
    event("accepted")
    if option == "lock_ttl" and value < 0.1:
        # A lease of a few ms is valid, and may still run out before a loaded machine
        # confirms it ("answered too late"): its acceptance is what is shown here.
        return
    result = f.apply()
    assert result.successful(), result.traceback
    assert len(fences) == 1 and isinstance(fences[0], int)
    locks = shared_redis.client(db=5)
    assert not locks.exists(f"redlock:{{{task_name}}}")
    left = list(locks.scan_iter(f"redlock:{{{task_name}}}*"))
    assert left and all(locks.pttl(key) > 0 for key in left)  # what remains expires
    resolved = state_for(redis_app).options_for(f)
    for attempt in (0, 1, 10, 60):
        delay = backoff_delay(resolved, attempt)
        assert math.isfinite(delay) and delay >= 0


NUMERIC = ["lock_ttl", "lock_max_hold", "lock_wait_timeout", "lock_retry_backoff"]
NUMERIC += ["lock_retry_backoff_max"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("option", NUMERIC)
def test_a_non_finite_number_is_refused_for_every_numeric_option(
    memory_app: Celery, option: str, value: float
) -> None:
    """NaN and infinities are refused at decoration (NaN passed every "< 0" check; an
    infinite TTL or backoff failed only deep in a worker, without the task's name)."""
    task_name = f"props.nonfinite{next(_names)}"
    with pytest.raises(ConfigError) as caught:

        @memory_app.task(base=LockedTask, name=task_name, shared=False, **{option: value})
        def f() -> None:
            """Never defined."""

    assert repr(task_name) in str(caught.value) and option in str(caught.value)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("redlock_ttl", float("nan")),
        ("redlock_ttl", 1e300),
        ("redlock_ttl", 0.0004),
        ("redlock_beat_ttl", float("inf")),
        ("redlock_fence_ttl", float("nan")),
        ("redlock_wait_timeout", float("nan")),
        ("redlock_retry_backoff", float("inf")),
        ("redlock_retry_backoff_max", float("nan")),
    ],
)
def test_a_non_finite_or_unstorable_setting_is_refused_naming_it(
    setting: str, value: float
) -> None:
    """App settings get the same checks as the task options they default."""
    with pytest.raises(ConfigError) as caught:
        load_settings({"redlock_url": "redis://127.0.0.1:1/1", setting: value})
    assert setting in str(caught.value) and "must be" in str(caught.value)


# -- the core Lock's options ----------------------------------------------------------------------
PREFIXES = st.text(max_size=12) | st.sampled_from(["redlock:", "", "a*b?[c]:", "lock{", "x}"])
SECONDS = st.one_of(
    st.none(), st.floats(), st.integers(min_value=-5, max_value=10**18), st.text(max_size=3)
)
OWNER_INFO = st.none() | st.dictionaries(
    st.text(max_size=6) | st.integers() | st.tuples(st.integers()),
    st.text(max_size=6) | st.floats() | st.integers(),
    max_size=3,
)


@ON_REDIS
@given(
    name=st.text(min_size=0, max_size=300),
    ttl=SECONDS,
    prefix=PREFIXES,
    max_hold=SECONDS,
    fence_ttl=SECONDS,
    owner_info=OWNER_INFO,
)
@example(name="x", ttl=1e300, prefix="p:", max_hold=None, fence_ttl=None, owner_info=None)
@example(name="x", ttl=0.002, prefix="p:", max_hold=None, fence_ttl=None, owner_info=None)
@example(name="\ud800", ttl=5, prefix="p:", max_hold=None, fence_ttl=None, owner_info=None)
@example(name="x", ttl=5, prefix="p:", max_hold=None, fence_ttl=None, owner_info={(1,): "a"})
def test_core_lock_options_are_refused_or_give_a_working_lock_that_expires(
    shared_redis: RedisServer,
    name: str,
    ttl: Any,
    prefix: str,
    max_hold: Any,
    fence_ttl: Any,
    owner_info: Any,
) -> None:
    """Lock(...) with any name, TTL, prefix, max_hold, fence_ttl and owner_info: a
    ConfigError at construction, or a lock that acquires, extends and releases on a real
    Redis, whose key expires within its TTL while held and is gone after release."""
    client = shared_redis.client(db=6)
    options: dict[str, Any] = {"key_prefix": prefix, "max_hold": max_hold}
    options.update(fence_ttl=fence_ttl, owner_info=owner_info, auto_renew=False)
    kwargs = {k: v for k, v in options.items() if v is not None or k == "owner_info"}
    try:
        lock = Lock(client, name, 5.0 if ttl is None else ttl, **kwargs)
    except ConfigError:
        event("refused")
        return
    event("accepted")
    if lock.ttl < 0.1:  # see test_a_task_option_value_...: accepted, not run
        return
    try:
        assert lock.acquire(blocking=False)
    except StoreUnavailable:  # pragma: no cover - the shared server is up
        raise
    left = client.pttl(lock.keys.lock)
    assert 0 < left <= lock.ttl_ms
    lock.extend()
    assert 0 < client.pttl(lock.keys.lock) <= 2 * lock.ttl_ms
    lock.release()
    assert not client.exists(lock.keys.lock)
    client.delete(lock.keys.fence, lock.keys.notify, lock.keys.waiting)


# -- passwords never show ------------------------------------------------------------------------


def _refusal(url: str) -> str:
    """The error of a lock on *url* whose port nothing listens on (no password in it)."""
    try:
        Lock(connect(url, socket_connect_timeout=0.2), "pw", ttl=5).acquire(blocking=False)
    except (ConfigError, StoreUnavailable) as exc:
        return str(exc)
    raise AssertionError("a lock on a closed port was taken")  # pragma: no cover


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    password=st.text(
        alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=6, max_size=20
    ),
    user=st.sampled_from(["", "default", "app"]),
    raw=st.booleans(),
)
def test_a_password_never_shows_in_masked_urls_or_connection_errors(
    password: str, user: str, raw: bool
) -> None:
    """Whatever the password (raw "@", "/", ":" in it, or percent-quoted), mask_url hides
    it, and the error of a lock on a closed port does not show it."""
    secret = password if raw else quote(password, safe="")
    assume(password not in "127.0.0.1" and quote(password, safe="") not in "redis")
    port = free_port()
    url = f"redis://{user}:{secret}@127.0.0.1:{port}/0"
    masked = mask_url(url)
    assert password not in masked and quote(password, safe="") not in masked
    assert f"127.0.0.1:{port}/0" in masked or not raw
    # A password that is a word of the error's own text ("Connec") shows nothing secret.
    plain = _refusal(f"redis://127.0.0.1:{port}/0")
    assume(password not in plain and quote(password, safe="") not in plain)
    try:
        client = connect(url, socket_connect_timeout=0.2)
        Lock(client, "pw", ttl=5).acquire(blocking=False)
    except (ConfigError, StoreUnavailable) as exc:
        assert password not in str(exc) and quote(password, safe="") not in str(exc)
    else:  # pragma: no cover - nothing listens there
        raise AssertionError("a lock on a closed port was taken")


@pytest.fixture(autouse=True)
def _no_leftover_keys(shared_redis: RedisServer) -> Any:
    """Whatever these tests leave in their databases is removed (keys never outlive a test)."""
    yield
    for db in (5, 6):
        client = redis.Redis(host=shared_redis.host, port=shared_redis.port, db=db)
        client.flushdb()
        client.close()


def test_short_lived_failing_clients_never_deadlock_the_store_cache() -> None:
    """Hundreds of fresh clients whose acquire fails, each error kept for a while (its
    traceback holds the lock and its store: a reference cycle the garbage collector frees
    at any allocation, also while a new store is being registered): no thread hangs."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    errors: list[BaseException] = []

    def churn() -> None:
        for limit in (50, 7, 100, 13, 1):  # collections at many different allocations
            gc.set_threshold(limit)
            for _ in range(100):
                try:
                    client = connect(url, socket_connect_timeout=0.01)
                    Lock(client, "churn", ttl=5).acquire(blocking=False)
                except StoreUnavailable as exc:
                    errors[:] = [exc]

    threshold = gc.get_threshold()
    try:
        thread = threading.Thread(target=churn, daemon=True)
        thread.start()
        thread.join(60)
    finally:
        gc.set_threshold(*threshold)
    assert not thread.is_alive(), "a thread deadlocked creating a lock"
    assert isinstance(errors[0], StoreUnavailable)


@pytest.mark.parametrize("option", ["ttl", "fence_ttl", "max_hold"])
@pytest.mark.parametrize("seconds", [1.8e305, 1.7976931348623157e308, 2.0**53])
def test_a_huge_finite_number_of_seconds_is_a_config_error_naming_the_option(
    redis_client: redis.Redis, option: str, seconds: float
) -> None:
    """A float so large that seconds * 1000 is infinite (hypothesis found 1.8e305 for
    fence_ttl) is refused as too long, naming the option, not an OverflowError."""
    kwargs = {option: seconds} if option != "ttl" else {}
    with pytest.raises(ConfigError, match=f"{option} must be at most"):
        Lock(redis_client, "huge", seconds if option == "ttl" else 5.0, **kwargs)
