"""The fast argument binder behind ``lock_key`` templates agrees with ``inspect.Signature.bind``.

For every call shape, the fast binder must either give exactly the template fields
that ``bind`` + ``apply_defaults`` give, or decline (None) so the slow path runs;
it must decline every call ``bind`` refuses, so a bad call still fails with
``bind``'s own message before any lock is taken.
"""

from __future__ import annotations

import inspect
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redlock.task import _make_binder


def f_plain(user_id, region="eu", *, dry=False, limit=10):  # type: ignore[no-untyped-def]
    """A typical task signature: positional, defaulted, keyword-only."""


def f_required_kwonly(a, b, *, c, d=4):  # type: ignore[no-untyped-def]
    """Keyword-only without a default."""


def f_none():  # type: ignore[no-untyped-def]
    """No arguments at all."""


def f_varargs(a, *rest):  # type: ignore[no-untyped-def]
    """*args: no fast binder."""


def f_varkw(a, **extra):  # type: ignore[no-untyped-def]
    """**kwargs: no fast binder."""


def f_posonly(a, /, b):  # type: ignore[no-untyped-def]
    """Positional-only: no fast binder."""


CASES = [
    (f_plain, ("user_id", "region", "dry")),
    (f_plain, ("limit",)),
    (f_required_kwonly, ("a", "c", "d")),
    (f_required_kwonly, ("b",)),
    (f_none, ()),
]
NAMES = ["user_id", "region", "dry", "limit", "a", "b", "c", "d", "zzz"]


def slow_fields(sig: inspect.Signature, fields: tuple[str, ...], args: Any, kwargs: Any) -> Any:
    """What bind + apply_defaults give for *fields*, or the TypeError it raised."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        return exc
    bound.apply_defaults()
    return {f: bound.arguments[f] for f in fields}


@settings(max_examples=400, deadline=None)
@given(
    case=st.sampled_from(CASES),
    args=st.lists(st.integers(0, 9), max_size=5).map(tuple),
    kwargs=st.dictionaries(st.sampled_from(NAMES), st.integers(0, 9), max_size=4),
)
def test_fast_binder_matches_signature_bind_or_declines(
    case: Any, args: tuple[int, ...], kwargs: dict[str, int]
) -> None:
    """Fast result == bind's fields whenever it answers; None whenever bind raises."""
    fun, fields = case
    sig = inspect.signature(fun)
    binder = _make_binder(sig, fields)
    assert binder is not None
    fast = binder(args, dict(kwargs))
    slow = slow_fields(sig, fields, args, kwargs)
    if isinstance(slow, TypeError):
        assert fast is None, (
            f"{fun.__name__}{args}{kwargs}: bind refused ({slow}), fast gave {fast}"
        )
    else:
        assert fast is not None, f"{fun.__name__}{args}{kwargs}: fast declined a valid call"
        assert fast == slow


def test_common_calls_take_the_fast_path() -> None:
    """Positional, keyword and defaulted spellings of one call all bind fast, to one value."""
    binder = _make_binder(inspect.signature(f_plain), ("user_id", "region"))
    assert binder is not None
    want = {"user_id": 7, "region": "eu"}
    assert binder((7,), {}) == want
    assert binder((), {"user_id": 7}) == want
    assert binder((7, "eu"), {}) == want
    assert binder((7,), {"region": "eu", "dry": True}) == want


def test_signatures_with_star_args_or_positional_only_get_no_fast_binder() -> None:
    """*args, **kwargs and positional-only parameters are left to Signature.bind."""
    for fun in (f_varargs, f_varkw, f_posonly):
        assert _make_binder(inspect.signature(fun), ("a",)) is None
