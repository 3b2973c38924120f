"""A ``lock_key`` template names the arguments of a call the way ``Signature.bind`` does.

For every call shape (positional, keyword, defaulted, ``*args``, ``**kwargs``,
positional-only), the rendered lock name is the template filled from
``bind`` + ``apply_defaults``; a call that ``bind`` refuses fails with ``bind``'s own
message, naming the task, before any lock is taken. No Redis is needed: rendering a
name reads the app's settings, it does not connect.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redlock import ConfigError, KeyTemplate, LockedTask
from celery_redlock.task.locked_task import lock_name_for


def f_plain(user_id, region="eu", *, dry=False, limit=10):  # type: ignore[no-untyped-def]
    """A typical task signature: positional, defaulted, keyword-only."""


def f_required_kwonly(a, b, *, c, d=4):  # type: ignore[no-untyped-def]
    """Keyword-only without a default."""


def f_none():  # type: ignore[no-untyped-def]
    """No arguments at all."""


def f_varargs(a, *rest):  # type: ignore[no-untyped-def]
    """*args."""


def f_varkw(a, **extra):  # type: ignore[no-untyped-def]
    """**kwargs: a template may name any keyword."""


def f_posonly(a, /, b):  # type: ignore[no-untyped-def]
    """Positional-only."""


CASES: list[tuple[Callable[..., Any], tuple[str, ...]]] = [
    (f_plain, ("user_id", "region", "dry")),
    (f_plain, ("limit",)),
    (f_required_kwonly, ("a", "c", "d")),
    (f_required_kwonly, ("b",)),
    (f_none, ()),
    (f_varargs, ("a",)),
    (f_varkw, ("a", "zzz")),
    (f_posonly, ("a", "b")),
]
NAMES = ["user_id", "region", "dry", "limit", "a", "b", "c", "d", "zzz"]


@pytest.fixture(scope="module")
def tasks() -> Iterator[dict[tuple[Callable[..., Any], tuple[str, ...]], Any]]:
    """One LockedTask per case, on an app whose lock Redis is never contacted."""
    app = Celery("binder", broker="memory://", set_as_current=False)
    app.conf.redlock_url = "redis://127.0.0.1:9/1"
    app.finalize()  # the decorator then returns the task itself, not a lazy proxy
    made = {}
    for number, (fun, fields) in enumerate(CASES):
        template = "k" + "".join(f":<{f}>" for f in fields)
        made[fun, fields] = app.task(
            base=LockedTask, shared=False, name=f"binder.t{number}", lock_key=template
        )(fun)
    try:
        yield made
    finally:
        app.close()


def expected_name(
    fun: Callable[..., Any], fields: tuple[str, ...], args: Any, kwargs: Any
) -> str | Exception:
    """The template filled from bind + apply_defaults, or the error bind or render raised."""
    sig = inspect.signature(fun)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        return exc
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.update(arguments.pop("extra", {}))  # f_varkw's **extra entries by name
    try:
        return KeyTemplate("k" + "".join(f":<{f}>" for f in fields)).render(arguments)
    except ConfigError as exc:  # a field only **kwargs could give, left out of the call
        return exc


@settings(max_examples=400, deadline=None)
@given(
    case=st.sampled_from(CASES),
    args=st.lists(st.integers(0, 9), max_size=5).map(tuple),
    kwargs=st.dictionaries(st.sampled_from(NAMES), st.integers(0, 9), max_size=4),
)
def test_lock_name_is_the_template_filled_as_signature_bind_names_the_arguments(
    tasks: dict[Any, Any], case: Any, args: tuple[int, ...], kwargs: dict[str, int]
) -> None:
    """The lock name equals the template rendered from bind's arguments; a call bind refuses
    raises bind's TypeError, prefixed with the task name."""
    fun, fields = case
    task = tasks[case]
    want = expected_name(fun, fields, args, kwargs)
    if isinstance(want, TypeError):
        with pytest.raises(TypeError) as info:
            lock_name_for(task, args, dict(kwargs))
        assert str(info.value) == f"{task.name}(): {want}"
    elif isinstance(want, ConfigError):
        with pytest.raises(ConfigError) as refused:
            lock_name_for(task, args, dict(kwargs))
        assert str(want) in str(refused.value) and repr(task.name) in str(refused.value)
    else:
        assert lock_name_for(task, args, dict(kwargs)) == want


def test_positional_keyword_and_defaulted_spellings_of_one_call_lock_one_name(
    tasks: dict[Any, Any],
) -> None:
    """f(7), f(user_id=7), f(7, "eu") and f(7, region="eu", dry=...) name one lock."""
    task = tasks[f_plain, ("user_id", "region", "dry")]
    names = {
        lock_name_for(task, (7,), {}),
        lock_name_for(task, (), {"user_id": 7}),
        lock_name_for(task, (7, "eu"), {}),
        lock_name_for(task, (7,), {"region": "eu", "dry": False, "limit": 3}),
    }
    assert names == {"k:7:eu:false"}


@pytest.fixture(scope="module")
def star_tasks() -> Iterator[dict[Callable[..., Any], Any]]:
    """One LockedTask per signature with ``lock_key="k:<*>"`` (every argument)."""
    app = Celery("binder-star", broker="memory://", set_as_current=False)
    app.conf.redlock_url = "redis://127.0.0.1:9/1"
    app.finalize()
    made = {}
    for number, fun in enumerate(dict.fromkeys(fun for fun, _ in CASES)):
        made[fun] = app.task(
            base=LockedTask, shared=False, name=f"binder.star{number}", lock_key="k:<*>"
        )(fun)
    try:
        yield made
    finally:
        app.close()


@settings(max_examples=400, deadline=None)
@given(
    fun=st.sampled_from(list(dict.fromkeys(fun for fun, _ in CASES))),
    args=st.lists(st.integers(0, 9), max_size=5).map(tuple),
    kwargs=st.dictionaries(st.sampled_from(NAMES), st.integers(0, 9), max_size=4),
)
def test_star_is_every_argument_as_bind_names_it(
    star_tasks: dict[Any, Any], fun: Any, args: tuple[int, ...], kwargs: dict[str, int]
) -> None:
    """``<*>`` renders every argument of the call, bound with defaults applied (``**kwargs``
    entries by name), as one JSON object with sorted keys: two calls share a name exactly
    when they bind to the same arguments."""
    task = star_tasks[fun]
    try:
        bound = inspect.signature(fun).bind(*args, **kwargs)
    except TypeError as exc:
        with pytest.raises(TypeError) as info:
            lock_name_for(task, args, dict(kwargs))
        assert str(info.value) == f"{task.name}(): {exc}"
        return
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.update(arguments.pop("extra", {}))
    want = "k:" + json.dumps(arguments, sort_keys=True, separators=(",", ":"))
    assert lock_name_for(task, args, dict(kwargs)) == want


def test_star_names_one_call_alike_however_it_is_spelt(star_tasks: dict[Any, Any]) -> None:
    """f(7), f(user_id=7) and f(7, "eu", dry=False) are one name under ``<*>``; another
    value of any argument is another name; a task without arguments renders ``{}``."""
    task = star_tasks[f_plain]
    names = {
        lock_name_for(task, (7,), {}),
        lock_name_for(task, (), {"user_id": 7}),
        lock_name_for(task, (7, "eu"), {"dry": False, "limit": 10}),
    }
    assert names == {'k:{"dry":false,"limit":10,"region":"eu","user_id":7}'}
    assert lock_name_for(task, (7,), {"limit": 11}) not in names
    assert lock_name_for(star_tasks[f_none], (), {}) == "k:{}"
