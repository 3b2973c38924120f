"""The Lua scripts' shared parts (``owner_of.lua``, ``fence_floor.lua``, ``index.lua``):
every script the Redis backend sends defines each shared function it calls, once and
before the first call; a script with flags keeps them on its first line. Read from the
sources, no server."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from celery_redlock.core.backends.redis import scripts
from celery_redlock.core.backends.redis.scripts import Script

LUA = resources.files("celery_redlock.core.backends.redis").joinpath("lua")
SHARED = sorted(
    path.name.removesuffix(".lua")
    for path in LUA.iterdir()
    if path.name.endswith(".lua") and "a shared part" in path.read_text("utf-8").split("\n")[0]
)
SENT = {name: value for name, value in vars(scripts).items() if isinstance(value, Script)}


def test_the_shared_parts_are_found() -> None:
    """The scan sees both parts (it would pass vacuously otherwise)."""
    assert SHARED == ["fence_floor", "index", "owner_of"]
    assert len(SENT) >= 20


@pytest.mark.parametrize("name", sorted(SENT))
def test_each_script_defines_the_shared_functions_it_calls(name: str) -> None:
    """A script calling owner_of(...) or fence_floor(...) has its local function in
    front, once, and before the first call (also behind the Sentinel guard)."""
    for source in (SENT[name].source, SENT[name].guarded.source):
        code = "\n".join(line.split("--")[0] for line in source.split("\n"))
        for part in SHARED:
            defined = [m.start() for m in re.finditer(rf"local function {part}\(", code)]
            calls = [m.start() for m in re.finditer(rf"(?<!function ){part}\(", code)]
            if calls:
                assert len(defined) == 1, f"{name}: {part} defined {len(defined)} times"
                assert defined[0] < calls[0], f"{name}: {part} called before it is defined"
            else:
                assert not defined, f"{name}: {part} put in front but never called"


def test_a_script_with_flags_keeps_them_on_its_first_line() -> None:
    """Redis reads a script's flags (#!lua) from its first line only: the parts put in
    front of such a script go after that line, in every variant."""
    built = Script("extend_node.lua", uses=("owner_of.lua",))
    for script in (scripts.EXTEND_NODE, built, built.guarded, scripts.EXTEND_NODE.indexed):
        assert script.source.startswith("#!lua flags=allow-cross-slot-keys")
        assert script.source.count("#!lua") == 1


INDEX_FUNCTIONS = (
    "index_put",
    "index_lock",
    "index_renew",
    "index_drop",
    "index_gone",
    "index_sync",
)


@pytest.mark.parametrize("name", sorted(SENT))
def test_a_script_writes_the_index_only_in_its_indexed_variant(name: str) -> None:
    """A script calling the index's functions has index.lua in front, with INDEX false as
    it is (a cluster's) and true as :attr:`Script.indexed` (also behind the Sentinel
    guard); a script that calls none is its own indexed variant."""
    script = SENT[name]
    code = "\n".join(line.split("--")[0] for line in script.source.split("\n"))
    calls = any(re.search(rf"(?<!function ){fn}\(", code) for fn in INDEX_FUNCTIONS)
    if not calls:
        assert script.indexed is script and "local INDEX" not in code
        return
    assert code.count("local INDEX = false") == 1 and "local INDEX = true" not in code
    for variant in (script.indexed, script.indexed.guarded):
        lines = "\n".join(line.split("--")[0] for line in variant.source.split("\n"))
        assert lines.count("local INDEX = true") == 1 and "local INDEX = false" not in lines
        assert variant.sha != script.sha


def _code(source: str) -> str:
    return "\n".join(line.split("--")[0] for line in source.split("\n"))


@pytest.mark.parametrize("name", sorted(SENT))
def test_a_script_carries_only_the_shared_definitions_it_uses(name: str) -> None:
    """Redis runs a script's whole text at every call, so a shared part's local function
    costs its closure whether called or not: each function a script defines from a shared
    part is called by the script (or by another function it keeps), once defined and
    before the first call; every function it calls is defined."""
    shared = {
        fn
        for part in SHARED
        for fn in re.findall(
            r"(?m)^local function (\w+)\(", LUA.joinpath(f"{part}.lua").read_text()
        )
    }
    assert {"index_gone", "index_sweep", "owner_of", "fence_floor"} <= shared
    for variant in (SENT[name], SENT[name].indexed, SENT[name].indexed.guarded):
        code = _code(variant.source)
        defined = [fn for fn in re.findall(r"local function (\w+)\(", code) if fn in shared]
        assert len(defined) == len(set(defined)), f"{name}: a shared function defined twice"
        for fn in defined:
            at = code.index(f"local function {fn}(")
            calls = [m.start() for m in re.finditer(rf"(?<![\w.]){fn}\(", code)]
            calls = [c for c in calls if not code[max(0, c - 15) : c].endswith("function ")]
            assert calls, f"{name}: {fn} is defined but never called"
            assert at < calls[0], f"{name}: {fn} called before it is defined"
        for fn in set(re.findall(r"(?<![\w.:])(index_\w+|owner_of|fence_floor)\(", code)):
            assert fn in defined, f"{name}: {fn} called but not defined"


def test_the_release_script_leaves_out_what_it_does_not_call() -> None:
    """The release calls index_gone (which reads index_head and index_state) and nothing
    else of index.lua: the sweep, the timed sets and the put are not in its text."""
    code = _code(scripts.RELEASE.indexed.source)
    assert "local function index_gone(" in code and "local function index_state(" in code
    for absent in ("index_sweep", "index_put", "index_timed", "index_lock", "index_at"):
        assert f"local function {absent}(" not in code, absent
